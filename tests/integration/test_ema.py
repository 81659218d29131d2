"""The EMA of the trained adapter through wanexp.train.run on the tiny model: its files beside the raw LoRA files
follow the update rule; a run stopped (or killed) and resumed ends with the uninterrupted run's EMA and raw files bit
for bit, also with validation swapping the EMA in and out; under DDP every replica holds the same shadow, and under
FSDP2 the shadow's shards are gathered for the files and taken back on resume."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors import safe_open
from safetensors.torch import load_file

from tests.conftest import ROOT, compose_cfg, run_cli
from wanexp.train import run

RAW, EMA = "tiny_lora_diffusers.safetensors", "tiny_lora_ema_diffusers.safetensors"


def _common(shared_dir, *extra: str) -> list[str]:
    return ["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
            "data.use_cache=false", "trainer.log_every_n_steps=1", "callbacks.progress=null", "optim.lr=1e-2",
            "optim.scheduler=constant", "optim.warmup_steps=0", *extra]


def _same(a: Path, b: Path) -> bool:
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_the_ema_files_follow_the_update_rule_beside_the_raw_ones(shared_dir, tmp_path):
    """decay 0.15 with warm-up, every 2 steps: updates at steps 2 (decay min(0.15, 1/10)) and 4 (0.15); an export at
    every step (the raw weights of each step), each with its EMA files in both formats; wanexp-sample's --run picks
    the raw files, with --ema the EMA's."""
    out = tmp_path / "run"
    run(compose_cfg(_common(shared_dir, "trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=1",
                            "callbacks.lora_export.keep_last=-1", "callbacks.ema.decay=0.15",
                            "callbacks.ema.every_n_steps=2", f"paths.output_dir={out}")))
    step = {s: load_file(out / "lora" / f"step_{s:06d}" / RAW) for s in range(1, 5)}
    ema = {s: load_file(out / "lora" / f"step_{s:06d}" / EMA) for s in range(1, 5)}
    b = [k for k in step[1] if "lora_B" in k]
    assert b and all(not ema[1][k].any() for k in b)  # no update yet: the start (a fresh LoRA's B is zero)
    for k in step[1]:
        start = ema[1][k]
        torch.testing.assert_close(ema[2][k], 0.1 * start + 0.9 * step[2][k], rtol=1e-6, atol=1e-8)
        assert torch.equal(ema[3][k], ema[2][k])  # step 3: no update
        torch.testing.assert_close(ema[4][k], 0.15 * ema[2][k] + 0.85 * step[4][k], rtol=1e-6, atol=1e-8)
    assert any(not torch.equal(ema[4][k], step[4][k]) for k in b)  # the EMA is not the raw weights
    final = out / "lora" / "final"
    assert sorted(p.name for p in final.iterdir()) == ["tiny_lora_comfyui.safetensors", RAW,
                                                       "tiny_lora_ema_comfyui.safetensors", EMA]
    comfy = load_file(final / "tiny_lora_ema_comfyui.safetensors")
    ups = {k.removeprefix("diffusion_model.").removesuffix(".lora_up.weight"): v for k, v in comfy.items()
           if k.endswith(".lora_up.weight")}
    assert len(ups) == len(b) and all(any(torch.equal(v, ema[4][k]) for k in b) for v in ups.values())
    with safe_open(final / EMA, "pt") as f:
        assert f.metadata()["wanexp_weights"] == "ema" and "lora_adapter_metadata" in f.metadata()
    from wanexp.generation import run_adapter_files  # wanexp-sample --run [--ema]: one file per expert, of one kind

    assert run_adapter_files(final) == [final / RAW] and run_adapter_files(final, ema=True) == [final / EMA]


def test_an_accumulated_step_updates_the_ema_once(shared_dir, tmp_path):
    r = run(compose_cfg(_common(shared_dir, "trainer.max_steps=2", "trainer.accumulate_grad_batches=2",
                                "callbacks.checkpoint.every_n_train_steps=2", "callbacks.ema.decay=0.9",
                                f"paths.output_dir={tmp_path / 'run'}")))
    ema = next(c for c in r["trainer"].callbacks if hasattr(c, "validation_weights"))
    assert (ema.steps, ema.updates) == (2, 2) and r["global_step"] == 2  # 4 batches, 2 optimizer steps


