"""Wan2.2 components given one by one (``model.path`` as a DiT file, ``model.transformer_path``,
``model.transformer_2_path``, ``model.vae_path``, ``model.text_encoder_path``, ``model.tokenizer_path``), each a
single weight file loaded directly (no conversion, nothing written) or the component's diffusers folder.

The single files are what ComfyUI users have (Comfy-Org's repackaged Wan2.2 files) and the Wan-AI component files.
What a file holds is read from its tensor names and shapes (the safetensors header; nothing loads):

* DiT (``wan2.2_ti2v_5B_fp16.safetensors``, ``wan2.2_{t2v,i2v}_{high,low}_noise_14B_{fp16,fp8_scaled}.safetensors``):
  the original Wan names (``blocks.N.self_attn.q.weight`` ...), bare or under ``model.diffusion_model.``
  (``diffusion_model.``), renamed by diffusers' ``convert_wan_transformer_to_diffusers``; its config is the original
  WanModel config read off the shapes (heads of 128 channels, as in every released Wan DiT; a tiny model's
  ``model.build`` may name another ``attention_head_dim``), turned into diffusers' by
  ``wanexp.models.wan22.original.transformer_config``. Its channels name the layout (TI2V-5B 48 -> 48, T2V-A14B
  16 -> 16, I2V-A14B 36 -> 16), which must be the model group's.
* VAE (``wan2.2_vae.safetensors`` for TI2V-5B, ``wan_2.1_vae.safetensors`` for A14B, or the Wan-AI ``.pth``): the
  original Wan VAE names, renamed and configured by wanexp.models.wan22.original (latent statistics: the Wan
  constants).
* UMT5-XXL (``umt5_xxl_fp16.safetensors``, ``umt5_xxl_fp8_e4m3fn_scaled.safetensors``): transformers'
  UMT5EncoderModel names, as ComfyUI stores them; or the Wan-AI ``models_t5_umt5-xxl-enc-bf16.pth`` (the original
  names, renamed by ``original.t5_key_map``). No tokenizer comes with it: ``model.tokenizer_path`` names a tokenizer
  folder (else the model.path folder's ``tokenizer/``).

Quantized files: every float8 tensor (e4m3fn, e5m2) is dequantized in fp32 -- times its layer's scale where the file
has one: ComfyUI's "scaled fp8" (a ``scaled_fp8`` marker and a per-tensor ``<layer>.scale_weight``; its newer form
``<layer>.weight_scale``, the layers listed in the header's ``_quantization_metadata`` or in ``<layer>.comfy_quant``)
-- and then cast to the component's dtype exactly as ``from_pretrained`` casts a folder's weights (the modules the
class keeps in fp32 stay fp32). The model holds the file's values in ``model.dtype``; ``model.fp8`` /
``model.fp8_storage`` then quantize the block linears again, per row, as they do any base. Activation scales
(``scale_input``, ``input_scale``) and an embedded ``spiece_model`` are not weights and are skipped; other
quantizations (int8, nvfp4, block-wise scales, GGUF) are refused in one line.
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from wanexp.errors import ConfigError
from wanexp.models.family import safetensors_problem, weight_files
from wanexp.models.wan22.layouts import LAYOUTS

KEYS = {"transformer": "model.transformer_path", "transformer_2": "model.transformer_2_path",
        "vae": "model.vae_path", "text_encoder": "model.text_encoder_path", "tokenizer": "model.tokenizer_path"}
DIT_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
FLOAT8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
FLOATS = ("F16", "BF16", "F32", "F64", *FLOAT8)
QUANT_FORMATS = ("float8_e4m3fn", "float8_e5m2")  # ComfyUI's per-layer formats wanexp dequantizes
WEIGHT_SCALES = (".scale_weight", ".weight_scale")  # ComfyUI's scaled fp8: the old name, the new one
NOT_WEIGHTS = (".scale_input", ".input_scale", ".comfy_quant")
MARKERS = ("scaled_fp8", "spiece_model")
TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
TORCH_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
                torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
HEAD_DIM = 128  # channels per attention head of every released Wan DiT (not stored in the weights)

# what a file holds, from its names: (kind, marker names); the first kind whose markers are all present
KINDS = (
    ("dit", ("patch_embedding.weight", "head.modulation")),
    ("dit_diffusers", ("patch_embedding.weight", "scale_shift_table")),
    ("vae", ("decoder.middle.0.residual.0.gamma",)),
    ("vae_diffusers", ("decoder.mid_block.resnets.0.norm1.gamma",)),
    ("text_encoder", ("encoder.block.0.layer.0.SelfAttention.q.weight",)),
    ("text_encoder", ("token_embedding.weight", "blocks.0.attn.q.weight")),
)
WHAT = {"dit": "a Wan DiT (transformer)", "dit_diffusers": "a Wan DiT in diffusers' names",
        "vae": "a Wan VAE", "vae_diffusers": "a Wan VAE in diffusers' names", "text_encoder": "a T5/UMT5 text encoder",
        "lora": "a LoRA", None: "none of the Wan2.2 components"}
WHERE = {"dit": "it belongs in model.transformer_path (or model.path)", "vae": "it belongs in model.vae_path",
         "text_encoder": "it belongs in model.text_encoder_path", "lora": "pass it as adapter.init_from",
         "dit_diffusers": "point the path at its diffusers folder (with config.json)",
         "vae_diffusers": "point the path at its diffusers folder (with config.json)"}
# the files Comfy-Org/Wan_2.2_ComfyUI_Repackaged names, for the lines that ask for one
COMFY_DIT = {"ti2v": "wan2.2_ti2v_5B_fp16.safetensors", "t2v_a14b": "wan2.2_t2v_{}_noise_14B_fp16.safetensors",
             "i2v_a14b": "wan2.2_i2v_{}_noise_14B_fp16.safetensors"}
COMFY_UMT5 = "umt5_xxl_fp16.safetensors or umt5_xxl_fp8_e4m3fn_scaled.safetensors"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "spiece.model")


def comfy_vae(layout: str) -> str:
    return "wan2.2_vae.safetensors" if LAYOUTS[layout].vae_layout.get("is_residual") else "wan_2.1_vae.safetensors"


# ---- one weight file ---------------------------------------------------------------------------------------------
class WeightFile:
    """One weight file: its weights' names (a DiT prefix taken off), shapes and stored dtypes, read from the
    safetensors header (a torch file: memory-mapped), and where each weight's scale is; :meth:`tensor` reads one
    weight as a float tensor (dequantized)."""

    def __init__(self, path, key: str):
        self.path, self.key = Path(path), key
        self._open = None  # the safetensors handle or the torch state dict while reading()
        entries, metadata, quant = self._read_header()
        self.prefix = next((p for p in DIT_PREFIXES if any(k.startswith(p) for k in entries)
                            and all(k.startswith(p) or k in MARKERS for k in entries)), "")
        entries = {k.removeprefix(self.prefix): v for k, v in entries.items()}
        self.check_quantization(metadata, quant)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for name, (dtype, shape) in entries.items():
            if name in MARKERS or name.endswith(NOT_WEIGHTS + WEIGHT_SCALES):
                continue
            if dtype not in FLOATS:
                raise self.error(f"tensor {name} is stored as {dtype}, a quantization wanexp does not read; use the "
                                 "fp16, bf16 or fp8 version of the file")
            self.shapes[name], self.dtypes[name] = shape, dtype
        self.scales: dict[str, str] = {}  # weight name -> its scale's name (prefix off)
        for name, (_, shape) in entries.items():
            suffix = next((s for s in WEIGHT_SCALES if name.endswith(s)), None)
            if suffix is None:
                continue
            weight = name[:-len(suffix)] + ".weight"
            if weight not in self.shapes:
                raise self.error(f"scale {name} has no weight {weight} (a damaged file; download it again)")
            rows, n = self.shapes[weight][0], math.prod(shape)
            if n != 1 and (n != rows or shape[0] != rows):
                raise self.error(f"{name} has shape {list(shape)}: block-wise fp8 scales are not read; use the "
                                 "fp16, bf16 or per-tensor fp8_scaled file")
            self.scales[weight] = name

    def error(self, what: str) -> ConfigError:
        return ConfigError(f"{self.key}={self.path}: {what}")

    # -- the header --
    def _read_header(self) -> tuple[dict, dict, dict]:
        """{name: (dtype label, shape)}, the header metadata, {layer: format} of per-layer ``comfy_quant`` tensors."""
        suffix = self.path.suffix.lower()
        if suffix == ".gguf":
            raise self.error("a GGUF file; wanexp reads .safetensors weights (fp16, bf16, fp8 or fp8_scaled)")
        if suffix in TORCH_SUFFIXES:
            sd = self._torch_file()
            return {k: (TORCH_DTYPES.get(v.dtype, str(v.dtype)), tuple(v.shape)) for k, v in sd.items()}, {}, {}
        problem = safetensors_problem(self.path)
        if problem:
            raise self.error(f"not a readable safetensors file: {problem}")
        from safetensors import safe_open

        entries, quant = {}, {}
        with safe_open(str(self.path), "pt") as f:
            metadata = f.metadata() or {}
            for k in f.keys():
                part = f.get_slice(k)
                entries[k] = (part.get_dtype(), tuple(part.get_shape()))
                if k.endswith(".comfy_quant"):
                    quant[k[:-len(".comfy_quant")]] = _quant_format(f.get_tensor(k))
        return entries, metadata, quant

    def _torch_file(self) -> dict:
        from wanexp.models.wan22.original import _load_pth

        try:
            return _load_pth(self.path)
        except ConfigError as e:
            raise self.error(str(e).removeprefix(f"{self.path}: ")) from None

    def check_quantization(self, metadata: dict, quant: dict) -> None:
        """One line for a layer quantized in a format other than float8 (ComfyUI's ``_quantization_metadata``, its
        per-layer ``comfy_quant``)."""
        layers = dict(quant)
        if "_quantization_metadata" in metadata:
            try:
                layers.update({k: _format_name(v) for k, v in
                               json.loads(metadata["_quantization_metadata"]).get("layers", {}).items()})
            except (ValueError, AttributeError):
                raise self.error("its _quantization_metadata is not readable JSON (a damaged file)") from None
        for layer, fmt in layers.items():
            if fmt not in QUANT_FORMATS:
                raise self.error(f"layer {layer} is quantized as {fmt}; wanexp reads fp16, bf16 and fp8 (scaled or "
                                 "not) files: use one of those")

    # -- what it holds --
    @property
    def kind(self) -> str | None:
        names = self.shapes
        if any(".lora_down." in n or ".lora_A." in n or n.startswith("lora_") for n in names):
            return "lora"
        return next((kind for kind, marks in KINDS if all(m in names for m in marks)), None)

    def expect(self, wanted: str) -> None:
        """One line unless the file holds ``wanted`` ("dit", "vae", "text_encoder") in the names read here."""
        kind = self.kind
        if kind == wanted:
            return
        if kind is not None and kind.startswith(wanted):  # the component in diffusers' names
            raise self.error(f"holds {WHAT[kind]}, which loads from its folder: {WHERE[kind]}")
        where = f"; {WHERE[kind]}" if kind in WHERE else f" (e.g. {', '.join(sorted(self.shapes)[:2])})"
        raise self.error(f"holds {WHAT[kind]}, not {WHAT[wanted]}{where}")

    @property
    def numel(self) -> int:
        """Elements of the weights (their scales and markers left out)."""
        return sum(math.prod(s) for s in self.shapes.values())

    # -- the tensors --
    @contextmanager
    def reading(self):
        """The file open for :meth:`tensor` (a torch file memory-mapped)."""
        if self.path.suffix.lower() in TORCH_SUFFIXES:
            self._open = self._torch_file()
            try:
                yield self
            finally:
                self._open = None
            return
        from safetensors import safe_open

        with safe_open(str(self.path), "pt") as f:
            self._open = f
            try:
                yield self
            finally:
                self._open = None

    def _get(self, name: str) -> torch.Tensor:
        key = self.prefix + name  # (only the markers may lack the prefix, and they are never read)
        return self._open[key] if isinstance(self._open, dict) else self._open.get_tensor(key)

    def tensor(self, name: str) -> torch.Tensor:
        """Weight ``name`` as stored (fp16/bf16/fp32), or dequantized to fp32: a float8 tensor, times its scale
        (one per tensor or one per row) when it has one. Inside :meth:`reading`."""
        t = self._get(name)
        scale = self.scales.get(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or scale is not None:
            t = t.float()
            if scale is not None:
                s = self._get(scale).float()
                t = t * (s.reshape(()) if s.numel() == 1 else s.reshape(-1, *[1] * (t.dim() - 1)))
        return t


def _quant_format(tensor: torch.Tensor) -> str:
    try:
        return _format_name(json.loads(bytes(tensor.tolist()).decode("utf-8")))
    except (ValueError, TypeError):
        return "unreadable"


def _format_name(conf) -> str:
    return str(conf.get("format") if isinstance(conf, dict) else conf)


# ---- the components ----------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """A component file, the config of the model it holds and each parameter's weight in it (model name -> the
    file's name, prefix off): what the checks found, and what loading reads."""

    file: WeightFile
    config: object  # a diffusers config dict, or a transformers UMT5Config
    names: dict[str, str]


