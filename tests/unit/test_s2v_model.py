"""The S2V DiT: its original-layout key map, direct loading of a release folder (tiny, and the real-size key set on
the meta device), one-line errors for a broken folder, batching and activation checkpointing. Parity with a
reference implementation: tests/unit/test_s2v_model_reference.py."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from wanexp.errors import ConfigError
from wanexp.models.s2v import build, original
from wanexp.models.s2v.transformer import WanS2VTransformer
from wanexp.models.wan22.original import INDEX_NAME

RELEASED_KEYS = 1260  # keys in the weight_map of Wan2.2-S2V-14B's diffusion_pytorch_model.safetensors.index.json


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("s2v") / "Wan2.2-S2V-tiny"
    model = build.write_tiny_s2v(folder, seed=0)
    return folder, model


def inputs(model, batch=1, frames=3, size=8, motion=19, seed=1):
    c = model.config
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    return dict(hidden_states=rnd(batch, c.in_dim, frames, size, size), timestep=torch.rand(batch, generator=g) * 1000,
                encoder_hidden_states=rnd(batch, 12, c.text_dim), ref_latents=rnd(batch, c.in_dim, 1, size, size),
                audio_features=rnd(batch, c.audio_layers, c.audio_dim, 4 * frames),
                motion_latents=rnd(batch, c.in_dim, motion, size, size), pose_latents=rnd(batch, c.cond_dim, frames,
                                                                                         size, size))


def public(config) -> dict:
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in config.items() if not k.startswith("_")}


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


# ---- names ------------------------------------------------------------------------------------------------------
def test_real_size_key_set_is_the_releases(monkeypatch):
    """The 14B model built on the meta device maps one to one onto the release's 1260 keys; the base Wan keys are
    named as diffusers' own converter names them; the extras and the audio injectors map as documented."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    with torch.device("meta"):
        model = WanS2VTransformer(**build.real_config())
    names = original.original_key_map(model)
    assert len(names) == len(set(names.values())) == RELEASED_KEYS
    assert all(p.is_meta for p in model.parameters())
    extras = ("audio_injector.", "casual_audio_encoder.", "cond_encoder.", "trainable_cond_mask.", "frame_packer.")
    base = {o: m for m, o in names.items() if not o.startswith(extras)}
    assert convert_wan_transformer_to_diffusers(dict(zip(base, base))) == {m: o for o, m in base.items()}
    assert names["blocks.27.audio_injector.attn.to_out.0.weight"] == "audio_injector.injector.7.o.weight"
    assert names["blocks.39.audio_injector.adain.linear.bias"] == "audio_injector.injector_adain_layers.11.linear.bias"
    assert names["causal_audio_encoder.encoder.conv1_local.conv.weight"] == \
        "casual_audio_encoder.encoder.conv1_local.conv.weight"
    assert sum(k.startswith("audio_injector.injector.") for k in names.values()) == 12 * 10
    # module names too (LoRA export): the audio cross-attention of block 4 is the original's injector 1
    assert original.original_name("blocks.4.audio_injector.attn.to_q", model.config.audio_inject_layers) == \
        "audio_injector.injector.1.q"
    assert original.original_name("blocks.3.ffn.net.0.proj", model.config.audio_inject_layers) == "blocks.3.ffn.0"


def test_block_module_names_are_diffusers_wan_names(tiny):
    """peft's Wan targets (to_q, to_k, to_v, to_out.0, ffn.net.0.proj, ffn.net.2) find every block's Linear layers,
    and the audio cross-attentions of the injected blocks alone."""
    _, model = tiny
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    suffixes = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    hits = {n for n in linears if n.endswith(suffixes)}
    layers = model.config.num_layers
    audio = model.config.audio_inject_layers
    assert len(hits) == layers * 10 + len(audio) * 4
    assert {n.split(".")[1] for n in hits if ".audio_injector." in n} == {str(i) for i in audio}


# ---- loading ----------------------------------------------------------------------------------------------------
def test_tiny_folder_loads_with_every_key_and_computes_the_same(tiny):
    folder, model = tiny
    index = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
    assert len(set(index.values())) == 2
    on_disk = {}
    for shard in sorted(set(index.values())):
        on_disk.update(load_file(folder / shard))
    assert set(on_disk) == set(index)
    loaded = original.load_s2v_transformer(folder)
    assert public(loaded.config) == public(model.config)
    names = original.original_key_map(loaded)
    assert set(names.values()) == set(on_disk)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, on_disk[names[k]]), k
    assert not any(p.is_meta for p in loaded.parameters())
    x = inputs(model)
    with torch.no_grad():
        assert torch.equal(loaded(**x), model(**x))
        loaded16 = original.load_s2v_transformer(folder, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded16.parameters()} == {torch.bfloat16}


