"""A progress bar that counts optimizer steps: samples / (world_size x batch) / accumulation per epoch."""
from __future__ import annotations

import math

from lightning.pytorch.callbacks import TQDMProgressBar


def optimizer_steps_per_epoch(trainer) -> int:
    """Optimizer steps in one epoch on each rank (the batches per rank already divide by world size x batch)."""
    batches = trainer.num_training_batches
    if batches == float("inf"):
        return 0
    return math.ceil(batches / trainer.accumulate_grad_batches)


class StepProgressBar(TQDMProgressBar):
    @property
    def total_train_batches(self) -> int:
        return optimizer_steps_per_epoch(self.trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = math.ceil((batch_idx + 1) / trainer.accumulate_grad_batches)
        bar = self.train_progress_bar
        if bar is not None and bar.n != n and self._should_update(n, bar.total):
            bar.n = n
            bar.refresh()
            bar.set_postfix(self.get_metrics(trainer, pl_module))
