"""Checkpoints: Lightning's ModelCheckpoint, plus a save at the run's final step."""
from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint


class RunCheckpoint(ModelCheckpoint):
    """Every N optimizer steps, newest K kept, ``last.ckpt`` linking the newest, and one more at the final step.

    So every checkpoint of a run, the last included, is written inside the training loop at the end of an optimizer
    step: resuming it (``resume=last``, also with a larger ``max_steps``) continues mid-epoch with exactly the data not
    yet seen. (A checkpoint saved after ``fit`` returns is taken by Lightning as the end of its epoch.)
    """

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        steps_done = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        last_epoch = trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs and \
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if (steps_done or last_epoch) and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
