"""Convert the ORIGINAL Wan-AI release layout of Wan2.2 into a diffusers-format folder, once.

The original layout (what DiffSynth-Studio and the Wan2.2 repo download)::

    TI2V-5B                                      T2V-A14B / I2V-A14B
      config.json                                  high_noise_model/{config.json, diffusion_pytorch_model*.safetensors}
      diffusion_pytorch_model*.safetensors         low_noise_model/{config.json, diffusion_pytorch_model*.safetensors}
      Wan2.2_VAE.pth                               Wan2.1_VAE.pth
      models_t5_umt5-xxl-enc-bf16.pth              models_t5_umt5-xxl-enc-bf16.pth
      google/umt5-xxl/   (tokenizer)               google/umt5-xxl/

Wan2.2-VACE-Fun-A14B (alibaba-pai) ships the A14B layout too, as VideoX-Fun writes it: each expert's config.json adds
``vace_layers`` and ``vace_in_dim`` and its weights the control blocks (``vace_blocks.N.*``, ``before_proj``,
``after_proj``, ``vace_patch_embedding``); it converts to diffusers' ``WanVACETransformer3DModel`` experts.

wanexp loads only diffusers-format folders (see ``ModelSpec.check_folder``); :func:`convert_original` writes one, with
``transformer/`` = high-noise expert and ``transformer_2/`` = low-noise expert for A14B.

Where the names come from:
  * transformer: diffusers' own ``convert_wan_transformer_to_diffusers`` (diffusers.loaders.single_file_utils; it
    maps the control blocks' ``before_proj``/``after_proj`` to ``proj_in``/``proj_out``).
  * VAE: written here for both VAEs and any ``num_res_blocks`` (diffusers' packaged ``convert_wan_vae_to_diffusers``
    covers only the Wan2.1 VAE and hard-codes ``num_res_blocks=2``; the Wan2.2 rules exist only in diffusers'
    ``scripts/convert_wan_to_diffusers.py``, which is not installed). Names follow wan/modules/vae2_1.py and
    vae2_2.py; tests/unit/test_original_layout.py checks the Wan2.1 part against diffusers' converter.
  * text encoder: written here from wan/modules/t5.py (T5Encoder) to transformers' UMT5EncoderModel.
  * latent statistics (not stored in the .pth files): the constants the original Wan2_1_VAE / Wan2_2_VAE classes
    hard-code (identical to diffusers' AutoencoderKLWan defaults for Wan2.1 and to ``vae22_diffusers_config`` of
    diffusers' conversion script for Wan2.2), unless an existing diffusers VAE config is given.

Every ``.pth`` is read with ``torch.load(weights_only=True)``; tensors are copied bit for bit (no dtype change).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from wanexp.errors import ConfigError
from wanexp.models.wan22.layouts import LAYOUTS, MODELS

T5_FILE = "models_t5_umt5-xxl-enc-bf16.pth"
TOKENIZER_DIR = "google/umt5-xxl"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
EXPERT_DIRS = {"transformer": "high_noise_model", "transformer_2": "low_noise_model"}  # A14B only

# CLI --model name (the names of conf/model/*.yaml) -> layout, and back: from the one table (layouts.py).
CLI_MODELS = {model: lay.name for model, lay in MODELS.items()}
MODEL_OF_LAYOUT = {lay.name: lay.model for lay in LAYOUTS.values()}

# Per-channel latent statistics hard-coded by the original code (wan/modules/vae2_1.py Wan2_1_VAE,
# vae2_2.py Wan2_2_VAE).
WAN21_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]
WAN22_LATENTS_MEAN = [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
                      -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
                      -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
                      -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
                      -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
                      0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]
WAN22_LATENTS_STD = [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
                     0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
                     0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                     0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
                     0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
                     0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]
LATENT_STATS = {16: (WAN21_LATENTS_MEAN, WAN21_LATENTS_STD), 48: (WAN22_LATENTS_MEAN, WAN22_LATENTS_STD)}


# ---- detection -------------------------------------------------------------------------------------------------------
def is_original_layout(path) -> bool:
    """True for a folder in the original Wan-AI release layout (and not already diffusers-format)."""
    p = Path(path)
    if not p.is_dir() or (p / "model_index.json").is_file():
        return False
    if any((p / f).is_file() for f in (T5_FILE, "Wan2.1_VAE.pth", "Wan2.2_VAE.pth")):
        return True
    if (p / EXPERT_DIRS["transformer"] / "config.json").is_file():
        return True
    return _is_wan_config(p / "config.json") and any(p.glob("diffusion_pytorch_model*.safetensors"))


def detect_layout(path) -> str | None:
    """The layout of an original-layout folder ("ti2v", "t2v_a14b", "i2v_a14b", "vace_a14b"), or None when it cannot
    tell. VACE experts are told by their config's ``vace_layers`` (their model_type is T2V's)."""
    p = Path(path)
    cfg_path = p / EXPERT_DIRS["transformer"] / "config.json"
    if not cfg_path.is_file():
        cfg_path = p / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    control = "vace_layers" in cfg
    for layout, lay in LAYOUTS.items():
        if lay.control != control:
            continue
        if control:
            return layout
        if cfg.get("model_type") == lay.model_type or (
                "model_type" not in cfg and cfg.get("in_dim") == lay.in_channels):
            return layout
    return None


def convert_command(src, layout: str, dst=None) -> str:
    """The exact command that converts ``src`` (printed by WanSpec.not_diffusers_hint)."""
    src = Path(src)
    dst = Path(dst) if dst is not None else src.with_name(src.name + "-diffusers")
    model = MODEL_OF_LAYOUT.get(layout, "|".join(CLI_MODELS))
    return f"python -m wanexp.cli.convert --src {src} --dst {dst} --model {model}"


def _is_wan_config(path: Path) -> bool:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and (cfg.get("_class_name") == "WanModel" or {"dim", "num_heads"} <= cfg.keys())


# ---- conversion ------------------------------------------------------------------------------------------------------
def convert_original(src, dst, layout: str, vae_config=None, max_shard_size: str = "5GB") -> list[str]:
    """Write a complete diffusers-format folder at ``dst`` from the original-layout folder ``src``.

    ``layout`` is "ti2v", "t2v_a14b" or "i2v_a14b". ``vae_config`` (optional): an existing diffusers VAE config.json
    (or a folder holding one) whose ``latents_mean``/``latents_std`` replace the built-in constants. The folder is
    written next to ``dst`` under a temporary name and renamed when complete. Returns one line per written component.
    """
    if layout not in LAYOUTS:
        raise ConfigError(f"layout={layout!r}: unknown; allowed: {', '.join(LAYOUTS)} "
                          f"(CLI --model {' | '.join(CLI_MODELS)})")
    src, dst = Path(src), Path(dst)
    lay = LAYOUTS[layout]
    _check_source(src, layout)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConfigError(f"--dst {dst}: already exists; remove it or choose another destination folder")
    latents = _latent_stats_override(vae_config)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        lines = _convert_into(src, tmp, lay, latents, max_shard_size)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary model folder
        if dst.is_dir():  # an empty folder: replace it
            dst.rmdir()
        os.rename(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return lines


def _convert_into(src: Path, out: Path, lay, latents, max_shard_size: str) -> list[str]:
    import diffusers

    from wanexp.models.wan22.pipeline import flow_scheduler

    lines = []
    comps = {}
    te = convert_text_encoder(src / T5_FILE)
    te.save_pretrained(out / "text_encoder", max_shard_size=max_shard_size)
    comps["text_encoder"] = te.to("meta")  # frees the weights; the pipeline below only records the class
    lines.append(f"text_encoder/  <- {src / T5_FILE}")

    tok = convert_tokenizer(src / TOKENIZER_DIR, out / "tokenizer")
    comps["tokenizer"] = tok
    lines.append(f"tokenizer/     <- {src / TOKENIZER_DIR}")

    layout = lay.name
    if lay.experts == ("dense",):
        experts = {"transformer": src}
    else:
        experts = {sub: src / name for sub, name in EXPERT_DIRS.items()}
    for sub, folder in experts.items():
        model = convert_transformer(folder, layout)
        model.save_pretrained(out / sub, max_shard_size=max_shard_size)
        comps[sub] = model.to("meta")
        lines.append(f"{sub + '/':<15}<- {folder}")

    vae = convert_vae(src / lay.vae_file, layout, latents)
    vae.save_pretrained(out / "vae", max_shard_size=max_shard_size)
    comps["vae"] = vae.to("meta")
    lines.append(f"vae/           <- {src / lay.vae_file}")

    shift, boundary = lay.shift, lay.boundary_ratio
    comps["scheduler"] = flow_scheduler(shift)
    comps["scheduler"].save_pretrained(out / "scheduler")
    lines.append(f"scheduler/     UniPCMultistepScheduler(flow_shift={shift})")

    kwargs = dict(comps, **lay.pipeline_extras)
    if boundary is not None:
        kwargs["boundary_ratio"] = boundary
    pipe = getattr(diffusers, lay.pipeline_class)(**kwargs)
    pipe.save_config(out)  # model_index.json, exactly as DiffusionPipeline.save_pretrained writes it
    lines.append(f"model_index.json  {lay.pipeline_class}"
                 + (f"(boundary_ratio={boundary})" if boundary is not None else "")
                 + "".join(f"({k}={v})" for k, v in lay.pipeline_extras.items()))
    return lines


def _check_source(src: Path, layout: str) -> None:
    """One ConfigError line for the first missing piece, or for a folder of another layout."""
    model = MODEL_OF_LAYOUT[layout]
    if not src.is_dir():
        raise ConfigError(f"--src {src}: folder not found; point it at the original Wan-AI Wan2.2 download")
    if (src / "model_index.json").is_file():
        raise ConfigError(f"--src {src}: has model_index.json, so it is already diffusers-format; "
                          "set model.path to it directly, no conversion needed")
    found = detect_layout(src)
    if found is not None and found != layout:
        raise ConfigError(f"--src {src}: this is an original {MODEL_OF_LAYOUT[found]} folder, not {model}; "
                          f"run with --model {MODEL_OF_LAYOUT[found]}")
    a14b = LAYOUTS[layout].experts != ("dense",)
    if a14b and not (src / EXPERT_DIRS["transformer"]).is_dir() and (src / "config.json").is_file():
        raise ConfigError(f"--src {src}: no high_noise_model/ (a single dense model, i.e. TI2V-5B); "
                          "run with --model ti2v5b")
    if not a14b and (src / EXPERT_DIRS["transformer"]).is_dir():
        raise ConfigError(f"--src {src}: has high_noise_model/ (an A14B model); run with --model t2v14b or i2v14b")
    for folder in ([src / d for d in EXPERT_DIRS.values()] if a14b else [src]):
        if not (folder / "config.json").is_file():
            raise ConfigError(f"--src {src}: missing {folder / 'config.json'}; the original {model} download "
                              "has one per model folder (re-download it)")
        _weight_files(folder)
    vae_file = LAYOUTS[layout].vae_file
    other = {"Wan2.1_VAE.pth": "Wan2.2_VAE.pth", "Wan2.2_VAE.pth": "Wan2.1_VAE.pth"}[vae_file]
    if not (src / vae_file).is_file():
        extra = f" (found {other}, which belongs to another model: check --model)" if (src / other).is_file() else ""
        raise ConfigError(f"--src {src}: missing {src / vae_file}; the original {model} download ships "
                          f"it{extra}")
    if not (src / T5_FILE).is_file():
        raise ConfigError(f"--src {src}: missing {src / T5_FILE} (the UMT5-XXL text encoder); copy it from the "
                          f"original Wan2.2 download into {src}")
    tok = src / TOKENIZER_DIR
    if not any((tok / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json", "spiece.model")):
        raise ConfigError(f"--src {src}: missing tokenizer folder {tok} (tokenizer_config.json / spiece.model); "
                          "copy google/umt5-xxl/ from the original Wan2.2 download")


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of one original DiT folder (single file, or shards listed by the index)."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError):
            raise ConfigError(f"{index}: not a safetensors index (no weight_map); re-download it") from None
        for n in names:
            if not (folder / n).is_file():
                raise ConfigError(f"{folder / n}: shard listed in {index.name} is missing; re-download it")
        return [folder / n for n in names]
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    shards = sorted(folder.glob("diffusion_pytorch_model*.safetensors"))
    if not shards:
        raise ConfigError(f"{folder}: no diffusion_pytorch_model*.safetensors; the original DiT weights are missing")
    return shards


def _load_pth(path: Path) -> dict:
    """A plain tensor state dict from a .pth file, read with weights_only=True (memory-mapped when possible)."""
    import pickle

    import torch

    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            sd = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) files cannot be mmapped
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError) as e:
        text = str(e).strip()
        if "Weights only load failed" in text:
            reason = "it is not a torch file or holds objects other than tensors"
        else:
            reason = (text.splitlines()[0] if text else type(e).__name__)[:160]
        raise ConfigError(f"{path}: cannot be read with torch.load(weights_only=True): {reason}; "
                          "use the original Wan-AI file (re-download it)") from None
    if not isinstance(sd, dict) or not sd or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ConfigError(f"{path}: not a plain state dict of tensors; expected the original Wan-AI file")
    return sd


def _load_into(model_cls_name: str, model, sd: dict, path) -> None:
    """Assign ``sd`` to a meta-device ``model`` (strict), turning a key mismatch into one ConfigError line."""
    missing, unexpected = _key_mismatch(model, sd)
    if missing or unexpected:
        raise ConfigError(
            f"{path}: does not match the {model_cls_name} layout derived from it "
            f"(missing {len(missing)} e.g. {missing[:2]}, unexpected {len(unexpected)} e.g. {unexpected[:2]}); "
            "is this the right file for --model?")
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        msg = " ".join(str(e).split())
        raise ConfigError(f"{path}: tensor shapes do not match {model_cls_name} ({msg[:200]})") from None


def _key_mismatch(model, sd: dict) -> tuple[list[str], list[str]]:
    expected = set(model.state_dict().keys())
    return sorted(expected - sd.keys()), sorted(sd.keys() - expected)


# ---- transformer -----------------------------------------------------------------------------------------------------
def _require_keys(orig, path) -> None:
    need = ("dim", "num_heads", "ffn_dim", "num_layers", "in_dim", "out_dim")
    missing = [k for k in need if not isinstance(orig, dict) or k not in orig]
    if missing:
        raise ConfigError(f"{path}: original Wan config.json lacks {', '.join(missing)}; re-download it")


def transformer_config(orig: dict, sd: dict, path, control: bool = False) -> dict:
    """diffusers WanTransformer3DModel config from an original WanModel config.json (+ tensor shapes); ``control``:
    a WanVACETransformer3DModel's, with the control blocks' layers and input channels."""
    _require_keys(orig, path)
    dim, heads = int(orig["dim"]), int(orig["num_heads"])
    text = sd.get("text_embedding.0.weight")
    extra = {}
    if control:
        # null in a VideoX-Fun config means its defaults: every second block, and the control's own input channels
        # (the control patch embedding's, read off the weights)
        layers, channels = orig.get("vace_layers"), orig.get("vace_in_dim")
        if layers is None:
            layers = list(range(0, int(orig["num_layers"]), 2))
        patch = sd.get("vace_patch_embedding.weight")
        if channels is None and patch is not None:
            channels = int(patch.shape[1])
        if not isinstance(layers, list) or not layers or not isinstance(channels, int):
            raise ConfigError(f"{path}: a VACE config.json needs vace_layers (a list of block indexes) and vace_in_dim "
                              f"(got {layers!r}, {channels!r}); re-download it")
        extra = {"vace_layers": [int(i) for i in layers], "vace_in_channels": channels}
    return {**extra,
        "patch_size": list(orig.get("patch_size", (1, 2, 2))),
        "num_attention_heads": heads,
        "attention_head_dim": dim // heads,
        "in_channels": int(orig["in_dim"]),
        "out_channels": int(orig["out_dim"]),
        # text_dim is not saved in the original config.json (WanModel.ignore_for_config): read it off the weights
        "text_dim": int(text.shape[1]) if text is not None else int(orig.get("text_dim", 4096)),
        "freq_dim": int(orig.get("freq_dim", 256)),
        "ffn_dim": int(orig["ffn_dim"]),
        "num_layers": int(orig["num_layers"]),
        "cross_attn_norm": bool(orig.get("cross_attn_norm", True)),
        "qk_norm": "rms_norm_across_heads" if orig.get("qk_norm", True) else None,
        "eps": float(orig.get("eps", 1e-6)),
        "image_dim": None,
        "added_kv_proj_dim": None,
        "rope_max_seq_len": 1024,
        "pos_embed_seq_len": None,
    }


def load_transformer_state_dict(folder: Path) -> dict:
    from safetensors.torch import load_file

    sd = {}
    for f in _weight_files(folder):
        sd.update(load_file(f))
    return sd


def convert_transformer(folder, layout: str):
    """The original DiT in ``folder`` as a diffusers WanTransformer3DModel (a VACE layout's:
    WanVACETransformer3DModel), weights assigned, not copied."""
    import diffusers
    import torch
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    folder = Path(folder)
    cfg_path = folder / "config.json"
    try:
        orig = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cfg_path}: not a readable JSON file ({type(e).__name__}); re-download it") from None
    _require_keys(orig, cfg_path)
    lay = LAYOUTS[layout]
    model = MODEL_OF_LAYOUT[layout]
    mt = orig.get("model_type")
    if ("vace_layers" in orig) != lay.control:
        other = "vace14b" if "vace_layers" in orig else "t2v14b"
        raise ConfigError(f"{cfg_path}: {'has' if 'vace_layers' in orig else 'lacks'} vace_layers, so this is "
                          f"{'a VACE' if 'vace_layers' in orig else 'not a VACE'} expert; run with --model {other}")
    accepted = {lay.model_type, "t2v"} if lay.control else {lay.model_type}  # VideoX-Fun writes "t2v" for VACE
    if mt is not None and mt not in accepted:
        raise ConfigError(f"{cfg_path}: model_type={mt!r}, but --model {model} needs {lay.model_type!r}; "
                          "pick the --model that matches this download")
    if orig.get("in_dim") != lay.in_channels or orig.get("out_dim") != lay.latent_channels:
        raise ConfigError(f"{cfg_path}: in_dim={orig.get('in_dim')}, out_dim={orig.get('out_dim')}, but --model "
                          f"{model} needs {lay.in_channels} -> {lay.latent_channels}; "
                          "pick the matching --model")
    sd = load_transformer_state_dict(folder)
    config = transformer_config(orig, sd, cfg_path, control=lay.control)
    sd = convert_wan_transformer_to_diffusers(sd)
    name = "WanVACETransformer3DModel" if lay.control else "WanTransformer3DModel"
    with torch.device("meta"):
        dit = getattr(diffusers, name)(**config)
    _load_into(name, dit, sd, folder)
    return dit


# ---- VAE -------------------------------------------------------------------------------------------------------------
_RES = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight", "residual.2.bias": "conv1.bias",
        "residual.3.gamma": "norm2.gamma", "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
        "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
_ATTN = ("norm.gamma", "to_qkv.weight", "to_qkv.bias", "proj.weight", "proj.bias")
_HEAD = {"head.0.gamma": "norm_out.gamma", "head.2.weight": "conv_out.weight", "head.2.bias": "conv_out.bias"}
_RESAMPLE = ("resample.", "time_conv.")


def _is_resample(leaf: str) -> bool:
    return leaf.startswith(_RESAMPLE)


def _flat_stages(sd: dict, prefix: str) -> dict[int, tuple[int, object]]:
    """Wan2.1 VAE flat ``{prefix}{j}.*`` list -> {j: (stage, resnet index | "resample")}: a Resample ends a stage."""
    idx = sorted({int(k[len(prefix):].split(".", 1)[0]) for k in sd if k.startswith(prefix)})
    resample = {j for j in idx if any(k.startswith(f"{prefix}{j}.") and _is_resample(k[len(f'{prefix}{j}.'):])
                                      for k in sd)}
    out, stage, r = {}, 0, 0
    for j in idx:
        if j in resample:
            out[j] = (stage, "resample")
            stage, r = stage + 1, 0
        else:
            out[j] = (stage, r)
            r += 1
    return out


def vae_key_map(sd: dict, residual: bool) -> dict[str, str]:
    """original Wan VAE key -> diffusers AutoencoderKLWan key, for the Wan2.2 (``residual``) or Wan2.1 VAE."""
    dec_stages = None if residual else _flat_stages(sd, "decoder.upsamples.")
    out = {}
    for key in sd:
        new = _vae_key(key, residual, dec_stages)
        if new is None:
            raise ConfigError(f"VAE key {key!r} is not part of the Wan{'2.2' if residual else '2.1'} VAE layout; "
                              "is this the right VAE file for --model?")
        out[key] = new
    return out


def _vae_key(key: str, residual: bool, dec_stages) -> str | None:
    top = {"conv1.weight": "quant_conv.weight", "conv1.bias": "quant_conv.bias",
           "conv2.weight": "post_quant_conv.weight", "conv2.bias": "post_quant_conv.bias"}
    if key in top:
        return top[key]
    part, _, rest = key.partition(".")
    if part not in ("encoder", "decoder"):
        return None
    if rest.startswith("conv1."):
        return f"{part}.conv_in.{rest[len('conv1.'):]}"
    if rest in _HEAD:
        return f"{part}.{_HEAD[rest]}"
    bits = rest.split(".")
    if bits[0] == "middle":
        i, leaf = bits[1], ".".join(bits[2:])
        if i in ("0", "2") and leaf in _RES:
            return f"{part}.mid_block.resnets.{int(i) // 2}.{_RES[leaf]}"
        if i == "1" and leaf in _ATTN:
            return f"{part}.mid_block.attentions.0.{leaf}"
        return None
    stack = {"encoder": "downsamples", "decoder": "upsamples"}[part]
    if bits[0] != stack:
        return None
    new_stack = {"encoder": "down_blocks", "decoder": "up_blocks"}[part]
    if residual:  # Wan2.2: {stack}.{stage}.{stack}.{j}.<leaf>
        if len(bits) < 5 or bits[2] != stack:
            return None
        i, j, leaf = bits[1], bits[3], ".".join(bits[4:])
        if leaf in _RES:
            return f"{part}.{new_stack}.{i}.resnets.{j}.{_RES[leaf]}"
        if _is_resample(leaf):
            return f"{part}.{new_stack}.{i}.{'downsampler' if part == 'encoder' else 'upsampler'}.{leaf}"
        return None
    # Wan2.1: one flat list {stack}.{j}.<leaf>; the encoder keeps it flat, the decoder groups it into up_blocks
    j, leaf = bits[1], ".".join(bits[2:])
    if part == "encoder":
        if leaf in _RES:
            return f"encoder.down_blocks.{j}.{_RES[leaf]}"
        return f"encoder.down_blocks.{j}.{leaf}" if _is_resample(leaf) else None
    stage, r = dec_stages[int(j)]
    if r == "resample":
        return f"decoder.up_blocks.{stage}.upsamplers.0.{leaf}" if _is_resample(leaf) else None
    return f"decoder.up_blocks.{stage}.resnets.{r}.{_RES[leaf]}" if leaf in _RES else None


def convert_vae_state_dict(sd: dict, residual: bool) -> dict:
    """Rename an original Wan VAE state dict to diffusers' AutoencoderKLWan names (tensors untouched)."""
    return {new: sd[old] for old, new in vae_key_map(sd, residual).items()}


