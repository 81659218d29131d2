"""Runs that lose nothing: a signal saves a checkpoint at the end of the step and exits 128+signal with the run marked
interrupted, and resume=last continues from it; checkpoint files are written atomically."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file

from tests.conftest import ROOT, compose_cfg
from wanexp.callbacks.checkpoint import AtomicCheckpointIO, CheckpointWriteError
from wanexp.train import cli, run


def _start(shared_dir, out, steps=400, env=None, extra=()):
    args = ["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
            "data.use_cache=false", f"trainer.max_steps={steps}", "trainer.log_every_n_steps=1",
            "callbacks.checkpoint.every_n_train_steps=1000", "callbacks.progress=null", *extra,
            f"paths.output_dir={out}"]
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))), args


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
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGUSR1, 138)], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_saves_marks_interrupted_and_resumes(shared_dir, tmp_path, sig, code):
    """SIGINT (exit 130): the live run of test_a_live_run_folder_is_locked ends with it (one process fewer)."""
    out = tmp_path / "run"
    env = None
    if sig == signal.SIGUSR1:  # as a SLURM job step (Lightning sees SLURM too), with a scontrol that records its call
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol.calls\n")
        (bin_dir / "scontrol").chmod(0o755)
        env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1",
               "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train"}
    # SIGTERM comes from inside, late in step 3 (from a callback after the preemption callback's step-end check):
    # Lightning's own handler used to see it first and end the run at that step with exit code 0, no checkpoint and
    # the status not interrupted; it is now saved at the end of step 4.
    late = ["+callbacks.zz_signal._target_=tests.helpers.SignalAtStep", "+callbacks.zz_signal.step=3"]
    proc, args = _start(shared_dir, out, env=env, extra=late if sig == signal.SIGTERM else ())
    if sig != signal.SIGTERM:
        _wait_for_step(out, 3)
        proc.send_signal(sig)
    out_text, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    if env:  # requeued once, after the step-end save (not from inside the handler: no hpc_ckpt of Lightning's)
        assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n"
        assert "SLURM job 4242 requeued" in out_text and not list(out.rglob("hpc_ckpt*"))
    step = _saved_and_interrupted(out, sig, err)
    assert step == 4 or sig != signal.SIGTERM
    if sig != signal.SIGTERM:
        return  # the same checkpoint path as SIGTERM's, resumed below
    # resumed in this process (a fresh process's imports cost ~8 s; the signal handling above is the subprocess's)
    run(compose_cfg([*args[:-1], f"paths.output_dir={out}", "resume=last", f"trainer.max_steps={step + 2}",
                     "allow_resume_changes=true"]))
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
    with pytest.raises(CheckpointWriteError, match=r"disk full while saving checkpoint .*last.ckpt: free space on .*"
                                                   r"the previous checkpoint is intact"):
        io.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 1}  # the previous file, whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temporary file left


def _saved_and_interrupted(out: Path, sig: signal.Signals, err: str) -> int:
    """A signalled run saved a checkpoint and a LoRA export at the end of its step, marked itself interrupted and
    said so on stderr (naming resume=last): that step."""
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "interrupted" and status["signal"] == sig.name
    step = status["step"]
    assert f"interrupted by {sig.name} at step {step}" in err and "resume=last" in err
    last = out / "checkpoints" / "last.ckpt"
    assert last.is_file() and torch.load(last, map_location="cpu", weights_only=False)["global_step"] == step
    assert (out / "lora" / f"step_{step:06d}" / "tiny_lora_comfyui.safetensors").is_file()
    return step


@pytest.mark.slow
def test_a_live_run_folder_is_locked(shared_dir, tmp_path, capsys):
    """Also: SIGINT (Ctrl-C) ends the live run like the signals of test_a_signal_saves_marks_interrupted_and_resumes
    (exit 130, saved, interrupted)."""
    out = tmp_path / "run"
    proc, args = _start(shared_dir, out)
    try:
        _wait_for_step(out, 2)
        before = sorted(p.name for p in out.rglob("*"))
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:  # the CLI's refusal, in this process: the live run is the other one
            cli(compose_cfg([*args[:-1], f"paths.output_dir={out}", "overwrite=true"]))
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("wanexp: error:")]
        assert e.value.code == 2 and len(errors) == 1, err[-2000:]
        assert f"is in use by a live run (pid {proc.pid} on " in errors[0]
        assert set(before) <= {p.name for p in out.rglob("*")}  # overwrite=true deleted nothing of the live run
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    _saved_and_interrupted(out, signal.SIGINT, err)
    from wanexp.runfolder import RunLock

    lock = RunLock(out, 600)  # the lock went with its process, which released it: no stale holder to take over
    lock.acquire()
    lock.release()
    assert "stale" not in capsys.readouterr().out


def test_resume_last_takes_the_newest_checkpoint_and_unwritable_folders_are_one_line(tmp_path):
    from wanexp.errors import ConfigError
    from wanexp.runfolder import RunLock, resume_path

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="holds no checkpoint yet; start it fresh"):
        resume_path("last", out)
    assert resume_path("auto", out) is None  # a requeued job's first start
    (out / "checkpoints").mkdir(parents=True)
    for step in (2, 4):  # killed after saving step 4 but before last.ckpt linked it
        (out / "checkpoints" / f"step_{step:06d}.ckpt").write_bytes(b"x")
    (out / "checkpoints" / ".step_000006.ckpt.123.tmp").write_bytes(b"half")  # killed during the next save
    assert resume_path("last", out).endswith("step_000004.ckpt")
    assert resume_path("auto", out).endswith("step_000004.ckpt")
    (out / "checkpoints" / "last.ckpt").symlink_to("step_000004.ckpt")
    assert resume_path("last", out).endswith("last.ckpt")
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"paths.output_dir=.*/file/run: cannot write there"):
        RunLock(blocked / "run", 60).acquire()
    lock = RunLock(out, 60)
    lock.acquire()
    lock.release()


def _tmpdir_elsewhere(tmp_path: Path) -> Path:
    """A $TMPDIR on another filesystem than the run folder (tmpfs where there is one), as on clusters."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != tmp_path.stat().st_dev:
        import tempfile

        return Path(tempfile.mkdtemp(prefix="wanexp-test-", dir=shm))
    (tmp_path / "tmpdir").mkdir()
    return tmp_path / "tmpdir"


