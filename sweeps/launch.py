"""Run a sweep's grid one point at a time, each point on several GPUs (torchrun), or print the commands.

Hydra's multirun runs points inside one process, which cannot host a multi-GPU point (Lightning would relaunch the
whole sweep in every rank). This launcher expands the same grid (the sweep config's ``hydra.sweeper.params`` plus
any ``key=a,b`` on the command line) and starts one ``torchrun ... train.py`` per point, with explicit run names and
folders (``outputs/sweeps/<sweep>/<n>``), the sweep config applied to every point (its name: the W&B group; alpha
tied to rank) and, at the end, the same summary (summary.csv/.md, loss.png, heatmap.png) as a Hydra multirun. A point
that does not finish (refused, or failed once started) does not stop the others (``--stop-on-failure`` does): its
state and its ``wanexp: error:`` line go to the sweep folder's points.jsonl and the summary; the launcher then exits
with the first such point's code.
For one SLURM job per point use Hydra's launcher instead: ``python train.py -m sweep=rank_lr hydra/launcher=slurm``.

    python sweeps/launch.py sweep=rank_lr --nproc 8 model.path=/models/Wan2.2-TI2V-5B-Diffusers
    python sweeps/launch.py sweep=rank_lr --dry-run ...        # print the commands (e.g. for sbatch)
"""
from __future__ import annotations

import argparse
import itertools
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: wanexp is importable from the repo root


def split_values(value: str) -> list[str]:
    """Hydra's simple sweep syntax ``a,b,c`` (no ranges or choice() here)."""
    return [v.strip() for v in str(value).split(",") if v.strip()]


def expand(overrides: list[str]) -> tuple[str, list[str], list[list[str]]]:
    """-> (sweep name, fixed overrides, one list of ``key=value`` per grid point)."""
    from omegaconf import OmegaConf

    from wanexp.config import compose

    sweep = next((o.split("=", 1)[1] for o in overrides if o.startswith("sweep=")), None)
    given = {o.partition("=")[0]: o.partition("=")[2] for o in overrides if not o.startswith("sweep=")}
    grid: dict[str, list[str]] = {}
    if sweep:
        cfg = compose([f"sweep={sweep}"], return_hydra_config=True)
        for key, value in OmegaConf.to_container(cfg.hydra.sweeper.params or {}).items():
            grid[key] = split_values(given.pop(key, value))  # the command line narrows the sweep's own grid
    fixed = []
    for key, value in given.items():
        if "," in value and not value.startswith(("[", "{")):
            grid[key] = split_values(value)
        else:
            fixed.append(f"{key}={value}")
    keys = list(grid)
    points = [[f"{k}={v}" for k, v in zip(keys, combo)] for combo in itertools.product(*(grid[k] for k in keys))]
    return sweep or "multirun", fixed, points


def commands(overrides: list[str], nproc: int, nnodes: int, torchrun_args: str = "",
             python: str = sys.executable, expanded: tuple | None = None) -> list[list[str]]:
    """Each point's torchrun command; ``expanded``: ``expand(overrides)`` when the caller has it already."""
    sweep, fixed, points = expanded or expand(overrides)
    out = []
    for i, point in enumerate(points):
        name = f"{sweep}/{i}_" + ",".join(point)
        # the sweep config itself (its name, alpha tied to rank, ...) in single-run mode, this point's values on top
        sweep_cfg = [f"sweep={sweep}", "hydra.mode=RUN"] if sweep != "multirun" else [f"+sweep.name={sweep}"]
        out.append([python, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}",
                    *shlex.split(torchrun_args), str(ROOT / "train.py"), *sweep_cfg, *fixed, *point,
                    f"run_name='{name}'",
                    f"paths.output_dir=${{paths.root_dir}}/outputs/sweeps/{sweep}/{i}", f"trainer.num_nodes={nnodes}"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per node for each point")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--torchrun-args", default="", help='extra torchrun arguments, e.g. "--rdzv-endpoint=host:29500"')
    ap.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    ap.add_argument("--stop-on-failure", action="store_true",
                    help="stop at the first point that does not finish (by default the other points still run)")
    args, overrides = ap.parse_known_args(argv)
    if args.dry_run:
        for cmd in commands(overrides, args.nproc, args.nnodes, args.torchrun_args):
            print(shlex.join(cmd), flush=True)
        return 0
    from wanexp.callbacks.sweep import record_point

    expanded = expand(overrides)
    sweep, _, points = expanded
    folder, codes = sweep_folder(sweep, overrides), []
    cmds = commands(overrides, args.nproc, args.nnodes, args.torchrun_args, expanded=expanded)
    for i, (cmd, point) in enumerate(zip(cmds, points)):
        print(shlex.join(cmd), flush=True)
        config = folder / str(i) / "config.yaml"  # written once a run starts: a refused point leaves it as it was
        before = config.stat().st_mtime_ns if config.exists() else None
        rc, line = run_point(cmd)
        codes.append(rc)
        after = config.stat().st_mtime_ns if config.exists() else None
        state = "finished" if rc == 0 else "refused" if after == before else "failed"
        folder.mkdir(parents=True, exist_ok=True)
        record_point(folder, str(i), point, state, None if rc == 0 else line or f"exit code {rc}")
        if rc and args.stop_on_failure:
            print(f"sweep point {i} {state} (exit {rc}); stopping (--stop-on-failure)", file=sys.stderr)
            break
    _summarize(folder, points)
    stopped = [c for c in codes if c]
    if stopped:
        print(f"{len(stopped)} of {len(codes)} sweep point(s) did not finish; their reasons: {folder}/summary.md",
              file=sys.stderr)
    return stopped[0] if stopped else 0


def run_point(cmd: list[str]) -> tuple[int, str | None]:
    """Run one point's command, its stderr passed through as it comes (a progress bar too): (its exit code, the last
    ``wanexp: error:`` line it printed, without the prefix; None when it printed none)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE)
    tail = b""
    while chunk := proc.stderr.read1(65536):
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
        tail = (tail + chunk)[-65536:]
    said = [ln for ln in tail.decode(errors="replace").splitlines() if ln.startswith("wanexp: error: ")]
    return proc.wait(), said[-1][len("wanexp: error: "):] if said else None


def sweep_folder(sweep: str, overrides: list[str]) -> Path:
    """outputs/sweeps/<sweep> under the command line's paths.root_dir: where the points' folders are."""
    from wanexp.config import compose

    cfg = compose([o for o in overrides if o.startswith("paths.")] + ["run_name=x"])
    folder = Path(cfg.paths.root_dir)
    return (folder if folder.is_absolute() else ROOT / folder) / "outputs" / "sweeps" / sweep


def _summarize(folder: Path, points: list[list[str]]) -> None:
    """summary.csv/.md and the plots in the sweep folder, as a Hydra multirun writes them (every point listed)."""
    from wanexp.callbacks.sweep import write_summary

    written = write_summary(folder, points) if folder.is_dir() else {}
    if written:
        print(f"sweep summary: {', '.join(str(p) for p in written.values())}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
