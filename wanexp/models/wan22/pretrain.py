"""A tiny base model that has learned something to fine-tune: ``model.build.pretrain`` trains a tiny build's DiT (all
its weights) by flow matching on generated clips of one colour's square, so that a LoRA can then be seen changing
what it draws (``make demo``: the base draws white squares, the LoRA the colours its captions name).

A LoRA does not turn a random DiT into a generator (measured on the demo's DiT: a rank-64 LoRA's loss was still 1.12
after 1,000 steps; trained whole, the DiT reaches 0.27 in the 400 steps of the demo's build). The clips are drawn by
:mod:`wanexp.data.synthetic` and encoded by the block codec (:mod:`wanexp.models.wan22.block_codec`: the latents are
computed, not run through the VAE); their captions name a random colour each, whatever the square's, so the base
learns that colour words change nothing.

:func:`fit_flow_matching` is the training loop (also the learnability toy's, tests/learn_toy.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from wanexp.errors import ConfigError

__all__ = ["PRETRAIN_KEYS", "fit_flow_matching", "pretrain_on_squares"]

PRETRAIN_KEYS = ("steps", "lr", "batch", "clips", "color", "background", "size", "num_frames", "height", "width",
                 "seed")


def fit_flow_matching(denoiser, objective, params, batches: Callable[[torch.Generator], object], steps: int,
                      lr: float, seed: int) -> list[float]:
    """``steps`` AdamW steps (no weight decay) of ``objective`` (wanexp's flow matching) through ``denoiser`` on
    ``params``; ``batches(generator)`` gives each step's EncodedBatch. One generator seeded by ``seed`` draws the
    batches, noise and timesteps in turn. The transformers are put in train mode (and left so). Returns the losses."""
    for module in denoiser.transformers.values():
        module.train()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        out = objective(batches(g), denoiser, g)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    return losses


def _settings(pretrain) -> dict:
    p = dict(pretrain)
    unknown = sorted(set(p) - set(PRETRAIN_KEYS))
    missing = [k for k in PRETRAIN_KEYS if k not in p]
    if unknown or missing:
        what = f"unknown key {unknown[0]!r}" if unknown else f"{missing[0]!r} missing"
        raise ConfigError(f"model.build.pretrain: {what}; its keys are {', '.join(PRETRAIN_KEYS)}")
    for key in ("steps", "batch", "clips"):
        if int(p[key]) < 1:
            raise ConfigError(f"model.build.pretrain.{key}={p[key]}: must be at least 1")
    if not float(p["lr"]) > 0:
        raise ConfigError(f"model.build.pretrain.lr={p['lr']}: must be positive")
    return p


def square_clips(p: dict) -> tuple[list, list[str]]:
    """The pretraining clips (ShapeSpecs: squares of ``color`` moving left to right at random heights and speeds) and
    their captions (each naming a random colour)."""
    from wanexp.data.synthetic import COLORS, SPEEDS, ShapeSpec

    rng = np.random.default_rng(int(p["seed"]))
    names, speeds = list(COLORS), list(SPEEDS)
    for key in ("color", "background"):
        if p[key] not in COLORS:
            raise ConfigError(f"model.build.pretrain.{key}={p[key]!r}: not one of {', '.join(names)}")
    specs = [ShapeSpec("square", p["color"], p["background"], float(p["size"]), float(rng.uniform(-0.25, 0.25)),
                       "from left to right", speeds[int(rng.integers(len(speeds)))]) for _ in range(int(p["clips"]))]
    captions = [replace(s, color=names[int(rng.integers(len(names)))]).prompt for s in specs]
    return specs, captions


def pretrain_on_squares(spec, components: dict, pretrain, tokenizer) -> list[float]:
    """Train ``components["transformer"]`` (in place, then frozen in eval mode) as the module docstring says, with
    ``components["text_encoder"]`` and ``tokenizer`` for the captions. ``pretrain``: model.build.pretrain
    (:data:`PRETRAIN_KEYS`). Returns the losses."""
    from wanexp.data.synthetic import render_frames
    from wanexp.models.denoiser import Denoiser
    from wanexp.models.encoders import EncodedBatch
    from wanexp.models.wan22.block_codec import block_average_latents
    from wanexp.models.wan22.encoders import encode_text
    from wanexp.objectives.flow_matching import FlowMatching

    p = _settings(pretrain)
    if (spec.build or {}).get("vae_weights") != "block_average":
        raise ConfigError("model.build.pretrain needs model.build.vae_weights=block_average (the clips are encoded by "
                          "that codec's formula)")
    specs, captions = square_clips(p)
    vae = components["vae"].config  # normalised as wanexp.models.wan22.encoders.encode_video does
    mean, std = (torch.tensor(v).view(-1, 1, 1, 1) for v in (vae.latents_mean, vae.latents_std))
    latents = torch.stack([(block_average_latents(render_frames(s, int(p["num_frames"]), int(p["height"]),
                                                                int(p["width"]))) - mean) / std for s in specs])
    text = encode_text(tokenizer, components["text_encoder"].eval(), captions, spec.text_len).float()
    transformer = components["transformer"]
    denoiser = Denoiser(spec, {"dense": transformer}, (0.0, 1.0))
    objective = FlowMatching(name="flow_matching", timestep={"sampling": "uniform", "shift": spec.shift,
                                                             "logit_mean": 0.0, "logit_std": 1.0})
    batch = int(p["batch"])

    def batches(g: torch.Generator):
        pick = torch.randint(0, len(specs), (batch,), generator=g)
        return EncodedBatch(latents[pick], text[pick], {})

    t0, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(1)  # a DiT this small runs as fast on one thread; more spin against any other process
    try:
        losses = fit_flow_matching(denoiser, objective, list(transformer.parameters()), batches, int(p["steps"]),
                                   float(p["lr"]), int(p["seed"]))
    finally:
        torch.set_num_threads(threads)
    transformer.requires_grad_(False).eval()
    k = max(1, len(losses) // 10)
    print(f"wanexp: pretrained the base DiT on {p['color']} squares (model.build.pretrain): loss "
          f"{sum(losses[:k]) / k:.3g} -> {sum(losses[-k:]) / k:.3g} in {len(losses)} steps "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return losses
