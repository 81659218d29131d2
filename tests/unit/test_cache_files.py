"""Cache shard files: readable like the folder that holds them (a cache shared by several users or jobs)."""
from __future__ import annotations

import os
import stat

import torch

from wanexp.data.cache import CacheIndex, CacheWriter


def test_shards_take_the_folder_s_read_bits_not_safetensors_0600(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o755)
    w = CacheWriter(root, "latent", shard_entries=1)
    w.add("k0", {"x": torch.ones(2)})
    w.close()
    shards = sorted(root.glob("latent-*.safetensors"))
    assert shards, "no shard written"
    assert stat.S_IMODE(shards[0].stat().st_mode) == 0o644
    assert torch.equal(CacheIndex(root).load("k0")["x"], torch.ones(2))