def _check_names(wf: WeightFile, model, names: dict[str, str]) -> None:
    """One line unless the file's weights are exactly ``model``'s parameters (a meta-built model), shape for shape."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(expected.keys() - names.keys())
    unexpected = sorted(names[k] for k in names.keys() - expected.keys())
    if missing or unexpected:
        raise wf.error(f"does not match the {type(model).__name__} its shapes describe (missing {len(missing)}, "
                       f"e.g. {missing[:2]}; unexpected {len(unexpected)}, e.g. {unexpected[:2]}): an incomplete "
                       "file, or another model's")
    for k, shape in expected.items():
        if wf.shapes[names[k]] != shape:
            raise wf.error(f"tensor {names[k]} has shape {list(wf.shapes[names[k]])} where {type(model).__name__} "
                           f"needs {list(shape)} (an incomplete file, or another model's)")


def transformer_plan(path, key: str, layout: str, model: str, head_dim: int = HEAD_DIM) -> Plan:
    """The DiT file at ``path``: its diffusers WanTransformer3DModel config and names, checked against the model
    group's ``layout`` (one line naming the right ``model=`` for another layout's file)."""
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from wanexp.models.wan22.original import transformer_config

    wf = WeightFile(path, key)
    wf.expect("dit")
    names = wf.shapes
    if any(n.startswith("img_emb.") for n in names):
        raise wf.error("has img_emb.* (Wan2.1's CLIP image input): a Wan2.1 image-to-video DiT, not a Wan2.2 one")
    need = ("patch_embedding.weight", "head.head.weight", "blocks.0.ffn.0.weight", "text_embedding.0.weight",
            "time_embedding.0.weight")
    missing = [n for n in need if n not in names]
    if missing:
        raise wf.error(f"no {missing[0]}: an incomplete DiT file (download it again)")
    dim, in_dim, *patch = names["patch_embedding.weight"]
    out_dim = names["head.head.weight"][0] // math.prod(patch)
    layers = len({n.split(".")[1] for n in names if n.startswith("blocks.")})
    found = next((lay for lay in LAYOUTS.values() if (lay.in_channels, lay.latent_channels) == (in_dim, out_dim)),
                 None)
    if found is None:
        have = ", ".join(f"{lay.model} {lay.in_channels} -> {lay.latent_channels}" for lay in LAYOUTS.values())
        raise wf.error(f"a DiT of {in_dim} -> {out_dim} channels, which no Wan2.2 model has ({have})")
    if found.name != layout:
        raise wf.error(f"the DiT of a {found.model} model ({in_dim} -> {out_dim} channels, {layers} blocks of width "
                       f"{dim}), not of model={model}; run with model={found.model}")
    if dim % head_dim:
        raise wf.error(f"width {dim} is not a multiple of the {head_dim}-channel attention heads")
    orig = {"dim": dim, "num_heads": dim // head_dim, "in_dim": in_dim, "out_dim": out_dim,
            "ffn_dim": names["blocks.0.ffn.0.weight"][0], "num_layers": layers,
            "freq_dim": names["time_embedding.0.weight"][1], "text_dim": names["text_embedding.0.weight"][1],
            "patch_size": patch, "qk_norm": "blocks.0.self_attn.norm_q.weight" in names,
            "cross_attn_norm": "blocks.0.norm3.weight" in names, "eps": 1e-6}
    config = transformer_config(orig, {}, wf.path)
    renamed = convert_wan_transformer_to_diffusers({n: n for n in names})  # diffusers name -> the file's
    with torch.device("meta"):
        _check_names(wf, WanTransformer3DModel.from_config(config), renamed)
    return Plan(wf, config, renamed)


def vae_plan(path, key: str, layout: str, model: str) -> Plan:
    """The VAE file at ``path``: its diffusers AutoencoderKLWan config and names; the model group's VAE (Wan2.2's
    for TI2V-5B, Wan2.1's for A14B)."""
    from diffusers import AutoencoderKLWan

    from wanexp.models.wan22.original import vae_config, vae_key_map

    wf = WeightFile(path, key)
    wf.expect("vae")
    residual = bool(LAYOUTS[layout].vae_layout.get("is_residual", False))
    nested = any(n.startswith("encoder.downsamples.0.downsamples.") for n in wf.shapes)
    if nested != residual:
        raise wf.error(f"the {'Wan2.2' if nested else 'Wan2.1'} VAE, but model={model} uses the "
                       f"{'Wan2.2' if residual else 'Wan2.1'} VAE: set {key} to it (ComfyUI: {comfy_vae(layout)})")
    missing = [n for n in ("encoder.conv1.weight", "decoder.head.2.weight", "conv2.weight") if n not in wf.shapes]
    if missing:
        raise wf.error(f"no {missing[0]}: an incomplete VAE file (download it again)")
    meta = {n: torch.empty(s, device="meta") for n, s in wf.shapes.items()}
    try:
        config = vae_config(meta, layout)
        names = {new: old for old, new in vae_key_map(meta, residual).items()}
    except ConfigError as e:
        raise wf.error(str(e)) from None
    with torch.device("meta"):
        _check_names(wf, AutoencoderKLWan.from_config(config), names)
    return Plan(wf, config, names)


