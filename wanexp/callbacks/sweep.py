"""Sweeps: the job list at the start, one line per finished point, and a summary at the end (a Hydra callback).

``conf/hydra/default.yaml`` registers :class:`SweepSummary` as ``hydra.callbacks.sweep``, so every multirun
(``python train.py -m sweep=rank_lr``, ``-m adapter.rank=8,16``, an Optuna search) gets:

- at the start, the grid's points (BasicSweeper) or the search space (other sweepers); a sweep whose point folders
  hold checkpoints of an earlier sweep (and neither resume nor overwrite) is refused here, before anything is written;
- after each point, its loss, named: ``val/loss`` when the run logs it, else the train loss averaged over its last
  logged steps; for sweepers that optimise (Optuna) that value is the point's objective. A point that does not
  finish (refused: its one line, nothing written; or failed once started) does not stop the sweep: its state and
  reason go to ``points.jsonl`` in the sweep folder, and the next point runs;
- after each point and at the end, in the sweep folder: ``summary.csv`` and ``summary.md`` (one row per point of the
  grid, run or not: swept values, state and reason, steps, final train loss, validation loss when present, samples/s,
  time, folder; the metric it ranks by named), ``loss.png`` (train loss vs step, one line per point) and, for a rank
  x lr grid, ``heatmap.png`` (the ranking loss, green = lower = better). A sweep whose every point was refused puts
  the sweep folder's files back as they were (a new sweep folder goes).

The swept keys are the sweep config's ``hydra.sweeper.params`` (``sweep=rank_lr``) and the command line's sweep
overrides (``adapter.rank=16,32``), read from the sweep folder's multirun.yaml. The same summary is rewritten by
``python -m wanexp.callbacks.sweep SWEEP_DIR`` (e.g. for a SLURM sweep whose jobs ended elsewhere). Points are read
from their run folders (config.yaml, status.json, status.jsonl).
"""
from __future__ import annotations

import atexit
import csv
import json
import math
import statistics
import sys
import textwrap
import time
from pathlib import Path

from hydra.experimental.callback import Callback

from wanexp.callbacks.loss_plot import loss_figure, pyplot, run_history
from wanexp.errors import say_error

RECORDS = "points.jsonl"  # in the sweep folder: each point's outcome (state, reason), one line per point run
SWEEP_FILES = ("multirun.yaml", RECORDS, "summary.csv", "summary.md", "loss.png", "heatmap.png")
FINAL_WINDOW = 5  # the final train loss is the mean of the last this-many logged values (one value is noisy)
COLUMNS = ("point", "overrides", "state", "reason", "step", "total_steps", "final_train_loss", "val_loss",
           "best_val_loss", "samples_per_s", "elapsed_s", "run_dir")
# The names the console, summary.md and the plots give the two losses a point has (a run's status.json "loss" is a
# third: the train loss of the last logged step, shown by wanexp-status as such).
TRAIN_LOSS = f"train loss (mean of last {FINAL_WINDOW} logged steps)"
VAL_LOSS = "val/loss"
METRIC_NAMES = {"final_train_loss": TRAIN_LOSS, "val_loss": VAL_LOSS}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


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


class PointStopped(Exception):
    """A sweep point that did not finish, raised by wanexp.train.cli in a multirun instead of exiting, so that Hydra
    records it (a failed job) and runs the next point: ``state`` refused (nothing written) or failed (it had
    started), ``line`` its one line, ``code`` its exit code (the sweep's, once every point ran)."""

    def __init__(self, state: str, line: str, code: int):
        super().__init__(line)
        self.state, self.line, self.code = state, line, code


def record_point(sweep_dir: Path, point: str, overrides: list[str], state: str, reason: str | None) -> None:
    """One point's outcome, appended to the sweep folder's points.jsonl."""
    entry = {"point": point, "overrides": overrides, "state": state, "reason": reason, "time": time.time()}
    with open(Path(sweep_dir) / RECORDS, "a") as f:
        f.write(json.dumps(entry) + "\n")


