"""The LightningModule: wires a model spec, an adapter, an objective and an optimizer. It never branches on the model.

    spec       what differs between model layouts (wanexp/models/family.py): loading, conditioning, expert routing
    adapter    what is trained on the frozen base of each expert (wanexp/adapters/kinds.py: LoraAdapter)
    objective  the loss and its metrics, given an encoded batch and the denoiser (wanexp/objectives/)
    optimizer  a factory from the `optim` group + the schedule settings (wanexp/optim.py)
"""
from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from torch import nn

from wanexp.context import RunContext
from wanexp.errors import DivergedError
from wanexp.lightning_compat import attached_trainer, mend_epoch_progress, open_next_epoch_after_resume
from wanexp.models.attention import check_attention_kernel
from wanexp.models.denoiser import Denoiser
from wanexp.models.encoders import cached_batch
from wanexp.models.family import ModelSpec, unreadable_weights
from wanexp.models.fp8 import check_fp8
from wanexp.objectives.base import Objective
from wanexp.optim import build_optimizer, lr_lambda


class DiffusionModule(L.LightningModule):
    def __init__(self, spec: ModelSpec, adapter, objective: Objective, boundary: dict, optimizer: Callable, lr: float,
                 schedule: dict, max_steps: int = -1, load_encoders: bool = True, allow_resume_changes: bool = False,
                 max_bad_steps: int = 10, seed: int = 0, context: RunContext | None = None):
        """``context``: the run's facts (wanexp/context.py; None: one process, no sequence parallel)."""
        super().__init__()
        self.run_context = context or RunContext()
        self.spec, self.adapter, self.objective = spec, adapter, objective
        self.boundary_name = boundary["name"]
        self.sigma_range = (float(boundary["sigma_min"]), float(boundary["sigma_max"]))
        self.expert_names = spec.trained_experts(self.boundary_name)
        self.optimizer_factory, self.lr, self.schedule = optimizer, lr, dict(schedule)
        self.max_steps = max_steps
        self.load_encoders = load_encoders  # False when every batch carries cached latents and text embeddings
        self.allow_resume_changes = allow_resume_changes
        self.max_bad_steps = max_bad_steps  # non-finite steps in a row that stop the run
        self.seed = seed
        self._skipped = torch.zeros((), dtype=torch.long)  # steps skipped for a non-finite loss or gradient (device)
        self._host_values: tuple[dict, int] | None = None  # the step's host numbers, logged after its optimizer step
        self._check_bad_steps = False  # a log step's run-stopping check, made after its optimizer step
        self._bad_in_row = torch.zeros((), dtype=torch.long)
        self._loss_finite: torch.Tensor | None = None  # every loss of the current optimizer step was finite
        self._rng_to_restore: dict | None = None  # from a resumed checkpoint, put back before the first step
        self.automatic_optimization = not objective.manual  # several adapters: each step trains the one it names
        self._metric_sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # metrics over the log window
        self._negative_text: torch.Tensor | None = None  # the negative prompt's embedding (objectives with CFG)
        self.transformers = nn.ModuleDict()
        self.students = nn.ModuleDict()  # models an objective trains in full (objective.build_trainable)
        self.encoders = None
        self.denoiser = Denoiser(spec, self.transformers, self.sigma_range)
        self.trainable_names: list[str] = []
        # Checkpoints hold the adapter weights only; the frozen base comes from model.path.
        self.strict_loading = False

    # ---- building -------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Load the experts, add the adapters, shard (FSDP) or place them. The ranks of a node take turns when the
        free host memory cannot hold every rank's full copy of the base at once (``parallel.concurrent_loads``): a
        rank's turn ends once its copy is sharded or on its GPU, so a node holds at most that many copies."""
        if len(self.transformers):
            return
        check_fp8(self.spec)  # every rank, before any loads (not inside one rank's turn); the run checked it at start
        check_attention_kernel(self.spec.attention_backend)  # as check_fp8
        sp_size = self.run_context.sp_size
        group = None
        if sp_size > 1:  # a collective: every rank makes the groups, before (not inside) its loading turn
            from wanexp.models import sequence

            group = sequence.build_group(sp_size)
        self.in_turns(lambda several: self._build_and_place(group, place_now=several))

    def in_turns(self, load, what: str = "the base") -> None:
        """Run ``load(several_turns)`` in this rank's host-memory turn (``load_turns``) for a load of the base's
        size; the ranks wait for each turn to end. Also validation's other expert of a one-expert A14B run. A
        collective: every rank calls it."""
        turns, mine = load_turns(self, what)
        for turn in range(turns):
            if turn == mine:
                load(turns > 1)
            if turns > 1:
                self.trainer.strategy.barrier("wanexp-load-turn")

    def _build_and_place(self, group, place_now: bool) -> None:
        """``group``: the sequence-parallel group (None without); ``place_now``: move to the GPU inside this turn."""
        from wanexp.models import fp8

        hint = fp8_hint(self.spec) if self.spec.fp8 else ""  # said once, with the first expert
        for e in self.expert_names:
            t = _readable(self.spec, f"the {e} transformer", self.spec.load_transformer, e)
            for name in self.objective.adapters:
                self.adapter.apply(t, name)
            if self.spec.fp8:  # after the adapters: their base layers are what becomes FP8
                n = fp8.convert_blocks(self.spec.blocks(t))
                if self.global_rank == 0:
                    print(f"wanexp: model.fp8: {n} frozen linears of the {e} transformer in FP8{hint}", flush=True)
                hint = ""
            self.transformers[e] = t
        for name, m in self.objective.build_trainable(dict(self.transformers), self.spec).items():
            self.students[name] = m  # e.g. KD's student: trained in full
        from wanexp.models import blockswap  # model.fp8_storage, model.blocks_to_swap (after a student copied them)

        for e, t in self.transformers.items():
            blockswap.low_vram(t, self.spec, e, verbose=self.global_rank == 0)
        if group is not None:  # sequence parallel: each training forward keeps 1/sp of the tokens (models/sequence.py)
            for t in [*self.transformers.values(), *self.students.values()]:
                self.spec.enable_sequence_parallel(t, group)
        if self.load_encoders:
            self.encoders = _readable(self.spec, "the VAE and text encoder", self.spec.load_encoders)
        self.trainable_names = [n for n, p in self.named_parameters() if p.requires_grad]
        trainer = attached_trainer(self)
        parallelize = getattr(trainer.strategy, "parallelize_module", None) if trainer else None
        if parallelize is not None:  # FSDP: shard after the adapters are added, before optimizers exist
            parallelize(self)
        root = trainer.strategy.root_device if trainer else None
        if place_now and root is not None and root.type == "cuda":
            # the host copy goes now, inside this rank's turn (Lightning would move the module after every turn)
            for m in ([self.encoders] if parallelize is not None else [self]):
                if m is not None:
                    m.to(root)
        # sharded experts: every rank must run the same expert in a step (ModelSpec.expert_for_step)
        self._expert_per_step = parallelize is not None and len(self.expert_names) > 1 and \
            trainer.world_size > 1 and not self.objective.manual  # (DMD + FSDP + two experts is refused)
        # Every rank loads the same frozen weights from disk: DDP need not broadcast or watch them.
        trainable = set(self.trainable_names)
        self._ddp_params_and_buffers_to_ignore = [n for n, _ in self.named_parameters() if n not in trainable] + [
            n for n, _ in self.named_buffers()
        ]

    def setup(self, stage: str) -> None:
        """Each data-parallel rank draws its own noise, timesteps and conditioning choices (seed + its data rank;
        rank 0 keeps the run's seed); the ranks of one sequence-parallel group share one sample, so they share these
        too. A resumed run puts every rank's saved streams back at its first step (wanexp/rng.py)."""
        dp_rank = self.run_context.dp_rank(self.trainer)
        if dp_rank:
            torch.manual_seed(self.seed + 1_000_003 * dp_rank)

    # ---- the step -------------------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int):
        encoded = cached_batch(batch) if "latents" in batch else self.encoders(batch)
        if self.spec.cuda_graphs:  # model.cuda_graphs: this step's graph replays may overwrite the last step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        if not self.automatic_optimization:
            return self._manual_step(encoded)
        if getattr(self, "_expert_per_step", False):
            self.denoiser.step_expert, self.denoiser.sigma_range = self.spec.expert_for_step(
                self.objective, self.sigma_range, self.seed, self.global_step)
        try:
            out = self.objective(encoded, self.denoiser, step=self.global_step, negative_text=self.negative_text())
        finally:  # only this step's forward is routed so (validation's held-out loss routes per sample)
            self.denoiser.step_expert, self.denoiser.sigma_range = None, self.sigma_range
        finite = torch.isfinite(out.loss.detach())  # read before the optimizer step (on_before_optimizer_step)
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        self._log_step(out.loss, out.metrics, {"train/lr": self.lr_schedulers().get_last_lr()[0]}, out.batch_size)
        return {"loss": out.loss, "flops": out.flops}

    def _manual_step(self, encoded):
        """One optimizer step of the adapter the objective's phase names (e.g. DMD: critic, ..., critic, generator)."""
        from wanexp.adapters import use_adapter

        phase = self.objective.phase(self.global_step)
        k = list(self.objective.optimizer_settings()).index(phase)
        opt, sched = self.optimizers()[k], self.lr_schedulers()[k]
        out = self.objective(encoded, self.denoiser, step=self.global_step, negative_text=self.negative_text())
        opt.zero_grad(set_to_none=True)
        with use_adapter(list(self.transformers.values()), out.adapter):  # a recomputing backward sees the same adapter
            self.manual_backward(out.loss)
        clip = self.objective.optimizer_settings()[phase].get("clip")
        if clip:
            params = [p for group in opt.optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, clip)
        self._loss_finite = torch.isfinite(out.loss.detach())
        opt.step()  # on_before_optimizer_step skips it if the loss or a gradient is not finite
        sched.step()
        self._log_step(out.loss, out.metrics, {f"train/lr_{phase}": sched.get_last_lr()[0]}, out.batch_size)
        self._after_optimizer_step()
        return {"loss": out.loss.detach(), "flops": out.flops}

    def _log_step(self, loss: torch.Tensor, metrics: dict, host_values: dict, batch_size: int) -> None:
        """The step's logging without a host sync on a GPU. The loss is logged as a device tensor every step (no
        ``prog_bar``: Lightning reads progress-bar metrics to the host at every step); the objective's metrics are
        summed on the device; what needs the host (the window's counts, the lr: ``self.log`` turns a number into a
        device tensor with a blocking copy) waits for :meth:`_after_optimizer_step` at log steps."""
        self.log("train/loss", loss.detach(), batch_size=batch_size)
        self._add_metrics(metrics)
        self._host_values = (host_values, batch_size)

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        self._after_optimizer_step()

    def _after_optimizer_step(self) -> None:
        """At a log step, once the step's forward, backward and optimizer step are issued: the reads of the device
        (the metrics' counts, the run-stopping count of skipped steps) and the host numbers logged. Read in the middle
        of the step, each would leave the GPU idle while the host issues the rest of it (with model.cuda_graphs,
        logging every step then cost 16 % of the step: docs/performance.md)."""
        if not self.run_context.logs_this_step(attached_trainer(self)):
            self._host_values = None
            return
        if self._check_bad_steps:
            self._check_bad_steps = False
            self._stop_if_diverged(self.global_step)  # the optimizer step is counted once it is taken
        self._flush_metrics()
        if self._host_values is not None:
            values, batch_size = self._host_values
            self._host_values = None
            for name, value in values.items():
                self.log(name, value, batch_size=batch_size)

    def _add_metrics(self, metrics: dict) -> None:
        """An objective's metrics, ``name -> (mean, samples)`` (tensors or numbers), summed on the device over the
        log window (logged by :meth:`_flush_metrics`)."""
        acc = self._metric_sums
        for name, (value, n) in metrics.items():
            if isinstance(n, torch.Tensor):  # counted on the device (e.g. samples per sigma quarter)
                n = n.to(dtype=torch.float32)
                total = torch.where(n > 0, value.detach().float() * n, torch.zeros_like(n))
            else:  # a count the host knows: no host-to-device copy (a blocking one on a GPU)
                n = float(n)
                total = value.detach().float() * n if n > 0 else torch.zeros((), device=value.device)
            if name in acc:
                total, n = acc[name][0] + total, acc[name][1] + n
            acc[name] = (total, n)

    def _flush_metrics(self) -> None:
        """The window's metrics logged as their sample-weighted means: one host read per log step, not one per step and
        metric; a group with no sample in the window (e.g. a sigma quarter) is left out."""
        acc = self._metric_sums
        if not acc:
            return
        names = list(acc)
        on_device = [k for k in names if isinstance(acc[k][1], torch.Tensor)]
        read = torch.stack([acc[k][1].to(self.device) for k in on_device]).tolist() if on_device else []
        counts = [acc[k][1] for k in names]  # the device counts in one host read per log step
        for k, c in zip(on_device, read):
            counts[names.index(k)] = c
        for k, c in zip(names, counts):
            if c > 0:
                self.log(k, acc[k][0] / c, batch_size=int(c))
        acc.clear()

    def negative_text(self) -> torch.Tensor | None:
        """The negative prompt's text embedding (1, text_len, D), encoded once on this device (objectives with CFG);
        a run from the cache loads the text encoder for it and frees it again."""
        if not self.objective.needs_negative_text:
            return None
        if self._negative_text is None:
            dm = getattr(attached_trainer(self), "datamodule", None)
            cached = dm.cached_text(self.objective.negative_prompt) if hasattr(dm, "cached_text") else None
            if cached is not None:  # the cache command encodes it with the captions
                self._negative_text = cached[None].to(self.device)
                return self._negative_text
            encoders = self.encoders if self.encoders is not None else self.spec.load_encoders().to(self.device)
            with torch.autocast(device_type=self.device.type, enabled=False):
                self._negative_text = encoders.encode_prompts([self.objective.negative_prompt])
            del encoders
        return self._negative_text

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self._rng_to_restore is not None:  # resumed: continue the random streams exactly where the save left them
            from wanexp.rng import set_rng_state

            set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    # ---- optimisation ---------------------------------------------------------------------------------------
    def on_before_optimizer_step(self, optimizer) -> None:
        """Skip an optimizer step whose loss or gradients are not finite (AdamW leaves the weights and moments as they
        were), count it in ``train/skipped_steps``, and stop the run after ``max_bad_steps`` of them in a row. With an
        fp16 grad scaler, gradient overflow is the scaler's to skip.

        A fused optimizer (AdamW on GPU) skips on the device through its ``found_inf`` input, as under a grad scaler:
        no host sync in the step; the run-stopping count is then read at log steps. Other optimizers get their
        gradients dropped, which needs the flag on the host every step."""
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        if self._loss_finite is not None:
            bad = bad | ~self._loss_finite.to(self.device)
        self._loss_finite = None
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2: this rank's shard
            if grads:
                bad = bad | ~torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()).to(self.device)
        if self.trainer.world_size > 1:  # sharded gradients: every rank must take the same decision
            bad = bad.float()  # an all-reduce without the barrier Lightning's strategy.reduce puts first (a host sync)
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
            bad = bad > 0
        self._skipped = self._skipped.to(self.device) + bad
        self._bad_in_row = (self._bad_in_row.to(self.device) + 1) * bad
        on_device = scaler is None and getattr(optimizer, "_step_supports_amp_scaling", False) and \
            bool(optimizer.defaults.get("fused"))
        if on_device:
            optimizer.grad_scale, optimizer.found_inf = None, bad.float()
        elif bool(bad):
            optimizer.zero_grad(set_to_none=True)
        if not on_device:  # the flag was read already: the count too
            self._stop_if_diverged(self.global_step + 1)
        elif self.run_context.logs_this_step(self.trainer):  # read once the step is issued (_after_optimizer_step)
            self._check_bad_steps = True
        self.log("train/skipped_steps", self._skipped.float(), on_step=True, on_epoch=False, batch_size=1)

    def _stop_if_diverged(self, step: int) -> None:
        """Print a skipped step (rank 0) and stop the run after ``max_bad_steps`` of them in a row. A step skipped on
        the device changed no weight, so reading this after its optimizer step stops at the same point."""
        in_row = int(self._bad_in_row)
        if in_row and self.global_rank == 0:
            print(f"wanexp: step {step}: non-finite loss or gradient; step skipped "
                  f"({in_row} in a row, {self.skipped_steps} in the run)", flush=True)
        if in_row >= self.max_bad_steps:
            raise DivergedError(
                f"{in_row} optimizer steps in a row had a non-finite loss or gradient (up to step "
                f"{step}); the run diverged and stopped with its last checkpoint intact: lower "
                "optim.lr, or use trainer.precision=bf16-mixed, then resume=last (guard.max_bad_steps sets the limit)")

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient over the whole run (reads the device)."""
        return int(self._skipped)

    def configure_optimizers(self):
        total = self.max_steps if self.max_steps and self.max_steps > 0 else int(self.trainer.estimated_stepping_batches)
        s = self.schedule
        if not self.automatic_optimization:  # one optimizer per trained adapter, stepped only in its own phase
            opts, scheds = [], []
            for name, o in self.objective.optimizer_settings().items():
                params = [p for n, p in self.named_parameters() if p.requires_grad and f".{name}." in n]
                opt = build_optimizer(self.optimizer_factory, params, float(o["lr"]),
                                      weight_decay=float(o["weight_decay"]), eps=float(o["eps"]),
                                      betas=tuple(o["betas"]))
                steps = sum(self.objective.phase(i) == name for i in range(total))
                opts.append(opt)
                scheds.append({"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(
                    s["scheduler"], int(s["warmup_steps"]), max(1, steps), float(s["min_lr_ratio"]))),
                    "interval": "step"})
            return opts, scheds
        opt = build_optimizer(self.optimizer_factory, (p for p in self.parameters() if p.requires_grad), self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(s["scheduler"], int(s["warmup_steps"]), total, float(s["min_lr_ratio"])))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _check_resume_settings(self, saved: dict) -> None:
        """Resume only what the checkpoint was written with: a different weight layout always stops the run; a
        different schedule (alpha, lr, steps, ...) stops it unless allow_resume_changes=true, and is then printed."""
        from wanexp.errors import ConfigError

        now = self.run_settings()
        for kind in ("fixed", "schedule"):
            diff = [f"{k}={saved[kind][k]} in the checkpoint, {v} now" for k, v in now[kind].items()
                    if kind in saved and k in saved[kind] and saved[kind][k] != v]
            if not diff:
                continue
            if kind == "fixed":
                raise ConfigError(f"resume: {'; '.join(diff)}: the checkpoint's weights have another layout; resume "
                                  "with its settings, or start a new run (another run_name)")
            if not self.allow_resume_changes:
                raise ConfigError(f"resume: {'; '.join(diff)}; resume with the checkpoint's settings, or pass "
                                  "allow_resume_changes=true to continue with the new ones")
            if self.global_rank == 0:
                print(f"wanexp: resume with changed settings (allow_resume_changes=true): {'; '.join(diff)}",
                      flush=True)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip as Lightning would, also for a fused optimizer under mixed precision.

        Lightning's mixed-precision plugin refuses to clip gradients for any fused optimizer, because with an fp16
        grad scaler the fused step unscales internally. Without a scaler the gradients are already true gradients;
        with one they are unscaled here first. Either way they are clipped with the same torch call.
        """
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugin = self.trainer.precision_plugin
        if not (gradient_clip_val and isinstance(plugin, MixedPrecision)):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if plugin.scaler is not None:
            if not getattr(optimizer, "_step_supports_amp_scaling", False):
                return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            # fp16 with a fused optimizer: Lightning leaves the gradients scaled (the fused step unscales); unscale
            # them here first, which the scaler records, so its step neither unscales twice nor misses an overflow
            plugin.scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

    # ---- checkpoints hold trainable weights only -------------------------------------------------------------
    def run_settings(self) -> dict:
        """What a checkpoint must agree with to be resumed: ``fixed`` (the weights' layout) and ``schedule``."""
        a = self.adapter
        return {"fixed": {"model": self.spec.name, "experts": list(self.expert_names), "boundary": self.boundary_name,
                          "objective": self.objective.name, "adapter.rank": a.rank, "adapter.targets": list(a.targets),
                          "adapter.attention": list(a.attention)},
                "schedule": {"adapter.alpha": a.alpha, "adapter.dropout": a.dropout, "optim.lr": self.lr,
                             "optim.scheduler": self.schedule["scheduler"],
                             "optim.warmup_steps": self.schedule["warmup_steps"],
                             "optim.min_lr_ratio": self.schedule["min_lr_ratio"],
                             # the run's length shapes a decaying schedule only
                             **({} if self.schedule["scheduler"] == "constant" else
                                {"trainer.max_steps": self.max_steps})}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        keep = set(self.trainable_names)
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        from wanexp.rng import get_rng_state

        checkpoint["wanexp"] = {"model": self.spec.name, "experts": self.expert_names, "boundary": self.boundary_name,
                                **self.run_settings(), "skipped_steps": self.skipped_steps,
                                "rng": get_rng_state(gather=self.trainer.world_size > 1)}

    def on_train_start(self) -> None:
        open_next_epoch_after_resume(self.trainer)

    def check_resume(self, saved: dict) -> None:
        """The resume check before the fit (wanexp.train.check_resume: a refused resume writes nothing); Lightning's
        load then does not repeat it."""
        self._check_resume_settings(saved)
        self._resume_checked = True

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("wanexp", {})
        if not getattr(self, "_resume_checked", False):
            self._check_resume_settings(saved)
        self._skipped = torch.tensor(int(saved.get("skipped_steps", 0)))
        states = saved.get("rng") or []
        if len(states) == self.trainer.world_size:  # another world size draws differently anyway
            self._rng_to_restore = states[self.global_rank]
        mend_epoch_progress(checkpoint)
        if "state_dict" not in checkpoint:  # FSDP loads weights itself before this hook
            return
        missing = [n for n in self.trainable_names if n not in checkpoint["state_dict"]]
        if missing:
            from wanexp.errors import ConfigError

            raise ConfigError(
                f"resume: the checkpoint lacks {len(missing)} adapter weights of this run (e.g. {missing[0]}); it was "
                "written by a run with other model/boundary/adapter settings: resume with those"
            )


def fp8_hint(spec) -> str:
    """What the FP8 base's load line adds where every block is fully checkpointed by default (no budget, no
    ``model.selective_checkpointing``): that setting was the FP8 base's slowest (docs/memory.md)."""
    if not (spec.gradient_checkpointing and spec.memory_budget_gib is None and spec.selective_checkpointing is None
            and spec.selective_checkpointing_supported and spec.wanexp_forward(spec.fast_modulation)
            and not spec.offload_activations):
        return ""
    return ("; every block fully checkpointed, the FP8 base's slowest setting (5B at 704x1280x17 on an H200: 357 ms "
            "and 15.8 GiB, against 280 ms and 12.0 GiB selective): set model.memory_budget_gib, or "
            "model.selective_checkpointing=true for short clips")


def _readable(spec: ModelSpec, what: str, load, *args):
    """Load weights; a corrupt or truncated file (what a partial download leaves) is one line, not a traceback."""
    from safetensors import SafetensorError

    try:
        return load(*args)
    except (OSError, SafetensorError) as e:
        raise unreadable_weights(spec.path, what, e) from None


def load_turns(module: DiffusionModule, what: str = "the base") -> tuple[int, int]:
    """(turns, this rank's turn) for loading the base into host memory; (1, 0) when every rank of a node can hold
    its full copy at once. ``parallel.concurrent_loads`` (the run context's) sets the ranks per node per turn; null
    derives it from the free host memory (the smallest over all ranks, so every rank counts the same turns).
    A collective when derived: every rank calls it. ``what`` names the load in the printed line."""
    trainer = attached_trainer(module)
    if trainer is None or trainer.world_size == 1:
        return 1, 0
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    strategy = trainer.strategy
    if not hasattr(strategy, "parallelize_module") and (not isinstance(strategy, DDPStrategy)
                                                        or isinstance(strategy, DeepSpeedStrategy)):
        return 1, 0  # DeepSpeed (a DDPStrategy subclass) places the model itself
    per_node = max(1, trainer.num_devices)
    k = module.run_context.concurrent_loads
    if k is None:
        import psutil
        import torch.distributed as dist

        need = module.spec.load_bytes(module.expert_names, module.load_encoders)
        free = torch.tensor([float(psutil.virtual_memory().available)], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            free = free.to(strategy.root_device)
            dist.all_reduce(free, op=dist.ReduceOp.MIN)  # before any rank loads: the same answer everywhere
        k = max(1, int(0.8 * float(free) // max(1, need)))
        why = (f"{per_node} ranks x {need / 2**30:.1f} GiB of weights would not fit the {float(free) / 2**30:.0f} GiB "
               f"of free host memory; parallel.concurrent_loads sets it")
    else:
        why = f"parallel.concurrent_loads={k}"
    if k >= per_node:
        return 1, 0
    turns = -(-per_node // k)
    if trainer.global_rank == 0:
        print(f"wanexp: loading {what} in {turns} turns of {k} rank(s) per node ({why})", flush=True)
    return turns, (trainer.local_rank % per_node) // k
