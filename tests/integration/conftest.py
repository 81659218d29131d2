"""Tiny runs of each Wan2.2 layout, trained once per session and shared by the integration tests."""
from __future__ import annotations

import pytest

from tests.conftest import compose_cfg
from wanexp.train import run

LAYOUTS = {
    # name: extra overrides
    "tiny": ["model=tiny"],  # trains half of its clips image-to-video (model.first_frame_cond=0.5)
    "tiny_t2v14b": ["model=tiny_t2v14b", "boundary=full"],
    "tiny_i2v14b": ["model=tiny_i2v14b", "boundary=full"],
}


def tiny_run(shared_dir, out_dir, extra: list[str]) -> dict:
    cfg = compose_cfg([
        "experiment=demo",
        f"paths.tiny_model_dir={shared_dir}/models",
        f"paths.data_dir={shared_dir}/data",
        f"paths.output_dir={out_dir}",
        "trainer.max_steps=4",
        "callbacks.checkpoint.every_n_train_steps=2",
        "trainer.log_every_n_steps=1",
        "callbacks.progress=null",
        # alpha != rank so a format that drops the scale would show; a large lr so the LoRA moves visibly
        "adapter.rank=4",
        "adapter.alpha=2",
        "optim.lr=1e-2",
        "optim.warmup_steps=0",
        *extra,
    ])
    result = run(cfg)
    result["cfg"] = cfg
    return result


@pytest.fixture(scope="session")
def trained(shared_dir, tmp_path_factory):
    """Lazily train each layout once: trained('tiny') -> run result dict."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = tiny_run(shared_dir, tmp_path_factory.mktemp(name) / "run", LAYOUTS[name])
        return cache[name]

    return get
