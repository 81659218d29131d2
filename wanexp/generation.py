"""Sampling videos through a model family's pipeline, and the numbers that judge them: shared by
``wanexp.cli.sample`` (adapter files on disk) and the validation callback (the run's own, already loaded
transformers).

- The family's spec builds the pipeline (``ModelSpec.load_pipeline`` from its folder, ``ModelSpec.make_pipeline``
  around modules in memory): a ``wanexp.models.pipeline.Pipeline``, which samples one video per call, loads
  adapter files, routes its steps over the experts and records the timesteps its transformer sees.
- A distilled adapter (``objective=dmd``) samples on exactly its student steps with no CFG (the pipeline's
  ``use_student``); anything else with the pipeline's scheduler, ``steps`` and ``guidance``.
- :func:`expert_routing` decides which expert (adapter on or off) serves each step, as training routed them.
- :func:`psnr`, :func:`ssim`: the student-teacher gap of decoded frames.
- :func:`heldout_loss`: the flow-matching loss on held-out samples at fixed sigmas with fixed noise (deterministic:
  the same weights give the same number, so sweep points compare).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch


def lora_header(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def run_adapter_files(folder: Path, ema: bool = False) -> list[Path]:
    """The adapter files of an export folder (a run's ``lora/final``) to sample with, one per trained expert: its
    ``_diffusers`` file, else (a LoHa) its ``_comfyui`` file; the raw weights', or with ``ema`` the EMA's
    (``callbacks.ema``: the files whose header says ``wanexp_weights=ema``)."""
    comfy = [p for p in sorted(Path(folder).glob("*_comfyui.safetensors"))
             if (lora_header(p).get("wanexp_weights") == "ema") == ema]
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


def write_mp4(path: Path, video: torch.Tensor, fps: int, audio=None) -> None:
    """``video`` (F, H, W, 3) in [0, 1] as an mp4 at ``fps``; ``audio``: (samples, rate) muxed in (AAC)."""
    from wanexp.data.media import write_video

    write_video(path, to_uint8(video), fps=fps, audio=audio)


STRIP_COLUMNS = 6  # frames a strip row shows at most: evenly spaced, the first and the last among them
STRIP_TILE = 128  # frames lower than this are enlarged (nearest neighbour, a whole factor) to at least this height


def strip_frames(video: torch.Tensor, columns: int = STRIP_COLUMNS):
    """Up to ``columns`` frames of a (F, H, W, 3) video in [0, 1], evenly spaced from the first to the last, as uint8
    (quantised as :func:`write_mp4` writes them), and their frame numbers: ``(frames (K, H, W, 3), numbers)``, one
    row of :func:`write_strip`. Small enough to keep between calls."""
    import numpy as np

    n = video.shape[0]
    numbers = sorted({int(round(x)) for x in np.linspace(0, n - 1, min(columns, n))})
    return to_uint8(video[numbers].float().cpu()), numbers


@dataclass(frozen=True)
class StripGroup:
    """One video of a strip: a title (its name and prompt), the frame number of each column, and its rows, each a
    label ("base", "LoRA step 500") and that model's frames (K, H, W, 3) uint8 (:func:`strip_frames`)."""

    title: str
    numbers: list
    rows: list


def write_strip(path: Path, groups: list[StripGroup]) -> None:
    """The PNG of :func:`render_strip`, written to a temporary name and renamed: a viewer never sees half a file."""
    from PIL import Image

    tmp = path.with_name(path.name + ".tmp")
    try:
        Image.fromarray(render_strip(groups)[0]).save(tmp, format="PNG")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)  # a failed save (a full disk) leaves no temporary file


STRIP_BACKGROUND = (28, 28, 28)  # between tiles and behind the text (white)


