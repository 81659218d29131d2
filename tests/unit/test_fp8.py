"""The opt-in FP8 base (wanexp/models/fp8.py): frozen block linears quantized per row to float8_e4m3fn, LoRA
untouched; the CPU runs torch._scaled_mm too."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.unit.test_perf_fast import output_and_grads, ti2v_batch, tiny_transformer
from wanexp.models import fp8


def _rel(a, b):
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_fp8_linear_quantizes_and_its_backward_is_an_fp8_gemm():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48).requires_grad_(False)
    q = fp8.FrozenFP8Linear(lin)
    assert q.weight_fp8.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (48, 1)
    assert dict(q.state_dict()) == {}  # nothing of it reaches a checkpoint or a LoRA file
    x = torch.randn(2, 10, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = q(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 10, 48)
    err = _rel(out, lin(x))
    assert 5e-3 < err < 6e-2, err  # really FP8 (bf16 alone is ~4e-3 here), and still the same linear
    grad = torch.randn_like(out)
    out.backward(grad)
    # grad @ diag(s_w) Wq = (grad * s_w^T) @ Wq with the left factor in e4m3 rows, product rounded to bf16
    g_fp8, g_scale = fp8.quantize_rows(grad.reshape(-1, 48).float() * q.weight_scale.t())
    expected = (g_scale * (g_fp8.float() @ q.weight_fp8.float())).to(torch.bfloat16).reshape(2, 10, 64)
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, expected.float())
    assert q(x.detach()).dtype == torch.float32  # fp32 in, no autocast: fp32 out, as nn.Linear


def _spy_scaled_mm(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Record the two operands of every torch._scaled_mm call."""
    calls, real = [], torch._scaled_mm

    def spy(a, b, *args, **kwargs):
        calls.append((a, b))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    return calls


