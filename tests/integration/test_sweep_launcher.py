"""sweeps/launch.py: the sweep grid as one torchrun point after another."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "sweeps"))
import launch  # noqa: E402


def test_grid_from_the_sweep_config_narrowed_by_the_command_line():
    sweep, fixed, points = launch.expand(["sweep=rank_lr", "model.path=/m", "optim.lr=1e-4"])
    assert sweep == "rank_lr" and fixed == ["model.path=/m"]
    assert points == [["adapter.rank=8", "optim.lr=1e-4"],
                      ["adapter.rank=16", "optim.lr=1e-4"],
                      ["adapter.rank=32", "optim.lr=1e-4"],
                      ["adapter.rank=64", "optim.lr=1e-4"]]
    _, _, full = launch.expand(["sweep=rank_lr"])
    assert len(full) == 12  # rank 8, 16, 32, 64 x lr 5e-5, 1e-4, 2e-4
    cmd = launch.commands(["sweep=rank_lr", "adapter.rank=8"], nproc=4, nnodes=1)[1]
    # each point gets the sweep config (its name, alpha tied to rank) as one run, not as a multirun
    assert "--nproc_per_node=4" in cmd and "sweep=rank_lr" in cmd and "hydra.mode=RUN" in cmd
    assert "run_name='rank_lr/1_adapter.rank=8,optim.lr=1e-4'" in cmd


def test_multirun_refuses_several_devices(tmp_path, monkeypatch, capsys):
    from tests.integration.test_cli_runs import _main  # the CLI's entry in this process

    # a 2-point grid: Hydra composes every point of the grid before the first one starts (~1 s each)
    code, err = _main(monkeypatch, capsys, ["-m", "sweep=rank_lr", "adapter.rank=8,16", "optim.lr=1e-4",
                                            "experiment=demo", "trainer.devices=2", f"paths.root_dir={tmp_path}"])
    assert code == 2 and len(err) == 1
    assert "python sweeps/launch.py" in err[0] and "Traceback" not in "\n".join(err)


@pytest.mark.slow
def test_launcher_runs_each_point_with_two_ranks(shared_dir, tmp_path):
    """A point as on a cluster, through python sweeps/launch.py: torchrun starts 2 ranks and Lightning joins them (no
    spawning of its own), the replicas stay in sync and the point writes its LoRA files. One point (a torchrun and its
    ranks cost ~25 s here): the grid's points one after another, test_launcher_runs_the_points_in_turn."""
    res = subprocess.run(
        [sys.executable, str(ROOT / "sweeps" / "launch.py"), "sweep=rank_lr", "--nproc", "2",
         "--torchrun-args=--master-port=29541", "experiment=demo", "adapter.rank=4", "optim.lr=1e-3",
         "parallel=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=1", "callbacks.progress=null",
         f"paths.root_dir={tmp_path}", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    _assert_point(tmp_path, 0, 4, world_size=2)
    rows = (tmp_path / "outputs" / "sweeps" / "rank_lr" / "summary.csv").read_text().splitlines()
    assert len(rows) == 2  # the summary, also of a one-point sweep


def test_launcher_runs_the_points_in_turn(shared_dir, tmp_path, monkeypatch, capsys):
    """The launcher's loop over a 2-point grid: each point's torchrun command in turn (here its train.py part, run
    through the CLI's entry in this process, one device), each in its own folder with its name and alpha tied to
    rank, then the same summary as a Hydra multirun (the swept key first)."""
    from tests.integration.test_cli_runs import _main_ends

    started = []

    def point(cmd):
        assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc_per_node=1"]
        args = cmd[cmd.index(str(ROOT / "train.py")) + 1:]
        started.append(args)
        _main_ends(monkeypatch, capsys, args)
        return 0, None

    monkeypatch.setattr(launch, "run_point", point)
    assert launch.main(["sweep=rank_lr", "experiment=demo", "adapter.rank=4,8", "optim.lr=1e-3",
                        "trainer.max_steps=1", "callbacks.progress=null", f"paths.root_dir={tmp_path}",
                        f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data"]) == 0
    assert len(started) == 2
    for i, rank in enumerate((4, 8)):
        _assert_point(tmp_path, i, rank, world_size=1)
    rows = (tmp_path / "outputs" / "sweeps" / "rank_lr" / "summary.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("adapter.rank,")  # the same summary as a Hydra multirun


def _assert_point(root, i: int, rank: int, world_size: int) -> None:
    """Point i of the rank_lr sweep under root ran to its end with adapter.rank=rank (alpha tied to it)."""
    run = root / "outputs" / "sweeps" / "rank_lr" / str(i)
    status = json.loads((run / "status.json").read_text())
    assert status["world_size"] == world_size and status["state"] == "finished"
    assert status["replicas_in_sync"] is (True if world_size > 1 else None)  # None: one process, nothing to compare
    assert sorted(f.name for f in (run / "lora" / "final").iterdir()) == ["tiny_lora_comfyui.safetensors",
                                                                          "tiny_lora_diffusers.safetensors"]
    assert status["run_name"] == f"rank_lr/{i}_adapter.rank={rank},optim.lr=1e-3"
    config = (run / "config.yaml").read_text()
    assert f"rank: {rank}" in config and f"alpha: {rank}" in config


def test_a_point_that_does_not_finish_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    """Three points: 0 refused (its one line, nothing written), 1 finished, 2 failed once started: all three run,
    the summary lists each with its state and reason, and the launcher exits with the first stopped point's code;
    --stop-on-failure stops at point 0 and the summary still lists the grid."""
    import csv

    ran = []

    def point(cmd):  # what each point's torchrun leaves (its run is not trained here)
        i = int(cmd[-2].rpartition("/")[2])
        ran.append(i)
        run = tmp_path / "outputs" / "sweeps" / "rank_lr" / str(i)
        if i == 0:
            return 2, f"paths.output_dir={run} is in use by a live run (pid 1 on h, started t); wait for it"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(f"overrides:\n- adapter.rank={(4, 8, 16)[i]}\n")
        (run / "status.json").write_text(json.dumps({"state": ("finished", "failed")[i - 1], "step": 1}))
        return (0, None) if i == 1 else (1, None)

    monkeypatch.setattr(launch, "run_point", point)
    args = ["sweep=rank_lr", "adapter.rank=4,8,16", "optim.lr=1e-3", f"paths.root_dir={tmp_path}"]
    assert launch.main(args) == 2 and ran == [0, 1, 2]
    folder = tmp_path / "outputs" / "sweeps" / "rank_lr"
    rows = list(csv.DictReader((folder / "summary.csv").open()))
    assert [(r["point"], r["adapter.rank"], r["state"]) for r in rows] == [("0", "4", "refused"), ("1", "8", "finished"),
                                                                          ("2", "16", "failed")]
    assert "is in use by a live run" in rows[0]["reason"] and rows[2]["reason"] == "exit code 1"
    assert "2 of 3 sweep point(s) did not finish" in capsys.readouterr().err
    ran.clear()
    import shutil

    shutil.rmtree(folder)
    assert launch.main([*args, "--stop-on-failure"]) == 2 and ran == [0]
    rows = list(csv.DictReader((folder / "summary.csv").open()))
    assert [(r["point"], r["state"]) for r in rows] == [("0", "refused"), ("1", "not started"), ("2", "not started")]