def render_strip(groups: list[StripGroup]):
    """The strip image (H, W, 3) uint8 and where each frame is in it: for each group, its title over a header naming
    each column's frame, then one row per model, its label on the left and its frames to the right, each frame
    enlarged to :data:`STRIP_TILE` pixels high when lower; the groups stacked (narrower ones padded). Text is sized to
    the frames (12 to 36 px), a title wraps over up to three lines. Returns ``(image, boxes)``, ``boxes[(group, row,
    column)] = (top, left, height, width)`` of each frame and ``boxes[(group, "title" | "header" | row)]`` of each
    text."""
    import math

    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    gap = 4
    canvases, boxes = [], {}
    for g, group in enumerate(groups):
        h, w = group.rows[0][1].shape[1:3]
        scale = max(1, math.ceil(STRIP_TILE / h))
        th, tw = h * scale, w * scale
        size = max(12, min(36, th // 8))
        font, pad = ImageFont.load_default(size), size // 2
        probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
        label_w = 2 * pad + max(math.ceil(probe.textlength(label, font=font)) for label, _ in group.rows)
        ncol = len(group.numbers)
        width = label_w + ncol * (tw + gap)
        title = _wrap(probe, group.title, font, width - 2 * pad, lines=3)
        title_h = len(title) * (size + pad) + pad
        head_h = size + pad
        height = title_h + head_h + len(group.rows) * (th + gap)
        img = Image.new("RGB", (width, height), STRIP_BACKGROUND)
        draw = ImageDraw.Draw(img)
        for i, line in enumerate(title):
            draw.text((pad, pad + i * (size + pad)), line, fill="white", font=font)
        boxes[(g, "title")] = (0, 0, title_h, width)
        boxes[(g, "header")] = (title_h, label_w, head_h, width - label_w)
        for c, number in enumerate(group.numbers):
            draw.text((label_w + c * (tw + gap), title_h), _fit(probe, f"frame {number}", font, tw), fill="white",
                      font=font)
        for r, (label, frames) in enumerate(group.rows):
            top = title_h + head_h + r * (th + gap)
            draw.text((pad, top + (th - size) // 2), label, fill="white", font=font)
            boxes[(g, r)] = (top, 0, th, label_w)
            for c in range(ncol):
                left = label_w + c * (tw + gap)
                tile = np.repeat(np.repeat(frames[c], scale, axis=0), scale, axis=1)
                img.paste(Image.fromarray(tile), (left, top))
                boxes[(g, r, c)] = (top, left, th, tw)
        canvases.append(np.asarray(img))
    width = max(x.shape[1] for x in canvases)
    out, offset = [], 0
    for g, x in enumerate(canvases):
        for key in [k for k in boxes if k[0] == g]:
            top, left, bh, bw = boxes[key]
            boxes[key] = (top + offset, left, bh, bw)
        padded = np.empty((x.shape[0] + 2 * gap, width, 3), dtype=np.uint8)
        padded[:] = STRIP_BACKGROUND
        padded[:x.shape[0], :x.shape[1]] = x
        out.append(padded)
        offset += padded.shape[0]
    return np.concatenate(out), boxes


def _fit(draw, text: str, font, room: float) -> str:
    """``text`` cut (with an ellipsis) to ``room`` pixels."""
    while len(text) > 1 and draw.textlength(text, font=font) > room:
        text = text[:-2] + "…"  # one character fewer, then the ellipsis
    return text


def _wrap(draw, text: str, font, room: float, lines: int) -> list[str]:
    """``text`` over at most ``lines`` lines of ``room`` pixels, broken at spaces; the last one cut to fit."""
    out: list[str] = []
    words = text.split(" ")
    while words and len(out) < lines - 1:
        k = len(words)
        while k > 1 and draw.textlength(" ".join(words[:k]), font=font) > room:
            k -= 1
        out.append(_fit(draw, " ".join(words[:k]), font, room))
        words = words[k:]
    if words:
        out.append(_fit(draw, " ".join(words), font, room))
    return out


# ---- which expert serves each sampling step -----------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertRouting:
    """How a sampling pipeline routes its steps over a model's experts: ``upper`` serves the steps with t >= 1000 *
    ``boundary_ratio`` (every step when it is None), ``lower`` the others; the steps on an expert in ``adapted`` run
    with the trained adapter on."""

    upper: str
    lower: str | None
    boundary_ratio: float | None
    adapted: tuple[str, ...]

    @property
    def experts(self) -> list[str]:
        """The experts a sample needs in memory."""
        return [e for e in (self.upper, self.lower) if e is not None]

    def plan(self, timesteps) -> list[tuple[str, bool]]:
        """(expert, adapter on) of the steps at these timesteps (0..1000)."""
        experts = [self.upper if self.boundary_ratio is None or t >= self.boundary_ratio * 1000
                   else self.lower for t in timesteps]
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
    - a dense model: every step on it.
    """
    experts, trained = list(experts), tuple(trained)
    if len(experts) == 1:
        return ExpertRouting(experts[0], None, None, trained)
    if distilled and len(trained) == 1:
        return ExpertRouting(trained[0], None, None, trained)
    upper, lower = experts  # a two-expert model lists its high-noise expert first (model.experts)
    return ExpertRouting(upper, lower, boundary_ratio, trained)


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
    from wanexp.adapters import use_adapter

    with use_adapter(modules, name):
        yield


def encode_batch(batch: dict, encoders, device) -> "object":
    """A loader batch on ``device`` as an EncodedBatch: cached latents and text as they are, else through
    ``encoders`` (the family's Encoders)."""
    from wanexp.models.encoders import cached_batch

    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    if "latents" in batch:
        return cached_batch(batch)
    return encoders(batch)
