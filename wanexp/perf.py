"""Model FLOPs of a Wan DiT LoRA step (the accounting of performance.md)."""
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