def text_encoder_plan(path, key: str) -> Plan:
    """The UMT5 encoder file at ``path`` (ComfyUI's transformers names, or the Wan-AI original names): its
    transformers UMT5Config and names."""
    from transformers import UMT5EncoderModel

    from wanexp.models.wan22.original import t5_key_map, umt5_config

    wf = WeightFile(path, key)
    wf.expect("text_encoder")
    if "token_embedding.weight" in wf.shapes:  # the original Wan T5Encoder names
        try:
            names = {new: old for old, news in t5_key_map(wf.shapes).items() for new in news}
        except ConfigError as e:
            raise wf.error(str(e)) from None
    else:
        names = {n: n for n in wf.shapes}
    for a, b in (("shared.weight", "encoder.embed_tokens.weight"), ("encoder.embed_tokens.weight", "shared.weight")):
        if a in names and b not in names:  # one embedding feeds the encoder (tied)
            names[b] = names[a]
    block = "encoder.block.{}.layer.{}"
    need = ["shared.weight", f"{block.format(0, 0)}.SelfAttention.relative_attention_bias.weight",
            f"{block.format(0, 0)}.SelfAttention.q.weight", f"{block.format(0, 1)}.DenseReluDense.wi_0.weight"]
    missing = [n for n in need if n not in names]
    if missing:
        raise wf.error(f"no {missing[0]}: not a complete UMT5 encoder file (use {COMFY_UMT5})")
    shape = {new: wf.shapes[old] for new, old in names.items()}
    layers = len({n.split(".")[2] for n in names if n.startswith("encoder.block.")})
    if layers > 1 and f"{block.format(1, 0)}.SelfAttention.relative_attention_bias.weight" not in names:
        raise wf.error("a T5 encoder (a relative position bias in block 0 only, like the t5xxl of Flux or SD3), not "
                       f"Wan's UMT5-XXL: use {COMFY_UMT5}")
    vocab, d_model = shape["shared.weight"]
    buckets, heads = shape[need[1]]
    config = umt5_config(vocab, d_model, buckets, heads, shape[need[2]][0], shape[need[3]][0], layers)
    with torch.device("meta"):
        _check_names(wf, UMT5EncoderModel(config), names)
    return Plan(wf, config, names)


