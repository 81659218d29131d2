"""parallel=deepspeed: the config rules, the ZeRO config, the checkpoint pointer files (no deepspeed needed), and, where
deepspeed is installed, the strategy built from the config, the LoRA gathering and a real ZeRO-2/ZeRO-3 training on
CPU (DS_ACCELERATOR=cpu over gloo; the CPU refusals are bypassed by a harness written to tmp_path)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, compose_cfg
from wanexp.config import check_config
from wanexp.config import rules as rules_module
from wanexp.errors import ConfigError
from wanexp.parallel.zero import (checkpoint_folder, read_pointer, remove_orphan_folders, write_pointer,
                                  zero_config)
from wanexp.runfolder import resume_path

GPU = ["parallel=deepspeed", "trainer.accelerator=gpu", "model.path=/m"]


@pytest.fixture
def installed(monkeypatch):
    """Pretend deepspeed is installed (CI has no deepspeed): the rules are checked without importing it."""
    real = importlib.util.find_spec
    monkeypatch.setattr(rules_module.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "deepspeed" else real(name, *a))


def _error(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(overrides))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---- rules -------------------------------------------------------------------------------------------------------
def test_deepspeed_on_cpu_is_refused():
    assert "needs GPUs" in _error(["parallel=deepspeed", "trainer.accelerator=cpu", "model.path=/m"])


def test_deepspeed_not_installed_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(rules_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    msg = _error(GPU)
    assert "deepspeed package is not installed" in msg and "parallel=ddp|fsdp" in msg


def test_deepspeed_refuses_dmd_and_two_experts_and_offloaded_weights_below_stage3(installed):
    msg = _error(GPU + ["objective=dmd"])
    assert msg.startswith("objective=dmd with parallel=deepspeed") and "parallel=ddp or parallel=fsdp" in msg
    msg = _error(GPU + ["model=t2v14b", "boundary=full"])
    assert "boundary=full" in msg and "boundary=high|low" in msg
    msg = _error(GPU + ["parallel.strategy.stage=3"])  # TI2V-5B compiles its blocks by default
    assert "model.compile=false" in msg and "parallel=fsdp" in msg
    msg = _error(GPU + ["parallel.strategy.offload_parameters=true"])
    assert "stage=2" in msg and "stage=3" in msg
    assert "parallel.strategy.stage=4" in _error(GPU + ["parallel.strategy.stage=4"])


def test_deepspeed_accepts_what_it_can_train(installed):
    check_config(compose_cfg(GPU))  # stage 2, TI2V-5B
    check_config(compose_cfg(GPU + ["parallel.strategy.stage=3", "model.compile=false",
                                    "parallel.strategy.offload_parameters=true",
                                    "parallel.strategy.offload_optimizer=true"]))
    check_config(compose_cfg(GPU + ["model=t2v14b", "boundary=high"]))  # one A14B expert


# ---- the ZeRO config -----------------------------------------------------------------------------------------------
def test_zero_config_for_lora_on_a_frozen_base():
    c = zero_config(2)
    assert c["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in c["zero_optimization"]
    assert c["zero_allow_untested_optimizer"] is True  # the torch AdamW is the client optimizer
    assert c["zero_force_ds_cpu_optimizer"] is False  # offload keeps it: no CPUAdam to compile
    # precision, clipping and accumulation come from the Trainer (Lightning adds them), never from here
    assert not {"bf16", "fp16", "gradient_clipping", "gradient_accumulation_steps", "optimizer"} & set(c)
    z3 = zero_config(3, offload_optimizer=True, offload_parameters=True)["zero_optimization"]
    assert z3["stage"] == 3 and z3["offload_optimizer"]["device"] == "cpu" and z3["offload_param"]["device"] == "cpu"
    assert z3["stage3_gather_16bit_weights_on_model_save"] is False  # the export gathers the LoRA only
    with pytest.raises(ConfigError, match="stage 3"):
        zero_config(2, offload_parameters=True)


# ---- checkpoints: a .ckpt pointer file per DeepSpeed folder ----------------------------------------------------------
def _fake_save(folder: Path, name: str, stamp: int) -> Path:
    ds = folder / f"{name}.{stamp}.ds"
    (ds / "checkpoint").mkdir(parents=True)
    (ds / "latest").write_text("checkpoint")
    write_pointer(folder / name, ds.name)
    return ds


def test_pointer_files_make_deepspeed_checkpoints_resumable_by_the_run_folder(tmp_path):
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    old = _fake_save(ck, "step_000002.ckpt", 1)
    new = _fake_save(ck, "step_000004.ckpt", 2)
    os.utime(ck / "step_000002.ckpt", (1, 1))
    (ck / "last.ckpt").symlink_to("step_000004.ckpt")
    assert read_pointer(ck / "step_000004.ckpt") == new.name
    assert resume_path("last", tmp_path) == str(ck / "last.ckpt")  # the run folder's own rule finds it
    assert checkpoint_folder(ck / "last.ckpt") == new  # through the link
    assert checkpoint_folder(ck / "step_000002.ckpt") == old
    # a re-save of the same name writes a new folder; the one no pointer names any more is removed
    newer = _fake_save(ck, "step_000004.ckpt", 3)
    assert remove_orphan_folders(ck) == [new] and not new.exists() and newer.is_dir() and old.is_dir()
    assert not list(ck.glob(".*.tmp"))  # the pointer was written under a temporary name and renamed


def test_a_checkpoint_of_another_strategy_or_a_lost_folder_is_one_line(tmp_path):
    torch.save({"state_dict": {}}, tmp_path / "ddp.ckpt")
    with pytest.raises(ConfigError, match="not a checkpoint written under parallel=deepspeed"):
        checkpoint_folder(tmp_path / "ddp.ckpt")
    write_pointer(tmp_path / "gone.ckpt", "gone.ckpt.1.ds")
    with pytest.raises(ConfigError, match="folder .* is missing"):
        checkpoint_folder(tmp_path / "gone.ckpt")


# ---- with deepspeed installed ---------------------------------------------------------------------------------------
def test_the_config_builds_the_strategy_without_zero_init():
    pytest.importorskip("deepspeed")
    from wanexp.parallel.zero import ZeroStrategy
    from wanexp.composition import build

    cfg = compose_cfg(GPU + ["parallel.strategy.stage=3", "parallel.strategy.offload_optimizer=true"])
    s = build(cfg.parallel.strategy)
    assert isinstance(s, ZeroStrategy)
    assert s.config == zero_config(3, offload_optimizer=True) and s.zero_stage_3
    assert s.exclude_frozen_parameters is True
    assert s._timeout.total_seconds() == cfg.parallel.strategy.timeout_s
    with s.model_sharded_context():  # the base loads from disk and peft initialises LoRA: not on zero.Init stubs
        layer = torch.nn.Linear(4, 4)
    assert not hasattr(layer.weight, "ds_id") and layer.weight.numel() == 16


def test_gather_trainable_takes_the_trainable_parameters_only_in_fp32():
    pytest.importorskip("deepspeed")
    from wanexp.parallel.zero import gather_trainable

    m = torch.nn.Sequential(torch.nn.Linear(3, 3).to(torch.bfloat16), torch.nn.Linear(3, 2))
    m[0].requires_grad_(False)
    out = gather_trainable(m, keep=True)
    assert set(out) == {"1.weight", "1.bias"}
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in out.values())
    assert torch.equal(out["1.weight"], m[1].weight.detach())
    assert gather_trainable(m, keep=False) == {}


HARNESS = '''
import os, sys, argparse
sys.path.insert(0, {root!r})
import wanexp.config as C, wanexp.config.rules as R
from omegaconf import open_dict
_rules = R.check_rules
def check_rules(cfg, *args):  # the CPU refusal is the only rule bypassed: the config claims a GPU for the check
    acc = cfg.trainer.accelerator
    with open_dict(cfg): cfg.trainer.accelerator = "gpu"
    try: _rules(cfg, *args)
    finally:
        with open_dict(cfg): cfg.trainer.accelerator = acc
R.check_rules = C.check_rules = check_rules
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.ddp import DDPStrategy
from wanexp.parallel.zero import ZeroStrategy as S
def setup_distributed(self):  # Lightning's DeepSpeed strategy checks for CUDA devices
    reset_seed(); self.set_world_ranks(); self._init_deepspeed_distributed()
def setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
    import deepspeed
    return deepspeed.initialize(args=argparse.Namespace(device_rank=-1), config=self.config, model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
        lr_scheduler=lr_scheduler, dist_init_required=False)[:2]
S.setup_distributed = setup_distributed
S.setup_environment = DDPStrategy.setup_environment
S._setup_model_and_optimizer = setup_model_and_optimizer
import wanexp.train
wanexp.train.main()
'''


@pytest.mark.slow
def test_zero2_and_zero3_train_export_and_resume_on_cpu(tiny_overrides, tmp_path):
    """ZeRO-2 on one process is the single-device run bit for bit (fp32); a checkpoint resumed through last.ckpt's
    pointer continues to the same weights; ZeRO-3 over two processes matches DDP to float rounding."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    harness = tmp_path / "ds_cpu.py"
    harness.write_text(HARNESS.format(root=str(ROOT)))
    base = [o for o in tiny_overrides if not o.startswith(("paths.output_dir", "trainer.max_steps"))] + [
        "optim.scheduler=constant"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")

    def train(script, name, *extra):
        r = subprocess.run([sys.executable, str(script), *base, f"paths.output_dir={tmp_path / name}", *extra],
                           cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        return load_file(tmp_path / name / "lora" / "final" / "tiny_lora_diffusers.safetensors")

    ref = train(ROOT / "train.py", "single", "parallel=single", "trainer.max_steps=4")
    ds = train(harness, "zero2", "parallel=deepspeed", "trainer.max_steps=2")
    assert read_pointer(tmp_path / "zero2" / "checkpoints" / "last.ckpt") is not None
    ds = train(harness, "zero2", "parallel=deepspeed", "trainer.max_steps=4", "resume=last", "overwrite=false")
    assert ds.keys() == ref.keys() and all(torch.equal(ds[k], ref[k]) for k in ref)
    assert any(float(v.abs().max()) > 0 for k, v in ds.items() if "lora_B" in k or "lora_up" in k)  # trained
    ddp = train(ROOT / "train.py", "ddp", "parallel=ddp", "trainer.devices=2", "trainer.max_steps=2")
    z3 = train(harness, "zero3", "parallel=deepspeed", "parallel.strategy.stage=3", "trainer.devices=2",
               "trainer.max_steps=2")
    assert z3.keys() == ddp.keys() and all(torch.allclose(z3[k], ddp[k], atol=1e-6) for k in ddp)
    folders = list((tmp_path / "zero3" / "checkpoints").glob("*.ds"))
    assert folders and all(len(list(f.glob("checkpoint/zero_pp_rank_*_optim_states.pt"))) == 2 for f in folders)
    json.loads((tmp_path / "zero3" / "checkpoints" / "step_000002.ckpt").read_text())
