"""Preemption and interruption: SIGTERM, SIGUSR1 (SLURM's warning, ``--signal=USR1@120``) and SIGINT save a checkpoint
at the end of the current optimizer step, mark the run ``interrupted`` and exit 128 + the signal (143, 138, 130).

The handlers only set a flag; the save happens at a step boundary, so the checkpoint is consistent, and with several
ranks the flag is combined over all of them each step, so every rank saves and stops at the same step.
"""
from __future__ import annotations

import signal

import torch
from lightning.pytorch.callbacks import Callback

from wanexp.errors import Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Preemption(Callback):
    def __init__(self):
        self.received = 0
        self._previous: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        self.received = self.received or signum
        previous = self._previous.get(signum)
        if callable(previous) and signum != signal.SIGINT:  # e.g. Lightning's SLURM requeue on SIGUSR1
            previous(signum, frame)

    def on_train_start(self, trainer, pl_module) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handler)

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # only at an optimizer step
        signum = self.received or (signal.SIGTERM if trainer.received_sigterm else 0)
        if trainer.world_size > 1:
            flag = torch.tensor([signum], device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        if not signum:
            return
        checkpoint = None
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and not ckpt._should_skip_saving_checkpoint(trainer):
            candidates = ckpt._monitor_candidates(trainer)
            ckpt._save_topk_checkpoint(trainer, candidates)
            ckpt._save_last_checkpoint(trainer, candidates)
        if ckpt is not None:
            checkpoint = ckpt.last_model_path or ckpt.best_model_path or None
        for cb in trainer.callbacks:
            if hasattr(cb, "interrupted"):
                cb.interrupted(trainer, signal.Signals(signum).name, checkpoint)
        raise Interrupted(signum, trainer.global_step, checkpoint)
