"""The trained DiT(s) of a run as one velocity predictor, which is what an objective calls.

It builds the layout's DiT input from the spec (per-token timesteps, conditioning channels, loss mask), sends each
sample to the expert that owns its noise level (``spec.route``), and calls each expert through the spec
(``spec.transformer_call``) in its base weights' dtype.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from wanexp.models.encoders import EncodedBatch
from wanexp.models.family import ModelSpec


@dataclass
class Prediction:
    velocity: torch.Tensor  # (B, C, F, H, W), the DiT's output
    loss_mask: torch.Tensor | None  # broadcastable to velocity; 1 = counted (None: every element)
    route: torch.Tensor  # (B,) index into Denoiser.experts of each sample's expert


class Denoiser:
    """Calls the transformers of ``experts`` (a name -> module mapping the LightningModule owns)."""

    def __init__(self, spec: ModelSpec, transformers: Mapping[str, nn.Module], sigma_range: tuple[float, float]):
        self.spec = spec
        self.transformers = transformers
        self.sigma_range = sigma_range  # the shifted-sigma range these experts are trained on (the boundary)
        self.step_expert: str | None = None  # set for a step: every sample goes to this expert (see expert_for_step)

    @property
    def experts(self) -> list[str]:
        return list(self.transformers)

    def _forward(self, expert: str, hidden, timestep, text, cond: dict) -> torch.Tensor:
        transformer = self.transformers[expert]
        dtype = self.spec.compute_dtype(transformer)  # the base weights' dtype (bf16-true converts them)
        return self.spec.transformer_call(transformer, hidden.to(dtype), timestep, text.to(dtype), cond)

    def __call__(self, x_t: torch.Tensor, sigma: torch.Tensor, batch: EncodedBatch) -> Prediction:
        """``sigma`` (B,) may live on the CPU (the objective draws it there): with several experts the routing then
        needs no host sync. With one expert nothing here waits for the device."""
        device = x_t.device
        sigma_dev = sigma.to(device, non_blocking=True)  # a host tensor of B values: staged, no sync
        hidden, timestep, mask = self.spec.model_inputs(x_t, batch.x0, sigma_dev, batch.cond)
        if len(self.experts) == 1:
            routes = self.spec.route(sigma_dev, self.experts)
            return Prediction(self._forward(self.experts[0], hidden, timestep, batch.text, batch.cond), mask, routes)
        if self.step_expert is not None:  # one expert for the whole step (sharded experts): no per-sample routing
            routes_host = torch.full((hidden.shape[0],), self.experts.index(self.step_expert), dtype=torch.long)
        else:
            routes_host = self.spec.route(sigma.cpu(), self.experts)  # no sync for a host sigma
        velocity = None
        for k, expert in enumerate(self.experts):
            idx_host = (routes_host == k).nonzero().squeeze(1)
            if idx_host.numel() == 0:
                continue
            if idx_host.numel() == hidden.shape[0]:  # the whole batch: no gather/scatter
                return Prediction(self._forward(expert, hidden, timestep, batch.text, batch.cond), mask,
                                  routes_host.to(device, non_blocking=True))
            idx = idx_host.to(device, non_blocking=True)
            out = self._forward(expert, hidden[idx], timestep[idx], batch.text[idx], _Rows(batch.cond, idx))
            if velocity is None:
                velocity = out.new_zeros((hidden.shape[0], *out.shape[1:]))
            velocity = velocity.index_put((idx,), out)
        return Prediction(velocity, mask, routes_host.to(device, non_blocking=True))

    def step_flops(self, latent_shape, text_len: int) -> float:
        """Model FLOPs of one forward + backward (LoRA: no base-weight gradients) over latents of this shape."""
        config = next(iter(self.transformers.values())).config
        flops = self.spec.step_flops(config, latent_shape, text_len, self.spec.gradient_checkpointing)
        return 0.0 if flops is None else flops  # a family without a FLOP formula: no TFLOP/s




class _Rows(Mapping):
    """The conditioning of the samples ``idx`` (an expert's part of a batch): a per-sample tensor's rows are taken
    when the family's transformer_call reads it, so a family that reads none adds no gather to the step."""

    def __init__(self, cond: dict, idx: torch.Tensor):
        self.cond, self.idx = cond, idx

    def __getitem__(self, key):
        value = self.cond[key]
        return value[self.idx] if isinstance(value, torch.Tensor) and value.dim() else value

    def __iter__(self):
        return iter(self.cond)

    def __len__(self) -> int:
        return len(self.cond)
