"""The one place in wanexp that reads or changes Lightning's private parts (attributes and methods whose names start
with ``_``, the fit loop's progress counters and the checkpoint's loop state). Everything else calls these functions.

Written for and checked on the Lightning versions in ``TESTED``: tests/unit/test_lightning_compat.py fails on another
version, and checks on a real Trainer that every private part read here exists and behaves as assumed. On a new
Lightning version, re-check each function against its source, then widen ``TESTED``.
"""
from __future__ import annotations

TESTED = ((2, 6), (2, 7))  # [from, to) as (major, minor): the Lightning versions this module was checked against


def tested_version(version: str) -> bool:
    """Whether a Lightning version string (``lightning.__version__``) lies in ``TESTED``."""
    major_minor = tuple(int(p) for p in version.split(".")[:2])
    return TESTED[0] <= major_minor < TESTED[1]


def attached_trainer(module):
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises when there is none)."""
    return module._trainer


def logs_this_step(trainer) -> bool:
    """Whether the current training step is a log step (``trainer.log_every_n_steps``), as Lightning decides it for
    ``self.log``: metrics read from the device only at these steps cost one host sync per log step, not per step."""
    return bool(trainer._logger_connector.should_update_logs)


def is_last_batch(trainer) -> bool:
    """Whether the training batch being run is the epoch's last (Lightning then steps the optimizer even inside an
    accumulation window)."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def skip_sigterm_broadcast(trainer) -> None:
    """Lightning broadcasts ``trainer.received_sigterm`` from rank 0 before every batch under several ranks, with a
    blocking read (a host sync per step); wanexp's preemption callback agrees on signals itself, so that broadcast
    is switched off for this fit."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


def save_checkpoint_now(callback, trainer) -> None:
    """Save the step checkpoint and last.ckpt of a ModelCheckpoint now, as at its own cadence (retention included),
    unless it skips this step (e.g. it just saved, or the run is a fast_dev_run)."""
    if callback._should_skip_saving_checkpoint(trainer):
        return
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


def open_next_epoch_after_resume(trainer) -> None:
    """Resumed from a checkpoint of an epoch's last step, Lightning (2.6) closes that epoch but still counts the run
    as restarted mid-epoch, so it does not open the next one: its epoch counters stay one behind in every later
    checkpoint, and a resume from one of those repeats an epoch. Called at train start (after Lightning's restart
    bookkeeping): the next epoch then starts as in an uninterrupted run."""
    loop = trainer.fit_loop
    epochs = loop.epoch_progress.current
    if loop.restarted_mid_epoch and epochs.processed == epochs.ready:
        loop.reset_restart_stage()


def mend_epoch_progress(checkpoint: dict) -> None:
    """A checkpoint saved at a step's end during an epoch counts that epoch as ready and started but not processed;
    one written by a run resumed from an epoch's last step (before ``open_next_epoch_after_resume``) counts it as
    processed too. Put such counters back, before Lightning restores its loops, so the resume continues that epoch."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    batches = (fit.get("epoch_loop.batch_progress") or {}).get("current") or {}
    if not batches or batches.get("completed") != batches.get("processed", 0) - 1:
        return  # not saved at a step's end
    for counts in (fit.get("epoch_progress") or {}).values():
        if counts.get("ready") == counts.get("processed") == counts.get("completed"):
            counts["ready"] = counts["started"] = counts["processed"] + 1
