"""The progress bar's pace (s/step) and ETA: the step-0 validation before the first training batch is not a step.
A fake clock and a stand-in trainer drive the bar's hooks (no training, no timing)."""
from __future__ import annotations

import io
import types

import pytest
import tqdm.std

from wanexp.callbacks.progress import StepProgressBar


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_trainer(step: int = 0, max_steps: int = 30):
    return types.SimpleNamespace(global_step=step, max_steps=max_steps, max_epochs=None, num_training_batches=100,
                                 accumulate_grad_batches=1, is_global_zero=True, callback_metrics={}, datamodule=None,
                                 _logger_connector=types.SimpleNamespace(should_update_logs=True))


@pytest.mark.parametrize("start", [0, 10], ids=["fresh", "resumed"])
def test_the_step0_validation_is_not_in_the_pace_or_the_eta(monkeypatch, start):
    """``1/30 [00:28<13:39, 28.27s/step]`` was the step-0 validation (27 s) counted as the first step (1 s)."""
    clock = Clock()
    monkeypatch.setattr(tqdm.std, "time", clock)
    monkeypatch.setattr("sys.stdout", io.StringIO())
    trainer = fake_trainer(start)
    bar = StepProgressBar()
    bar._trainer = trainer
    bar.on_train_start(trainer, None)
    clock.now += 27.0  # the validation at step 0 (on_train_start of the validation callback, after the bar's)
    bar.on_train_batch_start(trainer, None, {}, 0)
    for _ in range(2):  # two training steps of 1 s each
        clock.now += 1.0
        trainer.global_step += 1
        bar.on_train_batch_end(trainer, None, None, {}, 0)
        bar.on_train_batch_start(trainer, None, {}, 0)
    d = bar.train_progress_bar.format_dict
    line = " ".join(bar.train_progress_bar.format_meter(**d).split())
    left = 30 - start - 2  # steps, at 1 s each
    assert f"{start + 2}/30 [00:29<{left // 60:02d}:{left % 60:02d}, 1.00step/s" in line, line
    assert d["elapsed"] == pytest.approx(29.0)  # the session's wall time, validation included


def test_a_disabled_bar_of_another_rank_takes_the_hooks(monkeypatch):
    """Ranks other than 0 hold a disabled bar (tqdm gives it no clock): the pace hook must leave it alone."""
    monkeypatch.setattr("sys.stdout", io.StringIO())
    trainer = fake_trainer(0)
    trainer.is_global_zero = False
    bar = StepProgressBar()
    bar._trainer = trainer
    bar.disable()
    bar.on_train_start(trainer, None)
    assert bar.train_progress_bar.disable
    bar.on_train_batch_start(trainer, None, {}, 0)
    trainer.global_step += 1
    bar.on_train_batch_end(trainer, None, None, {}, 0)
    assert bar.train_progress_bar.pace_from is None
