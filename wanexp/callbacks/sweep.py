"""Sweeps: the job list at the start, one line per finished point, and a summary at the end (a Hydra callback).

``conf/hydra/default.yaml`` registers :class:`SweepSummary` as ``hydra.callbacks.sweep``, so every multirun
(``python train.py -m sweep=rank_lr``, ``-m adapter.rank=8,16``, an Optuna search) gets:

- at the start, the grid's points (BasicSweeper) or the search space (other sweepers);
- after each point, its final loss; for sweepers that optimise (Optuna) that value is the point's objective
  (``val/loss`` when the run logs it, else the final train loss);
- at the end (also when a point stopped the sweep), in the sweep folder: ``summary.csv`` and ``summary.md`` (one row
  per point: swept values, state, steps, final train loss, validation loss when present, samples/s, time, folder),
  ``loss.png`` (train loss vs step, one line per point) and, for a rank x lr grid, ``heatmap.png`` (final loss).

The same summary is rewritten by ``python -m wanexp.callbacks.sweep SWEEP_DIR`` (e.g. for a SLURM sweep whose jobs
ended elsewhere). Points are read from their run folders only (config.yaml, status.json, status.jsonl).
"""
from __future__ import annotations

import atexit
import csv
import json
import math
import statistics
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

FINAL_WINDOW = 5  # the final train loss is the mean of the last this-many logged values (one value is noisy)
COLUMNS = ("point", "overrides", "state", "step", "total_steps", "final_train_loss", "val_loss", "best_val_loss",
           "samples_per_s", "elapsed_s", "run_dir")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _history(run: Path) -> list[dict]:
    """status.jsonl, one entry per logged step (the training and validation lines of a step merged; the last value
    wins for a key logged twice, e.g. by a resumed run)."""
    by_step: dict[int, dict] = {}
    try:
        lines = (run / "status.jsonl").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            entry = json.loads(line)
            # a step's training line and its validation line are merged; a key logged twice: the last one wins
            by_step.setdefault(int(entry["step"]), {}).update(entry)
        except (ValueError, KeyError, TypeError):
            continue
    return [by_step[s] for s in sorted(by_step)]


def _overrides(run: Path) -> list[str]:
    import yaml

    for path, key in ((run / "config.yaml", "overrides"), (run / ".hydra" / "overrides.yaml", None)):
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            continue
        values = data.get(key) if key and isinstance(data, dict) else data
        if isinstance(values, list):
            return [str(v) for v in values]
    return []


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def point_row(run: Path) -> dict:
    """One sweep point's summary, from its run folder."""
    status, history = _read_json(run / "status.json"), _history(run)
    losses = _finite(h.get("loss") for h in history)
    vals = _finite(h.get("val_loss") for h in history) or _finite([status.get("val_loss")])
    speeds = _finite(h.get("samples_per_s") for h in history)
    final = statistics.fmean(losses[-FINAL_WINDOW:]) if losses else (_finite([status.get("loss")]) or [None])[0]
    state = status.get("state") or "not started"
    return {"point": run.name, "overrides": _overrides(run), "state": state, "step": status.get("step"),
            "total_steps": status.get("total_steps"), "final_train_loss": final,
            "val_loss": vals[-1] if vals else None, "best_val_loss": min(vals) if vals else None,
            "samples_per_s": statistics.median(speeds) if speeds else status.get("samples_per_s"),
            "elapsed_s": status.get("elapsed_s"), "run_dir": str(run), "history": history}


