"""Wan2.2's sampling pipeline: diffusers' WanPipeline / WanImageToVideoPipeline around the loaded modules, its
student scheduler for a distilled adapter, the expert routing over ``transformer``/``transformer_2``, the adapter
loaders of each kind, and the tiled decode (``WanSpec.load_pipeline`` / ``WanSpec.make_pipeline`` return a
:class:`WanPipelineRunner`, the family's :class:`wanexp.models.pipeline.Pipeline`)."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from wanexp.models.pipeline import Pipeline


def student_scheduler(timesteps: list[float], shift: float):
    """diffusers' flow-matching Euler scheduler with stochastic sampling on fixed student steps: at each step
    x0 = x_t - sigma v, then x_next = (1 - sigma_next) x0 + sigma_next noise (the DMD rollout of training).

    The pipeline calls ``step`` without a generator, so the re-noising would draw from the global one: the scheduler
    draws from its ``noise_generator`` instead, which :func:`generate` sets to the sample's seeded generator (same
    seed, same video)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    class StudentScheduler(FlowMatchEulerDiscreteScheduler):
        noise_generator: torch.Generator | None = None

        def set_timesteps(self, num_inference_steps=None, device=None, **kwargs):
            super().set_timesteps(sigmas=[t / 1000.0 for t in timesteps], device=device)

        def step(self, *args, generator=None, **kwargs):
            return super().step(*args, generator=self.noise_generator if generator is None else generator, **kwargs)

    return StudentScheduler(num_train_timesteps=1000, shift=shift, stochastic_sampling=True)


def load_adapter(pipe, path: Path, adapter_name: str, transformer_2: bool = False) -> str:
    """Load an adapter file into ``pipe``'s transformer (``transformer_2``: the A14B low-noise expert's) as
    ``adapter_name``, by the call that loads its kind in diffusers (docs/adapters.md, "Files and loaders"); returns
    that call's name:

    - a LoRA (any naming diffusers' Wan converter reads) or a peft-named DoRA: ``pipe.load_lora_weights``;
    - a peft-named LoKr (the ``_diffusers`` file): the transformer's ``load_lora_adapter`` with the LoKrConfig of the
      file's ``lora_adapter_metadata`` (the pipeline's loader wants "lora" in every key; ``...to_q.lokr_w1`` has none).
      ``use_safetensors=True``: without it diffusers 0.42 reads the file without its header and takes alpha = rank;
    - anything else (LoHa, which diffusers has no loader for; a ComfyUI-named LoKr or DoRA): through peft by
      ``wanexp.adapters.load_adapter_file``."""
    from safetensors import safe_open

    from wanexp.adapters import is_typed_adapter_file, load_adapter_file
    from wanexp.models.wan22.adapter_naming import WAN_NAMING

    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
    transformer = pipe.transformer_2 if transformer_2 else pipe.transformer
    if not is_typed_adapter_file(path) or any(".lora_magnitude_vector" in k for k in keys):
        pipe.load_lora_weights(str(path), adapter_name=adapter_name, load_into_transformer_2=transformer_2)
        return "pipe.load_lora_weights"
    if all(k.startswith("transformer.") for k in keys) and any(".lokr_" in k for k in keys):
        transformer.load_lora_adapter(str(path), prefix="transformer", adapter_name=adapter_name, use_safetensors=True)
        return "load_lora_adapter"
    load_adapter_file(transformer, path, WAN_NAMING, adapter_name, what=f"--lora {path}")
    return "wanexp.adapters.load_adapter_file"


@contextmanager
def recorded_timesteps(pipe):
    """Collect the timestep each transformer call of ``pipe`` gets (the last token's: a clean TI2V first frame has
    0), into the yielded list; the hooks are removed on exit."""
    record: list[float] = []

    def hook(module, a, kw):
        t = kw.get("timestep")
        record.append(float(t.flatten()[-1]))

    # one expert in both slots (use_routing) is hooked once
    modules = {id(m): m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None}
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules.values()]
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


def generate(pipe, prompt, seed, s, steps, guidance, negative, device, record, image=None, embeds=None,
             last_image=None, leading_frames=0, **conditions):
    """One sample: (latents fp32 on the CPU, video (F, H, W, 3) in [0, 1] on the CPU, the timesteps recorded).

    ``s``: height, width, frames, text_len. ``image``: the first frame (PIL) for an image-to-video pipeline;
    ``last_image``: its last frame (PIL, first-last-frame: diffusers' ``last_image``); ``conditions``: the pipeline's
    other inputs (VACE's ``video``, ``mask``, ``reference_images``); ``leading_frames``: latent frames the pipeline
    puts before the sample's (VACE's reference images), left out of what is returned and decoded.
    ``embeds``: the (prompt, negative prompt) UMT5 embeddings, each (text_len, D), for a pipeline built without its
    text encoder (validation and wanexp-sample encode them first). The decode is tiled (:func:`tiled`)."""
    from wanexp.models.wan22.encoders import decode_latents

    record.clear()
    g = torch.Generator(device="cpu").manual_seed(seed)
    if hasattr(pipe.scheduler, "noise_generator"):  # a student scheduler re-noises from this sample's stream too
        pipe.scheduler.noise_generator = g
    extra = dict(conditions) if image is None else dict(conditions, image=image)
    if last_image is not None:
        extra["last_image"] = last_image
    if embeds is None:
        extra.update(prompt=prompt, negative_prompt=negative)
    else:
        extra.update(prompt_embeds=embeds[0][None].to(device), negative_prompt_embeds=embeds[1][None].to(device))
    latents = pipe(height=s["height"], width=s["width"],
                   num_frames=s["frames"], num_inference_steps=steps, guidance_scale=guidance, generator=g,
                   output_type="latent", max_sequence_length=s["text_len"], **extra).frames[:, :, leading_frames:]
    vae = pipe.vae
    with torch.no_grad(), tiled(vae):
        pixels = decode_latents(vae, latents.to(device))  # (B, 3, F, H, W) in [-1, 1]
    video = ((pixels[0].permute(1, 2, 3, 0).float() + 1) / 2).clamp(0, 1).cpu()  # (F, H, W, 3)
    return latents.float().cpu(), video, list(record)


