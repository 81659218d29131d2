"""Wan2.2's plain reference loop, the one ``wanexp-bench`` times wanexp's step against: what a skilled user writes
with diffusers and peft (docs/performance.md). diffusers' WanTransformer3DModel in bf16, peft LoRA (rank r, alpha =
r) on the attention projections and the feed-forward linears with fp32 LoRA parameters, the forward under
torch.autocast(bf16), fp32 MSE, ``torch.optim.AdamW(params, lr)`` (PyTorch's default implementation: foreach, not
fused); one timestep per sample, or (TI2V-5B) the pipeline's per-token timesteps with the first latent frame clean.
``compiled``: each transformer block compiled (``block.compile()``), the one line a skilled user adds.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from wanexp.models.wan22.layouts import EXPERT_FOLDERS, MODELS

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
# the layouts whose DiT input is the latents alone: the plain loop builds no conditioning channels (nor a control)
LAYOUT = {model: lay for model, lay in MODELS.items() if lay.in_channels == lay.latent_channels and not lay.control}


def supports(model: str) -> bool:
    return model in LAYOUT


def folder(model: str) -> str:
    """The transformer folder the bench loads (a two-expert model's high-noise expert)."""
    return EXPERT_FOLDERS[LAYOUT[model].experts[0]]


def dense(model: str) -> bool:
    return LAYOUT[model].experts == ("dense",)


def geometry(model: str, model_path) -> dict:
    """What the bench's random inputs are shaped by: latent channels, VAE stride, per-token timesteps, the DiT's
    patch and text width (from the transformer's config.json)."""
    lay = LAYOUT[model]
    cfg = json.loads((Path(model_path) / folder(model) / "config.json").read_text())
    return {"latent_channels": lay.latent_channels, "vae_stride": tuple(lay.vae_stride),
            "per_token": lay.per_token_timestep, "patch": tuple(cfg["patch_size"]), "text_dim": cfg["text_dim"],
            "config": cfg}


def step_flops(config: dict, latent_shape, text_len: int, checkpointing: bool) -> float:
    from wanexp.models.wan22.flops import transformer_step_flops

    return transformer_step_flops(config, latent_shape, text_len, checkpointing)


def autocast(device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def plain_model(args, device, dtype=torch.bfloat16, compiled: bool = False):
    """bf16 DiT from the folder + peft LoRA (fp32 parameters) as a user adds it (``dtype=float32``: the fp32
    reference of the numerics check, always with activation checkpointing, which does not change the function).
    ``compiled``: each transformer block compiled, as a user adds it after the adapter (``block.compile()``)."""
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    t = WanTransformer3DModel.from_pretrained(args.model_path, subfolder=folder(args.model), dtype=dtype).to(device)
    t.requires_grad_(False)
    t.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=TARGETS))
    params = [p for n, p in t.named_parameters() if "lora_" in n]
    for p in params:
        p.data = p.data.float()
        p.requires_grad_(True)
    if args.ckpt or dtype == torch.float32:
        t.enable_gradient_checkpointing()
    if compiled:
        for block in t.blocks:
            block.compile(backend=args.compile_backend)
    return t, params


def plain_inputs(x0, noise, sigma, first_frame, per_token: bool):
    """x_t and the timestep as the diffusers pipelines build them (TI2V: a mask over latent frame 0)."""
    b = x0.shape[0]
    s = sigma.view(b, 1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * noise
    if not per_token:
        return x_t, sigma * 1000, None
    mask = torch.ones(b, 1, *x0.shape[2:], device=x0.device)
    mask[first_frame.to(x0.device), :, 0] = 0
    hidden = (1 - mask) * x0 + mask * x_t
    timestep = (mask[:, 0, :, ::2, ::2] * (sigma * 1000).view(b, 1, 1, 1)).flatten(1)
    return hidden, timestep, mask


def plain_loss(pred, target, mask):
    err = (pred.float() - target) ** 2
    if mask is None:
        return err.mean()
    m = mask.expand_as(err)
    return ((err * m).sum(dim=(1, 2, 3, 4)) / m.sum(dim=(1, 2, 3, 4))).mean()


def plain_forward(t, hidden, timestep, text):
    return t(hidden, timestep, text, return_dict=False)[0]


def plain_step(args, device, data, per_token: bool, compiled: bool = False, model=None):
    t, params = model or plain_model(args, device, compiled=compiled)
    opt = torch.optim.AdamW(params, lr=1e-4)  # as users write it: PyTorch's default (foreach) implementation
    x0, text = data

    def step():
        sigma = torch.rand(x0.shape[0], device=device)
        noise = torch.randn_like(x0)
        first = torch.ones(x0.shape[0], dtype=torch.bool, device=device)  # TI2V: frame 0 clean, at t=0
        hidden, timestep, _ = plain_inputs(x0, noise, sigma, first, per_token)
        with autocast(device):
            pred = plain_forward(t, hidden, timestep, text)
        loss = torch.nn.functional.mse_loss(pred.float(), noise - x0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return t, step, {"optimizer": "torch.optim.AdamW (default: foreach, not fused)",
                     "compile": args.compile_backend if compiled else False}
