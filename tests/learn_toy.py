"""A toy video distribution and a tiny Wan DiT that learns it: the learnability checks' shared parts (the CPU test
tests/integration/test_learnability.py and the GPU registry case ``learnability`` run the same code, sized apart).

The data lives in latent space directly (no VAE): C-channel latent videos of F frames on a size x size grid, a
constant background with one square of ``colour`` (a C-vector) that moves one cell right per frame from a random
start. ``hue`` -- the mean of channel 0 minus channel 1 over the whole frame -- tells the colours apart:
``square_area * (c0 - c1)``, +0.5 for colour A and -0.5 for colour B at the CPU size, 0 for the background.

The model is a diffusers ``WanTransformer3DModel`` (the Wan2.2 architecture, tiny), trained through wanexp's own
parts: ``wanexp.objectives.flow_matching.FlowMatching`` for the base and the LoRA (added by
``wanexp.adapters.LoraAdapter``, exported by its ``export``), ``wanexp.objectives.dmd.DMD`` for the few-step student,
and ``wanexp.models.denoiser.Denoiser`` around the transformer. Nothing here writes a loss by hand.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.wan_adapters import LoraAdapter
from wanexp.adapters import use_adapter
from wanexp.models.family import ModelSpec
from wanexp.models.denoiser import Denoiser
from wanexp.models.encoders import EncodedBatch

COLOURS = {"A": (1.0, -1.0, 0.5, 0.0), "B": (-1.0, 1.0, 0.5, 0.0)}  # c0 - c1: +2 and -2
BACKGROUND = -0.5


@dataclass(frozen=True)
class Toy:
    """Sizes of one learnability run (the CPU test's defaults; the GPU case scales them up)."""

    frames: int = 3
    size: int = 8
    square: int = 4
    heads: int = 2
    head_dim: int = 16
    layers: int = 2
    ffn: int = 64
    text_len: int = 4
    text_dim: int = 16
    batch: int = 16
    base_steps: int = 250
    base_lr: float = 4e-3
    lora_steps: int = 100
    lora_lr: float = 1e-2
    lora_rank: int = 8
    dmd_steps: int = 100
    dmd_lr: float = 2e-3  # the critic's
    # DMD2's two-time-scale update: the critic must track the generator's moving samples, or its error -- not the
    # teacher's score -- steers the generator, which then overshoots the teacher's distribution (more saturated
    # squares, falling PSNR). Several critic updates per generator update, and a slower generator.
    dmd_every: int = 4  # critic updates per generator update (objective.generator_every)
    dmd_gen_lr: float = 1e-3
    samples: int = 32
    teacher_steps: int = 50
    student_timesteps: tuple[int, ...] = (1000, 750, 500, 250)
    device: str = "cpu"

    @property
    def channels(self) -> int:
        return len(COLOURS["A"])


# ---- data ------------------------------------------------------------------------------------------------------
def toy_latents(n: int, colour: str, toy: Toy, generator: torch.Generator) -> torch.Tensor:
    """(n, C, F, size, size) videos of one ``colour`` square moving right one cell per frame."""
    x = torch.full((n, toy.channels, toy.frames, toy.size, toy.size), BACKGROUND)
    c = torch.tensor(COLOURS[colour]).view(-1, 1, 1)
    room = toy.size - toy.square
    ys = torch.randint(0, room + 1, (n,), generator=generator)
    xs = torch.randint(0, room - (toy.frames - 1) + 1, (n,), generator=generator)
    for i in range(n):
        for f in range(toy.frames):
            y0, x0 = int(ys[i]), int(xs[i]) + f
            x[i, :, f, y0:y0 + toy.square, x0:x0 + toy.square] = c
    return x.to(toy.device)


def hue(x: torch.Tensor) -> torch.Tensor:
    """Per sample: the mean of channel 0 minus channel 1 over every frame and cell (colour A: > 0, B: < 0)."""
    return (x[:, 0] - x[:, 1]).flatten(1).mean(1)


def profile(x: torch.Tensor) -> torch.Tensor:
    """Each channel's sorted values averaged over the samples, (C, F*H*W): what a set of samples looks like
    wherever its squares are (a position-free summary; the many-step and the 4-step samples share no noise)."""
    return x.flatten(2).sort(dim=2).values.mean(0)


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float) -> float:
    return float(10 * torch.log10(data_range**2 / ((a - b) ** 2).mean()))


