"""Turns the `parallel` config group into a Lightning strategy."""
from __future__ import annotations

from datetime import timedelta

from omegaconf import DictConfig


def build_strategy(p: DictConfig):
    if p.name == "single":
        return "auto"
    timeout = timedelta(seconds=int(p.get("timeout_s", 1800)))
    if p.name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(
            find_unused_parameters=bool(p.find_unused_parameters),
            static_graph=bool(p.static_graph),
            gradient_as_bucket_view=bool(p.gradient_as_bucket_view),
            timeout=timeout,
        )
    if p.name == "fsdp":
        from wanexp.parallel.fsdp import WanFSDPStrategy

        return WanFSDPStrategy(sharding_strategy=p.sharding_strategy, cpu_offload=bool(p.cpu_offload),
                               param_dtype=p.param_dtype, timeout=timeout)
    if p.name == "deepspeed":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=int(p.stage), offload_optimizer=bool(p.offload_optimizer),
                                 offload_parameters=bool(p.offload_parameters), timeout=timeout)
    raise ValueError(f"parallel={p.name}: allowed values are single, ddp, fsdp, deepspeed")
