"""Random S2V DiTs written in the original Wan-AI release layout (config.json + safetensors shards + index).

:func:`write_tiny_s2v` writes a small one for CPU tests, :func:`write_real_size_s2v` one of the released 14B shapes,
generating and writing one shard at a time on a given device (no whole-model copy in host memory). Both load through
:func:`wanexp.models.s2v.original.load_s2v_transformer`, as a real download does.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from wanexp.models.s2v.original import RELEASED_CONFIG, SHARED_KEYS, original_key_map, to_original_config
from wanexp.models.wan22.original import INDEX_NAME

TINY_SIZES = {
    "dim": 64, "ffn_dim": 128, "num_heads": 2, "num_layers": 6, "text_dim": 32, "freq_dim": 32, "audio_dim": 32,
    "audio_inject_layers": (0, 2, 5), "cond_dim": 16, "num_audio_token": 4,
}


def tiny_config(**sizes) -> dict:
    """WanS2VTransformer config of a tiny S2V: the released architecture (AdaLN audio injection into several
    blocks, FramePack 'padd', zero timestep) at small widths; ``sizes`` override :data:`TINY_SIZES`."""
    return {**TINY_SIZES, **sizes}


def real_config() -> dict:
    """WanS2VTransformer config of the released Wan2.2-S2V-14B."""
    return {**{k: RELEASED_CONFIG[k] for k in SHARED_KEYS}, "text_dim": 4096, "audio_layers": 25,
            "audio_inject_layers": tuple(RELEASED_CONFIG["audio_inject_layers"])}


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill every parameter with seeded random values (nothing zero, so every weight shows in the output)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = math.prod(p.shape[1:]) if p.ndim > 1 else p.shape[0]
            std = 1.0 / math.sqrt(fan_in) if p.ndim > 1 else 0.1
            value = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
            if name.endswith(("norm_q.weight", "norm_k.weight", "norm2.weight")):
                value = value + 1.0  # norm gains around 1
            p.copy_(value.to(p.dtype))
    return model


def _shard_keys(sizes: dict[str, int], shards: int) -> list[list[str]]:
    """Keys split into ``shards`` consecutive groups of about equal bytes."""
    total = sum(sizes.values())
    groups, acc = [[] for _ in range(shards)], 0
    for k, n in sizes.items():
        groups[min(shards - 1, acc * shards // max(total, 1))].append(k)
        acc += n
    return [g for g in groups if g]


def _write_folder(folder: Path, config: dict, named_shapes: dict, make_tensor, shards: int) -> None:
    """config.json + ``shards`` safetensors files + index, tensors produced one shard at a time by ``make_tensor``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sizes = {k: math.prod(shape) for k, shape in named_shapes.items()}
    groups = _shard_keys(sizes, shards)
    weight_map, total = {}, 0
    for i, keys in enumerate(groups, 1):
        name = f"diffusion_pytorch_model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: make_tensor(k).contiguous() for k in keys}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
        weight_map.update({k: name for k in keys})
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2))
    (folder / "config.json").write_text(json.dumps({**to_original_config(config), "_diffusers_version": "0.33.0"},
                                                   indent=2))


def write_tiny_s2v(folder, seed: int = 0, shards: int = 2, **sizes):
    """Write a tiny random S2V DiT in the original layout at ``folder``; returns the in-memory model (fp32, CPU)."""
    from wanexp.models.s2v.transformer import WanS2VTransformer

    model = randomize_(WanS2VTransformer(**tiny_config(**sizes)), seed).eval()
    names = original_key_map(model)
    sd = model.state_dict()
    orig = {names[k]: v for k, v in sd.items()}
    _write_folder(Path(folder), model.config, {k: v.shape for k, v in orig.items()}, lambda k: orig[k].clone(),
                  shards)
    return model


def write_real_size_s2v(folder, device="cuda", dtype=torch.bfloat16, seed: int = 0, shards: int = 4) -> dict:
    """Write a random DiT of the released Wan2.2-S2V-14B's shapes at ``folder`` (about 32 GB in bf16). The model is
    built on the meta device; each shard's tensors are drawn on ``device``, written and freed before the next.
    Returns the WanS2VTransformer config it wrote."""
    from wanexp.models.s2v.transformer import WanS2VTransformer

    config = real_config()
    with torch.device("meta"):
        model = WanS2VTransformer(**config)
    names = original_key_map(model)
    shapes = {names[k]: tuple(v.shape) for k, v in model.state_dict().items()}
    g = torch.Generator(device=device).manual_seed(seed)

    def make(key: str) -> torch.Tensor:
        shape = shapes[key]
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
        std = 1.0 / math.sqrt(fan_in) if len(shape) > 1 else 0.1
        return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype).cpu()

    _write_folder(Path(folder), model.config, shapes, make, shards)
    return config


def write_tiny_build(spec, folder: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """A complete random S2V folder for ``spec`` (an S2VSpec; sizes from ``spec.build``): the DiT in the original
    layout, the Wan2.1 VAE and UMT5 as diffusers/transformers folders ``vae/`` and ``text_encoder/``, the tokenizer
    at ``google/umt5-xxl/``, the wav2vec2 and a ``model_index.json`` naming the build. ``transformer: real`` in the
    build section writes the released 14B DiT (:func:`write_real_size_s2v`, drawn on ``device``) and ``audio: real``
    the full wav2vec2; otherwise both are tiny (the VAE and UMT5 take the section's sizes either way)."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    from wanexp.models.s2v.audio_encoder import FOLDER, wav2vec2_config, write_wav2vec2
    from wanexp.models.wan22.build import build_tokenizer
    from wanexp.models.wan22.original import TOKENIZER_DIR, WAN21_LATENTS_MEAN, WAN21_LATENTS_STD

    b = spec.build
    seed = int(b.get("seed", 0))
    te = dict(b["text_encoder"])
    audio_size = str(b.get("audio", "tiny"))
    audio = wav2vec2_config(audio_size)
    if b["transformer"] == "real":
        write_real_size_s2v(folder, device=device, dtype=torch.bfloat16 if dtype == torch.float32 else dtype,
                            seed=seed)
    else:
        write_tiny_s2v(folder, seed=seed, **{**b["transformer"], "text_dim": te["d_model"],
                                             "audio_dim": audio.hidden_size,
                                             "audio_layers": audio.num_hidden_layers + 1})
    write_wav2vec2(folder / FOLDER, audio_size, seed=seed)
    torch.manual_seed(seed)
    with torch.device(device):
        vae = AutoencoderKLWan(z_dim=spec.latent_channels, **b["vae"], latents_mean=WAN21_LATENTS_MEAN,
                               latents_std=WAN21_LATENTS_STD)
        vae.to(dtype).save_pretrained(folder / "vae")
        del vae
        text = UMT5EncoderModel(UMT5Config(**te, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
        text.to(dtype).save_pretrained(folder / "text_encoder")
    build_tokenizer(folder / TOKENIZER_DIR, spec.text_len)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanS2V", "build": spec.name}, indent=2))
