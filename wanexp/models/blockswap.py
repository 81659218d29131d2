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


# ---- wiring and the fit check -------------------------------------------------------------------------------------
def swap_count(spec, expert: str, layers: int) -> int:
    """``model.blocks_to_swap`` for the ``expert`` transformer of ``layers`` blocks; one line for more blocks than it
    has, or for ``auto`` not sized (wanexp.train checks it on the meta-built model before the run folder is touched)."""
    from wanexp.errors import ConfigError

    n = getattr(spec, "blocks_to_swap", 0) or 0
    if n == "auto":  # a command that builds the model without wanexp.train.run's resolve_blocks_to_swap
        raise ConfigError("model.blocks_to_swap=auto: this command does not size block swap; set "
                          "model.blocks_to_swap=N (wanexp-train prints the N auto picks on its start line)")
    if n > layers:
        raise ConfigError(f"model.blocks_to_swap={n}: the {expert} transformer has {layers} blocks; set "
                          f"model.blocks_to_swap to at most {layers}")
    return n


def low_vram(transformer: nn.Module, spec, expert: str, verbose: bool = True) -> BlockSwap | None:
    """``model.fp8_storage`` then ``model.blocks_to_swap`` on a loaded transformer (adapters added, on the host)."""
    from wanexp.models import fp8

    if getattr(spec, "fp8_storage", False):
        n = fp8.store_blocks(transformer)
        if verbose:
            print(f"wanexp: model.fp8_storage: {n} frozen linears of the {expert} transformer stored in FP8",
                  flush=True)
    layers = len(transformer.blocks)
    n = swap_count(spec, expert, layers)
    if not n:
        return None
    swap = enable(transformer.blocks, n)
    transformer._wanexp_blockswap = swap
    if verbose:
        pinned = "pinned host memory" if torch.cuda.is_available() else "host memory"
        print(f"wanexp: model.blocks_to_swap={n}: the frozen weights of {n} of {layers} blocks of the {expert} "
              f"transformer in {pinned} ({swap.host_bytes / 2**30:.1f} GiB), at most {swap.keep} on the GPU at once",
              flush=True)
    return swap


