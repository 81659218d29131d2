"""adapter=lokr, adapter=loha and DoRA train the tiny model through train.run: the export callback writes each kind's
files under its name, the final ComfyUI file reproduces the trained weights, and a resumed run is bit-identical."""
from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import tiny_run
from tests.unit.test_adapter_types import _assert_same_weights, _effective
from wanexp import lora

KIND = {"lokr": ["adapter=lokr"], "loha": ["adapter=loha"], "dora": ["adapter=lora", "adapter.use_dora=true"]}
FILES = {"lokr": ["tiny_lokr_comfyui.safetensors", "tiny_lokr_diffusers.safetensors"],
         "loha": ["tiny_loha_comfyui.safetensors"],
         "dora": ["tiny_lora_comfyui.safetensors", "tiny_lora_diffusers.safetensors"]}
EXACT = ["model=tiny", "optim.scheduler=constant", "callbacks.checkpoint.every_n_train_steps=1"]


def _trainable(result) -> dict:
    return {n: p.detach().clone() for n, p in result["module"].named_parameters() if p.requires_grad}


_RUNS: dict = {}


def _run(kind, shared_dir, tmp_path_factory):
    """Two steps of each kind (a constant lr, a checkpoint and an export per step), once per session."""
    if kind not in _RUNS:
        out = tmp_path_factory.mktemp(kind) / "run"
        _RUNS[kind] = (out, tiny_run(shared_dir, out, [*EXACT, *KIND[kind], "trainer.max_steps=2"]))
    return _RUNS[kind]


@pytest.mark.parametrize("kind", list(KIND))
def test_each_kind_trains_and_exports_its_files(kind, shared_dir, tmp_path_factory):
    out, r = _run(kind, shared_dir, tmp_path_factory)
    final = out / "lora" / "final"
    assert sorted(p.name for p in final.iterdir()) == FILES[kind]
    t = r["module"].transformers["dense"]
    names = list(_trainable(r))
    assert names and all(lora.is_adapter_key(n) for n in names)
    want = _effective(t)
    base = {k.replace(".base_layer", ""): v for k, v in t.state_dict().items() if not lora.is_adapter_key(k)}
    assert max((want[k].float() - base[k].float()).abs().max() for k in base) > 0, "training moved nothing"
    f = lora.read_any_adapter(final / FILES[kind][0], "final")
    got = dict(base)
    for module, params in f.modules.items():
        got[f"{module}.weight"] = lora.patched_weight(base[f"{module}.weight"], params).to(base[f"{module}.weight"])
    _assert_same_weights(got, want)


def test_resume_is_bit_identical_for_a_loha(shared_dir, tmp_path, tmp_path_factory):
    """Stopped after step 1 and resumed to step 2: the LoHa of the uninterrupted two steps, bit for bit."""
    full = _trainable(_run("loha", shared_dir, tmp_path_factory)[1])
    tiny_run(shared_dir, tmp_path / "cut", [*EXACT, *KIND["loha"], "trainer.max_steps=1"])
    cut = _trainable(tiny_run(shared_dir, tmp_path / "cut", [*EXACT, *KIND["loha"], "trainer.max_steps=2",
                                                           "resume=last"]))
    assert full.keys() == cut.keys() and all(torch.equal(full[k], cut[k]) for k in full)


def test_sampling_a_loha_run_says_to_bake_it(shared_dir, tmp_path_factory, capsys):
    """wanexp-sample --run finds no diffusers file in a LoHa run: one line naming wanexp-merge, not the bare base."""
    from wanexp.cli import sample

    out, _ = _run("loha", shared_dir, tmp_path_factory)
    capsys.readouterr()  # the training run's own output
    with pytest.raises(SystemExit) as e:
        sample.main(["--run", str(out), "--prompt", "x", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and "ComfyUI-only" in err and "wanexp-merge bake" in err, err
