"""The V100 (compute capability 7.0, no bf16) path: the install command, the start-up check of the torch build's GPU
architectures (torch.cuda monkeypatched: no GPU here), and the fp16 configuration it needs."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from tests.conftest import ROOT, compose_cfg
from wanexp import gpu_check
from wanexp.config import check_config
from wanexp.errors import ConfigError

CUDA13_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # PyPI's torch 2.11+ (CUDA 13)
CU126_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]  # download.pytorch.org/whl/cu126
LOCKED = re.search(r"^torch==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M).group(1)


def fake_gpus(monkeypatch, capability, archs, version=f"{LOCKED}+cu130", cuda="13.0", name="Tesla V100S-PCIE-32GB",
              count=2):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(archs))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", None)


@pytest.mark.parametrize("capability,archs,runs", [
    ((7, 0), CUDA13_ARCHS, False),  # the seed user's V100S under PyPI's torch
    ((7, 0), CU126_ARCHS, True),
    ((8, 6), ["sm_80"], True),  # a binary of the same major version, lower minor
    ((8, 0), ["sm_86"], False),  # not a higher minor
    ((9, 0), ["sm_80"], False),  # nor another major version
    ((12, 0), ["sm_90", "compute_90"], True),  # PTX JIT-compiles for a later GPU
    ((9, 0), ["sm_90a"], True),
])
def test_which_gpus_a_build_runs_on(capability, archs, runs):
    assert gpu_check.runs_on(capability, archs) is runs


def test_a_v100_under_a_cuda13_build_is_one_line_naming_the_cu126_install(monkeypatch):
    fake_gpus(monkeypatch, (7, 0), CUDA13_ARCHS)
    with pytest.raises(ConfigError) as e:
        gpu_check.check_torch_build("auto")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"Tesla V100S-PCIE-32GB (compute capability 7.0) has no kernels in the installed torch "
                          f"{LOCKED}+cu130 (CUDA 13.0, built for sm_75 to sm_120)")
    assert "make setup TORCH_CUDA=cu126" in msg
    assert f"pip install torch=={LOCKED}+cu126 --index-url https://download.pytorch.org/whl/cu126" in msg


def test_a_supported_gpu_the_cpu_and_a_newer_gpu(monkeypatch):
    fake_gpus(monkeypatch, (7, 0), CU126_ARCHS, version=f"{LOCKED}+cu126", cuda="12.6")
    gpu_check.check_torch_build("gpu")  # the V100 under the cu126 build: nothing to say
    fake_gpus(monkeypatch, (7, 0), CUDA13_ARCHS)
    gpu_check.check_torch_build("cpu")  # the run does not use the GPU
    fake_gpus(monkeypatch, (12, 0), ["sm_80", "sm_90"], version=f"{LOCKED}+cu126", cuda="12.6", name="RTX PRO 6000")
    with pytest.raises(ConfigError, match=r"RTX PRO 6000 \(compute capability 12.0\).*a torch \S+ build for sm_120"):
        gpu_check.check_torch_build("auto")


def test_train_stops_at_start_on_a_gpu_the_build_cannot_run(monkeypatch, capsys, shared_dir, tmp_path):
    """``python train.py`` on the V100 under a CUDA 13 build: exit 2 with the one line, before the model folder is
    read or the run folder made."""
    from tests.integration.test_cli_runs import _main

    fake_gpus(monkeypatch, (7, 0), CUDA13_ARCHS)
    out = tmp_path / "run"
    code, err = _main(monkeypatch, capsys, ["experiment=demo", "trainer.accelerator=gpu", "trainer.devices=1",
                                            f"paths.tiny_model_dir={tmp_path}/models", f"paths.output_dir={out}"])
    assert code == 2 and len(err) == 1 and "make setup TORCH_CUDA=cu126" in err[0], err
    assert err[0].startswith("wanexp: error: Tesla V100S-PCIE-32GB (compute capability 7.0)")
    assert not out.exists() and not (tmp_path / "models").exists()


def test_make_setup_installs_the_locked_torch_from_pytorchs_cu126_index_first():
    """``make setup TORCH_CUDA=cu126`` (docs/memory.md): torch of requirements.lock's version from PyTorch's cu126
    index before the lock (which it then satisfies), on a fresh .venv and on an existing one."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    pin = f"pip install -q torch=={LOCKED}+cu126 --index-url https://download.pytorch.org/whl/cu126"

    def dry_run(venv: str) -> list[str]:
        res = subprocess.run(["make", "-n", "setup", "TORCH_CUDA=cu126", f"VENV={venv}"], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        return res.stdout.splitlines()

    fresh = dry_run("/nonexistent/venv")
    first = next(i for i, line in enumerate(fresh) if pin in line)
    assert first < next(i for i, line in enumerate(fresh) if "-r requirements.lock" in line)
    assert any(pin in line for line in dry_run(str(ROOT / ".venv")))  # an existing .venv gets it too
    doc = (ROOT / "docs" / "memory.md").read_text()
    assert "make setup TORCH_CUDA=cu126" in doc


@pytest.mark.parametrize("overrides", [["model.dtype=fp16"], ["trainer.precision=16-mixed", "model.dtype=fp32",
                                                               "trainer.accelerator=gpu"]])
def test_fp16_compute_needs_wanexps_forward(overrides):
    """diffusers' block keeps the residual stream in fp16 (wanexp's forward: fp32, tests/unit/test_perf_fast.py)."""
    with pytest.raises(ConfigError, match=r"model.fast_modulation=false with fp16 compute: .*set "
                                          r"model.fast_modulation=true"):
        check_config(compose_cfg(["model.path=/somewhere", "model.fast_modulation=false", *overrides]))
    check_config(compose_cfg(["model.path=/somewhere", "model.fast_modulation=true", *overrides]))
