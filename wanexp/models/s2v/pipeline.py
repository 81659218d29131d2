"""S2V's sampler: Wan2.2's speech-to-video generation (``wan/speech2video.py``) over wanexp's modules.

One sample is a sequence of clips of ``clip_frames`` frames (Wan2.2's ``infer_frames``, 80; fewer when the sample
asks for fewer), as many as its audio gives (``wanexp.models.s2v.audio_encoder.clip_count``) and its frame count
needs. Each clip is ``steps`` flow-matching steps of UniPC with the family's shift, classifier-free guidance with
the negative prompt and zeroed audio features as the unconditional branch (the conditional call first). The first
clip drops the motion frames; each later clip is conditioned on the latents of the last 73 frames made so far (zeros
where there are fewer, as the reference starts from encoded zero frames). Decoding follows the reference: the first
clip decodes ``[reference latent, clip]`` and keeps its last ``clip_frames`` frames minus the first 3, a later clip
decodes ``[motion latents, clip]`` and keeps its last ``clip_frames``. The reference image is ``image`` (resized and
center-cropped to the sample's size); without one, a mid-grey frame.
"""
from __future__ import annotations

import numpy as np
import torch

from wanexp.errors import ConfigError
from wanexp.models.pipeline import OneExpertPipeline
from wanexp.models.s2v.original import MOTION_FRAMES
from wanexp.models.wan22.encoders import decode_latents, encode_video

FIRST_CLIP_DROP = 3  # frames the reference drops from the start of the first clip
INFER_FRAMES = 80  # frames per generated clip (Wan2.2's speech2video infer_frames)


