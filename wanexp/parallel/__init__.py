"""Lightning strategies for the `parallel` group; each option's ``parallel.strategy._target_`` names one of these.

    parallel=single    "auto" (Lightning picks the one device)
    parallel=ddp       ddp(...)                       -> lightning DDPStrategy
    parallel=fsdp      fsdp.BlockFSDPStrategy(...)      -> FSDP2 per transformer block
    parallel=deepspeed deepspeed(...)                 -> zero.ZeroStrategy (Lightning's DeepSpeedStrategy)
"""
from __future__ import annotations

from datetime import timedelta


def ddp(*, timeout_s: int, **kwargs):
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(timeout=timedelta(seconds=timeout_s), **kwargs)


def deepspeed(*, stage: int, offload_optimizer: bool = False, offload_parameters: bool = False, timeout_s: int,
              **kwargs):
    """ZeRO ``stage`` 1-3 with optional CPU offload of the optimizer state and (stage 3) of the parameters; the
    config and what differs from Lightning's defaults are in wanexp/parallel/zero.py."""
    from wanexp.parallel.zero import ZeroStrategy

    return ZeroStrategy(stage=stage, offload_optimizer=offload_optimizer,
                                offload_parameters=offload_parameters, timeout_s=timeout_s, **kwargs)
