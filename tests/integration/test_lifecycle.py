"""Runs that lose nothing: a signal saves a checkpoint at the end of the step and exits 128+signal with the run marked
interrupted, and resume=last continues from it; checkpoint files are written atomically."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, run_cli
from wanexp.callbacks.checkpoint import AtomicCheckpointIO, CheckpointWriteError


def _start(shared_dir, out, steps=400):
    args = ["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
            "data.use_cache=false", f"trainer.max_steps={steps}", "trainer.log_every_n_steps=1",
            "callbacks.checkpoint.every_n_train_steps=1000", "callbacks.progress=null", f"paths.output_dir={out}"]
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")), args


def _wait_for_step(out: Path, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if json.loads((out / "status.json").read_text()).get("step", 0) >= step:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.05)
    raise AssertionError("the run did not reach the step in time")


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGUSR1, 138), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGUSR1", "SIGINT"])
def test_a_signal_saves_marks_interrupted_and_resumes(shared_dir, tmp_path, sig, code):
    out = tmp_path / "run"
    proc, args = _start(shared_dir, out)
    _wait_for_step(out, 3)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "interrupted" and status["signal"] == sig.name
    step = status["step"]
    assert f"interrupted by {sig.name} at step {step}" in err and "resume=last" in err
    last = out / "checkpoints" / "last.ckpt"
    assert last.is_file() and torch.load(last, map_location="cpu", weights_only=False)["global_step"] == step
    assert (out / "lora" / f"step_{step:06d}" / "tiny_lora_comfyui.safetensors").is_file()
    if sig != signal.SIGTERM:
        return  # the same checkpoint path as SIGTERM's, resumed below
    res = run_cli([*args[:-1], f"paths.output_dir={out}", "resume=last", f"trainer.max_steps={step + 2}",
                   "allow_resume_changes=true"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((out / "status.json").read_text())["step"] == step + 2


def test_checkpoints_are_written_atomically(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "ckpts" / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}

    def broken_save(obj, f):  # a kill or a full disk in the middle of the write
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(CheckpointWriteError, match=r"cannot write checkpoint .*last.ckpt \(No space left on device\); "
                                                   r"the previous checkpoint is intact"):
        io.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 1}  # the previous file, whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temporary file left
