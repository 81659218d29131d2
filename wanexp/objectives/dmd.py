"""DMD step distillation (DMD2-style, without the GAN term): a generator LoRA learns to sample in a few steps.

One frozen base per expert plays three parts, switched by adapter (never three model copies):
    teacher    adapters off; the "real score", with classifier-free guidance v = v_u + w (v_c - v_u)
    generator  adapter ``gen``: the few-step student, exported as the run's LoRA
    critic     adapter ``critic``: the "fake score", a flow-matching model of the generator's samples

Generator sample: from pure noise, the student's steps sigma_0 > sigma_1 > ... (``student_timesteps`` shifted by
``student_shift``): at each step the generator predicts x0 = x_t - sigma v, which is re-noised to the next sigma with
fresh noise. The rollout stops at a random exit step (the same on every rank); only that last call keeps a graph.
This is the sampler ``wanexp.cli.sample`` runs for a distilled LoRA (a stochastic flow-matching Euler step).

    generator loss  0.5 * MSE(x0_gen, sg(x0_gen - (x0_fake - x0_real) / mean|x0_gen - x0_real|)), the teacher and the
                    critic scoring x0_gen noised to a sampled sigma (DMD's distribution-matching gradient); the critic
                    with its own CFG scale ``fake_guidance_scale`` (1: its conditional prediction alone)
    critic loss     flow matching on the generator's samples (no gradient into the generator); elements whose error
                    exceeds ``critic_outlier`` are left out (VideoX-Fun's mask)

The sigmas at which the teacher and the critic score, and at which the critic trains, are clamped to
``score_sigma_clamp`` (DMD2's and Self-Forcing's 2 % .. 98 %). TI2V: ``first_frame_cond`` of the samples keep the
clip's clean latent frame 0 in every call of the step -- generator, teacher and critic see the same conditioning.

Each training step trains one adapter: ``generator_every`` critic steps, then one generator step.
"""
from __future__ import annotations

import random
from dataclasses import replace

import torch

from wanexp.config.schema import DMDConfig
from wanexp.errors import ConfigError
from wanexp.adapters import use_adapter
from wanexp.objectives.base import Objective, ObjectiveOutput, StudentSteps, draw_noise
from wanexp.objectives.flow_matching import FlowMatching, add_noise, masked_mse
from wanexp.objectives.timesteps import shift_sigma


def _per_sample(x: torch.Tensor) -> torch.Tensor:
    return x.view(-1, *([1] * 4))


# The TI2V recipe's share of image-to-video samples (VideoX-Fun conditions half of its DMD steps on the first frame).
RECIPE_FIRST_FRAME_COND = 0.5


