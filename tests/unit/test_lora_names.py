"""LoRA target names (original Wan <-> diffusers) and the ComfyUI key mapping."""
from __future__ import annotations

import re

import pytest
import torch

from tests import wan_adapters as lora
from wanexp.errors import ConfigError


def _module_names(layers: int) -> list[str]:
    names = []
    for i in range(layers):
        for a in ("attn1", "attn2"):
            names += [f"blocks.{i}.{a}.{p}" for p in ("to_q", "to_k", "to_v", "to_out.0", "norm_q", "to_out")]
        names += [f"blocks.{i}.ffn.net.0.proj", f"blocks.{i}.ffn.net.2", f"blocks.{i}.ffn.net.0", f"blocks.{i}.norm2"]
    return names + ["proj_out", "condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1"]


def _matches(targets, attention, layers=30):
    rx = re.compile(lora.target_regex(targets, attention))
    return [n for n in _module_names(layers) if rx.fullmatch(n)]


def test_default_targets_hit_300_linears_on_a_30_block_model():
    hits = _matches(["q", "k", "v", "o", "ffn.0", "ffn.2"], ["self", "cross"])
    assert len(hits) == 300  # the 5B count in wan22-facts.md
    assert all(("attn" in h and h.split(".")[-1] in ("to_q", "to_k", "to_v", "0")) or "ffn.net" in h for h in hits)
    assert len(_matches(["q", "k", "v", "o", "ffn.0", "ffn.2"], ["self", "cross"], layers=40)) == 400


def test_attention_selection_and_diffusers_aliases():
    self_only = _matches(["q", "k", "v", "o"], ["self"], layers=2)
    assert self_only == [f"blocks.{i}.attn1.{p}" for i in range(2) for p in ("to_q", "to_k", "to_v", "to_out.0")]
    assert _matches(["to_q", "ffn.net.2"], ["cross"], layers=1) == ["blocks.0.attn2.to_q", "blocks.0.ffn.net.2"]


def test_unknown_targets_raise_one_line():
    with pytest.raises(ConfigError, match="unknown target 'qkv'"):
        lora.target_regex(["qkv"], ["self"])
    with pytest.raises(ConfigError, match="select no module"):
        lora.target_regex(["q"], [])


@pytest.mark.parametrize("diff,orig", [
    ("blocks.3.attn1.to_q", "blocks.3.self_attn.q"),
    ("blocks.3.attn1.to_out.0", "blocks.3.self_attn.o"),
    ("blocks.12.attn2.to_v", "blocks.12.cross_attn.v"),
    ("blocks.0.ffn.net.0.proj", "blocks.0.ffn.0"),
    ("blocks.0.ffn.net.2", "blocks.0.ffn.2"),
])
def test_module_names_map_both_ways(diff, orig):
    assert lora.diffusers_to_original_module(diff) == orig
    assert lora.original_to_diffusers_module(orig) == diff


def test_comfyui_conversion_round_trips_with_alpha():
    sd = {"blocks.0.attn1.to_q.lora_A.weight": torch.randn(4, 8),
          "blocks.0.attn1.to_q.lora_B.weight": torch.randn(8, 4),
          "blocks.1.ffn.net.2.lora_A.weight": torch.randn(4, 16), "blocks.1.ffn.net.2.lora_B.weight": torch.randn(8, 4)}
    comfy = lora.to_comfyui(sd, alpha=2.0)
    assert set(comfy) == {
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight", "diffusion_model.blocks.0.self_attn.q.lora_up.weight",
        "diffusion_model.blocks.0.self_attn.q.alpha", "diffusion_model.blocks.1.ffn.2.lora_down.weight",
        "diffusion_model.blocks.1.ffn.2.lora_up.weight", "diffusion_model.blocks.1.ffn.2.alpha"}
    back, rank, alpha = lora.convert_lora_state_dict(comfy)  # read back through diffusers' converter
    assert (rank, alpha) == (4, 2.0) and set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
