"""Block swap (``model.blocks_to_swap=N``): the frozen linear weights of N transformer blocks live in pinned host
memory and are copied to the compute device just before the block runs, then dropped.

Generic over a list of blocks (``nn.ModuleList``): :func:`enable` replaces each frozen linear of the swapped blocks (a
plain ``nn.Linear``, a LoRA layer's base layer, or a ``StoredFP8Linear`` of ``model.fp8_storage``: its float8 bytes
and scales are what moves) by a :class:`SwappedLinear` that holds no weight. The weight bytes sit in a
:class:`BlockSwap` outside the module tree, so ``module.to(cuda)`` (Lightning, DDP) moves the biases, norms, LoRA
parameters and the other blocks, and leaves them on the host. LoRA parameters and their optimizer state stay on
the GPU.

Each use fetches the block's weights from the host copy: the forward, the forward that activation checkpointing
repeats in the backward, and the backward itself (the input's gradient needs the weight; :class:`_SwappedLinearFn`,
in a compiled block the operator :func:`swapped_linear`, keeps only a handle between forward and backward, never the
weight). At most ``keep`` (2) swapped blocks are on the device at once: the one computing and the next one, copied
ahead on a side CUDA stream (a block's forward pre-hook starts the copy of the next swapped block in the pass's
direction: forward, or backward while autograd runs), ordered by events: the copy waits for the compute stream's
work so far (the memory it writes may have been a dropped block's), the compute stream waits for the copy before the
block's first use. The swapped blocks are spread evenly over the list, so each copy overlaps the compute of the
resident blocks before it.

On the CPU the same code runs with plain copies (no stream, no pinning): tests compare against no swap bitwise and
count the copies.

Compiled blocks (``model.compile``) swap too: :func:`swapped_linear` and its backward are custom operators, opaque to
torch.compile, that fetch when they run; the compiled graph holds no weight and no Python of the swap, a layer is
named by a host tensor (an input, not a constant), so every block shares one graph and nothing recompiles per block
or per step. The pre-hooks do not run inside a compiled block: there a block's first fetch starts the next copy.
"""
from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from wanexp.models.fp8 import StoredFP8Linear, linear_input_grad


