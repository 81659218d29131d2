"""model.attention_backend (wanexp/models/attention.py): ``fa4`` registers FlashAttention-4 as torch's flash kernels
through wanexp's adapter and runs the models on diffusers' ``_native_flash`` backend; where it cannot run (no
package, the CPU, a GPU other than Hopper or Blackwell) it is refused in one line. The package's kernels need a
Hopper GPU: here a stand-in with the package's calling convention and its layout check (no zero stride) takes their
place behind torch's own FA4 call code."""
from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from wanexp.errors import ConfigError
from wanexp.models import attention

S, H, D = 12, 2, 8


def _sdpa_bshd(q, k, v, scale=None):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          scale=scale).transpose(1, 2)


def _stand_in(calls: list) -> types.ModuleType:
    """flash_attn.cute.interface as the tests see it: the package's return values (a 5-tuple forward) and its
    refusal of a zero stride in any tensor it is given (flash_attn.cute.cute_dsl_utils.validate_output_layout)."""
    module = types.ModuleType(attention.FA4_KERNELS)

    def layout(*tensors):
        for t in tensors:
            if isinstance(t, torch.Tensor):
                assert 0 not in t.stride(), "out must not have broadcast dimensions"

    def fwd(q, k, v, softmax_scale=None, out=None, **_):
        layout(q, k, v, out)
        calls.append("fwd")
        o = _sdpa_bshd(q, k, v, softmax_scale)
        if out is not None:
            out.copy_(o)
            o = out
        return o, torch.zeros(q.shape[0], q.shape[2], q.shape[1]), None, None, None

    def bwd(q, k, v, out, dout, lse, softmax_scale=None, **_):
        layout(q, k, v, out, dout, lse)
        calls.append("bwd")
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        _sdpa_bshd(qq, kk, vv, softmax_scale).backward(dout)
        return qq.grad, kk.grad, vv.grad

    module._flash_attn_fwd, module._flash_attn_bwd = fwd, bwd
    return module


def _batch_stride_zero(seed: int) -> torch.Tensor:
    """(1, S, H, D) with stride 0 on the batch dimension: what a compiled backward's recompute passes (inductor)."""
    x = torch.randn(S, H, D, generator=torch.Generator().manual_seed(seed))
    return x.as_strided((1, S, H, D), (0, H * D, D, 1))


def _call(fn, **values):
    """torch's FA4 call code with the arguments its version takes (2.11 and 2.13 differ in a few)."""
    names = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in values.items() if k in names})


def test_dense_gives_a_size_one_dimension_a_stride_and_keeps_storage_and_elements():
    x = _batch_stride_zero(0)
    d = attention.dense(x)
    assert 0 in x.stride() and 0 not in d.stride()
    assert d.data_ptr() == x.data_ptr() and torch.equal(d, x)
    plain = torch.randn(1, S, H, D)
    assert attention.dense(plain) is plain
    broadcast = torch.randn(1, H, D).expand(S, H, D)  # a real broadcast: left to the kernel's own check
    assert attention.dense(broadcast) is broadcast


def test_torchs_fa4_calls_run_through_the_adapter_on_zero_stride_inputs(monkeypatch):
    """torch's _fa4 forward and backward (what its registered CUDA kernels call), pointed at wanexp's adapter as
    activate_fa4 points them: the package's 5-tuple forward is adapted to torch's (out, lse), and q, k, v, out and the
    output gradient with a zero batch stride reach the kernels with a nonzero one, the same elements."""
    from torch.nn.attention import _fa4

    calls: list = []
    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    package.cute, cute.interface = cute, _stand_in(calls)
    for module in (package, cute, cute.interface):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(_fa4, "_FA4_MODULE_PATH", attention.__name__)
    q, k, v = (_batch_stride_zero(i) for i in range(3))
    out_bhsd = torch.empty_like(q.transpose(1, 2))  # as torch's SDPA forward allocates its output
    assert 0 in out_bhsd.stride()
    scale = D ** -0.5
    common = dict(query=q, key=k, value=v, cu_seq_q=None, cu_seq_k=None, max_q=S, max_k=S, scale=scale,
                  is_causal=False, window_size_left=None, window_size_right=None)
    out, lse = _call(_fa4._fa4_run_forward, **common, seqused_k=None, out=out_bhsd.transpose(1, 2))
    ref = _sdpa_bshd(q, k, v, scale)
    assert torch.equal(out_bhsd.transpose(1, 2), ref) and torch.equal(out, ref) and lse.shape == (1, H, S)

    grad = _batch_stride_zero(3)
    dq, dk, dv = _call(_fa4._fa4_run_backward, **common, grad_out=grad, out=ref, logsumexp=lse)
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    _sdpa_bshd(qq, kk, vv, scale).backward(grad)
    assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), (qq.grad, kk.grad, vv.grad)))
    assert calls == ["fwd", "bwd"]


