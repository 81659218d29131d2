"""DMD step distillation on the tiny model: one base as teacher, generator and critic; each step trains one adapter."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import compose_cfg, module_from
from tests.integration.conftest import tiny_run
from wanexp.adapters import use_adapter
from wanexp.models.denoiser import Prediction
from wanexp.models.encoders import EncodedBatch
from wanexp.objectives.dmd import DMD

DMD_FAST = ["objective=dmd", "objective.generator_every=1", "objective.generator.lr=1e-3", "objective.critic.lr=1e-3",
            "objective.student_timesteps=[1000,500]"]


def _module(shared_dir, extra=()):
    module = module_from(compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", *DMD_FAST,
                                      *extra]))
    torch.manual_seed(0)  # the LoRA A matrices are drawn at random
    module.configure_model()
    return module


def _batch(module, seed=0) -> EncodedBatch:
    g = torch.Generator().manual_seed(seed)
    t = next(iter(module.transformers.values()))
    x0 = torch.randn(2, 48, 3, 4, 4, generator=g)
    text = torch.randn(2, module.spec.text_len, t.config.text_dim, generator=g)
    return EncodedBatch(x0, text, {})


def _randomise(module, names=("gen", "critic"), seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if "lora_B" in n and any(f".{a}." in n for a in names):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_at_init_teacher_generator_and_critic_agree_and_the_unguided_loss_is_zero(shared_dir):
    module = _module(shared_dir, ["objective.guidance_scale=1.0"])
    batch, modules = _batch(module), list(module.transformers.values())
    x_t, sigma = torch.randn_like(batch.x0), torch.tensor([0.9, 0.4])
    outs = {}
    for name in (None, "gen", "critic"):
        with use_adapter(modules, name):
            outs[name] = module.denoiser(x_t, sigma, batch).velocity
    assert torch.equal(outs[None], outs["gen"]) and torch.equal(outs[None], outs["critic"])
    gen_step = next(s for s in range(10) if module.objective.phase(s) == "gen")
    out = module.objective(batch, module.denoiser, torch.Generator().manual_seed(0), step=gen_step)
    assert out.adapter == "gen" and out.loss.item() == 0.0
    _randomise(module, ["critic"])  # a critic that differs from the teacher gives a gradient
    out = module.objective(batch, module.denoiser, torch.Generator().manual_seed(0), step=gen_step)
    assert out.loss.item() > 0


def _grads(shared_dir, checkpointing: bool, phase: str, reactivate: bool = True) -> dict:
    module = _module(shared_dir, [f"model.gradient_checkpointing={checkpointing}"])
    _randomise(module)
    module.train()
    step = next(s for s in range(10) if module.objective.phase(s) == phase)
    neg = torch.zeros(1, module.spec.text_len, next(iter(module.transformers.values())).config.text_dim)
    out = module.objective(_batch(module), module.denoiser, torch.Generator().manual_seed(3), step=step,
                           negative_text=neg)
    with use_adapter(list(module.transformers.values()), out.adapter if reactivate else "critic"):
        out.loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("phase", ["gen", "critic"])
def test_activation_checkpointing_recomputes_under_the_right_adapter(shared_dir, phase):
    plain, ckpt = _grads(shared_dir, False, phase), _grads(shared_dir, True, phase)
    assert plain and plain.keys() == ckpt.keys() and all(f".{phase}." in n for n in plain)
    assert all(torch.allclose(plain[n], ckpt[n], rtol=1e-5, atol=1e-7) for n in plain)
    if phase == "gen":  # backward under another adapter than the forward's recomputes a different function
        wrong = _grads(shared_dir, True, phase, reactivate=False)
        assert any(not torch.allclose(plain[n], wrong[n], rtol=1e-5, atol=1e-7) for n in plain)


def test_each_step_trains_only_its_adapter_and_the_base_is_unchanged(shared_dir, tmp_path):
    r = tiny_run(shared_dir, tmp_path / "run", [*DMD_FAST, "trainer.max_steps=4",
                                                "callbacks.checkpoint.every_n_train_steps=1",
                                                "callbacks.checkpoint.save_top_k=-1"])
    out, objective = Path(r["output_dir"]), r["module"].objective
    states = {s: torch.load(out / "checkpoints" / f"step_{s:06d}.ckpt", weights_only=True)["state_dict"]
              for s in (1, 2, 3, 4)}
    for s in (1, 2, 3):  # between checkpoints s and s+1 the optimizer step with index s ran
        trained = objective.phase(s)
        other = "critic" if trained == "gen" else "gen"
        changed = {n for n in states[s] if not torch.equal(states[s][n], states[s + 1][n])}
        assert changed and all(f".{trained}." in n for n in changed), (s, trained)
        assert any(f"lora_B.{trained}." in n for n in changed)
        assert all(torch.equal(states[s][n], states[s + 1][n]) for n in states[s] if f".{other}." in n)
    fresh = r["module"].spec.load_transformer("dense")
    trained_base = {n.removeprefix("transformers.dense."): p for n, p in r["module"].named_parameters()
                    if "lora_" not in n}
    for n, p in fresh.named_parameters():  # a LoRA-wrapped layer keeps its weight as base_layer.*
        key = n if n in trained_base else ".base_layer.".join(n.rsplit(".", 1))
        assert torch.equal(trained_base[key], p), n
    lora = out / "lora" / "final" / "tiny_lora_diffusers.safetensors"
    from safetensors.torch import load_file

    assert lora.is_file() and not any("critic" in k for k in load_file(lora))  # only the generator is exported


def test_resume_restores_both_optimizers_and_the_phase(shared_dir, tmp_path):
    """Stopped after step 3 and resumed from step 2 (the phases alternate), it ends where an uninterrupted run does.
    (A constant schedule: a decaying one is shaped by max_steps, which differs between the two runs here.)"""
    from safetensors.torch import load_file

    const = ["optim.scheduler=constant"]

    full = tiny_run(shared_dir, tmp_path / "full", [*DMD_FAST, *const, "trainer.max_steps=5",
                                                    "callbacks.checkpoint.every_n_train_steps=2"])
    tiny_run(shared_dir, tmp_path / "cut", [*DMD_FAST, *const, "trainer.max_steps=3",
                                            "callbacks.checkpoint.every_n_train_steps=2"])
    ckpt = torch.load(tmp_path / "cut" / "checkpoints" / "step_000002.ckpt", weights_only=True)
    assert len(ckpt["optimizer_states"]) == 2  # generator and critic
    resumed = tiny_run(shared_dir, tmp_path / "cut", [*DMD_FAST, *const, "trainer.max_steps=5",
                                                      "callbacks.checkpoint.every_n_train_steps=2",
                                                      f"resume={tmp_path / 'cut' / 'checkpoints' / 'step_000002.ckpt'}"])
    assert resumed["global_step"] == 5
    a = {n: p for n, p in full["module"].named_parameters() if p.requires_grad}
    b = {n: p for n, p in resumed["module"].named_parameters() if p.requires_grad}
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)  # both adapters, bit for bit
    name = "tiny_lora_comfyui.safetensors"
    x, y = load_file(tmp_path / "full" / "lora" / "final" / name), load_file(tmp_path / "cut" / "lora" / "final" / name)
    assert all(torch.equal(x[k], y[k]) for k in x)


def test_compiled_blocks_stay_compiled_through_both_phases_and_two_bucket_shapes(shared_dir, monkeypatch):
    """DMD calls the compiled blocks with three adapter states (generator, critic, none: the teacher), with and
    without grad, and buckets change the shapes: each combination is one compiled entry of the blocks' shared code.
    On this model these passed dynamo's default limit (8), past which the calls ran eagerly: here none may.
    (Dynamo's eager backend: the same guards and entries as inductor's, without its kernel compile.)"""
    from functools import partial

    from wanexp.models.wan22 import fast

    monkeypatch.setattr(fast, "compile_blocks", partial(fast.compile_blocks, backend="eager"))
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True,
                                        recompile_limit=torch._dynamo.config.recompile_limit):
            module = _module(shared_dir, ["model.compile=true"])
            assert hasattr(next(iter(module.transformers.values())), "_wanexp_compiled_checkpoint")
            _randomise(module)
            module.train()
            modules = list(module.transformers.values())
            neg = torch.zeros(1, module.spec.text_len, modules[0].config.text_dim)
            # a video bucket (3 latent frames) in both phases, then an image bucket: 12 entries, 8 at most before
            for frames, phase in ((3, "gen"), (3, "critic"), (1, "gen")):
                batch = _batch(module)
                batch = replace(batch, x0=batch.x0[:, :, :1].repeat(1, 1, frames, 1, 1))
                step = next(s for s in range(10) if module.objective.phase(s) == phase)
                out = module.objective(batch, module.denoiser, torch.Generator().manual_seed(frames), step=step,
                                       negative_text=neg)
                with use_adapter(modules, out.adapter):
                    out.loss.backward()
    finally:
        torch._dynamo.reset()


# ---- the DMD gradient on a problem with a known answer ----------------------------------------------------------
class _Gaussian(nn.Module):
    """A 'transformer' holding one LoRA layer so that use_adapter can switch it: no adapter = the teacher, whose data
    is N(mu_real, s0^2); adapter critic = N(mu_fake, s0^2). Predicts the exact posterior-mean velocity."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 1)


