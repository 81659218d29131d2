"""S2V's frozen encoders: the Wan2.1 VAE and UMT5 (Wan2.2's, reused) and wav2vec2 for the audio features.

A training clip of ``4k + 1`` frames is its reference image (frame 0) and the ``4k`` frames generated after it,
encoded as VideoX-Fun's S2V training encodes ``[reference, clip]``: one pass of the VAE, latent 0 is the reference
latent (the causal VAE's first latent sees frame 0 alone) and latents ``1..k`` are the clip's ``x0``. The audio
features are wav2vec2's hidden states of every layer, one window per generated frame, at that frame's time
(:func:`wanexp.models.s2v.audio_encoder.audio_features` over the clip's span, frame 0's dropped).
"""
from __future__ import annotations

import torch

from wanexp.data.audio import SAMPLE_RATE
from wanexp.models.encoders import Encoders
from wanexp.models.s2v.audio_encoder import AudioEncoder, audio_features
from wanexp.models.wan22.encoders import decode_latents, encode_text, encode_video


def clip_fps(num_samples: int, frames: int) -> int:
    """The (integer) frame rate of a clip of ``frames`` frames whose audio span is ``num_samples`` samples at 16 kHz
    (``wanexp.data.audio.audio_for_clip``: ``round(frames * 16000 / fps)`` samples)."""
    return round(frames * SAMPLE_RATE / num_samples)


class S2VEncoders(Encoders):
    """The Wan VAE, UMT5 and its tokenizer, and wav2vec2: ``cond["ref_latents"]`` (B, 16, 1, h, w) and
    ``cond["audio"]`` (B, layers, dim, F) of each clip."""

    def __init__(self, vae, text_encoder, tokenizer, audio_encoder: AudioEncoder, text_len: int):
        super().__init__()
        self.vae, self.text_encoder, self.tokenizer, self.text_len = vae, text_encoder, tokenizer, text_len
        self.wav2vec2 = audio_encoder.model  # a submodule: moves with .to()
        self.audio_encoder = audio_encoder

    @torch.no_grad()
    def encode_media(self, batch: dict) -> tuple[torch.Tensor, dict]:
        pixels = batch["pixels"]
        latents = encode_video(self.vae, pixels)
        cond = {"ref_latents": latents[:, :, :1]}
        if "audio" in batch:
            cond["audio"] = self.encode_audio(batch["audio"], pixels.shape[2]).to(latents.device)
        return latents[:, :, 1:], cond

    @torch.no_grad()
    def encode_audio(self, samples: torch.Tensor, frames: int) -> torch.Tensor:
        """(B, n) 16 kHz samples of each clip's span of ``frames`` frames -> (B, layers, dim, frames - 1) features
        of the frames after the reference."""
        fps = clip_fps(samples.shape[1], frames)
        return torch.stack([audio_features(self.audio_encoder, s.float().cpu().numpy(), SAMPLE_RATE, fps,
                                           frames)[..., 1:] for s in samples])

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        return encode_text(self.tokenizer, self.text_encoder, prompts, self.text_len)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        return decode_latents(self.vae, x0)
