"""The CLI as users run it: 2-process DDP on CPU (gloo), a multirun sweep, and W&B offline."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def _common(shared_dir, tmp_path) -> list[str]:
    return [
        "experiment=demo",
        f"paths.tiny_model_dir={shared_dir}/models",
        "trainer.log_every_n_steps=1",
    ]


def test_ddp_two_processes_on_cpu_counts_optimizer_steps(shared_dir, tmp_path):
    # 16 clips, 2 ranks x batch 2, accumulation 2: the bar must say 16 / (2 x 2) / 2 = 2 steps per epoch
    out = tmp_path / "ddp"
    res = run_cli([
        *_common(shared_dir, tmp_path), "parallel=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
        f"paths.data_dir={tmp_path}/data", "data.generate.num_videos=16", "data.generate.num_images=0",
        "data.batch_size=2", "trainer.accumulate_grad_batches=2", "trainer.max_steps=-1", "trainer.max_epochs=2",
        "callbacks.checkpoint.every_n_train_steps=2", f"paths.output_dir={out}",
    ], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert status["world_size"] == 2 and status["batches_per_epoch"] == 4
    assert status["steps_per_epoch"] == 2 and status["step"] == 4 and status["state"] == "finished"
    assert status["replicas_in_sync"] is True  # gradients were all-reduced: both ranks hold the same LoRA
    bars = re.findall(r"Epoch (\d+): 100%\|[^|]*\| (\d+)/(\d+)", res.stdout + res.stderr)
    assert bars and all(n == total == "2" for _, n, total in bars), res.stderr[-2000:]
    printed = re.findall(r"wanexp: LoRA file (\S+)", res.stdout)
    assert len(printed) == 2 and all(Path(p).is_file() for p in printed)  # printed once, by rank 0
    assert (out / "checkpoints" / "step_000002.ckpt").is_file() and (out / "lora" / "step_000004").is_dir()


def test_rank_lr_sweep_runs_every_point_in_its_own_folder(shared_dir, tmp_path):
    res = run_cli([
        "-m", "sweep=rank_lr", *_common(shared_dir, tmp_path), f"paths.data_dir={shared_dir}/data",
        f"paths.root_dir={tmp_path}", "trainer.max_steps=1", "callbacks.progress=null",
        "adapter.rank=4,8", "optim.lr=1e-4,1e-3",  # the command line narrows the grid
    ], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    sweep_dir = tmp_path / "outputs" / "sweeps" / "rank_lr"
    runs = sorted(p for p in sweep_dir.iterdir() if (p / "status.json").exists())
    assert len(runs) == 4, list(sweep_dir.iterdir())
    seen = set()
    for run in runs:
        cfg = OmegaConf.load(run / "config.yaml")
        seen.add((cfg.adapter.rank, cfg.optim.lr))
        assert cfg.run_name.startswith("rank_lr/") and (run / "lora" / "final" / "tiny_lora_comfyui.safetensors").is_file()
    assert seen == {(4, 1e-4), (4, 1e-3), (8, 1e-4), (8, 1e-3)}


def test_wandb_offline_logger(shared_dir, tmp_path):
    out = tmp_path / "wb"
    res = run_cli([*_common(shared_dir, tmp_path), f"paths.data_dir={shared_dir}/data", "logger=wandb",
                   "logger.wandb.mode=offline", "trainer.max_steps=2", f"paths.output_dir={out}", "callbacks.progress=null"],
                  timeout=300, env={"WANDB_SILENT": "true"})
    assert res.returncode == 0, res.stderr[-3000:]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_torchrun_launch_on_cpu(shared_dir, tmp_path):
    """torchrun (as on a multi-node/SLURM cluster) starts the ranks; Lightning joins them instead of spawning."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
           str(ROOT / "train.py"), *_common(shared_dir, tmp_path), f"paths.data_dir={shared_dir}/data",
           "parallel=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=2",
           "callbacks.progress=null", f"paths.output_dir={out}", "run_name=torchrun-cpu"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert status["world_size"] == 2 and status["step"] == 2 and status["run_name"] == "torchrun-cpu"
    assert status["replicas_in_sync"] is True
    assert len(re.findall(r"wanexp: LoRA file", res.stdout)) == 2


def test_corrupt_clip_in_a_worker_fails_with_one_line(shared_dir, tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    (clips / "broken.mp4").write_bytes(bytes(range(256)) * 64)
    (clips / "meta.csv").write_text("video,prompt\nbroken.mp4,a broken clip\nbroken.mp4,the same broken clip\n")
    common = [*_common(shared_dir, tmp_path), f"data.metadata={clips}/meta.csv", "data.generate=null",
              "data.num_workers=1", "trainer.max_steps=2", "callbacks.progress=null"]
    # unprobed (data.probe=false), the clip fails in a loader worker: one line, status failed
    out = tmp_path / "run"
    res = run_cli([*common, "data.probe=false", f"paths.output_dir={out}"], timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("wanexp: error:")]
    assert len(errors) == 1 and "broken.mp4: cannot decode video" in errors[0], res.stderr[-3000:]
    assert json.loads((out / "status.json").read_text())["state"] == "failed"
    # probed (the default), both rows are rejected before any weights load
    res = run_cli([*common, f"paths.output_dir={tmp_path}/probed"], timeout=300)
    errors = [line for line in res.stderr.splitlines() if line.startswith("wanexp: error:")]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-3000:]
    assert "2 of 2 samples rejected" in errors[0] and "broken.mp4: cannot open video" in errors[0], errors[0]
