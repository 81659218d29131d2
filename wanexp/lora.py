"""LoRA on Wan2.2 DiTs: target names, adapters, and export/import in ComfyUI and diffusers formats.

Users name targets the original Wan way (``q,k,v,o,ffn.0,ffn.2``); diffusers modules are ``attn1`` (self) /
``attn2`` (cross) ``.to_q/.to_k/.to_v/.to_out.0`` and ``ffn.net.0.proj`` / ``ffn.net.2``.
"""
from __future__ import annotations

import json
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
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


ADAPTER_KINDS = ("lora", "lokr", "loha")
# peft's parameter names per kind (its state-dict keys: ``{module}.{param}.{adapter}[.weight]``); ComfyUI reads the
# LoKr and LoHa ones under the same names (comfy/weight_adapter/lokr.py, loha.py).
_PARAM_NAMES = r"lora_[AB]|lora_magnitude_vector|lokr_w[12](?:_[ab])?|lokr_t2|hada_w[12]_[ab]|hada_t[12]"
_PARAM_TOKEN = re.compile(rf"\.({_PARAM_NAMES})\.")


def is_adapter_key(key: str) -> bool:
    """Whether a module/state-dict key names an adapter parameter (LoRA, DoRA magnitude, LoKr, LoHa)."""
    return _PARAM_TOKEN.search(key + ".") is not None


def peft_config(kind: str, rank: int, alpha: float, dropout: float, target_modules: str, use_dora: bool = False):
    """The peft config of an adapter kind. LoKr and LoHa have no input dropout: ``dropout`` is their rank dropout."""
    import peft

    if kind == "lora":
        return peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, init_lora_weights=True,
                               use_dora=use_dora, target_modules=target_modules)
    cls = {"lokr": peft.LoKrConfig, "loha": peft.LoHaConfig}[kind]
    return cls(r=rank, alpha=alpha, rank_dropout=dropout, init_weights=True, target_modules=target_modules)


def add_lora(transformer, rank: int, alpha: float, dropout: float, targets: list[str], attention: list[str],
             adapter_name: str = "default", kind: str = "lora", use_dora: bool = False) -> list[str]:
    """Add an adapter (``kind``: lora, lokr, loha; fp32 parameters) through diffusers' PeftAdapterMixin; return the
    trainable names."""
    cfg = peft_config(kind, rank, alpha, dropout, target_regex(targets, attention), use_dora)
    before = {n: p.requires_grad for n, p in transformer.named_parameters() if is_adapter_key(n)}
    transformer.add_adapter(cfg, adapter_name=adapter_name)  # peft's set_adapter freezes the other adapters
    names = []
    for name, p in transformer.named_parameters():
        mine = is_adapter_key(name) and (f".{adapter_name}." in name or name.endswith(f".{adapter_name}"))
        if mine:
            p.data = p.data.float()
            p.requires_grad_(True)
            names.append(name)
        elif not is_adapter_key(name):  # the base stays frozen
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
    """The ``adapter=lora`` component (DoRA with ``use_dora``): what is trained on the frozen base of every trained
    expert. ``adapter=lokr`` and ``adapter=loha`` are the same component with another peft adapter kind."""

    kind = "lora"

    def __init__(self, *, name: str, rank: int, alpha: float, dropout: float, targets: list[str],
                 attention: list[str], init_from: str | None, use_dora: bool = False):
        """The arguments are the ``adapter`` group (conf/adapter/*.yaml, typed by config.schema.LoraConfig)."""
        self.name, self.rank, self.alpha, self.dropout = name, int(rank), float(alpha), float(dropout)
        self.targets, self.attention, self.init_from = list(targets), list(attention), init_from
        self.use_dora = bool(use_dora)
        if self.use_dora and self.kind != "lora":
            raise ConfigError(f"adapter.use_dora=true: DoRA is a LoRA variant, adapter={self.kind} has none; set "
                              "adapter.use_dora=false or adapter=lora")
        target_regex(self.targets, self.attention)  # unknown names fail here, before any weight loads
        self._init = self._file = None
        if init_from:  # read and checked here too: a file that cannot fit fails before any weight loads
            what = f"adapter.init_from={init_from}"
            if self.kind == "lora" and not self.use_dora and not is_typed_adapter_file(init_from):
                self._init = read_lora_file(init_from, what)
                check_lora_fits(*self._init, self.rank, configured_kinds(self.targets, self.attention), what)
            else:
                self._file = read_adapter_file(init_from, what)
                check_adapter_fits(self._file, self, what)

    @staticmethod
    def is_param(key: str) -> bool:
        """Whether a state-dict key is an adapter parameter (of any kind)."""
        return is_adapter_key(key)

    @property
    def label(self) -> str:
        """The type as users name it: lora, dora, lokr, loha."""
        return "dora" if self.use_dora else self.kind

    def apply(self, transformer, adapter_name: str = "default") -> list[str]:
        """Add the adapter (fp32, trainable) to a frozen transformer, from ``init_from`` if set; its parameter names."""
        names = add_lora(transformer, self.rank, self.alpha, self.dropout, self.targets, self.attention, adapter_name,
                         kind=self.kind, use_dora=self.use_dora)
        what = f"adapter.init_from={self.init_from}"
        if self._init is not None:
            copy_lora_into(transformer, *self._init, adapter_name, what=what)
        if self._file is not None:
            copy_adapter_into(transformer, self._file, adapter_name, what=what)
        return names

    def export(self, state_dict: dict, prefix: str, transformer, out_dir: Path, stem: str,
               adapter_name: str = "default", meta: dict | None = None):
        """Write one expert's adapter files (ComfyUI, plus diffusers where diffusers loads the kind) from the keys of
        a (checkpoint) state dict under ``prefix`` (the transformer's name in the module)."""
        sd = adapter_weights(state_dict, prefix, adapter_name)
        base = (lambda module: base_weight(transformer, module)) if self.use_dora else None
        return export_adapter(sd, self.kind, lora_config_dict(transformer, adapter_name), out_dir, stem,
                              meta=dict(meta or {}, wanexp_targets=",".join(self.targets), wanexp_adapter=self.label),
                              base=base)


