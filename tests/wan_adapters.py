"""wanexp's adapter API bound to Wan2.2's naming (``WanSpec.adapter_naming``), under the names the tests of Wan's
adapter files call: the family-neutral functions take the naming, the adapter component its ``family``."""
from __future__ import annotations

from wanexp.adapters import export, files, kinds, merge, sizing
from wanexp.adapters.keys import adapter_weights, is_adapter_key  # noqa: F401
from wanexp.adapters.kinds import add_lora, use_adapter  # noqa: F401
from wanexp.adapters.merge import comfy_diff, patched_weight  # noqa: F401
from wanexp.adapters.sizing import adapter_size, adapter_tensor_shapes  # noqa: F401
from wanexp.models.wan22.adapter_naming import WAN_NAMING

WAN = "wanexp.models.wan22.spec.WanSpec"
target_regex = WAN_NAMING.target_regex
diffusers_to_original_module = WAN_NAMING.to_original
original_to_diffusers_module = WAN_NAMING.from_original


def LoraAdapter(**kw):  # noqa: N802 (the component's class, bound to the family)
    return kinds.LoraAdapter(family=WAN, **kw)


def LokrAdapter(**kw):  # noqa: N802
    return kinds.LokrAdapter(family=WAN, **kw)


def LohaAdapter(**kw):  # noqa: N802
    return kinds.LohaAdapter(family=WAN, **kw)


def to_comfyui(sd, alpha):
    return export.to_comfyui(sd, alpha, WAN_NAMING)


def export_lora(sd, config, out_dir, stem, meta=None):
    return export.export_lora(sd, config, WAN_NAMING, out_dir, stem, meta)


def convert_lora_state_dict(sd, header=None, what="LoRA file"):
    return files.convert_lora_state_dict(sd, WAN_NAMING, header, what)


def read_any_adapter(path, what="adapter file"):
    return files.read_adapter(path, what, WAN_NAMING)


def add_wan_lora(transformer, rank, alpha, dropout, targets, attention, adapter_name="default", kind="lora",
                 use_dora=False):
    return add_lora(transformer, rank, alpha, dropout, target_regex(targets, attention), adapter_name, kind, use_dora)


__all__ = ["merge", "sizing"]
