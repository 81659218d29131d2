"""The original Wan-AI release of Wan2.2-S2V-14B: its DiT key names, its config.json, and loading it directly.

The release folder (what users download)::

    Wan2.2-S2V-14B/
      config.json                                      the DiT's (WanModel_S2V) config
      diffusion_pytorch_model-0000N-of-00004.safetensors + diffusion_pytorch_model.safetensors.index.json
      Wan2.1_VAE.pth, models_t5_umt5-xxl-enc-bf16.pth, google/umt5-xxl/, wav2vec2-large-xlsr-53-english/

Original names are those of ``WanModel_S2V`` (also ComfyUI's and DiffSynth-Studio's S2V state dict). This module's
names (:class:`~wanexp.models.s2v.transformer.WanS2VTransformer`) differ in:

  * the base Wan layers, renamed as diffusers renames them (``blocks.N.self_attn.q`` -> ``blocks.N.attn1.to_q``,
    ``ffn.0`` -> ``ffn.net.0.proj``, the affine ``norm3`` -> ``norm2``, ``modulation`` -> ``scale_shift_table``,
    ``time_embedding.0`` -> ``condition_embedder.time_embedder.linear_1``, ``head.head`` -> ``proj_out`` ...);
  * the audio injector's K-th cross-attention / AdaLN (``audio_injector.injector.K.q``,
    ``audio_injector.injector_adain_layers.K.linear``) living in the block it follows, the K-th of the sorted
    ``audio_inject_layers`` (``blocks.N.audio_injector.attn.to_q``, ``blocks.N.audio_injector.adain.linear``);
  * ``casual_audio_encoder`` spelled ``causal_audio_encoder``.

``cond_encoder``, ``trainable_cond_mask``, ``frame_packer`` and ``patch_embedding`` keep their names.
"""
from __future__ import annotations

import json
from pathlib import Path

from wanexp.errors import ConfigError
from wanexp.models.wan22.original import INDEX_NAME, _require_keys, _weight_files

CLASS_NAME = "WanModel_S2V"
MODEL_TYPE = "s2v"

# config.json of the released Wan2.2-S2V-14B DiT (original names; text_dim and patch_size are not saved there).
RELEASED_CONFIG = {
    "_class_name": CLASS_NAME, "model_type": MODEL_TYPE,
    "dim": 5120, "ffn_dim": 13824, "num_heads": 40, "num_layers": 40, "in_dim": 16, "out_dim": 16,
    "freq_dim": 256, "eps": 1e-6, "text_len": 512, "cond_dim": 16, "audio_dim": 1024, "num_audio_token": 4,
    "enable_adain": True, "adain_mode": "attn_norm",
    "audio_inject_layers": [0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39],
    "zero_init": True, "zero_timestep": True, "enable_motioner": False, "add_last_motion": True, "enable_tsm": False,
    "trainable_token_pos_emb": False, "motion_token_num": 1024, "enable_framepack": True,
    "framepack_drop_mode": "padd",
}
# WanModel_S2V's defaults for keys a config.json may leave out (what the original code builds without them).
ORIGINAL_DEFAULTS = {
    "freq_dim": 256, "eps": 1e-6, "cond_dim": 0, "audio_dim": 5120, "num_audio_token": 4, "enable_adain": False,
    "adain_mode": "attn_norm", "audio_inject_layers": [0, 4, 8, 12, 16, 20, 24, 27], "zero_timestep": False,
    "enable_motioner": True, "add_last_motion": True, "enable_tsm": False, "trainable_token_pos_emb": False,
    "enable_framepack": False, "framepack_drop_mode": "drop",
}
# config values with the same name and meaning in config.json and WanS2VTransformer's config
SHARED_KEYS = ("dim", "ffn_dim", "num_heads", "num_layers", "in_dim", "out_dim", "freq_dim", "eps", "cond_dim",
               "audio_dim", "num_audio_token", "enable_adain", "zero_timestep", "add_last_motion",
               "framepack_drop_mode")
MOTION_FRAMES = 73  # pixel frames before a clip that the released model conditions on (wan_s2v_14B.py)

# ---- names ------------------------------------------------------------------------------------------------------
_TOP = (  # this module's prefix -> the original's
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("proj_out", "head.head"),
    ("scale_shift_table", "head.modulation"),
    ("causal_audio_encoder", "casual_audio_encoder"),
)
_SAME = ("patch_embedding", "cond_encoder", "trainable_cond_mask", "frame_packer")
_ATTN = {"to_q": "q", "to_k": "k", "to_v": "v", "norm_q": "norm_q", "norm_k": "norm_k"}