def sweep_points(sweep_dir: Path) -> list[Path]:
    """The run folders of a sweep (Hydra's job folders 0, 1, ...; or any child folder that holds a run)."""
    runs = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and
            ((p / "status.json").exists() or (p / "config.yaml").exists() or (p / ".hydra").exists())]
    return sorted(runs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def _swept(rows: list[dict]) -> list[str]:
    """Override keys whose values differ between points, in command-line order."""
    values: dict[str, set] = {}
    for row in rows:
        for o in row["overrides"]:
            k, _, v = o.partition("=")
            values.setdefault(k, set()).add(v)
    return [k for k, vs in values.items() if len(vs) > 1 or len(rows) == 1]


def _label(row: dict, keys: list[str]) -> str:
    pairs = dict(o.split("=", 1) for o in row["overrides"] if "=" in o)
    return " ".join(f"{k.rpartition('.')[2]}={pairs[k]}" for k in keys if k in pairs) or row["point"]


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def objective(row: dict) -> float | None:
    """What a sweep minimises: the validation loss when the run logs one, else the final train loss."""
    for key in ("val_loss", "final_train_loss"):
        if row.get(key) is not None:
            return float(row[key])
    return None


def write_summary(sweep_dir: Path) -> dict[str, Path]:
    """summary.csv, summary.md, loss.png and (rank x lr) heatmap.png in the sweep folder; returns what it wrote."""
    sweep_dir = Path(sweep_dir)
    rows = [point_row(p) for p in sweep_points(sweep_dir)]
    if not rows:
        return {}
    keys = _swept(rows)
    written = {"csv": sweep_dir / "summary.csv", "md": sweep_dir / "summary.md"}
    with open(written["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*keys, *COLUMNS])
        for row in rows:
            pairs = dict(o.split("=", 1) for o in row["overrides"] if "=" in o)
            w.writerow([*(pairs.get(k, "") for k in keys),
                        *(" ".join(row[c]) if c == "overrides" else _fmt(row[c]) for c in COLUMNS)])
    best = min((r for r in rows if objective(r) is not None), key=objective, default=None)
    shown = ("point", *keys, "state", "step", "final_train_loss", "val_loss", "samples_per_s", "elapsed_s")
    lines = [f"# Sweep {sweep_dir.name}: {len(rows)} points", "",
             f"Final train loss: the mean of the last {FINAL_WINDOW} logged values; val_loss is empty until the runs "
             "log one. Best (lowest validation loss, else final train loss) in bold.", "",
             "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for row in rows:
        pairs = dict(o.split("=", 1) for o in row["overrides"] if "=" in o)
        cells = [row["point"], *(pairs.get(k, "") for k in keys), *(_fmt(row[c]) for c in shown[1 + len(keys):])]
        if row is best:
            cells = [f"**{c}**" if c else c for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    written["md"].write_text("\n".join(lines) + "\n")
    written.update(_plots(sweep_dir, rows, keys))
    return written


def _plots(sweep_dir: Path, rows: list[dict], keys: list[str]) -> dict[str, Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("wanexp: sweep: matplotlib is not installed; no plots (pip install matplotlib)", flush=True)
        return {}
    out = {}
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in rows:
        pts = [(h["step"], h["loss"]) for h in row["history"] if h.get("loss") is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o" if len(pts) < 20 else None, markersize=3, label=_label(row, keys))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss")
    ax.set_title(f"sweep {sweep_dir.name}: train loss per point")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8, ncol=2 if len(rows) > 8 else 1)
    fig.tight_layout()
    out["loss"] = sweep_dir / "loss.png"
    fig.savefig(out["loss"], dpi=110)
    plt.close(fig)

    rank_key = next((k for k in keys if k.endswith(".rank")), None)
    lr_key = next((k for k in keys if k.endswith(".lr")), None)
    if rank_key and lr_key:
        grid: dict[tuple[str, str], float] = {}
        use_val = all(r["val_loss"] is not None for r in rows)
        for row in rows:
            pairs = dict(o.split("=", 1) for o in row["overrides"] if "=" in o)
            value = row["val_loss"] if use_val else row["final_train_loss"]
            if rank_key in pairs and lr_key in pairs and value is not None:
                grid[(pairs[rank_key], pairs[lr_key])] = value
        ranks = sorted({r for r, _ in grid}, key=float)
        lrs = sorted({lr for _, lr in grid}, key=float)
        if grid:
            import numpy as np

            z = np.array([[grid.get((r, lr), np.nan) for lr in lrs] for r in ranks])
            fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(lrs), 1.2 + 0.8 * len(ranks)))
            im = ax.imshow(z, cmap="viridis_r", aspect="auto")
            ax.set_xticks(range(len(lrs)), lrs)
            ax.set_yticks(range(len(ranks)), ranks)
            ax.set_xlabel(lr_key)
            ax.set_ylabel(rank_key)
            lo, hi = np.nanmin(z), np.nanmax(z)
            for i in range(len(ranks)):
                for j in range(len(lrs)):
                    if np.isfinite(z[i, j]):  # dark text on the light (low-loss) cells
                        light = hi == lo or (z[i, j] - lo) / (hi - lo) < 0.5
                        ax.text(j, i, f"{z[i, j]:.4g}", ha="center", va="center", fontsize=9,
                                color="black" if light else "white")
            what = "validation loss" if use_val else f"final train loss (last {FINAL_WINDOW} logged)"
            ax.set_title(f"{sweep_dir.name}: {what}", fontsize=10)
            fig.colorbar(im, ax=ax)
            fig.tight_layout()
            out["heatmap"] = sweep_dir / "heatmap.png"
            fig.savefig(out["heatmap"], dpi=110)
            plt.close(fig)
    return out


def grid_points(sweeper_params: dict, command_line: list[str]) -> list[list[str]] | None:
    """The points BasicSweeper will run (its rule: the sweep config's params, then the command line, a later value of
    a key replacing an earlier one), only the swept keys; None when a value is not a plain list."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    keys: dict[str, list[str]] = {}
    for o in parser.parse_overrides([f"{k}={v}" for k, v in sweeper_params.items()] + list(command_line)):
        key = o.get_key_element()
        if o.is_sweep_override():
            if not o.is_discrete_sweep():
                return None
            keys[key] = [f"{key}={v}" for v in o.sweep_string_iterator()]
        else:
            keys.pop(key, None)  # one value on the command line: no longer swept
    import itertools

    return [list(p) for p in itertools.product(*keys.values())] if keys else []


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks.sweep``): see the module docstring."""

    def __init__(self):
        self.sweep_dir: Path | None = None
        self.done = 0

    def on_multirun_start(self, config, **kwargs) -> None:
        from omegaconf import OmegaConf

        self.sweep_dir = Path(config.hydra.sweep.dir).resolve()
        params = OmegaConf.to_container(config.hydra.sweeper.get("params") or {}, resolve=False)
        sweeper = str(config.hydra.sweeper.get("_target_", ""))
        points = grid_points(params, list(config.hydra.overrides.task)) if "BasicSweeper" in sweeper else None
        if points is not None:
            print(f"wanexp: sweep: {len(points)} points, run folders {self.sweep_dir}/<n>", flush=True)
            for i, point in enumerate(points):
                print(f"wanexp: sweep:   {i}: {' '.join(point) or '(no swept values)'}", flush=True)
        else:
            print(f"wanexp: sweep: {sweeper.rpartition('.')[2]} over {params}; run folders {self.sweep_dir}/<n>",
                  flush=True)
        atexit.register(self._summarize)  # also when a point stops the sweep (its exit skips on_multirun_end)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        if not str(config.hydra.mode).endswith("MULTIRUN") or self.sweep_dir is None:
            return
        row = point_row(Path(config.hydra.runtime.output_dir))
        self.done += 1
        value = objective(row)
        print(f"wanexp: sweep: point {row['point']} {row['state']} at step {row['step']}: "
              f"loss {_fmt(value) or 'n/a'}", flush=True)
        if getattr(job_return, "status", None) is not None and job_return.status.name == "COMPLETED" \
                and job_return.return_value is None:
            job_return.return_value = value  # the objective of an optimising sweeper (Optuna)

    def on_multirun_end(self, config, **kwargs) -> None:
        self._summarize()

    def _summarize(self) -> None:
        if self.sweep_dir is None:
            return
        sweep_dir, self.sweep_dir = self.sweep_dir, None  # once
        written = write_summary(sweep_dir)
        if written:
            print(f"wanexp: sweep summary: {', '.join(str(p) for p in written.values())}", flush=True)
            print(written["md"].read_text(), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m wanexp.callbacks.sweep SWEEP_DIR  (writes summary.csv/.md and plots there)",
              file=sys.stderr)
        return 2
    written = write_summary(Path(args[0]))
    for p in written.values():
        print(p)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
