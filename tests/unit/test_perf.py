"""The model-FLOP count of a LoRA step, against numbers worked out by hand."""
from __future__ import annotations

import pytest

from wanexp.models.wan22.flops import dit_forward_flops, lora_step_flops, transformer_step_flops


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


def test_the_numerics_verdict_passes_a_path_near_the_plain_loop_or_as_near_the_fp32_function():
    """wanexp.cli.bench.verdict: within --tol of the plain bf16 loop passes; beyond it, a path no further from the
    fp32 function than the plain loop (H100, 2026-11-26: the compiled checkpoint's output 1.5e-2 from the plain loop,
    1.23e-2 from fp32 where the plain loop is 1.49e-2) passes; one further from fp32, or with other inputs, fails."""
    from wanexp.cli.bench import verdict

    near = dict(input_max_abs_diff=0.0, out_rel_err=7e-3, grad_rel_err_all=2e-3, grad_rel_err_worst=7e-3)
    assert verdict(dict(near), 1e-2)["ok_by"] == "plain"
    off = dict(near, out_rel_err=1.5e-2)
    assert verdict(dict(off), 1e-2)["ok"] is False  # no fp32 figures: only the plain loop to compare with
    floor = dict(plain_out_vs_fp32=1.49e-2, plain_grad_vs_fp32=5.6e-3)
    assert verdict(dict(off, **floor, out_vs_fp32=1.23e-2, grad_vs_fp32=5.6e-3), 1e-2)["ok_by"] == "fp32"
    assert verdict(dict(off, **floor, out_vs_fp32=2.5e-2, grad_vs_fp32=5.6e-3), 1e-2)["ok"] is False
    assert verdict(dict(off, **floor, out_vs_fp32=1.2e-2, grad_vs_fp32=9e-3), 1e-2)["ok"] is False
    assert verdict(dict(near, input_max_abs_diff=1e-3), 1e-2)["ok"] is False  # other sigma/noise draws


def test_card_telemetry_averages_the_clock_and_power_of_a_window():
    """The bench's card telemetry (wanexp.perf.CardTelemetry) reads `MHz, W` lines as nvidia-smi prints them, skips
    what is not a number, and averages the samples inside a window."""
    import sys
    import time

    from wanexp.perf import CardTelemetry

    script = ("import sys, time\n"
              "for line in ['1980, 120.5', '[N/A], [N/A]', '1750, 690.0', '1710, 700.0']:\n"
              "    print(line, flush=True); time.sleep(0.3)\n")
    t = CardTelemetry(command=[sys.executable, "-c", script])
    deadline = time.time() + 30
    while len(t.samples) < 3 and time.time() < deadline:
        time.sleep(0.05)
    t.close()
    assert [(m, w) for _, m, w in t.samples] == [(1980.0, 120.5), (1750.0, 690.0), (1710.0, 700.0)]
    hot = t.window(t.samples[1][0], t.samples[2][0])
    assert hot == {"sm_mhz": 1730.0, "power_w": 695.0, "max_power_w": 700.0, "samples": 2}
    assert t.window(0.0, 1.0) is None


def test_card_telemetry_without_nvidia_smi_samples_nothing(monkeypatch):
    import shutil

    from wanexp.perf import CardTelemetry

    monkeypatch.setattr(shutil, "which", lambda name: None)
    t = CardTelemetry()
    assert t.samples == [] and t.window(0.0, 2e9) is None and t.limit_w is None
    t.close()
