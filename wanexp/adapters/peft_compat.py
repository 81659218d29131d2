"""Every access to peft's private parts, in one place: adapter code elsewhere calls these. Written against peft
0.21 (requirements.lock; the GPU image's wheel is the same): a newer peft that renames one of these attributes breaks
this module's tests (tests/unit/test_adapter_types.py, test_lora_names.py), not a training run halfway.

- a tuner layer's active adapters and its off switch (``_active_adapter``, ``_disable_adapters``): set without
  ``set_adapter``/``disable_adapters``, which would also change ``requires_grad``;
- an adapter's parameter in a layer (``layer.lora_A[name].weight``, ``layer.lokr_w1[name]``, ...);
- LoKr's factorization of a linear's sides (``peft.tuners.lokr.layer.factorization``), which sizes its factors.
"""
from __future__ import annotations

import torch


def tuner_layers(modules) -> list:
    """The peft tuner layers (one per adapted linear) inside ``modules``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for t in modules for m in t.modules() if isinstance(m, BaseTunerLayer)]


def adapter_switch(layer) -> tuple:
    """(active adapter names, off) of a tuner layer."""
    return layer._active_adapter, layer._disable_adapters


def set_adapter_switch(layer, active, off: bool) -> None:
    """Set a tuner layer's active adapters and off switch, leaving ``requires_grad`` alone."""
    if active is not None:
        layer._active_adapter = active
    layer._disable_adapters = off


def adapter_in_use(layer) -> bool:
    """Whether an adapter of any kind is on in this tuner layer now (one of its active adapters holds parameters of
    the layer's kind: lora_A, lokr_w1, hada_w1_a ...)."""
    return not layer.disable_adapters and any(
        any(name in getattr(layer, attr, {}) for attr in layer.adapter_layer_names) for name in layer.active_adapters)


def adapter_param(layer, name: str, adapter_name: str):
    """Adapter ``adapter_name``'s parameter ``name`` (lora_A, lokr_w1, ...) of a tuner layer, or None."""
    holder = getattr(layer, name, None)
    if holder is None or adapter_name not in holder:
        return None
    value = holder[adapter_name]
    return value.weight if isinstance(value, torch.nn.Module) else value


def lokr_factorization(dimension: int) -> tuple[int, int]:
    """peft's split of a linear's side into LoKr's two factor sizes (its default factor)."""
    from peft.tuners.lokr.layer import factorization

    return factorization(dimension, -1)