def make_scheduler(shift: float):
    """UniPC on flow sigmas shifted by ``shift`` (Wan2.2's FlowUniPCMultistepScheduler, as diffusers has it)."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                                   num_train_timesteps=1000)


def clip_frames(frames: int) -> int:
    """Frames per generated clip for a sample of ``frames`` frames: the reference's 80, or fewer (a multiple of 4)."""
    return max(4, min(INFER_FRAMES, frames) // 4 * 4)


class S2VPipeline(OneExpertPipeline):
    """The S2V DiT (``transformers["dense"]``), the VAE and the scheduler; ``encoders``: an S2VEncoders for prompts
    given as text and the audio encoder (without it, the audio encoder of ``spec.path`` loads when a sample has
    audio)."""

    def __init__(self, spec, transformers: dict, vae, scheduler, encoders=None):
        self.spec, self.experts, self.vae, self.scheduler, self.encoders = spec, dict(transformers), vae, scheduler, \
            encoders
        self._audio_encoder = encoders.audio_encoder if encoders is not None else None

    # ---- inputs ----------------------------------------------------------------------------------------------
    def audio_encoder(self):
        if self._audio_encoder is None:
            self._audio_encoder = self.spec.load_audio_encoder()
        return self._audio_encoder

    def audio_input(self, inputs: dict | None, frames: int, fps: int, clips_wanted: int, device) -> torch.Tensor:
        """(clips, 1, layers, dim, frames) features of the sample's audio; without audio, one clip of zeros (and as
        many as asked)."""
        from wanexp.data.audio import find_audio, read_audio
        from wanexp.models.s2v.audio_encoder import audio_clips

        path = (inputs or {}).get("audio")
        if path is None:
            config = self.experts["dense"].config
            return torch.zeros(clips_wanted, 1, config.audio_layers, config.audio_dim, frames, device=device)
        samples, rate = read_audio(find_audio(path))  # a clip: its same-name audio file, else its own track
        clips = audio_clips(self.audio_encoder(), samples, rate, fps, frames)[:clips_wanted]
        return clips[:, None].to(device)

    def _reference(self, image, height: int, width: int, device) -> torch.Tensor:
        """(1, 3, 1, H, W) in [-1, 1]: the image resized to cover and center-cropped, or mid-grey."""
        from wanexp.data.media import resize_crop

        if image is None:
            return torch.zeros(1, 3, 1, height, width, device=device)
        pixels = torch.from_numpy(np.asarray(image.convert("RGB"))).permute(2, 0, 1)[:, None].float() / 127.5 - 1
        return resize_crop(pixels.permute(1, 0, 2, 3), height, width).permute(1, 0, 2, 3)[None].to(device)

    def soundtrack(self, inputs, frames, fps):
        """The sample's audio from the first frame kept (the first clip's first 3 frames are dropped)."""
        from wanexp.data.audio import find_audio, read_audio

        path = (inputs or {}).get("audio")
        if path is None:
            return None
        samples, rate = read_audio(find_audio(path))
        return samples[round(FIRST_CLIP_DROP / fps * rate):], rate

    # ---- sampling --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt, seed, shape, steps, guidance, negative, device, record, image=None, embeds=None,
                 inputs=None):
        spec, transformer = self.spec, self.experts["dense"]
        dtype = spec.compute_dtype(transformer)
        height, width, fps = shape["height"], shape["width"], shape.get("fps") or spec.fps
        per_clip = clip_frames(shape["frames"])
        wanted = -(-(shape["frames"] + FIRST_CLIP_DROP) // per_clip)
        text = torch.stack(list(embeds)) if embeds is not None else self.encoders.encode_prompts([prompt, negative])
        text = text.to(device, dtype)
        audio = self.audio_input(inputs, per_clip, fps, wanted, device).to(dtype)
        ref_pixels = self._reference(image, height, width, device)
        ref_latents = encode_video(self.vae, ref_pixels)
        last_frames = torch.zeros(1, 3, MOTION_FRAMES, height, width, device=device)
        motion = encode_video(self.vae, last_frames)
        grid = (per_clip // spec.vae_stride[0], height // spec.vae_stride[1], width // spec.vae_stride[2])
        record.clear()
        videos, latents_out = [], []
        for r in range(audio.shape[0]):
            generator = torch.Generator().manual_seed(seed + r)
            x = torch.randn(1, spec.latent_channels, *grid, generator=generator).to(device)
            self.scheduler.set_timesteps(steps, device=device)
            common = dict(ref_latents=ref_latents.to(dtype), motion_latents=None if r == 0 else motion.to(dtype))
            for t in self.scheduler.timesteps:
                record.append(float(t))
                timestep = t.reshape(1).to(device)
                cond, uncond = self.cfg_pair(  # the negative: the negative prompt and zeroed audio
                    lambda: transformer(hidden_states=x.to(dtype), timestep=timestep, encoder_hidden_states=text[:1],
                                        audio_features=audio[r], **common).float(),
                    lambda: transformer(hidden_states=x.to(dtype), timestep=timestep, encoder_hidden_states=text[1:],
                                        audio_features=torch.zeros_like(audio[r]), **common).float())
                x = self.scheduler.step(uncond + guidance * (cond - uncond), t, x).prev_sample
            latents_out.append(x.float().cpu())
            first = r == 0
            pixels = decode_latents(self.vae, torch.cat([ref_latents if first else motion, x], dim=2)).float()
            pixels = pixels[:, :, -per_clip:][:, :, FIRST_CLIP_DROP if first else 0:]
            videos.append(pixels.cpu())
            if r + 1 < audio.shape[0]:  # the last 73 frames made so far are the next clip's motion frames
                keep = min(MOTION_FRAMES, pixels.shape[2])
                last_frames = torch.cat([last_frames[:, :, keep:], pixels[:, :, -keep:].to(device)], dim=2)
                motion = encode_video(self.vae, last_frames)
        latents = torch.cat(latents_out, dim=2)
        video = torch.cat(videos, dim=2)[0, :, :shape["frames"]].permute(1, 2, 3, 0)  # (F, H, W, 3)
        return latents, ((video + 1) / 2).clamp(0, 1), list(record)

    def use_student(self, timesteps, shift=0.0):
        if timesteps is not None:
            raise ConfigError("model=s2v14b: the S2V sampler has no distilled-adapter schedule")
