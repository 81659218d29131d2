"""Observability pieces without training: the status command, the sweep summary and job list, the run's step total,
the W&B logger's environment fallbacks and how a W&B run is finished."""
from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from wanexp.callbacks.progress import total_optimizer_steps
from wanexp.callbacks.sweep import grid_points, write_summary
from wanexp.cli import status as status_cli


def _run(folder: Path, **status) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    base = {"state": "finished", "run_name": folder.name, "step": 10, "total_steps": 10, "updated": time.time()}
    (folder / "status.json").write_text(json.dumps({**base, **status}))
    return folder


@pytest.mark.parametrize("follow", [[], ["--follow"]], ids=["once", "follow"])
def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path, follow):
    """``wanexp-status RUN | head -1``: once the reader has gone, the command exits as Unix tools do (128 + SIGPIPE),
    with nothing on stderr (no BrokenPipeError traceback, none at exit either)."""
    run = _run(tmp_path / "run", state="running", step=40, total_steps=100, pid=os.getpid(),
               host=socket.gethostname())
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write meets a closed pipe
    try:
        r = subprocess.run([sys.executable, "-m", "wanexp.cli.status", str(run), *follow], stdout=write,
                           stderr=subprocess.PIPE, cwd=ROOT, timeout=60)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr.decode()) == (141, "")


def test_status_command_prints_a_run_with_its_ranks(tmp_path, capsys):
    ranks = [{"rank": r, "step": 40, "loss": 0.1 + r, "samples_per_s": 3.0, "mem_gib": 12.5, "peak_mem_gib": 13.0,
              "gpu_util": 97.0, "gpu_power_w": 684.0 - r, "gpu_power_limit_w": 700.0, "gpu_clock_mhz": 1752.0 + r,
              "rejected_online": r} for r in range(2)]
    run = _run(tmp_path / "run", state="running", step=40, total_steps=100, eta_s=3725, loss=0.123, lr=1e-4,
               samples_per_s=6.0, tokens_per_s=26400.0, tflops=300.0, pct_of_peak=38.0, mem_gib=12.5,
               peak_mem_gib=13.0, gpu_util=97.0, gpu_power_w=684.0, gpu_power_limit_w=700.0, gpu_clock_mhz=1752.0,
               last_checkpoint="/x/step_000040.ckpt", rejected_online=1, data={"rejected": 2}, host="elsewhere",
               pid=1, world_size=2, ranks=ranks)
    assert status_cli.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "40 / 100 (40.0 %)" in out and "1:02:05" in out and "38.0 % of peak" in out and "step_000040" in out
    assert "2 before training, 1 during" in out
    assert "GPU 97 %   684 W of 700   SM 1752 MHz" in out
    rows = [ln.split() for ln in out.split("per rank")[1].splitlines()[3:]]
    assert [r[:3] for r in rows] == [["0", "40", "0.1"], ["1", "40", "1.1"]]
    assert [r[7:9] for r in rows] == [["684", "1752"], ["683", "1753"]]  # W, SM MHz


def test_the_status_file_reads_what_nvml_reports_of_the_gpu(monkeypatch):
    """status.json's GPU fields (wanexp.callbacks.status_file._gpu): memory always on a GPU; utilisation, power, its
    limit and the SM clock where NVML reports them; a reading NVML refuses is left out, not a failure."""
    from wanexp.callbacks import status_file

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "utilization", lambda: 97)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda: 684_000)  # mW
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda: 1752)
    monkeypatch.setattr(status_file, "_power_limit_w", lambda: 700.0)
    assert status_file._gpu() == {"mem_gib": 3.0, "peak_mem_gib": 5.0, "gpu_util": 97.0, "gpu_power_w": 684.0,
                                  "gpu_power_limit_w": 700.0, "gpu_clock_mhz": 1752.0}

    def refused():
        raise RuntimeError("NVML: not supported")

    monkeypatch.setattr(torch.cuda, "power_draw", refused)
    assert "gpu_power_w" not in status_file._gpu() and status_file._gpu()["gpu_clock_mhz"] == 1752.0