class LokrAdapter(LoraAdapter):
    """``adapter=lokr``: peft's LoKr (a Kronecker product of two small factors per module)."""

    kind = "lokr"


class LohaAdapter(LoraAdapter):
    """``adapter=loha``: peft's LoHa (the Hadamard product of two low-rank products per module)."""

    kind = "loha"


def base_weight(transformer, module: str) -> torch.Tensor:
    """The frozen base weight of adapted ``module`` as a full fp32 CPU tensor (DoRA's export needs its row norms)."""
    w = transformer.get_submodule(module).get_base_layer().weight
    if type(w).__name__ == "DTensor" or type(w.data).__name__ == "DTensor":
        raise RuntimeError(f"{module}: a sharded base weight; DoRA export needs the whole weight on this rank")
    return w.detach().to("cpu", torch.float32)


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


# ---- files --------------------------------------------------------------------------------------------------
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


def adapter_weights(state_dict: dict[str, torch.Tensor], prefix: str = "",
                    adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """Adapter weights of one adapter from a (module or checkpoint) state dict, in peft naming without the adapter:
    ``{prefix}blocks.0.attn1.to_q.lora_A.default.weight`` -> ``blocks.0.attn1.to_q.lora_A.weight``,
    ``{prefix}blocks.0.attn1.to_q.lokr_w1.default`` -> ``blocks.0.attn1.to_q.lokr_w1``."""
    out = {}
    own = re.compile(rf"^(.+\.(?:{_PARAM_NAMES}))\.{re.escape(adapter_name)}(\.weight)?$")
    for key, value in state_dict.items():
        m = own.match(key[len(prefix):]) if key.startswith(prefix) else None
        if m:
            out[m.group(1) + (m.group(2) or "")] = value.detach().to("cpu", torch.float32).contiguous()
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


# ---- LoKr, LoHa, DoRA: ComfyUI's keys and arithmetic ------------------------------------------------------------
# ComfyUI (comfy/lora.py:load_lora, comfy/weight_adapter/{lora,lokr,loha,base}.py) reads, per module prefix ``x``:
# ``x.alpha``, ``x.dora_scale`` and the kind's tensors (``x.lora_up.weight``/``x.lora_down.weight``, ``x.lokr_w1`` or
# ``x.lokr_w1_a``/``x.lokr_w1_b``, the same for w2, ``x.hada_w1_a`` ... ``x.hada_w2_b``). Its scale is alpha/dim with
# dim the inner size of a low-rank factor (LoKr: only when a factor is low-rank, else 1; no alpha: 1). DoRA: a
# ``dora_scale`` of shape (out, 1) makes ComfyUI compute ``dora_scale / (|W|_row + eps) * (W + scale * diff)`` with
# |W| the row norm of the base weight; peft trains ``m / |W + scale * diff|_row * (W + scale * diff)``, so the file's
# dora_scale is m * (|W| + eps) / |W + scale * diff| (needs the base weight at export).
DORA_EPS = torch.finfo(torch.float32).eps  # ComfyUI patches in fp32 and adds that dtype's eps to the norm
_COMFY_KIND = {"lora_up.weight": "lora", "lora_B.weight": "lora", "lokr_w1": "lokr", "lokr_w1_a": "lokr",
               "lokr_w2": "lokr", "lokr_w2_a": "lokr", "hada_w1_a": "loha"}
KIND_NAMES = {"lora": "LoRA", "lokr": "LoKr", "loha": "LoHa"}


def comfy_module_params(kind: str, params: dict[str, torch.Tensor], rank: int, alpha: float,
                        weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One module's peft-named adapter weights (scale alpha/rank, peft's) -> ComfyUI's names and scale (see above).
    ``weight``: the base weight, needed for a DoRA magnitude only."""
    if kind == "lora":
        a, b = params["lora_A.weight"], params["lora_B.weight"]
        out = {"lora_down.weight": a, "lora_up.weight": b, "alpha": torch.tensor(float(alpha))}
        m = params.get("lora_magnitude_vector.weight", params.get("lora_magnitude_vector"))
        if m is not None:
            w = weight.float()
            merged = w + (alpha / rank) * (b @ a)
            out["dora_scale"] = (m * (w.norm(dim=1) + DORA_EPS) / merged.norm(dim=1)).unsqueeze(1).contiguous()
        return out
    out = dict(params)
    if kind == "lokr" and "lokr_w1_a" not in params and "lokr_w2_a" not in params:
        out["lokr_w1"] = params["lokr_w1"] * (alpha / rank)  # two full factors: ComfyUI applies no alpha
    else:  # peft uses one rank for every low-rank factor, the dim ComfyUI divides alpha by
        out["alpha"] = torch.tensor(float(alpha))
    return out


def _comfy_scale(params: dict, dim: int | None) -> float:
    alpha = params.get("alpha")
    return float(alpha) / dim if alpha is not None and dim is not None else 1.0


def comfy_diff(params: dict[str, torch.Tensor], shape=None) -> tuple[torch.Tensor, float]:
    """(unscaled weight difference, scale) of one module's ComfyUI-named params, as ComfyUI computes them; reshaped
    to ``shape`` (the weight's) when given."""
    diff, scale = _comfy_diff(params)
    return (diff if shape is None else diff.reshape(shape)), scale


def _comfy_diff(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    p = {k: v.float() for k, v in params.items()}
    if "lora_up.weight" in p or "lora_B.weight" in p:
        up, down = p.get("lora_up.weight", p.get("lora_B.weight")), p.get("lora_down.weight", p.get("lora_A.weight"))
        return up @ down, _comfy_scale(p, down.shape[0])
    if any(k.startswith("lokr_") for k in p):
        dim = None
        w1 = p.get("lokr_w1")
        if w1 is None:
            w1, dim = p["lokr_w1_a"] @ p["lokr_w1_b"], p["lokr_w1_b"].shape[0]
        w2 = p.get("lokr_w2")
        if w2 is None:
            w2, dim = p["lokr_w2_a"] @ p["lokr_w2_b"], p["lokr_w2_b"].shape[0]
        return torch.kron(w1, w2), _comfy_scale(p, dim)
    diff = (p["hada_w1_a"] @ p["hada_w1_b"]) * (p["hada_w2_a"] @ p["hada_w2_b"])
    return diff, _comfy_scale(p, p["hada_w1_b"].shape[0])


def patched_weight(weight: torch.Tensor, params: dict[str, torch.Tensor], strength: float = 1.0) -> torch.Tensor:
    """The weight ComfyUI's LoRA loader makes of ``weight`` and one module's params at ``strength`` (fp32), also for a
    peft DoRA magnitude (``lora_magnitude_vector``, a diffusers file): ``m / |W + diff|_row * (W + diff)``."""
    w = weight.float()
    diff, scale = comfy_diff(params, w.shape)
    dora, mag = params.get("dora_scale"), params.get("lora_magnitude_vector")
    if dora is None and mag is None:
        return w + (strength * scale) * diff
    calc = w + scale * diff
    if mag is not None:
        calc = calc * (mag.float() / calc.norm(dim=1)).unsqueeze(1)
    else:
        on_rows = dora.shape[0] == w.shape[0]
        norm = w.norm(dim=1, keepdim=True) if on_rows else calc.norm(dim=0, keepdim=True)
        calc = calc * (dora.float().reshape(-1, 1) if on_rows else dora.float().reshape(1, -1)) / (norm + DORA_EPS)
    return calc if strength == 1.0 else w + strength * (calc - w)


def _by_module(sd: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """peft-named weights -> {module: {param: tensor}} (``blocks.0.attn1.to_q.lora_A.weight`` -> module, param)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, w in sd.items():
        m = re.match(rf"^(.+?)\.((?:{_PARAM_NAMES})(?:\.weight)?)$", key)
        out.setdefault(m.group(1), {})[m.group(2)] = w
    return out


def export_adapter(sd: dict[str, torch.Tensor], kind: str, config: dict, out_dir: Path, stem: str,
                   meta: dict | None = None, base=None) -> list[Path]:
    """Write one adapter's files: ``{stem}_comfyui.safetensors`` (any kind) and ``{stem}_diffusers.safetensors``
    (LoRA, DoRA and LoKr: what diffusers' ``load_lora_weights`` loads; it has no LoHa). ``config``: the peft config
    as a dict; ``base(module)``: the base weight of a module (DoRA only)."""
    if kind == "lora" and not config.get("use_dora"):
        return list(export_lora(sd, config, out_dir, stem, meta))
    if not sd:
        raise ValueError(f"no adapter weights to export for {stem}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rank, alpha = int(config["r"]), float(config["lora_alpha"] if kind == "lora" else config["alpha"])
    comfy = {}
    for module, params in sorted(_by_module(sd).items()):
        weight = base(module) if base is not None and kind == "lora" else None
        orig = "diffusion_model." + diffusers_to_original_module(module)
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


# ---- reading LoKr, LoHa and DoRA files ---------------------------------------------------------------------------
_TYPED = re.compile(r"\.(lokr_|hada_|dora_scale$|lora_magnitude_vector)")


def is_typed_adapter_file(path) -> bool:
    """Whether a safetensors file holds a LoKr, LoHa or DoRA adapter (False for a LoRA or an unreadable file)."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), "pt") as f:
            return any(_TYPED.search(k) for k in f.keys())
    except Exception:  # unreadable: read_lora_file says why in one line
        return False


class AdapterFile:
    """A LoRA/DoRA/LoKr/LoHa file as {diffusers module name: ComfyUI-named params (alpha, dora_scale included)}; a
    diffusers/peft file's DoRA magnitude stays ``lora_magnitude_vector`` (see :func:`patched_weight`)."""

    def __init__(self, modules: dict[str, dict[str, torch.Tensor]], what: str):
        self.modules, self.what = modules, what
        kinds = {_COMFY_KIND[k] for p in modules.values() for k in p if k in _COMFY_KIND}
        if len(kinds) != 1:
            raise ConfigError(f"{what}: the file mixes adapter kinds ({', '.join(sorted(kinds)) or 'none found'}); "
                              "use a file of one kind (LoRA, LoKr or LoHa)")
        self.kind = kinds.pop()
        self.dora = any("dora_scale" in p or "lora_magnitude_vector" in p for p in modules.values())

    @property
    def label(self) -> str:
        return "DoRA" if self.dora else KIND_NAMES[self.kind]

    def rank(self) -> int | None:
        """The inner size of the low-rank factors (None: a LoKr of full factors only)."""
        for p in self.modules.values():
            for key, dim in (("lora_down.weight", 0), ("hada_w1_b", 0), ("lokr_w2_b", 0), ("lokr_w1_b", 0)):
                if key in p:
                    return int(p[key].shape[dim])
        return None


_PEFT_TO_COMFY = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight",
                  "lora_magnitude_vector.weight": "lora_magnitude_vector"}


def read_adapter_file(path, what: str = "adapter file", sd: dict | None = None) -> AdapterFile:
    """Read a wanexp (or ComfyUI-named) LoRA/DoRA/LoKr/LoHa file, or a diffusers/peft one with its
    ``lora_adapter_metadata`` header; one line on anything else."""
    header = {}
    if sd is None:
        sd, header = read_safetensors(path, what, "name an existing adapter .safetensors file", "")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    peft_named = False
    for key, w in sd.items():
        key = _kohya_to_comfy(key)
        m = re.match(r"^(?:diffusion_model\.)(.+?)\.(alpha|dora_scale|lora_(?:up|down)\.weight|lora_[AB]\.weight|"
                     r"lokr_\w+|hada_\w+)$", key)
        try:
            if m:
                module, param = original_to_diffusers_module(m.group(1)), m.group(2)
            else:
                m = re.match(rf"^(?:transformer\.|base_model\.model\.)?(.+?)\.((?:{_PARAM_NAMES})(?:\.weight)?)$", key)
                if not m:
                    raise ValueError(key)
                module, param, peft_named = m.group(1), _PEFT_TO_COMFY.get(m.group(2), m.group(2)), True
                if not _MODULE.match(module):
                    raise ValueError(key)
        except ValueError:
            raise _unknown_format(sd, what) from None
        modules.setdefault(module, {})[param] = w.to(torch.float32)
    if not modules:
        raise _unknown_format(sd, what)
    if peft_named:
        modules = _peft_scale_to_comfy(modules, header, what)
    return AdapterFile(modules, what)


_KOHYA = re.compile(r"^lora_unet_blocks_(\d+)_(?:(self_attn|cross_attn)_([qkvo])|ffn_([02]))\.(.+)$")


def _kohya_to_comfy(key: str) -> str:
    """kohya/musubi-tuner/LyCORIS module names (``lora_unet_blocks_0_self_attn_q.lokr_w1``) -> ComfyUI's
    (``diffusion_model.blocks.0.self_attn.q.lokr_w1``); other keys as they are."""
    m = _KOHYA.match(key)
    if m is None:
        return key
    block, attn, proj, ffn, param = m.groups()
    module = f"{attn}.{proj}" if attn else f"ffn.{ffn}"
    return f"diffusion_model.blocks.{block}.{module}.{param}"


def _peft_scale_to_comfy(modules: dict, header: dict, what: str) -> dict:
    """A peft-named file's modules (scale alpha/r from the header, peft's) under ComfyUI's scale rules."""
    try:
        meta = json.loads(header.get("lora_adapter_metadata", "{}"))
        rank = meta.get("transformer.r")
        alpha = meta.get("transformer.lora_alpha", meta.get("transformer.alpha", rank))
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{what}: its lora_adapter_metadata header is unreadable ({e}); use a file wanexp or "
                          "diffusers wrote") from None
    out = {}
    for module, p in modules.items():
        kind = next(_COMFY_KIND[k] for k in p if k in _COMFY_KIND)
        r = rank or (p["lora_down.weight"].shape[0] if kind == "lora" else None)
        if kind != "lora" and r is None:
            raise ConfigError(f"{what}: a peft-named {KIND_NAMES[kind]} file without lora_adapter_metadata (its r "
                              "and alpha); use the _comfyui file wanexp wrote")
        scale_alpha = float(alpha if alpha is not None else r)
        if kind == "lora":
            q = dict(p, alpha=torch.tensor(scale_alpha * p["lora_down.weight"].shape[0] / float(r)))
        else:
            q = comfy_module_params(kind, p, int(r), scale_alpha)
        out[module] = q
    return out


def check_adapter_fits(f: AdapterFile, adapter: "LoraAdapter", what: str) -> None:
    """Refuse (one line, before weights load) a file of another kind, DoRA-ness, rank or targets than the run."""
    want = "DoRA" if adapter.use_dora else KIND_NAMES[adapter.kind]
    if f.kind != adapter.kind or f.dora != adapter.use_dora:
        setting = f"adapter={f.kind}" + (" adapter.use_dora=true" if f.dora else "")
        raise ConfigError(f"{what}: the file is a {f.label} adapter, the run trains {want}; set {setting}")
    if f.kind == "lora":
        _check_not_transposed({m: (p["lora_down.weight"], p.get("lora_up.weight")) for m, p in f.modules.items()},
                              what)
    rank = f.rank()
    if rank is not None and rank != adapter.rank:
        raise ConfigError(f"{what}: file has rank {rank}, run has rank {adapter.rank}; set adapter.rank={rank}")
    for module, params in f.modules.items():
        if "dora_scale" in params and params["dora_scale"].shape[0] == 1:
            raise ConfigError(f"{what}: its DoRA scale is per input column ({module}), peft's DoRA is per output "
                              "row; use a DoRA file with a per-row (out, 1) dora_scale, as wanexp writes")
    _check_kinds(sorted(f.modules), configured_kinds(adapter.targets, adapter.attention), what)


def copy_adapter_into(transformer, f: AdapterFile, adapter_name: str = "default", what: str = "adapter file") -> None:
    """Copy a checked :class:`AdapterFile` into the run's adapter of the same kind: every module then makes the
    file's weight under the run's alpha (the file's scale is folded into one factor; DoRA's magnitude is derived
    from the base weight)."""
    cfg = transformer.peft_config[adapter_name]
    run_scale = (cfg.lora_alpha if f.kind == "lora" else cfg.alpha) / cfg.r
    for module, p in f.modules.items():
        layer = _file_module(transformer, module, what)
        for name, value in _peft_values(f.kind, p, run_scale, layer).items():
            param = _peft_param(layer, name, adapter_name)
            if param is None or param.shape != value.shape:
                have = f"is {list(param.shape)} in the run's adapter" if param is not None else "has no counterpart"
                raise ConfigError(f"{what}: {module}.{name} {list(value.shape)} {have}: the file is of another "
                                  "model or adapter shape (rank, kind); use one trained with this model and adapter")
            with torch.no_grad():
                param.copy_(value)


def _file_module(transformer, module: str, what: str):
    """The module of ``transformer`` an adapter file adapts; one line when the model has none of that name."""
    try:
        return transformer.get_submodule(module)
    except AttributeError:
        raise ConfigError(f"{what}: {module} is not in the model ({transformer.config.num_layers} blocks): the file "
                          "is an adapter of another model; use one trained on this model (see model=)") from None


def load_adapter_file(transformer, path, adapter_name: str = "default", what: str = "adapter file") -> AdapterFile:
    """Add the adapter of a file :func:`read_any_adapter` reads (LoRA, DoRA, LoKr or LoHa under wanexp's, ComfyUI's,
    kohya's or peft's names) to ``transformer`` as ``adapter_name``, through peft: a config of the file's kind on
    exactly its modules (its rank, or for a LoKr of full factors one at which peft keeps them full; alpha = rank),
    then its weights with the file's scale folded in (:func:`copy_adapter_into`). This loads what diffusers' loaders
    do not: a LoHa, a ComfyUI-named LoKr or DoRA (diffusers drops a ``dora_scale``)."""
    f = read_any_adapter(path, what)
    for module in f.modules:
        _file_module(transformer, module, what)
    rank = f.rank() or max(max(p["lokr_w2"].shape) for p in f.modules.values())
    transformer.add_adapter(peft_config(f.kind, rank, rank, 0.0, sorted(f.modules), f.dora), adapter_name)
    copy_adapter_into(transformer, f, adapter_name, what)
    return f


def _peft_values(kind: str, p: dict, run_scale: float, layer) -> dict[str, torch.Tensor]:
    """One module's ComfyUI-named params -> peft's parameter values under the run's scale."""
    diff, scale = comfy_diff(p, layer.get_base_layer().weight.shape)
    ratio = scale / run_scale
    if kind == "lora":
        out = {"lora_A": p["lora_down.weight"], "lora_B": p["lora_up.weight"] * ratio}
        if "lora_magnitude_vector" in p:
            out["lora_magnitude_vector"] = p["lora_magnitude_vector"]
        elif "dora_scale" in p:  # undo the export: m = dora_scale * |W + diff| / (|W| + eps)
            w = layer.get_base_layer().weight.detach().float()  # on the meta device for the start's fit check
            diff, dora = diff.to(w.device), p["dora_scale"].reshape(-1).to(w.device)
            out["lora_magnitude_vector"] = dora * (w + scale * diff).norm(dim=1) / (w.norm(dim=1) + DORA_EPS)
        return out
    out = {k: v for k, v in p.items() if k not in ("alpha", "dora_scale")}
    first = {"lokr": "lokr_w1" if "lokr_w1" in p else "lokr_w1_a", "loha": "hada_w1_a"}[kind]
    out[first] = out[first] * ratio
    return out


def _peft_param(layer, name: str, adapter_name: str):
    holder = getattr(layer, name, None)
    if holder is None or adapter_name not in holder:
        return None
    value = holder[adapter_name]
    return value.weight if isinstance(value, torch.nn.Module) else value


# ---- reading LoRA files of any trainer ------------------------------------------------------------------------
LORA_FORMATS = ("ComfyUI/original Wan (diffusion_model.blocks.N.self_attn.q.lora_down/lora_up or lora_A/lora_B, "
                "optional .alpha: wanexp, ai-toolkit), kohya/musubi-tuner (lora_unet_blocks_N_self_attn_q.lora_down/"
                "lora_up/.alpha), diffusers/peft (transformer.blocks.N.attn1.to_q.lora_A/lora_B)")
_PREFIXES = ("transformer.", "base_model.model.")  # diffusers' save_lora_weights, peft's save_pretrained
_LORA_KEY = re.compile(r"^(.+)\.lora_(A\.weight|B\.weight|B\.bias)$")
_MODULE = re.compile(r"^blocks\.\d+\.(?:(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|(ffn\.net\.0\.proj|ffn\.net\.2))$")
# One module of every kind wanexp can train, in the order messages list them.
_KIND_MODULES = [f"blocks.0.{a}.{p}" for a in ("attn1", "attn2") for p in ATTN_TARGETS.values()] + [
    f"blocks.0.{f}" for f in FFN_TARGETS.values()]


def read_lora_file(path: str | Path, what: str = "LoRA file") -> tuple[dict[str, torch.Tensor], int, float]:
    """Read a Wan LoRA file of any format in :data:`LORA_FORMATS` -> (peft-named fp32 weights, rank, alpha).
    ``what`` starts every error message (e.g. the config key that named the file)."""
    sd, header = read_safetensors(path, what, "name an existing LoRA .safetensors file",
                                  f"; formats accepted: {LORA_FORMATS}")
    return convert_lora_state_dict(sd, header, what)


def read_safetensors(path, what: str, fix: str, accepted: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, header) of an adapter file; a missing or unreadable file is one ConfigError line starting ``what``
    (``fix``: what to name instead; ``accepted``: appended to the not-safetensors line)."""
    from safetensors import SafetensorError, safe_open

    try:
        sd = load_file(os.fspath(path))
        with safe_open(os.fspath(path), "pt") as f:
            return sd, f.metadata() or {}
    except OSError as e:
        raise ConfigError(f"{what}: cannot read it ({e.strerror or e}); {fix}") from None
    except SafetensorError as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{what}: not a safetensors file ({reason}){accepted}") from None


def convert_lora_state_dict(sd: dict[str, torch.Tensor], header: dict | None = None,
                            what: str = "LoRA file") -> tuple[dict[str, torch.Tensor], int, float]:
    """Any Wan LoRA naming -> (peft-named fp32 weights without prefix, rank, alpha).

    diffusers' ``WanLoraLoaderMixin.lora_state_dict`` renames kohya/musubi and ComfyUI/original (also ai-toolkit's
    lora_A/lora_B) keys and folds each module's ``alpha/rank`` into its A and B. When every module has the same
    ``alpha/rank`` it is handed over as rank (scale 1) instead, so A and B come back as trained and the file's scale
    is returned as alpha; the caller folds it into B once (see :func:`copy_lora_into`)."""
    from diffusers.loaders.lora_pipeline import WanLoraLoaderMixin

    neutral, scale = _neutral_alphas(sd)
    try:
        converted = WanLoraLoaderMixin.lora_state_dict(neutral)
    except (KeyError, ValueError, IndexError, AttributeError) as e:  # the converters index the keys they expect
        raise _unknown_format(sd, what, f"diffusers' Wan converter: {type(e).__name__} {e}") from None
    weights = {}
    for key, w in converted.items():
        body = next((key[len(p):] for p in _PREFIXES if key.startswith(p)), key)
        if body.endswith(".alpha") and scale is not None:
            continue  # diffusers-named keys with an alpha: already in ``scale``
        if not _LORA_KEY.match(body):
            raise _unknown_format(sd, what)
        weights[body] = w.to(torch.float32)
    ranks = {w.shape[0] for k, w in weights.items() if k.endswith(".lora_A.weight")}
    if not ranks:
        raise _unknown_format(sd, what)
    _check_not_transposed({k.removesuffix(".lora_A.weight"): (w, weights.get(k.replace(".lora_A.", ".lora_B.")))
                           for k, w in weights.items() if k.endswith(".lora_A.weight")}, what)
    if len(ranks) > 1:
        raise ConfigError(f"{what}: the file mixes LoRA ranks {sorted(ranks)}; wanexp's adapter has one rank for "
                          "every module (adapter.rank): use a file with one rank")
    rank = ranks.pop()
    if scale is None:
        scale = _header_scale(header or {}, rank, what)
    return weights, rank, scale * rank


def _neutral_alphas(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float | None]:
    """(state dict, alpha/rank): every ``.alpha`` set to its module's rank when all modules share one alpha/rank, so
    the converter leaves A and B alone; otherwise the state dict as it is (the converter folds each module's own
    scale into its A and B) and scale 1. None: the file has no ``.alpha``."""
    alphas = {k[: -len(".alpha")]: v for k, v in sd.items() if k.endswith(".alpha")}
    if not alphas:
        return sd, None
    downs = {k.rsplit(".", 2)[0]: w for k, w in sd.items() if k.endswith((".lora_down.weight", ".lora_A.weight"))}
    if set(downs) != set(alphas):  # modules without alpha have scale 1; let the converter handle the mix
        return sd, 1.0
    scales = {float(alphas[m]) / downs[m].shape[0] for m in alphas}
    if len(scales) != 1:
        return sd, 1.0
    out = dict(sd)
    out.update({f"{m}.alpha": torch.tensor(float(downs[m].shape[0])) for m in alphas})
    return out, scales.pop()


def _check_not_transposed(pairs: dict[str, tuple], what: str) -> None:
    """Refuse a LoRA whose every module has A (down) of shape (out, r) and B (up) of shape (r, in): A and B swapped.
    ``pairs``: module -> (A, B). Read as they are, its ranks would be the modules' output sizes."""
    swapped = {m: (a, b) for m, (a, b) in pairs.items()
               if b is not None and a.ndim == b.ndim == 2 and a.shape[1] == b.shape[0] < a.shape[0]}
    if swapped and len(swapped) == len(pairs):
        module, (a, b) = next(iter(sorted(swapped.items())))
        raise ConfigError(f"{what}: the file looks transposed (lora_A and lora_B swapped: {module} has lora_A "
                          f"{list(a.shape)} and lora_B {list(b.shape)}; lora_A is (rank, in), lora_B (out, rank)); "
                          "swap each module's lora_A/lora_down and lora_B/lora_up back")


def _header_scale(header: dict, rank: int, what: str) -> float:
    """alpha/rank from diffusers' ``lora_adapter_metadata`` header (a peft LoraConfig); 1 without one."""
    if "lora_adapter_metadata" not in header:
        return 1.0
    try:
        meta = json.loads(header["lora_adapter_metadata"])
        return float(meta.get("transformer.lora_alpha", rank)) / float(meta.get("transformer.r", rank))
    except (ValueError, TypeError, ZeroDivisionError, AttributeError) as e:
        raise ConfigError(f"{what}: its lora_adapter_metadata header is unreadable ({e}); remove the header or "
                          "use a file written by diffusers' save_lora_weights") from None


def _unknown_format(sd: dict, what: str, detail: str = "") -> ConfigError:
    keys = sorted(sd)
    seen = ", ".join(keys[:3]) + (f" ... ({len(keys)} keys)" if len(keys) > 3 else "")
    detail = f"; {detail}" if detail else ""
    return ConfigError(f"{what}: not a Wan LoRA format wanexp reads (keys: {seen}{detail}); formats accepted: "
                       f"{LORA_FORMATS}")


def _kind(module: str) -> str | None:
    """``self_attn.q``, ``cross_attn.o``, ``ffn.0`` ... for a module wanexp's LoRA can train; None for any other."""
    m = _MODULE.match(module)
    if m is None:
        return None
    if m.group(1):
        return f"{'self' if m.group(1) == 'attn1' else 'cross'}_attn.{ALIASES[m.group(2)]}"
    return ALIASES[m.group(3)]


def configured_kinds(targets: list[str], attention: list[str]) -> list[str]:
    """The module kinds (see :func:`_kind`) an adapter with these ``targets``/``attention`` trains, in order."""
    rx = re.compile(target_regex(targets, attention))
    return [_kind(m) for m in _KIND_MODULES if rx.fullmatch(m)]


def _setting_for(kinds: set[str]) -> str:
    """The adapter.targets/attention that select ``kinds``, or the closest with a note that none selects them."""
    order = [_kind(m) for m in _KIND_MODULES]
    targets = [t for t in ALLOWED_TARGETS if any(k.split("_attn.")[-1] == t for k in kinds)]
    attention = [a for a in ATTN_KINDS if any(k.startswith(f"{a}_attn.") for k in kinds)]
    setting = f"adapter.targets=[{','.join(targets)}] adapter.attention=[{','.join(attention)}]"
    if [k for k in order if k in kinds] == configured_kinds(targets, attention):
        return f"set {setting}"
    return f"no adapter.targets/attention selects exactly these (the closest: {setting})"


def check_lora_fits(weights: dict[str, torch.Tensor], rank: int, alpha: float, run_rank: int, run_kinds: list[str],
                    what: str) -> None:
    """Refuse (one line) a LoRA whose rank or targets differ from the run's adapter. A file that covers fewer blocks
    is fine: the blocks it lacks start as a new adapter does (B = 0)."""
    if rank != run_rank:
        raise ConfigError(f"{what}: file has rank {rank}, run has rank {run_rank}; set adapter.rank={rank}")
    modules = sorted({_LORA_KEY.match(k).group(1) for k in weights})
    other = [m for m in modules if _kind(m) is None] + [k for k in weights if k.endswith(".lora_B.bias")]
    if other:
        raise ConfigError(f"{what}: the file adapts {len(other)} module(s) or biases wanexp's LoRA does not train "
                          f"(e.g. {other[0]}); wanexp trains {', '.join(ALLOWED_TARGETS)} of the blocks: use a LoRA "
                          "of those modules")
    _check_kinds(modules, run_kinds, what)


def _check_kinds(modules: list[str], run_kinds: list[str], what: str) -> None:
    """Refuse a file whose modules are not the ones the run's targets/attention select."""
    other = [m for m in modules if _kind(m) is None]
    if other:
        raise ConfigError(f"{what}: the file adapts {len(other)} module(s) wanexp's adapter does not train (e.g. "
                          f"{other[0]}); wanexp trains {', '.join(ALLOWED_TARGETS)} of the blocks")
    kinds = {_kind(m) for m in modules}
    if kinds != set(run_kinds):
        order = [_kind(m) for m in _KIND_MODULES]
        only_file = [k for k in order if k in kinds - set(run_kinds)]
        only_run = [k for k in order if k in set(run_kinds) - kinds]
        differs = "; ".join(part for part in (
            f"only the file adapts {', '.join(only_file)}" if only_file else "",
            f"only the run adapts {', '.join(only_run)}" if only_run else "") if part)
        raise ConfigError(f"{what}: the file's targets differ from the run's adapter ({differs}); "
                          f"{_setting_for(kinds)}")


def copy_lora_into(transformer, weights: dict[str, torch.Tensor], rank: int, alpha: float,
                   adapter_name: str = "default", what: str = "LoRA file") -> None:
    """Copy checked LoRA weights (see :func:`read_lora_file`) into an existing adapter of the same rank and targets.
    The file's ``alpha/rank`` is folded into B, so the update ``scale * B @ A`` is the file's under the run's alpha."""
    from peft.utils import set_peft_model_state_dict

    tag = f".{adapter_name}."
    own = {k.replace(tag, "."): v.shape for k, v in transformer.state_dict().items() if ".lora_" in k and tag in k}
    for key, w in weights.items():
        if key not in own or w.shape != own[key]:
            model = (f"is {list(own[key])} in the model" if key in own
                     else f"is not in the model ({transformer.config.num_layers} blocks)")
            raise ConfigError(f"{what}: {key} {list(w.shape)} {model}: the file is a LoRA of another model; use one "
                              "trained on this model (see model=)")
    cfg = transformer.peft_config[adapter_name]
    factor = (alpha / rank) / (cfg.lora_alpha / cfg.r)
    if factor != 1.0:
        weights = {k: (v * factor if ".lora_B." in k else v) for k, v in weights.items()}
    set_peft_model_state_dict(transformer, weights, adapter_name=adapter_name)


# ---- merging: any adapter file as ComfyUI-named modules; two LoRAs as one ----------------------------------------
def read_any_adapter(path, what: str) -> AdapterFile:
    """A LoKr/LoHa/DoRA file (:func:`read_adapter_file`) or a LoRA of any format in :data:`LORA_FORMATS`, as
    ComfyUI-named modules (a LoRA's scale is its ``alpha`` key)."""
    if is_typed_adapter_file(path):
        return read_adapter_file(path, what)
    weights, rank, alpha = read_lora_file(path, what)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, w in weights.items():
        m = _LORA_KEY.match(key)
        if m.group(2) == "B.bias":
            raise ConfigError(f"{what}: the file adapts biases ({key}); wanexp merges weight LoRAs only")
        name = "lora_down.weight" if m.group(2) == "A.weight" else "lora_up.weight"
        modules.setdefault(m.group(1), {})[name] = w
    for p in modules.values():
        p["alpha"] = torch.tensor(float(alpha))
    return AdapterFile(modules, what)


def concat_loras(files: list[AdapterFile], weights: list[float]) -> dict[str, torch.Tensor]:
    """Several LoRAs of the same modules (of any ranks) as one ComfyUI-named LoRA of rank sum(ranks):
    A = [A_1; A_2; ...] (rows), B = [w_1 s_1 B_1, w_2 s_2 B_2, ...] (columns), alpha = its rank (scale 1), so B @ A
    is sum_i w_i s_i B_i @ A_i exactly (s_i: file i's alpha/rank). Averaging the A's and B's instead would need one
    rank and add the cross terms B_1 A_2 + B_2 A_1."""
    first = files[0]
    for f in files:
        if f.kind != "lora" or f.dora:
            raise ConfigError(f"{f.what}: a {f.label} adapter; combining is exact for LoRA files only (a sum of "
                              "Kronecker/Hadamard products or DoRA norms is not one adapter of that kind)")
        if set(f.modules) != set(first.modules):
            only = sorted(set(f.modules) ^ set(first.modules))
            raise ConfigError(f"{f.what}: its layout differs from {first.what} (modules {only[0]} ... ({len(only)} "
                              "differ)); combine LoRAs of the same targets")
    out = {}
    for module in sorted(first.modules):
        downs, ups = [], []
        for f, w in zip(files, weights):
            p = f.modules[module]
            scale = _comfy_scale(p, p["lora_down.weight"].shape[0])
            downs.append(p["lora_down.weight"])
            ups.append(p["lora_up.weight"] * (w * scale))
        key = "diffusion_model." + diffusers_to_original_module(module)
        out[f"{key}.lora_down.weight"] = torch.cat(downs).contiguous()
        out[f"{key}.lora_up.weight"] = torch.cat(ups, dim=1).contiguous()
        out[f"{key}.alpha"] = torch.tensor(float(sum(d.shape[0] for d in downs)))
    return out


def save_adapter_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file atomically, readable as the umask allows (as the exports are)."""
    _atomic_save(tensors, Path(path), metadata)


# ---- the adapter's size per kind (the disk estimate, the memory fit estimate) ---------------------------------------
@dataclass
class AdapterSize:
    """One adapter on one transformer: its parameters, tensors, adapted linears and the alphas its ComfyUI file
    holds (one per linear, but none for a LoKr of two full factors, whose scale is folded into a factor)."""

    parameters: int = 0
    tensors: int = 0
    modules: int = 0
    alphas: int = 0


def adapter_tensor_shapes(kind: str, rank: int, use_dora: bool, in_features: int, out_features: int) -> list[tuple]:
    """The tensors peft gives one adapted linear (its layers' ``update_layer``, default configs as wanexp.lora sets
    them): LoRA A (rank, in) and B (out, rank), DoRA also a magnitude (out,); LoHa two such pairs; LoKr a full factor
    of the smaller halves of peft's factorizations of out and in, and a second one of the larger halves, split at
    the rank unless the rank reaches half its larger side."""
    if kind == "loha":
        return [(out_features, rank), (rank, in_features)] * 2
    if kind == "lokr":
        from peft.tuners.lokr.layer import factorization

        in_m, in_n = factorization(in_features, -1)
        out_l, out_k = factorization(out_features, -1)
        second = [(out_k, in_n)] if rank >= max(out_k, in_n) / 2 else [(out_k, rank), (rank, in_n)]
        return [(out_l, in_m), *second]
    return [(rank, in_features), (out_features, rank)] + ([(out_features,)] if use_dora else [])


def adapter_size(transformer, adapter) -> AdapterSize:
    """The adapter on ``transformer``: the tensors of each targeted linear (peft's matching), by kind."""
    from torch import nn

    pattern = re.compile(target_regex(adapter.targets, adapter.attention))
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
