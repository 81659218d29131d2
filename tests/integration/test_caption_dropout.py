"""Caption dropout from the cache: the cache command encodes the empty prompt, a run with dropout trains from the
cache alone (no encoders) and a dropped caption reads the empty prompt's embedding."""
from __future__ import annotations

import torch

from tests.conftest import compose_cfg
from tests.integration.conftest import tiny_run
from wanexp.cli.cache import build_cache
from wanexp.data.cache import CacheIndex, padded_text


def test_caption_dropout_trains_from_the_cache_with_the_empty_prompt(shared_dir, tmp_path):
    cache, p = tmp_path / "cache", "data.caption_dropout=0.5"
    build_cache(compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models",
                             f"paths.data_dir={shared_dir}/data", f"data.cache_dir={cache}", p]))
    r = tiny_run(shared_dir, tmp_path / "run", ["model=tiny", f"data.cache_dir={cache}", "trainer.max_steps=2", p])
    assert r["module"].encoders is None and r["global_step"] == 2  # every entry, the empty prompt's too, was cached
    dm = r["trainer"].datamodule
    empty = padded_text(CacheIndex(cache).load(dm.text_cache_key(""))["text"], dm.encoders.text_len)
    items = [dm.dataset[(i, epoch)] for epoch in (0, 1) for i in range(len(dm.dataset))]
    dropped = [it for it in items if it["prompt"] == ""]
    assert 0 < len(dropped) < len(items)
    assert all(torch.equal(it["text"], empty) for it in dropped)
    assert not any(torch.equal(it["text"], empty) for it in items if it["prompt"])
