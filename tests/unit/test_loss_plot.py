"""DIR/loss.png: the training loss (its moving mean) and val/loss against the step, read from DIR/status.jsonl; the
status callback redraws it at checkpoints and validations (at most every PLOT_EVERY_S) and at the end; a plot that
fails is one line and never stops the run."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from wanexp.callbacks import loss_plot
from wanexp.callbacks.loss_plot import SMOOTH, loss_curves, run_history, write_loss_plot
from wanexp.callbacks.status_file import RunStatus


def _history(folder, steps: int, val_every: int = 0) -> None:
    lines = []
    for s in range(1, steps + 1):
        lines.append({"step": s, "time": 0.0, "loss": 1.0 / s, "lr": 1e-3})
        if val_every and s % val_every == 0:
            lines.append({"step": s, "time": 0.0, "val": {"loss": 2.0 / s}, "val_loss": 2.0 / s})
    (folder / "status.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_the_curves_are_the_logged_loss_its_moving_mean_and_val_loss(tmp_path):
    _history(tmp_path, 12, val_every=4)
    curves = {label: points for label, points, _ in loss_curves(run_history(tmp_path))}
    train, mean, val = curves.values()
    assert train == [(s, 1.0 / s) for s in range(1, 13)]
    assert val == [(4, 0.5), (8, 0.25), (12, 2.0 / 12)]
    assert mean[0] == (1, 1.0) and mean[-1] == pytest.approx((12, np.mean([1.0 / s for s in range(3, 13)])))
    assert list(curves)[1] == f"train loss, mean of {SMOOTH} logged steps"
    _history(tmp_path, 3)  # few points: no mean, no val/loss
    assert [label for label, _, _ in loss_curves(run_history(tmp_path))] == ["train loss (per logged step)"]


def test_the_plot_is_a_png_and_nothing_is_written_before_a_loss_is_logged(tmp_path):
    assert write_loss_plot(tmp_path) is None and not (tmp_path / "loss.png").exists()
    _history(tmp_path, 30, val_every=10)
    path = write_loss_plot(tmp_path)
    image = np.asarray(Image.open(path).convert("RGB"))
    assert path == tmp_path / "loss.png" and image.shape == (550, 880, 3)
    assert image.std() > 10 and sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "status.jsonl"]


def _status(tmp_path, steps: int = 5) -> tuple[RunStatus, SimpleNamespace]:
    _history(tmp_path, steps)
    return RunStatus(str(tmp_path), "run"), SimpleNamespace(global_rank=0)


def test_checkpoints_redraw_it_at_most_every_plot_every_s_and_the_end_always(tmp_path, monkeypatch):
    status, trainer = _status(tmp_path)
    status.on_save_checkpoint(trainer, None, {})
    assert (tmp_path / "loss.png").is_file()
    (tmp_path / "loss.png").unlink()
    status.on_save_checkpoint(trainer, None, {})  # within PLOT_EVERY_S of the last plot: not redrawn
    assert not (tmp_path / "loss.png").exists()
    status._plot_loss(trainer, final=True)  # the run's end (finished, failed, interrupted) always draws
    assert (tmp_path / "loss.png").is_file()
    other, rank1 = RunStatus(str(tmp_path / "r1"), "run"), SimpleNamespace(global_rank=1)
    other.on_save_checkpoint(rank1, None, {})  # only rank 0 plots
    assert not (tmp_path / "r1").exists()


@pytest.mark.parametrize("broken, says", [
    ("write", "wanexp: the loss plot {dir}/loss.png was not written (OSError: disk says no); training goes on"),
    ("matplotlib", "wanexp: no loss plot (DIR/loss.png): matplotlib is not installed (pip install matplotlib)"),
])
def test_a_plot_that_cannot_be_drawn_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch, capsys, broken, says):
    status, trainer = _status(tmp_path)
    calls = []

    def fail(*args, **kwargs):
        calls.append(args)
        raise OSError("disk says no")

    if broken == "write":
        monkeypatch.setattr(loss_plot, "write_loss_plot", fail)
    else:
        monkeypatch.setattr(loss_plot, "pyplot", lambda: None)
    status.on_save_checkpoint(trainer, None, {})
    status._plot_loss(trainer, final=True)  # no second attempt, no second line
    assert capsys.readouterr().out.splitlines() == [says.format(dir=tmp_path)]
    assert len(calls) == (1 if broken == "write" else 0) and not (tmp_path / "loss.png").exists()
