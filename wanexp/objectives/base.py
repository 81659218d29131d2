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
    adapter: str | None = None  # several adapters: the one the loss's graph ran under (backward runs under it too)


@dataclass(frozen=True)
class StudentSteps:
    """A distilled adapter's sampling: these timesteps (1..1000, decreasing) shifted by ``shift``, guidance 1."""

    timesteps: tuple[int, ...]
    shift: float


class Objective:
    """Base class. ``adapters``: the adapter names it needs on every trained expert; ``export``: the one to export.

    An objective with several trained adapters (e.g. DMD's generator and critic) sets ``manual = True``: then each
    training step trains the one adapter ``phase(step)`` names, with its own optimizer settings from
    ``optimizer_settings()`` (Lightning manual optimization; the LightningModule does the bookkeeping)."""

    adapters: tuple[str, ...] = ("default",)
    export: str = "default"
    manual: bool = False
    needs_negative_text: bool = False  # True: the module passes the embedding of a negative prompt (CFG)

    def phase(self, step: int) -> str:
        """The adapter trained at optimizer step ``step`` (0-based; a pure function, so a resume keeps the phase)."""
        return self.adapters[0]

    # An objective that trains something other than adapters (KD's student) exports its own files with every
    # checkpoint: ``export_checkpoint(module, state_dict, out_dir) -> [paths]``; None: the adapter's LoRA files.
    export_checkpoint = None

    def build_trainable(self, transformers: dict, spec) -> dict:
        """Modules this objective trains besides the adapters (e.g. a student model), built once the base is loaded;
        the LightningModule owns them (device, DDP/FSDP, checkpoints). Default: none."""
        return {}

    def export_metadata(self) -> dict[str, str]:
        """Written into the exported LoRA files' headers (e.g. how a distilled LoRA must be sampled)."""
        return {"wanexp_objective": self.name}

    def student_steps(self) -> "StudentSteps | None":
        """How the exported adapter is sampled (validation, wanexp-sample): a distilled adapter on exactly its
        student steps, without CFG, every step on the expert it was trained on; None (the default): the model's own
        scheduler, steps and guidance, each step on the expert its noise level routes to."""
        return None

    def optimizer_settings(self) -> dict[str, dict]:
        """Per trained adapter: optimizer overrides (lr, weight_decay, eps, betas) and ``clip`` (max grad norm)."""
        return {}

    def __init__(self, name: str):
        self.name = name

    def __call__(self, batch, denoiser, generator: torch.Generator | None = None) -> ObjectiveOutput:
        """``batch``: wanexp.models.encode.EncodedBatch; ``denoiser``: wanexp.models.denoiser.Denoiser."""
        raise NotImplementedError
