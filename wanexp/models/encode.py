"""Frozen encoders: VAE latents (posterior mode, normalised) and UMT5 text embeddings, exactly as Wan2.2 uses them.

These run once per sample: online inside the training step for now, and into the latent/text cache later.
"""
from __future__ import annotations

import html
import re

import torch

try:  # ftfy fixes mojibake; the cleaning must match between caching and inference.
    import ftfy
except ImportError:  # pragma: no cover - ftfy is a pinned dependency
    ftfy = None


def clean_prompt(text: str) -> str:
    """ftfy fix + double html unescape + whitespace collapse (the Wan prompt cleaning)."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def _latent_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, device=like.device, dtype=torch.float32).view(shape)
    std = torch.tensor(vae.config.latents_std, device=like.device, dtype=torch.float32).view(shape)
    return mean, std


@torch.no_grad()
def encode_video(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels (B, 3, F, H, W) in [-1, 1] -> normalised latents x0 = (mode - mean) / std, fp32."""
    mode = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode().float()
    mean, std = _latent_stats(vae, mode)
    return (mode - mean) / std


@torch.no_grad()
def decode_latents(vae, x0: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_video`: normalised latents -> pixels in [-1, 1]."""
    mean, std = _latent_stats(vae, x0)
    z = (x0.float() * std + mean).to(vae.dtype)
    return vae.decode(z).sample.clamp(-1, 1)


@torch.no_grad()
def encode_image_condition(vae, first_frame: torch.Tensor, num_frames: int) -> torch.Tensor:
    """I2V-A14B condition: latents of [image, zeros x (F-1)] in pixel space. first_frame is (B, 3, H, W)."""
    b, c, h, w = first_frame.shape
    video = torch.zeros(b, c, num_frames, h, w, device=first_frame.device, dtype=first_frame.dtype)
    video[:, :, 0] = first_frame
    return encode_video(vae, video)


@torch.no_grad()
def encode_text(tokenizer, text_encoder, prompts: list[str], max_length: int) -> torch.Tensor:
    """UMT5 embeddings (B, max_length, D): encoded with the attention mask, zero past each prompt's real length.

    The DiT has no cross-attention mask, so the padding must be zeros exactly as at inference.
    """
    toks = tokenizer(
        [clean_prompt(p) for p in prompts],
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    device = text_encoder.device
    ids, mask = toks.input_ids.to(device), toks.attention_mask.to(device)
    hidden = text_encoder(ids, mask).last_hidden_state
    return hidden * mask.unsqueeze(-1).to(hidden.dtype)
