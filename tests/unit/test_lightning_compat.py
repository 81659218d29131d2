"""wanexp/lightning_compat.py reads Lightning's private parts: these tests pin the Lightning version it was checked
against and check, on a real tiny Trainer, that every private part it reads exists and behaves as it assumes."""
from __future__ import annotations

import inspect
import logging
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader

from wanexp import lightning_compat as compat

BATCHES = 3  # per epoch
LOG_EVERY = 2


def test_lightning_is_a_version_the_adapter_was_checked_against():
    assert compat.tested_version(L.__version__), (
        f"Lightning {L.__version__} is outside the versions wanexp/lightning_compat.py was checked against "
        f"({compat.TESTED}): re-check each function there against this version's source (and this test file), then "
        "widen TESTED")


def test_the_version_check_can_refuse():
    assert compat.tested_version("2.6.0") and compat.tested_version("2.6.6")
    assert not compat.tested_version("2.5.2") and not compat.tested_version("2.7.0")


class MemoryLogger(Logger):
    """Records the steps at which Lightning writes the logged metrics."""

    def __init__(self):
        super().__init__()
        self.steps: list[int] = []

    name, version = "memory", 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        if "x" in metrics:
            self.steps.append(step)


class Tiny(L.LightningModule):
    """Three batches an epoch; records what the adapter answers at each step. ``resume_fix``: apply the adapter's
    two resume corrections, as wanexp's module does."""

    def __init__(self, resume_fix: bool = True):
        super().__init__()
        self.w = nn.Linear(2, 1)
        self.resume_fix = resume_fix
        self.seen: list[tuple] = []  # (global step, logs this step, attached trainer is the trainer)
        self.saves: list[int] = []  # the global step of every checkpoint written

    def training_step(self, batch, batch_idx):
        t = self.trainer
        self.seen.append((t.global_step, compat.logs_this_step(t), compat.attached_trainer(self) is t))
        self.log("x", float(batch_idx))
        return self.w(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.arange(2 * 2 * BATCHES, dtype=torch.float32).view(-1, 2), batch_size=2)

    def on_save_checkpoint(self, checkpoint):
        self.saves.append(self.trainer.global_step)

    def on_load_checkpoint(self, checkpoint):
        if self.resume_fix:
            compat.mend_epoch_progress(checkpoint)

    def on_train_start(self):
        if self.resume_fix:
            compat.open_next_epoch_after_resume(self.trainer)