def test_status_command_shows_a_sweep_and_dead_or_stale_runs(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    _run(sweep / "0", run_name="rank_lr/0_adapter.rank=8", loss=0.5)
    _run(sweep / "1", run_name="rank_lr/1_adapter.rank=16", state="failed")
    import socket
    import subprocess

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer exists on this host
    _run(sweep / "2", state="running", host=socket.gethostname(), pid=gone.pid)
    _run(sweep / "10", state="running", host="another-host", pid=1, updated=time.time() - 3600)
    assert status_cli.main([str(sweep)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("4 points (1 dead, 1 failed, 1 finished, 1 stale)")
    assert [ln.split()[0] for ln in lines[3:]] == ["0", "1", "2", "10"]  # numeric order
    assert lines[3].split()[1] == "0_adapter.rank=8"


def test_status_command_bad_folder_is_one_line(tmp_path, capsys):
    assert status_cli.main([str(tmp_path / "nope")]) == 2
    assert status_cli.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("wanexp: error:") for e in err) and "no status.json" in err[1]


def _point(folder: Path, rank: int, lr: str, losses: list[float], val: float | None = None, state="finished"):
    _run(folder, state=state, step=len(losses), samples_per_s=2.0)
    (folder / "config.yaml").write_text(f"overrides:\n- experiment=demo\n- adapter.rank={rank}\n- optim.lr={lr}\n")
    with open(folder / "status.jsonl", "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": i, "loss": loss, "samples_per_s": 2.0 + i,
                                **({"val_loss": val} if val is not None else {})}) + "\n")


def test_sweep_summary_rows_final_loss_and_plots(tmp_path):
    sweep = tmp_path / "rank_lr"
    _point(sweep / "0", 8, "1e-4", [9, 9, 1, 1, 1, 1, 1])  # the mean of the last 5 logged values: 1
    _point(sweep / "1", 8, "2e-4", [2, 2, 2])
    _point(sweep / "2", 16, "1e-4", [3], state="failed")
    (sweep / "3" / ".hydra").mkdir(parents=True)  # a point that never started (a config error)
    (sweep / "3" / ".hydra" / "overrides.yaml").write_text("- adapter.rank=16\n- optim.lr=2e-4\n")
    written = write_summary(sweep)
    rows = list(csv.DictReader(written["csv"].open()))
    assert [(r["point"], r["adapter.rank"], r["optim.lr"], r["state"]) for r in rows] == [
        ("0", "8", "1e-4", "finished"), ("1", "8", "2e-4", "finished"), ("2", "16", "1e-4", "failed"),
        ("3", "16", "2e-4", "not started")]
    assert [r["final_train_loss"] for r in rows] == ["1", "2", "3", ""]
    assert rows[0]["val_loss"] == "" and float(rows[0]["samples_per_s"]) == 6.0  # median of the logged samples/s
    assert "experiment" not in rows[0]  # only the swept keys get columns
    md = written["md"].read_text()
    assert "| **0** | **8** | **1e-4** | **finished**" in md  # the best point in bold
    assert set(written) == {"csv", "md", "loss", "heatmap"}
    assert all(written[k].read_bytes()[:4] == b"\x89PNG" for k in ("loss", "heatmap"))


def test_sweep_summary_uses_the_validation_loss_when_runs_log_one(tmp_path):
    sweep = tmp_path / "s"
    _point(sweep / "0", 8, "1e-4", [1, 1], val=5.0)
    _point(sweep / "1", 8, "2e-4", [2, 2], val=4.0)
    rows = list(csv.DictReader(write_summary(sweep)["csv"].open()))
    assert [float(r["val_loss"]) for r in rows] == [5.0, 4.0]
    assert "| **1** |" in (sweep / "summary.md").read_text()  # lowest validation loss wins over train loss


def test_job_list_follows_the_basic_sweeper():
    # the sweep config's grid, narrowed by the command line; a single value takes a key out of the grid
    assert grid_points({"adapter.rank": "8,16", "optim.lr": "1e-4,2e-4"}, ["optim.lr=5e-5", "seed=1"]) == [
        ["adapter.rank=8"], ["adapter.rank=16"]]
    assert grid_points({"adapter.rank": "8,16"}, ["optim.lr=1e-4,2e-4"]) == [
        ["adapter.rank=8", "optim.lr=0.0001"], ["adapter.rank=8", "optim.lr=0.0002"],
        ["adapter.rank=16", "optim.lr=0.0001"], ["adapter.rank=16", "optim.lr=0.0002"]]  # as Hydra writes them
    assert grid_points({"optim.lr": "interval(1e-5, 1e-3)"}, []) is None  # not a grid: no list