def _complete_checkpoints(out: Path) -> dict[str, int]:
    """Every checkpoint under its final name loads (weights_only) and is complete: name -> its step."""
    found = {}
    for f in sorted((out / "checkpoints").glob("*.ckpt")):
        if f.is_file():
            found[f.name] = torch.load(f, map_location="cpu", weights_only=True)["global_step"]
    return found


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_reaches_the_uninterrupted_weights(shared_dir, tmp_path, monkeypatch):
    """2 SIGKILLs of one run (one at a random moment, one while a checkpoint is being written, with $TMPDIR on
    another filesystem), each followed by resume=auto; the run ends with the LoRA weights of an uninterrupted run with
    the same seed, bit for bit (the data order, the optimizer and the random streams all resume exactly). The killed
    sessions are processes of their own; the last session runs in this process (a process's imports cost ~8 s)."""
    steps = 14
    common = ["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
              "data.use_cache=false", f"trainer.max_steps={steps}", "trainer.log_every_n_steps=1",
              "callbacks.checkpoint.every_n_train_steps=2", "callbacks.progress=null", "overwrite=false"]
    run(compose_cfg([*common, f"paths.output_dir={tmp_path / 'ref'}"]))  # the uninterrupted run, in this process

    tmpdir = _tmpdir_elsewhere(tmp_path)
    secret = "wanexp-test-secret-0123456789"  # a W&B key in the environment must never reach the run folder
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmpdir), WANDB_API_KEY=secret,
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "faults"), str(ROOT)]))
    out = tmp_path / "killed"
    rng = random.Random(20261126)
    for trial in range(2):
        during_save = trial == 1
        newest = max(_complete_checkpoints(out).values(), default=0) if out.exists() else 0
        log = tmp_path / f"trial{trial}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *common, f"paths.output_dir={out}",
                                     "resume=auto"], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    env=dict(env, WANEXP_TEST_SLOW_FSYNC="2" if during_save else ""))
            deadline = time.time() + 120
            target = min(steps - 5, newest + rng.randint(1, 3))  # the kill comes before the run could end
            while time.time() < deadline and proc.poll() is None:
                if during_save:  # this process is writing a checkpoint: its temporary file exists, its final name not
                    if list((out / "checkpoints").glob(f".step_*.{proc.pid}.tmp")):  # (not an earlier kill's leftover)
                        break
                else:
                    try:
                        status = json.loads((out / "status.json").read_text())
                        if status.get("pid") == proc.pid and status["step"] >= target:
                            time.sleep(rng.uniform(0, 0.4))
                            break
                    except (FileNotFoundError, json.JSONDecodeError, KeyError):
                        pass
                time.sleep(0.01)
            assert proc.poll() is None, f"trial {trial}: the run ended before the kill:\n{log.read_text()[-2000:]}"
            proc.kill()
            proc.wait()
        text = log.read_text()
        if newest:  # it continued from the newest complete checkpoint
            line = next(x for x in text.splitlines() if "resume=auto: continuing from" in x)
            assert line.endswith(f"/checkpoints/step_{newest:06d}.ckpt"), line
        else:
            assert "resume=auto: no checkpoint yet, starting fresh" in text
        saved = _complete_checkpoints(out)  # each final-named file is whole, whenever the kill came
        assert all(name == "last.ckpt" or name == f"step_{step:06d}.ckpt" for name, step in saved.items()), saved
        if during_save:
            assert list((out / "checkpoints").glob(f".step_*.{proc.pid}.tmp")), "the kill came during a save"

    # the last session, in this process: its $TMPDIR and W&B key as the killed sessions had them
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))  # tempfile keeps the folder it found first
    monkeypatch.setenv("WANDB_API_KEY", secret)
    run(compose_cfg([*common, f"paths.output_dir={out}", "resume=auto"]))
    for name in ("tiny_lora_comfyui.safetensors", "tiny_lora_diffusers.safetensors"):
        a, b = load_file(tmp_path / "ref" / "lora" / "final" / name), load_file(out / "lora" / "final" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step_000010.ckpt", "step_000012.ckpt", "step_000014.ckpt"]  # exactly K=3 kept
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]  # the killed save's temporary file is gone
    assert not [p for p in tmpdir.rglob("*") if p.is_file() and p.stat().st_size > 4096]  # nothing big in $TMPDIR
    assert not [p for p in out.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    metrics = sorted((out / "logs").glob("version_*/metrics.csv"))
    assert len(metrics) >= 2  # every session kept its own metrics (none deleted or overwritten)


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("change,needle", [
    (["adapter.rank=8"], "resume: adapter.rank=4 in the checkpoint, 8 now: the checkpoint's weights have another "
                         "layout; resume with its settings, or start a new run (another run_name)"),
    (["optim.lr=5e-3"], "resume: optim.lr=0.01 in the checkpoint, 0.005 now; resume with the checkpoint's settings, "
                        "or pass allow_resume_changes=true"),
    (["resume=CONFIG"], "/config.yaml: a text file, not a checkpoint; pass a .ckpt file"),
], ids=["rank", "lr", "config.yaml"])
def test_a_refused_resume_leaves_the_run_folder_as_it_was(trained, tmp_path, capsys, change, needle):
    """An interrupted run resumed with other settings (or from a file that is no checkpoint) is refused with one
    line, and every file of it (status.json, config.yaml, rejects.jsonl, .lock, logs/, checkpoints) stays as it was,
    bytes and mtime (no new logs/version_N)."""
    import shutil

    from tests.conftest import compose_cfg
    from wanexp.train import cli

    src = trained("tiny")
    out = tmp_path / "run"
    shutil.copytree(src["output_dir"], out, symlinks=True)
    status = json.loads((out / "status.json").read_text())
    (out / "status.json").write_text(json.dumps(dict(status, state="interrupted", step=2)))
    overrides = [o.replace("CONFIG", str(out / "config.yaml")) for o in change]
    if not any(o.startswith("resume=") for o in overrides):
        overrides.append("resume=last")
    cfg = compose_cfg([*_tiny_overrides(src["cfg"], out), *overrides])
    before = _snapshot(out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli(cfg)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("wanexp: error: ") and needle in err[0], err
    assert _snapshot(out) == before  # every file's bytes and mtime: the reject list and the lock too
    assert sorted(p.name for p in (out / "logs").iterdir()) == \
        sorted(p.name for p in (Path(src["output_dir"]) / "logs").iterdir())  # no new logs/version_N


def _tiny_overrides(cfg, out: Path) -> list[str]:
    """The overrides of tests/integration/conftest.py:tiny_run for layout 'tiny', with the run folder moved."""
    return ["experiment=demo", f"paths.tiny_model_dir={cfg.paths.tiny_model_dir}",
            f"paths.data_dir={cfg.paths.data_dir}", f"paths.output_dir={out}", "trainer.max_steps=4",
            "callbacks.checkpoint.every_n_train_steps=2", "trainer.log_every_n_steps=1", "callbacks.progress=null",
            "adapter.rank=4", "adapter.alpha=2", "optim.lr=1e-2", "optim.warmup_steps=0", "model=tiny"]


def test_wanexps_error_is_the_last_line_after_wandbs_own(monkeypatch, capsys):
    """W&B prints its closing lines when it shuts down (at exit, unless told earlier): a failed run shuts it down
    first, so that wanexp's one line is the last line of the output."""
    import sys
    import types

    import wanexp.train as train
    from wanexp.callbacks.wandb_logger import WandbLoginError

    calls = []
    fake = types.ModuleType("wandb")
    fake.run = None  # W&B could not start the run (no network)

    def teardown(exit_code=None):
        calls.append("teardown")
        print("wandb: Find logs at: DIR/wandb/run-x/logs", file=sys.stderr, flush=True)

    fake.teardown = teardown
    monkeypatch.setitem(sys.modules, "wandb", fake)

    def refused(cfg):
        raise WandbLoginError("logger=wandb: W&B could not start the run (context deadline exceeded); log in")

    monkeypatch.setattr(train, "run", refused)
    with pytest.raises(SystemExit) as e:
        train.cli(compose_cfg_light())
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and calls == ["teardown"]
    assert err[-1].startswith("wanexp: error: logger=wandb: W&B could not start the run") and "wandb: Find" in err[0]
    # a run that started: finished as failed (exit code 2), then shut down, then the line
    run = types.SimpleNamespace(summary={})
    fake.run = run
    fake.finish = lambda exit_code: calls.append(f"finish {exit_code}")
    calls.clear()
    with pytest.raises(SystemExit):
        train.cli(compose_cfg_light())
    err = capsys.readouterr().err.strip().splitlines()
    assert calls == ["finish 2", "teardown"] and err[-1].startswith("wanexp: error: ")
    assert run.summary["wanexp/state"] == "failed"


def test_the_wandb_logger_writes_nothing_until_its_run_starts(tmp_path):
    from wanexp.callbacks.wandb_logger import RunWandbLogger

    RunWandbLogger(save_dir=str(tmp_path / "run"), mode="offline")  # built with the trainer, before the checks end
    assert not (tmp_path / "run").exists()


def compose_cfg_light():
    from tests.conftest import compose_cfg

    return compose_cfg(["model.path=/m"])
