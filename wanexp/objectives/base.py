"""What an objective is: a component that turns an encoded batch and a denoiser into a loss and its metrics.

To add one: a module here with a subclass of :class:`Objective`, a schema in ``wanexp/config/schema.py`` (extending
``ObjectiveConfig``) and ``conf/objective/<name>.yaml`` with its ``_target_``. The LightningModule needs no change.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # scalar, what backward runs on
    batch_size: int
    metrics: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)  # name -> (value, samples it averages)
    flops: float = 0.0  # model FLOPs this step spent (forward + backward), for perf/tflops


class Objective:
    """Base class. ``adapters``: the adapter names it needs on every trained expert; ``export``: the one to export."""

    adapters: tuple[str, ...] = ("default",)
    export: str = "default"

    def __init__(self, name: str):
        self.name = name

    def __call__(self, batch, denoiser, generator: torch.Generator | None = None) -> ObjectiveOutput:
        """``batch``: wanexp.models.encode.EncodedBatch; ``denoiser``: wanexp.models.denoiser.Denoiser."""
        raise NotImplementedError
