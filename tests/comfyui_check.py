"""ComfyUI's own loader code on wanexp's ComfyUI exports: ``python -m tests.comfyui_check COMFYUI_DIR`` prints JSON.

For each adapter kind of ``tests/unit/test_adapter_types.py`` (LoRA, DoRA, LoKr with full and with a low-rank factor,
LoHa; a tiny Wan DiT with random adapter weights) the exported ``_comfyui`` file goes through what ComfyUI's LoRA
loader node runs (comfy/sd.py ``load_lora_for_models``): ``comfy.lora.model_lora_keys_unet`` on the parameter names
of ComfyUI's own ``WanModel`` (built on the meta device), ``comfy.lora_convert.convert_lora``, ``comfy.lora.load_lora``
(unloaded keys are collected from its warnings), then ``comfy.lora.calculate_weight`` with the patch tuple
ComfyUI's ModelPatcher builds, at strength 1 and 0.5. The patched weights are compared with peft's merge of the
trained adapter (strength 1) and with ``wanexp.adapters.merge.patched_weight`` (0.5).

It runs in its own process: ComfyUI's modules need ``--cpu`` in ``sys.argv`` and stand-ins for imports this path does
not use (``comfy.model_base``, which imports every model family and is only read for ``isinstance`` checks, and
optional packages such as einops when absent).
"""
from __future__ import annotations

import json
import logging
import sys
import tempfile
import types
from pathlib import Path

import torch


def _stand_in(name: str, attr):
    module = types.ModuleType(name)

    def missing(key):
        if key.startswith("__"):
            raise AttributeError(key)
        return attr(key)

    module.__getattr__ = missing
    sys.modules[name] = module
    return module


def import_comfy(comfy_dir: str):
    """ComfyUI's ``comfy`` package from a source tree, on the CPU, with stand-ins for what this path does not use."""
    sys.path.insert(0, comfy_dir)
    sys.argv = [sys.argv[0], "--cpu"]  # comfy.cli_args reads the command line, as ComfyUI's main.py has it do
    for name in ("einops", "psutil", "comfy_kitchen", "comfy_aimdo"):
        try:
            __import__(name)
        except ImportError:
            _stand_in(name, lambda key: (lambda *a, **k: None))
    model_base = _stand_in("comfy.model_base", lambda key: type(key, (), {}))  # isinstance checks only
    import comfy
    import comfy.options

    comfy.model_base = model_base
    comfy.options.enable_args_parsing()
    import comfy.lora
    import comfy.lora_convert
    import comfy.ops
    from comfy.ldm.wan.model import WanModel

    return comfy, WanModel


def comfy_wan_keys(WanModel, ops, cfg: dict) -> list[str]:
    """The state-dict keys ComfyUI's WanModel has for a diffusers WanTransformer3DModel config."""
    with torch.device("meta"):
        m = WanModel(model_type="t2v", patch_size=tuple(cfg["patch_size"]), text_len=8, in_dim=cfg["in_channels"],
                     dim=cfg["num_attention_heads"] * cfg["attention_head_dim"], ffn_dim=cfg["ffn_dim"],
                     freq_dim=cfg["freq_dim"], text_dim=cfg["text_dim"], out_dim=cfg["out_channels"],
                     num_heads=cfg["num_attention_heads"], num_layers=cfg["num_layers"],
                     operations=ops.disable_weight_init, device="meta", dtype=torch.float32)
    return [f"diffusion_model.{k}" for k in m.state_dict()]


class _Model:
    """What ``model_lora_keys_unet`` reads of a ComfyUI model: its state dict and config."""

    def __init__(self, sd: dict):
        self.sd, self.model_config = sd, types.SimpleNamespace(unet_config={})

    def state_dict(self) -> dict:
        return self.sd


class _TmpFactory:
    @staticmethod
    def mktemp(name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=name))


def check(comfy_dir: str) -> dict:
    comfy, WanModel = import_comfy(comfy_dir)
    from safetensors.torch import load_file

    from tests.unit import test_adapter_types as kinds
    from tests import wan_adapters as lora

    unloaded: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: unloaded.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    keys = comfy_wan_keys(WanModel, comfy.ops, kinds.TINY)
    out = {"comfyui": str(comfy.lora.__file__), "kinds": {}}
    for kind in kinds.KINDS:
        _, want, files = kinds.trained(kind, _TmpFactory)
        base = kinds._base().state_dict()
        comfy_base = {f"diffusion_model.{lora.diffusers_to_original_module(k[:-len('.weight')])}.weight": v
                      for k, v in base.items() if k.startswith("blocks.") and ".norm" not in k and k.endswith("weight")}
        unknown = sorted(set(comfy_base) - set(keys))  # our original names must be ComfyUI's
        key_map = comfy.lora.model_lora_keys_unet(_Model({k: comfy_base.get(k) for k in keys}), {})
        unloaded.clear()
        loaded = comfy.lora.load_lora(comfy.lora_convert.convert_lora(load_file(files[0])), key_map)
        ours = lora.read_any_adapter(files[0], "file").modules
        full = half = 0.0
        for key, adapter in loaded.items():
            module = lora.original_to_diffusers_module(key[len("diffusion_model."):-len(".weight")])
            w = comfy_base[key]
            patched = comfy.lora.calculate_weight([(1.0, adapter, 1.0, None, None)], w.clone(), key)
            full = max(full, (patched - want[f"{module}.weight"]).abs().max().item())
            patched = comfy.lora.calculate_weight([(0.5, adapter, 1.0, None, None)], w.clone(), key)
            half = max(half, (patched - lora.patched_weight(w, ours[module], 0.5)).abs().max().item())
        adapted = sorted(k for k in want if k in base and not torch.equal(want[k], base[k]))
        out["kinds"][kind] = {"adapter": sorted({type(a).__name__ for a in loaded.values()}), "patched": len(loaded),
                              "adapted": len(adapted), "unloaded_keys": list(unloaded), "unknown_names": unknown,
                              "max_abs_diff": full, "max_abs_diff_strength_0_5": half}
    return out


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1])))
