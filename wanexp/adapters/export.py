"""Writing adapter files: ComfyUI's (original names under ``diffusion_model.``, any kind) and diffusers' (peft names
under ``transformer.`` with the peft config in the header: LoRA, DoRA, LoKr), atomically and as readable as the
umask allows."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from wanexp.adapters.keys import by_module
from wanexp.adapters.merge import comfy_module_params
from wanexp.adapters.naming import COMFY_PREFIX


def to_comfyui(sd: dict[str, torch.Tensor], alpha: float, naming) -> dict[str, torch.Tensor]:
    """diffusers/peft LoRA weights -> ComfyUI/original (``diffusion_model.…lora_down/lora_up`` + ``.alpha``)."""
    out = {}
    for key, w in sd.items():
        module, kind = re.match(r"^(.*)\.(lora_A|lora_B)\.weight$", key).groups()
        orig = COMFY_PREFIX + naming.to_original(module)
        out[f"{orig}.{'lora_down' if kind == 'lora_A' else 'lora_up'}.weight"] = w
        out[f"{orig}.alpha"] = torch.tensor(float(alpha))
    return out


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (``os.umask`` must set it to read it, and a
    file another thread creates meanwhile would get the wrong mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _atomic_save(tensors: dict, path: Path, metadata: dict[str, str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, tmp, metadata=metadata)
    os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates its file 0600; a LoRA file is as readable as a checkpoint
    os.replace(tmp, path)


def export_lora(sd: dict[str, torch.Tensor], config: dict, naming, out_dir: Path, stem: str,
                meta: dict | None = None):
    """Write ``{stem}_comfyui.safetensors`` and ``{stem}_diffusers.safetensors`` from peft-named LoRA weights.

    ``config`` is the adapter's LoraConfig as a dict (``r``, ``lora_alpha``, ``target_modules``, ...). The diffusers
    file has ``transformer.``-prefixed keys and ``lora_adapter_metadata`` in its header, so ``load_lora_weights``
    restores the right scale; the ComfyUI file carries ``.alpha`` per module.
    """
    if not sd:
        raise ValueError(f"no LoRA weights to export for {stem}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {k: str(v) for k, v in (meta or {}).items()}
    comfy = out_dir / f"{stem}_comfyui.safetensors"
    diff = out_dir / f"{stem}_diffusers.safetensors"
    _atomic_save(to_comfyui(sd, config["lora_alpha"], naming), comfy, {
        "format": "pt", "ss_network_dim": str(config["r"]), "ss_network_alpha": str(config["lora_alpha"]), **info})
    _atomic_save({f"transformer.{k}": v for k, v in sd.items()}, diff, {
        "format": "pt", "lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()}),
        **info})
    return comfy, diff


def export_adapter(sd: dict[str, torch.Tensor], kind: str, config: dict, naming, out_dir: Path, stem: str,
                   meta: dict | None = None, base=None) -> list[Path]:
    """Write one adapter's files: ``{stem}_comfyui.safetensors`` (any kind) and ``{stem}_diffusers.safetensors``
    (LoRA, DoRA and LoKr: what diffusers' ``load_lora_weights`` loads; it has no LoHa). ``config``: the peft config
    as a dict; ``base(module)``: the base weight of a module (DoRA only)."""
    if kind == "lora" and not config.get("use_dora"):
        return list(export_lora(sd, config, naming, out_dir, stem, meta))
    if not sd:
        raise ValueError(f"no adapter weights to export for {stem}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rank, alpha = int(config["r"]), float(config["lora_alpha"] if kind == "lora" else config["alpha"])
    comfy = {}
    for module, params in sorted(by_module(sd).items()):
        weight = base(module) if base is not None and kind == "lora" else None
        orig = COMFY_PREFIX + naming.to_original(module)
        for name, w in comfy_module_params(kind, params, rank, alpha, weight).items():
            comfy[f"{orig}.{name}"] = w
    info = {k: str(v) for k, v in (meta or {}).items()}
    files = [out_dir / f"{stem}_comfyui.safetensors"]
    _atomic_save(comfy, files[0], {"format": "pt", "ss_network_dim": str(rank), "ss_network_alpha": str(alpha),
                                   "wanexp_adapter": kind, **info})
    if kind in ("lora", "lokr"):
        files.append(out_dir / f"{stem}_diffusers.safetensors")
        # peft's own naming (DoRA's magnitude without .weight, as peft's get_peft_model_state_dict writes it)
        diff = {f"transformer.{k.removesuffix('.weight') if 'magnitude' in k else k}": v for k, v in sd.items()}
        _atomic_save(diff, files[1], {"format": "pt", **info, "lora_adapter_metadata": json.dumps(
            {f"transformer.{k}": v for k, v in config.items()})})
    return files


def save_adapter_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file atomically, readable as the umask allows (as the exports are)."""
    _atomic_save(tensors, Path(path), metadata)
