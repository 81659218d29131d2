"""Tiny random models (``model.build``), written once into ``model.path`` in the real folder layout.

Tests and the demo then load these folders through the same ``ModelSpec.load_*`` code a real run uses. Each family
writes its own components (``ModelSpec.write_random_model``); building is deterministic (seeded by the family) and
atomic here: the folder appears complete or not at all, also when ranks race.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from wanexp.errors import ConfigError
from wanexp.models.family import ModelSpec


def quiet_libraries() -> None:
    """Building writes through diffusers/transformers, whose dtype notes and shard progress bars say nothing here."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


def built_from_spec(spec: ModelSpec, folder: Path) -> bool:
    """Whether ``folder`` holds a model built from ``spec.build`` (its DiT config has the build's sizes)."""
    wanted = dict(spec.build.get("transformer") or {})
    for sub in dict.fromkeys(spec.expert_folders.values()):
        cfg = folder / sub / "config.json"
        if cfg.is_file():
            have = json.loads(cfg.read_text())
            return all(have.get(k) == v for k, v in wanted.items())
    return False


def ensure_tiny_model(spec: ModelSpec, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """Build ``spec.path`` from ``spec.build`` unless it already holds that model. Safe when several processes race.

    Only an absent (or empty) folder is built into, with a printed line: a path that holds anything else (a real
    model, another layout, a mistyped path to some other folder) stops with one line and is never written to."""
    target = spec.path
    if not spec.build:
        raise ValueError(f"{spec.name} has no build section; only tiny models are built")
    if (target / "model_index.json").is_file():
        if built_from_spec(spec, target):
            return target
        raise ConfigError(f"model.path={target}: holds a model that model={spec.name} did not build (model.build "
                          f"builds a random model into an absent folder); use the model group of that folder, or "
                          f"point model.path at an absent folder")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"model.path={target}: exists and is not a model built by model={spec.name}; model.build "
                          "writes only into an absent or empty folder: check the spelling of model.path, or pick an "
                          "absent folder")
    print(f"wanexp: building the random model {spec.name} into {target} (model.build; an absent model.path)",
          flush=True)
    quiet_libraries()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        spec.write_random_model(tmp, device, dtype)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model_index.json").is_file():  # an empty folder, not a racing winner's build
                target.rmdir()
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
