"""The optimizer seam: learning-rate scaling with the effective batch, the schedule, fused AdamW where allowed."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from wanexp.optim import build_optimizer, lr_lambda, scaled_lr


def test_lr_scaling_rules():
    assert scaled_lr(1e-4, "none", 64, 4) == 1e-4
    assert scaled_lr(1e-4, "linear", 64, 4) == pytest.approx(16e-4)
    assert scaled_lr(1e-4, "sqrt", 64, 4) == pytest.approx(4e-4)
    assert scaled_lr(2e-4, "linear", 2, 4) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="none, linear, sqrt"):
        scaled_lr(1e-4, "cubic", 1, 1)


def test_lr_schedule_warmup_then_decay():
    cos = lr_lambda("cosine", warmup=10, total=110, min_ratio=0.1)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(10) == pytest.approx(1.0) and cos(60) == pytest.approx(0.55) and cos(110) == pytest.approx(0.1)
    lin = lr_lambda("linear", warmup=0, total=100, min_ratio=0.0)
    assert lin(50) == pytest.approx(0.5) and lr_lambda("constant", 0, 100, 0)(99) == 1.0
    with pytest.raises(ValueError, match="constant, cosine, linear"):
        lr_lambda("step", 0, 1, 0)
    assert math.isfinite(cos(1000))


def test_optimizer_factory_gets_lr_and_fused_only_on_gpu():
    p = torch.nn.Parameter(torch.zeros(3))
    factory = functools.partial(torch.optim.AdamW, betas=[0.9, 0.99], weight_decay=0.01, fused=None)
    opt = build_optimizer(factory, [p], lr=3e-4)
    group = opt.param_groups[0]
    assert group["lr"] == 3e-4 and tuple(group["betas"]) == (0.9, 0.99) and group["weight_decay"] == 0.01
    assert not group["fused"]  # CPU parameters: the default kernel
    explicit = build_optimizer(functools.partial(torch.optim.AdamW, fused=False), [p], lr=1e-3)
    assert explicit.param_groups[0]["fused"] is False
    sgd = build_optimizer(functools.partial(torch.optim.SGD, momentum=0.9), [p], lr=1e-2)  # any torch optimizer
    assert sgd.param_groups[0]["lr"] == 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_on_gpu():
    p = torch.nn.Parameter(torch.zeros(3, device="cuda"))
    assert build_optimizer(functools.partial(torch.optim.AdamW, fused=None), [p], lr=1e-3).param_groups[0]["fused"]
