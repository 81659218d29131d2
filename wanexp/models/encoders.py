"""A family's frozen encoders as one module, and the batch an objective trains on.

A family's :class:`Encoders` subclass (``ModelSpec.load_encoders``) turns a loader batch into an
:class:`EncodedBatch`: the latents the DiT denoises (``x0``), the prompts' embeddings (``text``) and every other
per-sample tensor its DiT is conditioned on (``cond``, e.g. an image-to-video first frame's latent or audio features).
The cache (wanexp/data/cache.py) stores whatever ``encode_media`` puts in ``cond`` next to the latents, and
:func:`cached_batch` gives it back, so no shared code lists a family's conditioning keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

# The keys of a loader batch that are not conditioning: a cached batch's other tensors are the encoders' ``cond``.
LOADER_KEYS = ("pixels", "latents", "text", "index")


@dataclass
class EncodedBatch:
    """What an objective trains on: the latents, the text embeddings and the family's conditioning."""

    x0: torch.Tensor  # (B, C, F, H, W) fp32
    text: torch.Tensor  # (B, text_len, D)
    cond: dict = field(default_factory=dict)  # the encoders' per-sample tensors; objectives add per-step draws

    @property
    def size(self) -> int:
        return self.x0.shape[0]


class Encoders(nn.Module):
    """A family's frozen encoders (always in eval mode). A subclass implements ``encode_media`` (pixels and the
    family's ``sample_inputs`` -> latents and conditioning), ``encode_prompts`` and ``decode``."""

    def train(self, mode: bool = True):
        return super().train(False)  # no dropout in the encoders, ever

    def forward(self, batch: dict) -> EncodedBatch:
        """A loader batch (``pixels`` in [-1, 1], ``prompt``, the family's sample inputs) -> EncodedBatch; the
        encoders run in their own dtype, outside any autocast."""
        pixels = batch["pixels"]
        with torch.autocast(device_type=pixels.device.type, enabled=False):
            x0, cond = self.encode_media(batch)
            text = self.encode_prompts(list(batch["prompt"]))
        return EncodedBatch(x0, text, cond)

    def encode_media(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """(x0 (B, C, F, H, W) fp32, cond: name -> (B, ...) tensor) of a batch's pixels and sample inputs."""
        raise NotImplementedError(f"{type(self).__name__} does not encode media")

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """Prompt embeddings (B, text_len, D), zero past each prompt's real tokens (the cache stores the rows up to
        the last non-zero one and pads zeros back)."""
        raise NotImplementedError(f"{type(self).__name__} does not encode prompts")

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """Latents -> pixels in [-1, 1] (the inverse of ``encode_media``'s x0)."""
        raise NotImplementedError(f"{type(self).__name__} does not decode latents")


def text_rows(embedding: torch.Tensor) -> int:
    """The rows of a (text_len, D) embedding up to its last non-zero one: what the cache stores of a prompt."""
    nonzero = embedding.ne(0).any(-1).nonzero()
    return int(nonzero[-1]) + 1 if nonzero.numel() else 0


def cached_batch(batch: dict) -> EncodedBatch:
    """A loader batch that already carries latents and text embeddings (the cache) -> EncodedBatch; every other
    tensor it carries is the conditioning the family's encoders stored."""
    cond = {k: v for k, v in batch.items() if k not in LOADER_KEYS and isinstance(v, torch.Tensor)}
    return EncodedBatch(batch["latents"].float(), batch["text"], cond)
