"""make demo shows learning: with the Makefile's demo settings (a tiny base that draws white squares; a LoRA trained
on a red and a blue square that their captions name), the LoRA's videos take the colour each caption names where the
base's do not, the training loss falls, and the run writes the labelled before/after strip and the loss plot that
its end lines name."""
from __future__ import annotations

import re
from pathlib import Path

import av
import numpy as np
import pytest

from tests.conftest import ROOT, compose_cfg
from wanexp.data.synthetic import COLORS
from wanexp.train import end_lines, loss_trend, run

pytestmark = pytest.mark.slow  # builds the demo's base (its DiT trained on white squares) and trains the LoRA


def demo_overrides() -> list[str]:
    """The overrides of the Makefile's ``DEMO :=`` line (with its continuation lines): what make demo trains."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    (line,) = re.findall(r"^DEMO\s*:=(.*)$", text, flags=re.M)
    return line.split()


def square_colour(video: Path) -> np.ndarray:
    """The mean colour of what a video draws on its black background: the pixels with a channel above 80, over
    every frame."""
    with av.open(str(video)) as c:
        pixels = np.concatenate([f.to_ndarray(format="rgb24").reshape(-1, 3) for f in c.decode(video=0)])
    drawn = pixels[pixels.max(axis=1) > 80].astype(float)
    assert len(drawn) > 0.02 * len(pixels), f"{video} draws nearly nothing"
    return drawn.mean(axis=0)


def test_the_demo_lora_draws_the_colour_its_caption_names_where_the_base_does_not(shared_dir, tmp_path):
    from wanexp.cli.cache import build_cache

    args = demo_overrides()
    assert args == ["experiment=demo_squares"]
    cfg = compose_cfg([*args, f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
                       f"data.cache_dir={tmp_path}/cache", f"paths.output_dir={tmp_path}/run",
                       "callbacks.progress=null"])
    build_cache(cfg)  # make demo caches first, then trains from the cache
    r = run(cfg)
    out = Path(r["output_dir"])
    step = cfg.trainer.max_steps
    val = out / "validation"
    for i, prompt in enumerate(cfg.callbacks.validation.prompts):
        target = np.array(COLORS[next(c for c in ("red", "blue") if f" {c} " in prompt)], dtype=float)
        base = square_colour(val / "step_000000" / f"p{i}_s0_base.mp4")
        lora = square_colour(val / f"step_{step:06d}" / f"p{i}_s0.mp4")
        far, near = np.linalg.norm(base - target), np.linalg.norm(lora - target)
        # measured: red 212 -> 79, blue 192 -> 78 (the base draws grey-white squares, about (177, 177, 177); the
        # LoRA (141, 32, 39) and (35, 49, 133))
        assert near < 0.6 * far, (prompt, base.round(), lora.round())
    first, first_step, last, last_step = loss_trend(out / "status.jsonl")
    assert (first_step, last_step) == (cfg.trainer.log_every_n_steps, step) and last < 0.7 * first, (first, last)
    lines = end_lines(cfg, r)
    assert f"wanexp: loss curve {out / 'loss.png'}" in lines and (out / "loss.png").is_file()
    strip = val / "strip.png"
    assert any(ln.startswith(f"wanexp: before/after strip {strip} ") for ln in lines) and strip.is_file()
