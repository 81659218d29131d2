"""Wan2.2 rectified-flow objective: x_t = (1-s)*x0 + s*eps, target v = eps - x0, MSE."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from wanexp.objectives.timesteps import sample_sigmas


def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Interpolate clean latents and noise at per-sample ``sigma`` (shape (B,))."""
    s = sigma.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - x0


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample mean squared error in fp32. ``mask`` (broadcastable to pred, 1 = counted) drops elements."""
    err = (pred.float() - target.float()) ** 2
    dims = tuple(range(1, err.ndim))
    if mask is None:
        return err.mean(dim=dims)
    m = mask.to(err.dtype).expand_as(err)
    return (err * m).sum(dim=dims) / m.sum(dim=dims).clamp_min(1.0)


@dataclass
class FlowMatchingObjective:
    """Sampling knobs for the flow-matching LoRA objective (the ``objective=lora`` group)."""

    name: str = "lora"
    lora: dict = field(default_factory=dict)
    optim: dict = field(default_factory=dict)
    timestep: dict = field(default_factory=dict)
    first_frame_cond: float = 0.0

    def sample_sigmas(self, n: int, lo: float, hi: float, generator=None, device="cpu") -> torch.Tensor:
        ts = self.timestep
        return sample_sigmas(
            n,
            lo=lo,
            hi=hi,
            shift=float(ts.get("shift", 1.0)),
            scheme=ts.get("sampling", "uniform"),
            logit_mean=float(ts.get("logit_mean", 0.0)),
            logit_std=float(ts.get("logit_std", 1.0)),
            generator=generator,
            device=device,
        )