def load_transformer(plan: Plan, dtype: torch.dtype):
    """The DiT of ``plan`` with its weights in ``dtype`` (its fp32 modules in fp32, as ``from_pretrained`` leaves
    them)."""
    from diffusers import WanTransformer3DModel

    return _assign(WanTransformer3DModel, plan, dtype)


def load_vae(plan: Plan, dtype: torch.dtype):
    from diffusers import AutoencoderKLWan

    return _assign(AutoencoderKLWan, plan, dtype)


def _assign(cls, plan: Plan, dtype: torch.dtype):
    """``cls`` built without weights (its buffers real), each parameter assigned from the file in the dtype
    ``from_pretrained(dtype=...)`` gives it (wanexp.models.sharded.cast)."""
    from accelerate import init_empty_weights

    from wanexp.models.sharded import cast

    with init_empty_weights(include_buffers=False):
        model = cls.from_config(plan.config)
    cast(model, dtype, getattr(cls, "_keep_in_fp32_modules", None) or [])
    want = {n: p.dtype for n, p in model.named_parameters()}
    with plan.file.reading() as f:
        sd = {name: f.tensor(old).to(want[name]) for name, old in plan.names.items()}
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval()


def load_text_encoder(plan: Plan, dtype: torch.dtype):
    """The UMT5 encoder of ``plan`` loaded by transformers' ``from_pretrained`` from its state dict (so the dtypes are
    those of a folder's load, ``wo`` kept in fp32 under fp16). Dequantized tensors are handed over in ``dtype``
    (fp32 under fp16), stored ones as stored."""
    from transformers import UMT5EncoderModel

    hand = torch.float32 if dtype == torch.float16 else dtype
    sd, read = {}, {}
    with plan.file.reading() as f:
        for name, old in plan.names.items():
            if old not in read:
                t = f.tensor(old)
                read[old] = t.to(hand) if f.dtypes[old] in FLOAT8 or old in f.scales else t
            sd[name] = read[old]
    return UMT5EncoderModel.from_pretrained(None, config=plan.config, state_dict=sd, dtype=dtype)