# ---- model -----------------------------------------------------------------------------------------------------
class ToySpec:
    """The little of a model spec the Denoiser reads: one dense DiT, text-to-video inputs."""

    name, layout, boundary_ratio = "toy", "toy", None
    gradient_checkpointing, draws_first_frame, needs_image_latent = False, False, False

    route, transformer_call, step_flops = ModelSpec.route, ModelSpec.transformer_call, ModelSpec.step_flops

    def sample_condition(self, cond, batch_size, generator=None):
        return cond

    def compute_dtype(self, transformer) -> torch.dtype:
        return transformer.patch_embedding.weight.dtype  # trained whole from scratch: no frozen weight to read

    def model_inputs(self, x_t, x0, sigma, cond):
        from wanexp.models.wan22.conditioning import t2v_inputs

        return t2v_inputs(x_t, sigma)


def toy_transformer(toy: Toy, seed: int = 0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=toy.heads, attention_head_dim=toy.head_dim,
                                 in_channels=toy.channels, out_channels=toy.channels, text_dim=toy.text_dim,
                                 freq_dim=32, ffn_dim=toy.ffn, num_layers=toy.layers, rope_max_seq_len=64)


def denoiser(transformer) -> Denoiser:
    return Denoiser(ToySpec(), {"dense": transformer}, (0.0, 1.0))


def prompt(toy: Toy) -> torch.Tensor:
    """The one prompt's text embedding (1, text_len, text_dim): fixed, so the model learns the data alone."""
    return torch.randn(1, toy.text_len, toy.text_dim, generator=torch.Generator().manual_seed(7)).to(toy.device)


def flow_matching():
    from wanexp.objectives.flow_matching import FlowMatching

    return FlowMatching(name="flow_matching", timestep={"sampling": "uniform", "shift": 1.0, "logit_mean": 0.0,
                                                          "logit_std": 1.0})


def lora_adapter(rank: int) -> LoraAdapter:
    return LoraAdapter(name="lora", rank=rank, alpha=rank, dropout=0.0, targets=["q", "k", "v", "o", "ffn.0", "ffn.2"],
                       attention=["self", "cross"], init_from=None)


# ---- training ----------------------------------------------------------------------------------------------------
def train_flow_matching(transformer, params, colour: str, toy: Toy, steps: int, lr: float, seed: int) -> list[float]:
    """``steps`` AdamW steps of wanexp's flow-matching objective on fresh toy batches of ``colour`` (the loop the
    demo's base is trained with, wanexp.models.wan22.pretrain.fit_flow_matching)."""
    from wanexp.models.wan22.pretrain import fit_flow_matching

    text = prompt(toy).expand(toy.batch, -1, -1)
    return fit_flow_matching(denoiser(transformer), flow_matching(), params,
                             lambda g: EncodedBatch(toy_latents(toy.batch, colour, toy, g), text, {}), steps, lr, seed)


def train_base(toy: Toy, seed: int = 0):
    """The toy teacher: a tiny Wan DiT trained from scratch on colour A. Returns (transformer, losses)."""
    transformer = toy_transformer(toy, seed).to(toy.device)
    losses = train_flow_matching(transformer, list(transformer.parameters()), "A", toy, toy.base_steps, toy.base_lr,
                                 seed)
    return transformer.requires_grad_(False).eval(), losses


def train_lora(base, toy: Toy, out_dir: Path, seed: int = 1) -> tuple[Path, list[float]]:
    """A LoRA on a copy of ``base`` trained on colour B, exported by wanexp (ComfyUI + diffusers files); returns the
    diffusers file and the losses."""
    import copy

    transformer = copy.deepcopy(base)
    adapter = lora_adapter(toy.lora_rank)
    names = adapter.apply(transformer)
    params = [p for n, p in transformer.named_parameters() if n in set(names)]
    losses = train_flow_matching(transformer, params, "B", toy, toy.lora_steps, toy.lora_lr, seed)
    files = adapter.export(transformer.state_dict(), "", transformer, out_dir, "toy_lora")
    return next(f for f in files if f.name.endswith("_diffusers.safetensors")), losses


