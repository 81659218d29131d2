"""Flow-matching maths, sigma sampling per boundary, and the model inputs of each layout."""
from __future__ import annotations

import pytest
import torch

from wanexp.models.wan22 import conditioning
from wanexp.objectives.flow_matching import add_noise, masked_mse, velocity_target
from wanexp.objectives.timesteps import sample_sigmas, shift_sigma, unshift_sigma


def test_shift_matches_formula_and_inverts():
    s = torch.linspace(0, 1, 101, dtype=torch.float64)
    for shift in (1.0, 3.0, 5.0, 12.0):
        shifted = shift_sigma(s, shift)
        assert torch.allclose(shifted, shift * s / (1 + (shift - 1) * s))
        assert torch.allclose(unshift_sigma(shifted, shift), s, atol=1e-12)
    assert shift_sigma(0.5, 5.0) == pytest.approx(5 * 0.5 / (1 + 4 * 0.5))


@pytest.mark.parametrize("scheme", ["uniform", "logit_normal", "mode"])
@pytest.mark.parametrize("lo,hi", [(0.875, 1.0), (0.0, 0.875), (0.0, 1.0)])
def test_samples_stay_in_the_boundary_range(scheme, lo, hi):
    g = torch.Generator().manual_seed(0)
    s = sample_sigmas(4000, lo=lo, hi=hi, shift=12.0, scheme=scheme, generator=g)
    assert s.min() >= lo - 1e-6 and s.max() <= hi + 1e-6
    assert s.max() - s.min() > 0.5 * (hi - lo)  # spread over the range, not collapsed


def test_uniform_sampling_is_uniform_before_the_shift():
    g = torch.Generator().manual_seed(0)
    s = sample_sigmas(20000, lo=0.0, hi=1.0, shift=5.0, scheme="uniform", generator=g).double()
    u = unshift_sigma(s, 5.0)
    assert abs(u.mean().item() - 0.5) < 0.01
    # the shift pushes mass to high noise: median of shifted sigma = shift(0.5) = 5/6
    assert abs(s.median().item() - 5 / 6) < 0.01


def test_logit_normal_matches_its_distribution_and_truncates_exactly():
    g = torch.Generator().manual_seed(1)
    s = sample_sigmas(20000, lo=0.0, hi=1.0, shift=1.0, scheme="logit_normal", logit_mean=0.5, logit_std=1.0,
                      generator=g).double()
    z = torch.logit(s.clamp(1e-6, 1 - 1e-6))
    assert abs(z.mean().item() - 0.5) < 0.03 and abs(z.std().item() - 1.0) < 0.03
    # truncated to the high range: the fraction that fell there untruncated is tiny, yet all samples land there
    s_hi = sample_sigmas(1000, lo=0.9, hi=1.0, shift=1.0, scheme="logit_normal", generator=g)
    assert (s_hi >= 0.9).all()


