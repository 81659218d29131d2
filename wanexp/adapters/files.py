"""Reading adapter files of any trainer and putting them into a run's adapter: ONE path for every kind and naming.

:func:`read_adapter` reads a LoRA, DoRA, LoKr or LoHa file under wanexp's, ComfyUI's/the original release's, kohya's
or diffusers'/peft's names (the family's ``AdapterNaming`` says what its modules are called) into an
:class:`AdapterFile`; :func:`check_fits` refuses, in one line and before any weight loads, a file of another kind,
rank or targets than the run's adapter; :func:`copy_into` copies it into the run's adapter under the run's alpha;
:func:`load_adapter_file` adds a file's adapter to a transformer that has none (sampling).
"""
from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import load_file

from wanexp.adapters import peft_compat
from wanexp.adapters.keys import _PARAM_NAMES, peft_config
from wanexp.adapters.merge import _COMFY_KIND, DORA_EPS, KIND_NAMES, _comfy_scale, comfy_diff, comfy_module_params
from wanexp.adapters.naming import COMFY_PREFIX
from wanexp.errors import ConfigError

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


def read_adapter_file(path, what: str, naming, sd: dict | None = None) -> AdapterFile:
    """Read a wanexp (or ComfyUI-named) LoRA/DoRA/LoKr/LoHa file, or a diffusers/peft one with its
    ``lora_adapter_metadata`` header; one line on anything else."""
    header = {}
    if sd is None:
        sd, header = read_safetensors(path, what, "name an existing adapter .safetensors file", "")
    prefix = re.escape(COMFY_PREFIX)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    peft_named = False
    for key, w in sd.items():
        key = naming.kohya_to_comfy(key)
        m = re.match(rf"^{prefix}(.+?)\.(alpha|dora_scale|lora_(?:up|down)\.weight|lora_[AB]\.weight|"
                     r"lokr_\w+|hada_\w+)$", key)
        try:
            if m:
                module, param = naming.from_original(m.group(1)), m.group(2)
            else:
                m = re.match(rf"^(?:transformer\.|base_model\.model\.)?(.+?)\.((?:{_PARAM_NAMES})(?:\.weight)?)$", key)
                if not m:
                    raise ValueError(key)
                module, param, peft_named = m.group(1), _PEFT_TO_COMFY.get(m.group(2), m.group(2)), True
                if not naming.module_re.match(module):
                    raise ValueError(key)
        except ValueError:
            raise _unknown_format(sd, what, naming) from None
        modules.setdefault(module, {})[param] = w.to(torch.float32)
    if not modules:
        raise _unknown_format(sd, what, naming)
    if peft_named:
        modules = _peft_scale_to_comfy(modules, header, what)
    return AdapterFile(modules, what)


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


def check_fits(f: AdapterFile, adapter, what: str) -> None:
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
    _check_kinds(sorted(f.modules), adapter.naming.configured_kinds(adapter.targets, adapter.attention), what,
                 adapter.naming)


def copy_into(transformer, f: AdapterFile, adapter_name: str = "default", what: str = "adapter file") -> None:
    """Copy a checked :class:`AdapterFile` into the run's adapter of the same kind: every module then makes the
    file's weight under the run's alpha (the file's scale is folded into one factor; DoRA's magnitude is derived
    from the base weight)."""
    cfg = transformer.peft_config[adapter_name]
    run_scale = (cfg.lora_alpha if f.kind == "lora" else cfg.alpha) / cfg.r
    for module, p in f.modules.items():
        layer = _file_module(transformer, module, what)
        for name, value in _peft_values(f.kind, p, run_scale, layer).items():
            param = peft_compat.adapter_param(layer, name, adapter_name)
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
        blocks = getattr(transformer.config, "num_layers", None)
        size = f" ({blocks} blocks)" if blocks is not None else ""
        raise ConfigError(f"{what}: {module} is not in the model{size}: the file is an adapter of another model; use "
                          "one trained on this model (see model=)") from None


