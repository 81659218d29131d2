"""Opt-in FP8 base (``model.fp8=true``): the frozen linears of the transformer blocks stored and multiplied in FP8.

Each frozen ``nn.Linear`` of a block (the base layer under a LoRA, or a linear no adapter targets) becomes a
:class:`FrozenFP8Linear`: its weight is quantized once, at load, to ``float8_e4m3fn`` with one fp32 scale per output
row (half the memory of bf16); the forward quantizes its input per row the same way and runs one scaled FP8 GEMM
(``torch._scaled_mm``, bf16 out); the backward returns only the input's gradient (the weight is frozen) and saves no
activation for it, only the weight's float8 rows and scales. That gradient is one FP8 GEMM too
(:func:`fp8_input_grad`): ``grad @ diag(s_w) Wq = (grad * s_w^T) @ Wq``, the left factor quantized to e4m3 per row
with its own fp32 scale, ``Wq`` transposed to the column-major layout ``_scaled_mm`` needs at each backward (a transient
1-byte copy; none is kept). Linears whose dims are not multiples of 16 (which CUDA's ``_scaled_mm`` refuses;
:func:`convert_blocks` leaves them alone) multiply the dequantized weight instead. LoRA A/B, the embeddings, the norms
and ``proj_out`` are untouched. The LoRA files and checkpoints do not change (the FP8 tensors are non-persistent
buffers).

Off by default: FP8 (3 mantissa bits) changes what is computed. On random data a single GEMM's relative error is
~3.5e-2 against fp32 (forward and input gradient alike), where bf16's is ~3e-3; the whole model's is measured by the
GPU case ``fp8_5b`` (``python -m tests.gpu.run fp8_5b``).
Needs a GPU of compute capability >= 8.9 (Ada, Hopper) for the FP8 GEMM; the CPU runs it too (tests).

**FP8 storage** (``model.fp8_storage=true``, any GPU and the CPU): the same per-row quantization, but the weight is
dequantized to the base's dtype at each use (:class:`StoredFP8Linear`) and multiplied in that dtype: half the bytes
of the frozen block linears at rest (and to move, with block swap), no FP8 GEMM needed (V100, A100). The backward
dequantizes again instead of keeping the dequantized weight between forward and backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale) in float8_e4m3fn and the fp32 scale per row (amax / 448; all-zero rows get scale 1)."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def fp8_gemm_fits(weight_fp8: torch.Tensor) -> bool:
    """Whether both FP8 GEMMs of this (out, in) weight pass CUDA ``torch._scaled_mm``'s shape rule: the reduced dim
    and the second operand's two dims multiples of 16 (the forward reduces over ``in``, the input gradient over
    ``out``). The first operand's rows (the tokens) may be any number: no padding needed."""
    return weight_fp8.shape[0] % 16 == 0 and weight_fp8.shape[1] % 16 == 0