def test_a_resumed_run_ends_with_the_uninterrupted_ema_also_with_ema_validation(shared_dir, tmp_path):
    """The reference trains 4 steps without validation; the other stops at step 2 and resumes to 4, validating the raw
    and the EMA weights every 2 steps: its raw and EMA files equal the reference's bit for bit (the EMA state resumes
    exactly, and each validation puts the raw weights back exactly)."""
    common = _common(shared_dir, "callbacks.checkpoint.every_n_train_steps=2", "callbacks.ema.decay=0.5",
                     "data.val_fraction=0.3")
    run(compose_cfg([*common, "trainer.max_steps=4", "callbacks.validation.every_n_steps=0",
                     f"paths.output_dir={tmp_path / 'ref'}"]))
    out = tmp_path / "resumed"
    val = ["callbacks.validation.every_n_steps=2", "callbacks.ema.validate_with=both",
           "callbacks.validation.prompts=[a red square]",
           "callbacks.validation.steps=1", "callbacks.validation.loss_samples=2", "callbacks.validation.at_start=false"]
    run(compose_cfg([*common, *val, "trainer.max_steps=2", f"paths.output_dir={out}"]))
    run(compose_cfg([*common, *val, "trainer.max_steps=4", f"paths.output_dir={out}", "resume=last"]))
    for name in (RAW, EMA, "tiny_lora_ema_comfyui.safetensors"):
        assert _same(tmp_path / "ref" / "lora" / "final" / name, out / "lora" / "final" / name), name
    for step in (2, 4):  # one in each session
        folder = out / "validation" / f"step_{step:06d}"
        metrics = json.loads((folder / "metrics.json").read_text())["metrics"]
        assert metrics["val/loss"] != metrics["val/ema/loss"]  # the EMA weights were swapped in for their numbers
        assert (folder / "p0_s0.mp4").is_file() and (folder / "p0_s0_ema.mp4").is_file()


class ShadowDigest(Callback):
    """Writes each rank's EMA shadow checksum at the end of training (a test's look at every replica)."""

    def __init__(self, folder: str):
        self.folder = Path(folder)

    def on_train_end(self, trainer, pl_module) -> None:
        ema = next(c for c in trainer.callbacks if hasattr(c, "validation_weights"))
        shadow = ema.shadow(pl_module)
        digest = sum(float(t.double().sum()) * (i + 1) for i, t in enumerate(shadow.values()))
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps({"digest": digest,
                                                                                "updates": ema.updates}))


@pytest.mark.slow
def test_every_ddp_replica_holds_the_same_shadow(shared_dir, tmp_path):
    out, digests = tmp_path / "run", tmp_path / "digests"
    res = run_cli(_common(shared_dir, "parallel=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                          "trainer.max_steps=3", "callbacks.checkpoint.every_n_train_steps=3",
                          "callbacks.ema.decay=0.5", f"paths.output_dir={out}",
                          "+callbacks.digest._target_=tests.integration.test_ema.ShadowDigest",
                          f"+callbacks.digest.folder={digests}"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((digests / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["updates"] == 3
    assert (out / "lora" / "final" / EMA).is_file()


@pytest.mark.slow
def test_fsdp_gathers_the_shadow_for_its_files_and_takes_its_shards_back_on_resume(shared_dir, tmp_path):
    """decay 0: the shadow equals the weights after each update, so the EMA files equal the raw ones exactly (the
    gathered shards in their places); resumed from step 2 with decay 0.5, each rank takes its shard of that shadow
    back, and the files at steps 3 and 4 follow the rule from it."""
    out = tmp_path / "run"
    args = _common(shared_dir, "parallel=fsdp", "trainer.accelerator=cpu", "trainer.devices=2",
                   "parallel.strategy.param_dtype=fp32", "parallel.strategy.timeout_s=120",
                   "callbacks.lora_export.keep_last=-1", f"paths.output_dir={out}")
    res = run_cli([*args, "trainer.max_steps=2", "callbacks.checkpoint.every_n_train_steps=2",
                   "callbacks.ema.decay=0.0"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _same(out / "lora" / "step_000002" / RAW, out / "lora" / "step_000002" / EMA)
    res = run_cli([*args, "trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=1",
                   "callbacks.ema.decay=0.5", "callbacks.ema.warmup=false", "resume=last"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    raw = {s: load_file(out / "lora" / f"step_{s:06d}" / RAW) for s in (2, 3, 4)}
    ema = {s: load_file(out / "lora" / f"step_{s:06d}" / EMA) for s in (3, 4)}
    for k in raw[2]:
        e3 = 0.5 * raw[2][k] + 0.5 * raw[3][k]
        torch.testing.assert_close(ema[3][k], e3, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(ema[4][k], 0.5 * e3 + 0.5 * raw[4][k], rtol=1e-6, atol=1e-8)


@pytest.mark.slow
def test_a_killed_and_resumed_run_ends_with_the_uninterrupted_ema(shared_dir, tmp_path):
    """SIGKILL once the run passed its step-4 checkpoint (at a moment between steps), then resume=auto: the EMA files
    (and the raw ones) equal those of an uninterrupted run bit for bit."""
    common = _common(shared_dir, "trainer.max_steps=8", "callbacks.checkpoint.every_n_train_steps=2",
                     "callbacks.ema.decay=0.7", "callbacks.ema.every_n_steps=3")
    run(compose_cfg([*common, f"paths.output_dir={tmp_path / 'ref'}"]))
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *common, f"paths.output_dir={out}",
                             "resume=auto"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads((out / "status.json").read_text()).get("step", 0) >= 5:
                break
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the kill"
    proc.kill()
    proc.wait()
    assert (out / "checkpoints" / "step_000004.ckpt").is_file()
    run(compose_cfg([*common, f"paths.output_dir={out}", "resume=auto"]))
    for name in (RAW, EMA, "tiny_lora_ema_comfyui.safetensors"):
        assert _same(tmp_path / "ref" / "lora" / "final" / name, out / "lora" / "final" / name), name
