"""Exported LoRA files load into diffusers pipelines and reproduce the trained transformers (fp32, <= 1e-5)."""
from __future__ import annotations

from pathlib import Path

import diffusers
import pytest
import torch

SUFFIX = {"dense": "", "high": "_high_noise", "low": "_low_noise"}


def _inputs(transformer, spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    x = torch.randn(2, cfg.in_channels, 3, 4, 4, generator=g)
    text = torch.randn(2, spec.text_len, cfg.text_dim, generator=g)
    if spec.layout == "ti2v":  # per-token timesteps, frame 0 clean
        t = torch.full((2, 3 * 2 * 2), 700.0)
        t[:, :4] = 0
    else:
        t = torch.tensor([950.0, 300.0])
    return x, t, text


@pytest.mark.parametrize("name", ["tiny", "tiny_t2v14b", "tiny_i2v14b"])
@pytest.mark.parametrize("fmt", ["comfyui", "diffusers"])
def test_lora_file_reproduces_trained_transformer(trained, name, fmt):
    r = trained(name)
    module, spec = r["module"], r["module"].spec
    final = Path(r["output_dir"]) / "lora" / "final"
    pipe = getattr(diffusers, spec.pipeline_class).from_pretrained(spec.path, dtype=torch.float32)
    targets = {"dense": pipe.transformer, "high": pipe.transformer, "low": getattr(pipe, "transformer_2", None)}
    for expert, trained_t in module.transformers.items():
        f = final / f"{spec.name}_lora{SUFFIX[expert]}_{fmt}.safetensors"
        pipe.load_lora_weights(str(f), adapter_name=f"{fmt}_{expert}", load_into_transformer_2=(expert == "low"))
        x, t, text = _inputs(trained_t, spec)
        with torch.no_grad():
            ours = trained_t(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
            theirs = targets[expert](hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
            with _AdaptersOff(trained_t):
                base = trained_t(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        assert (ours - base).abs().max() > 1e-3, "the LoRA changed nothing: the check would be vacuous"
        assert (ours - theirs).abs().max() <= 1e-5, f"{expert}: {(ours - theirs).abs().max()}"


class _AdaptersOff:
    """Run a diffusers model with its adapters off, then switch them back on."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.disable_adapters()

    def __exit__(self, *exc):
        self.model.enable_adapters()
