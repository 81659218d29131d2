"""The optimizer seam: learning-rate scaling with the effective batch, the schedule, fused AdamW where allowed."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from wanexp.optim import build_optimizer, lr_lambda, scaled_lr


def test_lr_scaling_rules():
    assert scaled_lr(1e-4, "none", 64, 4) == 1e-4
    assert scaled_lr(1e-4, "linear", 64, 4) == pytest.approx(16e-4)
    assert scaled_lr(1e-4, "sqrt", 64, 4) == pytest.approx(4e-4)
    assert scaled_lr(2e-4, "linear", 2, 4) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="none, linear, sqrt"):
        scaled_lr(1e-4, "cubic", 1, 1)


def test_lr_schedule_warmup_then_decay():
    cos = lr_lambda("cosine", warmup=10, total=110, min_ratio=0.1)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(10) == pytest.approx(1.0) and cos(60) == pytest.approx(0.55) and cos(110) == pytest.approx(0.1)
    lin = lr_lambda("linear", warmup=0, total=100, min_ratio=0.0)
    assert lin(50) == pytest.approx(0.5) and lr_lambda("constant", 0, 100, 0)(99) == 1.0
    with pytest.raises(ValueError, match="constant, cosine, linear"):
        lr_lambda("step", 0, 1, 0)
    assert math.isfinite(cos(1000))


def test_optimizer_factory_gets_lr_and_fused_only_on_gpu():
    p = torch.nn.Parameter(torch.zeros(3))
    factory = functools.partial(torch.optim.AdamW, betas=[0.9, 0.99], weight_decay=0.01, fused=None)
    opt = build_optimizer(factory, [p], lr=3e-4)
    group = opt.param_groups[0]
    assert group["lr"] == 3e-4 and tuple(group["betas"]) == (0.9, 0.99) and group["weight_decay"] == 0.01
    assert not group["fused"]  # CPU parameters: the default kernel
    explicit = build_optimizer(functools.partial(torch.optim.AdamW, fused=False), [p], lr=1e-3)
    assert explicit.param_groups[0]["fused"] is False
    sgd = build_optimizer(functools.partial(torch.optim.SGD, momentum=0.9), [p], lr=1e-2)  # any torch optimizer
    assert sgd.param_groups[0]["lr"] == 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_on_gpu():
    p = torch.nn.Parameter(torch.zeros(3, device="cuda"))
    assert build_optimizer(functools.partial(torch.optim.AdamW, fused=None), [p], lr=1e-3).param_groups[0]["fused"]


# ---- the optimizers by name (conf/optim/*.yaml): built from their group, state saved and loaded exactly ----------
PACKAGES = {"adamw": None, "adamw8bit": "bitsandbytes", "prodigy": "prodigyopt", "came": "came_pytorch",
            "adafactor": "transformers"}


def _group(name: str, *extra: str):
    from tests.conftest import compose_cfg

    return compose_cfg([f"optim={name}", "model.path=/m", *extra]).optim


def _built(name: str, params, *extra: str):
    from wanexp.composition import build

    o = _group(name, *extra)
    return build_optimizer(build(o.optimizer), params, float(o.lr))


def _steps(opt, params, grads) -> None:
    for g in grads:
        for p, gp in zip(params, g):
            p.grad = gp.clone()
        opt.step()


@pytest.mark.parametrize("name", list(PACKAGES))
def test_each_optimizer_resumes_from_its_saved_state_bit_for_bit(name, tmp_path):
    """Three steps, the optimizer's state through a checkpoint file (torch.save, loaded weights_only as a resume
    loads it) into a fresh optimizer over copies of the weights; the next two steps of both are identical. Matrices
    (the factored moments of CAME and Adafactor) and a vector; bitsandbytes keeps its moments in 8 bits (min_8bit_size
    below the tensors' sizes)."""
    if PACKAGES[name]:
        pytest.importorskip(PACKAGES[name])
    torch.manual_seed(0)
    extra = ("optim.optimizer.min_8bit_size=16",) if name == "adamw8bit" else ()
    params = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(64))]
    grads = [[torch.randn_like(p) for p in params] for _ in range(5)]
    opt = _built(name, params, *extra)
    start = [p.detach().clone() for p in params]
    _steps(opt, params, grads[:3])
    assert all(not torch.equal(p, s) for p, s in zip(params, start)), f"{name} did not move the weights"
    if name == "adamw8bit":
        assert opt.state[params[0]]["state1"].dtype == torch.uint8  # 8-bit moments, on the CPU
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = _built(name, copies, *extra)
    resumed.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    _steps(opt, params, grads[3:])
    _steps(resumed, copies, grads[3:])
    assert all(torch.equal(a, b) for a, b in zip(params, copies)), f"{name}: the resumed steps differ"


