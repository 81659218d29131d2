"""Lightning strategies for the `parallel` group; each option's ``parallel.strategy._target_`` names one of these.

    parallel=single    "auto" (Lightning picks the one device)
    parallel=ddp       ddp(...)                       -> Lightning's DDPStrategy, DDP built on the current stream
    parallel=fsdp      fsdp.BlockFSDPStrategy(...)      -> FSDP2 per transformer block
    parallel=deepspeed deepspeed(...)                 -> zero.ZeroStrategy (Lightning's DeepSpeedStrategy)
"""
from __future__ import annotations

from datetime import timedelta


def ddp(*, timeout_s: int, **kwargs):
    from lightning.pytorch.strategies import DDPStrategy

    class SameStreamDDPStrategy(DDPStrategy):
        """Lightning's DDPStrategy (2.6) builds DistributedDataParallel inside a new CUDA stream, so the gradient
        accumulators DDP's reducer holds belong to that stream while every backward runs on the default one: each
        backward then syncs the two streams per parameter and warns ("The AccumulateGrad node's stream does not match
        ..."). Built on the current stream, as PyTorch asks, they match."""

        def _setup_model(self, model):
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(),
                                           **self._ddp_kwargs)

    return SameStreamDDPStrategy(timeout=timedelta(seconds=timeout_s), **kwargs)


def deepspeed(*, stage: int, offload_optimizer: bool = False, offload_parameters: bool = False, timeout_s: int,
              **kwargs):
    """ZeRO ``stage`` 1-3 with optional CPU offload of the optimizer state and (stage 3) of the parameters; the
    config and what differs from Lightning's defaults are in wanexp/parallel/zero.py."""
    from wanexp.parallel.zero import ZeroStrategy

    return ZeroStrategy(stage=stage, offload_optimizer=offload_optimizer,
                                offload_parameters=offload_parameters, timeout_s=timeout_s, **kwargs)
