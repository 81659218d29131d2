"""Validation during training: videos of fixed prompts and seeds with the current LoRA, and a held-out loss.

Every ``every_n_steps`` optimizer steps and at the last step (``every_n_steps: 0`` turns it off):

- **Videos**: each prompt x seed through the diffusers pipeline, built around the run's own transformers (the adapter
  the objective exports switched on; no second copy of the DiT), plus the VAE, text encoder and tokenizer (the run's,
  or loaded from ``model.path`` for the call and freed after when the run trains from the cache). A one-expert A14B run
  loads the other expert from ``model.path`` for the call (sharded over the ranks under FSDP2). Written to
  ``DIR/validation/step_NNNNNN/p<i>_s<seed>.mp4`` and logged to W&B (``val/video/p<i>_s<seed>``). At step 0 of a
  fresh run the base model (adapters off) is sampled once (``..._base.mp4``, ``val/base/...``);
  ``DIR/validation/strip.png`` then shows it against the latest LoRA (per video: its prompt, a row "base" and a row
  "LoRA step N", a column per frame, up to six evenly spaced; small frames enlarged), rewritten at each validation.
  Videos are written at ``fps`` (the model's native rate, ``model.fps``). With ``images`` (one per prompt), TI2V and
  I2V sample image-to-video from those images, resized and centre-cropped to each shape as training crops its clips;
  without, TI2V with ``first_frame`` and I2V take the first frames of the held-out clips (else the training clips),
  prompt i with clip i.
- **Distilled LoRA** (an objective with ``student_timesteps``, i.e. ``objective=dmd``): sampled on exactly its
  student steps with no CFG, as ``python -m wanexp.cli.sample`` does; the teacher is the base model with ``steps`` and
  the CFG it was distilled toward (the objective's ``guidance_scale`` and ``negative_prompt``), sampled once per
  session, and the gap is logged as ``val/teacher_latent_mse``, ``val/teacher_psnr``, ``val/teacher_ssim`` (means over
  prompts and seeds).
- **Held-out loss** ``val/loss`` (and ``val/loss_s<100 sigma>``): flow matching of the exported adapter on the first
  ``loss_samples`` held-out samples (``data.val_fraction``) at each of ``loss_sigmas`` (those in the boundary's
  range), with fixed noise: the same weights give the same value, so sweep points compare. Also in status.jsonl
  (``val_loss``), which the sweep summary reads.
- **EMA** (``callbacks.ema``): the weights ``callbacks.ema.validate_with`` names (raw, ema or both) are validated in
  turn, the EMA's swapped into the adapter for the call and the raw ones put back exactly; the EMA's videos and
  metrics carry ``ema`` in their names (``p0_s0_ema.mp4``, ``val/ema/loss``). The strip shows the last set validated.

Ranks: every rank samples its share of the videos (prompt x seed x shape k goes to rank k mod world; with
FSDP2-sharded weights, whose forwards are collective, a rank with fewer runs its last one again and drops it), and
rank 0 gathers them (uint8 frames over a gloo group of its own with ``timeout_s``, not the training's collective
timeout), writes and logs them. The held-out loss is rank 0's with replicated weights (DDP), every rank's call with
sharded ones. The model is in eval mode without gradients meanwhile, and the
training's random streams are left as they were.
"""
from __future__ import annotations

import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from wanexp.callbacks.progress import total_optimizer_steps
from wanexp.disk import saving  # a full disk while a video or the strip is written: one line
from wanexp.errors import ConfigError, MediaError


