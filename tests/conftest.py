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
