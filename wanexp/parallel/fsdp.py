"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the DiTs through Lightning's ModelParallelStrategy.

Order per transformer (as torchtitan does): activation checkpointing is already set by the spec -> ``fully_shard``
each of the family's blocks (``ModelSpec.blocks``) -> ``fully_shard`` the transformer root. Per-parameter sharding (FSDP2) keeps
a frozen bf16 base, fp32 LoRA weights and diffusers' fp32-kept norms in one unit. The frozen VAE and text encoder are
not sharded. Checkpoints gather only the trainable (LoRA) tensors, so saving never assembles the 5B/14B base on rank 0.
"""
from __future__ import annotations

from datetime import timedelta

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from wanexp.config.schema import DTYPES

RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}  # keys: config.schema.FSDP_SHARDING


class BlockFSDPStrategy(ModelParallelStrategy):
    def __init__(self, *, sharding_strategy: str, cpu_offload: bool, param_dtype: str, timeout_s: int, **kwargs):
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False,
                         timeout=timedelta(seconds=timeout_s), **kwargs)
        self.reshard_after_forward = RESHARD[sharding_strategy]
        self.cpu_offload = cpu_offload
        self.param_dtype = getattr(torch, DTYPES[param_dtype])

    def _setup_distributed(self) -> None:
        super()._setup_distributed()
        self._data_parallel_size = self.world_size  # pure data parallel: one shard group over every rank

    def parallelize_module(self, module) -> None:
        """Called by the LightningModule's configure_model once its transformers are loaded (LoRA added)."""
        # the loaded transformers, and models an objective trains in full (KD's student)
        for transformer in [*module.transformers.values(), *getattr(module, "students", {}).values()]:
            self.shard_transformer(transformer, module.spec.blocks(transformer))

    def shard_transformer(self, transformer, blocks) -> None:
        """FSDP2 over every rank: each of ``blocks`` (the family's repeated blocks, ``ModelSpec.blocks``), then the
        root (also validation's frozen other expert of a one-expert run). Parameters on the host move to this rank's
        GPU one block at a time, as shards."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh["data_parallel"]
        kwargs = dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        if self.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        root_policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        # Blocks do not cast their inputs: a checkpointed block recomputed in the backward must see the inputs its
        # forward saw, and FSDP2 up to torch 2.11 skipped that cast in the recompute (the rotary tables then came
        # back fp32 where the forward had bf16: CheckpointError). The root casts the model inputs once; what the
        # root computes in fp32 (rotary tables) reaches every block as fp32 in both passes, as under DDP.
        block_policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32,
                                            cast_forward_inputs=False)
        for block in blocks:
            fully_shard(block, mp_policy=block_policy, **kwargs)
        fully_shard(transformer, mp_policy=root_policy, **kwargs)

    def lightning_module_state_dict(self) -> dict:
        """Full tensors of the trainable parameters only (a collective: every rank calls it; rank 0 keeps them)."""
        module = self.lightning_module
        out = {}
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            if self.global_rank == 0:
                out[name] = full.detach().cpu()
        return out
