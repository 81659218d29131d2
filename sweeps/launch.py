"""Run a sweep's grid one point at a time, each point on several GPUs (torchrun), or print the commands.

Hydra's multirun runs points inside one process, which cannot host a multi-GPU point (Lightning would relaunch the
whole sweep in every rank). This launcher expands the same grid (the sweep config's ``hydra.sweeper.params`` plus
any ``key=a,b`` on the command line) and starts one ``torchrun ... train.py`` per point, with explicit run names and
folders (``outputs/sweeps/<sweep>/<n>``), the sweep config applied to every point (its name: the W&B group; alpha
tied to rank) and, at the end, the same summary (summary.csv/.md, loss.png, heatmap.png) as a Hydra multirun.
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
             python: str = sys.executable) -> list[list[str]]:
    sweep, fixed, points = expand(overrides)
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
    ap.add_argument("--keep-going", action="store_true", help="run the remaining points when one fails")
    args, overrides = ap.parse_known_args(argv)
    failed = []
    for cmd in commands(overrides, args.nproc, args.nnodes, args.torchrun_args):
        print(shlex.join(cmd), flush=True)
        if args.dry_run:
            continue
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc:
            failed.append(cmd)
            if not args.keep_going:
                print(f"sweep point failed (exit {rc}); stopping (use --keep-going to run the rest)", file=sys.stderr)
                return rc
    if not args.dry_run:
        _summarize(overrides)
    if failed:
        print(f"{len(failed)} sweep point(s) failed", file=sys.stderr)
        return 1
    return 0


def _summarize(overrides: list[str]) -> None:
    """summary.csv/.md and the plots in the sweep folder, as a Hydra multirun writes them."""
    from wanexp.callbacks.sweep import write_summary
    from wanexp.config import compose

    sweep = expand(overrides)[0]
    cfg = compose([o for o in overrides if o.startswith("paths.")] + ["run_name=x"])
    folder = Path(cfg.paths.root_dir)
    folder = (folder if folder.is_absolute() else ROOT / folder) / "outputs" / "sweeps" / sweep
    written = write_summary(folder) if folder.is_dir() else {}
    if written:
        print(f"sweep summary: {', '.join(str(p) for p in written.values())}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