def _trainer(batches, accumulate=1, max_steps=-1, max_epochs=None):
    return types.SimpleNamespace(num_training_batches=batches, accumulate_grad_batches=accumulate,
                                 max_steps=max_steps, max_epochs=max_epochs)


@pytest.mark.parametrize("trainer,total", [
    (_trainer(5, 2, max_steps=-1, max_epochs=3), 9),  # ceil(5 / 2) = 3 steps per epoch (the last one short) x 3
    (_trainer(5, 1, max_steps=7, max_epochs=-1), 7),
    (_trainer(5, 1, max_steps=100, max_epochs=2), 10),  # the epochs end first
    (_trainer(float("inf"), 1, max_steps=-1, max_epochs=-1), 0),  # unknown
])
def test_the_run_total_counts_optimizer_steps(trainer, total):
    assert total_optimizer_steps(trainer) == total


def test_wandb_logger_leaves_unset_values_to_the_environment(tmp_path, monkeypatch):
    from wanexp.callbacks.wandb_logger import RunWandbLogger, artifact_name

    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    lg = RunWandbLogger(save_dir=str(tmp_path), project=None, entity=None, group=None, name="r", tags=[], mode=None)
    init = lg._wandb_init
    assert init["project"] == "from-env" and "mode" not in init and "entity" not in init and "group" not in init
    assert "tags" not in init and "anonymous" not in init and init["dir"] == str(tmp_path)
    monkeypatch.delenv("WANDB_PROJECT")
    lg = RunWandbLogger(save_dir=str(tmp_path), name="r", tags=["a"], mode="offline", group="g", project=None)
    assert lg._wandb_init["project"] == "wanexp" and lg._wandb_init["mode"] == "offline"
    assert lg._wandb_init["group"] == "g" and lg._wandb_init["tags"] == ["a"]
    (tmp_path / "wandb").mkdir(exist_ok=True)  # the logger makes it only when its run starts
    (tmp_path / "wandb" / "wanexp-run-id").write_text("abc123")
    assert RunWandbLogger(save_dir=str(tmp_path), name="r", resume_from="last")._wandb_init["id"] == "abc123"
    assert RunWandbLogger(save_dir=str(tmp_path), name="r", resume_from=None)._wandb_init["id"] is None
    assert artifact_name("rank_lr/0_adapter.rank=8,optim.lr=1e-4") == "rank_lr-0_adapter.rank-8-optim.lr-1e-4-lora"


class _FakeRun:
    def __init__(self):
        self.summary, self.preempting = {}, False

    def mark_preempting(self):
        self.preempting = True


@pytest.fixture
def fake_wandb(monkeypatch):
    mod = types.SimpleNamespace(run=_FakeRun(), finished=[])
    mod.finish = lambda exit_code=None: mod.finished.append(exit_code)
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return mod


@pytest.mark.parametrize("error,code,state,preempting", [
    (None, 0, "finished", False),
    ("interrupted", 143, "interrupted", True),
    ("user", 2, "failed", False),
    ("crash", 1, "failed", False),
])
def test_wandb_run_is_finished_as_training_ended(fake_wandb, error, code, state, preempting):
    from wanexp.errors import ConfigError, Interrupted
    from wanexp.train import _finish_wandb

    exc = {"interrupted": Interrupted(15, 3, "/c.ckpt"), "user": ConfigError("optim.lr=abc: must be a number"),
           "crash": RuntimeError("boom")}.get(error)
    if exc is None:
        _finish_wandb(failed=False)
    else:
        try:
            raise exc
        except BaseException:
            _finish_wandb(failed=True)
    assert fake_wandb.finished == [code]
    assert fake_wandb.run.summary["wanexp/state"] == state and fake_wandb.run.preempting is preempting
    if error == "user":
        assert fake_wandb.run.summary["wanexp/error"] == "optim.lr=abc: must be a number"


def test_console_commands_and_packaged_configs():
    import tomllib

    from wanexp.config import CONF_DIR

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    scripts = project["project"]["scripts"]
    assert set(scripts) == {"wanexp-train", "wanexp-cache", "wanexp-status", "wanexp-bench", "wanexp-sample",
                            "wanexp-merge", "wanexp-plan", "wanexp-dataset"}
    assert scripts["wanexp-merge"] == "wanexp.cli.merge:entry"
    assert scripts["wanexp-train"] == "wanexp.train:main" and scripts["wanexp-status"] == "wanexp.cli.status:main"
    # the configs are found through the package (wanexp/conf), as an installed copy finds them
    assert (root / "wanexp" / "conf" / "train.yaml").is_file() and (CONF_DIR / "train.yaml").is_file()
    assert os.path.samefile(CONF_DIR, root / "wanexp" / "conf")