def test_fp8_input_gradient_error_against_fp32():
    """A random 1024-in, 768-out linear whose rows span four decades: relative error against fp32 3.7e-2 for the
    forward and 3.6e-2 for the input gradient (e4m3 gradient rows; e5m2 rows would give 5.7e-2, the bf16 product of
    the dequantized weight 2.6e-2, a plain bf16 linear 2.9e-3 / 2.4e-3)."""
    torch.manual_seed(0)
    lin = nn.Linear(1024, 768).requires_grad_(False)
    lin.weight.mul_(torch.logspace(-2, 2, 768).unsqueeze(1))
    q = fp8.FrozenFP8Linear(lin)
    x = torch.randn(4, 64, 1024, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = q(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    fwd_err, grad_err = _rel(out, lin(x)), _rel(x.grad, grad.float() @ lin.weight)
    assert 1e-2 < fwd_err < 5e-2 and 1e-2 < grad_err < 5e-2, (fwd_err, grad_err)


def test_fp8_backward_is_one_scaled_mm_and_keeps_only_the_weight(monkeypatch):
    torch.manual_seed(0)
    q = fp8.FrozenFP8Linear(nn.Linear(64, 48).requires_grad_(False))
    buffers = {k: (v.data_ptr(), v.shape, v.stride()) for k, v in q.named_buffers()}
    assert set(buffers) == {"weight_fp8", "weight_scale", "bias"}  # one float8 copy of the weight
    calls = _spy_scaled_mm(monkeypatch)
    x = torch.randn(3, 7, 64, requires_grad=True)  # 21 tokens: not a multiple of 16, as the GEMM's M may be
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = q(x)
    assert len(calls) == 1
    saved = out.grad_fn.saved_tensors  # the weight's buffers only, no activation
    assert [t.data_ptr() for t in saved] == [q.weight_fp8.data_ptr(), q.weight_scale.data_ptr()]
    out.float().square().sum().backward()
    assert len(calls) == 2 and torch.isfinite(x.grad).all() and x.grad.shape == x.shape
    a, b = calls[1]
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.shape == (21, 48) and b.shape == (48, 64)
    assert b.stride() == (1, 48)  # Wq column-major: the transposed copy made for this call
    assert {k: (v.data_ptr(), v.shape, v.stride()) for k, v in q.named_buffers()} == buffers  # no copy kept


def test_fp8_linear_of_any_shape(monkeypatch):
    """Any number of tokens (0 included) runs both FP8 GEMMs; a linear whose dims are not multiples of 16 (which CUDA's
    _scaled_mm refuses and convert_blocks leaves alone) runs both GEMMs on its dequantized weight."""
    torch.manual_seed(0)
    calls = _spy_scaled_mm(monkeypatch)
    q = fp8.FrozenFP8Linear(nn.Linear(64, 48).requires_grad_(False))
    for tokens in (0, 1, 5):
        x = torch.randn(tokens, 64, requires_grad=True)
        q(x).sum().backward()
        assert x.grad.shape == (tokens, 64)
    assert len(calls) == 6
    odd = fp8.FrozenFP8Linear(nn.Linear(40, 24).requires_grad_(False))
    x = torch.randn(5, 40, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = odd(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert len(calls) == 6
    assert torch.equal(out, (x.to(torch.bfloat16) @ odd.weight.t() + odd.bias.to(torch.bfloat16)))
    assert torch.equal(x.grad, (grad @ odd.weight).float())


def test_convert_blocks_keeps_the_lora_and_trains_it():
    ref = tiny_transformer()
    t = copy.deepcopy(ref)
    n = fp8.convert_blocks(t.blocks)
    linears = [m for m in ref.blocks.modules() if type(m) is nn.Linear and not m.weight.requires_grad]
    assert n == len(linears) > 0
    assert not [m for m in t.blocks.modules() if type(m) is nn.Linear and not m.weight.requires_grad]
    trainable = {k: v for k, v in ref.named_parameters() if v.requires_grad}
    assert {k: v for k, v in t.named_parameters() if v.requires_grad}.keys() == trainable.keys()
    assert set(t.state_dict()) == set(ref.state_dict()) - {k for k in ref.state_dict() if k.startswith("blocks.") and
                                                          "lora_" not in k and _is_block_linear(ref, k)}
    hidden, timestep, text = ti2v_batch(2, [True, False])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, grads_ref = output_and_grads(ref, hidden, timestep, text)
        out, grads = output_and_grads(t, hidden, timestep, text)
    assert 1e-3 < _rel(out, out_ref) < 0.2
    for k, g in grads.items():
        assert torch.isfinite(g).all() and g.abs().sum() > 0, k
    cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in grads.values()]),
                                                torch.cat([grads_ref[k].flatten() for k in grads]), dim=0)
    assert cos > 0.9, float(cos)


def _is_block_linear(model, key: str) -> bool:
    module = model.get_submodule(key.rsplit(".", 1)[0])
    return type(module) is nn.Linear and not module.weight.requires_grad


def test_a_run_with_fp8_base_trains_and_exports(shared_dir, tmp_path, capsys):
    """The whole run (wanexp.train.run, in process: the CLI's own path is covered by the other CLI tests)."""
    from safetensors.torch import load_file

    from tests.integration.conftest import tiny_run

    out = tmp_path / "run"
    tiny_run(shared_dir, out, ["data.use_cache=false", "trainer.max_steps=2", "model.fp8=true",
                               "trainer.precision=bf16-mixed", "callbacks.validation.every_n_steps=0"])
    assert "frozen linears of the dense transformer in FP8" in capsys.readouterr().out
    lora = load_file(str(out / "lora" / "final" / "tiny_lora_diffusers.safetensors"))
    assert lora and all(torch.isfinite(v).all() for v in lora.values())


def test_a_v100_skips_compile_and_refuses_fp8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100S-PCIE-32GB")
    from wanexp.models.wan22 import fast

    assert fast.compile_supported() == (False, "Tesla V100S-PCIE-32GB (compute capability 7.0) is below Triton's 8.0")
    ok, why = fp8.fp8_supported()
    assert not ok and why.startswith("Tesla V100S-PCIE-32GB (compute capability 7.0) has no FP8 GEMM")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert fp8.fp8_supported() == (True, "") and fast.compile_supported() == (True, "")


# ---- FP8 storage (model.fp8_storage): weight-only, dequantized at use, any GPU -------------------------------------
def test_fp8_storage_linear_error_and_input_gradient():
    """A random 1024x1024 bf16 linear whose rows span four decades of magnitude: 2.6e-2 relative output error against
    the fp32 linear (the bf16 linear's own is 2.9e-3; one scale for every row would give 0.89); the input's gradient
    is grad @ the dequantized weight."""
    torch.manual_seed(0)
    lin = nn.Linear(1024, 1024).requires_grad_(False)
    lin.weight.mul_(torch.logspace(-2, 2, 1024).unsqueeze(1))
    x = torch.randn(4, 64, 1024)
    exact = lin(x)
    lin16 = copy.deepcopy(lin).to(torch.bfloat16)
    q = fp8.StoredFP8Linear(lin16)
    assert q.weight_fp8.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (1024, 1) and q.dtype == torch.bfloat16
    assert dict(q.state_dict()) == {}  # nothing of it reaches a checkpoint or a LoRA file
    xb = x.to(torch.bfloat16).requires_grad_()
    out = q(xb)
    assert out.dtype == torch.bfloat16
    err, bf16_err = _rel(out, exact), _rel(lin16(xb), exact)
    assert 1e-2 < err < 4e-2 and bf16_err < 4e-3, (err, bf16_err)  # really FP8 rows, and still the same linear
    grad = torch.randn_like(out)
    out.backward(grad)
    expected = (grad.reshape(-1, 1024) @ q.weight).reshape(xb.shape)
    assert torch.equal(xb.grad, expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 input under autocast: bf16 product, fp32 gradient
        x32 = x.clone().requires_grad_()
        out = q(x32)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and x32.grad.dtype == torch.float32 and torch.isfinite(x32.grad).all()


def test_fp8_storage_keeps_the_lora_and_it_trains():
    t = tiny_transformer()
    n = fp8.store_blocks(t.blocks)
    assert n == 2 * 10 and not [m for m in t.blocks.modules() if type(m) is nn.Linear and not m.weight.requires_grad]
    params = [p for p in t.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    hidden, timestep, text = ti2v_batch(2, [True, False])
    losses = []
    for _ in range(5):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = t(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
        loss = (out.float() ** 2).mean()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("overrides, hinted", [
    (["model.gradient_checkpointing=true"], True),  # every block fully checkpointed: the FP8 base's slowest
    (["model.gradient_checkpointing=true", "model.memory_budget_gib=20"], False),  # the budget plans selective blocks
    (["model.gradient_checkpointing=true", "model.selective_checkpointing=false"], False),  # said so
    (["model.gradient_checkpointing=true", "model.selective_checkpointing=true"], False),
    (["model.gradient_checkpointing=false"], False),
])
def test_the_fp8_load_line_names_the_setting_that_pays_where_every_block_is_fully_checkpointed(overrides, hinted):
    from tests.conftest import compose_cfg
    from wanexp.composition import build
    from wanexp.module import fp8_hint

    hint = fp8_hint(build(compose_cfg(["experiment=demo", "model.fp8=true", *overrides]).model))
    assert bool(hint) is hinted
    if hinted:
        assert hint.startswith("; every block fully checkpointed") and "set model.memory_budget_gib, or " \
            "model.selective_checkpointing=true" in hint and "\n" not in hint


def test_a_two_expert_fp8_load_says_the_hint_once(tmp_path, capsys):
    """The FP8 base's load line, one per expert: the checkpointing hint rides on the first only."""
    from tests.conftest import compose_cfg, module_from

    module = module_from(compose_cfg(["experiment=demo", "model=tiny_t2v14b", f"paths.tiny_model_dir={tmp_path}",
                                      "model.fp8=true", "model.gradient_checkpointing=true",
                                      "trainer.precision=bf16-mixed"]))
    module.configure_model()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("wanexp: model.fp8: ")]
    assert len(lines) == 2 and [("fully checkpointed" in ln) for ln in lines] == [True, False], lines