class _ToyDenoiser:
    sigma_range = (0.02, 0.98)

    def __init__(self, mu_real: float, s0: float = 0.5):
        from peft import LoraConfig, inject_adapter_in_model

        t = _Gaussian()
        for name in ("gen", "critic"):
            inject_adapter_in_model(LoraConfig(r=1, target_modules=["lin"]), t, adapter_name=name)
        self.transformers = {"dense": t}
        self.mu_real, self.mu_fake, self.s0 = mu_real, 0.0, s0

    def __call__(self, x_t, sigma, batch):
        layer = self.transformers["dense"].lin
        mu = self.mu_real if layer._disable_adapters else self.mu_fake
        s = sigma.view(-1, *([1] * (x_t.ndim - 1)))
        a = 1 - s  # x_t = a x0 + s eps, x0 ~ N(mu, s0^2): E[x0 | x_t] = mu + a s0^2 (x_t - a mu) / (a^2 s0^2 + s^2)
        x0_hat = mu + a * self.s0**2 * (x_t - a * mu) / (a**2 * self.s0**2 + s**2)
        return Prediction((x_t - x0_hat) / s, None, torch.zeros(x_t.shape[0], dtype=torch.long))


def test_the_generator_moves_toward_the_teacher_distribution():
    dmd = DMD(name="dmd", timestep={"sampling": "uniform", "shift": 1.0, "logit_mean": 0.0, "logit_std": 1.0},
              student_timesteps=[1000], student_shift=1.0, guidance_scale=1.0, negative_prompt="", generator_every=1,
              generator={}, critic={})
    toy = _ToyDenoiser(mu_real=2.0)
    offset = torch.zeros((), requires_grad=True)  # the generator: x0 = offset + s0 * z
    opt = torch.optim.SGD([offset], lr=0.5)
    g = torch.Generator().manual_seed(0)
    shape = (8, 1, 1, 16, 16)  # 8 samples of 256 elements: DMD normalises per sample by its mean |x0_gen - x0_real|
    batch = EncodedBatch(torch.zeros(shape), torch.zeros(8, 1, 1), {})
    for _ in range(60):
        x0_gen = offset + toy.s0 * torch.randn(shape, generator=g)
        toy.mu_fake = float(offset)  # an ideal critic: it knows the generator's distribution
        per_sample, _ = dmd.generator_loss(batch, toy, x0_gen, None, None, g)
        opt.zero_grad()
        per_sample.mean().backward()
        opt.step()
    assert abs(float(offset) - 2.0) < 0.2, float(offset)  # from 0 to the teacher's mean


def test_the_critic_loss_falls_on_a_fixed_batch(shared_dir):
    """The critic learns the generator's samples: repeated critic steps on one batch (same draws) lower its loss."""
    module = _module(shared_dir)
    batch, modules = _batch(module), list(module.transformers.values())
    step = next(s for s in range(10) if module.objective.phase(s) == "critic")
    critic = [p for n, p in module.named_parameters() if p.requires_grad and ".critic." in n]
    opt = torch.optim.AdamW(critic, lr=1e-2)
    losses = []
    for _ in range(30):
        out = module.objective(batch, module.denoiser, torch.Generator().manual_seed(5), step=step)
        opt.zero_grad()
        with use_adapter(modules, out.adapter):
            out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert out.adapter == "critic" and losses[-1] < 0.85 * losses[0], losses[::6]
    assert all(a > b for a, b in zip(losses[::6], losses[6::6])), losses[::6]