def guided(cond: torch.Tensor, uncond: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Classifier-free guidance in the form v_u + w (v_c - v_u); w = 1 is the conditional prediction alone."""
    return cond if scale == 1.0 else uncond + scale * (cond - uncond)


def check_clamp(clamp) -> tuple[float, float] | None:
    """``objective.score_sigma_clamp``: null, or [lo, hi] with 0 <= lo < hi <= 1."""
    if clamp is None:
        return None
    lo, hi = (float(v) for v in clamp) if len(clamp) == 2 else (1.0, 0.0)
    if not 0.0 <= lo < hi <= 1.0:
        from wanexp.errors import ConfigError

        raise ConfigError(f"objective.score_sigma_clamp={list(clamp)}: must be [lo, hi] with 0 <= lo < hi <= 1 "
                          "(e.g. [0.02, 0.98]), or null for no clamp")
    return lo, hi


def outlier_mask(error: torch.Tensor, mask: torch.Tensor | None, threshold: float | None) -> torch.Tensor | None:
    """The loss mask with every element whose |error| exceeds ``threshold`` left out (None: the mask unchanged)."""
    if threshold is None:
        return mask
    keep = error.detach().abs() <= threshold
    return keep if mask is None else keep & mask.to(torch.bool).expand_as(keep)


def first_frame_fraction(setting: float | None, draws_first_frame: bool, layout: str) -> float:
    """The share of samples a DMD step conditions on the clip's first frame: the setting, or null: the recipe's 0.5
    on a layout with an optional first frame (TI2V) and none elsewhere."""
    if setting is None:
        return RECIPE_FIRST_FRAME_COND if draws_first_frame else 0.0
    if setting and not draws_first_frame:
        from wanexp.errors import ConfigError

        raise ConfigError(f"objective.first_frame_cond={setting:g}: the {layout} layout has no optional first-frame "
                          "conditioning (only TI2V-5B has); set it to null or 0")
    return setting


def check_options(cfg) -> None:
    """DMD's options against the other groups, at composition (nothing loaded): the model's layout for
    ``first_frame_cond``, the boundary's sigma range for ``score_sigma_clamp``."""
    from hydra.utils import get_class  # the spec class by its dotted name: nothing loads

    o, b = cfg.objective, cfg.boundary
    spec_class = get_class(str(cfg.model._target_))
    first_frame_fraction(o.first_frame_cond, spec_class.draws_first_frame, spec_class.layout)
    clamp = check_clamp(o.score_sigma_clamp)
    if clamp is not None and not (clamp[0] < b.sigma_max and clamp[1] > b.sigma_min):
        from wanexp.errors import ConfigError

        raise ConfigError(f"objective.score_sigma_clamp={list(clamp)} with boundary={b.name} "
                          f"[{b.sigma_min:g}, {b.sigma_max:g}]: the ranges do not overlap, so no noise level is left; "
                          "widen the clamp or set it to null")


class DMD(Objective):
    adapters = ("gen", "critic")
    export = "gen"
    manual = True
    one_forward = False  # the teacher's and the generator's or critic's forwards
    needs_negative_text = True
    schema = DMDConfig

    @classmethod
    def check(cls, cfg) -> None:
        m, b, p, t = cfg.model, cfg.boundary, cfg.parallel, cfg.trainer
        if p.name == "deepspeed":
            raise ConfigError("objective=dmd with parallel=deepspeed: DMD steps two adapters with two optimizers, and "
                              "DeepSpeed under Lightning takes one; use parallel=ddp or parallel=fsdp")
        if p.name == "fsdp" and b.name == "full" and m.boundary_ratio is not None:
            raise ConfigError(f"objective=dmd with parallel=fsdp and model={m.name} boundary=full: the ranks' critic "
                              "and generator losses would run different sharded experts in one step; distil one expert "
                              "per run (boundary=high|low) or use parallel=ddp")
        if p.sp_size > 1:
            raise ConfigError(f"parallel.sp_size={p.sp_size} with objective=dmd: DMD's gradient-free teacher and "
                              "critic forwards are not sequence-split; use parallel.sp_size=1")
        # each step trains one adapter with its own optimizer (Lightning manual optimization)
        if t.accumulate_grad_batches != 1:
            raise ConfigError(f"objective=dmd with trainer.accumulate_grad_batches={t.accumulate_grad_batches}: DMD "
                              "steps one adapter per batch; set trainer.accumulate_grad_batches=1 (raise "
                              "data.batch_size instead)")
        if str(t.precision).startswith("16"):
            raise ConfigError(f"objective=dmd with trainer.precision={t.precision}: the fp16 grad scaler is not "
                              "supported with DMD's two optimizers; use bf16-mixed (or 32)")
        check_options(cfg)  # the DMD2/VideoX-Fun options against the model's layout and the boundary

    def __init__(self, *, name: str, timestep: dict, student_timesteps: list[int], student_shift: float,
                 guidance_scale: float, negative_prompt: str, generator_every: int, generator: dict, critic: dict,
                 fake_guidance_scale: float = 1.0, score_sigma_clamp: list[float] | None = None,
                 critic_outlier: float | None = None, first_frame_cond: float | None = None):
        """The arguments are the ``objective=dmd`` group (config.schema.DMDConfig, whose YAML sets the recipe's
        values); the keyword defaults here leave each option out."""
        super().__init__(name)
        self.noise_levels = FlowMatching(name=name, timestep=timestep)  # its sigma sampler, on the boundary's range
        self.student_timesteps = [int(t) for t in student_timesteps]
        self.student_shift = float(student_shift)
        self.guidance_scale = float(guidance_scale)
        self.fake_guidance_scale = float(fake_guidance_scale)
        self.score_sigma_clamp = check_clamp(score_sigma_clamp)
        self.critic_outlier = None if critic_outlier is None else float(critic_outlier)
        self.first_frame_cond = None if first_frame_cond is None else float(first_frame_cond)
        self.negative_prompt = negative_prompt
        self.generator_every = int(generator_every)
        self.settings = {"gen": dict(generator), "critic": dict(critic)}
        if sorted(self.student_timesteps, reverse=True) != self.student_timesteps or \
                not all(0 < t <= 1000 for t in self.student_timesteps):
            from wanexp.errors import ConfigError

            raise ConfigError(f"objective.student_timesteps={self.student_timesteps}: must decrease, each in 1..1000 "
                              "(e.g. [1000, 750, 500, 250])")

    # ---- the schedule of updates ----------------------------------------------------------------------------------
    def phase(self, step: int) -> str:
        return "gen" if step % (self.generator_every + 1) == self.generator_every else "critic"

    def optimizer_settings(self) -> dict[str, dict]:
        return self.settings

    def student_steps(self) -> StudentSteps:
        return StudentSteps(tuple(self.student_timesteps), self.student_shift)

    def export_metadata(self) -> dict[str, str]:
        """wanexp.cli.sample samples a LoRA with these headers on exactly the student's steps."""
        return {**super().export_metadata(), "wanexp_student_timesteps": ",".join(map(str, self.student_timesteps)),
                "wanexp_student_shift": str(self.student_shift)}

    @property
    def student_sigmas(self) -> list[float]:
        """The student's noise levels (shifted), as the sampler uses them."""
        return [float(shift_sigma(t / 1000.0, self.student_shift)) for t in self.student_timesteps]

    def exit_step(self, step: int) -> int:
        """Where the rollout of training step ``step`` stops: random, and the same on every rank and after a resume."""
        return random.Random(1_000_003 * step + 17).randrange(len(self.student_timesteps))

    def sample_condition(self, batch, spec, generator=None) -> dict:
        """The step's conditioning, which every call of the step (generator, teacher, critic) then sees: on TI2V,
        ``first_frame_cond`` of the samples keep the clip's clean latent frame 0 (objective.first_frame_cond, not
        model.first_frame_cond, which is flow matching's); other layouts condition as the spec does."""
        if not spec.draws_first_frame:
            return spec.sample_condition(batch.cond, batch.size, generator)
        share = first_frame_fraction(self.first_frame_cond, True, spec.layout)
        return dict(batch.cond, first_frame=torch.rand(batch.size, generator=generator) < share)

    def prompts_only_problem(self, spec) -> str | None:
        """What of this run needs clips when the data is prompts alone (wanexp.data.prompts), or None: the generator
        samples from noise and the critic learns its samples, so text-to-video DMD needs the prompts only."""
        if spec.needs_image_latent:
            return (f"model={spec.name} conditions every sample on its clip's first frame; give clips, or distil a "
                    "text-to-video layout from prompts")
        share = first_frame_fraction(self.first_frame_cond, spec.draws_first_frame, spec.layout)
        if share:
            return (f"objective.first_frame_cond={share:g} conditions TI2V samples on their clips' first frames; "
                    "set objective.first_frame_cond=0 to distil text-to-video from prompts, or give clips")
        return None

    # ---- the losses -----------------------------------------------------------------------------------------------
    def _sigmas(self, n: int, denoiser, device, generator=None) -> torch.Tensor:
        """Noise levels for scoring and for the critic: the boundary's range, clamped to ``score_sigma_clamp``."""
        lo, hi = denoiser.sigma_range
        sigma = self.noise_levels.sample_sigmas(n, lo, hi, generator=generator, device=device)
        if self.score_sigma_clamp is None:
            return sigma
        c_lo, c_hi = self.score_sigma_clamp  # within the boundary's range: a clamped sigma keeps its expert
        return sigma.clamp(max(lo, c_lo), min(hi, c_hi))

    def rollout(self, batch, denoiser, exit_k: int, grad: bool, generator=None):
        """The generator's sample x0 after ``exit_k + 1`` student steps from noise, and the loss mask."""
        modules = list(denoiser.transformers.values())
        x0, b = batch.x0, batch.size
        sigmas = self.student_sigmas
        x = draw_noise(x0.shape, x0.dtype, x0.device, generator)
        with use_adapter(modules, "gen"):
            for i in range(exit_k + 1):
                s = torch.full((b,), sigmas[i], device=x0.device)
                with torch.set_grad_enabled(grad and i == exit_k):
                    pred = denoiser(x, s, batch)
                    x0_hat = x - _per_sample(s) * pred.velocity.float()
                    if pred.loss_mask is not None:  # a conditioned first frame is the clip's, not a prediction
                        x0_hat = torch.where(pred.loss_mask.to(torch.bool), x0_hat, x0.to(x0_hat.dtype))
                if i < exit_k:
                    nxt = sigmas[i + 1]
                    noise = draw_noise(x0.shape, x0.dtype, x0.device, generator)
                    x = (1 - nxt) * x0_hat.detach() + nxt * noise
        return x0_hat, pred.loss_mask

    def generator_loss(self, batch, denoiser, x0_gen, mask, negative_text, generator=None):
        modules = list(denoiser.transformers.values())
        b = batch.size
        sigma = self._sigmas(b, denoiser, x0_gen.device, generator)
        noise = draw_noise(x0_gen.shape, x0_gen.dtype, x0_gen.device, generator)
        with torch.no_grad():
            x_t = add_noise(x0_gen.detach(), noise, sigma)
            with use_adapter(modules, None):  # the teacher: the frozen base
                v_c = denoiser(x_t, sigma, batch).velocity.float()
                if self.guidance_scale != 1.0:
                    uncond = replace(batch, text=negative_text.to(batch.text).expand_as(batch.text))
                    v_u = denoiser(x_t, sigma, uncond).velocity.float()
                    v_c = v_u + self.guidance_scale * (v_c - v_u)
            with use_adapter(modules, "critic"):
                v_fake = denoiser(x_t, sigma, batch).velocity.float()
                if self.fake_guidance_scale != 1.0:
                    uncond = replace(batch, text=negative_text.to(batch.text).expand_as(batch.text))
                    v_fake = guided(v_fake, denoiser(x_t, sigma, uncond).velocity.float(), self.fake_guidance_scale)
            s = _per_sample(sigma)
            x0_real, x0_fake = x_t - s * v_c, x_t - s * v_fake
            m = torch.ones_like(x0_gen) if mask is None else mask.to(x0_gen.dtype).expand_as(x0_gen)
            dims = tuple(range(1, x0_gen.ndim))
            scale = ((x0_gen.detach() - x0_real).abs() * m).sum(dims) / m.sum(dims).clamp_min(1.0)
            target = x0_gen.detach() - (x0_fake - x0_real) / _per_sample(scale.clamp_min(1e-8))
        per_sample = 0.5 * masked_mse(x0_gen, target, mask)
        forwards = 2 + (self.guidance_scale != 1.0) + (self.fake_guidance_scale != 1.0)
        return per_sample, forwards  # the loss, and the forward-only passes it took

    def critic_loss(self, batch, denoiser, x0_gen, generator=None):
        modules = list(denoiser.transformers.values())
        x0 = x0_gen.detach()
        sigma = self._sigmas(batch.size, denoiser, x0.device, generator)
        noise = draw_noise(x0.shape, x0.dtype, x0.device, generator)
        with use_adapter(modules, "critic"):
            pred = denoiser(add_noise(x0, noise, sigma), sigma, batch)
        target = noise - x0
        mask = outlier_mask(pred.velocity.float() - target.float(), pred.loss_mask, self.critic_outlier)
        return masked_mse(pred.velocity, target, mask)

    def __call__(self, batch, denoiser, generator=None, *, step: int = 0,
                 negative_text: torch.Tensor | None = None) -> ObjectiveOutput:
        phase = self.phase(step)
        batch = replace(batch, cond=self.sample_condition(batch, denoiser.spec, generator))
        exit_k = self.exit_step(step)
        x0_gen, mask = self.rollout(batch, denoiser, exit_k, grad=phase == "gen", generator=generator)
        if phase == "gen":
            if negative_text is None and (self.guidance_scale != 1.0 or self.fake_guidance_scale != 1.0):
                raise ValueError("DMD with guidance needs the negative prompt's text embedding")
            per_sample, forwards = self.generator_loss(batch, denoiser, x0_gen, mask, negative_text, generator)
        else:
            per_sample, forwards = self.critic_loss(batch, denoiser, x0_gen, generator), 1  # the rollout's last call
        loss = per_sample.mean()
        # Model FLOPs: one pass with a backward, plus forward-only passes (each about half of a LoRA forward+backward).
        flops = denoiser.step_flops(batch.x0.shape, batch.text.shape[1]) * (1 + (exit_k + forwards) / 2)
        metrics = {f"train/loss_{'generator' if phase == 'gen' else 'critic'}": (loss.detach(), batch.size)}
        return ObjectiveOutput(loss=loss, batch_size=batch.size, metrics=metrics, flops=flops, adapter=phase)