def vae_config(sd: dict, layout: str, latents=None) -> dict:
    """diffusers AutoencoderKLWan config read off an original Wan VAE state dict (+ the layout's VAE constants)."""
    lay = LAYOUTS[layout]
    residual = bool(lay.vae_layout.get("is_residual", False))
    nested = any(k.startswith("encoder.downsamples.0.downsamples.") for k in sd)
    name = LAYOUTS[layout].vae_file
    if nested != residual:
        raise ConfigError(f"{name}: has the {'Wan2.2' if nested else 'Wan2.1'} VAE layout, but --model "
                          f"{MODEL_OF_LAYOUT[layout]} uses the {'Wan2.2' if residual else 'Wan2.1'} VAE; "
                          "check the file and --model")
    try:
        base = sd["encoder.conv1.weight"].shape
        head = sd["decoder.head.2.weight"].shape
        z_dim = int(sd["conv2.weight"].shape[0])
    except KeyError as e:
        raise ConfigError(f"{name}: no {e.args[0]!r}; not an original Wan VAE state dict") from None
    base_dim, in_ch, out_ch, dec_dim = int(base[0]), int(base[1]), int(head[0]), int(head[1])
    if residual:
        stages = sorted({int(k.split(".")[2]) for k in sd if k.startswith("encoder.downsamples.")})
        first = {int(k.split(".")[4]) for k in sd if k.startswith("encoder.downsamples.0.downsamples.")
                 and k.split(".", 5)[5].startswith("residual.")}
        num_res = len(first)
        stage_out = [sd[f"encoder.downsamples.{i}.downsamples.0.residual.2.weight"].shape[0] for i in stages]
        temporal = [any(k.startswith(f"encoder.downsamples.{i}.downsamples.{num_res}.time_conv.") for k in sd)
                    for i in stages[:-1]]
    else:
        enc = _flat_stages(sd, "encoder.downsamples.")
        n_stages = max(s for s, _ in enc.values()) + 1
        num_res = sum(1 for s, r in enc.values() if s == 0 and r != "resample")
        firsts = sorted(j for j, (s, r) in enc.items() if r == 0)
        stage_out = [sd[f"encoder.downsamples.{j}.residual.2.weight"].shape[0] for j in firsts][:n_stages]
        temporal = [any(k.startswith(f"encoder.downsamples.{j}.time_conv.") for k in sd)
                    for j, (s, r) in sorted(enc.items()) if r == "resample"]
    if latents is None:
        if z_dim not in LATENT_STATS:
            raise ConfigError(f"{name}: z_dim={z_dim} has no known latent statistics; pass --vae-config with a "
                              "diffusers VAE config.json that has latents_mean/latents_std")
        latents = LATENT_STATS[z_dim]
    mean, std = (list(map(float, x)) for x in latents)
    if len(mean) != z_dim or len(std) != z_dim:
        raise ConfigError(f"--vae-config: latents_mean/latents_std have {len(mean)}/{len(std)} values but {name} has "
                          f"z_dim={z_dim}; use the config of the matching VAE")
    return {
        "base_dim": base_dim,
        "decoder_base_dim": dec_dim if (residual or dec_dim != base_dim) else None,
        "z_dim": z_dim,
        "dim_mult": [int(c) // base_dim for c in stage_out],
        "num_res_blocks": num_res,
        "attn_scales": [],
        "temperal_downsample": temporal,
        "dropout": 0.0,
        "latents_mean": mean,
        "latents_std": std,
        "is_residual": residual,
        "in_channels": in_ch,
        "out_channels": out_ch,
        "patch_size": lay.vae_layout.get("patch_size"),
        "scale_factor_temporal": 4,
        "scale_factor_spatial": lay.vae_layout.get("scale_factor_spatial", 8),
    }


def convert_vae(path, layout: str, latents=None):
    """The original Wan2.1/Wan2.2 VAE file as a diffusers AutoencoderKLWan (weights assigned, not copied)."""
    import torch
    from diffusers import AutoencoderKLWan

    path = Path(path)
    sd = _load_pth(path)
    config = vae_config(sd, layout, latents)
    converted = convert_vae_state_dict(sd, config["is_residual"])
    with torch.device("meta"):
        vae = AutoencoderKLWan(**config)
    _load_into("AutoencoderKLWan", vae, converted, path)
    return vae


def _latent_stats_override(vae_config_path):
    if vae_config_path is None:
        return None
    p = Path(vae_config_path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
        return cfg["latents_mean"], cfg["latents_std"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"--vae-config {vae_config_path}: not a readable diffusers VAE config.json with "
                          "latents_mean and latents_std") from None


# ---- text encoder ----------------------------------------------------------------------------------------------------
def t5_key_map(sd: dict) -> dict[str, list[str]]:
    """original Wan T5Encoder key (wan/modules/t5.py) -> transformers UMT5EncoderModel key(s)."""
    per_block = {
        "norm1.weight": "layer.0.layer_norm.weight",
        "attn.q.weight": "layer.0.SelfAttention.q.weight",
        "attn.k.weight": "layer.0.SelfAttention.k.weight",
        "attn.v.weight": "layer.0.SelfAttention.v.weight",
        "attn.o.weight": "layer.0.SelfAttention.o.weight",
        "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
        "norm2.weight": "layer.1.layer_norm.weight",
        "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",  # GELU branch: gelu(wi_0 x) * wi_1 x
        "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",     # linear branch: fc1(x) * gate(x)
        "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
    }
    out = {}
    for key in sd:
        if key == "token_embedding.weight":
            out[key] = ["shared.weight", "encoder.embed_tokens.weight"]
        elif key == "norm.weight":
            out[key] = ["encoder.final_layer_norm.weight"]
        elif key.startswith("blocks.") and key.split(".", 2)[2] in per_block:
            i, leaf = key.split(".", 2)[1:]
            out[key] = [f"encoder.block.{i}.{per_block[leaf]}"]
        else:
            raise ConfigError(f"{T5_FILE}: unexpected key {key!r} (not the Wan UMT5-XXL encoder; a shared "
                              "pos_embedding or decoder weights are not supported)")
    return out


def t5_config(sd: dict):
    """transformers UMT5Config read off the original T5 encoder's tensor shapes."""
    try:
        vocab, d_model = sd["token_embedding.weight"].shape
        buckets, heads = sd["blocks.0.pos_embedding.embedding.weight"].shape
        d_attn = sd["blocks.0.attn.q.weight"].shape[0]
        d_ff = sd["blocks.0.ffn.fc1.weight"].shape[0]
    except KeyError as e:
        raise ConfigError(f"{T5_FILE}: no {e.args[0]!r}; not the original Wan UMT5-XXL encoder state dict") from None
    layers = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    return umt5_config(vocab, d_model, buckets, heads, d_attn, d_ff, layers)


def umt5_config(vocab, d_model, buckets, heads, d_attn, d_ff, layers):
    """transformers UMT5Config of Wan's UMT5-XXL encoder at these sizes (read off a state dict's shapes)."""
    from transformers import UMT5Config

    return UMT5Config(
        vocab_size=int(vocab), d_model=int(d_model), d_kv=int(d_attn) // int(heads), d_ff=int(d_ff),
        num_layers=int(layers), num_decoder_layers=int(layers), num_heads=int(heads),
        relative_attention_num_buckets=int(buckets), relative_attention_max_distance=128,  # T5RelativeEmbedding
        layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu",  # T5LayerNorm eps; GELU(tanh) gate = gelu_new
        dropout_rate=0.1, tie_word_embeddings=True,  # one token_embedding feeds the encoder
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )


def convert_text_encoder(path):
    """The original ``models_t5_umt5-xxl-enc-bf16.pth`` as a transformers UMT5EncoderModel (weights assigned)."""
    import torch
    from transformers import UMT5EncoderModel

    path = Path(path)
    sd = _load_pth(path)
    config = t5_config(sd)
    converted = {}
    for old, news in t5_key_map(sd).items():
        for new in news:
            converted[new] = sd[old]
    with torch.device("meta"):
        te = UMT5EncoderModel(config)
    _load_into("UMT5EncoderModel", te, converted, path)
    return te


def convert_tokenizer(src, out):
    """Load ``google/umt5-xxl/`` with AutoTokenizer and save it as ``tokenizer/`` (validates that it loads)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(os.fspath(src))
    except (OSError, ValueError) as e:
        msg = " ".join(str(e).split())
        raise ConfigError(f"{src}: the tokenizer does not load ({msg[:160]}); copy google/umt5-xxl/ from the "
                          "original Wan2.2 download") from None
    tok.save_pretrained(os.fspath(out))
    return tok