def _attn_name(parts: list[str]) -> list[str]:
    if parts[:2] == ["to_out", "0"]:
        return ["o", *parts[2:]]
    if parts and parts[0] in _ATTN:
        return [_ATTN[parts[0]], *parts[1:]]
    raise KeyError(".".join(parts))


def _block_name(parts: list[str]) -> list[str]:
    head = parts[0]
    if head in ("attn1", "attn2"):
        return [{"attn1": "self_attn", "attn2": "cross_attn"}[head], *_attn_name(parts[1:])]
    if head == "norm2":  # the affine cross-attention norm
        return ["norm3", *parts[1:]]
    if parts[:4] == ["ffn", "net", "0", "proj"]:
        return ["ffn", "0", *parts[4:]]
    if parts[:3] == ["ffn", "net", "2"]:
        return ["ffn", "2", *parts[3:]]
    if parts == ["scale_shift_table"]:
        return ["modulation"]
    raise KeyError(".".join(parts))


def original_name(name: str, audio_inject_layers) -> str:
    """This module's parameter or module name -> the original release's (e.g. for a ComfyUI LoRA file).

    ``audio_inject_layers``: the model's config value (the K-th sorted injected block holds injector K)."""
    parts = name.split(".")
    try:
        if parts[0] == "blocks" and len(parts) > 2:
            block, rest = parts[1], parts[2:]
            if rest[0] == "audio_injector":
                k = str(sorted(audio_inject_layers).index(int(block)))
                if rest[1] == "attn":
                    return ".".join(["audio_injector", "injector", k, *_attn_name(rest[2:])])
                if rest[1] == "adain":
                    return ".".join(["audio_injector", "injector_adain_layers", k, *rest[2:]])
                raise KeyError(name)
            return ".".join(["blocks", block, *_block_name(rest)])
        for new, old in _TOP:
            if name == new or name.startswith(new + "."):
                return old + name[len(new):]
        if parts[0] in _SAME:
            return name
    except (KeyError, ValueError, IndexError):
        pass
    raise KeyError(f"{name!r} has no original S2V name")


def original_key_map(model) -> dict[str, str]:
    """{this module's state-dict key: original key} for every key of ``model`` (a WanS2VTransformer)."""
    layers = model.config.audio_inject_layers
    out = {k: original_name(k, layers) for k in model.state_dict()}
    if len(set(out.values())) != len(out):
        raise AssertionError("two keys map to one original key")
    return out


def module_key_map(model) -> dict[str, str]:
    """{original key: this module's state-dict key}: the inverse of :func:`original_key_map`."""
    return {v: k for k, v in original_key_map(model).items()}


# ---- config -----------------------------------------------------------------------------------------------------
def read_config(folder: Path) -> dict:
    """The DiT config.json of an original S2V release folder, or one ConfigError line saying why it is not one."""
    path = folder / "config.json"
    if not folder.is_dir():
        raise ConfigError(f"{folder}: folder not found; point it at the original Wan2.2-S2V-14B download")
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{folder}: no config.json; not a Wan2.2-S2V-14B release folder") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({type(e).__name__}); re-download it") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: not a JSON object; re-download it")
    cls, mt = cfg.get("_class_name"), cfg.get("model_type")
    if (mt is not None and mt != MODEL_TYPE) or (mt is None and cls != CLASS_NAME):
        raise ConfigError(f"{path}: _class_name={cls!r}, model_type={mt!r}: not a Wan2.2-S2V DiT "
                          f"({CLASS_NAME}, model_type 's2v'); point the path at the Wan2.2-S2V-14B download")
    _require_keys(cfg, path)
    return cfg


