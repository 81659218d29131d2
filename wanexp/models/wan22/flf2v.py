"""First-last-frame to video (FLF2V) on the Wan2.2 I2V-A14B weights (``model=flf2v14b``, ``model=tiny_flf2v``).

The same two experts, VAE and text encoder users download as Wan2.2-I2V-A14B; only the conditioning differs. The
16 image-condition channels are the VAE latents of ``[first frame, zeros x (F - 2), last frame]`` and the 4 mask
channels are 1 on the first and on the last pixel frame (Wan2.1's ``first_last_frame2video``, diffusers'
``WanImageToVideoPipeline(..., last_image=...)``, DiffSynth-Studio's ``end_image``). A training sample's last frame is
the last frame of its trained window (after frame sampling), as DiffSynth-Studio takes ``video[-1]``; a
``last_image`` metadata column (an image file) overrides it for its row.

TI2V-5B has no first-last-frame form: it conditions by replacing latent frame 0, and neither diffusers (its
``expand_timesteps`` path drops ``last_image``) nor DiffSynth-Studio (its fused image unit reads ``input_image``
only) conditions it on a last frame, so FLF2V is this I2V-A14B variant alone.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from wanexp.models.wan22 import conditioning
from wanexp.models.wan22.encoders import WanEncoders, encode_image_condition, encode_video
from wanexp.models.wan22.pipeline import WanPipelineRunner
from wanexp.models.wan22.spec import I2VA14BSpec

LAST_IMAGE = "last_image"  # the metadata column and the sample input's name
# A loaded last_image is (4, H, W): the image's 3 channels in [-1, 1] and a 4th that is 1 where the row named an
# image and 0 where it did not (then the clip's own last frame is used): one shape for every row, so rows with and
# without the column share a batch.
GIVEN = 3


def last_frames(pixels: torch.Tensor, loaded: torch.Tensor | None) -> torch.Tensor:
    """Each sample's last frame (B, 3, H, W): its ``last_image`` where its row gave one, else the clip's own last
    frame (pixels (B, 3, F, H, W); ``loaded``: the batch's (B, 4, H, W) ``last_image`` or None)."""
    own = pixels[:, :, -1]
    if loaded is None:
        return own
    given = loaded[:, GIVEN:GIVEN + 1] > 0.5
    return torch.where(given, loaded[:, :GIVEN].to(own.dtype), own)


class FirstLastEncoders(WanEncoders):
    """Wan's encoders; ``cond["image_latent"]`` holds the first and the last frame."""

    def __init__(self, vae, text_encoder, tokenizer, text_len: int):
        super().__init__(vae, text_encoder, tokenizer, text_len, image_latent=True)

    def encode_media(self, batch: dict) -> tuple[torch.Tensor, dict]:
        pixels = batch["pixels"]
        last = last_frames(pixels, batch.get(LAST_IMAGE))
        return encode_video(self.vae, pixels), {
            "image_latent": encode_image_condition(self.vae, pixels[:, :, 0], pixels.shape[2], last)}


class FirstLastRunner(WanPipelineRunner):
    """diffusers' WanImageToVideoPipeline given the sample's last frame as ``last_image``: ``inputs["last_image"]``,
    an image path (``wanexp-sample --last``: resized and centre-cropped to the sample's size as training crops its
    clips, handed over as a (1, 3, H, W) tensor in [0, 1], which the pipeline maps to [-1, 1]), a clip's path (its
    frame ``frames - 1``: validation's held-out clip, conditioned as training conditions it) or a PIL image."""

    def generate(self, prompt, seed, shape, steps, guidance, negative, device, record, image=None, embeds=None,
                 inputs=None):
        from wanexp.models.wan22 import pipeline

        last = (inputs or {}).get(LAST_IMAGE)
        if isinstance(last, (str, os.PathLike)):  # an image, or a clip (validation's held-out one): its last frame
            from wanexp.data.media import load_clip
            from wanexp.data.metadata import media_kind

            frames = shape["frames"] if media_kind(str(last)) == "video" else 1
            last = (load_clip(last, frames, shape["height"], shape["width"])[:, -1][None] + 1) / 2
        return pipeline.generate(self.pipe, prompt, seed, shape, steps, guidance, negative, device, record, image,
                                 embeds, last_image=last)


class FLF2VA14BSpec(I2VA14BSpec):
    """I2V-A14B's weights, trained and sampled on a first and a last frame."""

    sample_inputs = {LAST_IMAGE: "an image the sample ends on (default: the clip's own last frame)"}
    sample_input_fallbacks = {LAST_IMAGE: ()}  # a row without it: the clip's own path, i.e. its own last frame

    def load_sample_input(self, name, path, num_frames, fps, size=None, start=0, stride=1) -> torch.Tensor:
        """The row's last image as (4, H, W) (see GIVEN), resized and centre-cropped to the clip's ``size`` (height,
        width) as training crops its clips; the clip's own path (no ``last_image`` in the row) gives zeros."""
        from wanexp.data.media import load_clip
        from wanexp.data.metadata import media_kind

        height, width = size
        if media_kind(path) == "video":
            return torch.zeros(GIVEN + 1, height, width)
        image = load_clip(path, 1, height, width)[:, 0]
        return torch.cat([image, torch.ones(1, height, width)])

    def check_sample_input(self, name, path) -> str | None:
        """A ``last_image`` that is not an image file, missing or unreadable: the reason, as the data probe words a
        clip's (the clip's own path: none)."""
        from wanexp.data.metadata import IMAGE_EXTENSIONS, Sample, media_kind
        from wanexp.data.probe import probe_sample

        kind = media_kind(path)
        if kind == "video":
            return None
        if kind is None:
            return f"last_image {path}: not an image file (one of {', '.join(sorted(IMAGE_EXTENSIONS))})"
        reason = probe_sample(Sample(path=path, prompt="", kind=kind), 1, 1, 16, 16).reason
        return f"last_image {path}: {reason}" if reason else None

    def encoder_info(self):
        """Latents cached for I2V (the first frame only) are never this model's: its cond id differs."""
        return dataclasses.replace(super().encoder_info(), cond_id="first_last_frame")

    def load_encoders(self):
        return FirstLastEncoders(self.load_vae(), self.load_text_encoder(), self.load_tokenizer(), self.text_len)

    def model_inputs(self, x_t, x0, sigma, cond):
        return conditioning.i2v_inputs(x_t, sigma, cond["image_latent"], self.vae_stride[0], last_frame=True)

    def load_pipeline(self, device, dtype, image):
        return FirstLastRunner(super().load_pipeline(device, dtype, image).pipe)

    def make_pipeline(self, transformers, vae, scheduler, image):
        return FirstLastRunner(super().make_pipeline(transformers, vae, scheduler, image).pipe)
