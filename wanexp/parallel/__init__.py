"""Lightning strategies for the `parallel` group; each option's ``parallel.strategy._target_`` names one of these.

    parallel=single    "auto" (Lightning picks the one device)
    parallel=ddp       ddp(...)                       -> lightning DDPStrategy
    parallel=fsdp      fsdp.WanFSDPStrategy(...)      -> FSDP2 per WanTransformerBlock
    parallel=deepspeed deepspeed(...)                 -> lightning DeepSpeedStrategy
"""
from __future__ import annotations

from datetime import timedelta


def ddp(*, timeout_s: int, **kwargs):
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(timeout=timedelta(seconds=timeout_s), **kwargs)


def deepspeed(*, timeout_s: int, **kwargs):
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return DeepSpeedStrategy(timeout=timedelta(seconds=timeout_s), **kwargs)
