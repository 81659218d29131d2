"""An adapter's size per kind, from the shapes peft gives each adapted linear: the disk estimate of a run's
checkpoints and exports, and the trainable memory of the fit estimate (no weight is loaded: the transformer may be on
the meta device)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from wanexp.adapters import peft_compat


@dataclass
class AdapterSize:
    """One adapter on one transformer: its parameters, tensors, adapted linears and the alphas its ComfyUI file
    holds (one per linear, but none for a LoKr of two full factors, whose scale is folded into a factor)."""

    parameters: int = 0
    tensors: int = 0
    modules: int = 0
    alphas: int = 0


def adapter_tensor_shapes(kind: str, rank: int, use_dora: bool, in_features: int, out_features: int) -> list[tuple]:
    """The tensors peft gives one adapted linear (its layers' ``update_layer``, default configs as wanexp.adapters sets
    them): LoRA A (rank, in) and B (out, rank), DoRA also a magnitude (out,); LoHa two such pairs; LoKr a full factor
    of the smaller halves of peft's factorizations of out and in, and a second one of the larger halves, split at
    the rank unless the rank reaches half its larger side."""
    if kind == "loha":
        return [(out_features, rank), (rank, in_features)] * 2
    if kind == "lokr":
        in_m, in_n = peft_compat.lokr_factorization(in_features)
        out_l, out_k = peft_compat.lokr_factorization(out_features)
        second = [(out_k, in_n)] if rank >= max(out_k, in_n) / 2 else [(out_k, rank), (rank, in_n)]
        return [(out_l, in_m), *second]
    return [(rank, in_features), (out_features, rank)] + ([(out_features,)] if use_dora else [])


def adapter_size(transformer, adapter) -> AdapterSize:
    """The adapter on ``transformer``: the tensors of each targeted linear (peft's matching), by kind. ``adapter``:
    the built adapter, or the ``adapter`` group's config (its ``family`` names the module naming)."""
    from torch import nn

    from wanexp.adapters.kinds import naming_of

    naming = getattr(adapter, "naming", None) or naming_of(adapter.family)
    attention = None if adapter.attention is None else list(adapter.attention)
    pattern = re.compile(naming.target_regex(list(adapter.targets), attention))
    kind, dora = getattr(adapter, "kind", "lora"), bool(getattr(adapter, "use_dora", False))
    out = AdapterSize()
    for name, m in transformer.named_modules():
        if isinstance(m, nn.Linear) and pattern.fullmatch(name):
            shapes = adapter_tensor_shapes(kind, adapter.rank, dora, m.in_features, m.out_features)
            out.parameters += sum(math.prod(s) for s in shapes)
            out.tensors += len(shapes)
            out.modules += 1
            out.alphas += 0 if kind == "lokr" and len(shapes) == 2 else 1
    return out
