"""wanexp-merge: a baked model folder equals the adapter-applied model; a combined LoRA equals applying both.

Tolerance: fp32 weights within 1e-5 absolute (weights of magnitude ~0.3; the merge is one fp32 add per weight).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.unit.test_adapter_types import TOL, _assert_same_weights, _base, _out, _randomize, trained
from tests import wan_adapters as lora
from wanexp.cli import merge


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A diffusers model folder of the tiny base: model_index.json, transformer/, and a stand-in vae/."""
    root = tmp_path_factory.mktemp("model") / "base"
    _base().save_pretrained(root / "transformer")
    (root / "vae").mkdir()
    (root / "vae" / "config.json").write_text("{}")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    return root


def _merged_weights(out):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(out / "transformer", torch_dtype=torch.float32).state_dict()


@pytest.mark.parametrize("kind,strength", [("lora", 0.7), ("dora", 1.0), ("lokr_lowrank", 1.0), ("loha", 0.5)])
def test_bake_equals_the_adapter_applied_model(kind, strength, model_dir, tmp_path, tmp_path_factory):
    _, want, files = trained(kind, tmp_path_factory)
    out = merge.main(["bake", "--model", str(model_dir), "--lora", str(files[0]), "--strength", str(strength),
                      "--out", str(tmp_path / "merged")])
    got = _merged_weights(out)
    if strength == 1.0:  # the trained adapter itself, as peft merges it
        _assert_same_weights(got, want)
    else:  # at a strength: the base plus strength x the adapter's difference
        base = _base().state_dict()
        _assert_same_weights(got, {k: base[k] + strength * (want[k] - base[k]) for k in base})
    assert (out / "vae").is_symlink() and (out / "vae").resolve() == (model_dir / "vae").resolve()
    assert (out / "model_index.json").is_symlink() and not (out / "transformer").is_symlink()


def test_baked_model_gives_the_trained_output(model_dir, tmp_path, tmp_path_factory):
    from diffusers import WanTransformer3DModel

    t, _, files = trained("lora", tmp_path_factory)
    out = merge.main(["bake", "--model", str(model_dir), "--lora", str(files[1]), "--out", str(tmp_path / "m")])
    merged = WanTransformer3DModel.from_pretrained(out / "transformer", torch_dtype=torch.float32)
    assert (_out(merged) - _out(t)).abs().max() <= TOL


@pytest.mark.parametrize("rank", [4, 2])
def test_combine_concatenates_ranks_exactly(rank, tmp_path, tmp_path_factory):
    """A LoRA of rank 4 (alpha 2) and one of ``rank`` (alpha 3) with weights 1 and 0.5 make one LoRA of rank
    4 + ``rank`` whose weight difference is the sum of theirs at those weights."""
    first = trained("lora", tmp_path_factory)[2][0]
    t = _base()
    ad = lora.LoraAdapter(name="lora", rank=rank, alpha=3.0, dropout=0.0,
                          targets=["q", "k", "v", "o", "ffn.0", "ffn.2"], attention=["self", "cross"], init_from=None)
    ad.apply(t)
    _randomize(t, seed=7)
    second = ad.export(t.state_dict(), "", t, tmp_path / "second", "b")[1]  # the diffusers file: formats may differ
    out = merge.main(["combine", "--lora", str(first), "--lora", str(second), "--weight", "1", "--weight", "0.5",
                      "--out", str(tmp_path / "ab.safetensors")])
    sd = load_file(out)
    assert sd["diffusion_model.blocks.0.self_attn.q.lora_down.weight"].shape == (4 + rank, 16)
    a, b = lora.read_any_adapter(first, "a"), lora.read_any_adapter(second, "b")
    combined = lora.read_any_adapter(out, "ab")
    base = _base().state_dict()

    def delta(params):
        diff, scale = lora.comfy_diff(params)
        return scale * diff

    for module in a.modules:
        want = delta(a.modules[module]) + 0.5 * delta(b.modules[module])
        assert (delta(combined.modules[module]) - want).abs().max() <= TOL
        w = base[f"{module}.weight"]
        both = lora.patched_weight(lora.patched_weight(w, a.modules[module], 1.0), b.modules[module], 0.5)
        assert (lora.patched_weight(w, combined.modules[module]) - both).abs().max() <= TOL


def _refused(capsys, argv, created):
    with pytest.raises(SystemExit) as e:
        merge.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("wanexp: error: ") and "\n" not in err, err
    assert not created.exists() and not list(created.parent.glob(f".{created.name}*")), "a refused merge wrote"
    return err


def test_bad_input_is_one_line_and_writes_nothing(model_dir, tmp_path, tmp_path_factory, capsys):
    lora_file = trained("lora", tmp_path_factory)[2][0]
    out = tmp_path / "merged"
    assert "file not found" in _refused(capsys, ["bake", "--model", str(model_dir), "--lora",
                                                 str(tmp_path / "none.safetensors"), "--out", str(out)], out)
    assert "not a diffusers model folder" in _refused(capsys, ["bake", "--model", str(tmp_path), "--lora",
                                                               str(lora_file), "--out", str(out)], out)
    # an adapter of another model: a 3-block LoRA onto the 2-block base
    from diffusers import WanTransformer3DModel

    from tests.unit.test_adapter_types import TINY

    big = WanTransformer3DModel(**dict(TINY, num_layers=3, ffn_dim=48))
    ad = lora.LoraAdapter(name="lora", rank=4, alpha=2.0, dropout=0.0, targets=["ffn.0"], attention=[],
                          init_from=None)
    ad.apply(big)
    other = ad.export(big.state_dict(), "", big, tmp_path / "other", "o")[0]
    assert "an adapter of another model" in _refused(
        capsys, ["bake", "--model", str(model_dir), "--lora", str(other), "--out", str(out)], out)
    # a non-empty output folder: left as it was
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    with pytest.raises(SystemExit):
        merge.main(["bake", "--model", str(model_dir), "--lora", str(lora_file), "--out", str(full)])
    assert "already exists" in capsys.readouterr().err and [p.name for p in full.iterdir()] == ["keep.txt"]
    # combine: a LoKr, LoRAs of other modules, a missing weight count
    lokr = trained("lokr_lowrank", tmp_path_factory)[2][0]
    ab = tmp_path / "ab.safetensors"
    assert "combining is exact for LoRA files only" in _refused(
        capsys, ["combine", "--lora", str(lora_file), "--lora", str(lokr), "--out", str(ab)], ab)
    assert "its layout differs" in _refused(
        capsys, ["combine", "--lora", str(lora_file), "--lora", str(other), "--out", str(ab)], ab)
    assert "give one per file" in _refused(
        capsys, ["combine", "--lora", str(lora_file), "--lora", str(lora_file), "--weight", "1", "--out", str(ab)], ab)
