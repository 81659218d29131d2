"""DMD's DMD2/VideoX-Fun options, each against its formula on a scripted denoiser (no model): the critic's CFG, the
clamp of the scoring sigmas, the critic's outlier mask, TI2V first-frame conditioning, and Wan's negative prompt."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests.conftest import compose_cfg
from wanexp.errors import ConfigError
from wanexp.models.denoiser import Prediction
from wanexp.models.encoders import EncodedBatch
from wanexp.config import check_config
from wanexp.objectives.dmd import DMD, first_frame_fraction, outlier_mask

UNIFORM = {"sampling": "uniform", "shift": 1.0, "logit_mean": 0.0, "logit_std": 1.0}
# Wan's standard negative prompt (Wan2.2's shared_config sample_neg_prompt, VideoX-Fun's --negative_prompt default)
WAN_NEGATIVE = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"
                "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，"
                "畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")


def _dmd(**options) -> DMD:
    base = dict(name="dmd", timestep=UNIFORM, student_timesteps=[1000, 500], student_shift=1.0, guidance_scale=1.0,
                negative_prompt="", generator_every=1, generator={}, critic={})
    return DMD(**{**base, **options})


class _T2V:
    draws_first_frame, layout = False, "t2v_a14b"

    def sample_condition(self, cond, batch_size, generator=None):
        return cond

    def model_inputs(self, x_t, x0, sigma, cond):
        return x_t, sigma, None


class _TI2V(_T2V):
    draws_first_frame, layout = True, "ti2v"

    def model_inputs(self, x_t, x0, sigma, cond):
        from wanexp.models.wan22.conditioning import ti2v_inputs

        return ti2v_inputs(x_t, x0, sigma, cond["first_frame"], (1, 2, 2))


class _Scripted:
    """A denoiser whose velocity is ``velocity(adapter, text, hidden, sigma)``; it records every call. The adapter
    is read from a peft layer, so DMD's use_adapter switches it as it switches a real transformer's."""

    def __init__(self, velocity, spec=None, sigma_range=(0.0, 1.0)):
        from peft import LoraConfig, inject_adapter_in_model

        t = nn.Sequential(nn.Linear(1, 1))
        with warnings.catch_warnings():  # peft warns that the second adapter joins the first: as DMD wants
            warnings.simplefilter("ignore")
            for name in ("gen", "critic"):
                inject_adapter_in_model(LoraConfig(r=1, target_modules=["0"]), t, adapter_name=name)
        self.transformers, self.spec, self.sigma_range = {"dense": t}, spec or _T2V(), sigma_range
        self.velocity, self.calls = velocity, []

    def adapter(self):
        layer = self.transformers["dense"][0]
        return None if layer._disable_adapters else layer._active_adapter[0]

    def __call__(self, x_t, sigma, batch):
        hidden, _, mask = self.spec.model_inputs(x_t, batch.x0, sigma, batch.cond)
        self.calls.append({"adapter": self.adapter(), "sigma": sigma.clone(), "hidden": hidden.clone(),
                           "uncond": bool(batch.text.eq(-1).all()), "cond": dict(batch.cond)})
        v = self.velocity(self.adapter(), batch.text, hidden, sigma)
        return Prediction(v, mask, torch.zeros(x_t.shape[0], dtype=torch.long))


def _batch(b=2, frames=3, seed=0) -> EncodedBatch:
    g = torch.Generator().manual_seed(seed)
    return EncodedBatch(torch.randn(b, 4, frames, 4, 4, generator=g), torch.ones(b, 2, 3), {})


NEGATIVE = -torch.ones(1, 2, 3)  # the scripted denoiser tells the unconditional branch by this text


# ---- fake_guidance_scale ----------------------------------------------------------------------------------------
def _critic_cfg_denoiser():
    """Teacher: velocity 1 with either text (guided: 1 at any scale). Critic: 0.5 conditional, -0.5 unconditional."""
    def velocity(adapter, text, hidden, sigma):
        uncond = bool(text.eq(-1).all())
        value = 1.0 if adapter is None else (-0.5 if uncond else 0.5)
        return torch.full_like(hidden, value)
    return _Scripted(velocity)


def test_the_critic_guidance_is_v_u_plus_w_times_v_c_minus_v_u():
    """At w = 1.5 the critic's guided velocity -0.5 + 1.5 (0.5 + 0.5) = 1 equals the teacher's: the DMD gradient and
    the loss are exactly zero. Another form (v_c + w (v_c - v_u) = 2) or no guidance (0.5) leaves a loss."""
    x0_gen = torch.randn(2, 4, 3, 4, 4)
    for scale, zero in ((1.5, True), (1.0, False), (2.5, False)):
        den = _critic_cfg_denoiser()
        loss, forwards = _dmd(fake_guidance_scale=scale).generator_loss(
            _batch(), den, x0_gen, None, NEGATIVE, torch.Generator().manual_seed(0))
        critic_calls = [c for c in den.calls if c["adapter"] == "critic"]
        assert (loss.abs().max().item() == 0.0) == zero, (scale, loss)
        assert len(critic_calls) == (1 if scale == 1.0 else 2) and forwards == 2 + (scale != 1.0)
        assert [c["uncond"] for c in critic_calls] == ([False] if scale == 1.0 else [False, True])


def test_critic_guidance_without_a_negative_embedding_is_refused():
    dmd = _dmd(fake_guidance_scale=2.0)
    gen_step = next(s for s in range(4) if dmd.phase(s) == "gen")
    with pytest.raises(ValueError, match="negative prompt"):
        dmd(_batch(), _critic_cfg_denoiser(), torch.Generator().manual_seed(0), step=gen_step, negative_text=None)


# ---- score_sigma_clamp ------------------------------------------------------------------------------------------
def test_scoring_and_critic_sigmas_are_clamped_and_keep_their_expert():
    den = _Scripted(lambda a, t, h, s: torch.zeros_like(h))
    g = torch.Generator().manual_seed(0)
    free = _dmd(score_sigma_clamp=None)._sigmas(4000, den, "cpu", g)
    clamped = _dmd(score_sigma_clamp=[0.02, 0.98])._sigmas(4000, den, "cpu", torch.Generator().manual_seed(0))
    assert free.min() < 0.02 and free.max() > 0.98
    assert clamped.min() == pytest.approx(0.02) and clamped.max() == pytest.approx(0.98)
    assert torch.equal(clamped, free.clamp(0.02, 0.98))  # a clamp of the same draws, not another distribution
    high = _Scripted(lambda a, t, h, s: torch.zeros_like(h), sigma_range=(0.9, 1.0))
    s = _dmd(score_sigma_clamp=[0.02, 0.98])._sigmas(1000, high, "cpu", g)
    assert s.min() >= 0.9 and s.max() == pytest.approx(0.98)  # inside the expert's range
    # both losses score at the clamped levels (the rollout keeps the student's own sigmas, 1.0 included)
    dmd, x0 = _dmd(score_sigma_clamp=[0.3, 0.4]), torch.randn(2, 4, 3, 4, 4)
    dmd.generator_loss(_batch(), den, x0, None, None, g)
    dmd.critic_loss(_batch(), den, x0, g)
    assert den.calls and all(0.3 - 1e-6 <= float(s) <= 0.4 + 1e-6 for c in den.calls for s in c["sigma"])


def test_a_bad_clamp_is_one_config_error():
    with pytest.raises(ConfigError, match=r"objective.score_sigma_clamp=\[0.9, 0.1\]: must be \[lo, hi\]"):
        _dmd(score_sigma_clamp=[0.9, 0.1])
    cfg = compose_cfg(["objective=dmd", "model=tiny_t2v14b", "boundary=high", "objective.score_sigma_clamp=[0.1,0.5]"])
    with pytest.raises(ConfigError, match="do not overlap"):  # at composition, before anything loads
        check_config(cfg)


# ---- critic_outlier ---------------------------------------------------------------------------------------------
def test_the_critic_loss_leaves_out_elements_whose_error_exceeds_the_threshold():
    """The scripted critic predicts the flow-matching target plus an error of 1 everywhere and 60 on a quarter of
    the elements: with threshold 50 the loss is the MSE of the kept elements (exactly 1), off it is the plain MSE."""
    x0 = torch.randn(2, 4, 3, 4, 4)
    err = torch.ones_like(x0)
    err[:, :1] = 60.0

    def velocity(adapter, text, x_t, sigma):
        s = sigma.view(-1, 1, 1, 1, 1)
        noise = (x_t - (1 - s) * x0) / s
        return noise - x0 + err

    den = _Scripted(velocity)
    masked = _dmd(critic_outlier=50.0).critic_loss(_batch(), den, x0, torch.Generator().manual_seed(0))
    plain = _dmd(critic_outlier=None).critic_loss(_batch(), den, x0, torch.Generator().manual_seed(0))
    assert torch.allclose(masked, torch.ones(2), atol=1e-3), masked
    assert torch.allclose(plain, (err**2).mean(dim=(1, 2, 3, 4)), rtol=1e-4), plain


def test_the_outlier_mask_keeps_the_loss_mask():
    error = torch.tensor([[1.0, 60.0, -70.0, 2.0]])
    assert outlier_mask(error, None, None) is None
    assert outlier_mask(error, None, 50.0).tolist() == [[True, False, False, True]]
    frame_mask = torch.tensor([[False, True, True, True]])
    assert outlier_mask(error, frame_mask, 50.0).tolist() == [[False, False, False, True]]


# ---- first_frame_cond (TI2V) ------------------------------------------------------------------------------------
def test_first_frame_share_defaults_to_the_recipe_on_ti2v_only():
    assert first_frame_fraction(None, True, "ti2v") == 0.5
    assert first_frame_fraction(None, False, "t2v_a14b") == 0.0
    assert first_frame_fraction(0.2, True, "ti2v") == 0.2
    with pytest.raises(ConfigError, match=r"objective.first_frame_cond=0.5: the i2v_a14b layout has no optional"):
        first_frame_fraction(0.5, False, "i2v_a14b")
    check_config(compose_cfg(["objective=dmd", "model=tiny_t2v14b", "objective.first_frame_cond=0"]))
    with pytest.raises(ConfigError, match="t2v_a14b layout has no optional first-frame"):  # at composition
        check_config(compose_cfg(["objective=dmd", "model=tiny_t2v14b", "objective.first_frame_cond=0.5"]))


def test_ti2v_dmd_conditions_generator_teacher_and_critic_on_the_clips_first_frame():
    """One generator step with guidance: every call sees the same draw; a drawn sample's DiT input has the clip's
    frame 0 in every call; the generator's sample keeps it; about half of the samples are drawn (null: 0.5)."""
    batch = _batch(b=64)
    den = _Scripted(lambda a, t, h, s: h * 0.5, spec=_TI2V())
    dmd = _dmd(guidance_scale=3.0, fake_guidance_scale=2.0)
    gen_step = next(s for s in range(4) if dmd.phase(s) == "gen")
    exit_k = dmd.exit_step(gen_step)
    g = torch.Generator().manual_seed(0)
    cond = dmd.sample_condition(batch, den.spec, g)
    first = cond["first_frame"]
    assert 20 < int(first.sum()) < 44  # 64 draws at 0.5
    from dataclasses import replace

    x0_gen, mask = dmd.rollout(replace(batch, cond=cond), den, exit_k, grad=False, generator=g)
    dmd.generator_loss(replace(batch, cond=cond), den, x0_gen, mask, NEGATIVE, g)
    assert [c["adapter"] for c in den.calls][-4:] == [None, None, "critic", "critic"]
    for c in den.calls:
        assert torch.equal(c["cond"]["first_frame"], first)
        assert torch.equal(c["hidden"][first, :, 0], batch.x0[first, :, 0])
        assert not torch.equal(c["hidden"][~first, :, 0], batch.x0[~first, :, 0])
    assert torch.equal(x0_gen[first, :, 0], batch.x0[first, :, 0])
    none = _dmd(first_frame_cond=0.0).sample_condition(batch, den.spec, g)["first_frame"]
    assert not none.any()


def test_layouts_without_the_optional_first_frame_condition_as_their_spec_does():
    spec = _T2V()
    assert _dmd().sample_condition(_batch(), spec) == {}


# ---- negative_prompt ---------------------------------------------------------------------------------------------
def test_the_negative_prompt_defaults_to_wans_and_is_cached_with_the_captions():
    from wanexp.cli.cache import extra_prompts

    cfg = compose_cfg(["objective=dmd"])
    assert cfg.objective.negative_prompt == WAN_NEGATIVE
    assert WAN_NEGATIVE in extra_prompts(cfg)  # the cache command encodes it: training never loads UMT5 for it
    assert compose_cfg(["objective=dmd", "objective.negative_prompt="]).objective.negative_prompt == ""