class Validation(Callback):
    def __init__(self, output_dir: str, every_n_steps: int, prompts: list[str], seeds: list[int], first_frame: bool,
                 fps: int, steps: int, guidance: float, negative_prompt: str, loss_sigmas: list[float],
                 loss_samples: int, timeout_s: int, at_start: bool = True, shapes=None, images=None):
        """The arguments are ``callbacks.validation`` (config.schema.ValidationConfig). ``shapes``: null (the data's
        first bucket at ``data.num_frames``), ``buckets`` (every bucket), or a list of [height, width] or
        [height, width, frames]. ``images``: null, or one image file per prompt (image-to-video from it)."""
        bad = [s for s in loss_sigmas if not 0.0 <= float(s) <= 1.0]
        if bad:
            raise ConfigError(f"callbacks.validation.loss_sigmas={list(loss_sigmas)}: {bad[0]} is not in [0, 1]")
        self.shapes = _check_shapes(shapes)
        self.dir = Path(output_dir) / "validation"
        self.every = int(every_n_steps)
        self.prompts, self.seeds = list(prompts), [int(s) for s in seeds] or [0]
        self.images = _check_images(images, self.prompts)
        self.first_frame = bool(first_frame)
        self.fps, self.steps, self.guidance = int(fps), int(steps), float(guidance)
        self.negative_prompt = negative_prompt
        self.loss_sigmas = [float(s) for s in loss_sigmas]
        self.loss_samples = int(loss_samples)
        self.timeout_s = int(timeout_s)
        self.at_start = bool(at_start)  # step 0 of a fresh run: the base model's videos and the step-0 numbers
        self._done: int | None = None  # the step last validated
        self._teacher: dict | None = None  # (prompt index, seed, shape) -> (latents, video) of the base model
        self._group = None  # a gloo group with a long timeout, for the ranks that wait
        self._embeds: dict[str, torch.Tensor] = {}  # prompt -> text embedding (text_len, D) on the CPU, made once
        self._vae = None  # a run from the cache: the VAE from model.path, loaded at the first call, kept on the CPU
        self.results: list[dict] = []  # what each validation produced (also DIR/validation/step_N/metrics.json)
        self._before: dict[str, tuple] = {}  # video name -> the base's (frames, numbers) (generation.strip_frames)
        self.strip: Path | None = None  # DIR/validation/strip.png once written: the base vs the latest LoRA

    def sizes(self, dm) -> list[dict]:
        """The shapes sampled: {height, width, frames} each (see ``shapes``)."""
        buckets = [tuple(r) for r in (getattr(dm, "resolutions", None) or [(dm.height, dm.width)])]
        chosen = buckets[:1] if self.shapes is None else buckets if self.shapes == "buckets" else self.shapes
        return [{"height": int(c[0]), "width": int(c[1]), "frames": int(c[2]) if len(c) > 2 else int(dm.num_frames)}
                for c in chosen]

    # ---- when ----------------------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage) -> None:
        if self.every and trainer.world_size > 1 and torch.distributed.is_available() \
                and torch.distributed.is_initialized() and self._group is None:
            from datetime import timedelta

            self._group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        if self.every and self.prompts:  # before configure_model: a run that cannot validate stops before it loads
            self._check_other_expert_fits(trainer, pl_module)

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
        was_training = pl_module.training
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        pl_module.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):  # training's random streams untouched
                torch.manual_seed(0)  # the pipeline's stochastic scheduler draws from the global generator
                result = self._run(trainer, pl_module, step, base, sharded)
        finally:
            pl_module.train(was_training)
        if trainer.world_size > 1 and self._group is not None:
            torch.distributed.barrier(group=self._group)  # rank 0 wrote the videos; the others waited here
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

    def _run(self, trainer, pl_module, step: int, base: bool, sharded: bool = False) -> dict:
        out: dict = {"step": step, "metrics": {}, "videos": {}, "timesteps": {}}
        own = pl_module.encoders  # an online run's encoders; a run from the cache has none
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the training step's cached blocks back to the allocator's free pool
        try:
            for k, (tag, weights) in enumerate(_weight_sets(trainer, pl_module)):
                with weights:  # the raw weights, or the EMA's swapped in (callbacks.ema.validate_with)
                    own = self._validate_weights(trainer, pl_module, step, base and k == 0, own, out, sharded, tag)
        finally:
            own = None
            import gc

            # an FSDP2-sharded module sits in a reference cycle (its state refers back to it): without a collection
            # the other expert's shards would stay on the GPU until Python's next full GC (checked on CPU)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return out

    def _validate_weights(self, trainer, pl_module, step: int, base: bool, own, out: dict, sharded: bool,
                          tag: str):
        """The held-out loss and the videos of the weights in the model now; ``tag`` (``ema``) goes into their metric
        names (``val/ema/loss``) and video names (``p0_s0_ema``). Returns the encoders used (loaded once)."""
        from wanexp.generation import heldout_loss

        dm = trainer.datamodule
        held_out = sharded or trainer.global_rank == 0  # replicated weights: rank 0's is every rank's
        if self.loss_samples and held_out and getattr(dm, "val_dataset", None) is not None:
            from wanexp.generation import adapter, encode_batch

            if own is None and not getattr(dm, "cached", False):  # held-out pixels need the encoders
                own = _load_encoders(pl_module.spec, pl_module.device)
            lo, hi = pl_module.sigma_range
            sigmas = [s for s in self.loss_sigmas if lo <= s <= hi] or \
                [lo + (hi - lo) * (k + 0.5) / 5 for k in range(5)]
            batches = (encode_batch(b, own, pl_module.device) for b in dm.val_batches(self.loss_samples))
            with adapter(list(pl_module.transformers.values()), pl_module.objective.export), \
                    trainer.precision_plugin.forward_context():
                loss = heldout_loss(pl_module.denoiser, batches, sigmas, seed=0)
            out["metrics"].update({f"val/{tag}/{k}" if tag else f"val/{k}": float(v)
                                   for k, v in loss.items() if k != "samples"})
            out["loss_samples"] = loss.get("samples", 0)
        if self.prompts:
            self._sample(trainer, pl_module, step, base, own, out, sharded, tag)
        return own

    # ---- what a sample needs: text embeddings, the VAE, the experts ----------------------------------------------
    def _embeddings(self, trainer, pl_module, encoders, negatives: tuple = ()) -> dict[str, torch.Tensor]:
        """Every prompt's and the negative prompts' (``negative_prompt`` and ``negatives``) text embedding, made once
        per run: from the cache (the cache command encodes them with the captions), else with the run's text encoder,
        else with the text encoder loaded from model.path for this one call. Kept on the CPU: a large text encoder
        never stays on the GPU for validation."""
        missing = [p for p in dict.fromkeys([*self.prompts, self.negative_prompt, *negatives]) if p not in self._embeds]
        dm = trainer.datamodule
        for prompt in list(missing):
            cached = dm.cached_text(prompt) if hasattr(dm, "cached_text") else None
            if cached is not None:
                self._embeds[prompt] = cached
                missing.remove(prompt)
        if missing:
            if encoders is None and trainer.global_rank == 0:
                print(f"wanexp: validation: encoding {len(missing)} prompt(s) with the text encoder from model.path "
                      "once (not in the cache; wanexp-cache with the same overrides adds them)", flush=True)
            self._embeds.update(pl_module.spec.encode_prompts(missing, pl_module.device, encoders))
        return self._embeds

    def _vae_on(self, pl_module, encoders):
        """The VAE on the device for this call: the run's own, or (from the cache) model.path's, loaded once."""
        if encoders is not None:
            return encoders.vae
        if self._vae is None:
            self._vae = pl_module.spec.load_vae()
        return self._vae.to(pl_module.device)

    def _check_other_expert_fits(self, trainer, pl_module) -> None:
        """A one-expert A14B run samples with the other expert too (unless its adapter is distilled: every student
        step then runs on the trained expert). With replicated weights rank 0 holds both experts whole: on a GPU
        that cannot, stop at the start with one line instead of running out of memory at the first validation."""
        spec = pl_module.spec
        other = _other_experts(spec, list(pl_module.expert_names),
                               pl_module.objective)
        strategy = type(trainer.strategy).__name__.lower()
        if not other or not torch.cuda.is_available() or "fsdp" in strategy:
            return
        dev = torch.device("cuda", torch.cuda.current_device())
        usable = torch.cuda.get_device_properties(dev).total_memory
        frac = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        usable = usable * (frac(dev) if frac is not None else 1.0)
        need = spec.load_bytes(spec.experts, encoders=False)  # both experts' weight files
        swap = getattr(spec, "blocks_to_swap", 0)
        if swap:  # both experts stream all but their resident blocks (models/blockswap.py: 2 swapped ones at a time)
            layers = int(spec.transformer_config(other[0])["num_layers"])
            need = need * (layers - min(swap, layers) + min(2, swap)) / layers
        if need > 0.9 * usable:
            raise ConfigError(
                f"validation videos of a boundary={pl_module.boundary_name} run need both experts on rank 0 "
                f"({need / 2**30:.1f} GiB of weights; this GPU has {usable / 2**30:.1f} GiB): set parallel=fsdp "
                "(the other expert is sharded over the ranks), or callbacks.validation.prompts=[] (held-out loss "
                "only), or callbacks.validation.every_n_steps=0")

    @staticmethod
    def _share(trainer, items: list, sharded: bool) -> list:
        """This rank's share of the validation samples, as (item, real): items r, r + world, ... With sharded
        weights every forward is collective, so a rank with fewer items runs its last again (real=False, dropped)
        until every rank runs as many."""
        rank, world = trainer.global_rank, trainer.world_size
        mine = [(x, True) for x in items[rank::world]]
        if sharded and items:
            per = -(-len(items) // world)
            mine += [((mine[-1] if mine else (items[0], True))[0], False)] * (per - len(mine))
        return mine

    def _gather(self, trainer, done: dict) -> list[dict]:
        """Every rank's samples (``done``) on rank 0 (its gloo group, ``timeout_s``); [done] for one process."""
        if trainer.world_size == 1 or self._group is None:
            return [done]
        parts = [None] * trainer.world_size if trainer.global_rank == 0 else None
        torch.distributed.gather_object(done, parts, dst=0, group=self._group)
        return parts or []

    def _sample(self, trainer, pl_module, step, base, encoders, out, sharded: bool = False, tag: str = "") -> None:
        """``tag``: the weight set's name in the adapter's video names and metrics (the base model's have none)."""
        from wanexp.generation import adapter, psnr, ssim, strip_frames, to_uint8, write_mp4

        spec, objective = pl_module.spec, pl_module.objective
        dev = pl_module.device
        modules = list(pl_module.transformers.values())
        experts = dict(pl_module.transformers.items())
        student = objective.student_steps()
        extra = {}
        for other in _other_experts(spec, list(experts), objective):  # the base expert for its share of the steps
            extra[other], out["other_expert"] = _other_expert(trainer, pl_module, other)
        # the base model's CFG: a distilled adapter's teacher is the one it was distilled toward
        guidance, negative = self.guidance, self.negative_prompt
        if student is not None:
            guidance = getattr(objective, "guidance_scale", guidance)
            negative = getattr(objective, "negative_prompt", negative)
        embeds = self._embeddings(trainer, pl_module, encoders, (negative,))
        sizes = self.sizes(trainer.datamodule)
        image = (spec.needs_image_latent or bool(self.images) or (self.first_frame and spec.draws_first_frame)
                 or spec.reference_image)  # S2V, Animate: a reference image, the held-out clip's first frame
        images: dict = {}
        if image:
            images = self._first_frames(trainer.datamodule, sizes)
            if images is None:
                print("wanexp: validation videos skipped: image-to-video needs a first frame and the data has "
                      "none (callbacks.validation.images gives one per prompt)", flush=True)
                return
        # the family's own inputs (an S2V clip's audio, an FLF2V clip's last frame): prompt i with held-out sample i's
        held = trainer.datamodule.held_out_inputs(len(self.prompts)) if spec.sample_inputs else []
        inputs = {i: held[i % len(held)] for i in range(len(self.prompts))} if held else {}
        vae = self._vae_on(pl_module, encoders)
        pipe = spec.make_pipeline({**experts, **extra}, vae, spec.load_scheduler(), image)
        folder = self.dir / f"step_{step:06d}"
        write = trainer.global_rank == 0
        named = len(sizes) > 1  # several shapes: the shape is part of each video's name
        items = [((i, seed, _tag(sz)), f"p{i}_s{seed}" + (f"_{_tag(sz)}" if named else ""), prompt,
                  dict(sz, text_len=spec.text_len), images.get((i, _tag(sz))))
                 for sz in sizes for i, prompt in enumerate(self.prompts) for seed in self.seeds]
        mine = self._share(trainer, items, sharded)
        gaps = []
        done: dict = {"base": [], "after": [], "rank": trainer.global_rank}  # (name, prompt, uint8 video[, ...])

        try:
            with pipe.recorded_timesteps() as record:
                teacher_now = student is not None and self._teacher is None
                if base or teacher_now:  # the base model (adapters off): logged at step 0, a DMD run's teacher
                    pipe.use_student(None)
                    teacher = {}
                    with adapter(modules, None):
                        for (key, name, prompt, s, img), real in mine:
                            lat, video, _ = pipe.generate(prompt, key[1], s, self.steps, guidance, negative, dev,
                                                          record, img, embeds=(embeds[prompt], embeds[negative]),
                                                          inputs=inputs.get(key[0]))
                            if not real:  # a rank's padding call (sharded weights: every rank runs as many)
                                continue
                            teacher[key] = (lat, video)
                            if base:
                                done["base"].append((name, prompt, to_uint8(video)))
                    if student is not None:
                        self._teacher = teacher
                lora_moved = step > 0 or student is not None or getattr(pl_module.adapter, "init_from", None)
                if lora_moved:  # a fresh LoRA is zero: its step-0 videos would be the base model's
                    if student is not None:  # exactly the training's student steps, no CFG
                        pipe.use_student(list(student.timesteps), student.shift)
                        steps, guidance = len(student.timesteps), 1.0
                    else:
                        pipe.use_student(None)
                        steps, guidance = self.steps, self.guidance
                    with adapter(modules, objective.export):
                        for (key, name, prompt, s, img), real in mine:
                            lat, video, used = pipe.generate(prompt, key[1], s, steps, guidance, self.negative_prompt,
                                                             dev, record, img,
                                                             embeds=(embeds[prompt], embeds[self.negative_prompt]),
                                                             inputs=inputs.get(key[0]))
                            if not real:
                                continue
                            gap = None
                            if student is not None:
                                t_lat, t_video = self._teacher[key]
                                gap = (float(((lat - t_lat) ** 2).mean()), psnr(video, t_video), ssim(video, t_video))
                            done["after"].append((name, prompt, to_uint8(video), used, gap))
            parts = self._gather(trainer, done)
            if write:  # every rank's videos, in the items' order
                order = {name: k for k, (_, name, _, _, _) in enumerate(items)}
                out["sampled_by"] = dict(sorted(((x[0], p["rank"]) for p in parts for x in p["after"] or p["base"]),
                                                key=lambda x: order[x[0]]))
                for name, prompt, frames in sorted((x for p in parts for x in p["base"]), key=lambda x: order[x[0]]):
                    video = torch.from_numpy(frames).float() / 255
                    self._before[name] = strip_frames(video)
                    f = folder / f"{name}_base.mp4"
                    with saving(f"the validation video {f}", f):
                        write_mp4(f, video, self.fps)
                    out["videos"][f"val/base/{name}"] = (str(f), f"base: {prompt}")
                after = {}
                for name, prompt, frames, used, gap in sorted((x for p in parts for x in p["after"]),
                                                             key=lambda x: order[x[0]]):
                    video = torch.from_numpy(frames).float() / 255
                    tagged = f"{name}_{tag}" if tag else name
                    out["timesteps"][tagged] = used
                    f = folder / f"{tagged}.mp4"
                    with saving(f"the validation video {f}", f):
                        write_mp4(f, video, self.fps)
                    out["videos"][f"val/video/{tagged}"] = (str(f), prompt)
                    after[name] = (strip_frames(video), f"{tagged}: {prompt}")
                    if gap is not None:
                        gaps.append(gap)
                self._write_strip(after, step)
        finally:
            del pipe, extra
            if encoders is None:
                vae.to("cpu")  # kept for the next call, off the GPU
        if gaps:
            n = len(gaps)
            head = f"val/{tag}/" if tag else "val/"
            out["metrics"].update({f"{head}teacher_latent_mse": sum(g[0] for g in gaps) / n,
                                   f"{head}teacher_psnr": sum(min(g[1], 100.0) for g in gaps) / n,
                                   f"{head}teacher_ssim": sum(g[2] for g in gaps) / n})

    def _write_strip(self, after: dict, step: int) -> None:
        """DIR/validation/strip.png: per video, its name and prompt over a row of the base model's frames (sampled at
        step 0 of this session) and a row of the LoRA's at ``step``, a column per frame (generation.render_strip).
        Rewritten at each validation: always base vs latest. ``after``: video name -> (LoRA's frames, label)."""
        from wanexp.generation import StripGroup, write_strip

        groups = [StripGroup(label, numbers, [("base", self._before[name][0]), (f"LoRA step {step}", frames)])
                  for name, ((frames, numbers), label) in after.items() if name in self._before]
        if groups:
            self.strip = self.dir / "strip.png"
            with saving(f"the validation strip {self.strip}", self.strip):
                write_strip(self.strip, groups)

    def _first_frames(self, dm, sizes: list[dict]) -> dict | None:
        """(prompt index, shape tag) -> the first frame (PIL) of an image-to-video sample: ``images`` resized and
        centre-cropped to the shape as training crops its clips, else the first frames of the held-out (else
        training) clips, prompt i with clip i. None when there is neither."""
        from wanexp.generation import condition_image, first_frame_image

        out = {}
        for sz in sizes:
            h, w = sz["height"], sz["width"]
            if self.images:
                out.update({(i, _tag(sz)): condition_image(path, h, w) for i, path in enumerate(self.images)})
                continue
            frames = dm.first_frames(len(self.prompts), h, w)
            if not frames:
                return None
            out.update({(i, _tag(sz)): first_frame_image(frames[i % len(frames)]) for i in range(len(self.prompts))})
        return out


def _weight_sets(trainer, pl_module) -> list:
    """(tag, context) per weight set validated: the raw weights (tag ""), or those ``callbacks.ema.validate_with``
    names (wanexp.callbacks.ema: the EMA's swapped in while its context is open, tag ``ema``)."""
    ema = next((c for c in trainer.callbacks if hasattr(c, "validation_weights")), None)
    return ema.validation_weights(pl_module) if ema is not None else [("", nullcontext())]


def _tag(size: dict) -> str:
    return f"{size['height']}x{size['width']}x{size['frames']}"


def _check_images(images, prompts: list[str]) -> list[str] | None:
    """``callbacks.validation.images``: null, or one readable image file per prompt (checked before the run starts;
    each is cropped to the sample's shape when it is sampled)."""
    if images is None:
        return None
    from wanexp.generation import condition_image

    images = [str(x) for x in images]
    if len(images) != len(prompts):
        raise ConfigError(f"callbacks.validation.images has {len(images)} image(s) for {len(prompts)} prompt(s): give "
                          "one image per prompt, in the prompts' order, or null (the clips' first frames)")
    for path in images:
        try:
            condition_image(path, 16, 16)
        except MediaError as e:
            raise ConfigError(f"callbacks.validation.images: {e}") from None
    return images


def _check_shapes(shapes):
    """``callbacks.validation.shapes``: null, ``buckets``, or [[h, w], ...] / [[h, w, frames], ...] (the frames are
    held to the model's frame rule with data.num_frames, wanexp.config.rules)."""
    if shapes is None or shapes == "buckets":
        return shapes
    ok = isinstance(shapes, (list, tuple)) and shapes and all(
        isinstance(c, (list, tuple)) and len(c) in (2, 3) and all(isinstance(x, int) and x > 0 for x in c)
        for c in shapes)
    if not ok:
        raise ConfigError(f"callbacks.validation.shapes={shapes}: null (the first bucket), buckets (every bucket), or "
                          "a list of [height, width] or [height, width, frames], e.g. [[704,1280],[1280,704,17]]")
    return [tuple(c) for c in shapes]


def _other_experts(spec, trained: list[str], objective) -> list[str]:
    """The experts a sample needs besides the trained ones, routed as training routed (generation.expert_routing): a
    one-expert A14B adapter's other expert serves the steps its noise level routes there, unless the adapter is
    distilled (every student step then runs on the expert it was trained on)."""
    from wanexp.generation import expert_routing

    routing = expert_routing(spec.experts, spec.boundary_ratio, trained, objective.student_steps() is not None)
    return [e for e in routing.experts if e not in trained]


def _other_expert(trainer, pl_module, name: str):
    """The expert a one-expert A14B run does not train, frozen, for its share of the sampling steps. Under FSDP2
    (every rank samples) it is sharded like the trained one, loaded in the same host-memory turns as the base: each
    GPU holds 1/world of it (the whole 14B expert, 26.6 GiB in bf16, on every GPU otherwise). With replicated weights
    rank 0 samples alone and holds it whole (checked to fit at the start). Returns the expert and what this rank
    holds of it (metrics.json)."""
    spec = pl_module.spec
    sharded = any(hasattr(p, "full_tensor") for p in pl_module.parameters())
    shard = getattr(trainer.strategy, "shard_transformer", None) if sharded else None
    ranks = trainer.world_size if shard is not None else 1
    if shard is None:
        t = spec.load_transformer(name)
        if getattr(spec, "blocks_to_swap", 0):  # streamed like the trained expert, not loaded whole (models/blockswap)
            from wanexp.models import blockswap

            blockswap.low_vram(t, spec, name, verbose=trainer.global_rank == 0)
        t = t.to(pl_module.device)
    else:
        loaded = []

        def load(_several: bool) -> None:
            loaded.append(spec.load_transformer(name).requires_grad_(False))
            shard(loaded[0], spec.blocks(loaded[0]))  # block by block: this rank's GPU gets only its shards

        pl_module.in_turns(load, what=f"validation's {name} expert")
        t = loaded[0]
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in t.parameters())
    if ranks > 1 and trainer.global_rank == 0:
        print(f"wanexp: validation: the {name} expert from model.path, sharded over {ranks} ranks "
              f"({held / 2**30:.2f} GiB of its weights on each)", flush=True)
    return t.eval(), {"name": name, "sharded_over": ranks, "bytes_here": held}


def _load_encoders(spec, device):
    """The encoders from model.path, for one held-out loss of a run trained online from pixels without its own."""
    return spec.load_encoders().to(device)
