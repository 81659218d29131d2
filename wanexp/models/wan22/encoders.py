"""Wan2.2's frozen encoders: VAE latents (posterior mode, normalised by the VAE's latents_mean/std), UMT5 text
embeddings, and the I2V-A14B image condition, exactly as Wan2.2 uses them.

They run once per sample: online inside the training step, or into the latent/text cache (wanexp.cli.cache).
"""
from __future__ import annotations

import torch

from wanexp.models.encoders import Encoders
from wanexp.text import clean_prompt


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
def encode_image_condition(vae, first_frame: torch.Tensor, num_frames: int,
                           last_frame: torch.Tensor | None = None) -> torch.Tensor:
    """I2V-A14B condition: latents of [image, zeros x (F-1)] in pixel space. first_frame is (B, 3, H, W).
    ``last_frame`` (B, 3, H, W): first-last-frame conditioning, the latents of [image, zeros x (F-2), last frame]
    (Wan2.1's FLF2V, diffusers' ``last_image``); a one-frame sample keeps its image."""
    b, c, h, w = first_frame.shape
    video = torch.zeros(b, c, num_frames, h, w, device=first_frame.device, dtype=first_frame.dtype)
    if last_frame is not None and num_frames > 1:
        video[:, :, -1] = last_frame.to(first_frame.dtype)
    video[:, :, 0] = first_frame
    return encode_video(vae, video)


def tokenize(tokenizer, prompts: list[str], max_length: int):
    """Cleaned prompts -> input_ids and attention_mask (B, max_length), padded and truncated as Wan does."""
    return tokenizer(
        [clean_prompt(p) for p in prompts],
        padding="max_length",
        max_length=max_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )


@torch.no_grad()
def encode_text(tokenizer, text_encoder, prompts: list[str], max_length: int) -> torch.Tensor:
    """UMT5 embeddings (B, max_length, D): encoded with the attention mask, zero past each prompt's real length.

    The DiT has no cross-attention mask, so the padding must be zeros exactly as at inference.
    """
    toks = tokenize(tokenizer, prompts, max_length)
    device = text_encoder.device
    ids, mask = toks.input_ids.to(device), toks.attention_mask.to(device)
    hidden = text_encoder(ids, mask).last_hidden_state
    return hidden * mask.unsqueeze(-1).to(hidden.dtype)


class WanEncoders(Encoders):
    """The Wan VAE, the UMT5 text encoder and its tokenizer; ``image_latent``: each sample also carries its first
    frame's latent (I2V-A14B's ``cond["image_latent"]``)."""

    def __init__(self, vae, text_encoder, tokenizer, text_len: int, image_latent: bool = False):
        super().__init__()
        self.vae, self.text_encoder, self.tokenizer = vae, text_encoder, tokenizer
        self.text_len, self.image_latent = text_len, image_latent

    def encode_media(self, batch: dict) -> tuple[torch.Tensor, dict]:
        pixels = batch["pixels"]
        x0 = encode_video(self.vae, pixels)
        cond = {}
        if self.image_latent:
            cond["image_latent"] = encode_image_condition(self.vae, pixels[:, :, 0], pixels.shape[2])
        return x0, cond

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        return encode_text(self.tokenizer, self.text_encoder, prompts, self.text_len)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        return decode_latents(self.vae, x0)


def encode_prompts(spec, prompts, device, encoders=None) -> dict:
    """``ModelSpec.encode_prompts`` of a family with UMT5 text (Wan2.2, S2V): each prompt's embedding on the CPU, by the
    run's ``encoders`` or by ``spec``'s text encoder loaded for the call (freed after it)."""
    if encoders is not None:
        te, tok = encoders.text_encoder, encoders.tokenizer
    else:
        te, tok = spec.load_text_encoder().to(device), spec.load_tokenizer()
    with torch.no_grad(), torch.autocast(device_type=torch.device(device).type, enabled=False):
        emb = encode_text(tok, te, list(prompts), spec.text_len)
    return {p: e.cpu() for p, e in zip(prompts, emb)}
