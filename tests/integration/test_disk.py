"""Disk in bounds, on tiny runs in process: the start check, LoRA export retention, a full disk during an export."""
from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from tests.conftest import compose_cfg
from wanexp.train import cli

Usage = namedtuple("Usage", "total used free")


def _cli_error(cfg, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli(cfg)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("wanexp: error:")]
    assert e.value.code == 2 and len(lines) == 1, captured.err[-3000:]
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

    import wanexp.lora

    real = wanexp.lora.save_file

    def save_file(tensors, path, metadata=None):
        if "step_000005" in str(path):
            Path(path).write_bytes(b"partial")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(wanexp.lora, "save_file", save_file)
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
