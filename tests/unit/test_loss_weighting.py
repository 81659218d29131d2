"""objective.weighting: each scheme against its reference formula, and the flow-matching loss it weights."""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from wanexp.objectives.flow_matching import SIGMA_FLOOR, FlowMatching, loss_weight

SIGMAS = torch.linspace(0.01, 0.99, 99, dtype=torch.float64).float()


@pytest.mark.parametrize("scheme", ["none", "sigma_sqrt", "cosmap"])
def test_each_scheme_matches_diffusers_sd3_weighting(scheme):
    """The reference: diffusers' training_utils.compute_loss_weighting_for_sd3 (musubi-tuner uses the same)."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    want = compute_loss_weighting_for_sd3(scheme, SIGMAS)
    assert torch.allclose(loss_weight(SIGMAS, scheme), want.float(), rtol=1e-6)


def test_schemes_match_the_sd3_papers_formulas():
    """Written out: sigma_sqrt = 1/sigma^2; cosmap = 2 / (pi (1 - 2 sigma + 2 sigma^2)) (SD3, eq. of the CosMap
    density), the mean of which over sigma in (0, 1) is 1."""
    s = SIGMAS.double()
    assert torch.allclose(loss_weight(SIGMAS, "sigma_sqrt").double(), 1 / s**2, rtol=1e-6)
    cosmap = torch.tensor([2 / (math.pi * (1 - 2 * x + 2 * x * x)) for x in s.tolist()], dtype=torch.float64)
    assert torch.allclose(loss_weight(SIGMAS, "cosmap").double(), cosmap, rtol=1e-6)
    grid = (torch.arange(100000, dtype=torch.float64) + 0.5) / 100000
    assert abs(float(loss_weight(grid, "cosmap").double().mean()) - 1.0) < 1e-3
    assert torch.equal(loss_weight(SIGMAS, "none"), torch.ones_like(SIGMAS))


def test_sigma_sqrt_is_finite_at_a_clean_sample():
    assert float(loss_weight(torch.tensor([0.0]), "sigma_sqrt")) == pytest.approx(SIGMA_FLOOR**-2)


def _diffsynth_training_weights(shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DiffSynth-Studio's FlowMatchScheduler in training (its Wan template, 1000 steps), written out: the sigmas
    linspace(1, 0, 1001)[:-1] shifted, timesteps t = 1000 sigma, y = exp(-2 ((t - 500) / 1000)^2), less its minimum,
    times 1000 / its sum. Returns (sigmas, weights)."""
    sigmas = torch.linspace(1, 0, 1001, dtype=torch.float64)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    t = sigmas * 1000
    y = torch.exp(-2 * ((t - 500) / 1000) ** 2)
    y = y - y.min()
    return sigmas, y * (1000 / y.sum())


@pytest.mark.parametrize("shift", [1.0, 5.0, 12.0])
def test_gaussian_is_diffsynth_s_training_weight(shift):
    sigmas, want = _diffsynth_training_weights(shift)
    got = loss_weight(sigmas, "gaussian", shift)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-7)
    assert float(got.double().mean()) == pytest.approx(1.0, abs=1e-6)  # mean 1 over the training timesteps
    assert float(got[0]) == 0.0  # pure noise (sigma 1) weighs nothing
    between = torch.tensor([0.2, 0.5, 0.8])
    w = loss_weight(between, "gaussian", shift)
    assert w[1] > w[0] and w[1] > w[2] and w[0] == pytest.approx(float(w[2]))  # a bell at sigma 0.5


def test_gaussian_needs_the_shift():
    with pytest.raises(ValueError, match="shift"):
        loss_weight(SIGMAS, "gaussian")


@dataclass
class _Batch:
    x0: torch.Tensor
    text: torch.Tensor
    cond: object = None

    @property
    def size(self) -> int:
        return self.x0.shape[0]


class _Denoiser:
    """Predicts zero velocity: the per-sample loss is mean((noise - x0)^2), whatever sigma was drawn."""

    sigma_range, experts = (0.0, 1.0), ["dense"]
    spec = SimpleNamespace(sample_condition=lambda cond, b, g: cond)

    def __call__(self, x_t, sigma, batch):
        self.sigma = sigma
        return SimpleNamespace(velocity=torch.zeros_like(x_t), loss_mask=None, route=torch.zeros(x_t.shape[0]))

    def step_flops(self, shape, text_len):
        return 0


@pytest.mark.parametrize("scheme", ["none", "sigma_sqrt", "cosmap", "gaussian"])
def test_flow_matching_loss_is_the_weighted_mean(scheme):
    fm = FlowMatching(name="fm", timestep={"sampling": "uniform", "shift": 3.0, "logit_mean": 0.0, "logit_std": 1.0},
                      weighting=scheme)
    x0 = torch.randn(4, 2, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    batch, den = _Batch(x0=x0, text=torch.zeros(4, 3, 8)), _Denoiser()
    out = fm(batch, den, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)  # the same draws as the objective's: sigma, then the noise
    sigma = fm.sample_sigmas(4, 0.0, 1.0, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    per_sample = ((noise - x0) ** 2).mean(dim=(1, 2, 3, 4))
    assert torch.allclose(out.loss, (per_sample * loss_weight(sigma, scheme, 3.0)).mean(), rtol=1e-5)
    if scheme != "none":  # the weighting changed the loss: the check is not the unweighted mean again
        assert not torch.allclose(out.loss, per_sample.mean(), rtol=1e-3)


def test_gaussian_weighting_is_wired_from_the_config():
    from tests.conftest import compose_cfg
    from wanexp.composition import build

    cfg = compose_cfg(["experiment=demo", "objective.weighting=gaussian"])
    fm = build(cfg.objective)
    assert fm.weighting == "gaussian" and fm.shift == cfg.model.shift
