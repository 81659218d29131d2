"""Loss curves as PNG: a run's ``DIR/loss.png`` (its training loss and, when validated, ``val/loss`` against the
optimizer step, read from ``DIR/status.jsonl``) and the figure the sweep summary draws its points' curves with.

The status callback (wanexp.callbacks.status_file) writes ``DIR/loss.png`` at each checkpoint, after each validation
and when the run ends (finished, failed or interrupted), so a run that is killed keeps the curve of its last
checkpoint. Plotting never stops a run: matplotlib missing or any failure is one printed line (once per run) and no
plot.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

__all__ = ["loss_curves", "loss_figure", "pyplot", "run_history", "write_loss_plot"]

PLOT_NAME = "loss.png"
SMOOTH = 10  # logged steps in the moving mean drawn over a run's training loss


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def run_history(run: Path) -> list[dict]:
    """status.jsonl, one entry per logged step (the training and validation lines of a step merged; the last value
    wins for a key logged twice, e.g. by a resumed run)."""
    by_step: dict[int, dict] = {}
    try:
        lines = (Path(run) / "status.jsonl").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            entry = json.loads(line)
            by_step.setdefault(int(entry["step"]), {}).update(entry)
        except (ValueError, KeyError, TypeError):
            continue
    return [by_step[s] for s in sorted(by_step)]


def loss_curves(history: list[dict], window: int = SMOOTH) -> list[tuple]:
    """The curves of a run's loss.png from its :func:`run_history`: the training loss of each logged step, its
    moving mean over ``window`` logged steps (when there are more than ``window``), and ``val/loss``; each as
    (label, [(step, value), ...], plot style), those without a value left out."""
    train = [(h["step"], float(h["loss"])) for h in history if _number(h.get("loss"))]
    val = [(h["step"], float(h["val_loss"])) for h in history if _number(h.get("val_loss"))]
    curves = [("train loss (per logged step)", train, {"alpha": 0.5 if len(train) > window else 1.0})]
    if len(train) > window:
        values = [v for _, v in train]
        mean = [(s, statistics.fmean(values[max(0, i - window + 1):i + 1])) for i, (s, _) in enumerate(train)]
        curves.append((f"train loss, mean of {window} logged steps", mean, {"linewidth": 2}))
    curves.append(("val/loss", val, {"linewidth": 2}))
    return [c for c in curves if c[1]]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def loss_figure(plt, curves: list[tuple], title: str, ylabel: str):
    """A figure of loss curves against the optimizer step: ``curves`` is (label, [(step, value), ...]) each, or
    (label, points, style) with keyword arguments for ``Axes.plot``; a curve of fewer than 20 points marks them.
    The caller saves and closes it."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points, *style in curves:
        if points:
            ax.plot(*zip(*points), marker="o" if len(points) < 20 else None, markersize=3, label=label,
                    **(style[0] if style else {}))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8, ncol=2 if len(curves) > 8 else 1)
    fig.tight_layout()
    return fig


def write_loss_plot(run: Path, title: str | None = None) -> Path | None:
    """``run``/loss.png from ``run``/status.jsonl (:func:`loss_curves`). None (nothing written) without a logged loss
    yet, or without matplotlib. Written to a temporary name and renamed: a viewer never sees half a file."""
    run = Path(run)
    curves = loss_curves(run_history(run))
    plt = pyplot() if curves else None
    if plt is None:
        return None
    fig = loss_figure(plt, curves, title or f"{run.name}: loss", "loss")
    path, tmp = run / PLOT_NAME, run / f".{PLOT_NAME}.tmp"
    try:
        fig.savefig(tmp, dpi=110, format="png")
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path