def fp8_input_grad(grad: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``grad (M, out) @ W`` for ``W = diag(weight_scale) weight_fp8`` as one FP8 GEMM, in ``grad``'s dtype:
    ``(grad * weight_scale^T) @ weight_fp8``, the left factor quantized per row with its own fp32 scale.

    The gradient is quantized to float8_e4m3fn, not e5m2 (which CUDA also accepts as the first operand): with a scale
    per row, taken from the row's own amax, e5m2's wider range buys nothing and its 2 mantissa bits double the error
    (tests/unit/test_fp8.py, random data: 3.6e-2 relative error against fp32 with e4m3, 5.7e-2 with e5m2)."""
    grad_fp8, grad_scale = quantize_rows(grad.float() * weight_scale.t())
    # _scaled_mm's second operand must be column-major (the reduced dim contiguous: Hopper's FP8 tensor cores take
    # only K-major operands), and the stored weight is (out, in) with `in` contiguous: a transient transposed copy
    # of the float8 bytes, not kept (a second copy would double the FP8 weight memory).
    weight_t = weight_fp8.t().contiguous().t()
    ones = torch.ones(1, weight_fp8.shape[1], dtype=torch.float32, device=weight_fp8.device)
    return torch._scaled_mm(grad_fp8, weight_t, scale_a=grad_scale, scale_b=ones, out_dtype=grad.dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_fp8, weight_scale, bias, out_dtype):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if fp8_gemm_fits(weight_fp8):
            x_fp8, x_scale = quantize_rows(x2)
            out = torch._scaled_mm(x_fp8, weight_fp8.t(), scale_a=x_scale, scale_b=weight_scale.t(),
                                   out_dtype=out_dtype)
        else:  # CUDA's _scaled_mm refuses these dims (convert_blocks does not convert them): the dequantized weight
            out = x2.to(out_dtype) @ dequantize(weight_fp8, weight_scale, out_dtype).t()
        if bias is not None:
            out = out + bias.to(out_dtype)
        ctx.save_for_backward(weight_fp8, weight_scale)
        ctx.in_dtype = x.dtype
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        weight_fp8, weight_scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        grad2 = grad_out.reshape(-1, grad_out.shape[-1])
        if fp8_gemm_fits(weight_fp8):
            grad_x = fp8_input_grad(grad2, weight_fp8, weight_scale)
        else:  # as in the forward: dims CUDA's _scaled_mm refuses get the dequantized weight
            grad_x = grad2 @ dequantize(weight_fp8, weight_scale, grad_out.dtype)
        return grad_x.reshape(*grad_out.shape[:-1], weight_fp8.shape[1]).to(ctx.in_dtype), None, None, None, None


def _store_rows(module: nn.Module, linear: nn.Linear) -> None:
    """``linear``'s weight as float8 rows with their scales, and its bias, as buffers of ``module`` (not saved: the
    checkpoint holds the adapters only)."""
    weight_fp8, scale = quantize_rows(linear.weight.detach())
    module.register_buffer("weight_fp8", weight_fp8, persistent=False)
    module.register_buffer("weight_scale", scale, persistent=False)
    if linear.bias is not None:
        module.register_buffer("bias", linear.bias.detach().clone(), persistent=False)
    else:
        module.bias = None


class FrozenFP8Linear(nn.Module):
    """A frozen ``nn.Linear`` in FP8 (see the module docstring). ``out_dtype``: bf16 unless the input is fp32 and no
    autocast is active (then fp32, as the linear it replaces would return)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        _store_rows(self, linear)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (bf16), for code that reads ``.weight``; the GEMMs never use it."""
        return dequantize(self.weight_fp8, self.weight_scale, torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast = torch.is_autocast_enabled(x.device.type)
        out_dtype = torch.float32 if x.dtype == torch.float32 and not autocast else torch.bfloat16
        return _FP8Linear.apply(x, self.weight_fp8, self.weight_scale, self.bias, out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3 rowwise"


def convert_blocks(blocks: nn.ModuleList) -> int:
    """Replace every frozen ``nn.Linear`` inside ``blocks`` (a transformer's repeated blocks, ``spec.blocks``; a LoRA
    layer's base layer included) by a :class:`FrozenFP8Linear`, in place; trainable linears (LoRA A/B) stay. Returns
    how many were replaced."""
    count = 0
    for block in blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and not child.weight.requires_grad and \
                        child.in_features % 16 == 0 and child.out_features % 16 == 0:
                    setattr(parent, name, FrozenFP8Linear(child))
                    count += 1
    return count


def fp8_supported() -> tuple[bool, str]:
    """Whether this machine runs the FP8 GEMM: a GPU of compute capability >= 8.9, or no GPU (the CPU kernel)."""
    from wanexp.gpu_check import gpu_capability_below

    gpu = gpu_capability_below((8, 9))
    return (False, f"{gpu} has no FP8 GEMM (8.9+: Ada, Hopper)") if gpu else (True, "")


def check_fp8(spec) -> None:
    """model.fp8=true needs the FP8 GEMM: one line on a GPU without it (below compute capability 8.9). wanexp.train.run
    checks it before anything loads or is written; the module again on every rank before it loads."""
    if not spec.fp8:
        return
    from wanexp.errors import ConfigError

    ok, why = fp8_supported()
    if not ok:
        raise ConfigError(f"model.fp8=true: {why}; set model.fp8=false")


# ---- FP8 storage: weight-only, dequantized at use --------------------------------------------------------------
def dequantize(weight_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) weight in ``dtype`` from its float8 rows and their fp32 scales."""
    return (weight_fp8.float() * scale).to(dtype)


def linear_input_grad(grad_out: torch.Tensor, weight: torch.Tensor, x_dtype: torch.dtype) -> torch.Tensor:
    """The input's gradient of ``F.linear(x, weight)`` as autograd computes it for a frozen weight (grad @ weight, in
    the forward's compute dtype, then cast back to the input's dtype as autocast's cast node does)."""
    with torch.autocast(grad_out.device.type, enabled=False):
        g = grad_out.reshape(-1, grad_out.shape[-1]).mm(weight.to(grad_out.dtype))
    return g.view(*grad_out.shape[:-1], weight.shape[1]).to(x_dtype)


class _DequantLinear(torch.autograd.Function):
    """``F.linear`` with the weight dequantized from FP8 in the forward and again in the backward (only the float8
    bytes and scales are kept in between)."""

    @staticmethod
    def forward(ctx, x, weight_fp8, weight_scale, bias, dtype):
        out = F.linear(x, dequantize(weight_fp8, weight_scale, dtype), bias)  # autocast applies as to nn.Linear
        ctx.save_for_backward(weight_fp8, weight_scale)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        weight_fp8, weight_scale = ctx.saved_tensors
        return linear_input_grad(grad_out, dequantize(weight_fp8, weight_scale, grad_out.dtype), ctx.x_dtype), \
            None, None, None, None


class StoredFP8Linear(nn.Module):
    """A frozen ``nn.Linear`` stored in float8_e4m3fn with one fp32 scale per output row, computed in ``dtype`` (the
    original weight's) after dequantizing at each use. Weight-only: no FP8 GEMM, so any GPU or the CPU runs it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        _store_rows(self, linear)

    # the stored tensors and how they become the weight: what block swap (models/blockswap.py) moves and rebuilds
    def stored_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight_fp8": self.weight_fp8, "weight_scale": self.weight_scale}

    def weight_from(self, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        return dequantize(stored["weight_fp8"], stored["weight_scale"], self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, for code that reads ``.weight``."""
        return self.weight_from(self.stored_tensors())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantLinear.apply(x, self.weight_fp8, self.weight_scale, self.bias, self.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stored fp8_e4m3 rowwise"


def store_blocks(blocks: nn.ModuleList) -> int:
    """Replace every frozen ``nn.Linear`` inside ``blocks`` (a transformer's repeated blocks, ``spec.blocks``; a LoRA
    layer's base layer included) by a :class:`StoredFP8Linear`, in place; trainable linears stay. Returns how many
    were replaced."""
    count = 0
    for block in blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and not child.weight.requires_grad:
                    setattr(parent, name, StoredFP8Linear(child))
                    count += 1
    return count
