"""The memory plan of a run: how many GiB one device needs (weights with N blocks swapped, the least activations, the
adapter's training state), the block count ``model.blocks_to_swap=auto`` picks from a budget, and the refusal of a
run that cannot fit ``model.memory_budget_gib``. Reads the transformers' config.json through the family's memory
formula (``spec.memory_formula()``; None: the family gives no estimate and nothing is planned); nothing loads.
The block-swap mechanism that applies the N is wanexp/models/blockswap.py."""
from __future__ import annotations

import os

import torch
from omegaconf import OmegaConf, open_dict

from wanexp.errors import ConfigError

TRAINABLE_BYTES = 16  # an fp32 adapter parameter, its gradient and AdamW's two moments
AUTO_HEADROOM = 0.9  # of a GPU's free memory, the share auto plans for (fast.blocks_to_checkpoint keeps 10 % free too)


def _tokens(data, spec, sp_size: int) -> int:
    """The most DiT tokens one device's batch holds under the data settings (a sequence-parallel rank: its share),
    the family's extra latent frames (ModelSpec.extra_latent_frames) counted."""
    shapes = [list(b) for b in data.buckets] if data.get("buckets") else [[data.height, data.width]]
    ft, fh, fw = spec.vae_stride
    pt, ph, pw = spec.patch
    frames = ((int(data.num_frames) - 1) // ft + 1 + spec.extra_latent_frames) // pt
    per_sample = max(frames * (int(h) // (fh * ph)) * (int(w) // (fw * pw)) for h, w in shapes)
    tokens = int(data.token_budget) if data.get("token_budget") else per_sample * int(data.batch_size)
    return max(tokens, per_sample) // max(1, sp_size)


def trainable_gib(adapter, transformers: dict) -> float:
    """GiB of the adapter's parameters, gradients and optimizer moments on one device, counted on the meta-built
    ``transformers`` (ModelSpec.meta_transformers, before the adapters are added), as the disk estimate
    counts them. ``adapter``: the adapter group (None: no adapter)."""
    from wanexp.adapters.sizing import adapter_size

    if adapter is None:
        return 0.0
    return sum(adapter_size(t, adapter).parameters for t in transformers.values()) * TRAINABLE_BYTES / 2**30


class FitEstimate:
    """A run's least memory on one device in GiB, from the transformers' config.json (nothing loads): the weights
    with ``n`` blocks swapped (2 of them on the device at once) plus the least activation memory (with activation
    checkpointing: every block checkpointed). ``transformers``: the pre-flight's meta-built ones (None: built here)."""

    def __init__(self, cfg, spec, transformers: dict | None = None):
        formula = spec.memory_formula()
        if formula is None:
            raise ConfigError(f"model={spec.name}: the family gives no memory estimate")
        if transformers is None:
            transformers = spec.meta_transformers(cfg.boundary.name)
        m = cfg.model
        self.formula = formula
        self.sp = int(cfg.parallel.get("sp_size", 1) or 1)
        shards = 1
        if cfg.parallel.name in ("fsdp", "deepspeed") and isinstance(cfg.trainer.devices, int):
            shards = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
        self.shards, self.tokens = shards, _tokens(cfg.data, spec, self.sp)
        self.checkpointing = bool(m.get("gradient_checkpointing"))
        # what the refusal may suggest: offloaded activations (wanexp's forward), sequence parallel
        self.own_forward, self.sequence_parallel = spec.wanexp_forward(True), spec.sequence_parallel
        self.offloading = self.checkpointing and bool(m.get("offload_activations"))
        # selective checkpointing: a formula's keyword, passed only when on (a family without it refuses it)
        selective = {"selective": True} if self.checkpointing and m.get("selective_checkpointing") else {}
        self._dtype_bytes = spec.dtype.itemsize
        self._weight_bytes = 1 if (m.get("fp8") or m.get("fp8_storage")) else self._dtype_bytes
        self._configs = [spec.transformer_config(e) for e in spec.trained_experts(cfg.boundary.name)]
        self.layers = max(formula.block_count(c) for c in self._configs)
        compiled = formula.compiled(bool(m.get("compile")))
        self.trainable = trainable_gib(cfg.get("adapter"), transformers)
        self.activations = max(formula.activations_gib(c, self.tokens, self.checkpointing, self.offloading, compiled,
                                                       **selective)
                               for c in self._configs) + self.trainable

    def weights(self, n: int) -> float:
        """GiB of weights per device with n blocks swapped (at most 2 of them on the device at once)."""
        f = self.formula
        return sum(f.weights_gib(c, self._weight_bytes, self._dtype_bytes,
                                 f.block_count(c) - min(n, f.block_count(c)) + min(2, n))
                   for c in self._configs) / self.shards

    def need(self, n: int) -> float:
        return self.weights(n) + self.activations

    def summary(self, n: int) -> dict:
        """The estimate with ``n`` blocks swapped, as plain numbers (GiB per device)."""
        return {"need_gib": self.need(n), "weights_gib": self.weights(n), "activations_gib": self.activations,
                "tokens": self.tokens, "blocks_to_swap": n, "blocks": self.layers}

    def fewest(self, budget: float, start: int = 0) -> int | None:
        """The smallest block count from ``start`` whose need fits ``budget``; None when even every block does not."""
        return next((n for n in range(start, self.layers + 1) if self.need(n) <= budget), None)

    def refusal(self, source: str, n: int, budget: float) -> ConfigError:
        """The one-line ConfigError of a run that needs more than ``budget`` with ``n`` blocks swapped."""
        fits = self.fewest(budget, start=n + 1)
        options = [f"model.blocks_to_swap={fits} (frozen weights in host memory)"] if fits is not None else []
        if not self.checkpointing:
            options.append("model.gradient_checkpointing=true")
        elif not self.offloading and self.own_forward:
            options.append("model.offload_activations=true (the checkpointed blocks' inputs in host memory)")
        if self.sequence_parallel:
            options.append(f"parallel.sp_size={2 * self.sp} (sequence parallel: each GPU holds a share of the tokens)")
        options += ["parallel=fsdp on several GPUs (shards the weights)", "fewer frames or a smaller size"]
        base, ckpt = self.weights(n), "every block" if self.checkpointing else "no block"
        return ConfigError(f"{source}: this run needs at least {self.need(n):.1f} GiB per GPU ({base:.1f} GiB of "
                           f"weights, {self.activations:.1f} GiB of activations at {self.tokens} tokens with {ckpt} "
                           f"checkpointed); set " + ", or ".join(options))


def usable_gib(cfg) -> float | None:
    """GiB this rank's GPU has free for the run (within the process's memory fraction), or None on the CPU."""
    if str(cfg.trainer.accelerator) == "cpu" or not torch.cuda.is_available():
        return None
    local = int(os.environ.get("LOCAL_RANK", 0))  # Lightning's and torchrun's ranks on this node
    devices = cfg.trainer.devices
    index = int(devices[local]) if OmegaConf.is_list(devices) else local % torch.cuda.device_count()
    free, total = torch.cuda.mem_get_info(index)
    capped = total * torch.cuda.get_per_process_memory_fraction(index) - torch.cuda.memory_reserved(index)
    return min(free, capped) / 2**30


def _set_blocks_to_swap(cfg, spec, n: int) -> int:
    """The chosen count, in the config (what config.yaml and wanexp-plan read) and on the spec (what the build
    applies)."""
    with open_dict(cfg.model):
        cfg.model.blocks_to_swap = n
    spec.blocks_to_swap = n
    return n


def resolve_blocks_to_swap(cfg, spec, verbose: bool = True, transformers: dict | None = None,
                           est: "FitEstimate | None" = None) -> int:
    """``model.blocks_to_swap=auto``: the fewest blocks whose weights and least activations (:class:`FitEstimate`)
    fit ``model.memory_budget_gib``, or 90 % of this GPU's free memory without one (0 on the CPU, or for a family
    that gives no memory estimate). Sets the count in the config and on the spec, says why on the start line, and
    refuses in one line when even every block does not fit. A count is returned as it is. ``est``: the run's
    estimate when the caller has it (it does not depend on the block count)."""
    m = cfg.model
    if m.get("blocks_to_swap") != "auto":
        return int(m.get("blocks_to_swap") or 0)
    if spec.memory_formula() is None:
        if verbose:
            print(f"wanexp: model.blocks_to_swap=auto: 0 blocks swapped (model={spec.name}'s family gives no memory "
                  "estimate)", flush=True)
        return _set_blocks_to_swap(cfg, spec, 0)
    est, budget = est or FitEstimate(cfg, spec, transformers), m.get("memory_budget_gib")
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
    _set_blocks_to_swap(cfg, spec, n)
    if verbose:
        print(f"wanexp: model.blocks_to_swap=auto: {n} of {est.layers} blocks swapped ({why})", flush=True)
    return n


def check_fit(cfg, spec, transformers: dict | None = None, verbose: bool = False) -> dict | None:
    """With ``model.memory_budget_gib`` set, refuse a run whose weights on one device plus the least activation
    memory it can have (:class:`FitEstimate`) exceed the budget, naming what would make room (the block count that
    fits, when one does). ``blocks_to_swap=auto`` is resolved first. Returns the estimate at the run's block count
    (:meth:`FitEstimate.summary`: what wanexp-plan reports), or None for a family without a memory formula, which is
    not checked. Reads the transformers' config.json only; nothing loads. ``verbose``: auto's line is printed."""
    if spec.memory_formula() is None:
        resolve_blocks_to_swap(cfg, spec, verbose=verbose, transformers=transformers)
        return None
    est = FitEstimate(cfg, spec, transformers)  # one estimate for auto's choice and the check
    n = resolve_blocks_to_swap(cfg, spec, verbose=verbose, transformers=transformers, est=est)
    budget = cfg.model.get("memory_budget_gib")
    if budget is not None and est.need(n) > budget:
        raise est.refusal(f"model.memory_budget_gib={budget:g}", n, budget)
    return est.summary(n)
