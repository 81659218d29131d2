"""Wan2.2's memory formula: GiB of a WanTransformer3DModel's weights and of one block's activations, from its
config.json (nothing loads). wanexp.memory_plan asks these through ``WanSpec.memory_formula()``."""
from __future__ import annotations

from types import SimpleNamespace

# The working memory of one checkpointed block's recompute and backward, in bf16 elements per token per unit of the
# model width and of the FFN width, and the eager blocks' factor over compiled ones. Fitted to peaks measured on one
# H100 (2026-11-27, LoRA r32, bf16-mixed, every block checkpointed), less the weights, the kept block inputs and the
# LoRA state: TI2V-5B at 27,280 tokens compiled (21.4 GiB), the A14B expert at 32,760 tokens compiled (53.2 GiB; with
# FP8 storage and offloaded inputs 26.9 GiB) and eager with every block swapped and offloaded inputs (18.2 GiB;
# benchmarks/a14b_h100_2026-11-27.md).
RECOMPUTE_PER_DIM, RECOMPUTE_PER_FFN, RECOMPUTE_EAGER = 35.0, 1.02, 1.2


def base_gib(config: dict, weight_bytes: float, other_bytes: float, resident_blocks: int) -> float:
    """GiB of a WanTransformer3DModel's weights on the device: ``resident_blocks`` blocks' linears at
    ``weight_bytes`` per element, the embeddings and output projection at ``other_bytes``."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    per_block = 8 * d * d + 2 * d * config["ffn_dim"]  # self- and cross-attention q,k,v,o; the FFN's two linears
    patch = 1
    for p in config["patch_size"]:
        patch *= p
    other = (config["text_dim"] * d + d * d + config["freq_dim"] * d + d * d + 6 * d * d
             + (config["in_channels"] + config["out_channels"]) * patch * d)
    return (resident_blocks * per_block * weight_bytes + other * other_bytes) / 2**30


def recompute_gib(config: dict, tokens: int, compiled: bool) -> float:
    """GiB one checkpointed block needs while it recomputes and runs its backward (see the constants above)."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    per_token = RECOMPUTE_PER_DIM * d + RECOMPUTE_PER_FFN * config["ffn_dim"]
    return tokens * per_token * 2 / 2**30 * (1.0 if compiled else RECOMPUTE_EAGER)


class WanMemory:
    """The memory formula of a Wan2.2 DiT (the protocol wanexp.memory_plan reads)."""

    def block_count(self, config: dict) -> int:
        return int(config["num_layers"])

    def weights_gib(self, config: dict, weight_bytes: float, other_bytes: float, resident_blocks: int) -> float:
        return base_gib(config, weight_bytes, other_bytes, resident_blocks)

    def activations_gib(self, config: dict, tokens: int, checkpointing: bool, offloading: bool,
                        compiled: bool, selective: bool = False) -> float:
        """The least activation memory of one step: with checkpointing, every block keeps its bf16 input (offloaded:
        one on its way to the host; selective: its attention output and FFN up-projection too) and one block's
        backward recomputes it (fast.py); without, every block keeps its activations."""
        from wanexp.models.wan22.fast import block_activation_gib, kept_bytes_per_token

        if checkpointing:
            d, heads = config["num_attention_heads"] * config["attention_head_dim"], config["num_attention_heads"]
            kept = 1 if offloading else config["num_layers"]
            extra = (config["num_layers"] * tokens * kept_bytes_per_token(heads, config["attention_head_dim"],
                                                                           config["ffn_dim"]) if selective else 0)
            return (kept * tokens * d * 2 + extra) / 2**30 + recompute_gib(config, tokens, compiled)
        return config["num_layers"] * block_activation_gib(SimpleNamespace(**config), tokens)

    def compiled(self, compile: bool) -> bool:
        """Whether ``model.compile`` compiles the blocks on this machine (the recompute is lighter compiled)."""
        from wanexp.models.wan22.fast import compile_supported

        return compile and compile_supported()[0]
