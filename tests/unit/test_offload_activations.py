"""model.offload_activations (wanexp/models/wan22/fast.py:offloaded_checkpoint): the checkpointed blocks' inputs are
saved through the save-to-host hooks, and the loss and LoRA gradients are those of plain checkpointing, bit for bit,
with and without block swap."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.unit.test_blockswap import assert_same_bitwise
from tests.unit.test_perf_fast import output_and_grads, ti2v_batch, tiny_transformer
from wanexp.models import blockswap
from wanexp.models.wan22 import fast


def checkpointed(offload: bool, layers: int = 2):
    t = fast.use_frame_modulation(tiny_transformer(num_layers=layers))
    t.enable_gradient_checkpointing()
    fast.set_memory_budget(t, None)
    t._wanexp_offload_activations = offload
    return t


class CountingSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
    """save_on_cpu's contract (pack moves to the host, unpack brings back), counting what it packs."""
    packed: list = []

    def __init__(self, pin_memory=False, device_type="cuda"):
        def pack(x):
            CountingSaveOnCpu.packed.append(tuple(x.shape))
            return x.device, x.cpu()

        super().__init__(pack, lambda p: p[1].to(p[0]))


@pytest.mark.parametrize("swap", [0, 2], ids=["no-swap", "swap-2"])
def test_offloaded_inputs_give_the_same_loss_and_lora_gradients_bitwise(swap, monkeypatch):
    ref = checkpointed(False)
    t = copy.deepcopy(ref)
    t._wanexp_offload_activations = True
    if swap:
        blockswap.enable(t.blocks, swap)
    CountingSaveOnCpu.packed = []
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    hidden, timestep, text = ti2v_batch(2, [True, False])
    assert_same_bitwise(ref, t, hidden, timestep, text)  # the first block's LoRA too: its input requires grad
    # each block's input hidden states (B, tokens, dim) went through the host hooks, on each of the two passes
    tokens = hidden.shape[2] * hidden.shape[3] * hidden.shape[4] // 4
    hidden_saves = [s for s in CountingSaveOnCpu.packed if s == (2, tokens, 32)]
    assert len(hidden_saves) == 2 * len(t.blocks), CountingSaveOnCpu.packed


def test_offloaded_inputs_with_compiled_blocks():
    """Compiled blocks (model.compile) under the offloaded checkpoint: the result of the compiled checkpoint without
    offload (the "eager" backend: dynamo's graphs run as traced, so the comparison is of the wiring)."""
    ref = checkpointed(False)
    t = copy.deepcopy(ref)
    t._wanexp_offload_activations = True
    for m in (ref, t):
        fast.compile_blocks(m, checkpoint=True, backend="eager")
    hidden, timestep, text = ti2v_batch(2, [True, False])
    out_ref, grads_ref = output_and_grads(ref, hidden, timestep, text)
    out, grads = output_and_grads(t, hidden, timestep, text)
    assert torch.allclose(out, out_ref, rtol=0, atol=1e-6)
    assert grads.keys() == grads_ref.keys() and len(grads) == 40
    for k in grads:
        assert grads_ref[k].abs().max() > 0 and torch.allclose(grads[k], grads_ref[k], rtol=1e-5, atol=1e-7), k