# ---- the run's sources ---------------------------------------------------------------------------------------------
def source_key(spec, component: str) -> str:
    """The config key that names ``component``'s source (messages)."""
    if spec.component_paths.get(f"{component}_path") is None and spec.path is not None:
        return "model.path"
    return KEYS[component]


def head_dim(spec) -> int:
    """Channels per attention head of the DiT files: 128 (Wan's), or a tiny model's ``model.build`` value."""
    return int(((spec.build or {}).get("transformer") or {}).get("attention_head_dim", HEAD_DIM))


def plan(spec, component: str) -> Plan:
    """The checked plan of a component given as a file (inspected once per spec)."""
    plans = spec.__dict__.setdefault("_single_file_plans", {})
    if component not in plans:
        src, key = spec.source(component), source_key(spec, component)
        if component in ("transformer", "transformer_2"):
            plans[component] = transformer_plan(src, key, spec.layout, spec.name, head_dim(spec))
        elif component == "vae":
            plans[component] = vae_plan(src, key, spec.layout, spec.name)
        else:
            plans[component] = text_encoder_plan(src, key)
    return plans[component]


def not_set(spec, component: str) -> ConfigError:
    """The one line for a component the run needs that no path gives (model.path is null or a DiT file)."""
    p = spec.path
    why = "model.path=null" if p is None else f"model.path={p} is a single DiT file"
    dit = COMFY_DIT[spec.layout]
    if component == "transformer":
        wants = f"the {'high-noise expert' if 'high' in spec.experts else 'DiT'}'s file (ComfyUI: {dit.format('high')})"
    elif component == "transformer_2":
        why = "the run needs the low-noise expert (to train it, or for the validation samples of boundary=high)"
        wants = f"the low-noise expert's file (ComfyUI: {dit.format('low')})"
    elif component == "vae":
        wants = f"the VAE file (ComfyUI: {comfy_vae(spec.layout)})"
    elif component == "text_encoder":
        wants = f"the UMT5 file (ComfyUI: {COMFY_UMT5})"
    else:
        why = "UMT5 single files carry no tokenizer"
        wants = ("a tokenizer folder (the tokenizer/ of a Wan2.2 diffusers download, or google/umt5-xxl/ of the "
                 "Wan-AI one)")
    return ConfigError(f"{KEYS[component]} is not set and {why}: set it to {wants}")


