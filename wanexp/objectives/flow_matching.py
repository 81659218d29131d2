"""Wan2.2 rectified-flow objective: x_t = (1-s)*x0 + s*eps, target v = eps - x0, MSE."""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from wanexp.config.schema import FlowMatchingConfig, TimestepConfig
from wanexp.objectives.base import Objective, ObjectiveOutput, draw_noise, to_device
from wanexp.objectives.timesteps import sample_sigmas, shift_sigma


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


SIGMA_FLOOR = 1e-4  # sigma_sqrt's 1/sigma^2 at a sigma of 0 (a clean sample) would be infinite
TRAIN_TIMESTEPS = 1000  # DiffSynth-Studio's training schedule: unshifted sigmas 1, 0.999, ..., 0.001, shifted


def gaussian_bell(sigma: torch.Tensor) -> torch.Tensor:
    """exp(-2 (t - 500)^2 / 1000^2) at t = 1000 sigma, less its least value on [0, 1] (exp(-1/2), at sigma 1)."""
    return torch.exp(-2 * (sigma - 0.5) ** 2) - math.exp(-0.5)


@functools.lru_cache(maxsize=8)
def gaussian_mean(shift: float) -> float:
    """The mean of :func:`gaussian_bell` over DiffSynth-Studio's training schedule at ``shift``."""
    u = 1 - torch.arange(TRAIN_TIMESTEPS, dtype=torch.float64) / TRAIN_TIMESTEPS
    return float(gaussian_bell(shift_sigma(u, shift)).mean())


def loss_weight(sigma: torch.Tensor, scheme: str, shift: float | None = None) -> torch.Tensor:
    """Per-sample loss weight at the (shifted) noise level ``sigma`` (``objective.weighting``). The schemes of SD3
    (Esser et al. 2024) as diffusers' ``compute_loss_weighting_for_sd3`` and musubi-tuner's ``--weighting_scheme``
    name them: ``none`` 1; ``sigma_sqrt`` 1/sigma^2 (sigma floored at SIGMA_FLOOR); ``cosmap``
    2 / (pi (1 - 2 sigma + 2 sigma^2)). Their ``logit_normal`` and ``mode`` shape the sigma draw instead
    (``objective.timestep.sampling``). And DiffSynth-Studio's training weight (its FlowMatchScheduler's):
    ``gaussian`` :func:`gaussian_bell` scaled to a mean of 1 over its 1000 training timesteps at ``shift`` (the
    timestep shift; needed by this scheme only), 0 at pure noise; taken at the drawn sigma, where DiffSynth takes
    its nearest training timestep's."""
    s = sigma.float()
    if scheme == "none":
        return torch.ones_like(s)
    if scheme == "sigma_sqrt":
        return s.clamp_min(SIGMA_FLOOR) ** -2.0
    if scheme == "cosmap":
        return 2.0 / (math.pi * (1 - 2 * s + 2 * s**2))
    if scheme == "gaussian":
        if shift is None:
            raise ValueError("loss weighting gaussian: pass the timestep shift")
        return (gaussian_bell(sigma.double()) / gaussian_mean(shift)).float()
    raise ValueError(f"unknown loss weighting {scheme!r}")  # the schema's choices are checked at composition


SIGMA_BUCKETS = 4  # train/loss_t<k> covers shifted sigma in [k/4, (k+1)/4)


def loss_breakdown(per_sample: torch.Tensor, sigma: torch.Tensor, route: torch.Tensor,
                   experts: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-sample losses averaged per expert (when there are several) and per sigma quarter, without a host sync.

    Every key is always present: ``name -> (mean, count)``, both 0-dim tensors on the loss's device; a group with no
    sample this step has count 0 and mean NaN (nothing to average), so a logger can weight by the count or skip it.
    """
    per_sample = per_sample.detach().float()
    groups = {}
    for k, expert in enumerate(experts if len(experts) > 1 else []):
        groups[f"train/loss_{expert}"] = route.to(per_sample.device) == k
    buckets = (sigma.detach().to(per_sample.device) * SIGMA_BUCKETS).long().clamp(max=SIGMA_BUCKETS - 1)
    for k in range(SIGMA_BUCKETS):
        groups[f"train/loss_t{k}"] = buckets == k
    out = {}
    for name, sel in groups.items():
        n = sel.sum()
        out[name] = ((per_sample * sel).sum() / n, n)
    return out


class FlowMatching(Objective):
    """The Wan2.2 flow-matching loss on the boundary's sigma range (``objective=flow_matching``)."""

    schema = FlowMatchingConfig

    def __init__(self, *, name: str, timestep: dict, weighting: str = "none"):
        """``timestep``: sampling, shift, logit_mean, logit_std, mode_scale (config.schema.TimestepConfig; a missing
        mode_scale is the schema's default); ``weighting``: the per-sample loss weight (:func:`loss_weight`)."""
        super().__init__(name)
        self.weighting = weighting
        self.sampling, self.shift = timestep["sampling"], float(timestep["shift"])
        self.logit_mean, self.logit_std = float(timestep["logit_mean"]), float(timestep["logit_std"])
        self.mode_scale = float(timestep.get("mode_scale", TimestepConfig.mode_scale))

    def weighted_mean(self, per_sample: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The batch's loss: per-sample losses times w(sigma), averaged (the loss_t metrics stay unweighted MSE)."""
        if self.weighting == "none":
            return per_sample.mean()
        return (per_sample * loss_weight(sigma, self.weighting, self.shift).to(per_sample.device)).mean()

    def sample_sigmas(self, n: int, lo: float, hi: float, generator=None, device="cpu") -> torch.Tensor:
        return sample_sigmas(n, lo=lo, hi=hi, shift=self.shift, scheme=self.sampling, logit_mean=self.logit_mean,
                             logit_std=self.logit_std, mode_scale=self.mode_scale, generator=generator,
                             device=device)

    def __call__(self, batch, denoiser, generator=None, *, step: int = 0, negative_text=None) -> ObjectiveOutput:
        x0, b = batch.x0, batch.size
        # sigma is drawn on the host (the denoiser routes experts from it) and copied without a host sync
        sigma_host = self.sample_sigmas(b, *denoiser.sigma_range, generator=generator, device="cpu")
        sigma = to_device(sigma_host, x0.device)
        noise = draw_noise(x0.shape, x0.dtype, x0.device, generator)
        x_t = add_noise(x0, noise, sigma)
        batch = replace(batch, cond=denoiser.spec.sample_condition(batch.cond, b, generator))
        pred = denoiser(x_t, sigma_host, batch)
        per_sample = masked_mse(pred.velocity, velocity_target(x0, noise), pred.loss_mask)
        return ObjectiveOutput(
            loss=self.weighted_mean(per_sample, sigma), batch_size=b,
            metrics=loss_breakdown(per_sample, sigma, pred.route, denoiser.experts),
            flops=denoiser.step_flops(x0.shape, batch.text.shape[1]),
        )