def point_records(sweep_dir: Path) -> dict[str, dict]:
    """Each point's last recorded outcome (points.jsonl: a point run again counts as its last run)."""
    try:
        lines = (Path(sweep_dir) / RECORDS).read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        try:
            entry = json.loads(line)
            out[str(entry["point"])] = entry
        except (ValueError, KeyError, TypeError):
            continue
    return out


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def point_row(run: Path) -> dict:
    """One sweep point's summary, from its run folder."""
    status, history = _read_json(run / "status.json"), run_history(run)
    losses = _finite(h.get("loss") for h in history)
    vals = _finite(h.get("val_loss") for h in history) or _finite([status.get("val_loss")])
    speeds = _finite(h.get("samples_per_s") for h in history)
    final = statistics.fmean(losses[-FINAL_WINDOW:]) if losses else (_finite([status.get("loss")]) or [None])[0]
    state = status.get("state") or "not started"
    return {"point": run.name, "overrides": _overrides(run), "state": state,
            "reason": status.get("error") if state == "failed" else None, "step": status.get("step"),
            "total_steps": status.get("total_steps"), "final_train_loss": final,
            "val_loss": vals[-1] if vals else None, "best_val_loss": min(vals) if vals else None,
            "samples_per_s": statistics.median(speeds) if speeds else status.get("samples_per_s"),
            "elapsed_s": status.get("elapsed_s"), "run_dir": str(run), "history": history}


def _point_order(name: str):
    return not name.isdigit(), int(name) if name.isdigit() else 0, name


def sweep_points(sweep_dir: Path) -> list[Path]:
    """The run folders of a sweep (Hydra's job folders 0, 1, ...; or any child folder that holds a run)."""
    runs = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and
            ((p / "status.json").exists() or (p / "config.yaml").exists() or (p / ".hydra").exists())]
    return sorted(runs, key=lambda p: _point_order(p.name))


def sweep_grid(sweep_dir: Path) -> list[list[str]] | None:
    """Every point of the grid the sweep folder's multirun.yaml describes (BasicSweeper), its swept values, in
    Hydra's order; None for a search (Optuna) or a folder without a readable multirun.yaml."""
    from omegaconf import OmegaConf

    try:
        multirun = OmegaConf.load(Path(sweep_dir) / "multirun.yaml")
        if "BasicSweeper" not in str(multirun.hydra.sweeper.get("_target_", "")):
            return None
        return grid_points(sweeper_params(multirun.hydra), list(multirun.hydra.overrides.task))
    except Exception:  # noqa: BLE001 - a missing or foreign file: the points are the folders and the records
        return None


def sweep_rows(sweep_dir: Path, grid: list[list[str]] | None = None) -> list[dict]:
    """One row per point: every point of the grid (``grid``, else multirun.yaml's), run or not, and every point
    folder or recorded point besides (a search's trials). A point the sweep recorded as refused shows its reason and
    nothing of its folder (which may hold another run: e.g. a live run that held its lock); one that has not run yet
    is "not started"."""
    sweep_dir = Path(sweep_dir)
    folders = {p.name: p for p in sweep_points(sweep_dir)}
    records = point_records(sweep_dir)
    grid = {str(i): point for i, point in enumerate(grid if grid is not None else sweep_grid(sweep_dir) or [])}
    rows = []
    for name in sorted({*grid, *folders, *records}, key=_point_order):
        record = records.get(name) or {}
        state = record.get("state")
        if name in folders and state != "refused":
            row = point_row(folders[name])
        else:
            row = dict.fromkeys(COLUMNS, None)
            row.update(point=name, overrides=[], state="not started", run_dir=str(sweep_dir / name), history=[])
        row["overrides"] = row["overrides"] or record.get("overrides") or grid.get(name) or []
        if state in ("refused", "failed"):
            row["state"], row["reason"] = state, record.get("reason")
        rows.append(row)
    return rows


def _swept(rows: list[dict], known: list[str] | None = None) -> list[str]:
    """The swept keys the points' overrides hold: ``known`` (the sweep's own, from multirun.yaml) when given, else
    the override keys whose values differ between points, in command-line order."""
    if known:
        held = {o.partition("=")[0] for row in rows for o in row["overrides"]}
        if any(k in held for k in known):
            return [k for k in known if k in held]
    values: dict[str, set] = {}
    for row in rows:
        for o in row["overrides"]:
            k, _, v = o.partition("=")
            values.setdefault(k, set()).add(v)
    return [k for k, vs in values.items() if len(vs) > 1 or len(rows) == 1]


