"""Wan2.2-Animate's frozen encoders: the Wan2.1 VAE and UMT5 (Wan2.2's, reused) and the CLIP vision tower.

A training clip of ``4k + 1`` frames is one segment as the reference generates it (Wan2.2's ``wan/animate.py``, the
first segment: no previous frames), conditioned on its first frame as the reference image, on its pose video (the
same frames, through the VAE) and on its face video (pixels at the face encoder's size). What the DiT sees is
what diffusers' WanAnimatePipeline builds for that segment:

- ``x0``: the reference image's latent, then the clip's ``k + 1`` latents (``k + 2`` latent frames; the DiT's input
  and output have the reference slot first, and the loss leaves it out: ``AnimateSpec.model_inputs``);
- ``cond["reference_latents"]`` (B, 4 + 16, k + 2, h, w): the reference slot (mask 1, the image's latent), then the
  segment's condition: animation, the latents of a zero video with mask 0 (all generated); replacement, the
  background video's latents with mask ``1 - mask_video`` (1 where the background is kept) at the latent size;
- ``cond["pose_latents"]`` (B, 16, k + 1, h, w), ``cond["face_pixels"]`` (B, 3, 4k + 1, S, S) in [-1, 1];
- ``cond["image_embeds"]`` (B, tokens, width): the CLIP vision tower's penultimate hidden states of the reference.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from wanexp.data.media import resize_crop
from wanexp.models.encoders import Encoders
from wanexp.models.wan22.conditioning import i2v_mask_channels
from wanexp.models.wan22.encoders import decode_latents, encode_text, encode_video

MASK_CHANNELS = 4  # the VAE's temporal stride: the pixel mask folded into latent frames


def to_pil(frames: torch.Tensor) -> list:
    """(B, 3, H, W) in [-1, 1] -> uint8 PIL images (the frames the clip was decoded from, exactly)."""
    from PIL import Image

    u8 = ((frames.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(np.ascontiguousarray(a)) for a in u8]


def fit(video: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, C, F, h, w) resized to cover ``height x width`` and centre-cropped, as the clip was."""
    if video.shape[-2:] == (height, width):
        return video
    return resize_crop(video.transpose(1, 2).float(), height, width).transpose(1, 2)


def segment_mask(keep: torch.Tensor | None, b: int, frames: int, h: int, w: int, device) -> torch.Tensor:
    """The segment's 4 mask channels (B, 4, k + 1, h, w): ``keep`` (B, F, h, w) in [0, 1] per pixel frame at the
    latent size (1: the frame's content is given), None: all 0; frame 0 repeated 4 times so the frames fold evenly."""
    if keep is None:
        return torch.zeros(b, MASK_CHANNELS, (frames - 1) // MASK_CHANNELS + 1, h, w, device=device)
    keep = torch.cat([keep[:, :1].repeat(1, MASK_CHANNELS, 1, 1), keep[:, 1:]], dim=1)
    return keep.view(b, -1, MASK_CHANNELS, h, w).transpose(1, 2)


class AnimateEncoders(Encoders):
    """The Wan VAE, UMT5 and its tokenizer, and the CLIP vision tower with its image processor; ``face_size``: the
    DiT's face encoder's input size; ``replacement``: the segment's condition is the background video inside the
    mask (else a zero video, all generated)."""

    def __init__(self, vae, text_encoder, tokenizer, image_encoder, image_processor, text_len: int, face_size: int,
                 replacement: bool):
        super().__init__()
        self.vae, self.text_encoder, self.tokenizer, self.image_encoder = vae, text_encoder, tokenizer, image_encoder
        self.image_processor, self.text_len, self.face_size = image_processor, text_len, face_size
        self.replacement = replacement

    @torch.no_grad()
    def encode_image(self, reference: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> the CLIP vision tower's penultimate hidden states (B, tokens, width), of the
        images as its processor prepares them (resized, centre-cropped, normalised)."""
        inputs = self.image_processor(images=to_pil(reference), return_tensors="pt")
        pixels = inputs["pixel_values"].to(self.image_encoder.device, self.image_encoder.dtype)
        return self.image_encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2].float()

    @torch.no_grad()
    def encode_media(self, batch: dict) -> tuple[torch.Tensor, dict]:
        pixels = batch["pixels"]
        b, _, frames, height, width = pixels.shape
        reference = pixels[:, :, :1]
        ref_latents = encode_video(self.vae, reference)
        latents = encode_video(self.vae, pixels)
        h, w = latents.shape[-2:]
        ref_mask = i2v_mask_channels(b, 1, h, w, MASK_CHANNELS, latents.device, latents.dtype)
        if self.replacement:
            condition = encode_video(self.vae, fit(batch["background_video"], height, width))
            keep = 1 - (fit(batch["mask_video"], height, width)[:, 0].to(latents.device) + 1) / 2  # channel 0, [0, 1]
            keep = F.interpolate(keep, size=(h, w), mode="nearest")  # (B, F, h, w): frames as channels
            mask = segment_mask(keep, b, frames, h, w, latents.device)
        else:
            condition = encode_video(self.vae, torch.zeros_like(pixels))
            mask = segment_mask(None, b, frames, h, w, latents.device)
        cond = {
            "reference_latents": torch.cat([torch.cat([ref_mask, ref_latents], dim=1),
                                            torch.cat([mask, condition], dim=1)], dim=2),
            "pose_latents": encode_video(self.vae, fit(batch["pose_video"], height, width)),
            "face_pixels": fit(batch["face_video"], self.face_size, self.face_size).float(),
            "image_embeds": self.encode_image(reference[:, :, 0]).to(latents.device),
        }
        return torch.cat([ref_latents, latents], dim=2), cond

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        return encode_text(self.tokenizer, self.text_encoder, prompts, self.text_len)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        """The clip's frames: the latents after the reference slot."""
        return decode_latents(self.vae, x0[:, :, 1:])
