"""Model FLOPs of a Wan2.2 DiT LoRA step (the accounting of docs/performance.md): ``WanSpec.step_flops``."""
from __future__ import annotations


def dit_forward_flops(tokens: int, dim: int, ffn: int, layers: int, text_len: int = 512) -> tuple[float, float]:
    """(linear, attention) FLOPs of one forward over ``tokens`` video tokens."""
    n, d, f, t = tokens, dim, ffn, text_len
    linear = 2 * n * (4 * d * d + 2 * d * d + 2 * d * f) + 2 * t * 2 * d * d
    attention = 4 * n * n * d + 4 * n * t * d
    return linear * layers, attention * layers


def lora_step_flops(tokens: int, dim: int, ffn: int, layers: int, text_len: int = 512,
                    checkpointing: bool = False) -> float:
    """A LoRA step: no weight gradient for the frozen base -> 2*linear + 3*attention (+1 forward if recomputed)."""
    linear, attention = dit_forward_flops(tokens, dim, ffn, layers, text_len)
    work = 2 * linear + 3 * attention
    if checkpointing:
        work += linear + attention
    return work


def transformer_step_flops(config, latent_shape, text_len: int, checkpointing: bool = False) -> float:
    """LoRA-step FLOPs of a batch of latents (B, C, F, H, W) through a Wan DiT with this (diffusers) config.

    ``config`` is the transformer's config: a diffusers FrozenDict or its config.json as a dict.
    """
    b, _, f, h, w = latent_shape
    pt, ph, pw = config["patch_size"]
    tokens = (f // pt) * (h // ph) * (w // pw)
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    return b * lora_step_flops(tokens, dim, config["ffn_dim"], config["num_layers"], text_len, checkpointing)
