"""What an objective is: a component that turns an encoded batch and a denoiser into a loss and its metrics.

An objective is one module with a subclass of :class:`Objective` and one YAML file with its ``_target_``
(docs/extending.md walks through one). Its class carries what is particular to it: its config schema (``schema``),
its rules across config groups (``check``), its loss (``__call__``). Neither the LightningModule nor
``wanexp/config`` names an objective.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto ``device`` without a host sync: to a GPU through pinned memory, non-blocking."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def draw_noise(shape, dtype: torch.dtype, device, generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard normal noise of ``shape`` on ``device``. Without a ``generator``, from the device's own global stream
    (CUDA's on a GPU: the module seeds it per rank and a checkpoint restores it), drawn on the device: drawing a clip's
    ~1M values on the host takes ~5 ms of every step, during which a GPU that waits for the step's first kernel idles.
    With one (a host generator: the bench's numerics check, tests that fix the draws), on the host and copied without
    a host sync: the same values on any device."""
    if generator is None and torch.device(device).type == "cuda":
        return torch.randn(shape, dtype=dtype, device=device)
    return to_device(torch.randn(shape, generator=generator, dtype=dtype), device)


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
    """Base class: what the LightningModule, the callbacks and the config checks use of an objective, and the
    defaults a simple loss keeps. ``adapters``: the adapter names it needs on every trained expert; ``export``: the
    one to export.

    An objective with several trained adapters (e.g. DMD's generator and critic) sets ``manual = True``: then each
    training step trains the one adapter ``phase(step)`` names, with its own optimizer settings from
    ``optimizer_settings()`` (Lightning manual optimization; the LightningModule does the bookkeeping)."""

    adapters: tuple[str, ...] = ("default",)
    export: str = "default"
    manual: bool = False
    needs_negative_text: bool = False  # True: the module passes the embedding of ``negative_prompt`` (CFG)
    negative_prompt: str = ""
    # One forward of one model per training step, then its backward: what model.cuda_graphs replays (config rules).
    one_forward: bool = True
    # The dataclass (a subclass of wanexp.config.schema.ObjectiveConfig) that types the objective group's YAML: its
    # fields' types, ranges (knob(..., gt=...)) and defaults are checked before anything loads. None: untyped.
    schema: type | None = None
    # Another objective whose noise levels this one trains at (KD and DMD keep a FlowMatching); see sample_sigmas.
    noise_levels: "Objective | None" = None

    @classmethod
    def check(cls, cfg) -> None:
        """This objective's rules across config groups, on the composed config (an omegaconf.DictConfig; read it,
        never change it): raise ``wanexp.errors.ConfigError("<key>=<value> with ...: <problem>; <what to set>")``,
        one line. Runs before anything loads, after the generic rules and after the ``objective`` group was checked
        against ``schema``. Default: no rule."""

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

    def sample_sigmas(self, n: int, lo: float, hi: float, generator: torch.Generator | None = None,
                      device="cpu") -> torch.Tensor:
        """``n`` noise levels (shifted sigma in [lo, hi], shape (n,)) from the distribution this objective trains at.
        When both A14B experts are sharded (FSDP, boundary=full) the module draws each step's expert from it, so a
        step's samples all go to one expert as often as per-sample routing would send them there. Default: from
        ``noise_levels`` when set, else uniform on [lo, hi]."""
        if self.noise_levels is not None:
            return self.noise_levels.sample_sigmas(n, lo, hi, generator=generator, device=device)
        return lo + (hi - lo) * torch.rand(n, generator=generator, device=device)

    def __init__(self, name: str):
        self.name = name

    def __call__(self, batch, denoiser, generator: torch.Generator | None = None, *, step: int = 0,
                 negative_text: torch.Tensor | None = None) -> ObjectiveOutput:
        """The loss of one training step; the LightningModule calls it with exactly these arguments.

        ``batch``: a ``wanexp.models.encoders.EncodedBatch`` (``x0`` latents, ``text`` embeddings, ``cond``, ``size``).
        ``denoiser``: a ``wanexp.models.denoiser.Denoiser``; ``denoiser(x_t, sigma, batch)`` returns the velocity,
        loss mask and expert route, handling conditioning, expert routing and dtypes; ``denoiser.sigma_range`` is the
        range of noise levels to train. ``generator``: the random stream for noise and timesteps (None: torch's
        global one, which the module seeds per rank and a resume restores). ``step``: the optimizer step (0-based;
        ``phase(step)`` trains). ``negative_text``: the embedding of ``negative_prompt`` (1, text_len, D) when
        ``needs_negative_text``, else None."""
        raise NotImplementedError
