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
        self._init = None
        if init_from:  # read and checked here too: a file that cannot fit fails before any weight loads
            what = f"adapter.init_from={init_from}"
            self._init = read_lora_file(init_from, what)
            check_lora_fits(*self._init, self.rank, configured_kinds(self.targets, self.attention), what)

    def apply(self, transformer, adapter_name: str = "default") -> list[str]:
        """Add the adapter (fp32, trainable) to a frozen transformer, from ``init_from`` if set; its parameter names."""
        names = add_lora(transformer, self.rank, self.alpha, self.dropout, self.targets, self.attention, adapter_name)
        if self._init is not None:
            copy_lora_into(transformer, *self._init, adapter_name, what=f"adapter.init_from={self.init_from}")
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
    from safetensors import SafetensorError, safe_open

    try:
        sd = load_file(os.fspath(path))
        with safe_open(os.fspath(path), "pt") as f:
            header = f.metadata() or {}
    except OSError as e:
        raise ConfigError(f"{what}: cannot read it ({e.strerror or e}); name an existing LoRA .safetensors file"
                          ) from None
    except SafetensorError as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{what}: not a safetensors file ({reason}); formats accepted: {LORA_FORMATS}") from None
    return convert_lora_state_dict(sd, header, what)


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
