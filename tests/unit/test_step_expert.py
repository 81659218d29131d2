"""The step's forced expert (sharded experts, ModelSpec.expert_for_step) overrides each sample's own noise
level in the denoiser's routing: every rank runs that expert whatever sigmas it drew, the same in any precision,
checkpointing or loading setting (the routing reads nothing else)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from wanexp.models.denoiser import Denoiser
from wanexp.models.wan22.spec import WanSpec


class _Expert(nn.Module):
    """Records the batch size of each call; returns its input scaled by a per-expert factor."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale, self.calls = scale, []

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        self.calls.append(hidden_states.shape[0])
        return (hidden_states * self.scale,)


def _denoiser() -> tuple[Denoiser, dict[str, _Expert]]:
    spec = SimpleNamespace(boundary_ratio=0.875, compute_dtype=lambda t: torch.float32,
                           model_inputs=lambda x_t, x0, sigma, cond: (x_t, sigma * 1000, None))
    spec.route = lambda sigma, loaded: WanSpec.route(spec, sigma, loaded)  # Wan's routing, its transformer call
    spec.transformer_call = lambda *args: WanSpec.transformer_call(spec, *args)
    experts = {"high": _Expert(2.0), "low": _Expert(3.0)}
    return Denoiser(spec, experts, (0.0, 1.0)), experts


def _call(denoiser: Denoiser, sigma: torch.Tensor):
    x = torch.ones(sigma.shape[0], 2, 1, 2, 2)
    return denoiser(x, sigma, SimpleNamespace(x0=x, cond={}, text=torch.zeros(sigma.shape[0], 3, 4)))


def test_the_forced_expert_takes_every_sample_whatever_its_sigma():
    sigma = torch.tensor([0.95, 0.2, 0.5, 0.9])  # two samples on each side of the boundary
    for forced, scale in (("high", 2.0), ("low", 3.0)):
        denoiser, experts = _denoiser()
        denoiser.step_expert = forced
        pred = _call(denoiser, sigma)
        assert experts[forced].calls == [4] and experts[{"high": "low", "low": "high"}[forced]].calls == []
        assert pred.route.tolist() == [denoiser.experts.index(forced)] * 4
        assert torch.equal(pred.velocity, torch.full_like(pred.velocity, scale))


def test_without_a_forced_expert_each_sample_goes_to_the_expert_of_its_sigma():
    denoiser, experts = _denoiser()
    pred = _call(denoiser, torch.tensor([0.95, 0.2, 0.5, 0.9]))
    assert experts["high"].calls == [2] and experts["low"].calls == [2]
    assert pred.route.tolist() == [0, 1, 1, 0]
    assert pred.velocity[:, 0, 0, 0, 0].tolist() == [2.0, 3.0, 3.0, 2.0]