def swapped_indices(num_blocks: int, n: int) -> list[int]:
    """``n`` block positions spread evenly over ``num_blocks`` (the last block included when n > 0)."""
    n = max(0, min(n, num_blocks))
    return sorted({num_blocks - 1 - (k * num_blocks) // n for k in range(n)}) if n else []


def in_backward() -> bool:
    """Whether autograd's engine is running (a checkpointed block's recompute, or a backward formula)."""
    return torch._C._current_graph_task_id() != -1


class BlockSwap:
    """The host copies of the swapped blocks' weights and the device copies now resident (see the module doc)."""

    def __init__(self, keep: int = 2):
        self.host: dict[int, dict[str, dict[str, torch.Tensor]]] = {}  # block -> layer -> tensor name -> host tensor
        self.resident: OrderedDict[int, list] = OrderedDict()  # block -> [layer -> name -> device tensor, event]
        self.keep = keep
        self.copies = 0  # block copies host -> device made so far (tests count them)
        self.host_bytes = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def indices(self) -> list[int]:
        return sorted(self.host)

    def add(self, block: int, layer: str, tensors: dict[str, torch.Tensor]) -> None:
        """Keep ``tensors`` (a layer's stored weight) on the host, pinned when CUDA is there (asynchronous copies)."""
        pin = torch.cuda.is_available()
        host = {k: (v.detach().cpu().pin_memory() if pin else v.detach().cpu().clone()) for k, v in tensors.items()}
        self.host.setdefault(block, {})[layer] = host
        self.host_bytes += sum(v.numel() * v.element_size() for v in host.values())

    # ---- device copies ----------------------------------------------------------------------------------------
    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _load(self, block: int, device: torch.device, protect: tuple[int, ...]) -> None:
        """Start copying ``block`` to ``device``; drop the least recently used blocks beyond ``keep``."""
        side = self._side_stream(device)
        if side is not None:  # the destination is allocated on the compute stream: write it after that stream's work
            side.wait_stream(torch.cuda.current_stream(device))
        copies = {}
        for layer, tensors in self.host[block].items():
            copies[layer] = {}
            for name, h in tensors.items():
                dst = torch.empty_like(h, device=device)
                with torch.cuda.stream(side) if side is not None else nullcontext():
                    dst.copy_(h, non_blocking=side is not None)
                copies[layer][name] = dst
        event = None
        if side is not None:
            event = torch.cuda.Event()
            event.record(side)
        self.copies += 1
        self.resident[block] = [copies, event]
        self._evict(device, protect=(*protect, block))

    def _evict(self, device: torch.device, protect: tuple[int, ...]) -> None:
        for block in list(self.resident):
            if len(self.resident) <= self.keep:
                return
            if block in protect:
                continue
            _, event = self.resident.pop(block)
            if event is not None:  # a copy still in flight writes memory the compute stream may reuse
                torch.cuda.current_stream(device).wait_event(event)

    def prefetch(self, block: int, device: torch.device, protect: tuple[int, ...] = ()) -> None:
        if block in self.host and block not in self.resident:
            self._load(block, device, protect)

    def acquire(self, block: int, device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
        """The block's weights on ``device``, ready for the compute stream; the next swapped block in this pass's
        direction starts copying."""
        if block not in self.resident:
            self._load(block, device, protect=())
        self.resident.move_to_end(block)
        entry = self.resident[block]
        if entry[1] is not None:
            torch.cuda.current_stream(device).wait_event(entry[1])
            entry[1] = None
        nxt = self.next_swapped(block, backward=in_backward(), include=False)
        if nxt is not None:
            self.prefetch(nxt, device, protect=(block,))
        return entry[0]

    def next_swapped(self, position: int, backward: bool, include: bool) -> int | None:
        """The first swapped block from ``position`` in the pass's direction (``include``: position itself counts)."""
        ahead = [i for i in self.indices if (i <= position if backward else i >= position)]
        if not include:
            ahead = [i for i in ahead if i != position]
        if not ahead:
            return None
        return max(ahead) if backward else min(ahead)


class _SwappedLinearFn(torch.autograd.Function):
    """``F.linear`` whose weight is fetched through a :class:`SwappedLinear` in the forward and fetched again in the
    backward; only the handle is kept in between. The eager path: a fraction of the custom operator's host time
    per call (on the CPU ~70 against ~400 us a forward and backward), which a 5B step, close to host-bound, would
    feel."""

    @staticmethod
    def forward(ctx, x, bias, layer):
        out = F.linear(x, layer.fetch(x.device), bias)  # autocast applies as to nn.Linear
        ctx.layer, ctx.x_dtype = layer, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return linear_input_grad(grad_out, ctx.layer.fetch(grad_out.device), ctx.x_dtype), None, None


class SwappedLinear(nn.Module):
    """A frozen linear whose stored weight lives in a :class:`BlockSwap` (host memory) and is fetched at each use.
    Its bias (small) stays a buffer that moves with the module."""

    def __init__(self, layer: nn.Module, swap: BlockSwap, block: int, key: str):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        if isinstance(layer, StoredFP8Linear):
            stored, self._weight_from = layer.stored_tensors(), layer.weight_from
        else:
            stored, self._weight_from = {"weight": layer.weight}, (lambda t: t["weight"])
        swap.add(block, key, stored)
        self._swap, self._block, self._key = swap, block, key  # plain attributes: module.to() leaves them alone
        bias = layer.bias.detach().clone() if layer.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("_where", torch.empty(0, dtype=torch.int8), persistent=False)  # the module's device
        handle = next(_HANDLES)
        _LAYERS[handle] = weakref.ref(self, lambda _: _LAYERS.pop(handle, None))
        self._handle = torch.tensor([handle])  # a host tensor, not a buffer: module.to() leaves it on the host

    def fetch(self, device: torch.device) -> torch.Tensor:
        return self._weight_from(self._swap.acquire(self._block, device)[self._key])

    @property
    def weight(self) -> torch.Tensor:
        """The weight, fetched to this module's device, for code that reads ``.weight``."""
        return self.fetch(self._where.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # an opaque operator in the compiled graph (see swapped_linear)
            return swapped_linear(x, self.bias, self._handle, self.out_features)
        return _SwappedLinearFn.apply(x, self.bias, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block {self._block} swapped"


# ---- the swapped linear as two custom ops ---------------------------------------------------------------------
# The fetch (host copy, stream waits, eviction) runs inside two operators that torch.compile treats as opaque calls:
# a compiled block keeps its weights out of its graph (a graph input would be saved for the backward, keeping every
# swapped block's weights on the device), and dynamo traces no Python of BlockSwap. A layer is named by a small
# host tensor (a graph input, not a constant), so every block shares one compiled graph.
_LAYERS: dict[int, weakref.ref] = {}  # handle -> SwappedLinear
_HANDLES = itertools.count()


def _layer(handle: torch.Tensor) -> SwappedLinear:
    return _LAYERS[int(handle[0])]()


@torch.library.custom_op("wanexp::swapped_linear", mutates_args=())
def swapped_linear(x: torch.Tensor, bias: torch.Tensor | None, handle: torch.Tensor,
                   out_features: int) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with W fetched for this call; under autocast x and bias arrive cast (the autocast
    kernel below), W is cast to their dtype: autocast's ``F.linear``, bit for bit."""
    return F.linear(x, _layer(handle).fetch(x.device).to(x.dtype), bias)


@swapped_linear.register_fake
def _(x, bias, handle, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("wanexp::swapped_linear_input_grad", mutates_args=())
def swapped_linear_input_grad(grad: torch.Tensor, handle: torch.Tensor, in_features: int) -> torch.Tensor:
    """The input's gradient, W fetched again (only the handle is kept between the forward and the backward)."""
    return linear_input_grad(grad, _layer(handle).fetch(grad.device), grad.dtype)


@swapped_linear_input_grad.register_fake
def _(grad, handle, in_features):
    return grad.new_empty(*grad.shape[:-1], in_features)


def _save_handle(ctx, inputs, output):
    x, _, handle, _ = inputs
    ctx.save_for_backward(handle)
    ctx.in_features = x.shape[-1]


def _input_grad(ctx, grad):
    (handle,) = ctx.saved_tensors
    return swapped_linear_input_grad(grad, handle, ctx.in_features), None, None, None


swapped_linear.register_autograd(_input_grad, setup_context=_save_handle)


def _register_autocast(device_type: str) -> None:
    """Autocast of the op as of ``F.linear`` (lower-precision floating inputs), at the autocast dtype of the call
    (torch.library.register_autocast fixes one dtype; bf16-mixed and 16-mixed need both)."""
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def cast(t, dtype):
        eligible = t is not None and t.is_floating_point() and t.device.type == device_type and t.dtype != torch.float64
        return t.to(dtype) if eligible else t

    def kernel(_, x, bias, handle, out_features):
        dtype = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return swapped_linear(cast(x, dtype), cast(bias, dtype), handle, out_features)

    _AUTOCAST.impl("swapped_linear", kernel, key, with_keyset=True)


_AUTOCAST = torch.library.Library("wanexp", "FRAGMENT")
for _device_type in ("cpu", "cuda"):
    _register_autocast(_device_type)


def _frozen_linear(module: nn.Module) -> bool:
    if isinstance(module, StoredFP8Linear):
        return True
    return type(module) is nn.Linear and not module.weight.requires_grad


def enable(blocks: nn.ModuleList, n: int, keep: int = 2) -> BlockSwap:
    """Swap ``n`` of ``blocks`` (spread evenly): their frozen linears become :class:`SwappedLinear` whose weights are
    held by the returned :class:`BlockSwap`; trainable parameters (LoRA) are untouched. Call before the module moves
    to the GPU (the weights go to the host from where they are)."""
    swap = BlockSwap(keep=keep)
    for i in swapped_indices(len(blocks), n):
        block = blocks[i]
        for parent_name, parent in list(block.named_modules()):
            for name, child in list(parent.named_children()):
                if _frozen_linear(child):
                    key = f"{parent_name}.{name}" if parent_name else name
                    setattr(parent, name, SwappedLinear(child, swap, i, key))
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(_prefetch_hook(swap, i))
    return swap


def _prefetch_hook(swap: BlockSwap, position: int):
    """Before block ``position`` runs: start copying the next swapped block of this pass (itself if swapped)."""
    def hook(module, args):
        if torch.compiler.is_compiling():  # a compiled block: its first fetch prefetches (BlockSwap.acquire)
            return
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is None:
            return
        nxt = swap.next_swapped(position, backward=in_backward(), include=True)
        if nxt is not None:
            swap.prefetch(nxt, device, protect=tuple(swap.resident)[-1:])
    return hook


# ---- wiring -------------------------------------------------------------------------------------
def swap_count(spec, expert: str, layers: int) -> int:
    """``model.blocks_to_swap`` for the ``expert`` transformer of ``layers`` blocks; one line for more blocks than it
    has, or for ``auto`` not sized (the pre-flight, wanexp.composition, checks it on the meta-built model before the
    run folder is touched)."""
    from wanexp.errors import ConfigError

    n = getattr(spec, "blocks_to_swap", 0) or 0
    if n == "auto":  # a command that builds the model without the pre-flight's resolve_blocks_to_swap
        raise ConfigError("model.blocks_to_swap=auto: this command does not size block swap; set "
                          "model.blocks_to_swap=N (wanexp-train prints the N auto picks on its start line)")
    if n > layers:
        raise ConfigError(f"model.blocks_to_swap={n}: the {expert} transformer has {layers} blocks; set "
                          f"model.blocks_to_swap to at most {layers}")
    return n


def low_vram(transformer: nn.Module, spec, expert: str, verbose: bool = True) -> BlockSwap | None:
    """``model.fp8_storage`` then ``model.blocks_to_swap`` on a loaded transformer (adapters added, on the host)."""
    from wanexp.models import fp8

    blocks = spec.blocks(transformer)
    if getattr(spec, "fp8_storage", False):
        n = fp8.store_blocks(blocks)
        if verbose:
            print(f"wanexp: model.fp8_storage: {n} frozen linears of the {expert} transformer stored in FP8",
                  flush=True)
    layers = len(blocks)
    n = swap_count(spec, expert, layers)
    if not n:
        return None
    swap = enable(blocks, n)
    transformer._wanexp_blockswap = swap
    if verbose:
        pinned = "pinned host memory" if torch.cuda.is_available() else "host memory"
        print(f"wanexp: model.blocks_to_swap={n}: the frozen weights of {n} of {layers} blocks of the {expert} "
              f"transformer in {pinned} ({swap.host_bytes / 2**30:.1f} GiB), at most {swap.keep} on the GPU at once",
              flush=True)
    return swap
