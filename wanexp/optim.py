"""Optimizer and learning-rate schedule of the trained (adapter) parameters: pure functions the module calls.

The optimizer itself comes from the ``optim.optimizer`` node (``_target_`` + ``_partial_``: torch's AdamW, or
bitsandbytes' AdamW8bit, Prodigy, CAME or transformers' Adafactor by ``optim=<name>``), instantiated by
wanexp/train.py and called here with the parameters and the learning rate.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable

import torch

from wanexp.config.schema import LR_SCALING, SCHEDULERS


def scaled_lr(lr: float, rule: str, effective_batch: int, reference_batch: int) -> float:
    """``lr`` tuned at ``reference_batch``, scaled to ``effective_batch``: none, linear (x ratio) or sqrt."""
    if rule not in LR_SCALING:
        raise ValueError(f"lr scaling rule {rule!r}: allowed values are {', '.join(LR_SCALING)}")
    ratio = effective_batch / reference_batch
    return lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def lr_lambda(kind: str, warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warm-up then constant, cosine or linear decay to ``min_ratio`` (a LambdaLR factor per step)."""
    if kind not in SCHEDULERS:
        raise ValueError(f"optim.scheduler={kind!r}: allowed values are {', '.join(SCHEDULERS)}")

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return min_ratio + (1 - min_ratio) * (1 - progress)

    return f


def build_optimizer(factory: Callable, params: Iterable[torch.nn.Parameter], lr: float,
                    **overrides) -> torch.optim.Optimizer:
    """Call the configured optimizer; ``fused=None`` becomes the fused kernel when every parameter is on a GPU.
    ``overrides`` replace the configured arguments (e.g. one adapter's weight decay in a several-adapter objective)."""
    params = list(params)
    kwargs = {"lr": lr, **overrides}
    accepts_fused = "fused" in inspect.signature(getattr(factory, "func", factory)).parameters
    if accepts_fused and getattr(factory, "keywords", {}).get("fused", "unset") is None:
        kwargs["fused"] = bool(params) and all(p.is_cuda for p in params) or None
    return factory(params, **kwargs)
