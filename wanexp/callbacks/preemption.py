"""Preemption and interruption: SIGTERM, SIGUSR1 (SLURM's warning, ``--signal=USR1@120``) and SIGINT save a checkpoint
at the end of the current optimizer step, mark the run ``interrupted`` and exit 128 + the signal (143, 138, 130).

The handlers only set a flag; the save happens at a step boundary, so the checkpoint is consistent. With several
ranks the flag is combined over all of them at every step's end (a max all-reduce) and read at the next step's end,
after the GPU has finished it: no host sync in the step, and every rank saves and stops at the same step, one optimizer
step after the signal's. Lightning's own per-step SIGTERM broadcast (a blocking read every step) is turned off while
this callback runs; its handler's job is done here.
"""
from __future__ import annotations

import signal
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from wanexp.errors import Interrupted
from wanexp.lightning_compat import is_last_batch, save_checkpoint_now, skip_sigterm_broadcast

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Preemption(Callback):
    """``requeue``: in a SLURM job (``SLURM_JOB_ID`` set), SIGUSR1 also requeues the job with ``scontrol requeue``
    once the checkpoint is saved (what Lightning's SLURM auto-requeue does, but after a consistent step-end save
    instead of a save from inside the signal handler); the requeued job continues with ``resume=auto``."""

    def __init__(self, requeue: bool):
        self.requeue = requeue
        self.received = 0
        self._previous: dict[int, object] = {}
        self._launcher = None
        self._agreed: LaggedMax | None = None

    def _handler(self, signum, frame) -> None:
        first = not self.received
        self.received = self.received or signum
        # Lightning's own SIGTERM handler is not called: it sets trainer.received_sigterm, which makes Lightning's
        # loop exit at the end of the same step (SIGTERMException: exit code 0, no checkpoint, status not
        # interrupted) when the signal lands after this callback's step-end check. Its other job is done here: the
        # processes a launcher started (trainer.devices=N without torchrun) get the signal too.
        launcher = self._launcher
        if first and signum == signal.SIGTERM and launcher is not None and hasattr(launcher, "kill"):
            launcher.kill(signum)

    def on_train_start(self, trainer, pl_module) -> None:
        self._launcher = trainer.strategy.launcher if trainer.global_rank == 0 else None
        self._agreed = None
        # Lightning broadcasts trainer.received_sigterm from rank 0 before every batch under several ranks, with a
        # blocking read; its handler is not called here (above) and the step-end check below covers a SIGTERM it saw
        # before training started, so that broadcast only costs a host sync per step.
        skip_sigterm_broadcast(trainer)
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
        if (batch_idx + 1) % trainer.accumulate_grad_batches and not is_last_batch(trainer):
            return  # only at an optimizer step
        signum = self.received or (signal.SIGTERM if trainer.received_sigterm else 0)
        if trainer.world_size > 1:
            if self._agreed is None:
                self._agreed = LaggedMax(trainer.strategy.root_device)
            signum = self._agreed(signum)
        if not signum:
            return
        ckpt = trainer.checkpoint_callback
        if ckpt is not None:
            save_checkpoint_now(ckpt, trainer)
            checkpoint = ckpt.last_model_path or ckpt.best_model_path or None
        else:  # callbacks.checkpoint=null: the one checkpoint a run ends with (as train.py saves it at the end), in
            # the run folder's checkpoints/ where resume=last finds it
            checkpoint = str(Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt")
            trainer.save_checkpoint(checkpoint)  # collective: every rank stops at this step
        for cb in trainer.callbacks:
            if hasattr(cb, "interrupted"):
                cb.interrupted(trainer, signal.Signals(signum).name, checkpoint)
        if signum == signal.SIGUSR1 and self.requeue and trainer.global_rank == 0:
            requeue_slurm_job()
        raise Interrupted(signum, trainer.global_step, checkpoint)


class LaggedMax:
    """``agreed = LaggedMax(device)(local)``: the max over all ranks of each rank's ``local`` value as it was at the
    previous call (0 at the first). Each call starts an all-reduce of this call's value and, on a GPU, copies the
    result to pinned host memory without waiting; the next call reads it once the GPU has passed that point (an
    event recorded a step earlier), so the step never waits for the GPU. Every rank gets the same answer from the
    same call. On the CPU (gloo) the all-reduce is already done when it returns."""

    def __init__(self, device: torch.device):
        self.device = device
        cuda = device.type == "cuda"
        self._in = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        self._out = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        self._event = None

    def __call__(self, local: int) -> int:
        import torch.distributed as dist

        if self._event is not None:
            self._event.synchronize()  # the previous call's all-reduce and copies are done
        agreed = int(self._out[0])
        self._in[0] = local  # safe to overwrite: the copy that read it is done
        flag = self._in.to(self.device, non_blocking=True)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # no barrier first (Lightning's reduce has one)
        self._out.copy_(flag, non_blocking=True)
        if self.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        return agreed


def requeue_slurm_job() -> None:
    """``scontrol requeue`` this SLURM job (an array task by its own id); outside SLURM nothing happens."""
    import os
    import subprocess

    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        ok, why = res.returncode == 0, (res.stderr or res.stdout).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        ok, why = False, str(e)
    print(f"wanexp: SLURM job {job} requeued" if ok else
          f"wanexp: warning: scontrol requeue {job} failed ({why}); resubmit the job with resume=auto", flush=True)
