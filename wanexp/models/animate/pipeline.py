"""Animate's sampler: diffusers' WanAnimatePipeline over wanexp's modules.

One sample animates the reference image (``--image``) with the motion of its pose and face videos (``--pose-video``,
``--face-video``; replacement mode also ``--background-video`` and ``--mask-video``), all read at the sample's frame
rate for its ``frames`` frames. The pipeline generates them in segments of up to 77 frames (the reference's), each
after the first continuing from the last frame of the one before, with the folder's scheduler at the model's shift;
CFG (``guidance`` > 1, the reference's default is none) runs the negative prompt with a blank face video.
"""
from __future__ import annotations

import torch

from wanexp.errors import ConfigError
from wanexp.models.pipeline import OneExpertPipeline

SEGMENT_FRAMES = 77  # frames per generated segment (Wan2.2's animate frame_num, the pipeline's default)
PREVIOUS_FRAMES = 1  # frames of the previous segment a later segment continues from (the reference's refert_num)


def pipeline_type():
    """diffusers' WanAnimatePipeline (imported as Wan2.2's pipelines are: wanexp.models.wan22.pipeline)."""
    from wanexp.models.wan22.pipeline import pipeline_class

    return pipeline_class("WanAnimatePipeline")


def load_animate_pipeline(spec, device, dtype):
    """The folder's whole pipeline (every component) on ``device`` in ``dtype`` (the VAE in ``model.vae_dtype``)."""
    pipe = pipeline_type().from_pretrained(str(spec.path), dtype=dtype)
    pipe.vae.to(spec.vae_dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def build_animate_pipeline(spec, transformer, vae, scheduler):
    """The pipeline around a transformer and VAE already in memory; the CLIP image encoder, its processor, the text
    encoder and tokenizer load from the folder (prompts may also come as embeddings)."""
    image_encoder, processor = spec.load_image_encoder()
    pipe = pipeline_type()(tokenizer=spec.load_tokenizer(), text_encoder=spec.load_text_encoder(), vae=vae,
                           scheduler=scheduler, image_processor=processor,
                           image_encoder=image_encoder.to(transformer.device), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def segment_frames(frames: int) -> int:
    """Frames per segment for a sample of ``frames`` frames: the reference's 77, or the sample's (4k + 1) if fewer."""
    return min(SEGMENT_FRAMES, (frames - 1) // 4 * 4 + 1)


def read_frames(path: str, frames: int, fps: int, height: int | None = None, width: int | None = None) -> list:
    """The first ``frames`` frames of a video at ``fps`` as PIL images, at its own size (or ``height x width``)."""
    from wanexp.data.media import load_clip
    from wanexp.models.animate.encoders import to_pil
    from wanexp.models.animate.media import video_size

    w, h = video_size(path)
    clip = load_clip(path, frames, height or h, width or w, fps=fps)
    return to_pil(clip.transpose(0, 1))


class AnimatePipeline(OneExpertPipeline):
    """A WanAnimatePipeline (``pipe``) as the family's sampling pipeline: its transformer is the dense expert."""

    def __init__(self, spec, pipe):
        self.spec, self.pipe = spec, pipe
        self.experts = {"dense": pipe.transformer}

    def inputs_of(self, inputs: dict | None, frames: int, fps: int) -> dict:
        """The control videos of a sample as the pipeline takes them (lists of PIL frames), each required."""
        inputs = inputs or {}
        missing = [n for n in self.spec.sample_inputs if n not in inputs]
        if missing:
            flags = " ".join(f"--{n.replace('_', '-')}" for n in missing)
            raise ConfigError(f"model={self.spec.name} ({self.spec.animate_mode}) samples from {flags} for every "
                              "--prompt (videos of the motion to follow: docs/animate.md)")
        face = self.spec.face_size()
        return {n: read_frames(p, frames, fps, *((face, face) if n == "face_video" else ())) for n, p in
                inputs.items()}

    @torch.no_grad()
    def generate(self, prompt, seed, shape, steps, guidance, negative, device, record, image=None, embeds=None,
                 inputs=None):
        frames, fps = shape["frames"], shape.get("fps") or self.spec.fps
        videos = self.inputs_of(inputs, frames, fps)
        if image is None:
            raise ConfigError(f"model={self.spec.name} animates a reference image: pass one --image per --prompt")
        dtype = self.pipe.transformer.dtype
        text = {"prompt": prompt, "negative_prompt": negative} if embeds is None else {
            "prompt_embeds": embeds[0][None].to(device, dtype), "negative_prompt_embeds": embeds[1][None].to(device,
                                                                                                             dtype)}
        record.clear()
        latents = []

        def on_step(pipe, i, t, kwargs):
            record.append(float(t))
            if i == pipe.num_timesteps - 1:  # a segment's last step: its generated latents (the reference slot off)
                latents.append(kwargs["latents"][:, :, 1:].float().cpu())
            return {}

        out = self.pipe(image=image, pose_video=videos["pose_video"], face_video=videos["face_video"],
                        background_video=videos.get("background_video"), mask_video=videos.get("mask_video"),
                        height=shape["height"], width=shape["width"], segment_frame_length=segment_frames(frames),
                        num_inference_steps=steps, mode="replace" if self.spec.animate_mode == "replacement" else
                        "animate", prev_segment_conditioning_frames=PREVIOUS_FRAMES, guidance_scale=guidance,
                        generator=torch.Generator().manual_seed(seed), output_type="pt",
                        callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["latents"],
                        max_sequence_length=shape.get("text_len", self.spec.text_len), **text).frames
        video = out[0].permute(0, 2, 3, 1).float().cpu()  # (F, H, W, 3) in [0, 1]
        return torch.cat(latents, dim=2), video, list(record)

    def use_student(self, timesteps, shift=0.0):
        if timesteps is not None:
            raise ConfigError(f"model={self.spec.name}: the Animate sampler has no distilled-adapter schedule")
