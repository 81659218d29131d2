"""The EMA of the trained adapter (wanexp/callbacks/ema.py) on a small module: its update rule (decay, warm-up,
cadence), the shadow covering exactly the trainable parameters, the swap for validation restoring the weights bit for
bit, its state continuing exactly after a save and load, and the runs it refuses."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from wanexp.callbacks.ema import AdapterEMA
from wanexp.errors import ConfigError


def _module() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    m[0].weight.requires_grad_(False)  # a frozen base weight: not in the shadow
    return m


def _step(m: nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))


def test_the_shadow_follows_decay_warmup_and_cadence():
    m = _module()
    ema = AdapterEMA(decay=0.15, every_n_steps=2, warmup=True)
    shadow = ema.shadow(m)
    assert list(shadow) == [n for n, p in m.named_parameters() if p.requires_grad]  # the trainable ones only
    expected = {n: t.clone() for n, t in shadow.items()}
    trained = dict(m.named_parameters())
    for step, d in [(1, None), (2, 0.1), (3, None), (4, 0.15), (5, None), (6, 0.15)]:  # min(0.15, 1/10, 2/11, ..)
        _step(m)
        ema.update()
        if d is not None:
            for n in expected:
                expected[n] = d * expected[n] + (1 - d) * trained[n].detach()
        for n, t in ema.shadow(m).items():
            torch.testing.assert_close(t, expected[n], rtol=1e-6, atol=1e-7)
            assert t.dtype == torch.float32
    assert (ema.steps, ema.updates) == (6, 3)
    plain = AdapterEMA(decay=0.5, warmup=False)
    plain.shadow(m)
    assert plain.current_decay() == 0.5


def test_validation_swaps_the_ema_in_and_restores_the_weights_exactly():
    m = _module()
    ema = AdapterEMA(decay=0.9, validate_with="both")
    ema.shadow(m)
    for _ in range(3):
        _step(m)
        ema.update()
    raw = {n: p.detach().clone() for n, p in m.named_parameters()}
    sets = ema.validation_weights(m)
    assert [tag for tag, _ in sets] == ["", "ema"]
    with sets[1][1]:
        for n, p in m.named_parameters():
            want = ema.shadow(m)[n] if p.requires_grad else raw[n]
            assert torch.equal(p, want), n
    assert all(torch.equal(p, raw[n]) for n, p in m.named_parameters())
    assert [t for t, _ in AdapterEMA(decay=0.9, validate_with="ema").validation_weights(m)] == ["ema"]
    assert [t for t, _ in AdapterEMA(decay=0.9, validate_with="raw").validation_weights(m)] == [""]
    assert [t for t, _ in AdapterEMA(decay=None).validation_weights(m)] == [""]  # off: the raw weights


def test_a_saved_and_loaded_ema_continues_exactly(tmp_path):
    m = _module()
    ema = AdapterEMA(decay=0.8, every_n_steps=3)
    ema.shadow(m)
    for _ in range(4):
        _step(m)
        ema.update()
    torch.save(ema.state_dict(), tmp_path / "ema.pt")
    resumed = AdapterEMA(decay=0.8, every_n_steps=3)
    resumed.load_state_dict(torch.load(tmp_path / "ema.pt", weights_only=True))
    resumed.shadow(m)  # applied once the parameters exist
    for _ in range(5):
        _step(m)
        ema.update()
        resumed.update()
    assert (resumed.steps, resumed.updates) == (ema.steps, ema.updates) == (9, 3)
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow(m).values(), resumed.shadow(m).values()))


def test_an_ema_that_is_off_does_nothing_and_bad_values_are_one_line():
    off = AdapterEMA(decay=None)
    assert not off.enabled and off.state_dict() == {} and off.exported({"callbacks": {}}) is None
    with pytest.raises(ConfigError, match=r"callbacks.ema.decay=1.0: must be >= 0 and < 1"):
        AdapterEMA(decay=1.0)
    with pytest.raises(ConfigError, match=r"callbacks.ema.validate_with=best: allowed values are raw, ema, both"):
        AdapterEMA(decay=0.9, validate_with="best")


@pytest.mark.parametrize("overrides, needle", [
    (["parallel=deepspeed", "trainer.accelerator=gpu"], "callbacks.ema.decay with parallel=deepspeed: DeepSpeed keeps "
                                                        "the trained weights inside its engine's partitions"),
    (["objective=kd"], "callbacks.ema.decay with objective=kd: the objective trains and exports a whole model"),
    (["callbacks.ema.validate_with=best"], "callbacks.ema.validate_with=best: allowed values are raw, ema, both"),
    (["callbacks.ema.decay=1.5"], "callbacks.ema.decay=1.5: must be >= 0.0 and < 1.0"),
], ids=["deepspeed", "kd", "validate_with", "decay"])
def test_runs_the_ema_cannot_follow_are_refused_in_one_line(overrides, needle):
    from tests.conftest import compose_cfg
    from wanexp.config import check_config
    from wanexp.config.rules import check_ema

    cfg = compose_cfg(["experiment=demo", "callbacks.ema.decay=0.999", *overrides])
    with pytest.raises(ConfigError) as e:
        check_ema(cfg) if "parallel=deepspeed" in overrides else check_config(cfg)
    assert needle in str(e.value)
