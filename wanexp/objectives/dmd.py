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
                    critic scoring x0_gen noised to a sampled sigma (DMD's distribution-matching gradient)
    critic loss     flow matching on the generator's samples (no gradient into the generator)

Each training step trains one adapter: ``generator_every`` critic steps, then one generator step.
"""
from __future__ import annotations

import random
from dataclasses import replace

import torch

from wanexp.lora import use_adapter
from wanexp.objectives.base import Objective, ObjectiveOutput, StudentSteps
from wanexp.objectives.flow_matching import FlowMatching, add_noise, masked_mse
from wanexp.objectives.timesteps import shift_sigma


def _per_sample(x: torch.Tensor) -> torch.Tensor:
    return x.view(-1, *([1] * 4))


class DMD(Objective):
    adapters = ("gen", "critic")
    export = "gen"
    manual = True
    needs_negative_text = True

    def __init__(self, *, name: str, timestep: dict, student_timesteps: list[int], student_shift: float,
                 guidance_scale: float, negative_prompt: str, generator_every: int, generator: dict, critic: dict):
        """The arguments are the ``objective=dmd`` group (config.schema.DMDConfig)."""
        super().__init__(name)
        self.noise_levels = FlowMatching(name=name, timestep=timestep)  # its sigma sampler, on the boundary's range
        self.student_timesteps = [int(t) for t in student_timesteps]
        self.student_shift = float(student_shift)
        self.guidance_scale = float(guidance_scale)
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

    # ---- the losses -----------------------------------------------------------------------------------------------
    def _sigmas(self, n: int, denoiser, device, generator=None) -> torch.Tensor:
        return self.noise_levels.sample_sigmas(n, *denoiser.sigma_range, generator=generator, device=device)

    def rollout(self, batch, denoiser, exit_k: int, grad: bool, generator=None):
        """The generator's sample x0 after ``exit_k + 1`` student steps from noise, and the loss mask."""
        modules = list(denoiser.transformers.values())
        x0, b = batch.x0, batch.size
        sigmas = self.student_sigmas
        x = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)
        with use_adapter(modules, "gen"):
            for i in range(exit_k + 1):
                s = torch.full((b,), sigmas[i], device=x0.device)
                with torch.set_grad_enabled(grad and i == exit_k):
                    pred = denoiser(x, s, batch)
                    x0_hat = x - _per_sample(s) * pred.velocity.float()
                if i < exit_k:
                    nxt = sigmas[i + 1]
                    noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)
                    x = (1 - nxt) * x0_hat.detach() + nxt * noise
        return x0_hat, pred.loss_mask

    def generator_loss(self, batch, denoiser, x0_gen, mask, negative_text, generator=None):
        modules = list(denoiser.transformers.values())
        b = batch.size
        sigma = self._sigmas(b, denoiser, x0_gen.device, generator)
        noise = torch.randn(x0_gen.shape, generator=generator, dtype=x0_gen.dtype).to(x0_gen.device)
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
            s = _per_sample(sigma)
            x0_real, x0_fake = x_t - s * v_c, x_t - s * v_fake
            m = torch.ones_like(x0_gen) if mask is None else mask.to(x0_gen.dtype).expand_as(x0_gen)
            dims = tuple(range(1, x0_gen.ndim))
            scale = ((x0_gen.detach() - x0_real).abs() * m).sum(dims) / m.sum(dims).clamp_min(1.0)
            target = x0_gen.detach() - (x0_fake - x0_real) / _per_sample(scale.clamp_min(1e-8))
        per_sample = 0.5 * masked_mse(x0_gen, target, mask)
        return per_sample, 3 if self.guidance_scale != 1.0 else 2  # the loss, and the forward-only passes it took

    def critic_loss(self, batch, denoiser, x0_gen, generator=None):
        modules = list(denoiser.transformers.values())
        x0 = x0_gen.detach()
        sigma = self._sigmas(batch.size, denoiser, x0.device, generator)
        noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)
        with use_adapter(modules, "critic"):
            pred = denoiser(add_noise(x0, noise, sigma), sigma, batch)
        return masked_mse(pred.velocity, noise - x0, pred.loss_mask)

    def __call__(self, batch, denoiser, generator=None, *, step: int = 0,
                 negative_text: torch.Tensor | None = None) -> ObjectiveOutput:
        phase = self.phase(step)
        batch = replace(batch, cond=denoiser.spec.sample_condition(batch.cond, batch.size, generator))
        exit_k = self.exit_step(step)
        x0_gen, mask = self.rollout(batch, denoiser, exit_k, grad=phase == "gen", generator=generator)
        if phase == "gen":
            if negative_text is None and self.guidance_scale != 1.0:
                raise ValueError("DMD with guidance needs the negative prompt's text embedding")
            per_sample, forwards = self.generator_loss(batch, denoiser, x0_gen, mask, negative_text, generator)
        else:
            per_sample, forwards = self.critic_loss(batch, denoiser, x0_gen, generator), 1  # the rollout's last call
        loss = per_sample.mean()
        # Model FLOPs: one pass with a backward, plus forward-only passes (each about half of a LoRA forward+backward).
        flops = denoiser.step_flops(batch.x0.shape, batch.text.shape[1]) * (1 + (exit_k + forwards) / 2)
        metrics = {f"train/loss_{'generator' if phase == 'gen' else 'critic'}": (loss.detach(), batch.size)}
        return ObjectiveOutput(loss=loss, batch_size=batch.size, metrics=metrics, flops=flops, adapter=phase)
