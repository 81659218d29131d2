"""Disk in bounds, on tiny runs in process: the start check, LoRA export retention, a full disk during an export."""
from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.conftest import compose_cfg
from wanexp.train import cli

Usage = namedtuple("Usage", "total used free")


def _cli_error(cfg, capsys, command=cli) -> str:
    with pytest.raises(SystemExit) as e:
        command(cfg)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("wanexp: error:")]
    assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in captured.err, captured.err[-3000:]
    return lines[0], captured.out


def test_a_run_that_cannot_hold_its_checkpoints_and_exports_stops_before_writing(tiny_overrides, tmp_path, capsys,
                                                                                monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    line, _ = _cli_error(compose_cfg(tiny_overrides), capsys)
    out = tmp_path / "run"
    assert line.startswith(f"wanexp: error: paths.output_dir={out}: needs ~") and " (checkpoints 2 x " in line
    assert line.endswith("), 1000 B free; free space or set callbacks.lora_export.keep_last / "
                         "callbacks.checkpoint.save_top_k lower")
    assert not out.exists()  # a refused run writes nothing (its reject list neither)


def test_exports_are_pruned_and_a_full_disk_during_one_is_one_line(tiny_overrides, tmp_path, capsys, monkeypatch):
    """Exports every step, the newest 2 and every 2nd kept; the disk fills during step 5's (the last) export: one
    line, exit 2, the partial export removed, the earlier exports and checkpoints whole."""
    from safetensors import SafetensorError

    import wanexp.adapters.export

    real = wanexp.adapters.export.save_file

    def save_file(tensors, path, metadata=None):
        if "step_000005" in str(path):
            Path(path).write_bytes(b"partial")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(wanexp.adapters.export, "save_file", save_file)
    cfg = compose_cfg([*tiny_overrides, "trainer.max_steps=5", "callbacks.checkpoint.every_n_train_steps=1",
                       "callbacks.lora_export.keep_last=2", "callbacks.lora_export.keep_every=2"])
    line, printed = _cli_error(cfg, capsys)
    # held at most: 3 + 1 checkpoints; exports: the newest 2 + milestones 2, 4 (one of them the newest) + final
    assert "wanexp: disk: ~" in printed and "(checkpoints 4 x " in printed and "LoRA exports 4 x " in printed
    out = tmp_path / "run"
    assert line.startswith(f"wanexp: error: disk full while saving the LoRA export of step 5 "
                           f"({out}/lora/step_000005): free space on /")
    assert line.endswith("or lower retention (callbacks.lora_export.keep_last / callbacks.checkpoint.save_top_k); "
                         "the previous export step_000004 is intact and this step's checkpoint was not written; then "
                         "continue with resume=last")
    # step 1 pruned once step 4's export was whole; 2 is a milestone; step 5's partial export is gone
    assert sorted(p.name for p in (out / "lora").iterdir()) == ["step_000002", "step_000003", "step_000004"]
    assert all(len(list((out / "lora" / s).glob("*.safetensors"))) == 2 for s in ("step_000002", "step_000004"))
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step_000002.ckpt", "step_000003.ckpt",
                                                      "step_000004.ckpt"]
    assert torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 4
    status = json.loads((out / "status.json").read_text())
    assert Path(status["last_checkpoint"]).is_file()
    assert status["state"] == "failed" and f"wanexp: error: {status['error']}" == line  # why it stopped


class FillDiskAt(Callback):
    """Fills the disk (a FullDisk) when optimizer step ``step`` starts: as another process filling it mid-run."""

    disk = None  # the test's FullDisk

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step - 1:
            type(self).disk.full = True


def _fill_at(step: int) -> list[str]:
    return ["+callbacks.zz_fill._target_=tests.integration.test_disk.FillDiskAt", f"+callbacks.zz_fill.step={step}"]


def _full_disk(root, monkeypatch):
    from tests.faults.disk_full import FullDisk

    disk = FullDisk(root).install(monkeypatch)
    monkeypatch.setattr(FillDiskAt, "disk", disk)
    return disk


