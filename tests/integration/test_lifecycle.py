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


def test_a_live_run_folder_is_locked(shared_dir, tmp_path):
    out = tmp_path / "run"
    proc, args = _start(shared_dir, out)
    try:
        _wait_for_step(out, 2)
        before = sorted(p.name for p in out.rglob("*"))
        res = run_cli([*args[:-1], f"paths.output_dir={out}", "overwrite=true"], timeout=120)
        errors = [line for line in res.stderr.splitlines() if line.startswith("wanexp: error:")]
        assert res.returncode == 2 and len(errors) == 1, res.stderr[-2000:]
        assert f"is in use by a live run (pid {proc.pid} on " in errors[0]
        assert set(before) <= {p.name for p in out.rglob("*")}  # overwrite=true deleted nothing of the live run
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    res = run_cli([*args[:-1], f"paths.output_dir={out}", "resume=last", "allow_resume_changes=true",
                   "trainer.max_steps=1"], timeout=300)  # the lock went with its process
    assert "in use by a live run" not in res.stderr


def test_resume_last_takes_the_newest_checkpoint_and_unwritable_folders_are_one_line(tmp_path):
    from omegaconf import OmegaConf

    from wanexp.errors import ConfigError
    from wanexp.train import lock_run_folder, resume_path, unlock_run_folder

    out = tmp_path / "run"
    cfg = OmegaConf.create({"resume": "last"})
    with pytest.raises(ConfigError, match="holds no checkpoint yet; start it fresh"):
        resume_path(cfg, out)
    (out / "checkpoints").mkdir(parents=True)
    for step in (2, 4):  # killed after saving step 4 but before last.ckpt linked it
        (out / "checkpoints" / f"step_{step:06d}.ckpt").write_bytes(b"x")
    assert resume_path(cfg, out).endswith("step_000004.ckpt")
    (out / "checkpoints" / "last.ckpt").symlink_to("step_000004.ckpt")
    assert resume_path(cfg, out).endswith("last.ckpt")
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"paths.output_dir=.*/file/run: cannot write there"):
        lock_run_folder(blocked / "run")
    lock_run_folder(out)
    unlock_run_folder(out)
