"""An exponential moving average (EMA) of the trained adapter: ``callbacks.ema.decay=0.999``.

The shadow is an fp32 copy of exactly the trainable parameters (every adapter the objective trains), updated after
each optimizer step (a hook on the optimizers: an accumulated step counts once, a step the fp16 grad scaler skips not
at all), every ``every_n_steps`` of them::

    shadow <- shadow + (1 - d) (weights - shadow),   d = min(decay, (1 + n) / (10 + n)) at the n-th update (warmup)

It is kept where the weights are: on every rank under DDP (each replica steps the same weights, so each holds the same
shadow), as shards of the same layout under FSDP2 (the update is elementwise; a checkpoint gathers the full tensors,
a resume takes each rank's shard back). The checkpoint holds the shadow, so a resumed run continues it exactly; the
LoRA export (wanexp.callbacks.lora_export) writes it beside the raw files, under names with ``ema`` in them, and
validation samples and scores the weights ``validate_with`` names (the EMA's swapped in and the raw ones put back
exactly afterwards).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from lightning.pytorch.callbacks import Callback

from wanexp.errors import ConfigError

VALIDATE_WITH = ("raw", "ema", "both")  # config.schema.EMA_VALIDATE (callbacks may not import config)
TAG = "ema"  # in the names of the EMA's files, videos and metrics


class AdapterEMA(Callback):
    def __init__(self, decay: float | None, every_n_steps: int = 1, warmup: bool = True, validate_with: str = "ema"):
        """The arguments are ``callbacks.ema`` (config.schema.EMAConfig); ``decay=None``: no EMA (the callback does
        nothing)."""
        if decay is not None and not 0.0 <= float(decay) < 1.0:
            raise ConfigError(f"callbacks.ema.decay={decay}: must be >= 0 and < 1 (e.g. 0.999), or null for no EMA")
        if validate_with not in VALIDATE_WITH:
            raise ConfigError(f"callbacks.ema.validate_with={validate_with}: allowed values are "
                              f"{', '.join(VALIDATE_WITH)}")
        self.decay = None if decay is None else float(decay)
        self.every = int(every_n_steps)
        self.warmup = bool(warmup)
        self.validate_with = validate_with
        self.steps = 0  # optimizer steps seen (the checkpoint keeps it: every_n_steps continues across a resume)
        self.updates = 0  # EMA updates made
        self.names: list[str] = []
        self._params: list[torch.nn.Parameter] = []
        self._shadow: list[torch.Tensor] = []
        self._loaded: dict | None = None  # a resumed checkpoint's state, applied once the parameters exist
        self._hooks: list = []

    @property
    def enabled(self) -> bool:
        return self.decay is not None

    def current_decay(self) -> float:
        """The decay of the next update (``warmup``: at most (1 + n) / (10 + n) at the n-th, counted from 0)."""
        n = self.updates
        return min(self.decay, (1 + n) / (10 + n)) if self.warmup else self.decay

    # ---- the shadow ----------------------------------------------------------------------------------------------
    def shadow(self, pl_module) -> dict[str, torch.Tensor]:
        """Parameter name -> its shadow (this rank's shard under FSDP2), built on first use."""
        self._ensure(pl_module)
        return dict(zip(self.names, self._shadow))

    def _ensure(self, pl_module) -> None:
        if self._shadow or not self.enabled:
            return
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self._params = [p for _, p in named]
        with torch.no_grad():
            self._shadow = [p.detach().float().clone() for p in self._params]
        loaded, self._loaded = self._loaded, None
        if loaded and loaded.get("shadow"):
            self._restore(loaded)

    def _restore(self, state: dict) -> None:
        saved = state["shadow"]
        missing = [n for n in self.names if n not in saved]
        if missing:  # the module's own resume check refuses other adapter layouts before this
            raise ConfigError(f"resume: the checkpoint's EMA lacks {len(missing)} adapter weights of this run (e.g. "
                              f"{missing[0]}); resume with the settings it was written with")
        with torch.no_grad():
            for name, s in zip(self.names, self._shadow):
                s.copy_(_shard_like(saved[name], s))
        self.steps, self.updates = int(state.get("steps", 0)), int(state.get("updates", 0))
        if float(state.get("decay", self.decay)) != self.decay:
            print(f"wanexp: resume: callbacks.ema.decay={self.decay} (the checkpoint's EMA was made with "
                  f"{state['decay']}); the shadow continues with the new decay", flush=True)

    def update(self) -> None:
        """One optimizer step done: every ``every_n_steps``-th moves the shadow toward the weights."""
        self.steps += 1
        if self.steps % self.every:
            return
        weight = 1.0 - self.current_decay()
        self.updates += 1
        with torch.no_grad():
            torch._foreach_lerp_(self._shadow, [p.detach().float() for p in self._params], weight)

    # ---- Lightning -------------------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        if not self.enabled:
            return
        self._ensure(pl_module)
        for opt in trainer.optimizers:
            self._hooks.append(opt.register_step_post_hook(lambda *_: self.update()))
        if trainer.global_rank == 0:
            how = f"decay {self.decay:g}" + (", warm-up" if self.warmup else "") + \
                (f", every {self.every} steps" if self.every > 1 else "")
            print(f"wanexp: EMA of the trained adapter ({how}; {len(self.names)} tensors in fp32): exported as *_ema_* "
                  f"files beside the raw ones; validation uses the {self._validated()} weights", flush=True)

    def teardown(self, trainer, pl_module, stage) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def state_dict(self) -> dict:
        """The checkpoint's EMA: full fp32 tensors on the CPU (a collective under FSDP2: every rank saves)."""
        if not self.enabled or not self._shadow:
            return {}
        with torch.no_grad():
            shadow = {n: _full(s).to("cpu", copy=True) for n, s in zip(self.names, self._shadow)}
        return {"decay": self.decay, "every_n_steps": self.every, "warmup": self.warmup, "steps": self.steps,
                "updates": self.updates, "shadow": shadow}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.enabled:
            self._loaded = dict(state_dict)

    def exported(self, checkpoint: dict) -> dict[str, torch.Tensor] | None:
        """The EMA weights a checkpoint holds (parameter name -> full tensor), for the export; None without EMA."""
        if not self.enabled:
            return None
        return (checkpoint.get("callbacks", {}).get(self.state_key) or {}).get("shadow") or None

    # ---- validation --------------------------------------------------------------------------------------------
    def _validated(self) -> str:
        return {"raw": "raw", "ema": "EMA", "both": "raw and the EMA"}[self.validate_with]

    def validation_weights(self, pl_module) -> list[tuple[str, object]]:
        """(tag, context) per weight set validation samples: "" for the raw weights, ``ema`` for the EMA's (swapped
        in while the context is open)."""
        if not self.enabled or self.validate_with == "raw":
            return [("", nullcontext())]
        ema = (TAG, self.swapped_in(pl_module))
        return [ema] if self.validate_with == "ema" else [("", nullcontext()), ema]

    @contextmanager
    def swapped_in(self, pl_module):
        """The EMA weights in the trained parameters while open; the raw weights put back bit for bit after."""
        self._ensure(pl_module)
        with torch.no_grad():
            raw = [p.detach().clone() for p in self._params]
            for p, s in zip(self._params, self._shadow):
                p.copy_(s.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, r in zip(self._params, raw):
                    p.copy_(r)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A full tensor: a sharded (FSDP2 DTensor) one gathered (a collective), any other as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (a checkpoint's whole tensor) laid out as ``like``: on its device in its dtype, and as this rank's
    shard when ``like`` is sharded (every rank holds the whole tensor, so no rank sends anything)."""
    full = full.to(like.device, like.dtype)
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