def test_each_optimizer_group_names_its_rate_rule_and_pin():
    """Every conf/optim file states its learning-rate scaling rule; the ones from other packages name the pip pin
    that the missing-package refusal names."""
    from wanexp.config import CONF_DIR
    from wanexp.config.schema import SCHEMAS

    files = sorted(p.stem for p in (CONF_DIR / "optim").glob("*.yaml"))
    assert files == sorted(PACKAGES)
    for name in files:
        text = (CONF_DIR / "optim" / f"{name}.yaml").read_text()
        assert "lr scaling:" in text, name
        schema = SCHEMAS[f"optimizer/{name}"]
        assert schema.option == name
        if schema.package is not None:
            assert f"pip install {schema.package[1]}" in text, name


def _refusal(*overrides: str) -> str:
    from tests.conftest import compose_cfg
    from wanexp.config import check_config
    from wanexp.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(["experiment=demo", *overrides]))
    return str(e.value)


@pytest.mark.parametrize("overrides, needle", [
    (["optim=prodigy", "optim.lr_scaling=sqrt"], "optim=prodigy with optim.lr_scaling=sqrt: optim.lr multiplies the "
                                                 "optimizer's own step-size estimate"),
    (["optim=came", "parallel=fsdp", "trainer.devices=2"], "optim=came with parallel=fsdp: its factored moments need "
                                                           "each weight's whole rows and columns; use parallel=ddp"),
    (["optim=adamw8bit", "parallel=fsdp", "trainer.devices=2"], "optim=adamw8bit with parallel=fsdp: bitsandbytes'"),
    (["optim=prodigy", "parallel=fsdp", "trainer.devices=2"], "optim=prodigy with parallel=fsdp"),
    (["optim=adafactor", "optim.optimizer.relative_step=true"], "optim.optimizer.relative_step=true with "
                                                                "optim=adafactor: Adafactor's own time-dependent rate"),
    (["optim=came", "objective=dmd"], "optim=came with objective=dmd: each of its adapters sets Adam's betas"),
    (["optim=adafactor", "objective=dmd"], "optim=adafactor with objective=dmd"),
    (["optim=prodigy", "objective=dmd"], "optim=prodigy with objective=dmd: each of its adapters sets its own "
                                         "learning rate"),
], ids=["prodigy_scaling", "came_fsdp", "8bit_fsdp", "prodigy_fsdp", "relative_step", "came_dmd", "adafactor_dmd",
        "prodigy_dmd"])
def test_an_optimizer_where_it_cannot_run_is_one_line(overrides, needle):
    for name, module in PACKAGES.items():
        if f"optim={name}" in overrides and module:
            pytest.importorskip(module)
    assert needle in _refusal(*overrides)


@pytest.mark.parametrize("name", ["adamw8bit", "prodigy", "came"])
def test_a_missing_optimizer_package_names_its_pin(name, monkeypatch):
    import importlib.util

    from wanexp.config.schema import SCHEMAS

    module, pin = SCHEMAS[f"optimizer/{name}"].package
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == module else real(n, *a))
    assert _refusal(f"optim={name}") == (f"optim={name}: the {module} package is not installed; pip install {pin} "
                                         "(or pip install 'wanexp[optim]'), or use optim=adamw")


def test_eight_bit_adamw_on_the_cpu_needs_a_build_with_cpu_kernels(monkeypatch):
    """bitsandbytes 0.50 brought CPU kernels for its optimizers (test_each_optimizer_resumes_from_its_saved_state_bit_
    for_bit runs its 8-bit AdamW on the CPU); an earlier installed version is refused on the CPU in one line naming
    the pin, and is fine on a GPU."""
    pytest.importorskip("bitsandbytes")
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.49.1" if d == "bitsandbytes" else real(d))
    assert _refusal("optim=adamw8bit") == (
        "optim=adamw8bit with trainer.accelerator=cpu: bitsandbytes 0.49.1 has no CPU kernels for its optimizers "
        "(they came with 0.50.0); pip install bitsandbytes==0.50.2, train on a GPU, or use optim=adamw")
    from tests.conftest import compose_cfg
    from wanexp.config.rules import check_optim

    check_optim(compose_cfg(["experiment=demo", "optim=adamw8bit", "trainer.accelerator=gpu"]))
