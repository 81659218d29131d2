"""LoRA on Wan2.2 DiTs: target names, adapters, and export/import in ComfyUI and diffusers formats.

Users name targets the original Wan way (``q,k,v,o,ffn.0,ffn.2``); diffusers modules are ``attn1`` (self) /
``attn2`` (cross) ``.to_q/.to_k/.to_v/.to_out.0`` and ``ffn.net.0.proj`` / ``ffn.net.2``.
"""
from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from wanexp.errors import ConfigError

ATTN_TARGETS = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0"}
FFN_TARGETS = {"ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2"}
ATTN_KINDS = {"self": "attn1", "cross": "attn2"}
# Diffusers spellings accepted too.
ALIASES = {v: k for k, v in {**ATTN_TARGETS, **FFN_TARGETS}.items()}
ALLOWED_TARGETS = list(ATTN_TARGETS) + list(FFN_TARGETS)


def target_regex(targets: list[str], attention: list[str]) -> str:
    """A peft ``target_modules`` regex (full match on module names) for original-style target names."""
    names = []
    for t in targets:
        t = ALIASES.get(t, t)
        if t not in ALLOWED_TARGETS:
            raise ConfigError(
                f"adapter.targets: unknown target {t!r}; allowed: {', '.join(ALLOWED_TARGETS)} "
                "(or their diffusers names to_q, to_k, to_v, to_out.0, ffn.net.0.proj, ffn.net.2)"
            )
        names.append(t)
    for a in attention:
        if a not in ATTN_KINDS:
            raise ConfigError(f"adapter.attention: unknown value {a!r}; allowed: self, cross")
    alts = []
    attn = [re.escape(ATTN_TARGETS[t]) for t in names if t in ATTN_TARGETS]
    if attn and attention:
        layers = "|".join(ATTN_KINDS[a] for a in attention)
        alts.append(rf"blocks\.\d+\.({layers})\.({'|'.join(attn)})")
    ffn = [re.escape(FFN_TARGETS[t]) for t in names if t in FFN_TARGETS]
    if ffn:
        alts.append(rf"blocks\.\d+\.({'|'.join(ffn)})")
    if not alts:
        raise ConfigError("adapter: targets and attention select no module; e.g. targets=[q,k,v,o,ffn.0,ffn.2]")
    return "^(" + "|".join(alts) + ")$"


def add_lora(transformer, rank: int, alpha: float, dropout: float, targets: list[str], attention: list[str],
             adapter_name: str = "default") -> list[str]:
    """Add a LoRA adapter (fp32 parameters) through diffusers' PeftAdapterMixin; return the trainable names."""
    from peft import LoraConfig

    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, init_lora_weights=True,
                     target_modules=target_regex(targets, attention))
    before = {n: p.requires_grad for n, p in transformer.named_parameters() if "lora_" in n}
    transformer.add_adapter(cfg, adapter_name=adapter_name)  # peft's set_adapter freezes the other adapters
    names = []
    for name, p in transformer.named_parameters():
        if "lora_" in name and f".{adapter_name}." in name:
            p.data = p.data.float()
            p.requires_grad_(True)
            names.append(name)
        elif "lora_" not in name:  # the base stays frozen
            p.requires_grad_(False)
        else:  # other adapters keep their own settings
            p.requires_grad_(before[name])
    return names