class SaveAt(Callback):
    """Saves through ``save_checkpoint_now`` at the given steps' ends; records the last-batch flag of every batch."""

    def __init__(self, steps):
        self.steps, self.last_batch, self.writes = set(steps), [], []

    def on_train_start(self, trainer, pl_module):
        compat.skip_sigterm_broadcast(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.last_batch.append((batch_idx, compat.is_last_batch(trainer)))
        if trainer.global_step in self.steps:
            before = len(pl_module.saves)
            compat.save_checkpoint_now(trainer.checkpoint_callback, trainer)
            first = len(pl_module.saves)
            compat.save_checkpoint_now(trainer.checkpoint_callback, trainer)  # a second call in a step is skipped
            self.writes.append((trainer.global_step, first - before, len(pl_module.saves) - first))


def fit(folder, max_steps=3 * BATCHES, ckpt=None, save=(), resume_fix=True):
    """One tiny CPU fit; its checkpoints are written only by ``save_checkpoint_now`` (no cadence of their own)."""
    module, saver, logger = Tiny(resume_fix), SaveAt(save), MemoryLogger()
    checkpoints = ModelCheckpoint(dirpath=folder, filename="{step}", save_top_k=-1, save_last=True,
                                  every_n_train_steps=0, every_n_epochs=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, log_every_n_steps=LOG_EVERY,
                        logger=logger, callbacks=[saver, checkpoints], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ckpt_path=ckpt, weights_only=True)
    return trainer, module, saver, logger


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("uninterrupted")
    return folder, *fit(folder, save=(BATCHES, BATCHES + 2))


def test_attached_trainer_reads_what_module_trainer_refuses_to_give():
    module = Tiny()
    assert compat.attached_trainer(module) is None
    with pytest.raises(RuntimeError, match="not attached"):
        module.trainer  # why the adapter reads the private slot: the public property raises


def test_log_steps_are_the_steps_lightning_writes_the_logs(uninterrupted):
    _, trainer, module, _, logger = uninterrupted
    assert all(attached for *_, attached in module.seen)
    asked = [step for step, logs, _ in module.seen if logs]
    assert asked == [s for s in range(3 * BATCHES) if (s + 1) % LOG_EVERY == 0]  # the step about to be taken
    assert logger.steps == asked  # what self.log wrote to the logger, at the same steps


def test_last_batch_is_each_epochs_last(uninterrupted):
    saver = uninterrupted[3]
    assert saver.last_batch == [(i, i == BATCHES - 1) for i in range(BATCHES)] * 3


def test_sigterm_broadcast_is_the_epoch_loops_attribute_and_is_switched_off(uninterrupted):
    trainer = uninterrupted[1]
    loop = trainer.fit_loop.epoch_loop
    # Lightning calls it by this name before every batch under several ranks; the adapter replaces it per fit
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(type(loop).advance)
    assert callable(type(loop)._broadcast_sigterm_tensor)
    assert loop._broadcast_sigterm_tensor() is None and "_broadcast_sigterm_tensor" in vars(loop)


def test_save_checkpoint_now_writes_the_step_file_and_last_once(uninterrupted):
    folder, saver = uninterrupted[0], uninterrupted[3]
    assert [(step, first > 0, again) for step, first, again in saver.writes] == \
        [(BATCHES, True, 0), (BATCHES + 2, True, 0)]  # the second call in a step writes nothing
    assert {f.name for f in folder.iterdir()} == {f"step={BATCHES}.ckpt", f"step={BATCHES + 2}.ckpt", "last.ckpt"}


def test_a_resume_from_an_epochs_last_step_needs_the_epoch_reopened(uninterrupted, tmp_path):
    """Lightning leaves the epoch counters one behind after a resume from an epoch's last step (the reason for
    ``open_next_epoch_after_resume``); with it, they end as in the uninterrupted run."""
    folder, trainer, module, *_ = uninterrupted
    reference = trainer.fit_loop.epoch_progress.current.state_dict()
    ckpt = str(folder / f"step={BATCHES}.ckpt")
    plain = fit(tmp_path / "plain", ckpt=ckpt, save=(BATCHES + 2,), resume_fix=False)
    assert plain[0].fit_loop.epoch_progress.current.state_dict() != reference, \
        "Lightning now reopens the epoch itself: open_next_epoch_after_resume (and mend_epoch_progress) may go"
    fixed = fit(tmp_path / "fixed", ckpt=ckpt, resume_fix=True)
    assert fixed[0].fit_loop.epoch_progress.current.state_dict() == reference
    assert fixed[1].seen == module.seen[BATCHES:]


def test_mend_makes_a_checkpoint_of_an_unmended_resume_read_as_an_uninterrupted_one(uninterrupted, tmp_path):
    """A checkpoint written mid-epoch by a run resumed without the fix counts its epoch as processed; mended, its
    epoch counters are those of the uninterrupted run's checkpoint at the same step, and the resume ends the same."""
    folder, trainer, module, *_ = uninterrupted
    fit(tmp_path / "plain", ckpt=str(folder / f"step={BATCHES}.ckpt"), save=(BATCHES + 2,), resume_fix=False)
    unmended = str(tmp_path / "plain" / f"step={BATCHES + 2}.ckpt")
    saved = torch.load(unmended, weights_only=True)
    counts = dict(saved["loops"]["fit_loop"]["epoch_progress"]["current"])
    assert counts["ready"] == counts["processed"] == counts["completed"]  # the shape mend recognises
    compat.mend_epoch_progress(saved)
    expected = torch.load(folder / f"step={BATCHES + 2}.ckpt", weights_only=True)
    assert saved["loops"]["fit_loop"]["epoch_progress"]["current"] == \
        expected["loops"]["fit_loop"]["epoch_progress"]["current"]
    resumed = fit(tmp_path / "mended", ckpt=unmended, resume_fix=True)
    assert resumed[0].fit_loop.epoch_progress.current.state_dict() == \
        trainer.fit_loop.epoch_progress.current.state_dict()
    assert resumed[1].seen == module.seen[BATCHES + 2:]


def test_mend_leaves_an_uninterrupted_runs_checkpoint_alone(uninterrupted):
    saved = torch.load(uninterrupted[0] / f"step={BATCHES + 2}.ckpt", weights_only=True)
    before = {k: dict(v) for k, v in saved["loops"]["fit_loop"]["epoch_progress"].items()}
    compat.mend_epoch_progress(saved)
    assert saved["loops"]["fit_loop"]["epoch_progress"] == before


def test_the_strategy_hooks_wanexp_overrides_are_still_lightnings():
    """wanexp/parallel/ extends two strategies through private hooks (by subclassing, outside this adapter): a
    Lightning version that renamed them would silently skip wanexp's additions."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

    assert callable(getattr(ModelParallelStrategy, "_setup_distributed", None))
    assert callable(getattr(DeepSpeedStrategy, "_initialize_deepspeed_train", None))
