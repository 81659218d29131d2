"""Checkpoints: Lightning's ModelCheckpoint plus a save at the run's final step, written atomically."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from wanexp.disk import disk_full_message, is_disk_full
from wanexp.errors import UserError
from wanexp.lightning_compat import is_last_batch, save_checkpoint_now


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, read-only folder); the previous one is intact."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint under a temporary name in its own folder, then renames it: a kill or a full disk during
    a save never leaves a truncated file under a checkpoint's name (a temporary file in ``$TMPDIR`` would not be
    renamable across filesystems, so the temporary file sits next to the target)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except (OSError, RuntimeError) as e:
            # torch.save's zip writer turns a failed write into RuntimeError("... unexpected pos ..."), the OSError
            # (ENOSPC) being its __context__; any other RuntimeError is a bug and keeps its traceback
            tmp.unlink(missing_ok=True)  # before the free space is read for the message
            if is_disk_full(e):
                raise CheckpointWriteError(disk_full_message(f"checkpoint {path}", path,
                                                             "the previous checkpoint is intact")) from None
            if not isinstance(e, OSError):
                raise
            raise CheckpointWriteError(
                f"cannot write checkpoint {path} ({e.strerror or e}); the previous checkpoint is intact: free space "
                "or make the folder writable (or set paths.output_dir elsewhere), then continue with resume=last"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)


class RunCheckpoint(ModelCheckpoint):
    """Every N optimizer steps, newest K kept, ``last.ckpt`` linking the newest, and one more at the final step.

    So every checkpoint of a run, the last included, is written inside the training loop at the end of an optimizer
    step: resuming it (``resume=last``, also with a larger ``max_steps``) continues mid-epoch with exactly the data not
    yet seen. (A checkpoint saved after ``fit`` returns is taken by Lightning as the end of its epoch.)
    """

    def load_state_dict(self, state_dict) -> None:
        """Resuming: retention keeps exactly ``save_top_k`` step checkpoints. A kill between writing a new checkpoint
        and deleting the one it replaces leaves that older file behind; it is removed here (rank 0)."""
        super().load_state_dict(state_dict)
        if self.save_top_k <= 0 or not self.dirpath or not self.best_k_models:
            return
        import re

        from lightning.fabric.utilities.rank_zero import rank_zero_only

        if rank_zero_only.rank != 0:
            return
        kept = {Path(p).resolve() for p in self.best_k_models}
        oldest = min(float(v) for v in self.best_k_models.values())
        for f in Path(self.dirpath).glob("step_*.ckpt"):
            m = re.fullmatch(r"step_(\d+)\.ckpt", f.name)
            if m and int(m.group(1)) < oldest and f.resolve() not in kept:
                f.unlink(missing_ok=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        steps_done = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        last_epoch = trainer.max_epochs is not None and trainer.max_epochs > 0 and \
            trainer.current_epoch + 1 >= trainer.max_epochs and \
            is_last_batch(trainer)
        if steps_done or last_epoch:
            save_checkpoint_now(self, trainer)