def _multirun_cfg(tmp_path, task: list[str], **top):
    """A composed multirun config as Hydra hands it to the sweep callback: a plain -m grid (sweeper.params null)."""
    from omegaconf import open_dict

    from wanexp.config import compose

    cfg = compose([f"paths.root_dir={tmp_path}", *(f"{k}={v}" for k, v in top.items())], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.overrides.task = task
        cfg.hydra.mode = "MULTIRUN"
    assert cfg.hydra.sweeper.params is None
    return cfg


def test_plain_multirun_point_is_named_after_its_comma_list_keys(tmp_path):
    """-m adapter.rank=4,8 without sweep=: the callback lists the points and a point takes the swept key's name."""
    import atexit

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from wanexp.callbacks.sweep import SweepSummary
    from wanexp.train import _adopt_sweep_folder

    cfg = _multirun_cfg(tmp_path, ["experiment=demo", "adapter.rank=4,8", "trainer.max_steps=2"])
    sweep_dir = Path(cfg.hydra.sweep.dir)
    cb = SweepSummary()
    cb.on_multirun_start(cfg)  # raised on the null hydra.sweeper.params
    atexit.unregister(cb._summarize)
    sweep_dir.mkdir(parents=True)
    OmegaConf.save(cfg, sweep_dir / "multirun.yaml")  # as the sweeper writes it before the first point
    job = _multirun_cfg(tmp_path, ["experiment=demo", "adapter.rank=8", "trainer.max_steps=2"])
    with open_dict(job):
        job.hydra.job.num = 1
        job.hydra.runtime.output_dir = str(sweep_dir / "1")
    HydraConfig.instance().set_config(job)
    try:
        _adopt_sweep_folder(job)
    finally:
        HydraConfig.instance().cfg = None
    assert job.run_name == "multirun/1_adapter.rank=8" and job.paths.output_dir == str(sweep_dir / "1")


def test_sweep_over_folders_with_checkpoints_is_refused_before_writing(tmp_path, capsys):
    import atexit

    from wanexp.callbacks.sweep import SweepSummary

    cfg = _multirun_cfg(tmp_path, ["adapter.rank=4,8"])
    sweep_dir = Path(cfg.hydra.sweep.dir)
    (sweep_dir / "1" / "checkpoints").mkdir(parents=True)
    (sweep_dir / "1" / "checkpoints" / "step_000002.ckpt").write_bytes(b"x")
    (sweep_dir / "multirun.yaml").write_text("old\n")
    with pytest.raises(SystemExit) as stop:
        SweepSummary().on_multirun_start(cfg)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("wanexp: error: hydra.sweep.dir=") and "point 1 already hold" in err[0]
    assert (sweep_dir / "multirun.yaml").read_text() == "old\n" and sorted(p.name for p in sweep_dir.iterdir()) == [
        "1", "multirun.yaml"]
    cb = SweepSummary()  # resume=last continues the points: not refused
    cb.on_multirun_start(_multirun_cfg(tmp_path, ["adapter.rank=4,8", "resume=last"], resume="last"))
    atexit.unregister(cb._summarize)


def test_sweep_whose_points_were_all_refused_puts_its_files_back(tmp_path):
    from wanexp.callbacks.sweep import SweepSummary, _snapshot

    old = tmp_path / "s" / "0"
    _point(old, 8, "1e-4", [1, 1])
    os.utime(old / "status.json", (time.time() - 600, time.time() - 600))  # trained by an earlier sweep
    (tmp_path / "s" / "multirun.yaml").write_text("old\n")
    (tmp_path / "s" / "summary.md").write_text("old\n")
    cb = SweepSummary()
    cb.sweep_dir, cb._keep = tmp_path / "s", _snapshot(tmp_path / "s")
    (tmp_path / "s" / "multirun.yaml").write_text("new\n")  # the sweeper's; then its first point is refused
    cb._summarize()
    assert (tmp_path / "s" / "multirun.yaml").read_text() == "old\n"
    assert (tmp_path / "s" / "summary.md").read_text() == "old\n" and not (tmp_path / "s" / "summary.csv").exists()
    cb = SweepSummary()  # a new sweep folder whose first point was refused: gone
    cb.sweep_dir, cb._keep = tmp_path / "new", _snapshot(tmp_path / "new")
    (tmp_path / "new" / "0" / ".hydra").mkdir(parents=True)
    cb._summarize()
    assert not (tmp_path / "new").exists()
    cb = SweepSummary()  # a point that trained: the summary is written
    cb.sweep_dir, cb._keep = tmp_path / "s", _snapshot(tmp_path / "s")
    _point(tmp_path / "s" / "1", 8, "2e-4", [2, 2])
    cb._summarize()
    assert (tmp_path / "s" / "summary.csv").exists()


def test_each_loss_is_named_where_it_is_shown(tmp_path, capsys):
    """A point's loss in the summary, the status command and the heatmap says which loss it is; the summary names
    the loss it ranks by and never compares a val/loss with a train loss."""
    sweep = tmp_path / "s"
    _point(sweep / "0", 8, "1e-4", [3, 3], val=0.5)  # lowest val/loss, but point 1 has none: ranked by train loss
    _point(sweep / "1", 8, "2e-4", [2, 2])
    md = write_summary(sweep)["md"].read_text()
    assert "Ranked by train loss (mean of last 5 logged steps), lower is better" in md
    assert "| train loss (mean of last 5 logged steps) | val/loss |" in md and "| **1** |" in md
    _point(sweep / "1", 8, "2e-4", [2, 2], val=0.7)
    md = write_summary(sweep)["md"].read_text()
    assert "Ranked by val/loss, lower is better" in md and "| **0** |" in md
    assert status_cli.main([str(sweep)]) == 0
    out = capsys.readouterr().out
    import re

    header = re.split(r"\s{2,}", out.splitlines()[1])
    assert "train loss (last step)" in header and "val/loss" in header and "loss" not in header
    _run(sweep / "0", loss=0.25, val_loss=0.5)
    assert status_cli.main([str(sweep / "0")]) == 0
    assert "train loss  0.25 (last logged step)   val/loss 0.5" in capsys.readouterr().out


def test_heatmap_shows_lower_loss_as_better():
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    from wanexp.callbacks.sweep import heatmap_figure

    z = np.array([[1.0, 2.0], [3.0, np.nan]])
    fig = heatmap_figure(z, ["8", "16"], ["1e-4", "2e-4"], "adapter.rank", "optim.lr", "s", "val/loss")
    image = fig.axes[0].images[0]
    best, worst = image.to_rgba(np.array([1.0]))[0], image.to_rgba(np.array([3.0]))[0]
    assert best[1] > best[0] and worst[0] > worst[1]  # lowest green, highest red
    assert fig.axes[1].get_ylabel() == "val/loss, lower is better"
    assert len(fig.axes[0].patches) == 1  # the best cell outlined


# ---- the status callback's lr and elapsed time (a stand-in trainer and clock; no training) --------------------------
class _Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _status_run(monkeypatch, folder: Path, clock: _Clock, step: int = 0, warmup: int = 10, before: float = 0.0,
                logged: list | None = None):
    """A RunStatus on ``folder`` with a stand-in trainer at ``step``: AdamW at lr 1e-3 under wanexp's schedule with
    ``warmup`` warm-up steps, status.json rewritten at every step. ``before``: seconds between the start of training
    and its first batch (the step-0 validation); ``logged``: the perf/* metrics of each log step, appended there."""
    import torch

    from wanexp.callbacks import status_file as status_mod
    from wanexp.optim import lr_lambda

    monkeypatch.setattr(status_mod, "time", types.SimpleNamespace(time=clock, perf_counter=clock, monotonic=clock))
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("constant", warmup, 100, 0.0))
    for _ in range(step):  # a resumed run's schedule is where its checkpoint left it
        opt.step()
        sched.step()
    trainer = types.SimpleNamespace(
        global_rank=0, world_size=1, global_step=step, current_epoch=0, max_steps=100, max_epochs=None,
        num_training_batches=100, accumulate_grad_batches=1, log_every_n_steps=1000, optimizers=[opt],
        datamodule=None, loggers=[], callback_metrics={}, checkpoint_callback=None, profiler=None,
        _logger_connector=types.SimpleNamespace(should_update_logs=False))
    cb = status_mod.RunStatus(output_dir=str(folder), run_name="r", every_s=0.0)
    module = types.SimpleNamespace(log_dict=lambda metrics, **kw: logged.append(metrics))
    cb.on_train_start(trainer, module)
    clock.now += before

    def step_once(seconds: float, log: bool = False) -> dict:
        cb.on_train_batch_start(trainer, module, {"prompt": ["a"]}, 0)
        cb.on_before_optimizer_step(trainer, module, opt)
        opt.step()
        sched.step()  # Lightning steps the schedule before the callbacks' on_train_batch_end
        trainer.global_step += 1
        trainer._logger_connector.should_update_logs = log
        clock.now += seconds
        cb.on_train_batch_end(trainer, module, None, {"prompt": ["a"]}, 0)
        return json.loads((folder / "status.json").read_text())

    return step_once