def load_adapter_file(transformer, path, naming, adapter_name: str = "default", what: str = "adapter file") -> AdapterFile:
    """Add the adapter of a file :func:`read_adapter` reads (LoRA, DoRA, LoKr or LoHa under wanexp's, ComfyUI's,
    kohya's or peft's names) to ``transformer`` as ``adapter_name``, through peft: a config of the file's kind on
    exactly its modules (its rank, or for a LoKr of full factors one at which peft keeps them full; alpha = rank),
    then its weights with the file's scale folded in (:func:`copy_into`). This loads what diffusers' loaders
    do not: a LoHa, a ComfyUI-named LoKr or DoRA (diffusers drops a ``dora_scale``)."""
    f = read_adapter(path, what, naming)
    for module in f.modules:
        _file_module(transformer, module, what)
    rank = f.rank() or max(max(p["lokr_w2"].shape) for p in f.modules.values())
    transformer.add_adapter(peft_config(f.kind, rank, rank, 0.0, sorted(f.modules), f.dora), adapter_name)
    copy_into(transformer, f, adapter_name, what)
    return f


def _peft_values(kind: str, p: dict, run_scale: float, layer) -> dict[str, torch.Tensor]:
    """One module's ComfyUI-named params -> peft's parameter values under the run's scale."""
    if kind == "lora" and "dora_scale" not in p:  # the scale alone: no weight difference is built
        scale = _comfy_scale(p, p["lora_down.weight"].shape[0])
    else:
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


_PREFIXES = ("transformer.", "base_model.model.")  # diffusers' save_lora_weights, peft's save_pretrained


_LORA_KEY = re.compile(r"^(.+)\.lora_(A\.weight|B\.weight|B\.bias)$")


def read_lora_file(path, what: str, naming) -> tuple[dict[str, torch.Tensor], int, float]:
    """Read a LoRA file of any format the family's naming accepts (``naming.formats``) -> (peft-named fp32
    weights, rank, alpha). ``what`` starts every error message (e.g. the config key that named the file)."""
    sd, header = read_safetensors(path, what, "name an existing LoRA .safetensors file",
                                  f"; formats accepted: {naming.formats}")
    return convert_lora_state_dict(sd, naming, header, what)


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


def convert_lora_state_dict(sd: dict[str, torch.Tensor], naming, header: dict | None = None,
                            what: str = "LoRA file") -> tuple[dict[str, torch.Tensor], int, float]:
    """Any LoRA naming of the family -> (peft-named fp32 weights without prefix, rank, alpha).

    The family's converter (``naming.convert_lora``: diffusers' for its models) renames kohya/musubi and
    ComfyUI/original (also ai-toolkit's lora_A/lora_B) keys and folds each module's ``alpha/rank`` into its A and B;
    without one, the names the naming knows are read as they are. When every module has the same ``alpha/rank`` it
    is handed over as rank (scale 1) instead, so A and B come back as trained and the file's scale is returned as
    alpha; the caller folds it into B once (see :func:`copy_into`)."""
    neutral, scale = _neutral_alphas(sd)
    try:
        converted = naming.convert_lora(neutral) if naming.convert_lora else _renamed(neutral, naming)
    except (KeyError, ValueError, IndexError, AttributeError) as e:  # the converters index the keys they expect
        raise _unknown_format(sd, what, naming, f"the family's LoRA converter: {type(e).__name__} {e}") from None
    weights = {}
    for key, w in converted.items():
        body = next((key[len(p):] for p in _PREFIXES if key.startswith(p)), key)
        if body.endswith(".alpha") and scale is not None:
            continue  # diffusers-named keys with an alpha: already in ``scale``
        if not _LORA_KEY.match(body):
            raise _unknown_format(sd, what, naming)
        weights[body] = w.to(torch.float32)
    ranks = {w.shape[0] for k, w in weights.items() if k.endswith(".lora_A.weight")}
    if not ranks:
        raise _unknown_format(sd, what, naming)
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


