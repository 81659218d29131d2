"""Training from prompts alone: a metadata file without media (``wanexp.data.metadata.read_prompts``).

DMD's generator samples from noise and its critic learns the generator's samples, so neither needs a clip: a batch
is the prompts' text embeddings (from the cache, or encoded online) and zero latents of the bucket's shape, which
fix only the shape of what the generator samples. An objective that trains on the clips themselves (flow matching,
KD, TI2V first-frame conditioning) is refused such a file with one line (``check_prompts_only``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils.data import Dataset

from wanexp.data.cache import CacheIndex, padded_text
from wanexp.data.metadata import Reject, Sample
from wanexp.errors import ConfigError, MetadataError


def latent_grid(encoders, shape: tuple[int, int, int]) -> tuple[int, int, int, int]:
    """(channels, frames, height, width) of the latents of a (frames, height, width) bucket: the VAE's z_dim (its
    config.json) and the model's VAE stride."""
    channels = int(json.loads((Path(encoders.vae) / "config.json").read_text())["z_dim"])
    (st, sh, sw), (f, h, w) = encoders.vae_stride, shape
    return channels, (f - 1) // st + 1, h // sh, w // sw


class PromptDataset(Dataset):
    """One prompt per item: ``{"latents": zeros, "text": cached embedding}`` when every prompt is cached, else
    ``{"pixels": zeros, "prompt"}`` for the module to encode online (the VAE sees a blank clip of the bucket's
    shape)."""

    def __init__(self, samples: list[Sample], shapes: list, text_keys: list[str] | None = None,
                 index: CacheIndex | None = None, text_len: int = 0, grid: tuple[int, int, int, int] | None = None):
        self.samples, self.shapes, self.text_keys, self.index = samples, shapes, text_keys, index
        self.text_len, self.grid = text_len, grid

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        item = {"prompt": self.samples[i].prompt, "index": i}
        if self.index is None:
            f, h, w = self.shapes[i]
            return dict(item, pixels=torch.zeros(3, f, h, w))
        text = padded_text(self.index.load(self.text_keys[i])["text"], self.text_len)
        return dict(item, latents=torch.zeros(self.grid), text=text)


def prompt_items(dm, samples: list[Sample], rejects: list[Reject]):
    """The datamodule's items for a prompts file: every prompt at the (data.num_frames, height, width) bucket."""
    if dm.max_samples:
        samples = samples[: dm.max_samples]
    if not samples:
        first = rejects[0]
        raise MetadataError(f"{dm.metadata}: no usable prompt, all {len(rejects)} rejected (first: {first.source}: "
                            f"{first.reason}); fix or remove those rows")
    dm.prompts_only = True
    dm.report = {"rows": len(samples) + len(rejects), "rejected": len(rejects), "warnings": 0, "long_captions": 0,
                 "prompts_only": len(samples), "rejects_file": None}
    n = len(samples)
    return samples, [(dm.num_frames, dm.height, dm.width)] * n, [0] * n, [None] * n


def prompt_dataset(dm, samples: list[Sample], shapes: list) -> tuple[PromptDataset, bool]:
    """The training set of a prompts file, and whether it is wholly cached (then no encoder loads)."""
    keys = [dm.text_cache_key(s.prompt) for s in samples] if dm.encoders and dm.cache_dir else []
    index = CacheIndex(dm.cache_dir) if keys and dm.use_cache else None
    missing = len({k for k in keys if index is None or k not in index})
    cached = index is not None and missing == 0
    dm.keys = [(None, k) for k in keys]
    dm.report["cache"] = {"dir": str(dm.cache_dir) if dm.cache_dir else None, "used": cached,
                          "missing_entries": missing if keys else None}
    r = dm.dataset_repeat
    if not cached:
        return PromptDataset(samples * r, shapes * r), False
    grid = latent_grid(dm.encoders, shapes[0])
    return PromptDataset(samples * r, shapes * r, keys * r, index, dm.encoders.text_len, grid), True


def check_prompts_only(objective, spec, metadata) -> None:
    """Refuse a prompts file to an objective that trains on the clips: one line naming what to change.
    ``objective.prompts_only_problem(spec)`` (DMD's) says what, if anything, still needs media; an objective
    without it needs clips."""
    problem = getattr(objective, "prompts_only_problem", None)
    reason = problem(spec) if problem else (f"objective={objective.name} trains on the clips themselves; give a "
                                            "metadata file with a media column, or distil from prompts with "
                                            "objective=dmd")
    if reason:
        raise ConfigError(f"data.metadata={metadata} holds prompts only (no media): {reason}")
