"""Frame windows through the datamodule and the cache: each window of a long clip is its own sample and cache entry;
random windows change each epoch and are never cached."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import compose_cfg
from wanexp.cli.cache import build_cache
from wanexp.data.media import write_video
from wanexp.errors import ConfigError
from wanexp.models.tiny import ensure_tiny_model
from wanexp.composition import build


@pytest.fixture
def long_clips(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = ["video,prompt"]
    for k, n in enumerate((40, 20)):
        frames = np.stack([np.full((64, 64, 3), 5 * i, dtype=np.uint8) for i in range(n)])
        write_video(data / f"clip{k}.mp4", frames, fps=24)  # the tiny model's rate: trained frame for frame
        rows.append(f"clip{k}.mp4,a gray clip {k}")
    (data / "meta.csv").write_text("\n".join(rows) + "\n")
    return data


def _dm(shared_dir, data, tmp_path, *extra):
    cfg = compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"data.metadata={data}/meta.csv",
                       "data.generate=null", f"data.cache_dir={tmp_path}/cache", "data.batch_size=1", *extra])
    spec = build(cfg.model)
    ensure_tiny_model(spec)
    dm = build(cfg.data, _partial_=True, seed=0)(encoders=spec.encoder_info())
    dm.setup()
    return cfg, dm


def test_chunks_and_uniform_windows_are_samples_and_cache_entries(shared_dir, long_clips, tmp_path):
    _, dm = _dm(shared_dir, long_clips, tmp_path, "data.window=chunks", "data.windows_per_clip=0")
    assert dm.dataset.starts == [0, 9, 18, 27, 0, 9]  # 9-frame windows: 4 fit in 40 frames, 2 in 20
    assert len({lkey for lkey, _ in dm.keys}) == 6 and len({tkey for _, tkey in dm.keys}) == 2
    first = dm.dataset[1]["pixels"]  # clip0 frames 9..17: gray 45..85 -> [-1, 1]
    assert abs(float(first[:, 0].mean()) - (45 / 127.5 - 1)) < 0.05
    cfg, dm = _dm(shared_dir, long_clips, tmp_path, "data.window=uniform", "data.windows_per_clip=3")
    assert dm.dataset.starts == [0, 16, 31, 0, 6, 11]
    build_cache(cfg)
    _, dm = _dm(shared_dir, long_clips, tmp_path, "data.window=uniform", "data.windows_per_clip=3")
    assert dm.cached and len(dm.dataset) == 6


def test_random_windows_change_per_epoch_and_are_not_cached(shared_dir, long_clips, tmp_path):
    cfg, dm = _dm(shared_dir, long_clips, tmp_path, "data.window=random")
    assert not dm.cached and dm.report["cache"]["missing_entries"] is None
    means = {e: float(dm.dataset[(0, e)]["pixels"][:, 0].mean()) for e in range(6)}
    assert len({round(m, 2) for m in means.values()}) > 1  # a new first frame in some epoch
    assert means[3] == float(dm.dataset[(0, 3)]["pixels"][:, 0].mean())  # the same epoch draws the same window
    with pytest.raises(ConfigError, match="data.window=random draws a new window every epoch"):
        build_cache(cfg)


def test_token_budget_sets_each_buckets_batch(shared_dir, long_clips, tmp_path):
    _, dm = _dm(shared_dir, long_clips, tmp_path, "data.token_budget=64")
    # the tiny TI2V layout: 9 frames at 64x64 -> 3 latent frames x (64/16/2)^2 = 12 tokens; 64 // 12 = 5 per batch
    assert dm.bucket_batch_sizes() == {(9, 64, 64): 5}
