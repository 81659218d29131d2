"""adapter=lokr, adapter=loha and DoRA train the tiny model through train.run: the export callback writes each kind's
files under its name, the final ComfyUI file reproduces the trained weights, and a resumed run is bit-identical."""
from __future__ import annotations

import pytest
import torch

from tests.integration.conftest import tiny_run
from tests.unit.test_adapter_types import TOL, _assert_same_weights, _effective
from tests import wan_adapters as lora

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


@pytest.mark.parametrize("kind", list(KIND))
def test_wanexp_sample_runs_each_kinds_run_with_its_adapter(kind, shared_dir, tmp_path_factory, tmp_path):
    """``python -m wanexp.cli.sample --run`` on a LoKr, LoHa or DoRA run loads its final file (the route
    docs/adapters.md names), runs every step with the adapter on, and samples the video of the model with the adapter
    baked in (``wanexp-merge bake``: ComfyUI's arithmetic), not the base model's."""
    from omegaconf import OmegaConf

    from wanexp.cli import merge, sample

    out, _ = _run(kind, shared_dir, tmp_path_factory)
    cfg = OmegaConf.load(out / "config.yaml")
    baked = merge.main(["bake", "--model", cfg.model.path, "--lora", str(out / "lora" / "final" / FILES[kind][0]),
                        "--out", str(tmp_path / "baked_model")])

    def sampled(run) -> dict:
        (entry,) = sample.main(["--run", str(run), "--prompt", "a ball", "--seed", "1", "--steps", "2", "--guidance",
                                "1", "--device", "cpu", "--out", str(tmp_path / "samples" / run.name)])["samples"]
        return entry

    def bare_run(name, model_path):  # the run's settings, another model folder, no adapter files
        folder = tmp_path / name
        folder.mkdir()
        OmegaConf.save(OmegaConf.merge(cfg, {"model": {"path": str(model_path)}}), folder / "config.yaml")
        return folder

    adapted = sampled(out)
    assert adapted["experts"] == [["dense", True]] * 2
    with_baked = sampled(bare_run("baked", baked))["latents"]
    base = sampled(bare_run("base", cfg.model.path))["latents"]
    gap, moved = (adapted["latents"] - with_baked).abs().max(), (base - with_baked).abs().max()
    assert gap <= TOL and moved > 100 * TOL, (gap, moved)