def _unknown_format(sd: dict, what: str, naming, detail: str = "") -> ConfigError:
    keys = sorted(sd)
    seen = ", ".join(keys[:3]) + (f" ... ({len(keys)} keys)" if len(keys) > 3 else "")
    detail = f"; {detail}" if detail else ""
    return ConfigError(f"{what}: not a LoRA format wanexp reads for this model (keys: {seen}{detail}); formats "
                       f"accepted: {naming.formats}")


def _check_kinds(modules: list[str], run_kinds: list[str], what: str, naming) -> None:
    """Refuse a file whose modules are not the ones the run's targets/attention select."""
    other = [m for m in modules if naming.kind(m) is None]
    if other:
        raise ConfigError(f"{what}: the file adapts {len(other)} module(s) wanexp's adapter does not train (e.g. "
                          f"{other[0]}); wanexp trains {', '.join(naming.allowed)} of the blocks")
    kinds = {naming.kind(m) for m in modules}
    if kinds != set(run_kinds):
        order = [naming.kind(m) for m in naming.probe_modules]
        only_file = [k for k in order if k in kinds - set(run_kinds)]
        only_run = [k for k in order if k in set(run_kinds) - kinds]
        differs = "; ".join(part for part in (
            f"only the file adapts {', '.join(only_file)}" if only_file else "",
            f"only the run adapts {', '.join(only_run)}" if only_run else "") if part)
        raise ConfigError(f"{what}: the file's targets differ from the run's adapter ({differs}); "
                          f"{naming.setting_for(kinds)}")


def read_adapter(path, what: str, naming) -> AdapterFile:
    """An adapter file of any kind and naming the family's ``naming`` accepts, as ComfyUI-named modules (a LoRA's
    scale is its ``alpha`` key): a LoKr/LoHa/DoRA file through :func:`read_adapter_file`, a LoRA through the
    family's LoRA converter (:func:`read_lora_file`); :func:`check_fits` and :func:`copy_into` take either."""
    if is_typed_adapter_file(path):
        return read_adapter_file(path, what, naming)
    weights, rank, alpha = read_lora_file(path, what, naming)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, w in weights.items():
        m = _LORA_KEY.match(key)
        if m.group(2) == "B.bias":
            raise ConfigError(f"{what}: the file adapts biases ({key}); wanexp's adapters train the weights of "
                              "linears only: use a LoRA without biases")
        name = "lora_down.weight" if m.group(2) == "A.weight" else "lora_up.weight"
        modules.setdefault(m.group(1), {})[name] = w
    for p in modules.values():
        p["alpha"] = torch.tensor(float(alpha))
    return AdapterFile(modules, what)


def _renamed(sd: dict[str, torch.Tensor], naming) -> dict[str, torch.Tensor]:
    """A LoRA's keys in peft's names, for a family without a LoRA converter: ComfyUI/original and kohya names (the
    naming's: ``lora_down``/``lora_up`` or ``lora_A``/``lora_B``, each module's ``alpha/rank`` folded into its B)
    and peft's (kept as they are)."""
    out, alphas = {}, {}
    original = re.compile(rf"^{re.escape(COMFY_PREFIX)}(.+)\.(alpha|lora_(?:down|up|A|B)\.weight)$")
    for key, w in sd.items():
        m = original.match(naming.kohya_to_comfy(key))
        if m is None:
            out[key] = w
            continue
        module, param = naming.from_original(m.group(1)), m.group(2)
        if param == "alpha":
            alphas[module] = float(w)
        else:
            out[f"{module}.{'lora_A' if param in ('lora_down.weight', 'lora_A.weight') else 'lora_B'}.weight"] = w
    for module, alpha in alphas.items():
        rank = out[f"{module}.lora_A.weight"].shape[0]
        out[f"{module}.lora_B.weight"] = out[f"{module}.lora_B.weight"] * (alpha / rank)
    return out
