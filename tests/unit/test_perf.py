"""The model-FLOP count of a LoRA step, against numbers worked out by hand."""
from __future__ import annotations

import pytest

from wanexp.perf import dit_forward_flops, lora_step_flops, transformer_step_flops


def test_forward_flops_by_hand():
    # 8 tokens, dim 4, ffn 16, text 2, one layer:
    # linear  = 2*8*(4*16 + 2*16 + 2*4*16) + 2*2*2*16 = 2*8*224 + 128 = 3712
    # attention = 4*8*8*4 + 4*8*2*4 = 1024 + 256 = 1280
    assert dit_forward_flops(8, 4, 16, 1, text_len=2) == (3712, 1280)
    assert dit_forward_flops(8, 4, 16, 3, text_len=2) == (3 * 3712, 3 * 1280)


def test_lora_step_counts_forward_backward_and_recompute():
    assert lora_step_flops(8, 4, 16, 1, text_len=2) == 2 * 3712 + 3 * 1280
    assert lora_step_flops(8, 4, 16, 1, text_len=2, checkpointing=True) == 3 * 3712 + 4 * 1280


def test_ti2v5b_step_at_704x1280x17():
    """TI2V-5B (dim 3072, ffn 14336, 30 layers) at 704x1280x17: 5x44x80 latents -> 5x22x40 = 4,400 tokens."""
    cfg = {"patch_size": [1, 2, 2], "num_attention_heads": 24, "attention_head_dim": 128, "ffn_dim": 14336,
           "num_layers": 30}
    n, d, f, t = 4400, 3072, 14336, 512
    linear = 2 * n * (6 * d * d + 2 * d * f) + 4 * t * d * d
    attention = 4 * n * n * d + 4 * n * t * d
    assert transformer_step_flops(cfg, (1, 48, 5, 44, 80), 512) == 30 * (2 * linear + 3 * attention)
    assert transformer_step_flops(cfg, (2, 48, 5, 44, 80), 512) == 2 * 30 * (2 * linear + 3 * attention)
    assert transformer_step_flops(cfg, (1, 48, 5, 44, 80), 512) / 1e12 == pytest.approx(101.47, abs=0.01)  # 256 TFLOP/s x 396 ms in performance.md
