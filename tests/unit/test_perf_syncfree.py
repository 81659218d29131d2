"""The step's bookkeeping without host syncs computes what the synchronous code did: per-group losses, expert routing."""
from __future__ import annotations

import math

import torch
from torch import nn

from wanexp.models.denoiser import Denoiser
from wanexp.models.encoders import EncodedBatch
from wanexp.models.wan22.spec import WanSpec
from wanexp.objectives.flow_matching import loss_breakdown


def test_loss_breakdown_has_every_group_with_tensor_counts():
    per_sample = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0])
    sigma = torch.tensor([0.10, 0.20, 0.60, 0.95, 1.00])  # quarters 0, 0, 2, 3, 3 (1.0 counts in the last)
    route = torch.tensor([1, 1, 1, 0, 0])
    out = loss_breakdown(per_sample, sigma, route, ["high", "low"])
    assert set(out) == {"train/loss_high", "train/loss_low"} | {f"train/loss_t{k}" for k in range(4)}
    expect = {"train/loss_high": (12.0, 2), "train/loss_low": (7 / 3, 3), "train/loss_t0": (1.5, 2),
              "train/loss_t2": (4.0, 1), "train/loss_t3": (12.0, 2)}
    for name, (mean, n) in expect.items():
        value, count = out[name]
        assert isinstance(count, torch.Tensor) and int(count) == n, name
        assert math.isclose(float(value), mean, rel_tol=1e-6), name
    value, count = out["train/loss_t1"]  # nobody in this quarter: count 0, nothing to average
    assert int(count) == 0 and math.isnan(float(value))
    # one expert: no per-expert keys
    assert set(loss_breakdown(per_sample, sigma, route, ["dense"])) == {f"train/loss_t{k}" for k in range(4)}


class _Spec:
    """Wan's routing and transformer call around a stand-in DiT."""

    boundary_ratio = 0.5
    route, transformer_call = WanSpec.route, WanSpec.transformer_call

    def compute_dtype(self, transformer):
        return torch.float32

    def model_inputs(self, x_t, x0, sigma, cond):
        return x_t, 1000 * sigma, None


class _Expert(nn.Module):
    """Stands for a DiT: output = input * a factor of its own + the timestep, so a misrouted sample shows."""

    def __init__(self, factor: float):
        super().__init__()
        self.patch_embedding = nn.Linear(1, 1)
        self.factor = factor

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        return (hidden_states * self.factor + timestep.view(-1, 1, 1, 1, 1),)


def test_routing_from_a_host_sigma_matches_per_sample_experts():
    experts = nn.ModuleDict({"high": _Expert(2.0), "low": _Expert(-3.0)})
    den = Denoiser(_Spec(), experts, (0.0, 1.0))
    x = torch.randn(4, 2, 1, 2, 2)
    batch = EncodedBatch(x, torch.zeros(4, 3, 1))
    for sigma in ([0.9, 0.1, 0.6, 0.2], [0.9, 0.7, 0.6, 0.8], [0.1, 0.2, 0.3, 0.4]):  # mixed, all high, all low
        sigma = torch.tensor(sigma)
        pred = den(x, sigma, batch)
        high = sigma >= 0.5
        expect = torch.where(high.view(-1, 1, 1, 1, 1), x * 2.0, x * -3.0) + 1000 * sigma.view(-1, 1, 1, 1, 1)
        torch.testing.assert_close(pred.velocity, expect, rtol=0, atol=0)
        assert pred.route.tolist() == [0 if h else 1 for h in high.tolist()]


def test_the_signal_flag_is_agreed_one_call_late(tmp_path):
    """LaggedMax: each call all-reduces (max) this call's value and returns the previous call's result, so a step
    never waits for its own reduce. One gloo process here; the 2-rank case is in test_data_resume (a signal that only
    rank 1 receives stops both ranks at the same step)."""
    import torch.distributed as dist

    from wanexp.callbacks.preemption import LaggedMax

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        agreed = LaggedMax(torch.device("cpu"))
        assert [agreed(v) for v in (0, 10, 0, 15, 2, 0)] == [0, 0, 10, 0, 15, 2]
    finally:
        dist.destroy_process_group()


def test_noise_is_drawn_on_a_gpu_unless_a_host_generator_fixes_it(monkeypatch):
    """A GPU step draws its noise on the device (no host draw, no copy: ~5 ms of every step on the host); a host
    generator keeps the host draw (the same values on any device); the CPU draws from its global stream."""
    from wanexp.objectives import base

    calls = []
    real = torch.randn

    def randn(*shape, **kw):
        calls.append(kw)
        return real(*shape, **{k: v for k, v in kw.items() if k != "device"})

    monkeypatch.setattr(base.torch, "randn", randn)
    monkeypatch.setattr(base, "to_device", lambda t, device: ("copied", t))
    base.draw_noise((2, 3), torch.float32, torch.device("cuda", 0))
    assert calls[-1] == {"dtype": torch.float32, "device": torch.device("cuda", 0)}
    g = torch.Generator().manual_seed(5)
    copied, t = base.draw_noise((2, 3), torch.float32, "cuda", torch.Generator().manual_seed(5))
    assert copied == "copied" and calls[-1]["generator"] is not None and "device" not in calls[-1]
    assert torch.equal(t, real((2, 3), generator=g))
    monkeypatch.undo()
    torch.manual_seed(3)
    a = base.draw_noise((4,), torch.float32, "cpu")
    torch.manual_seed(3)
    assert torch.equal(a, torch.randn(4))
