"""The attention kernel a model runs (``model.attention_backend``): one of diffusers' installed dispatcher backends,
or ``fa4``: FlashAttention-4 (the ``flash-attn-4`` package, CuTe DSL kernels for Hopper and Blackwell) as torch's
flash-attention implementation, which the ``_native_flash`` backend then calls.

torch's registration (``torch.nn.attention.activate_flash_attention_impl("FA4")``) replaces the CUDA kernels of
``aten._scaled_dot_product_flash_attention`` and its backward for the whole process, so compiled blocks, their
checkpoint's recompute and sequence parallel's attention run it like any SDPA kernel; every other SDPA call keeps its
kernel (on Hopper the default SDPA runs cuDNN's). It is registered here against this module, which adapts two things
between torch's call and the package's functions:

- torch 2.11-2.13 unpack ``(out, lse)`` from the package's forward, which returns ``(out, lse, p, row_max, o_lo)``;
- a compiled backward passes q, k and v with stride 0 on their batch dimension of size 1 (inductor's layout; the
  addresses are the same for any stride there), and the package refuses a zero stride in an output, which torch's
  call code and the package allocate like q.
  :func:`dense` gives such a tensor a nonzero stride on its size-1 dimensions: the same storage, the same elements.

Measured in docs/performance.md (Attention kernels)."""
from __future__ import annotations

import functools
import importlib.util

import torch

from wanexp.errors import ConfigError

FA4 = "fa4"
FA4_DISPATCH = "_native_flash"  # the diffusers backend whose SDPA call runs torch's flash kernels, then FA4's
FA4_KERNELS = "flash_attn.cute.interface"
FA4_CAPABILITIES = (9, 10)  # Hopper, Blackwell (what the package and torch's registration take)
_active = False


def check_attention_backend(name: str) -> None:
    """model.attention_backend must be ``fa4`` with its package installed, or one of diffusers' installed backends
    (no *_hub kernel downloads)."""
    if name == FA4:
        missing = fa4_missing()
        if missing:
            raise ConfigError(f"model.attention_backend=fa4: {missing}; or set model.attention_backend=null")
        return
    from diffusers.models.attention_dispatch import AttentionBackendName

    names = [a.value for a in AttentionBackendName]
    if name not in names:
        raise ConfigError(f"model.attention_backend={name}: allowed values are null (default), {FA4}, "
                          + ", ".join(n for n in names if not n.endswith("_hub")))
    if name.endswith("_hub"):
        raise ConfigError(f"model.attention_backend={name}: *_hub backends download kernels from a hub; use the "
                          "installed equivalent (e.g. flash, _flash_3, native, fa4)")


def fa4_missing() -> str:
    """What this Python lacks for FlashAttention-4 ("" when nothing): the package, or torch's registration."""
    try:
        found = importlib.util.find_spec(FA4_KERNELS) is not None
    except ModuleNotFoundError:  # no flash_attn package at all
        found = False
    if not found:
        return "the flash-attn-4 package is not installed: pip install flash-attn-4 (Hopper and Blackwell GPUs)"
    if importlib.util.find_spec("torch.nn.attention._fa4") is None:
        return f"torch {torch.__version__} has no FlashAttention-4 registration: install torch 2.11 or newer"
    return ""


def fa4_device_problem(accelerator: str = "auto") -> str:
    """Why this process cannot run FlashAttention-4 ("" when it can): a CPU run, no CUDA GPU, or a GPU that is not a
    Hopper or Blackwell. There is no CPU kernel, and the flash backend on the CPU would run another one silently."""
    if str(accelerator) == "cpu":
        return "trainer.accelerator=cpu: FlashAttention-4 runs on NVIDIA Hopper and Blackwell GPUs"
    if not torch.cuda.is_available():
        return "this machine has no CUDA GPU; FlashAttention-4 runs on NVIDIA Hopper and Blackwell GPUs"
    bad = [f"{torch.cuda.get_device_name(i)} (compute capability {'.'.join(map(str, cap))})"
           for i in range(torch.cuda.device_count())
           if (cap := torch.cuda.get_device_capability(i))[0] not in FA4_CAPABILITIES]
    if bad:
        return f"{bad[0]} is not a Hopper or Blackwell GPU (compute capability 9.x or 10.x)"
    return ""


def check_attention_kernel(backend: str | None, accelerator: str = "auto") -> None:
    """model.attention_backend=fa4 where it cannot run: one line, before anything loads (the run at its start, the
    module on every rank, and every load of a transformer with it)."""
    if backend != FA4:
        return
    problem = fa4_missing() or fa4_device_problem(accelerator)
    if problem:
        raise ConfigError(f"model.attention_backend=fa4: {problem}; or set model.attention_backend=null")


def set_attention_backend(model, name: str | None) -> None:
    """``model.set_attention_backend`` for a value of model.attention_backend (null: the model's default). Any value
    but fa4 gives torch's flash-attention kernels back where an earlier model of the process took them for FA4 (the
    bench's variants; a run's models all share one value)."""
    if name != FA4:
        deactivate_fa4()
    if not name:
        return
    if name == FA4:
        check_attention_kernel(name)
        activate_fa4()
        name = FA4_DISPATCH
    model.set_attention_backend(name)


def activate_fa4() -> None:
    """torch's flash-attention kernels replaced by FlashAttention-4 through this module, once per process."""
    global _active
    import torch.nn.attention as attention
    from torch.nn.attention import _fa4

    if _active and attention.current_flash_attention_impl() == "FA4":
        return
    attention.register_flash_attention_impl(
        "FA4", register_fn=functools.partial(_fa4.register_flash_attention_fa4, module_path=__name__))
    attention.activate_flash_attention_impl("FA4")
    _active = True


def deactivate_fa4() -> None:
    """torch's own flash-attention kernels back, where :func:`activate_fa4` replaced them in this process."""
    global _active
    if not _active:
        return
    import torch.nn.attention as attention

    if attention.current_flash_attention_impl() == "FA4":
        attention.restore_flash_attention_impl(_raise_warn=False)
    _active = False


# ---- what torch's FA4 registration calls (module_path=this module) ---------------------------------------------
def dense(t):
    """``t`` with a nonzero stride on each of its size-1 dimensions that has stride 0 (the same storage and
    elements: a size-1 dimension's stride addresses nothing); ``t`` itself when it has none, or when a dimension
    larger than 1 has stride 0 (a real broadcast, left to the kernel's own check)."""
    if not isinstance(t, torch.Tensor) or 0 not in t.stride():
        return t
    if any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride())):
        return t
    span = max((n * s for n, s in zip(t.shape, t.stride())), default=1) or 1
    return t.as_strided(t.shape, [span if s == 0 else s for s in t.stride()], t.storage_offset())


def _kernels():
    from flash_attn.cute import interface  # FA4_KERNELS

    return interface


def _flash_attn_fwd(q, k, v, *args, **kwargs):
    kwargs = {key: dense(x) for key, x in kwargs.items()}
    result = _kernels()._flash_attn_fwd(dense(q), dense(k), dense(v), *(dense(a) for a in args), **kwargs)
    return result[0], result[1]


def _flash_attn_bwd(*args, **kwargs):
    result = _kernels()._flash_attn_bwd(*(dense(a) for a in args), **{key: dense(x) for key, x in kwargs.items()})
    return result[0], result[1], result[2]