def test_status_shows_the_lr_each_step_used_and_the_configured_one(tmp_path, monkeypatch):
    """During warm-up (10 steps to 1e-3) step k trains at k x 1e-4, which ``train/lr`` logs: status.json's ``lr`` is
    that one, not the next step's; ``optimizer.base_lr`` is the configured 1e-3 (not the first warm-up value)."""
    step_once = _status_run(monkeypatch, tmp_path, _Clock(1000.0))
    first = json.loads((tmp_path / "status.json").read_text())
    assert first["optimizer"]["base_lr"] == pytest.approx(1e-3) and "lr" not in first["optimizer"]
    assert [step_once(1.0)["lr"] for _ in range(3)] == pytest.approx([1e-4, 2e-4, 3e-4])
    assert status_cli.learning_rate(json.loads((tmp_path / "status.json").read_text())) == "lr 0.0003 (last step; base 0.001)"


@pytest.mark.parametrize("start", [0, 10], ids=["fresh", "resumed"])
def test_the_step0_validation_is_not_in_the_step_time_the_eta_or_the_first_perf_window(tmp_path, monkeypatch, start):
    """The step-0 validation (27 s here) runs between the start of training and its first batch: status.json's
    ``step_time_s`` and ``eta_s`` and the first ``perf/*`` window count from that batch (steps of 1 s), as the
    progress bar does; ``elapsed_s`` is the session's wall time, the validation included."""
    logged: list[dict] = []
    step_once = _status_run(monkeypatch, tmp_path, _Clock(1000.0), step=start, before=27.0, logged=logged)
    step_once(1.0)
    s = step_once(1.0, log=True)
    assert logged[0]["perf/step_time_s"] == pytest.approx(1.0) and logged[0]["perf/samples_per_s"] == pytest.approx(1.0)
    assert (s["step_time_s"], s["eta_s"], s["elapsed_s"]) == pytest.approx((1.0, 100 - start - 2, 29.0))
    assert step_once(3.0)["step_time_s"] == pytest.approx(5 / 3)  # later steps (and validations) stay in the pace


