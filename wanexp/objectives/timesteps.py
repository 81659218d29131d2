"""Noise-level (sigma) sampling for Wan2.2 flow matching.

Conventions (see wan22-facts.md): sigma in [0, 1], ``t = 1000 * sigma``, and the shifted schedule
``sigma' = S*sigma / (1 + (S-1)*sigma)``. Expert boundaries and the ``boundary`` config group are ranges of the
*shifted* sigma; sampling schemes (uniform, logit-normal, mode) act on the *unshifted* sigma. Sampling inside a
boundary range therefore maps the range back through the inverse shift and samples the scheme truncated to it, which
keeps the distribution exactly the scheme's, conditioned on the range.

The schemes are SD3's (Esser et al. 2024) as diffusers' ``compute_density_for_timestep_sampling`` draws them:
``logit_normal`` sigma = sigmoid(logit_mean + logit_std * z), z standard normal; ``mode`` sigma = f(u) for u uniform
on [0, 1], f(u) = 1 - u - mode_scale * (cos(pi u / 2)^2 - 1 + u) (decreasing from 1 to 0 for mode_scale in
[-1, 2/(pi-2)]; 0 is uniform, larger puts more of the draws at mid noise).
"""
from __future__ import annotations

import math

import torch

from wanexp.config.schema import TIMESTEP_SAMPLING as SCHEMES
from wanexp.config.schema import TimestepConfig


def shift_sigma(sigma: torch.Tensor | float, shift: float) -> torch.Tensor | float:
    """Apply the flow-matching time shift: S*s / (1 + (S-1)*s)."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def unshift_sigma(sigma_shifted: torch.Tensor | float, shift: float) -> torch.Tensor | float:
    """Inverse of :func:`shift_sigma`: s = s' / (S - (S-1)*s')."""
    return sigma_shifted / (shift - (shift - 1) * sigma_shifted)


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _logit(p: float) -> float:
    if p <= 0.0:
        return -math.inf
    if p >= 1.0:
        return math.inf
    return math.log(p / (1.0 - p))


def mode_sigma(u: torch.Tensor | float, scale: float) -> torch.Tensor | float:
    """SD3's mode density as a map of a uniform ``u`` in [0, 1]: 1 - u - scale * (cos(pi u / 2)^2 - 1 + u)."""
    cos = torch.cos(math.pi * u / 2) if isinstance(u, torch.Tensor) else math.cos(math.pi * u / 2)
    return 1 - u - scale * (cos**2 - 1 + u)


def _mode_inverse(sigma: float, scale: float) -> float:
    """The u in [0, 1] that :func:`mode_sigma` maps to ``sigma`` (it decreases from 1 to 0): by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mode_sigma(mid, scale) > sigma else (lo, mid)
    return (lo + hi) / 2


def sample_sigmas(
    n: int,
    *,
    lo: float,
    hi: float,
    shift: float,
    scheme: str = "uniform",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = TimestepConfig.mode_scale,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Sample ``n`` shifted sigmas in ``[lo, hi]`` (a boundary range of the shifted schedule).

    The unshifted sigma follows ``scheme`` truncated to ``[unshift(lo), unshift(hi)]``; the result is shifted.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"objective.timestep.sampling={scheme!r}: allowed values are {', '.join(SCHEMES)}")
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"sigma range [{lo}, {hi}] must satisfy 0 <= lo < hi <= 1")
    u_lo, u_hi = float(unshift_sigma(lo, shift)), float(unshift_sigma(hi, shift))
    p = torch.rand(n, generator=generator, dtype=torch.float64)
    if scheme == "uniform":
        u = u_lo + (u_hi - u_lo) * p
    elif scheme == "mode":
        # the uniform draw between the draws that mode_sigma maps to the range's ends (it decreases)
        a, b = _mode_inverse(u_hi, mode_scale), _mode_inverse(u_lo, mode_scale)
        u = mode_sigma(a + (b - a) * p, mode_scale).clamp(u_lo, u_hi)
    else:
        # Truncated logit-normal by inverse CDF: p uniform between the CDF values of the range ends.
        c_lo = _normal_cdf((_logit(u_lo) - logit_mean) / logit_std)
        c_hi = _normal_cdf((_logit(u_hi) - logit_mean) / logit_std)
        q = (c_lo + (c_hi - c_lo) * p).clamp(1e-12, 1 - 1e-12)
        z = torch.special.ndtri(q)
        u = torch.sigmoid(logit_mean + logit_std * z).clamp(u_lo, u_hi)
    return shift_sigma(u, shift).to(device=device, dtype=torch.float32)