def _rewrite_shard(folder, drop=None, add=None):
    index = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
    shard = folder / index[drop or next(iter(index))]
    sd = load_file(shard)
    if drop:
        del sd[drop]
    if add:
        sd[add] = torch.zeros(1)
    save_file(sd, str(shard))


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_a_key_missing_or_unknown_is_one_line(tiny, tmp_path, change):
    folder = tmp_path / "broken"
    shutil.copytree(tiny[0], folder)
    key = "audio_injector.injector_adain_layers.1.linear.weight"
    _rewrite_shard(folder, drop=key if change == "missing" else None,
                   add="audio_injector.injector.9.q.weight" if change == "unexpected" else None)
    with pytest.raises(ConfigError) as e:
        original.load_s2v_transformer(folder)
    msg = one_line(e)
    assert str(folder) in msg
    if change == "missing":
        assert f"missing 1 ['{key}']" in msg and "unexpected 0" in msg
    else:
        assert "missing 0" in msg and "unexpected 1 ['audio_injector.injector.9.q.weight']" in msg


def test_a_folder_that_is_not_s2v_is_one_line(tiny, tmp_path):
    folder = tmp_path / "t2v"
    shutil.copytree(tiny[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "_class_name": "WanModel", "model_type": "t2v"}))
    with pytest.raises(ConfigError) as e:
        original.load_s2v_transformer(folder)
    assert "not a Wan2.2-S2V DiT" in one_line(e)
    with pytest.raises(ConfigError) as e:
        original.load_s2v_transformer(tmp_path / "nowhere")
    assert "folder not found" in one_line(e)
    # without the keys the original builds its defaults: the transformer motioner, not FramePack
    del cfg["enable_framepack"], cfg["enable_motioner"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        original.load_s2v_transformer(folder)
    assert "enable_framepack=False, enable_motioner=True" in one_line(e)


def test_real_size_writer_writes_a_loadable_folder(tmp_path, monkeypatch):
    """write_real_size_s2v's shard-at-a-time path, at the tiny config (the real one writes 32 GB)."""
    monkeypatch.setattr(build, "real_config", lambda: {**build.tiny_config(), "audio_layers": 25})
    config = build.write_real_size_s2v(tmp_path / "real", device="cpu", dtype=torch.bfloat16, shards=3)
    index = json.loads((tmp_path / "real" / INDEX_NAME).read_text())["weight_map"]
    assert len(set(index.values())) == 3
    model = original.load_s2v_transformer(tmp_path / "real")
    assert {k: v for k, v in public(model.config).items() if k in config} == public(config)
    assert len(original.original_key_map(model)) == len(index)


# ---- forward ----------------------------------------------------------------------------------------------------
def test_a_batch_of_two_is_two_single_forwards(tiny):
    _, model = tiny
    x = inputs(model, batch=2)
    with torch.no_grad():
        both = model(**x)
        one = [model(**{k: v[i:i + 1] for k, v in x.items()}) for i in range(2)]
    torch.testing.assert_close(both, torch.cat(one), rtol=1e-5, atol=1e-6)


def test_every_input_changes_the_output(tiny):
    _, model = tiny
    x = inputs(model)
    with torch.no_grad():
        base = model(**x)
        for name in ("timestep", "encoder_hidden_states", "ref_latents", "audio_features", "motion_latents",
                     "pose_latents"):
            changed = model(**{**x, name: x[name] * 0.5})
            assert not torch.allclose(changed, base, atol=1e-4), name
        assert not torch.allclose(model(**{**x, "motion_latents": None}), base, atol=1e-4)


def test_audio_steps_must_match_the_latent_frames(tiny):
    _, model = tiny
    x = inputs(model)
    with pytest.raises(ValueError, match="4 audio steps per latent frame"):
        model(**{**x, "audio_features": x["audio_features"][..., :-4]})


def test_activation_checkpointing_gives_the_same_gradients(tiny):
    _, model = tiny
    x = inputs(model)
    model = build.randomize_(WanS2VTransformer(**dict(model.config)), seed=0)
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        if ckpt:
            model.enable_gradient_checkpointing()
        model(**x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7)
