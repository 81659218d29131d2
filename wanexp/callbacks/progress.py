"""One progress bar for the whole run, counting optimizer steps: ``step / total`` with loss, samples/s and the run's ETA.

The total is the run's optimizer steps: ``trainer.max_steps``, or (when it is -1 or the epochs end first) the steps of
one epoch (batches per rank / accumulation, rounded up: Lightning steps at the end of each epoch too) x ``max_epochs``.
The batches per rank already divide the samples (x each dataset's repeat and weight) by world size x batch, so the
total is right for any world size, batch and accumulation. A resumed run's bar starts at the resumed step, and its ETA counts
only the steps of this session.

The rate (s/step) and the ETA count from the session's first training batch: the step-0 validation, which runs once
before it (the base model's videos; minutes on A14B), is no step. Later validations recur at their cadence and stay in
the pace, so the ETA holds for the rest of the run; the elapsed time is the session's wall time.
"""
from __future__ import annotations

import math
import sys

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from wanexp.context import RunContext


def optimizer_steps_per_epoch(trainer) -> int:
    """Optimizer steps in one epoch on each rank (the batches per rank already divide by world size x batch)."""
    batches = trainer.num_training_batches
    if batches == float("inf"):
        return 0
    return math.ceil(batches / trainer.accumulate_grad_batches)


def total_optimizer_steps(trainer) -> int:
    """Optimizer steps of the whole run (0 when unknown: an endless loader with no ``max_steps``)."""
    per_epoch = optimizer_steps_per_epoch(trainer)
    epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else None
    by_epochs = per_epoch * epochs if per_epoch and epochs else 0
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return min(trainer.max_steps, by_epochs) if by_epochs else trainer.max_steps
    return by_epochs


def dataset_postfix(trainer) -> dict[str, str]:
    """With several datasets (``data.datasets``): each one's samples trained so far in this epoch (all ranks) of
    those the epoch trains, ``{"clips": "40/120", "stills": "130/400"}``; from the loader's order, no device read."""
    seen = getattr(getattr(trainer, "datamodule", None), "samples_seen", None)
    if seen is None:
        return {}
    return {name: f"{done}/{total}" for name, (done, total) in seen(trainer.global_step).items()}


class PacedTqdm(Tqdm):
    """A bar whose rate and ETA count from ``pace_from`` = (time, step) when set, not from the bar's creation."""

    pace_from: tuple[float, int] | None = None

    @property
    def format_dict(self) -> dict:
        d = super().format_dict
        if self.pace_from is not None and self.n > self.pace_from[1]:
            t0, n0 = self.pace_from
            d["rate"] = (self.n - n0) / max(self._time() - t0, 1e-9)
        return d


class StepProgressBar(TQDMProgressBar):
    """``Training: 45%|████▌     | 450/1000 [02:10<02:39, 3.45step/s, loss=0.123, samples/s=13.8]`` (rank 0);
    with several datasets, each one's samples this epoch follow: ``..., clips=40/120, stills=130/400]``.

    One bar from the first to the last optimizer step (no per-epoch bars); ``refresh_rate`` in optimizer steps.
    """

    def __init__(self, refresh_rate: int = 1):
        super().__init__(refresh_rate=refresh_rate, leave=False)
        self._bar_step = 0
        self._shown: dict = {}  # loss and samples/s of the last logged step

    def init_train_tqdm(self) -> Tqdm:
        # created with its total and start step, so no "Training: 0/?" bar is ever drawn
        step = self.trainer.global_step
        return PacedTqdm(desc="Training", total=self.total_train_batches or None, initial=step,
                    position=2 * self.process_position, disable=self.is_disabled, leave=True, dynamic_ncols=True,
                    file=sys.stdout, smoothing=0.1, unit="step",
                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]")

    @property
    def total_train_batches(self) -> int:
        return total_optimizer_steps(self.trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        self._bar_step = trainer.global_step

    def on_train_epoch_start(self, trainer, *_) -> None:
        pass  # one bar for the run: nothing resets per epoch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        bar = self.train_progress_bar
        if bar.pace_from is None and not bar.disable:  # the session's first batch: after the step-0 validation
            # (a disabled bar, every rank but 0, has no clock)
            bar.pace_from = (bar._time(), trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar, step = self.train_progress_bar, trainer.global_step
        if bar is None or step == self._bar_step:
            return  # accumulating: no optimizer step yet
        self._bar_step = step
        if step % self.refresh_rate == 0 or step == bar.total:
            bar.n = step
            if RunContext.logs_this_step(trainer) or step == bar.total:
                # loss and samples/s as logged: read from the device at log steps only (a read is a host sync)
                self._shown = self.get_metrics(trainer, pl_module)
            bar.set_postfix({**self._shown, **dataset_postfix(trainer)}, refresh=False)
            bar.refresh()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass

    def get_metrics(self, trainer, pl_module) -> dict:
        """Loss and samples/s (the values logged at the last step; rank 0's)."""
        shown = {}
        m = trainer.callback_metrics
        if "train/loss" in m:
            shown["loss"] = f"{float(m['train/loss']):.4g}"
        if "perf/samples_per_s" in m:
            shown["samples/s"] = f"{float(m['perf/samples_per_s']):.3g}"
        return shown
