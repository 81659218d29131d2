"""Shared fixtures: compose configs like the CLI does; tiny models and demo clips built once per session."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig

from wanexp.config import CONF_DIR as CONF
from wanexp.config import compose

ROOT = Path(__file__).resolve().parents[1]


def one_thread_per_process() -> None:
    """Tiny models, two pytest-xdist workers on a 2-core machine: one intra-op thread in each worker and in every run
    it starts (OMP_NUM_THREADS is inherited). A second thread only spins against the other worker's: a 6-step
    ``python train.py`` of the demo took 40 s of CPU with 2 threads, 20 s with 1. A value set by the caller stays."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


one_thread_per_process()


def pytest_collection_modifyitems(config, items) -> None:
    """The modules that hold slow (multi-process, end-to-end) tests run first, each module's tests together and in
    their order. ``make test`` hands the two xdist workers 2 tests at a time (``--maxschedchunk 2``): both start on
    the long runs and both end on short tests (longest first), instead of one worker finishing a minute-long run
    alone (with larger chunks or ``--dist worksteal`` the slow modules landed on one worker and ran last)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order inside each group stays


def compose_cfg(overrides: list[str]) -> DictConfig:
    return compose(overrides)


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """Tiny models and generated clips, built once per test session (never in the repo)."""
    return tmp_path_factory.mktemp("wanexp_shared")


@pytest.fixture
def tiny_overrides(shared_dir, tmp_path) -> list[str]:
    """Overrides for a fast CPU run of the tiny model on the synthetic clips, writing into tmp_path."""
    return [
        "experiment=demo",
        f"paths.tiny_model_dir={shared_dir}/models",
        f"paths.data_dir={shared_dir}/data",
        f"paths.output_dir={tmp_path}/run",
        "trainer.max_steps=3",
        "callbacks.checkpoint.every_n_train_steps=2",
        "trainer.log_every_n_steps=1",
        "callbacks.progress=null",
    ]


def run_cli(args: list[str], timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python train.py ARGS`` as a user would."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env)