@contextmanager
def tiled(vae):
    """The VAE decodes in overlapping spatial tiles inside the block (diffusers' tiling, 256-pixel tiles): a
    704x1280 decode then needs a few GiB instead of most of a 32 GB card. Restored on exit, so the training
    encode (online runs share the VAE) is never tiled."""
    was = getattr(vae, "use_tiling", None)
    if was is None:  # a VAE without tiling support decodes whole
        yield vae
        return
    vae.use_tiling = True
    try:
        yield vae
    finally:
        vae.use_tiling = was


def pipeline_experts(pipe) -> dict:
    """Expert name -> transformer of a Wan pipeline as loaded (``high``/``low`` for A14B, else ``dense``)."""
    second = getattr(pipe, "transformer_2", None)
    return {"dense": pipe.transformer} if second is None else {"high": pipe.transformer, "low": second}


@contextmanager
def use_routing(pipe, routing, modules: dict):
    """Run ``pipe`` routed by ``routing`` (``modules``: expert name -> transformer); restored on exit. One expert
    for every step is the pipeline's ``transformer`` with no boundary (``transformer_2`` is then never called)."""
    saved = pipe.transformer, getattr(pipe, "transformer_2", None), pipe.config.boundary_ratio
    pipe.transformer = modules[routing.upper]
    if routing.lower is not None:
        pipe.transformer_2 = modules[routing.lower]
    pipe.register_to_config(boundary_ratio=routing.boundary_ratio)
    try:
        yield pipe
    finally:
        pipe.transformer, pipe.transformer_2 = saved[0], saved[1]
        pipe.register_to_config(boundary_ratio=saved[2])


def flow_scheduler(shift: float):
    """The UniPC flow-matching scheduler the Wan2.2 diffusers folders ship, at ``flow_shift=shift`` (what a converted
    folder and a tiny build write, and what a run loads when its weights come without a folder)."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                                   num_train_timesteps=1000)


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
    two = "high" in transformers and "low" in transformers
    kwargs = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                  transformer=transformers["high"] if two else next(iter(transformers.values())),
                  transformer_2=transformers["low"] if two else None,
                  boundary_ratio=spec.boundary_ratio if two else None, **spec.pipeline_extras)
    cls = pipeline_class(spec.image_pipeline_class if image else spec.pipeline_class)  # the family's
    if image:
        kwargs.update(image_processor=None, image_encoder=None)
    pipe = cls(**kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_class(name: str):
    """The diffusers pipeline class ``name`` (a spec's ``pipeline_class`` or ``image_pipeline_class``). diffusers'
    Wan image-to-video module imports transformers' ``CLIPImageProcessor`` for Wan2.1's CLIP image encoder, which
    Wan2.2 has none of (its pipelines are built without an image processor); transformers without torchvision
    resolves that name to ``CLIPImageProcessorPil`` and logs a warning. The name is bound to that class first, as
    transformers' message advises (a direct import), so the import finds it and nothing is logged."""
    import importlib.util
    import sys

    if importlib.util.find_spec("torchvision") is None:
        from transformers import CLIPImageProcessorPil

        live = sys.modules["transformers"]  # that import may have re-created the module (processing_utils does)
        if "CLIPImageProcessor" not in vars(live):
            live.CLIPImageProcessor = CLIPImageProcessorPil
    import diffusers

    return getattr(diffusers, name)


class WanPipelineRunner(Pipeline):
    """A diffusers Wan pipeline as the family's :class:`~wanexp.models.pipeline.Pipeline`."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.experts = pipeline_experts(pipe)
        self.boundary_ratio = pipe.config.boundary_ratio
        self.default_scheduler = pipe.scheduler
        self._record: list | None = None

    def generate(self, prompt, seed, shape, steps, guidance, negative, device, record, image=None, embeds=None,
                 inputs=None):
        return generate(self.pipe, prompt, seed, shape, steps, guidance, negative, device, record, image, embeds)

    def recorded_timesteps(self):
        return recorded_timesteps(self.pipe)

    def routed(self, routing):
        return use_routing(self.pipe, routing, self.experts)

    def load_adapter(self, path, adapter_name, expert):
        return load_adapter(self.pipe, path, adapter_name, transformer_2=expert == "low")

    def adapters_on(self, on: bool) -> None:
        (self.pipe.enable_lora if on else self.pipe.disable_lora)()

    def use_student(self, timesteps, shift=0.0) -> None:
        self.pipe.scheduler = self.default_scheduler if timesteps is None else student_scheduler(list(timesteps),
                                                                                                  shift)
