"""Random Wan2.2-Animate models in the Wan-AI/Wan2.2-Animate-14B-Diffusers folder layout (``model.build``).

The folder is what ``WanAnimatePipeline.save_pretrained`` writes: ``transformer/`` (WanAnimateTransformer3DModel),
``vae/`` (the Wan2.1 VAE), ``text_encoder/`` + ``tokenizer/`` (UMT5), ``image_encoder/`` (CLIPVisionModel) +
``image_processor/`` (CLIPImageProcessor), ``scheduler/`` and ``model_index.json``. The build section gives each
component's sizes; ``transformer: real`` writes the released DiT's shapes (:data:`REAL_TRANSFORMER`) and
``image_encoder: real`` the released CLIP's, built on the given device in the given dtype.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

# The released DiT's sizes (Wan-AI/Wan2.2-Animate-14B-Diffusers transformer/config.json: Wan2.1-I2V's 14B DiT with
# its CLIP image cross-attention, image_dim 1280 and added_kv_proj_dim 5120 (transformer_config), plus the pose patch
# embedding, the motion and face encoders and a face adapter after every 5th block: the class's defaults).
REAL_TRANSFORMER = {"num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824, "num_layers": 40,
                    "text_dim": 4096, "freq_dim": 256}
# The released image encoder: open-clip XLM-RoBERTa-large ViT-H/14's vision tower (what CLIPVisionModel loads)
REAL_IMAGE_ENCODER = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                      "num_attention_heads": 16, "image_size": 224, "patch_size": 14, "projection_dim": 1024,
                      "hidden_act": "gelu"}


def transformer_config(spec, sizes: dict, image_dim: int) -> dict:
    """WanAnimateTransformer3DModel arguments: the build's sizes, the family's channels and patch, the image
    encoder's width, and the added key/value projections of the image cross-attention at the DiT's width."""
    sizes = dict(sizes)
    dim = sizes["num_attention_heads"] * sizes["attention_head_dim"]
    return {"in_channels": spec.in_channels, "latent_channels": spec.latent_channels,
            "out_channels": spec.latent_channels, "patch_size": list(spec.patch), "image_dim": image_dim,
            "added_kv_proj_dim": dim, **sizes}


def randomize_(model: torch.nn.Module, seed: int, device=None) -> torch.nn.Module:
    """Fill every parameter with seeded values (1/sqrt(fan-in) for matrices, norm gains around 1, small vectors): a
    model whose every weight shows in its output, drawn one tensor at a time."""
    g = torch.Generator(device=device or "cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            fan_in = math.prod(p.shape[1:]) if p.ndim > 1 else p.shape[0]
            std = 1.0 / math.sqrt(fan_in) if p.ndim > 1 else 0.1
            value = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32) * std
            if name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_k.weight", "norm2.weight")):
                value = value + 1.0
            p.copy_(value.to(p.dtype))
    return model


def write_tiny_build(spec, folder: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """A complete random Animate folder for ``spec`` (an AnimateSpec; sizes from ``spec.build``) built on
    ``device`` in ``dtype``, saved as ``WanAnimatePipeline.save_pretrained`` saves one."""
    from wanexp.models.animate.pipeline import pipeline_type

    WanAnimatePipeline = pipeline_type()  # first: it binds the CLIP image processor's name (see pipeline_class)
    from diffusers import AutoencoderKLWan, WanAnimateTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    from wanexp.models.wan22.build import build_tokenizer
    from wanexp.models.wan22.original import WAN21_LATENTS_MEAN, WAN21_LATENTS_STD
    from wanexp.models.wan22.pipeline import flow_scheduler

    b = spec.build
    seed = int(b.get("seed", 0))
    clip = REAL_IMAGE_ENCODER if b.get("image_encoder") == "real" else dict(b["image_encoder"])
    sizes = REAL_TRANSFORMER if b["transformer"] == "real" else b["transformer"]
    torch.manual_seed(seed)
    with torch.device(device):
        transformer = WanAnimateTransformer3DModel(**transformer_config(spec, sizes, clip["hidden_size"]))
        transformer = randomize_(transformer.to(dtype), seed, device)
        vae = AutoencoderKLWan(z_dim=spec.latent_channels, **b["vae"], latents_mean=WAN21_LATENTS_MEAN,
                               latents_std=WAN21_LATENTS_STD).to(dtype)
        text = UMT5EncoderModel(UMT5Config(**b["text_encoder"], pad_token_id=0, eos_token_id=1,
                                           decoder_start_token_id=0)).to(dtype)
        image_encoder = CLIPVisionModel(CLIPVisionConfig(**clip)).to(dtype)
    size = clip["image_size"]
    processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    tokenizer = build_tokenizer(folder / "tokenizer", spec.text_len)
    pipe = WanAnimatePipeline(tokenizer=tokenizer, text_encoder=text, vae=vae, scheduler=flow_scheduler(spec.shift),
                              image_processor=processor, image_encoder=image_encoder, transformer=transformer)
    pipe.save_pretrained(folder)