def point_values(row: dict) -> dict[str, str]:
    """A point's swept values: its ``key=value`` overrides as key -> value."""
    return dict(o.split("=", 1) for o in row["overrides"] if "=" in o)


def _label(row: dict, keys: list[str]) -> str:
    pairs = point_values(row)
    return " ".join(f"{k.rpartition('.')[2]}={pairs[k]}" for k in keys if k in pairs) or row["point"]


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def objective_key(row: dict) -> str | None:
    """Which loss one point is judged by (an optimising sweeper's objective): val/loss when the run logs one, else
    the final train loss; None when it has neither."""
    return next((k for k in ("val_loss", "final_train_loss") if row.get(k) is not None), None)


def objective(row: dict) -> float | None:
    """What a sweep minimises for one point: its value of :func:`objective_key`."""
    key = objective_key(row)
    return None if key is None else float(row[key])


def ranking_key(rows: list[dict]) -> str:
    """The one loss a sweep's points are ranked by: val/loss when every point with a train loss also has one (two
    metrics are never compared with each other), else the final train loss."""
    trained = [r for r in rows if r["final_train_loss"] is not None or r["val_loss"] is not None]
    return "val_loss" if trained and all(r["val_loss"] is not None for r in trained) else "final_train_loss"


def write_summary(sweep_dir: Path, grid: list[list[str]] | None = None) -> dict[str, Path]:
    """summary.csv, summary.md, loss.png and (rank x lr) heatmap.png in the sweep folder (``grid``: its points, when
    no multirun.yaml there lists them); returns what it wrote."""
    sweep_dir = Path(sweep_dir)
    rows = sweep_rows(sweep_dir, grid)
    if not rows:
        return {}
    keys = _swept(rows, sweep_folder_keys(sweep_dir))
    written = {"csv": sweep_dir / "summary.csv", "md": sweep_dir / "summary.md"}
    with open(written["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*keys, *COLUMNS])
        for row in rows:
            pairs = point_values(row)
            w.writerow([*(pairs.get(k, "") for k in keys),
                        *(" ".join(row[c]) if c == "overrides" else _fmt(row[c]) for c in COLUMNS)])
    rank_by = ranking_key(rows)
    best = min((r for r in rows if r[rank_by] is not None), key=lambda r: r[rank_by], default=None)
    shown = ("point", *keys, "state", "step", "final_train_loss", "val_loss", "samples_per_s", "elapsed_s")
    header = [METRIC_NAMES.get(c, c) for c in shown]
    states = [r["state"] for r in rows]
    counts = ", ".join(f"{states.count(x)} {x}" for x in sorted(set(states)))
    lines = [f"# Sweep {sweep_dir.name}: {len(rows)} points ({counts})", "",
             f"Ranked by {METRIC_NAMES[rank_by]}, lower is better; the best point in bold.", "",
             f"- {TRAIN_LOSS} (CSV: final_train_loss): the training loss averaged over the last {FINAL_WINDOW} logged "
             "steps (wanexp-status shows the last logged step's alone).",
             f"- {VAL_LOSS} (CSV: val_loss): the loss on the held-out clips at the last validation; empty when the run "
             "has no validation data (data.val_fraction).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(shown)]
    for row in rows:
        pairs = point_values(row)
        cells = [row["point"], *(pairs.get(k, "") for k in keys), *(_fmt(row[c]) for c in shown[1 + len(keys):])]
        if row is best:
            cells = [f"**{c}**" if c else c for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    stopped = [r for r in rows if r["reason"]]
    if stopped:
        lines += ["", "Points that did not finish:", ""]
        lines += [f"- {r['point']} ({_label(r, keys)}): {r['state']}: {r['reason']}" for r in stopped]
    written["md"].write_text("\n".join(lines) + "\n")
    written.update(_plots(sweep_dir, rows, keys))
    return written


def _plots(sweep_dir: Path, rows: list[dict], keys: list[str]) -> dict[str, Path]:
    plt = pyplot()
    if plt is None:
        print("wanexp: sweep: matplotlib is not installed; no plots (pip install matplotlib)", flush=True)
        return {}
    out = {}
    curves = [(_label(row, keys), [(h["step"], h["loss"]) for h in row["history"] if h.get("loss") is not None])
              for row in rows]
    fig = loss_figure(plt, curves, f"sweep {sweep_dir.name}: train loss per point", "train loss (per logged step)")
    out["loss"] = sweep_dir / "loss.png"
    fig.savefig(out["loss"], dpi=110)
    plt.close(fig)

    use_val = ranking_key(rows) == "val_loss"
    grid = rank_lr_grid(rows, keys, "val_loss" if use_val else "final_train_loss")
    if grid is not None:
        import numpy as np

        z = np.array([[np.nan if v is None else v for v in row] for row in grid["values"]])
        fig = heatmap_figure(z, grid["ranks"], grid["lrs"], grid["rank_key"], grid["lr_key"], sweep_dir.name,
                             VAL_LOSS if use_val else TRAIN_LOSS)
        out["heatmap"] = sweep_dir / "heatmap.png"
        fig.savefig(out["heatmap"], dpi=110)
        plt.close(fig)
    return out


def rank_lr_grid(rows: list[dict], keys: list[str], metric: str) -> dict | None:
    """A sweep's rank x lr grid of ``metric`` (each point's val_loss or final_train_loss): the swept keys ending in
    ``.rank`` and ``.lr``, their values in numeric order, and ``values[i][j]`` for rank i and lr j (None where no
    point has one). None when the sweep does not sweep both. The summary's heatmap.png and the live page's heatmap
    (wanexp.cli.status_server) draw it."""
    rank_key = next((k for k in keys if k.endswith(".rank")), None)
    lr_key = next((k for k in keys if k.endswith(".lr")), None)
    if not (rank_key and lr_key):
        return None
    grid = {}
    for row in rows:
        pairs = point_values(row)
        if rank_key in pairs and lr_key in pairs and row.get(metric) is not None:
            grid[(pairs[rank_key], pairs[lr_key])] = row[metric]
    if not grid:
        return None

    def number(v: str) -> float:
        try:
            return float(v)
        except ValueError:
            return math.inf

    ranks = sorted({r for r, _ in grid}, key=number)
    lrs = sorted({lr for _, lr in grid}, key=number)
    return {"rank_key": rank_key, "lr_key": lr_key, "ranks": ranks, "lrs": lrs,
            "values": [[grid.get((r, lr)) for lr in lrs] for r in ranks]}


HEATMAP_CMAP = "RdYlGn_r"  # low loss green, high loss red: the best cell reads as good without a legend


def heatmap_figure(z, ranks: list[str], lrs: list[str], rank_key: str, lr_key: str, name: str, metric: str):
    """rank x lr cells of ``metric`` (a loss): green is lower (better), the best cell outlined, the colour bar
    labelled with the metric and "lower is better"."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    # the title and the colour bar's label wrap, and the figure is large enough for their lines (a small grid's
    # colour bar is shorter than a loss's name, its axes narrower than the title)
    label = "\n".join(textwrap.wrap(f"{metric}, lower is better", 26))
    fig, ax = plt.subplots(figsize=(2.4 + 1.3 * len(lrs), max(3.4, 1.2 + 0.8 * len(ranks))))
    im = ax.imshow(z, cmap=HEATMAP_CMAP, aspect="auto")
    ax.set_xticks(range(len(lrs)), lrs)
    ax.set_yticks(range(len(ranks)), ranks)
    ax.set_xlabel(lr_key)
    ax.set_ylabel(rank_key)
    for i in range(len(ranks)):
        for j in range(len(lrs)):
            if np.isfinite(z[i, j]):  # the colour map is mid-light at both ends: black text reads on every cell
                ax.text(j, i, f"{z[i, j]:.4g}", ha="center", va="center", fontsize=9, color="black")
    if np.isfinite(z).any():
        i, j = np.unravel_index(np.nanargmin(z), z.shape)
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2.5))
    ax.set_title("\n".join([*textwrap.wrap(f"{name}: {metric}", 36), "(best outlined)"]), fontsize=10)
    fig.colorbar(im, ax=ax).set_label(label, fontsize=9)
    fig.tight_layout()
    return fig


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

    return [list(p) for p in itertools.product(*keys.values())]  # no swept key: one point


def sweeper_params(hydra_cfg) -> dict:
    """``hydra.sweeper.params`` as a dict: a sweep config's grid (sweep=rank_lr); empty for a plain ``-m`` grid,
    where Hydra leaves it null."""
    from omegaconf import OmegaConf

    params = hydra_cfg.sweeper.get("params")
    return dict(OmegaConf.to_container(params, resolve=False)) if params else {}


def swept_keys(sweeper_params: dict, command_line: list[str]) -> list[str]:
    """The keys a multirun sweeps: the sweep config's params, then the command line's sweep overrides (a comma list,
    range(...), choice(...)), each once, in that order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = list(sweeper_params)
    for o in OverridesParser.create().parse_overrides(list(command_line)):
        if o.is_sweep_override() and o.get_key_element() not in keys:
            keys.append(o.get_key_element())
    return keys


def sweep_folder_keys(sweep_dir: Path) -> list[str] | None:
    """The keys a sweep folder's multirun swept, from its multirun.yaml (the sweeper writes it before the first
    point, also for a cluster launcher whose points run elsewhere): a point's own overrides hold one value per key,
    so the command line's comma lists are only there. None when the file cannot be read."""
    from omegaconf import OmegaConf

    try:
        multirun = OmegaConf.load(Path(sweep_dir) / "multirun.yaml")
        command_line = list(multirun.hydra.overrides.task)
        params = sweeper_params(multirun.hydra)
    except Exception:  # noqa: BLE001 - a missing or foreign file: the caller names the points another way
        return None
    return swept_keys(params, command_line)


def _setting(config, point: list[str], key: str):
    """A top-level setting of one point: its own swept value when the grid sweeps it, else the sweep's."""
    for o in point:
        k, _, v = o.partition("=")
        if k.lstrip("+") == key:
            return None if v in ("null", "~", "") else v
    return config.get(key)


def _refuse_taken_points(config, sweep_dir: Path, points: list[list[str]] | None) -> None:
    """Refuse the whole sweep before the sweeper writes anything (multirun.yaml, the points' .hydra) when a point's
    run folder holds checkpoints of an earlier run and the point neither resumes nor overwrites: each such point
    would be refused one at a time, after the sweep folder's files were rewritten."""
    from omegaconf import OmegaConf

    if OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir") != "${hydra.job.num}":
        return  # point folders named another way: each point checks its own folder
    if points is None:  # a search: its trials reuse the numbered folders there are
        numbers = sorted(int(p.name) for p in sweep_dir.glob("*") if p.name.isdigit())
        points = [[] for _ in numbers]
    else:
        numbers = list(range(len(points)))
    taken = []
    for n, point in zip(numbers, points):
        resume, overwrite = _setting(config, point, "resume"), _setting(config, point, "overwrite")
        held = any((sweep_dir / str(n) / "checkpoints").glob("*.ckpt"))
        if held and resume is None and str(overwrite).lower() != "true":
            taken.append(str(n))
    if taken:
        say_error(f"hydra.sweep.dir={sweep_dir}: point{'s' if len(taken) > 1 else ''} {', '.join(taken)} "
                  "already hold checkpoints of an earlier sweep (<point>/checkpoints); pass resume=last to continue "
                  "them, another sweep folder (sweep.name=NAME or hydra.sweep.dir=DIR), or overwrite=true to replace "
                  "them")
        raise SystemExit(2)  # not an Exception: Hydra would turn that into a warning and sweep on


def _snapshot(sweep_dir: Path) -> dict:
    """What a refused sweep puts back: whether the sweep folder existed, and the sweep's own files there."""
    files = {}
    for name in SWEEP_FILES:
        try:
            files[name] = (sweep_dir / name).read_bytes()
        except OSError:
            files[name] = None
    return {"time": time.time(), "existed": sweep_dir.exists(), "files": files}


def _ran_since(sweep_dir: Path, start: float) -> bool:
    """Whether a point of this sweep got as far as training (a run writes status.json once it starts); a point it
    recorded as refused did not, whatever its folder holds (a live run of another command)."""
    refused = {p for p, r in point_records(sweep_dir).items() if r.get("state") == "refused" and
               r.get("time", 0) >= start - 1}
    for run in sweep_points(sweep_dir) if sweep_dir.is_dir() else []:
        try:
            if run.name not in refused and (run / "status.json").stat().st_mtime >= start - 1:
                return True
        except OSError:
            continue
    return False


def _restore(sweep_dir: Path, keep: dict) -> None:
    """Undo what a sweep whose points were all refused wrote: a new sweep folder goes (nothing in it trained), an
    existing one gets its own files back as they were (multirun.yaml, points.jsonl, the summary)."""
    import shutil

    if not keep["existed"]:
        shutil.rmtree(sweep_dir, ignore_errors=True)
        return
    for name, before in keep["files"].items():
        if before is None:
            (sweep_dir / name).unlink(missing_ok=True)
        elif (sweep_dir / name).read_bytes() != before:
            (sweep_dir / name).write_bytes(before)


class SweepSummary(Callback):
    """Hydra callback (``hydra.callbacks.sweep``): see the module docstring."""

    def __init__(self):
        self.sweep_dir: Path | None = None
        self.done = 0
        self._keep: dict | None = None

    def on_multirun_start(self, config, **kwargs) -> None:
        self.sweep_dir = Path(config.hydra.sweep.dir).resolve()
        params = sweeper_params(config.hydra)
        sweeper = str(config.hydra.sweeper.get("_target_", ""))
        points = grid_points(params, list(config.hydra.overrides.task)) if "BasicSweeper" in sweeper else None
        if points is not None:
            print(f"wanexp: sweep: {len(points)} point{'s' * (len(points) != 1)}, run folders {self.sweep_dir}/<n>",
                  flush=True)
            for i, point in enumerate(points):
                print(f"wanexp: sweep:   {i}: {' '.join(point) or '(no swept values)'}", flush=True)
        else:
            print(f"wanexp: sweep: {sweeper.rpartition('.')[2]} over {params}; run folders {self.sweep_dir}/<n>",
                  flush=True)
        _refuse_taken_points(config, self.sweep_dir, points)
        self._keep = _snapshot(self.sweep_dir)
        atexit.register(self._summarize)  # also when a point stops the sweep (its exit skips on_multirun_end)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        if not str(config.hydra.mode).endswith("MULTIRUN") or self.sweep_dir is None:
            return
        run = Path(config.hydra.runtime.output_dir)
        status = getattr(getattr(job_return, "status", None), "name", "COMPLETED")
        error = getattr(job_return, "_return_value", None) if status == "FAILED" else None
        stopped = isinstance(error, PointStopped)
        state = error.state if stopped else "failed" if status == "FAILED" else "finished"
        reason = None if status != "FAILED" else error.line if stopped else f"{type(error).__name__}: {error}"
        record_point(self.sweep_dir, run.name, list(config.hydra.overrides.task), state, reason)
        self.done += 1
        if state == "refused":  # nothing of it was written; its folder may hold another run
            print(f"wanexp: sweep: point {run.name} refused: {reason}", flush=True)
        else:
            row = point_row(run)
            value, key = objective(row), objective_key(row)
            loss = f"{METRIC_NAMES[key]} {_fmt(value)}" if key else "no loss logged"
            print(f"wanexp: sweep: point {row['point']} {row['state']} at step {row['step']}: {loss}", flush=True)
            if status == "COMPLETED" and job_return.return_value is None:
                job_return.return_value = value  # the objective of an optimising sweeper (Optuna)
        if self._keep is None or _ran_since(self.sweep_dir, self._keep["time"]):
            write_summary(self.sweep_dir)  # the summary so far: a sweep stopped later (a signal) still has it

    def on_multirun_end(self, config, **kwargs) -> None:
        self._summarize()

    def _summarize(self) -> None:
        if self.sweep_dir is None:
            return
        sweep_dir, self.sweep_dir = self.sweep_dir, None  # once
        if self._keep is not None and not _ran_since(sweep_dir, self._keep["time"]):
            _restore(sweep_dir, self._keep)  # every point it tried was refused: a refused sweep leaves no trace
            return
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
