"""Sampling videos through the diffusers pipeline, and the numbers that judge them: shared by ``wanexp.cli.sample``
(a LoRA file on disk) and the validation callback (the run's own, already loaded transformers).

- A distilled LoRA (``objective=dmd``) samples on exactly its student steps with no CFG (:func:`student_scheduler`);
  anything else with the pipeline's scheduler, ``steps`` and ``guidance``.
- :func:`generate` returns the latents, the decoded video in [0, 1] and the timesteps the transformer saw.
- :func:`psnr`, :func:`ssim`: the student-teacher gap of decoded frames.
- :func:`heldout_loss`: the flow-matching loss on held-out samples at fixed sigmas with fixed noise (deterministic:
  the same weights give the same number, so sweep points compare).
"""
from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch


def student_scheduler(timesteps: list[float], shift: float):
    """diffusers' flow-matching Euler scheduler with stochastic sampling on fixed student steps: at each step
    x0 = x_t - sigma v, then x_next = (1 - sigma_next) x0 + sigma_next noise (the DMD rollout of training)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    class StudentScheduler(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
            super().set_timesteps(sigmas=[t / 1000.0 for t in timesteps], device=device)

    return StudentScheduler(num_train_timesteps=1000, shift=shift, stochastic_sampling=True)


def lora_header(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Peak signal-to-noise ratio (dB) of two videos with values in [0, 1]."""
    mse = float(((a.float() - b.float()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 7) -> float:
    """Mean SSIM over frames (F, H, W, C in [0, 1]), a uniform window, the usual constants (K1=0.01, K2=0.03)."""
    x = a.float().permute(0, 3, 1, 2)
    y = b.float().permute(0, 3, 1, 2)
    window = min(window, x.shape[-1], x.shape[-2])
    pool = torch.nn.functional.avg_pool2d
    mx, my = pool(x, window, 1), pool(y, window, 1)
    vx, vy = pool(x * x, window, 1) - mx**2, pool(y * y, window, 1) - my**2
    cxy = pool(x * y, window, 1) - mx * my
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(s.mean())


def to_uint8(video: torch.Tensor):
    """A (F, H, W, 3) video in [0, 1] as uint8 frames for :func:`wanexp.data.media.write_video`."""
    return (video.numpy() * 255).round().astype("uint8")


def write_mp4(path: Path, video: torch.Tensor, fps: int) -> None:
    from wanexp.data.media import write_video

    write_video(path, to_uint8(video), fps=fps)


@contextmanager
def recorded_timesteps(pipe):
    """Collect the timestep each transformer call of ``pipe`` gets (the last token's: a clean TI2V first frame has
    0), into the yielded list; the hooks are removed on exit."""
    record: list[float] = []

    def hook(module, a, kw):
        t = kw.get("timestep")
        record.append(float(t.flatten()[-1]))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True)
               for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


def generate(pipe, prompt, seed, s, steps, guidance, negative, device, record, image=None):
    """One sample: (latents fp32 on the CPU, video (F, H, W, 3) in [0, 1] on the CPU, the timesteps recorded).

    ``s``: height, width, frames, text_len. ``image``: the first frame (PIL) for an image-to-video pipeline."""
    from wanexp.models.encode import decode_latents

    record.clear()
    g = torch.Generator(device="cpu").manual_seed(seed)
    extra = {} if image is None else {"image": image}
    latents = pipe(prompt=prompt, negative_prompt=negative, height=s["height"], width=s["width"],
                   num_frames=s["frames"], num_inference_steps=steps, guidance_scale=guidance, generator=g,
                   output_type="latent", max_sequence_length=s["text_len"], **extra).frames
    vae = pipe.vae
    with torch.no_grad():
        pixels = decode_latents(vae, latents.to(device))  # (B, 3, F, H, W) in [-1, 1]
    video = ((pixels[0].permute(1, 2, 3, 0).float() + 1) / 2).clamp(0, 1).cpu()  # (F, H, W, 3)
    return latents.float().cpu(), video, list(record)


# ---- a pipeline around transformers already in memory -------------------------------------------------------------
def load_scheduler(model_path: str | Path):
    """The scheduler the model folder ships (model_index.json names its class)."""
    import diffusers

    index = json.loads((Path(model_path) / "model_index.json").read_text())
    name = (index.get("scheduler") or [None, "FlowMatchEulerDiscreteScheduler"])[1]
    return getattr(diffusers, name).from_pretrained(str(model_path), subfolder="scheduler")


def build_pipeline(spec, transformers: dict, vae, text_encoder, tokenizer, scheduler, image: bool):
    """A diffusers Wan pipeline object around modules already in memory (nothing is loaded or copied).

    ``transformers``: expert name -> transformer (``dense``, or ``high`` and ``low``). ``image``: an image-to-video
    pipeline (I2V-A14B always; TI2V-5B with a first frame)."""
    import diffusers

    two = "high" in transformers and "low" in transformers
    kwargs = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                  transformer=transformers["high"] if two else next(iter(transformers.values())),
                  transformer_2=transformers["low"] if two else None,
                  boundary_ratio=spec.boundary_ratio if two else None,
                  expand_timesteps=bool(spec.pipeline_extras.get("expand_timesteps", False)))
    cls = diffusers.WanImageToVideoPipeline if image else diffusers.WanPipeline
    if image:
        kwargs.update(image_processor=None, image_encoder=None)
    pipe = cls(**kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def first_frame_image(pixels: torch.Tensor):
    """A clip's first frame ((3, F, H, W) or (3, H, W) in [-1, 1]) as a PIL image."""
    from PIL import Image

    frame = pixels[:, 0] if pixels.ndim == 4 else pixels
    arr = ((frame.permute(1, 2, 0).float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    return Image.fromarray(arr)


# ---- the held-out loss --------------------------------------------------------------------------------------------
@torch.no_grad()
def heldout_loss(denoiser, batches, sigmas: list[float], seed: int = 0) -> dict[str, float]:
    """The flow-matching loss (velocity target noise - x0, the loss mask applied) of each held-out sample at each of
    ``sigmas``, with noise drawn from a generator seeded by (seed, sample, sigma): the same weights give the same
    value on any device count. Returns ``{"loss": mean, "loss_s<100 sigma>": mean at that sigma, "samples": n}``.

    ``batches``: EncodedBatch objects of one sample each (in a fixed order)."""
    from wanexp.objectives.flow_matching import add_noise, masked_mse, velocity_target

    per_sigma: dict[float, list[float]] = {s: [] for s in sigmas}
    n = 0
    for i, batch in enumerate(batches):
        x0 = batch.x0
        for j, s in enumerate(sigmas):
            g = torch.Generator().manual_seed(seed * 1_000_003 + i * 1009 + j)
            noise = torch.randn(x0.shape, generator=g, dtype=torch.float32).to(x0.device, x0.dtype)
            sigma = torch.full((x0.shape[0],), float(s), dtype=torch.float32)
            pred = denoiser(add_noise(x0, noise, sigma.to(x0.device)), sigma, batch)
            per_sigma[s].append(float(masked_mse(pred.velocity, velocity_target(x0, noise), pred.loss_mask).mean()))
        n += 1
    if n == 0:
        return {}
    out = {"loss": sum(sum(v) for v in per_sigma.values()) / (n * len(sigmas)), "samples": n}
    for s, v in per_sigma.items():
        out[f"loss_s{round(100 * s):02d}"] = sum(v) / len(v)
    return out


@contextmanager
def adapter(modules, name: str | None):
    """Run ``modules`` under adapter ``name`` (None: the frozen base) without touching requires_grad."""
    from wanexp.lora import use_adapter

    with use_adapter(modules, name):
        yield


def encode_batch(batch: dict, encoders, device) -> "object":
    """A loader batch on ``device`` as an EncodedBatch: cached latents and text as they are, else through
    ``encoders`` (wanexp.models.encode.Encoders)."""
    from wanexp.models.encode import cached_batch

    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    if "latents" in batch:
        return cached_batch(batch)
    return encoders(batch)


def make_encoders(vae, text_encoder, tokenizer, spec):
    from wanexp.models.encode import Encoders

    return Encoders(vae, text_encoder, tokenizer, spec.text_len, spec.needs_image_latent)
