"""Validation during training: videos of fixed prompts and seeds with the current LoRA, and a held-out loss.

Every ``every_n_steps`` optimizer steps and at the last step (``every_n_steps: 0`` turns it off):

- **Videos**: each prompt x seed through the diffusers pipeline, built around the run's own transformers (the adapter
  the objective exports switched on; no second copy of the DiT), plus the VAE, text encoder and tokenizer (the run's,
  or loaded from ``model.path`` for the call and freed after when the run trains from the cache). A one-expert A14B run
  loads the other expert from ``model.path`` for the call (sharded over the ranks under FSDP2). Written to
  ``DIR/validation/step_NNNNNN/p<i>_s<seed>.mp4`` and logged to W&B (``val/video/p<i>_s<seed>``). At step 0 of a
  fresh run the base model (adapters off) is sampled once (``..._base.mp4``, ``val/base/...``). TI2V with
  ``first_frame`` and I2V sample image-to-video from the first frames of the held-out clips (else the training clips),
  prompt i with clip i.
- **Distilled LoRA** (an objective with ``student_timesteps``, i.e. ``objective=dmd``): sampled on exactly its
  student steps with no CFG, as ``python -m wanexp.cli.sample`` does; the base model with ``steps``/``guidance`` is the
  teacher, sampled once per session, and the gap is logged as ``val/teacher_latent_mse``, ``val/teacher_psnr``,
  ``val/teacher_ssim`` (means over prompts and seeds).
- **Held-out loss** ``val/loss`` (and ``val/loss_s<100 sigma>``): flow matching of the exported adapter on the first
  ``loss_samples`` held-out samples (``data.val_fraction``) at each of ``loss_sigmas`` (those in the boundary's
  range), with fixed noise: the same weights give the same value, so sweep points compare. Also in status.jsonl
  (``val_loss``), which the sweep summary reads.

Ranks: with replicated weights (DDP) rank 0 validates while the others wait at a barrier of their own gloo group with
``timeout_s`` (not the training's collective timeout); with FSDP2-sharded weights every rank runs the same calls
(each forward gathers the shards) and rank 0 writes. The model is in eval mode without gradients meanwhile, and the
training's random streams are left as they were.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from wanexp.callbacks.progress import total_optimizer_steps
from wanexp.errors import ConfigError


class Validation(Callback):
    def __init__(self, output_dir: str, every_n_steps: int, prompts: list[str], seeds: list[int], first_frame: bool,
                 height: int, width: int, num_frames: int, fps: int, steps: int, guidance: float,
                 negative_prompt: str, loss_sigmas: list[float], loss_samples: int, timeout_s: int,
                 at_start: bool = True):
        """The arguments are ``callbacks.validation`` (config.schema.ValidationConfig)."""
        bad = [s for s in loss_sigmas if not 0.0 <= float(s) <= 1.0]
        if bad:
            raise ConfigError(f"callbacks.validation.loss_sigmas={list(loss_sigmas)}: {bad[0]} is not in [0, 1]")
        if (num_frames - 1) % 4:
            raise ConfigError(f"callbacks.validation.num_frames={num_frames}: must be 4k+1 (e.g. 17, 81)")
        self.dir = Path(output_dir) / "validation"
        self.every = int(every_n_steps)
        self.prompts, self.seeds = list(prompts), [int(s) for s in seeds] or [0]
        self.first_frame = bool(first_frame)
        self.size = {"height": int(height), "width": int(width), "frames": int(num_frames)}
        self.fps, self.steps, self.guidance = int(fps), int(steps), float(guidance)
        self.negative_prompt = negative_prompt
        self.loss_sigmas = [float(s) for s in loss_sigmas]
        self.loss_samples = int(loss_samples)
        self.timeout_s = int(timeout_s)
        self.at_start = bool(at_start)  # step 0 of a fresh run: the base model's videos and the step-0 numbers
        self._done: int | None = None  # the step last validated
        self._teacher: dict | None = None  # (prompt index, seed) -> (latents, video) of the base model
        self._group = None  # a gloo group with a long timeout, for the ranks that wait
        self.results: list[dict] = []  # what each validation produced (also DIR/validation/step_N/metrics.json)

    # ---- when ----------------------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage) -> None:
        if self.every and trainer.world_size > 1 and torch.distributed.is_available() \
                and torch.distributed.is_initialized() and self._group is None:
            from datetime import timedelta

            self._group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))

    def on_train_start(self, trainer, pl_module) -> None:
        if self.every and self.at_start and trainer.global_step == 0:  # fresh run: base model once, step-0 numbers
            self._validate(trainer, pl_module, base=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not self.every or step == self._done or step == 0:
            return
        if step % self.every == 0 or step >= total_optimizer_steps(trainer):
            self._validate(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.every and trainer.global_step != self._done:  # e.g. a run of max_epochs ending off the cadence
            self._validate(trainer, pl_module)

    # ---- how -----------------------------------------------------------------------------------------------------
    def _validate(self, trainer, pl_module, base: bool = False) -> None:
        step = trainer.global_step
        self._done = step
        t0 = time.perf_counter()
        params = list(pl_module.parameters())
        sharded = any(hasattr(p, "full_tensor") for p in params)  # FSDP2: every rank takes part in each forward
        if any(hasattr(p, "ds_id") for p in params):  # DeepSpeed ZeRO-3 partitions the weights its own way
            if trainer.global_rank == 0 and not self.results:
                print("wanexp: validation is skipped under DeepSpeed ZeRO stage 3 (partitioned weights); use "
                      "parallel=fsdp or ddp for validation", flush=True)
            return
        result: dict = {}
        if base and trainer.global_rank == 0:  # minutes on A14B before the first step: say what it is doing
            print(f"wanexp: validation at step 0: sampling the base model first ({len(self.prompts)} prompt(s) x "
                  f"{len(self.seeds)} seed(s), {self.steps} steps; callbacks.validation.at_start=false skips this, "
                  "callbacks.validation.every_n_steps=0 all validation)", flush=True)
        if sharded or trainer.global_rank == 0:
            was_training = pl_module.training
            devices = [pl_module.device] if pl_module.device.type == "cuda" else []
            pl_module.eval()
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=devices):  # training's random streams untouched
                    torch.manual_seed(0)  # the pipeline's stochastic scheduler draws from the global generator
                    result = self._run(trainer, pl_module, step, base)
            finally:
                pl_module.train(was_training)
        if trainer.world_size > 1 and not sharded and self._group is not None:
            torch.distributed.barrier(group=self._group)  # the others waited here while rank 0 sampled
        if trainer.global_rank != 0:
            return
        result["seconds"] = time.perf_counter() - t0
        self.results.append(result)
        metrics = result.get("metrics", {})
        if metrics:
            for lg in trainer.loggers:
                lg.log_metrics(metrics, step=step)
            status = next((c for c in trainer.callbacks if hasattr(c, "validated")), None)
            if status is not None:
                status.validated(trainer, metrics)
        videos = result.get("videos", {})
        for lg in trainer.loggers:
            if videos and hasattr(lg, "log_videos"):
                lg.log_videos(videos, step=step, fps=self.fps)
        folder = self.dir / f"step_{step:06d}"
        if videos or metrics:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "metrics.json").write_text(json.dumps({k: v for k, v in result.items() if k != "videos"} |
                                                            {"videos": {k: v[0] for k, v in videos.items()}},
                                                            indent=2))
        said = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k.count("_s") == 0 or "teacher" in k)
        print(f"wanexp: validation at step {step}: {len(videos)} video(s) in {folder}"
              + (f"; {said}" if said else "") + f" ({result['seconds']:.1f} s)", flush=True)

    def _run(self, trainer, pl_module, step: int, base: bool) -> dict:
        from wanexp.sampling import heldout_loss

        spec, objective = pl_module.spec, pl_module.objective
        modules = list(pl_module.transformers.values())
        export = objective.export
        out: dict = {"step": step, "metrics": {}, "videos": {}, "timesteps": {}}
        dm = trainer.datamodule
        own = pl_module.encoders
        loaded = None
        needs_pixels = getattr(dm, "val_dataset", None) is not None and not getattr(dm, "cached", False)
        if own is None and ((self.prompts) or (self.loss_samples and needs_pixels)):
            loaded = _load_encoders(spec, pl_module.device)
        encoders = own if own is not None else loaded
        try:
            if self.loss_samples and getattr(dm, "val_dataset", None) is not None:
                from wanexp.sampling import adapter, encode_batch

                lo, hi = pl_module.sigma_range
                sigmas = [s for s in self.loss_sigmas if lo <= s <= hi] or \
                    [lo + (hi - lo) * (k + 0.5) / 5 for k in range(5)]
                batches = (encode_batch(b, encoders, pl_module.device) for b in dm.val_batches(self.loss_samples))
                with adapter(modules, export), trainer.precision_plugin.forward_context():
                    loss = heldout_loss(pl_module.denoiser, batches, sigmas, seed=0)
                out["metrics"].update({f"val/{k}": float(v) for k, v in loss.items() if k != "samples"})
                out["loss_samples"] = loss.get("samples", 0)
            if self.prompts:
                self._sample(trainer, pl_module, step, base, encoders, out)
        finally:
            del loaded
            import gc

            # an FSDP2-sharded module sits in a reference cycle (its state refers back to it): without a collection
            # the other expert's shards would stay on the GPU until Python's next full GC (checked on CPU)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return out

    def _sample(self, trainer, pl_module, step, base, encoders, out) -> None:
        from wanexp.sampling import (
            adapter,
            build_pipeline,
            first_frame_image,
            generate,
            load_scheduler,
            psnr,
            recorded_timesteps,
            ssim,
            student_scheduler,
            write_mp4,
        )

        spec, objective = pl_module.spec, pl_module.objective
        dev = pl_module.device
        modules = list(pl_module.transformers.values())
        experts = dict(pl_module.transformers.items())
        extra = {}
        if set(spec.experts) == {"high", "low"} and len(experts) == 1:  # one-expert A14B: the other from model.path
            other = "low" if "high" in experts else "high"
            extra[other], out["other_expert"] = _other_expert(trainer, pl_module, other)
        image = spec.needs_image_latent or (self.first_frame and spec.draws_first_frame)
        images: list = [None] * len(self.prompts)
        if image:
            frames = trainer.datamodule.first_frames(len(self.prompts), self.size["height"], self.size["width"])
            if not frames:
                print("wanexp: validation videos skipped: image-to-video needs a first frame and the data has none",
                      flush=True)
                return
            images = [first_frame_image(frames[i % len(frames)]) for i in range(len(self.prompts))]
        default = load_scheduler(spec.path)
        pipe = build_pipeline(spec, {**experts, **extra}, encoders.vae, encoders.text_encoder, encoders.tokenizer,
                              default, image)
        s = dict(self.size, text_len=spec.text_len)
        distilled = getattr(objective, "student_timesteps", None)
        folder = self.dir / f"step_{step:06d}"
        write = trainer.global_rank == 0
        gaps = []
        try:
            with recorded_timesteps(pipe) as record:
                teacher_now = distilled is not None and self._teacher is None
                if base or teacher_now:  # the base model (adapters off): logged at step 0, a DMD run's teacher
                    pipe.scheduler = default
                    teacher = {}
                    with adapter(modules, None):
                        for i, prompt in enumerate(self.prompts):
                            for seed in self.seeds:
                                lat, video, _ = generate(pipe, prompt, seed, s, self.steps, self.guidance,
                                                         self.negative_prompt, dev, record, images[i])
                                teacher[(i, seed)] = (lat, video)
                                if base and write:
                                    f = folder / f"p{i}_s{seed}_base.mp4"
                                    write_mp4(f, video, self.fps)
                                    out["videos"][f"val/base/p{i}_s{seed}"] = (str(f), f"base: {prompt}")
                    if distilled is not None:
                        self._teacher = teacher
                lora_moved = step > 0 or distilled is not None or getattr(pl_module.adapter, "init_from", None)
                if not lora_moved:  # a fresh LoRA is zero: its step-0 videos would be the base model's
                    return
                if distilled is not None:  # exactly the training's student steps, no CFG
                    pipe.scheduler = student_scheduler(distilled, objective.student_shift)
                    steps, guidance = len(distilled), 1.0
                else:
                    pipe.scheduler, steps, guidance = default, self.steps, self.guidance
                with adapter(modules, objective.export):
                    for i, prompt in enumerate(self.prompts):
                        for seed in self.seeds:
                            lat, video, used = generate(pipe, prompt, seed, s, steps, guidance, self.negative_prompt,
                                                        dev, record, images[i])
                            out["timesteps"][f"p{i}_s{seed}"] = used
                            if write:
                                f = folder / f"p{i}_s{seed}.mp4"
                                write_mp4(f, video, self.fps)
                                out["videos"][f"val/video/p{i}_s{seed}"] = (str(f), prompt)
                            if distilled is not None:
                                t_lat, t_video = self._teacher[(i, seed)]
                                gaps.append((float(((lat - t_lat) ** 2).mean()), psnr(video, t_video),
                                             ssim(video, t_video)))
        finally:
            del pipe, extra
        if gaps:
            n = len(gaps)
            out["metrics"].update({"val/teacher_latent_mse": sum(g[0] for g in gaps) / n,
                                   "val/teacher_psnr": sum(min(g[1], 100.0) for g in gaps) / n,
                                   "val/teacher_ssim": sum(g[2] for g in gaps) / n})


def _other_expert(trainer, pl_module, name: str):
    """The expert a one-expert A14B run does not train, frozen, for its share of the sampling steps. Under FSDP2
    (every rank samples) it is sharded like the trained one, loaded in the same host-memory turns as the base: each
    GPU holds 1/world of it (the whole 14B expert, 26.6 GiB in bf16, on every GPU otherwise). With replicated weights
    rank 0 samples alone and holds it whole. Returns the expert and what this rank holds of it (metrics.json)."""
    spec = pl_module.spec
    sharded = any(hasattr(p, "full_tensor") for p in pl_module.parameters())
    shard = getattr(trainer.strategy, "shard_transformer", None) if sharded else None
    ranks = trainer.world_size if shard is not None else 1
    if shard is None:
        t = spec.load_transformer(name).to(pl_module.device)
    else:
        loaded = []

        def load(_several: bool) -> None:
            loaded.append(spec.load_transformer(name).requires_grad_(False))
            shard(loaded[0])  # block by block: this rank's GPU gets only its shards

        pl_module.in_turns(load, what=f"validation's {name} expert")
        t = loaded[0]
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in t.parameters())
    if ranks > 1 and trainer.global_rank == 0:
        print(f"wanexp: validation: the {name} expert from model.path, sharded over {ranks} ranks "
              f"({held / 2**30:.2f} GiB of its weights on each)", flush=True)
    return t.eval(), {"name": name, "sharded_over": ranks, "bytes_here": held}


def _load_encoders(spec, device):
    """The VAE, text encoder and tokenizer from model.path, for one validation (a run from the cache has none)."""
    from wanexp.sampling import make_encoders

    return make_encoders(spec.load_vae().to(device), spec.load_text_encoder().to(device), spec.load_tokenizer(), spec)
