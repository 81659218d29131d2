"""Sampling videos through the diffusers pipeline, and the numbers that judge them: shared by ``wanexp.cli.sample``
(a LoRA file on disk) and the validation callback (the run's own, already loaded transformers).

- A distilled LoRA (``objective=dmd``) samples on exactly its student steps with no CFG (:func:`student_scheduler`);
  anything else with the pipeline's scheduler, ``steps`` and ``guidance``.
- :func:`expert_routing` decides which A14B expert (adapter on or off) serves each step, as training routed them;
  :func:`use_routing` applies it to a pipeline.
- :func:`generate` returns the latents, the decoded video in [0, 1] and the timesteps the transformer saw; the same
  seed gives the same sample (a student scheduler's re-noising draws from the seed's generator).
- :func:`psnr`, :func:`ssim`: the student-teacher gap of decoded frames.
- :func:`heldout_loss`: the flow-matching loss on held-out samples at fixed sigmas with fixed noise (deterministic:
  the same weights give the same number, so sweep points compare).
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch


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


def lora_header(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


# ---- an adapter file into a diffusers pipeline --------------------------------------------------------------------
def load_adapter(pipe, path: Path, adapter_name: str, transformer_2: bool = False) -> str:
    """Load an adapter file into ``pipe``'s transformer (``transformer_2``: the A14B low-noise expert's) as
    ``adapter_name``, by the call that loads its kind in diffusers (docs/adapters.md, "Files and loaders"); returns
    that call's name:

    - a LoRA (any naming diffusers' Wan converter reads) or a peft-named DoRA: ``pipe.load_lora_weights``;
    - a peft-named LoKr (the ``_diffusers`` file): the transformer's ``load_lora_adapter`` with the LoKrConfig of the
      file's ``lora_adapter_metadata`` (the pipeline's loader wants "lora" in every key; ``...to_q.lokr_w1`` has none).
      ``use_safetensors=True``: without it diffusers 0.42 reads the file without its header and takes alpha = rank;
    - anything else (LoHa, which diffusers has no loader for; a ComfyUI-named LoKr or DoRA): through peft by
      :func:`wanexp.lora.load_adapter_file`."""
    from safetensors import safe_open

    from wanexp.lora import is_typed_adapter_file, load_adapter_file

    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
    transformer = pipe.transformer_2 if transformer_2 else pipe.transformer
    if not is_typed_adapter_file(path) or any(".lora_magnitude_vector" in k for k in keys):
        pipe.load_lora_weights(str(path), adapter_name=adapter_name, load_into_transformer_2=transformer_2)
        return "pipe.load_lora_weights"
    if all(k.startswith("transformer.") for k in keys) and any(".lokr_" in k for k in keys):
        transformer.load_lora_adapter(str(path), prefix="transformer", adapter_name=adapter_name, use_safetensors=True)
        return "load_lora_adapter"
    load_adapter_file(transformer, path, adapter_name, what=f"--lora {path}")
    return "wanexp.lora.load_adapter_file"


def run_adapter_files(folder: Path) -> list[Path]:
    """The adapter files of an export folder (a run's ``lora/final``) to sample with, one per trained expert: its
    ``_diffusers`` file, else (a LoHa) its ``_comfyui`` file."""
    comfy = sorted(Path(folder).glob("*_comfyui.safetensors"))
    diffusers = [p.with_name(p.name.replace("_comfyui.", "_diffusers.")) for p in comfy]
    return [d if d.is_file() else c for c, d in zip(comfy, diffusers)]


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Peak signal-to-noise ratio (dB) of two videos with values in [0, 1] (torchmetrics; inf when identical)."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    return float(peak_signal_noise_ratio(a.float(), b.float(), data_range=1.0))


def ssim(a: torch.Tensor, b: torch.Tensor, chunk: int = 8) -> float:
    """Mean SSIM over the frames of two videos (F, H, W, C in [0, 1], frames of at least 6 pixels a side):
    torchmetrics' SSIM (Gaussian window 11x11, sigma 1.5, K1=0.01, K2=0.03, the borders mirrored). ``chunk`` frames
    at a time: the filtered maps of a whole 704x1280 video would take several GiB."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    x, y = a.float().permute(0, 3, 1, 2), b.float().permute(0, 3, 1, 2)
    per_frame = [structural_similarity_index_measure(x[i:i + chunk], y[i:i + chunk], data_range=1.0,
                                                     reduction="none") for i in range(0, x.shape[0], chunk)]
    return float(torch.cat(per_frame).mean())


def to_uint8(video: torch.Tensor):
    """A (F, H, W, 3) video in [0, 1] as uint8 frames for :func:`wanexp.data.media.write_video`."""
    return (video.numpy() * 255).round().astype("uint8")


def write_mp4(path: Path, video: torch.Tensor, fps: int) -> None:
    from wanexp.data.media import write_video

    write_video(path, to_uint8(video), fps=fps)


def strip_frames(video: torch.Tensor):
    """The first, middle and last frames of a (F, H, W, 3) video in [0, 1], side by side, as uint8 (quantised as
    :func:`write_mp4` writes them): one half of a row of :func:`write_strip`. Small enough to keep between calls."""
    import numpy as np

    frames = to_uint8(video[[0, video.shape[0] // 2, video.shape[0] - 1]].float().cpu())
    return np.concatenate(list(frames), axis=1)


def write_strip(path: Path, rows: list[tuple], labels: list[str] | None = None) -> None:
    """A PNG of before/after pairs: one row per (base, LoRA) pair of :func:`strip_frames`, the base's three frames
    then the LoRA's; rows of narrower shapes are padded with black. ``labels``: one per row (its video and prompt),
    written in a band above the row with what each half's frames are (:func:`label_band`). Written to a temporary
    name, then renamed: a viewer never sees half a file."""
    import numpy as np
    from PIL import Image

    lines = [np.concatenate(pair, axis=1) for pair in rows]  # a pair: the same prompt, seed and shape
    if labels is not None:
        lines = [np.concatenate([label_band(line.shape, label), line]) for line, label in zip(lines, labels)]
    width = max(x.shape[1] for x in lines)
    grid = np.concatenate([np.pad(x, ((0, 0), (0, width - x.shape[1]), (0, 0))) for x in lines], axis=0)
    tmp = path.with_name(path.name + ".tmp")
    try:
        Image.fromarray(grid).save(tmp, format="PNG")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)  # a failed save (a full disk) leaves no temporary file


def label_band(shape: tuple, label: str):
    """A black band of white text to put above a strip row of ``shape`` (H, W, 3): ``label`` on its first line, then
    over each of the row's six frames which it is ("base first" ... "LoRA last"). The text is sized to the row's
    height (10 to 36 px: legible on a 64-pixel demo frame and on a 704-pixel one) and cut to fit its space."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    height, width = shape[0], shape[1]
    size = max(10, min(36, height // 16))
    font, pad = ImageFont.load_default(size), size // 3 + 2
    band = Image.new("RGB", (width, 2 * (size + pad) + pad))
    draw = ImageDraw.Draw(band)

    def fit(text: str, room: float) -> str:
        while len(text) > 1 and draw.textlength(text, font=font) > room:
            text = text[:-2] + "…"  # one character fewer, then the ellipsis
        return text

    draw.text((pad, pad), fit(label, width - 2 * pad), fill="white", font=font)
    frame = width / 6
    columns = [f"{who} {which}" for who in ("base", "LoRA") for which in ("first", "middle", "last")]
    for k, text in enumerate(columns):
        draw.text((round(k * frame) + pad, size + 2 * pad), fit(text, frame - pad), fill="white", font=font)
    return np.asarray(band)


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


def generate(pipe, prompt, seed, s, steps, guidance, negative, device, record, image=None, embeds=None):
    """One sample: (latents fp32 on the CPU, video (F, H, W, 3) in [0, 1] on the CPU, the timesteps recorded).

    ``s``: height, width, frames, text_len. ``image``: the first frame (PIL) for an image-to-video pipeline.
    ``embeds``: the (prompt, negative prompt) UMT5 embeddings, each (text_len, D), for a pipeline built without its
    text encoder (validation reads them from the cache). The decode is tiled (:func:`tiled`)."""
    from wanexp.models.wan22.encoders import decode_latents

    record.clear()
    g = torch.Generator(device="cpu").manual_seed(seed)
    if hasattr(pipe.scheduler, "noise_generator"):  # a student scheduler re-noises from this sample's stream too
        pipe.scheduler.noise_generator = g
    extra = {} if image is None else {"image": image}
    if embeds is None:
        extra.update(prompt=prompt, negative_prompt=negative)
    else:
        extra.update(prompt_embeds=embeds[0][None].to(device), negative_prompt_embeds=embeds[1][None].to(device))
    latents = pipe(height=s["height"], width=s["width"],
                   num_frames=s["frames"], num_inference_steps=steps, guidance_scale=guidance, generator=g,
                   output_type="latent", max_sequence_length=s["text_len"], **extra).frames
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


# ---- which expert serves each sampling step -----------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertRouting:
    """How the Wan pipeline routes the sampling steps: ``transformer`` serves the steps with t >= 1000 *
    ``boundary_ratio`` (every step when it is None), ``transformer_2`` the others, as diffusers' Wan pipelines do;
    the steps on an expert in ``adapted`` run with the trained adapter on."""

    transformer: str
    transformer_2: str | None
    boundary_ratio: float | None
    adapted: tuple[str, ...]

    @property
    def experts(self) -> list[str]:
        """The experts a sample needs in memory."""
        return [e for e in (self.transformer, self.transformer_2) if e is not None]

    def plan(self, timesteps) -> list[tuple[str, bool]]:
        """(expert, adapter on) of the steps at these timesteps (0..1000)."""
        experts = [self.transformer if self.boundary_ratio is None or t >= self.boundary_ratio * 1000
                   else self.transformer_2 for t in timesteps]
        return [(e, e in self.adapted) for e in experts]


def expert_routing(experts, boundary_ratio: float | None, trained, distilled: bool) -> ExpertRouting:
    """Which expert serves each sampling step of an adapter trained on the experts ``trained`` (the run's
    ``spec.trained_experts(boundary)``; [] for the base model) of a model with ``experts`` (``spec.experts``) and
    ``boundary_ratio``. ``distilled``: the objective samples on its student steps (``student_steps()`` is set: DMD).

    Sampling routes as training did. Training sends a noise level to an expert by its shifted sigma (high when
    sigma >= boundary_ratio) only when the run holds both experts (boundary=full); a one-expert run (boundary=high or
    low) sends every noise level it trains to its one expert. Hence:

    - not distilled: the usual routing by the boundary. A one-expert adapter learned only its side of the boundary, so
      the other side runs on the other expert's base weights: boundary=low samples t >= boundary on the base high
      expert and the rest on low + LoRA; boundary=high samples high + LoRA above, the base low expert below;
    - distilled, one expert (boundary=high or low): the student's rollout ran every student step, whatever its
      sigma, on that expert with the generator adapter, so every sampling step runs there with the LoRA (the
      other expert is not needed);
    - distilled, boundary=full: the student steps routed by the boundary, as in the rollout;
    - a dense model (TI2V-5B): every step on it.
    """
    trained = tuple(trained)
    if list(experts) == ["dense"]:
        return ExpertRouting("dense", None, None, trained)
    if distilled and len(trained) == 1:
        return ExpertRouting(trained[0], None, None, trained)
    return ExpertRouting("high", "low", boundary_ratio, trained)


def pipeline_experts(pipe) -> dict:
    """Expert name -> transformer of a Wan pipeline as loaded (``high``/``low`` for A14B, else ``dense``)."""
    second = getattr(pipe, "transformer_2", None)
    return {"dense": pipe.transformer} if second is None else {"high": pipe.transformer, "low": second}


@contextmanager
def use_routing(pipe, routing: ExpertRouting, modules: dict):
    """Run ``pipe`` routed by ``routing`` (``modules``: expert name -> transformer); restored on exit. One expert
    for every step is the pipeline's ``transformer`` with no boundary (``transformer_2`` is then never called)."""
    saved = pipe.transformer, getattr(pipe, "transformer_2", None), pipe.config.boundary_ratio
    pipe.transformer = modules[routing.transformer]
    if routing.transformer_2 is not None:
        pipe.transformer_2 = modules[routing.transformer_2]
    pipe.register_to_config(boundary_ratio=routing.boundary_ratio)
    try:
        yield pipe
    finally:
        pipe.transformer, pipe.transformer_2 = saved[0], saved[1]
        pipe.register_to_config(boundary_ratio=saved[2])


@contextmanager
def recorded_experts(modules: dict):
    """Collect (expert name, adapter on) of each transformer call of ``modules`` (name -> transformer) into the
    yielded list: which expert served each call, and whether an adapter (of any kind) was active in it then."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    record: list[tuple[str, bool]] = []

    def holds(layer, name) -> bool:  # lora_A, lokr_w1, hada_w1_a ...: the layer's parameters of its kind
        return any(name in getattr(layer, attr, {}) for attr in layer.adapter_layer_names)

    def hook_for(name, layers):
        def hook(module, a, kw):
            record.append((name, any(not layer.disable_adapters and any(holds(layer, n) for n in layer.active_adapters)
                                     for layer in layers)))
        return hook

    handles = [m.register_forward_pre_hook(hook_for(name, [x for x in m.modules() if isinstance(x, BaseTunerLayer)]),
                                           with_kwargs=True) for name, m in modules.items()]
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


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
    two = "high" in transformers and "low" in transformers
    kwargs = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                  transformer=transformers["high"] if two else next(iter(transformers.values())),
                  transformer_2=transformers["low"] if two else None,
                  boundary_ratio=spec.boundary_ratio if two else None,
                  expand_timesteps=bool(spec.pipeline_extras.get("expand_timesteps", False)))
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


def condition_image(path: str | Path, height: int, width: int):
    """A user's image (``wanexp-sample --image``, ``callbacks.validation.images``) as the first frame of a
    height x width sample, as a PIL image: resized to cover and centre-cropped as training crops its clips
    (``wanexp.data.media.load_clip``). Not an image file, missing or unreadable: a MediaError (one line)."""
    from wanexp.data.media import load_clip
    from wanexp.data.metadata import IMAGE_EXTENSIONS, media_kind
    from wanexp.errors import MediaError

    if media_kind(path) != "image":
        raise MediaError(f"{path}: not an image file (one of {', '.join(sorted(IMAGE_EXTENSIONS))})")
    if not Path(path).is_file():
        raise MediaError(f"{path}: file not found")
    return first_frame_image(load_clip(path, 1, height, width))


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
    ``encoders`` (wanexp.models.encoders.Encoders)."""
    from wanexp.models.encoders import cached_batch

    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    if "latents" in batch:
        return cached_batch(batch)
    return encoders(batch)


def encode_prompts(spec, prompts: list[str], device, encoders=None) -> dict[str, torch.Tensor]:
    """Each prompt's UMT5 embedding (text_len, D), on the CPU: with ``encoders``' text encoder, else with the one in
    model.path, loaded for this call and freed after it."""
    from wanexp.models.wan22.encoders import encode_text

    if encoders is not None:
        te, tok = encoders.text_encoder, encoders.tokenizer
    else:
        te, tok = spec.load_text_encoder().to(device), spec.load_tokenizer()
    with torch.no_grad(), torch.autocast(device_type=torch.device(device).type, enabled=False):
        emb = encode_text(tok, te, list(prompts), spec.text_len)
    return {p: e.cpu() for p, e in zip(prompts, emb)}


def make_encoders(vae, text_encoder, tokenizer, spec):
    from wanexp.models.wan22.encoders import WanEncoders as Encoders

    return Encoders(vae, text_encoder, tokenizer, spec.text_len, spec.needs_image_latent)