def test_a_resumed_run_shows_its_training_time_over_every_session(tmp_path, monkeypatch, capsys):
    clock = _Clock(1000.0)
    step_once = _status_run(monkeypatch, tmp_path, clock)
    first = [step_once(50.0) for _ in range(2)][-1]
    assert first["elapsed_s"] == first["elapsed_total_s"] == 100.0
    clock.now += 3600.0  # the run stopped (killed); resumed an hour later from its step-2 checkpoint
    step_once = _status_run(monkeypatch, tmp_path, clock, step=2)
    s = step_once(30.0)
    assert (s["start_step"], s["elapsed_before_s"], s["elapsed_s"], s["elapsed_total_s"]) == (2, 100.0, 30.0, 130.0)
    step_once = _status_run(monkeypatch, tmp_path, clock, step=3)  # a second resume adds to the first
    assert step_once(20.0)["elapsed_total_s"] == 150.0
    assert status_cli.main([str(tmp_path)]) == 0
    assert "elapsed 0:02:30 (0:00:20 since the resume at step 3)" in capsys.readouterr().out
    _run(tmp_path / "sweep" / "0", elapsed_s=20.0, elapsed_total_s=150.0)
    assert status_cli.main([str(tmp_path / "sweep")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("0:02:30")  # the sweep's elapsed column