def check(spec, experts: list[str]) -> None:
    """Every component the run loads (``experts``' transformers and the encoders), found and checked from the files'
    headers and the folders' configs (nothing loads): one line naming the first problem and its key."""
    p = spec.path
    if p is not None and p.is_file() and spec.component_paths["transformer_path"] is not None:
        raise ConfigError(f"model.path={p} and model.transformer_path={spec.component_paths['transformer_path']} both name "
                          "the transformer's file: keep one (model.path may then be a diffusers folder for the rest)")
    components = list(dict.fromkeys(spec.expert_folders[e] for e in experts)) + ["vae", "text_encoder", "tokenizer"]
    _check_expert_names(spec, components)
    for component in components:
        src = spec.source(component)
        if src is None:
            raise not_set(spec, component)
        if component == "tokenizer":
            _check_tokenizer(spec, src)
        elif src.is_file():
            plan(spec, component)
        else:
            _check_folder(spec, component, src)
    _check_text_width(spec)


def _check_folder(spec, component: str, src: Path) -> None:
    """A component from a folder: a diffusers/transformers folder with its config.json and readable weights."""
    key = source_key(spec, component)
    if not (src / "config.json").is_file():
        if key == "model.path":
            advice = spec.not_diffusers_hint(spec.path)
            if advice:
                raise ConfigError(f"model.path={spec.path}: {advice}")
            raise ConfigError(f"model.path={spec.path}: component '{component}/' is missing or has no config.json; "
                              f"set {KEYS[component]} to its file, or point model.path at a diffusers-format folder")
        raise ConfigError(f"{key}={src}: not found as a file, and a folder without config.json; point it at the "
                          "component's weight file or its diffusers folder")
    if component in ("transformer", "transformer_2"):
        cfg = json.loads((src / "config.json").read_text())
        if cfg.get("in_channels") != spec.in_channels:
            raise ConfigError(f"{key}={spec.path if key == 'model.path' else src}: {component} has in_channels="
                              f"{cfg.get('in_channels')} but model={spec.name} expects {spec.in_channels}; pick the "
                              "model group that matches it")
    for f in weight_files(src):
        problem = safetensors_problem(f) if f.suffix == ".safetensors" else None
        if problem:
            raise ConfigError(f"{key}={spec.path if key == 'model.path' else src}: cannot read {component}/{f.name} "
                              f"({problem}); a weight file there is corrupt or incomplete: download it again")