def test_activation_registers_torchs_fa4_on_the_adapter(monkeypatch):
    import torch.nn.attention as attn
    from torch.nn.attention import _fa4

    monkeypatch.setattr(_fa4, "_FA4_MODULE_PATH", _fa4._FA4_MODULE_PATH)
    monkeypatch.setattr(attention, "_active", False)
    monkeypatch.setattr(_fa4, "_fa4_register_kernels", lambda: None)  # the dispatcher keeps its CPU and CUDA kernels
    try:
        attention.activate_fa4()
        assert attn.current_flash_attention_impl() == "FA4" and _fa4._FA4_MODULE_PATH == attention.__name__
        attention.activate_fa4()  # once per process
    finally:
        attn.restore_flash_attention_impl()


def test_a_model_without_fa4_gives_torchs_flash_kernels_back(monkeypatch):
    """The bench's variants in one process: a model set to another backend (or the default) after one set to fa4 runs
    torch's own flash kernels again; fa4 again takes them again."""
    import torch.nn.attention as attn
    from torch.nn.attention import _fa4

    monkeypatch.setattr(_fa4, "_FA4_MODULE_PATH", _fa4._FA4_MODULE_PATH)
    monkeypatch.setattr(attention, "_active", False)
    monkeypatch.setattr(_fa4, "_fa4_register_kernels", lambda: None)
    monkeypatch.setattr(attention, "check_attention_kernel", lambda name, accelerator="auto": None)
    set_to = []
    model = types.SimpleNamespace(set_attention_backend=set_to.append)
    try:
        for name, impl in (("fa4", "FA4"), (None, None), ("fa4", "FA4"), ("_native_flash", None), ("fa4", "FA4")):
            attention.set_attention_backend(model, name)
            assert attn.current_flash_attention_impl() == impl, name
        assert set_to == ["_native_flash"] * 4
    finally:
        attn.restore_flash_attention_impl(_raise_warn=False)


def test_fa4_without_its_package_is_one_line(monkeypatch):
    real = attention.importlib.util.find_spec
    monkeypatch.setattr(attention.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("flash_attn") else real(name, *a))
    with pytest.raises(ConfigError, match=r"model.attention_backend=fa4: the flash-attn-4 package is not installed: "
                                          r"pip install flash-attn-4 .*; or set model.attention_backend=null"):
        attention.check_attention_backend("fa4")
    with pytest.raises(ConfigError, match="allowed values are null .default., fa4, "):
        attention.check_attention_backend("fast")


@pytest.mark.parametrize("accelerator,gpus,message", [
    ("cpu", [(9, 0)], "trainer.accelerator=cpu: FlashAttention-4 runs on NVIDIA Hopper and Blackwell GPUs"),
    ("auto", [], "this machine has no CUDA GPU"),
    ("gpu", [(9, 0), (8, 0)], r"GPU1 \(compute capability 8.0\) is not a Hopper or Blackwell GPU"),
    ("gpu", [(7, 0)], r"GPU0 \(compute capability 7.0\) is not a Hopper or Blackwell GPU"),
    ("gpu", [(9, 0), (10, 0)], None),
])
def test_fa4_where_it_cannot_run_is_one_line(monkeypatch, accelerator, gpus, message):
    monkeypatch.setattr(attention, "fa4_missing", lambda: "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(gpus))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: gpus[i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"GPU{i}")
    attention.check_attention_kernel("native", accelerator)  # another backend: nothing to check
    if message is None:
        attention.check_attention_kernel("fa4", accelerator)
        return
    with pytest.raises(ConfigError, match=f"model.attention_backend=fa4: {message}.*; or set "
                                          "model.attention_backend=null"):
        attention.check_attention_kernel("fa4", accelerator)


def test_set_attention_backend_runs_fa4_on_the_flash_backend(monkeypatch):
    set_to, activated = [], []
    model = types.SimpleNamespace(set_attention_backend=set_to.append)
    monkeypatch.setattr(attention, "activate_fa4", lambda: activated.append(1))
    monkeypatch.setattr(attention, "fa4_missing", lambda: "")
    monkeypatch.setattr(attention, "fa4_device_problem", lambda accelerator="auto": "")
    attention.set_attention_backend(model, None)
    attention.set_attention_backend(model, "_native_cudnn")
    attention.set_attention_backend(model, "fa4")
    assert set_to == ["_native_cudnn", "_native_flash"] and activated == [1]
    monkeypatch.setattr(attention, "fa4_device_problem", lambda accelerator="auto": "this machine has no CUDA GPU")
    with pytest.raises(ConfigError, match="this machine has no CUDA GPU"):  # a load outside train.py's checks
        attention.set_attention_backend(model, "fa4")
    assert activated == [1]