def module_config(orig: dict, shapes: dict, path) -> dict:
    """WanS2VTransformer's config from an original config.json and the tensor shapes of its weights (text_dim,
    patch size and the number of wav2vec2 layers are not in config.json)."""
    cfg = {**ORIGINAL_DEFAULTS, **orig}
    unsupported = [f"{k}={cfg[k]!r}" for k, ok in (
        ("enable_framepack", True), ("enable_motioner", False), ("enable_tsm", False),
        ("trainable_token_pos_emb", False), ("adain_mode", "attn_norm")) if cfg[k] != ok]
    if unsupported:
        raise ConfigError(f"{path}: {', '.join(unsupported)}: only the released S2V architecture (FramePack motion "
                          "frames, adain_mode='attn_norm') is supported")
    layers = [int(i) for i in cfg["audio_inject_layers"]]
    names = [str(i) for i in range(int(cfg["num_layers"]))]
    if len(set(layers)) != len(layers) or any(b.startswith(str(i)) and b != str(i) for b in names for i in layers):
        # the original assigns injectors to blocks whose index starts with an injected index (block 12 for 1)
        raise ConfigError(f"{path}: audio_inject_layers={layers} repeat a block or are the prefix of another "
                          "block's index, which the original code injects twice; not supported")
    try:
        text = shapes["text_embedding.0.weight"]
        patch = shapes["patch_embedding.weight"]
        audio = shapes["casual_audio_encoder.weights"]
    except KeyError as e:
        raise ConfigError(f"{path}: the weights have no {e.args[0]!r}; not a Wan2.2-S2V DiT") from None
    return {
        "dim": int(cfg["dim"]), "ffn_dim": int(cfg["ffn_dim"]), "num_heads": int(cfg["num_heads"]),
        "num_layers": int(cfg["num_layers"]), "in_dim": int(cfg["in_dim"]), "out_dim": int(cfg["out_dim"]),
        "text_dim": int(text[1]), "freq_dim": int(cfg["freq_dim"]), "eps": float(cfg["eps"]),
        "patch_size": tuple(int(p) for p in patch[2:]), "cond_dim": int(cfg["cond_dim"]),
        "audio_dim": int(cfg["audio_dim"]), "audio_layers": int(audio[1]),
        "num_audio_token": int(cfg["num_audio_token"]), "enable_adain": bool(cfg["enable_adain"]),
        "audio_inject_layers": tuple(layers), "zero_timestep": bool(cfg["zero_timestep"]),
        "add_last_motion": bool(cfg["add_last_motion"]), "framepack_drop_mode": str(cfg["framepack_drop_mode"]),
        "motion_frames": int(cfg.get("motion_frames", MOTION_FRAMES)),
    }


def to_original_config(config) -> dict:
    """The original config.json of a WanS2VTransformer config (the released values for everything it fixes)."""
    c = dict(config)
    return {**RELEASED_CONFIG, **{k: c[k] for k in SHARED_KEYS},
            "audio_inject_layers": [int(i) for i in c["audio_inject_layers"]]}


# ---- loading ----------------------------------------------------------------------------------------------------
def _shapes(files: list[Path]) -> dict[str, tuple[list[int], Path]]:
    from safetensors import safe_open

    out = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as sf:
                for k in sf.keys():
                    out[k] = (list(sf.get_slice(k).get_shape()), f)
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise ConfigError(f"{f}: not a readable safetensors file ({type(e).__name__}); re-download it") from None
    return out


def load_s2v_transformer(folder, dtype=None, device="cpu"):
    """The DiT of an original Wan2.2-S2V release folder as a WanS2VTransformer.

    Built on the meta device; each shard's tensors are read straight to ``device`` (safetensors) and assigned, cast
    to ``dtype`` when given. Any key missing from or unknown to the model is one ConfigError line naming the files."""
    import torch
    from safetensors import safe_open

    from wanexp.models.s2v.transformer import WanS2VTransformer

    folder = Path(folder)
    orig = read_config(folder)
    files = _weight_files(folder)
    found = _shapes(files)
    config = module_config(orig, {k: s for k, (s, _) in found.items()}, folder / "config.json")
    with torch.device("meta"):
        model = WanS2VTransformer(**config)
    to_module = module_key_map(model)
    missing = sorted(to_module.keys() - found.keys())
    unexpected = sorted(found.keys() - to_module.keys())
    if missing or unexpected:
        where = INDEX_NAME if (folder / INDEX_NAME).is_file() else "the safetensors files"
        raise ConfigError(f"{folder}: the S2V weights ({where}) do not match its config.json: missing "
                          f"{len(missing)} {missing[:3]}, unexpected {len(unexpected)} {unexpected[:3]}; "
                          "re-download the release (or fix config.json)")
    device = torch.device(device)
    for f in files:
        with safe_open(f, framework="pt", device=str(device)) as sf:
            sd = {}
            for k in sf.keys():
                t = sf.get_tensor(k)
                sd[to_module[k]] = t if dtype is None else t.to(dtype)
        try:
            model.load_state_dict(sd, strict=False, assign=True)
        except RuntimeError as e:
            msg = " ".join(str(e).split())
            raise ConfigError(f"{f}: tensor shapes do not match its config.json ({msg[:200]})") from None
        del sd
    return model