def _check_tokenizer(spec, src: Path) -> None:
    key = source_key(spec, "tokenizer")
    if not any((src / f).is_file() for f in TOKENIZER_FILES):
        where = f"model.path={spec.path}: component 'tokenizer/' is missing" if key == "model.path" else \
            f"{key}={src}: not a tokenizer folder"
        raise ConfigError(f"{where} (no {', '.join(TOKENIZER_FILES)}); set model.tokenizer_path to a tokenizer folder "
                          "(the tokenizer/ of a Wan2.2 diffusers download, or google/umt5-xxl/ of the Wan-AI one)")


def _check_expert_names(spec, components: list[str]) -> None:
    """An A14B expert file whose name says it is the other expert (ComfyUI's ``high_noise`` / ``low_noise``)."""
    if spec.experts == ["dense"]:
        return
    for component, mine, other in (("transformer", "high", "low"), ("transformer_2", "low", "high")):
        src = spec.source(component) if component in components else None
        if src is not None and src.is_file() and f"{other}_noise" in src.name.lower():
            raise ConfigError(f"{source_key(spec, component)}={src}: its name says the {other}-noise expert, but this "
                              f"key gives the {mine}-noise one (model.transformer_path: high, "
                              "model.transformer_2_path: low); swap the files")


def _check_text_width(spec) -> None:
    """The DiT reads text embeddings as wide as the text encoder writes them."""
    dit = next((spec.source(c) for c in ("transformer", "transformer_2") if spec.source(c) is not None), None)
    te = spec.source("text_encoder")
    if dit is None or te is None:
        return
    text_dim = plan(spec, _dit_component(spec, dit)).config["text_dim"] if dit.is_file() else \
        json.loads((dit / "config.json").read_text()).get("text_dim")
    d_model = plan(spec, "text_encoder").config.d_model if te.is_file() else \
        json.loads((te / "config.json").read_text()).get("d_model")
    if text_dim is not None and d_model is not None and int(text_dim) != int(d_model):
        raise ConfigError(f"{source_key(spec, 'text_encoder')}={te}: a text encoder of width {d_model}, but the DiT "
                          f"({dit}) reads {text_dim}-wide text: use the UMT5-XXL encoder of this model")


def _dit_component(spec, src: Path) -> str:
    return "transformer" if spec.source("transformer") == src else "transformer_2"