def _ks(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    grid = torch.cat([a, b]).double().sort().values
    cdf = [torch.searchsorted(x.double().sort().values, grid, right=True) / len(x) for x in (a, b)]
    return float((cdf[0] - cdf[1]).abs().max())


def test_mode_is_diffusers_mode_density():
    """The reference: diffusers' training_utils.compute_density_for_timestep_sampling("mode", mode_scale=s) (SD3's
    f_mode, musubi-tuner's too): the same map of the same uniform draws, and sample_sigmas draws its distribution
    (before the shift; the shift then applies as to any scheme)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling as density

    from wanexp.objectives.timesteps import mode_sigma

    for scale in (1.29, 0.0, -0.5, 1.75):
        want = density("mode", 1000, mode_scale=scale, generator=torch.Generator().manual_seed(3))
        u = torch.rand(1000, generator=torch.Generator().manual_seed(3))
        assert torch.allclose(mode_sigma(u, scale), want, atol=1e-6)
    ref = density("mode", 20000, mode_scale=1.29, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(5)
    for shift in (1.0, 5.0):
        s = sample_sigmas(20000, lo=0.0, hi=1.0, shift=shift, scheme="mode", mode_scale=1.29, generator=g)
        assert _ks(unshift_sigma(s.double(), shift), ref) < 0.02  # the 0.1 % critical value is 0.0195
    uniform = sample_sigmas(20000, lo=0.0, hi=1.0, shift=1.0, scheme="uniform", generator=g)
    assert _ks(ref, uniform) > 0.05  # the check tells the mode density from the uniform one


def test_mode_truncated_to_a_boundary_is_the_conditional_distribution():
    """Inside an expert's range (shifted sigma in [0.875, 1] at shift 12, the A14B high-noise expert): exactly the
    mode draws that land there, as diffusers' draws kept where they land in it."""
    from diffusers.training_utils import compute_density_for_timestep_sampling as density

    ref = shift_sigma(density("mode", 400000, mode_scale=1.29, generator=torch.Generator().manual_seed(6)), 12.0)
    for lo, hi in ((0.875, 1.0), (0.0, 0.875)):
        kept = ref[(ref >= lo) & (ref <= hi)]
        s = sample_sigmas(20000, lo=lo, hi=hi, shift=12.0, scheme="mode", mode_scale=1.29,
                          generator=torch.Generator().manual_seed(7))
        assert len(kept) > 20000 and _ks(s, kept) < 0.02


def test_mode_sampling_is_wired_from_the_config():
    from tests.conftest import compose_cfg
    from wanexp.composition import build

    cfg = compose_cfg(["experiment=demo", "objective.timestep.sampling=mode", "objective.timestep.mode_scale=0.5"])
    fm = build(cfg.objective)
    assert (fm.sampling, fm.mode_scale) == ("mode", 0.5)
    assert compose_cfg(["experiment=demo"]).objective.timestep.mode_scale == 1.29  # diffusers' and musubi's default


def test_bad_scheme_and_range_raise():
    with pytest.raises(ValueError, match="uniform, logit_normal"):
        sample_sigmas(2, lo=0, hi=1, shift=1, scheme="beta")
    with pytest.raises(ValueError, match="0 <= lo < hi <= 1"):
        sample_sigmas(2, lo=0.9, hi=0.5, shift=1)


def test_noise_interpolation_and_velocity():
    x0, eps = torch.randn(3, 4, 2, 2, 2), torch.randn(3, 4, 2, 2, 2)
    sigma = torch.tensor([0.0, 0.5, 1.0])
    x_t = add_noise(x0, eps, sigma)
    assert torch.equal(x_t[0], x0[0]) and torch.equal(x_t[2], eps[2])
    assert torch.allclose(x_t[1], 0.5 * x0[1] + 0.5 * eps[1])
    assert torch.equal(velocity_target(x0, eps), eps - x0)
    # the velocity moves x_t along the path: x_t + (s' - s) * v = x_{s'}
    assert torch.allclose(x_t[1] + 0.5 * velocity_target(x0, eps)[1], eps[1], atol=1e-6)


def test_masked_mse_ignores_masked_elements():
    pred, target = torch.zeros(2, 1, 3, 1, 1), torch.zeros(2, 1, 3, 1, 1)
    target[:, :, 0] = 10.0  # a huge error only on frame 0
    target[:, :, 1:] = 1.0
    mask = torch.ones(2, 1, 3, 1, 1, dtype=torch.bool)
    mask[0, :, 0] = False
    loss = masked_mse(pred, target, mask)
    assert loss[0].item() == pytest.approx(1.0) and loss[1].item() == pytest.approx((100 + 1 + 1) / 3)
    assert masked_mse(pred, target).shape == (2,)


def test_ti2v_inputs_condition_frame_zero_with_timestep_zero():
    b, c, f, h, w = 2, 48, 3, 4, 6
    x0, x_t = torch.randn(b, c, f, h, w), torch.randn(b, c, f, h, w)
    sigma = torch.tensor([0.4, 0.8])
    hidden, timestep, mask = conditioning.ti2v_inputs(x_t, x0, sigma, torch.tensor([True, False]), (1, 2, 2))
    tokens_per_frame = (h // 2) * (w // 2)
    assert timestep.shape == (b, f * tokens_per_frame)
    assert torch.all(timestep[0, :tokens_per_frame] == 0) and torch.allclose(timestep[0, tokens_per_frame:], torch.tensor(400.0))
    assert torch.allclose(timestep[1], torch.tensor(800.0))
    assert torch.equal(hidden[0, :, 0], x0[0, :, 0]) and torch.equal(hidden[0, :, 1:], x_t[0, :, 1:])
    assert torch.equal(hidden[1], x_t[1])
    assert not mask[0, 0, 0].any() and mask[0, 0, 1:].all() and mask[1].all()


def test_i2v_inputs_have_36_channels_and_mask_on_frame_zero():
    b, f, h, w = 2, 3, 4, 4
    x_t, img = torch.randn(b, 16, f, h, w), torch.randn(b, 16, f, h, w)
    hidden, timestep, mask = conditioning.i2v_inputs(x_t, torch.tensor([0.95, 0.2]), img)
    assert hidden.shape == (b, 36, f, h, w) and mask is None
    assert torch.equal(hidden[:, :16], x_t) and torch.equal(hidden[:, 20:], img)
    m = hidden[:, 16:20]
    assert torch.all(m[:, :, 0] == 1) and torch.all(m[:, :, 1:] == 0)
    assert torch.allclose(timestep, torch.tensor([950.0, 200.0]))


def test_one_expert_per_step_keeps_each_samples_noise_distribution():
    """Sharded experts train one expert per step (WanSpec.expert_for_step); a sample's noise level must
    still follow the objective's distribution over the whole range: the step's expert is high as often as a free
    draw lands above the boundary, and the draws inside each expert's range follow the truncated distribution."""
    from types import SimpleNamespace

    from wanexp.models.wan22.spec import WanSpec
    from wanexp.objectives.flow_matching import FlowMatching

    def expert_for_step(sampler, sigma_range, boundary, seed, step):
        return WanSpec.expert_for_step(SimpleNamespace(boundary_ratio=boundary), sampler, sigma_range, seed, step)

    fm = FlowMatching(name="fm", timestep={"sampling": "logit_normal", "shift": 12.0, "logit_mean": 0.0,
                                           "logit_std": 1.0})
    boundary, n = 0.875, 4000
    free = fm.sample_sigmas(20000, 0.0, 1.0, generator=torch.Generator().manual_seed(1))
    picks = [expert_for_step(fm, (0.0, 1.0), boundary, seed=3, step=s) for s in range(n)]
    p_high, got = float((free >= boundary).double().mean()), sum(e == "high" for e, _ in picks) / n
    assert abs(got - p_high) < 4 * (p_high * (1 - p_high) / n) ** 0.5
    assert expert_for_step(fm, (0.0, 1.0), boundary, 3, 17) == picks[17]  # the same on every rank, and after a resume
    g = torch.Generator().manual_seed(2)
    mixed = torch.cat([fm.sample_sigmas(1, *rng, generator=g) for _, rng in picks])
    qs = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64)
    assert torch.allclose(mixed.double().quantile(qs), free.double().quantile(qs), atol=0.03)