@contextmanager
def use_adapter(modules, name: str | None):
    """Run ``modules`` (transformers) with only adapter ``name`` active, or with every adapter off (``None``: the
    frozen base, e.g. a distillation teacher); restores the previous state on exit.

    Unlike peft's ``set_adapter``/``disable_adapters`` this never touches ``requires_grad``: the trainable set stays
    what the optimizers and DDP were built with. Activation checkpointing recomputes a block's forward during backward
    under whatever adapter is active then, so a backward must run inside the same ``use_adapter`` as its forward."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for t in modules for m in t.modules() if isinstance(m, BaseTunerLayer)]
    saved = [(layer._active_adapter, layer._disable_adapters) for layer in layers]
    for layer in layers:
        if name is None:
            layer._disable_adapters = True
        else:
            layer._active_adapter = [name]
            layer._disable_adapters = False
    try:
        yield
    finally:
        for layer, (active, disabled) in zip(layers, saved):
            layer._active_adapter, layer._disable_adapters = active, disabled


class LoraAdapter:
    """The ``adapter=lora`` component: what is trained on the frozen base of every trained expert."""

    def __init__(self, *, name: str, rank: int, alpha: float, dropout: float, targets: list[str],
                 attention: list[str], init_from: str | None):
        """The arguments are the ``adapter`` group (conf/adapter/lora.yaml, typed by config.schema.LoraConfig)."""
        self.name, self.rank, self.alpha, self.dropout = name, int(rank), float(alpha), float(dropout)
        self.targets, self.attention, self.init_from = list(targets), list(attention), init_from
        target_regex(self.targets, self.attention)  # unknown names fail here, before any weight loads

    def apply(self, transformer, adapter_name: str = "default") -> list[str]:
        """Add the adapter (fp32, trainable) to a frozen transformer, from ``init_from`` if set; its parameter names."""
        names = add_lora(transformer, self.rank, self.alpha, self.dropout, self.targets, self.attention, adapter_name)
        if self.init_from:
            load_lora_into(transformer, self.init_from, adapter_name)
        return names

    def export(self, state_dict: dict, prefix: str, transformer, out_dir: Path, stem: str,
               adapter_name: str = "default", meta: dict | None = None):
        """Write one expert's adapter (ComfyUI + diffusers files) from the keys of a (checkpoint) state dict under
        ``prefix`` (the transformer's name in the module)."""
        sd = adapter_weights(state_dict, prefix, adapter_name)
        return export_lora(sd, lora_config_dict(transformer, adapter_name), out_dir, stem,
                           meta=dict(meta or {}, wanexp_targets=",".join(self.targets)))


def lora_config_dict(transformer, adapter_name: str = "default") -> dict:
    cfg = transformer.peft_config[adapter_name].to_dict()
    for k, v in list(cfg.items()):
        if isinstance(v, set):
            cfg[k] = sorted(v)
    return cfg


# ---- name conversion ----------------------------------------------------------------------------------------
_DIFF_TO_ORIG = [
    (re.compile(r"^blocks\.(\d+)\.attn1\.(to_q|to_k|to_v|to_out\.0)$"), "self_attn"),
    (re.compile(r"^blocks\.(\d+)\.attn2\.(to_q|to_k|to_v|to_out\.0)$"), "cross_attn"),
]
_PROJ = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}
_FFN = {"ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}


def diffusers_to_original_module(name: str) -> str:
    for pat, kind in _DIFF_TO_ORIG:
        m = pat.match(name)
        if m:
            return f"blocks.{m.group(1)}.{kind}.{_PROJ[m.group(2)]}"
    m = re.match(r"^blocks\.(\d+)\.(ffn\.net\.0\.proj|ffn\.net\.2)$", name)
    if m:
        return f"blocks.{m.group(1)}.{_FFN[m.group(2)]}"
    raise ValueError(f"no original Wan name for LoRA module {name!r}")


def original_to_diffusers_module(name: str) -> str:
    m = re.match(r"^blocks\.(\d+)\.(self_attn|cross_attn)\.([qkvo])$", name)
    if m:
        layer = "attn1" if m.group(2) == "self_attn" else "attn2"
        return f"blocks.{m.group(1)}.{layer}.{ATTN_TARGETS[m.group(3)]}"
    m = re.match(r"^blocks\.(\d+)\.(ffn\.0|ffn\.2)$", name)
    if m:
        return f"blocks.{m.group(1)}.{FFN_TARGETS[m.group(2)]}"
    raise ValueError(f"no diffusers name for Wan module {name!r}")


def to_comfyui(sd: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """diffusers/peft LoRA weights -> ComfyUI/original (``diffusion_model.…lora_down/lora_up`` + ``.alpha``)."""
    out = {}
    for key, w in sd.items():
        module, kind = re.match(r"^(.*)\.(lora_A|lora_B)\.weight$", key).groups()
        orig = "diffusion_model." + diffusers_to_original_module(module)
        out[f"{orig}.{'lora_down' if kind == 'lora_A' else 'lora_up'}.weight"] = w
        out[f"{orig}.alpha"] = torch.tensor(float(alpha))
    return out


def from_comfyui(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int, float]:
    """ComfyUI/original LoRA -> (diffusers/peft weights, rank, alpha). One rank and alpha for all modules."""
    out, ranks, alphas = {}, set(), set()
    for key, w in sd.items():
        body = key.removeprefix("diffusion_model.")
        if body.endswith(".alpha"):
            alphas.add(float(w))
            continue
        module, kind = re.match(r"^(.*)\.(lora_down|lora_up)\.weight$", body).groups()
        out[f"{original_to_diffusers_module(module)}.{'lora_A' if kind == 'lora_down' else 'lora_B'}.weight"] = w
        if kind == "lora_down":
            ranks.add(w.shape[0])
    if len(ranks) != 1 or len(alphas) > 1:
        raise ValueError(f"LoRA file mixes ranks {sorted(ranks)} / alphas {sorted(alphas)}; one of each is supported")
    rank = ranks.pop()
    return out, rank, alphas.pop() if alphas else float(rank)


# ---- files --------------------------------------------------------------------------------------------------
def _atomic_save(tensors: dict, path: Path, metadata: dict[str, str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)


def adapter_weights(state_dict: dict[str, torch.Tensor], prefix: str = "",
                    adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """LoRA weights of one adapter from a (module or checkpoint) state dict, in peft naming without the adapter:
    ``{prefix}blocks.0.attn1.to_q.lora_A.default.weight`` -> ``blocks.0.attn1.to_q.lora_A.weight``."""
    out = {}
    tag = f".{adapter_name}."
    for key, value in state_dict.items():
        if key.startswith(prefix) and ".lora_" in key and tag in key:
            out[key[len(prefix):].replace(tag, ".")] = value.detach().to("cpu", torch.float32).contiguous()
    return out


def export_lora(sd: dict[str, torch.Tensor], config: dict, out_dir: Path, stem: str, meta: dict | None = None):
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
    _atomic_save(to_comfyui(sd, config["lora_alpha"]), comfy, {
        "format": "pt", "ss_network_dim": str(config["r"]), "ss_network_alpha": str(config["lora_alpha"]), **info})
    _atomic_save({f"transformer.{k}": v for k, v in sd.items()}, diff, {
        "format": "pt", "lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()}),
        **info})
    return comfy, diff


def read_lora_file(path: str | Path) -> tuple[dict[str, torch.Tensor], int, float]:
    """Read a ComfyUI or diffusers LoRA file -> (peft-named weights without prefix, rank, alpha)."""
    from safetensors import safe_open

    sd = load_file(os.fspath(path))
    if any(k.startswith("diffusion_model.") for k in sd):
        return from_comfyui(sd)
    with safe_open(os.fspath(path), "pt") as f:
        header = f.metadata() or {}
    weights = {k.removeprefix("transformer."): v for k, v in sd.items()}
    rank = next(v.shape[0] for k, v in weights.items() if k.endswith("lora_A.weight"))
    alpha = float(rank)
    if "lora_adapter_metadata" in header:
        alpha = float(json.loads(header["lora_adapter_metadata"]).get("transformer.lora_alpha", rank))
    return weights, rank, alpha


def load_lora_into(transformer, path: str | Path, adapter_name: str = "default") -> None:
    """Copy a LoRA file's weights into an existing adapter of matching rank (used by ``adapter.init_from``)."""
    from peft.utils import set_peft_model_state_dict

    weights, rank, alpha = read_lora_file(path)
    cfg = transformer.peft_config[adapter_name]
    if rank != cfg.r:
        raise ConfigError(f"adapter.init_from={path}: file has rank {rank}, run has rank {cfg.r}; "
                          f"set adapter.rank={rank}")
    if abs(alpha - cfg.lora_alpha) > 1e-6:
        # Fold the file's scale into B so the effective update is unchanged under the run's alpha.
        factor = (alpha / rank) / (cfg.lora_alpha / cfg.r)
        weights = {k: (v * factor if "lora_B" in k else v) for k, v in weights.items()}
    result = set_peft_model_state_dict(transformer, weights, adapter_name=adapter_name)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ConfigError(f"adapter.init_from={path}: {len(unexpected)} weights match no LoRA module "
                          f"(e.g. {unexpected[0]}); check adapter.targets")