def test_a_disk_filled_mid_run_is_one_line_leaves_no_temporary_file_and_resume_continues(tiny_overrides, tmp_path,
                                                                                         capsys, monkeypatch):
    """The disk fills after step 2's checkpoint: the status writer is the first to meet it (step 3). One line, exit
    2, no traceback (also none from the failed status write or the loggers' last writes); no temporary file is left;
    status.json keeps what it last said (it cannot be written). Once space is freed, resume=last continues."""
    from tests.faults.disk_full import temporaries

    out = tmp_path / "run"
    disk = _full_disk(out, monkeypatch)
    base = [*tiny_overrides, "trainer.max_steps=5", "callbacks.checkpoint.every_n_train_steps=2"]
    line, _ = _cli_error(compose_cfg([*base, *_fill_at(3)]), capsys)
    assert line.startswith(f"wanexp: error: disk full while saving the run status ({out}/status.json): free space on ")
    assert line.endswith("the last checkpoint is intact; then continue with resume=last")
    assert disk.failed and not temporaries(out)
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "running" and status["step"] == 2
    disk.full = False  # space freed
    capsys.readouterr()
    cli(compose_cfg([*base, "resume=last"]))
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
    assert torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 5
    assert not temporaries(out)


@pytest.mark.parametrize("where,what", [
    ("checkpoints", "checkpoint {out}/checkpoints/step_000004.ckpt"),
    ("validation", "the validation video {out}/validation/step_000004/p0_s0.mp4"),
], ids=["checkpoint", "validation-video"])
def test_a_disk_full_where_the_status_can_still_be_written_says_why_in_it(tiny_overrides, tmp_path, capsys,
                                                                          monkeypatch, where, what):
    """The disk fills for one writer (the checkpoint at step 4, the validation video at step 4), the status writer
    still has room: one line, exit 2, status.json failed with that line, no temporary file."""
    from tests.faults.disk_full import temporaries

    out = tmp_path / "run"
    _full_disk(out / where, monkeypatch)
    line, _ = _cli_error(compose_cfg([
        *tiny_overrides, "trainer.max_steps=5", "callbacks.checkpoint.every_n_train_steps=2", *_fill_at(4),
        "callbacks.validation.every_n_steps=4", "callbacks.validation.at_start=false", "callbacks.validation.steps=1",
        "callbacks.validation.prompts=[a red ball]", "callbacks.validation.seeds=[0]"]), capsys)
    assert line.startswith(f"wanexp: error: disk full while saving {what.format(out=out)}"), line
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "failed" and f"wanexp: error: {status['error']}" == line
    assert not temporaries(out)


def test_a_full_disk_while_caching_is_one_line_and_the_rerun_continues(shared_dir, tmp_path, capsys, monkeypatch):
    """The cache command on a full disk: one line (exit 2) naming the shard it was saving, or the cache folder when
    the first write that fails names no file (the reject list); no temporary shard left. Once space is freed the
    same command caches every entry."""
    from tests.faults.disk_full import temporaries
    from wanexp.cli.cache import cache_cli
    from wanexp.data.cache import CacheIndex

    cache = tmp_path / "cache"
    disk = _full_disk(cache, monkeypatch)
    cfg = compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models",
                       f"paths.data_dir={shared_dir}/data", f"data.cache_dir={cache}", "data.cache_shard_size=4"])
    then = "; then run the same cache command again (it encodes only what is missing)"
    disk.full = True
    line, _ = _cli_error(cfg, capsys, cache_cli)
    assert line.startswith(f"wanexp: error: disk full while saving a file in {cache}: free space on "), line
    assert line.endswith(f"; the entries written before it are kept{then}")
    disk.names = "*.safetensors*"  # room for the small files, none for a shard
    line, _ = _cli_error(cfg, capsys, cache_cli)
    assert line.startswith(f"wanexp: error: disk full while saving the cache shard {cache}/text-r000-00000.safetensors"
                           ": free space on "), line
    assert line.endswith(then) and not temporaries(cache)
    disk.full = False
    cache_cli(cfg)
    assert len(CacheIndex(cache)) == 20 and not temporaries(cache)
