"""model.memory_budget_gib: only the blocks the budget needs are checkpointed; the function computed is unchanged."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import compose_cfg
from wanexp.errors import ConfigError
from wanexp.models.wan22 import fast
from wanexp.models.tiny import ensure_tiny_model
from wanexp.composition import build


def test_the_budget_decides_how_many_blocks_are_checkpointed():
    # TI2V-5B at 4,400 tokens: 0.637 GiB per block, inputs 0.025 GiB each; 10.7 GiB held; 30 GiB budget:
    # 27 - 10.7 - 30 * 0.025 - 1.5 * 0.637 = 14.6 GiB free -> keep 22 blocks, checkpoint 8
    assert fast.blocks_to_checkpoint(30, 0.637, 30.0, 10.7, 0.025) == 8
    # 27,280 tokens: 3.95 GiB per block, inputs 0.156 GiB: 27 - 10.9 - 4.7 - 5.9 = 5.5 free -> keep 1
    assert fast.blocks_to_checkpoint(30, 3.95, 30.0, 10.9, 0.156) == 29
    assert fast.blocks_to_checkpoint(30, 0.637, 80.0, 10.5) == 0
    assert fast.blocks_to_checkpoint(30, 0.637, 11.0, 10.5) == 30
    per_block = fast.block_activation_gib(type("C", (), dict(num_attention_heads=24, attention_head_dim=128,
                                                              ffn_dim=14336))(), 4400)
    assert per_block == pytest.approx(0.637)


def _saved(transformer, x, t, text) -> tuple[int, dict]:
    count = 0

    def pack(tensor):
        nonlocal count
        count += 1
        return tensor

    transformer.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    out.pow(2).mean().backward()
    return count, {n: p.grad.clone() for n, p in transformer.named_parameters() if p.grad is not None}


def test_part_of_the_blocks_checkpointed_gives_the_same_gradients(shared_dir):
    cfg = compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models",
                       "model.gradient_checkpointing=true"])
    spec = build(cfg.model)
    ensure_tiny_model(spec)
    t = spec.load_transformer("dense")
    t.requires_grad_(True)
    t.train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 48, 3, 8, 8, generator=g)
    text = torch.randn(1, 16, t.config.text_dim, generator=g)
    ts = torch.tensor([700.0])
    tokens = 3 * 4 * 4
    per_block = fast.block_activation_gib(t.config, tokens)
    held = sum(p.numel() for p in t.parameters()) * 12 / 2**30  # weights' gradients + AdamW moments, as estimated
    results = {}
    inputs = 2 * tokens * t.config.num_attention_heads * t.config.attention_head_dim * 2 / 2**30
    for name, budget in (("all", None), ("one", (held + inputs + per_block * 3) / 0.9), ("none", 1e6)):
        fast.set_memory_budget(t, budget)
        n = fast.checkpointed_blocks(t, tokens)
        results[name] = (n, *_saved(t, x, ts, text))
    assert [results[k][0] for k in ("all", "one", "none")] == [2, 1, 0]
    counts = [results[k][1] for k in ("all", "one", "none")]
    assert counts[0] < counts[1] < counts[2], counts  # fewer blocks checkpointed -> more activations kept
    for k in ("one", "none"):
        assert all(torch.allclose(results["all"][2][n], results[k][2][n], rtol=1e-5, atol=1e-7) for n in results[k][2])


def test_a_budget_needs_checkpointing_and_the_fast_forward():
    with pytest.raises(ConfigError, match="model.memory_budget_gib=30 picks which blocks to checkpoint"):
        build(compose_cfg(["model.path=/m", "model.memory_budget_gib=30", "model.gradient_checkpointing=false"]).model)
