"""peft's side of an adapter: the config of each kind, which state-dict keys are adapter parameters, one adapter's
weights of a (checkpoint) state dict, and those weights grouped by module."""
from __future__ import annotations

import re

import torch

# peft's parameter names per kind (its state-dict keys: ``{module}.{param}.{adapter}[.weight]``); ComfyUI reads the
# LoKr and LoHa ones under the same names (comfy/weight_adapter/lokr.py, loha.py).
_PARAM_NAMES = r"lora_[AB]|lora_magnitude_vector|lokr_w[12](?:_[ab])?|lokr_t2|hada_w[12]_[ab]|hada_t[12]"


_PARAM_TOKEN = re.compile(rf"\.({_PARAM_NAMES})\.")


def is_adapter_key(key: str) -> bool:
    """Whether a module/state-dict key names an adapter parameter (LoRA, DoRA magnitude, LoKr, LoHa)."""
    return _PARAM_TOKEN.search(key + ".") is not None


def adapter_weights(state_dict: dict[str, torch.Tensor], prefix: str = "",
                    adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """Adapter weights of one adapter from a (module or checkpoint) state dict, in peft naming without the adapter:
    ``{prefix}<module>.lora_A.default.weight`` -> ``<module>.lora_A.weight``,
    ``{prefix}<module>.lokr_w1.default`` -> ``<module>.lokr_w1``."""
    out = {}
    own = re.compile(rf"^(.+\.(?:{_PARAM_NAMES}))\.{re.escape(adapter_name)}(\.weight)?$")
    for key, value in state_dict.items():
        m = own.match(key[len(prefix):]) if key.startswith(prefix) else None
        if m:
            out[m.group(1) + (m.group(2) or "")] = value.detach().to("cpu", torch.float32).contiguous()
    return out


def by_module(sd: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """peft-named weights -> {module: {param: tensor}} (``<module>.lora_A.weight`` -> module, param)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, w in sd.items():
        m = re.match(rf"^(.+?)\.((?:{_PARAM_NAMES})(?:\.weight)?)$", key)
        out.setdefault(m.group(1), {})[m.group(2)] = w
    return out


def peft_config(kind: str, rank: int, alpha: float, dropout: float, target_modules: str, use_dora: bool = False):
    """The peft config of an adapter kind. LoKr and LoHa have no input dropout: ``dropout`` is their rank dropout."""
    import peft

    if kind == "lora":
        return peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, init_lora_weights=True,
                               use_dora=use_dora, target_modules=target_modules)
    cls = {"lokr": peft.LoKrConfig, "loha": peft.LoHaConfig}[kind]
    return cls(r=rank, alpha=alpha, rank_dropout=dropout, init_weights=True, target_modules=target_modules)
