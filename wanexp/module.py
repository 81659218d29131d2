"""The LightningModule: wires a model spec, an adapter, an objective and an optimizer. It never branches on the model.

    spec       what differs between Wan2.2 layouts (wanexp/models/spec.py): loading, conditioning, expert routing
    adapter    what is trained on the frozen base of each expert (wanexp/lora.py: LoraAdapter)
    objective  the loss and its metrics, given an encoded batch and the denoiser (wanexp/objectives/)
    optimizer  a factory from the `optim` group + the schedule settings (wanexp/optim.py)
"""
from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from torch import nn

from wanexp.errors import DivergedError
from wanexp.models.denoiser import Denoiser
from wanexp.models.encode import cached_batch
from wanexp.models.spec import WanSpec
from wanexp.objectives.base import Objective
from wanexp.optim import build_optimizer, lr_lambda


class WanModule(L.LightningModule):
    def __init__(self, spec: WanSpec, adapter, objective: Objective, boundary: dict, optimizer: Callable, lr: float,
                 schedule: dict, max_steps: int = -1, load_encoders: bool = True, allow_resume_changes: bool = False,
                 max_bad_steps: int = 10):
        super().__init__()
        self.spec, self.adapter, self.objective = spec, adapter, objective
        self.boundary_name = boundary["name"]
        self.sigma_range = (float(boundary["sigma_min"]), float(boundary["sigma_max"]))
        self.expert_names = spec.trained_experts(self.boundary_name)
        self.optimizer_factory, self.lr, self.schedule = optimizer, lr, dict(schedule)
        self.max_steps = max_steps
        self.load_encoders = load_encoders  # False when every batch carries cached latents and text embeddings
        self.allow_resume_changes = allow_resume_changes
        self.max_bad_steps = max_bad_steps  # non-finite steps in a row that stop the run
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite loss or gradient, over the whole run
        self._bad_in_row = 0
        self._loss_finite: torch.Tensor | None = None  # every loss of the current optimizer step was finite
        self._rng_to_restore: dict | None = None  # from a resumed checkpoint, put back before the first step
        self.transformers = nn.ModuleDict()
        self.encoders = None
        self.denoiser = Denoiser(spec, self.transformers, self.sigma_range)
        self.trainable_names: list[str] = []
        # Checkpoints hold the adapter weights only; the frozen base comes from model.path.
        self.strict_loading = False

    # ---- building -------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if len(self.transformers):
            return
        for e in self.expert_names:
            t = _readable(self.spec, f"the {e} transformer", self.spec.load_transformer, e)
            for name in self.objective.adapters:
                self.adapter.apply(t, name)
            self.transformers[e] = t
        if self.load_encoders:
            self.encoders = _readable(self.spec, "the VAE and text encoder", self.spec.load_encoders)
        self.trainable_names = [n for n, p in self.named_parameters() if p.requires_grad]
        parallelize = getattr(self._trainer.strategy, "parallelize_module", None) if self._trainer else None
        if parallelize is not None:  # FSDP: shard after the adapters are added, before optimizers exist
            parallelize(self)
        # Every rank loads the same frozen weights from disk: DDP need not broadcast or watch them.
        trainable = set(self.trainable_names)
        self._ddp_params_and_buffers_to_ignore = [n for n, _ in self.named_parameters() if n not in trainable] + [
            n for n, _ in self.named_buffers()
        ]

    # ---- the step -------------------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int):
        encoded = cached_batch(batch) if "latents" in batch else self.encoders(batch)
        out = self.objective(encoded, self.denoiser)
        finite = torch.isfinite(out.loss.detach())  # checked (one sync) once per optimizer step, before it
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        self.log("train/loss", out.loss, prog_bar=True, batch_size=out.batch_size)
        for name, (value, n) in out.metrics.items():
            self.log(name, value, batch_size=n)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0], batch_size=out.batch_size)
        return {"loss": out.loss, "flops": out.flops}

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self._rng_to_restore is not None:  # resumed: continue the random streams exactly where the save left them
            from wanexp.rng import set_rng_state

            set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    # ---- optimisation ---------------------------------------------------------------------------------------
    def on_before_optimizer_step(self, optimizer) -> None:
        """Skip an optimizer step whose loss or gradients are not finite (its gradients are dropped, so AdamW leaves
        the weights and moments as they were), count it in ``train/skipped_steps``, and stop the run after
        ``max_bad_steps`` of them in a row. With an fp16 grad scaler, gradient overflow is the scaler's to skip."""
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        if self._loss_finite is not None:
            bad = bad | ~self._loss_finite.to(self.device)
        self._loss_finite = None
        if getattr(self.trainer.precision_plugin, "scaler", None) is None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2: this rank's shard
            if grads:
                bad = bad | ~torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum()).to(self.device)
        if self.trainer.world_size > 1:  # sharded gradients: every rank must take the same decision
            bad = self.trainer.strategy.reduce(bad.float(), reduce_op="max") > 0
        if bool(bad):
            optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self._bad_in_row += 1
            if self.global_rank == 0:
                print(f"wanexp: step {self.global_step + 1}: non-finite loss or gradient; step skipped "
                      f"({self._bad_in_row} in a row, {self.skipped_steps} in the run)", flush=True)
            if self._bad_in_row >= self.max_bad_steps:
                raise DivergedError(
                    f"{self._bad_in_row} optimizer steps in a row had a non-finite loss or gradient (up to step "
                    f"{self.global_step + 1}); the run diverged and stopped with its last checkpoint intact: lower "
                    "optim.lr, or use trainer.precision=bf16-mixed, then resume=last (guard.max_bad_steps sets the limit)")
        else:
            self._bad_in_row = 0
        self.log("train/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self):
        opt = build_optimizer(self.optimizer_factory, (p for p in self.parameters() if p.requires_grad), self.lr)
        total = self.max_steps if self.max_steps and self.max_steps > 0 else int(self.trainer.estimated_stepping_batches)
        s = self.schedule
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
        """Clip as Lightning would, also for a fused optimizer under bf16 autocast.

        Lightning's mixed-precision plugin refuses to clip gradients for any fused optimizer, a rule that matters only
        with an fp16 grad scaler (the fused step unscales internally). Without a scaler the gradients are already
        true gradients, so they are clipped here with the same torch call.
        """
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugin = self.trainer.precision_plugin
        if not (gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
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

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("wanexp", {})
        self._check_resume_settings(saved)
        self.skipped_steps = int(saved.get("skipped_steps", 0))
        states = saved.get("rng") or []
        if len(states) == self.trainer.world_size:  # another world size draws differently anyway
            self._rng_to_restore = states[self.global_rank]
        if "state_dict" not in checkpoint:  # FSDP loads weights itself before this hook
            return
        missing = [n for n in self.trainable_names if n not in checkpoint["state_dict"]]
        if missing:
            from wanexp.errors import ConfigError

            raise ConfigError(
                f"resume: the checkpoint lacks {len(missing)} adapter weights of this run (e.g. {missing[0]}); it was "
                "written by a run with other model/boundary/adapter settings: resume with those"
            )


def _readable(spec: WanSpec, what: str, load, *args):
    """Load weights; a corrupt or truncated file (what a partial download leaves) is one line, not a traceback."""
    from safetensors import SafetensorError

    try:
        return load(*args)
    except (OSError, SafetensorError) as e:
        from wanexp.errors import ConfigError

        reason = " ".join(str(e).split())[:300]
        raise ConfigError(f"model.path={spec.path}: cannot read {what} ({reason}); a weight file there is corrupt or "
                          "incomplete: download (or convert) it again") from None