def with_lora_file(base, path: Path):
    """A copy of ``base`` with an exported LoRA file loaded the way diffusers' pipelines load it."""
    import copy

    transformer = copy.deepcopy(base)
    transformer.load_lora_adapter(str(path), prefix="transformer", adapter_name="toy")
    return transformer.eval()


def dmd_objective(toy: Toy, generator_every: int = 1):
    from wanexp.objectives.dmd import DMD

    return DMD(name="dmd", timestep={"sampling": "uniform", "shift": 1.0, "logit_mean": 0.0, "logit_std": 1.0},
               student_timesteps=list(toy.student_timesteps), student_shift=1.0, guidance_scale=1.0,
               negative_prompt="", generator_every=generator_every, generator={}, critic={},
               score_sigma_clamp=[0.02, 0.98])


def train_dmd(base, toy: Toy, seed: int = 2):
    """wanexp's DMD on a copy of the toy teacher: generator and critic LoRAs, one AdamW each (lr ``dmd_gen_lr`` and
    ``dmd_lr``), each step trains the adapter the objective's phase names (``dmd_every`` critic steps per generator
    step). Returns (transformer with ``gen`` and ``critic``, objective, losses)."""
    import copy

    transformer = copy.deepcopy(base)
    names = {a: set(lora_adapter(toy.lora_rank).apply(transformer, a)) for a in ("gen", "critic")}
    params = {a: [p for n, p in transformer.named_parameters() if n in names[a]] for a in names}
    lrs = {"gen": toy.dmd_gen_lr, "critic": toy.dmd_lr}
    opts = {a: torch.optim.AdamW(params[a], lr=lrs[a], weight_decay=0.0) for a in params}
    den, objective, text = denoiser(transformer), dmd_objective(toy, toy.dmd_every), prompt(toy)
    g = torch.Generator().manual_seed(seed)
    losses = {"gen": [], "critic": []}
    for step in range(toy.dmd_steps):
        # the generator samples from noise: the batch gives the shape (and the prompt) only
        batch = EncodedBatch(torch.zeros(toy.batch, toy.channels, toy.frames, toy.size, toy.size, device=toy.device),
                             text.expand(toy.batch, -1, -1), {})
        out = objective(batch, den, g, step=step)
        opts[out.adapter].zero_grad(set_to_none=True)
        with use_adapter([transformer], out.adapter):
            out.loss.backward()
        opts[out.adapter].step()
        losses[out.adapter].append(float(out.loss.detach()))
    return transformer, objective, losses


