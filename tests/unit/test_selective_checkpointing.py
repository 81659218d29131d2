"""Selective activation checkpointing (``model.selective_checkpointing``, wanexp/models/wan22/fast.py): a checkpointed
block keeps its attention output and its FFN up-projection for the backward and recomputes the rest. The same
function and LoRA gradients as full checkpointing, bit for bit on the CPU (kept or recomputed, the same operations
give the same values); the policy keeps exactly those two outputs per block; the planners count what they keep; the
settings it cannot run with are refused in one line."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.unit.test_perf_fast import TINY, output_and_grads, ti2v_batch, tiny_transformer
from wanexp.models.wan22 import fast


def _checkpointed(selective: bool, fp8: bool = False):
    t = fast.use_frame_modulation(tiny_transformer())
    if fp8:  # model.fp8=true: the frozen linears as FP8 GEMMs (torch._scaled_mm, bias added after)
        from wanexp.models.fp8 import convert_blocks

        assert convert_blocks(t.blocks) == 10 * TINY["num_layers"]
    t.enable_gradient_checkpointing()
    fast.set_selective_checkpointing(t, selective)
    return t


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-base", "fp8-base"])
def test_selective_checkpointing_keeps_the_attention_and_the_up_projection_and_computes_the_same(fp8):
    full, selective = _checkpointed(False, fp8), _checkpointed(True, fp8)
    selective.load_state_dict(full.state_dict())
    decisions = []
    policy = selective.blocks[0]._wanexp_keep

    def recorded(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        if not ctx.is_recompute:
            decisions.append((op, decision.name))
        return decision

    selective._wanexp_keep_policy = recorded  # what every block's forward checkpoints with (fast.keep_outputs)
    hidden, timestep, text = ti2v_batch(3, [True, False])
    ref, ref_g = output_and_grads(full, hidden, timestep, text)
    out, g = output_and_grads(selective, hidden, timestep, text)
    assert torch.equal(out, ref) and g.keys() == ref_g.keys()
    assert all(torch.equal(g[n], ref_g[n]) for n in g)
    kept = [op for op, d in decisions if d == "MUST_SAVE"]
    layers = TINY["num_layers"]
    assert sum(op in fast.ATTENTION_OPS for op in kept) == layers  # self-attention; cross-attention is recomputed
    assert sum(op in fast.ATTENTION_OPS for op, _ in decisions) == 2 * layers
    assert len(kept) == 2 * layers and len(decisions) > 10 * len(kept)  # the up-projection; the rest recomputed
    gemm = torch.ops.aten._scaled_mm.default if fp8 else torch.ops.aten.addmm.default
    assert sum(op is gemm for op in kept) == layers


def test_the_up_projection_is_the_gemm_as_wide_as_the_ffn():
    policy = fast.KeepAttentionAndUpProjection(ffn_dim=64)
    ctx = type("Ctx", (), {"is_recompute": False})()
    x = torch.zeros(5, 32)
    assert policy(ctx, torch.ops.aten.addmm.default, torch.zeros(64), x, torch.zeros(32, 64)).name == "MUST_SAVE"
    assert policy(ctx, torch.ops.aten.addmm.default, torch.zeros(32), x, torch.zeros(32, 32)).name == "PREFER_RECOMPUTE"
    lora_b = torch.ops.aten.mm.default, torch.zeros(5, 4), torch.zeros(4, 64)  # a LoRA product as wide as the FFN
    assert policy(ctx, *lora_b).name == "PREFER_RECOMPUTE"
    assert policy(ctx, torch.ops.aten.gelu.default, torch.zeros(5, 64)).name == "PREFER_RECOMPUTE"
    scaled = torch.ops.aten._scaled_mm.default  # the FP8 base's GEMM: (x, w^T, scales...), its bias added after
    assert policy(ctx, scaled, x, torch.zeros(32, 64), torch.ones(5, 1), torch.ones(1, 64)).name == "MUST_SAVE"
    assert policy(ctx, scaled, x, torch.zeros(32, 32), torch.ones(5, 1), torch.ones(1, 32)).name == "PREFER_RECOMPUTE"
    attention = fast.ATTENTION_OPS[0]
    q, text = torch.zeros(1, 2, 40, 16), torch.zeros(1, 2, 7, 16)
    assert policy(ctx, attention, q, q, q).name == "MUST_SAVE"
    assert policy(ctx, attention, q, text, text).name == "PREFER_RECOMPUTE"  # cross-attention


def test_the_budget_and_the_plan_count_what_a_selective_block_keeps():
    from wanexp.models.wan22.memory import WanMemory

    t = _checkpointed(True)
    c = t.config
    per_token = fast.kept_bytes_per_token(c.num_attention_heads, c.attention_head_dim, c.ffn_dim)
    assert fast.kept_gib(t, 1000) == 1000 * per_token / 2**30 and fast.kept_gib(_checkpointed(False), 1000) == 0
    config = {"num_attention_heads": 24, "attention_head_dim": 128, "ffn_dim": 14336, "num_layers": 30}
    plain = WanMemory().activations_gib(config, 4400, True, False, True)
    kept = WanMemory().activations_gib(config, 4400, True, False, True, selective=True)
    # the 5B at 704x1280x17: 30 blocks x 4,400 tokens x (attention 3072 + FFN 14336 wide, bf16; log-sum-exp fp32)
    assert kept - plain == pytest.approx(30 * 4400 * (2 * 3072 + 4 * 24 + 2 * 14336) / 2**30) and 4 < kept - plain < 5


@pytest.mark.parametrize("overrides, message", [
    (["model.selective_checkpointing=true", "model.gradient_checkpointing=false"],
     "model.selective_checkpointing=true chooses what a checkpointed block keeps: it needs "
     "model.gradient_checkpointing=true"),
    (["model.selective_checkpointing=true", "model.offload_activations=true", "model.gradient_checkpointing=true"],
     "model.selective_checkpointing=true keeps outputs on the GPU that model.offload_activations=true"),
    (["model=tiny_s2v", "model.selective_checkpointing=true", "model.gradient_checkpointing=true"],
     "model.selective_checkpointing=true: model=tiny_s2v's blocks have no save policy"),
])
def test_settings_it_cannot_run_with_are_one_line(overrides, message):
    from tests.conftest import compose_cfg
    from wanexp.composition import build
    from wanexp.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        build(compose_cfg(["experiment=demo", *overrides]).model)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_budget_spends_its_room_on_selective_blocks_first():
    """model.selective_checkpointing=null (the default) with a budget: selective blocks first (the most time saved per
    GiB), then blocks not checkpointed at all; true and false keep their plans."""
    # the 5B at 4,400 tokens: 0.637 GiB of activations per block, 0.143 GiB kept by a selective one, inputs 0.025 GiB,
    # 10.7 GiB held; 30 GiB: 14.6 GiB free -> 30 selective (4.3 GiB), then 10.3 // 0.494 = 20 not checkpointed
    per_block, kept = 0.637, 0.143
    assert fast.plan_blocks(30, per_block, kept, 30.0, 10.7, 0.025, None) == (10, 10)
    assert fast.plan_blocks(30, per_block, kept, 30.0, 10.7, 0.025, False) == (8, 0)  # 8 fully, 22 not at all
    assert fast.plan_blocks(30, per_block, kept, 30.0, 10.7, 0.025, True) == (
        (n := fast.blocks_to_checkpoint(30, per_block - kept, 30.0, 10.7 + 30 * kept, 0.025)), n)
    # 20 GiB: 5.6 GiB free -> every block selective, 1.3 GiB left turns 2 of them into unchecked ones
    assert fast.plan_blocks(30, per_block, kept, 20.0, 10.7, 0.025, None) == (28, 28)
    # 14 GiB: room for one selective block; 11 GiB: for none
    assert fast.plan_blocks(30, per_block, kept, 14.0, 10.7, 0.025, None) == (30, 1)
    assert fast.plan_blocks(30, per_block, kept, 11.0, 10.7, 0.025, None) == (30, 0)
    assert fast.plan_blocks(30, per_block, kept, 200.0, 10.7, 0.025, None) == (0, 0)


def test_a_budget_with_room_for_one_selective_block_keeps_its_outputs_and_computes_the_same():
    full, auto = _checkpointed(False), _checkpointed(None)
    auto.load_state_dict(full.state_dict())
    hidden, timestep, text = ti2v_batch(3, [True, False])
    tokens = hidden.shape[0] * hidden.shape[2] * hidden.shape[3] * hidden.shape[4] // 4  # patches of 1x2x2
    c = auto.config
    held = sum(p.numel() for p in auto.parameters() if p.requires_grad) * 12 / 2**30  # as block_plan counts it
    inputs = len(auto.blocks) * tokens * c.num_attention_heads * c.attention_head_dim * 2 / 2**30
    kept, per_block = fast.kept_gib(auto, tokens), fast.block_activation_gib(c, tokens)
    assert 0 < 2 * kept < per_block
    fast.set_memory_budget(auto, (held + inputs + 1.5 * per_block + 1.5 * kept) / 0.9)
    ref, ref_g = output_and_grads(full, hidden, timestep, text)
    out, g = output_and_grads(auto, hidden, timestep, text)
    assert auto._wanexp_ckpt_for_tokens == {tokens: (2, 1)}
    assert auto.blocks[0]._wanexp_keep is not None and auto.blocks[1]._wanexp_keep is None
    assert torch.equal(out, ref) and all(torch.equal(g[n], ref_g[n]) for n in ref_g)
    fast.set_memory_budget(auto, None)  # no budget: every block checkpointed, none selectively
    output_and_grads(auto, hidden, timestep, text)
    assert all(block._wanexp_keep is None for block in auto.blocks)