def _tokens(data, spec, sp_size: int) -> int:
    """The most DiT tokens one device's batch holds under the data settings (a sequence-parallel rank: its share)."""
    shapes = [list(b) for b in data.buckets] if data.get("buckets") else [[data.height, data.width]]
    ft, fh, fw = spec.vae_stride
    pt, ph, pw = spec.patch
    frames = ((int(data.num_frames) - 1) // ft + 1) // pt
    per_sample = max(frames * (int(h) // (fh * ph)) * (int(w) // (fw * pw)) for h, w in shapes)
    tokens = int(data.token_budget) if data.get("token_budget") else per_sample * int(data.batch_size)
    return max(tokens, per_sample) // max(1, sp_size)


def base_gib(config: dict, weight_bytes: float, other_bytes: float, resident_blocks: int) -> float:
    """GiB of a WanTransformer3DModel's weights on the device: ``resident_blocks`` blocks' linears at
    ``weight_bytes`` per element, the embeddings and output projection at ``other_bytes``."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    per_block = 8 * d * d + 2 * d * config["ffn_dim"]  # self- and cross-attention q,k,v,o; the FFN's two linears
    patch = 1
    for p in config["patch_size"]:
        patch *= p
    other = (config["text_dim"] * d + d * d + config["freq_dim"] * d + d * d + 6 * d * d
             + (config["in_channels"] + config["out_channels"]) * patch * d)
    return (resident_blocks * per_block * weight_bytes + other * other_bytes) / 2**30


# The working memory of one checkpointed block's recompute and backward, in bf16 elements per token per unit of the
# model width and of the FFN width, and the eager blocks' factor over compiled ones. Fitted to peaks measured on one
# H100 (2026-11-27, LoRA r32, bf16-mixed, every block checkpointed), less the weights, the kept block inputs and the
# LoRA state: TI2V-5B at 27,280 tokens compiled (21.4 GiB), the A14B expert at 32,760 tokens compiled (53.2 GiB; with
# FP8 storage and offloaded inputs 26.9 GiB) and eager with every block swapped and offloaded inputs (18.2 GiB;
# benchmarks/a14b_h100_2026-11-27.md).
RECOMPUTE_PER_DIM, RECOMPUTE_PER_FFN, RECOMPUTE_EAGER = 35.0, 1.02, 1.2
TRAINABLE_BYTES = 16  # an fp32 adapter parameter, its gradient and AdamW's two moments


def recompute_gib(config: dict, tokens: int, compiled: bool) -> float:
    """GiB one checkpointed block needs while it recomputes and runs its backward (see the constants above)."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    per_token = RECOMPUTE_PER_DIM * d + RECOMPUTE_PER_FFN * config["ffn_dim"]
    return tokens * per_token * 2 / 2**30 * (1.0 if compiled else RECOMPUTE_EAGER)


def trainable_gib(cfg, spec) -> float:
    """GiB of the adapter's parameters, gradients and optimizer moments on one device (counted on the meta device
    from the transformers' config.json, as the disk estimate counts them)."""
    from wanexp.adapters.sizing import adapter_size

    if cfg.get("adapter") is None:
        return 0.0
    with torch.device("meta"):
        transformers = [spec.transformer_type().from_config(spec.transformer_config(e))
                        for e in spec.trained_experts(cfg.boundary.name)]
    return sum(adapter_size(t, cfg.adapter).parameters for t in transformers) * TRAINABLE_BYTES / 2**30


class FitEstimate:
    """A run's least memory on one device in GiB, from the transformers' config.json (nothing loads): the weights
    with ``n`` blocks swapped (2 of them on the device at once) plus the least activation memory (with activation
    checkpointing: every block checkpointed)."""

    def __init__(self, cfg, spec):
        from types import SimpleNamespace

        from wanexp.models.wan22.fast import block_activation_gib, compile_supported

        m = cfg.model
        self.sp = int(cfg.parallel.get("sp_size", 1) or 1)
        shards = 1
        if cfg.parallel.name in ("fsdp", "deepspeed") and isinstance(cfg.trainer.devices, int):
            shards = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
        self.shards, self.tokens = shards, _tokens(cfg.data, spec, self.sp)
        self.checkpointing = bool(m.get("gradient_checkpointing"))
        self.offloading = self.checkpointing and bool(m.get("offload_activations"))
        self._dtype_bytes = spec.dtype.itemsize
        self._weight_bytes = 1 if (m.get("fp8") or m.get("fp8_storage")) else self._dtype_bytes
        self._configs = [spec.transformer_config(e) for e in spec.trained_experts(cfg.boundary.name)]
        self.layers = max(int(c["num_layers"]) for c in self._configs)
        compiled = bool(m.get("compile")) and compile_supported()[0]
        self.trainable = trainable_gib(cfg, spec)
        self.activations = 0.0
        for c in self._configs:
            if self.checkpointing:  # every block keeps its bf16 input; one block's backward recomputes it (fast.py)
                d = c["num_attention_heads"] * c["attention_head_dim"]
                kept = 1 if self.offloading else c["num_layers"]  # offloaded: one input on its way to the host
                act = kept * self.tokens * d * 2 / 2**30 + recompute_gib(c, self.tokens, compiled)
            else:  # every block keeps its activations for the backward
                act = c["num_layers"] * block_activation_gib(SimpleNamespace(**c), self.tokens)
            self.activations = max(self.activations, act + self.trainable)

    def weights(self, n: int) -> float:
        """GiB of weights per device with n blocks swapped (at most 2 of them on the device at once)."""
        return sum(base_gib(c, self._weight_bytes, self._dtype_bytes,
                            c["num_layers"] - min(n, c["num_layers"]) + min(2, n)) for c in self._configs) / self.shards

    def need(self, n: int) -> float:
        return self.weights(n) + self.activations

    def fewest(self, budget: float, start: int = 0) -> int | None:
        """The smallest block count from ``start`` whose need fits ``budget``; None when even every block does not."""
        return next((n for n in range(start, self.layers + 1) if self.need(n) <= budget), None)

    def refusal(self, source: str, n: int, budget: float):
        """The one-line ConfigError of a run that needs more than ``budget`` with ``n`` blocks swapped."""
        from wanexp.errors import ConfigError

        fits = self.fewest(budget, start=n + 1)
        options = [f"model.blocks_to_swap={fits} (frozen weights in host memory)"] if fits is not None else []
        if not self.checkpointing:
            options.append("model.gradient_checkpointing=true")
        elif not self.offloading:
            options.append("model.offload_activations=true (the checkpointed blocks' inputs in host memory)")
        options += [f"parallel.sp_size={2 * self.sp} (sequence parallel: each GPU holds a share of the tokens)",
                    "parallel=fsdp on several GPUs (shards the weights)", "fewer frames or a smaller size"]
        base, ckpt = self.weights(n), "every block" if self.checkpointing else "no block"
        return ConfigError(f"{source}: this run needs at least {self.need(n):.1f} GiB per GPU ({base:.1f} GiB of "
                           f"weights, {self.activations:.1f} GiB of activations at {self.tokens} tokens with {ckpt} "
                           f"checkpointed); set " + ", or ".join(options))


AUTO_HEADROOM = 0.9  # of a GPU's free memory, the share auto plans for (fast.blocks_to_checkpoint keeps 10 % free too)


def usable_gib(cfg) -> float | None:
    """GiB this rank's GPU has free for the run (within the process's memory fraction), or None on the CPU."""
    import os

    from omegaconf import OmegaConf

    if str(cfg.trainer.accelerator) == "cpu" or not torch.cuda.is_available():
        return None
    local = int(os.environ.get("LOCAL_RANK", 0))  # Lightning's and torchrun's ranks on this node
    devices = cfg.trainer.devices
    index = int(devices[local]) if OmegaConf.is_list(devices) else local % torch.cuda.device_count()
    free, total = torch.cuda.mem_get_info(index)
    capped = total * torch.cuda.get_per_process_memory_fraction(index) - torch.cuda.memory_reserved(index)
    return min(free, capped) / 2**30


def resolve_blocks_to_swap(cfg, spec, verbose: bool = True) -> int:
    """``model.blocks_to_swap=auto``: the fewest blocks whose weights and least activations (:class:`FitEstimate`)
    fit ``model.memory_budget_gib``, or 90 % of this GPU's free memory without one (0 on the CPU). Sets the count in
    the config (``cfg.model.blocks_to_swap``: what config.yaml and wanexp-plan read) and on the spec, says why on
    the start line, and refuses in one line when even every block does not fit. A count is returned as it is."""
    from omegaconf import open_dict

    m = cfg.model
    if m.get("blocks_to_swap") != "auto":
        return int(m.get("blocks_to_swap") or 0)
    est, budget = FitEstimate(cfg, spec), m.get("memory_budget_gib")
    if budget is not None:
        source, where = f"model.memory_budget_gib={budget:g}", f"model.memory_budget_gib={budget:g}"
    else:
        usable = usable_gib(cfg)
        budget = None if usable is None else usable * AUTO_HEADROOM
        source = f"model.blocks_to_swap=auto on a GPU with {usable or 0:.1f} GiB free"
        where = f"{AUTO_HEADROOM:.0%} of this GPU's {usable or 0:.1f} GiB free ({budget or 0:.1f} GiB)"
    if budget is None:
        n, why = 0, "no model.memory_budget_gib to size it from, and no GPU"
    else:
        n = est.fewest(budget)
        if n is None:
            raise est.refusal(source, est.layers, budget)
        why = (f"the fewest whose weights and least activations fit {where}: {est.need(n):.1f} GiB estimated, "
               f"{est.weights(n):.1f} of weights and {est.activations:.1f} of activations at {est.tokens} tokens")
        if n:
            why += f"; {n - 1} would need {est.need(n - 1):.1f}"
    with open_dict(m):
        m.blocks_to_swap = n
    spec.blocks_to_swap = n
    if verbose:
        print(f"wanexp: model.blocks_to_swap=auto: {n} of {est.layers} blocks swapped ({why})", flush=True)
    return n


def check_fit(cfg, spec) -> None:
    """With ``model.memory_budget_gib`` set, refuse a run whose weights on one device plus the least activation
    memory it can have (:class:`FitEstimate`) exceed the budget, naming what would make room (the block count that
    fits, when one does). ``blocks_to_swap=auto`` is resolved first. Reads the transformers' config.json only;
    nothing loads."""
    n = resolve_blocks_to_swap(cfg, spec, verbose=False)
    budget = cfg.model.get("memory_budget_gib")
    if budget is None:
        return
    est = FitEstimate(cfg, spec)
    if est.need(n) > budget:
        raise est.refusal(f"model.memory_budget_gib={budget:g}", n, budget)