# ---- sampling ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def sample_euler(transformer, toy: Toy, steps: int, seed: int, adapter: str | None = "keep") -> torch.Tensor:
    """``toy.samples`` videos by flow-matching Euler steps from noise (the teacher's sampler); ``adapter``: "keep"
    runs the transformer as it is, None with every adapter off."""
    den, text = denoiser(transformer), prompt(toy).expand(toy.samples, -1, -1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(toy.samples, toy.channels, toy.frames, toy.size, toy.size, generator=g).to(toy.device)
    batch = EncodedBatch(torch.zeros_like(x), text, {})
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    ctx = use_adapter([transformer], None) if adapter is None else _nothing()
    with ctx:
        for i in range(steps):
            v = den(x, sigmas[i].expand(toy.samples), batch).velocity.float()
            x = x + float(sigmas[i + 1] - sigmas[i]) * v
    return x.cpu()


@torch.no_grad()
def sample_student(transformer, objective, toy: Toy, seed: int) -> torch.Tensor:
    """``toy.samples`` videos by the distilled sampler (wanexp's DMD rollout through every student step, adapter
    ``gen``): predict x0, re-noise to the next student sigma with fresh noise, no CFG."""
    text = prompt(toy).expand(toy.samples, -1, -1)
    shape = (toy.samples, toy.channels, toy.frames, toy.size, toy.size)
    batch = EncodedBatch(torch.zeros(shape, device=toy.device), text, {})
    g = torch.Generator().manual_seed(seed)
    x0, _ = objective.rollout(batch, denoiser(transformer), len(toy.student_timesteps) - 1, grad=False, generator=g)
    return x0.cpu()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def strip_frames(videos: dict[str, torch.Tensor], path: Path) -> Path:
    """A PNG of the first, middle and last frame of the first sample of each set (one row per set), channels 0-2
    mapped to RGB from [-1, 1]."""
    from PIL import Image

    rows = []
    for x in videos.values():
        f = x.shape[2]
        frames = [x[0, :3, k] for k in (0, f // 2, f - 1)]
        rows.append(torch.cat([torch.nn.functional.pad(fr, (1, 1, 1, 1), value=1.0) for fr in frames], dim=2))
    grid = torch.cat(rows, dim=1).clamp(-1, 1)
    img = ((grid + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
    scale = max(1, math.ceil(256 / img.shape[1]))
    Image.fromarray(img).resize((img.shape[1] * scale, img.shape[0] * scale), Image.NEAREST).save(path)
    return path


def run_all(toy: Toy, out_dir: Path) -> dict:
    """The three checks in one go (the GPU case): base on A, LoRA on B, DMD student of the base. Writes
    ``strip.png`` (first/middle/last frame of base, LoRA, teacher and 4-step student samples) and returns the
    numbers the checks compare."""
    import copy
    import time

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    base, base_losses = train_base(toy)
    base_x = sample_euler(base, toy, 20, seed=10)
    lora_file, _ = train_lora(base, toy, out_dir)
    lora_x = sample_euler(with_lora_file(base, lora_file), toy, 20, seed=10)
    teacher = sample_euler(base, toy, toy.teacher_steps, seed=11)
    student, objective, _ = train_dmd(base, toy)
    untrained = copy.deepcopy(base)
    lora_adapter(toy.lora_rank).apply(untrained, "gen")
    ref = profile(teacher)
    span = float(ref.max() - ref.min())
    student_x = sample_student(student, objective, toy, seed=12)
    result = {
        "base_loss_first": sum(base_losses[:20]) / 20, "base_loss_last": sum(base_losses[-20:]) / 20,
        "hue_base": float(hue(base_x).mean()), "hue_lora": float(hue(lora_x).mean()),
        "hue_teacher": float(hue(teacher).mean()),
        "psnr_untrained": psnr(profile(sample_student(untrained, objective, toy, seed=12)), ref, span),
        "psnr_student": psnr(profile(student_x), ref, span),
        # the statistic's ceiling: the teacher against itself on other noise (no sampler scores above it)
        "psnr_teacher_reseeded": psnr(profile(sample_euler(base, toy, toy.teacher_steps, seed=13)), ref, span),
        "seconds": time.perf_counter() - t0,
        "strip": str(strip_frames({"base": base_x, "lora": lora_x, "teacher": teacher, "student": student_x},
                                  out_dir / "strip.png")),
    }
    result["psnr_gain"] = result["psnr_student"] - result["psnr_untrained"]
    return result


def main() -> None:
    """``python -m tests.learn_toy --out DIR [--device cuda] [--scale 4]``: the checks larger, results as JSON."""
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=int, default=1, help="grid x2 and steps x scale (1: the CPU test's sizes)")
    a = ap.parse_args()
    k = a.scale
    # k times the DMD steps: the critic gets k times the updates, the generator the same total movement (its lr / k).
    # Past that movement the generator overshoots the teacher (measured at the CPU size, 300 steps: 38.2 dB with
    # lr 1e-3 / 3, 33.2 dB with lr 1e-3 and 9 critic updates per generator update).
    toy = Toy(device=a.device) if k == 1 else Toy(
        frames=5, size=16, square=6, heads=4, head_dim=32, layers=4, ffn=256, batch=64, base_steps=250 * k,
        lora_steps=100 * k, dmd_steps=100 * k, dmd_gen_lr=Toy.dmd_gen_lr / k, samples=64, device=a.device)
    result = run_all(toy, Path(a.out))
    (Path(a.out) / "learnability.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()


__all__ = ["Toy", "hue", "profile", "psnr", "sample_euler", "sample_student", "strip_frames", "toy_latents",
           "train_base", "train_dmd", "train_lora", "with_lora_file"]
