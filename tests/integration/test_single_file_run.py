"""A run whose weights are all ComfyUI-style single files (model.path a fp8_scaled DiT file, model.vae_path,
model.text_encoder_path, model.tokenizer_path; no model folder): wanexp.cli.cache encodes the clips with the file's
VAE and UMT5, train.py trains two steps from that cache; a bad DiT file is one line and exit 2 from train.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import compose_cfg, run_cli_batch
from tests.integration.conftest import tiny_run
from tests.unit.test_single_file import comfy_model_files, dit
from wanexp.cli.cache import build_cache
from wanexp.composition import build
from wanexp.models.wan22.build import build_components

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("comfy")
    comps = build_components(build(compose_cfg(["model=tiny", f"paths.tiny_model_dir={root}"]).model))
    comps["transformer"] = dit()
    return comfy_model_files(root, comps)


def model_overrides(files: dict) -> list[str]:
    return ["model=tiny", "model.build=null", *[f"model.{k}={v}" for k, v in files.items()]]


def test_cache_then_train_from_single_files(files, shared_dir, tmp_path):
    cache = tmp_path / "cache"
    stats = build_cache(compose_cfg(["experiment=demo", f"paths.data_dir={shared_dir}/data",
                                     f"data.cache_dir={cache}", *model_overrides(files)]))
    assert stats["written"] == 20 and stats["rejected"] == 0  # 10 clips/images + 10 prompts
    r = tiny_run(shared_dir, tmp_path / "run", [*model_overrides(files), f"data.cache_dir={cache}",
                                                "trainer.max_steps=2"])
    assert r["global_step"] == 2 and r["module"].encoders is None  # every sample from the cache
    status = json.loads((Path(r["output_dir"]) / "status.json").read_text())
    assert status["data"]["cache"]["used"] is True and math.isfinite(status["loss"])


def test_train_py_refuses_a_bad_dit_file_in_one_line(files, shared_dir, tmp_path):
    bad = tmp_path / "wan2.2_ti2v_5B_fp16.safetensors"
    bad.write_bytes(b"<html>404 Not Found</html>")  # what a failed download leaves
    args = ["experiment=demo", f"paths.data_dir={shared_dir}/data", f"paths.output_dir={tmp_path}/run",
            *model_overrides({**files, "path": str(bad)})]
    [r] = run_cli_batch([args], tmp_path / "cli")
    assert r["returncode"] == 2, r
    assert r["stderr"].startswith(f"wanexp: error: model.path={bad}: not a readable safetensors file")
    assert r["stderr"].count("\n") == 1 and not (tmp_path / "run").exists()
