"""model.offload_activations (wanexp/models/wan22/fast.py:offloaded_checkpoint): each checkpointed block's input goes
to the host once, the device input is dropped after the forward (the recompute reads the host copy), the loss and
LoRA gradients are those of plain checkpointing, bit for bit, with and without block swap."""
from __future__ import annotations

import copy
import gc
import weakref

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


class HostCopies:
    """Stands in for fast.to_host on the CPU (where the real one keeps the tensor as it is): a distinct copy, as the
    pinned host copy is, with a weak reference to each device input it was given."""

    def __init__(self):
        self.shapes, self.inputs = [], []

    def __call__(self, x):
        self.shapes.append(tuple(x.shape))
        self.inputs.append(weakref.ref(x))
        return x.clone()


@pytest.mark.parametrize("swap", [0, 2], ids=["no-swap", "swap-2"])
def test_offloaded_inputs_give_the_same_loss_and_lora_gradients_bitwise(swap, monkeypatch):
    ref = checkpointed(False)
    t = copy.deepcopy(ref)
    t._wanexp_offload_activations = True
    if swap:
        blockswap.enable(t.blocks, swap)
    copies = HostCopies()
    monkeypatch.setattr(fast, "to_host", copies)
    hidden, timestep, text = ti2v_batch(2, [True, False])
    assert_same_bitwise(ref, t, hidden, timestep, text)  # the first block's LoRA too
    # each block's input hidden states (B, tokens, dim) went to the host once per forward (fp32 and bf16 runs)
    tokens = hidden.shape[2] * hidden.shape[3] * hidden.shape[4] // 4
    assert copies.shapes == [(2, tokens, 32)] * (2 * len(t.blocks)), copies.shapes  # ref runs none


def test_the_device_input_is_dropped_until_the_backward():
    """After the forward only the host copies hold the blocks' inputs: the inputs the blocks were given are freed
    (plain checkpointing keeps them referenced for its recompute)."""
    t = checkpointed(True, layers=3)
    copies = HostCopies()
    fast.to_host, real = copies, fast.to_host
    try:
        hidden, timestep, text = ti2v_batch(2, [True, False])
        out = t(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
        gc.collect()
        assert len(copies.inputs) == 3 and all(r() is None for r in copies.inputs)
        (out.float() ** 2).mean().backward()
        assert all(p.grad is not None and p.grad.abs().max() > 0 for n, p in t.named_parameters() if p.requires_grad)
    finally:
        fast.to_host = real


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
