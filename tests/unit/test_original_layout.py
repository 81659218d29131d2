"""Converting the ORIGINAL Wan-AI release layout into a diffusers-format folder (models/wan22/original.py, cli/convert).

Tiny random diffusers models are written in the original layout by the helpers below, converted, and loaded back
through ``WanSpec.load_*``. The helpers' diffusers -> original names (the DiT's and the VAE's in tests/single_files.py)
are written independently of the code under test (from wan/modules/{model,t5,vae2_1,vae2_2}.py of the Wan2.2 repo),
so a round trip checks the converter against them; where diffusers ships the original -> diffusers converter (DiT,
Wan2.1 VAE), these helpers are checked against diffusers' own code, and the text-encoder mapping is checked
numerically against a re-implementation of the original T5 encoder forward.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.conftest import ROOT, compose_cfg
from tests.single_files import dit_to_original, vae_to_original
from wanexp.errors import ConfigError
from wanexp.models.wan22 import original
from wanexp.models.wan22.build import build_components, build_tokenizer
from wanexp.composition import build

T5_FILE = "models_t5_umt5-xxl-enc-bf16.pth"


# ---- diffusers -> original names (the inverse mapping, written from the original Wan2.2 modules) ---------------------
def t5_to_original(sd: dict) -> dict:
    """transformers UMT5EncoderModel -> original Wan T5Encoder (wan/modules/t5.py) names."""
    leaf = {"layer.0.layer_norm.weight": "norm1.weight",
            "layer.0.SelfAttention.q.weight": "attn.q.weight", "layer.0.SelfAttention.k.weight": "attn.k.weight",
            "layer.0.SelfAttention.v.weight": "attn.v.weight", "layer.0.SelfAttention.o.weight": "attn.o.weight",
            "layer.0.SelfAttention.relative_attention_bias.weight": "pos_embedding.embedding.weight",
            "layer.1.layer_norm.weight": "norm2.weight",
            "layer.1.DenseReluDense.wi_0.weight": "ffn.gate.0.weight",
            "layer.1.DenseReluDense.wi_1.weight": "ffn.fc1.weight",
            "layer.1.DenseReluDense.wo.weight": "ffn.fc2.weight"}
    out = {"token_embedding.weight": sd["shared.weight"], "norm.weight": sd["encoder.final_layer_norm.weight"]}
    for k, v in sd.items():
        if m := re.fullmatch(r"encoder\.block\.(\d+)\.(.+)", k):
            out[f"blocks.{m.group(1)}.{leaf[m.group(2)]}"] = v
    return out


def wan_t5_forward(sd: dict, ids, mask, num_heads: int, num_buckets: int = 32, max_dist: int = 128):
    """The original Wan T5Encoder forward (wan/modules/t5.py, shared_pos=False, eval) on an original state dict."""
    def norm(x, w):
        return w * (x * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + 1e-6))

    def bucket(rel):  # T5RelativeEmbedding._relative_position_bucket, bidirectional
        nb = num_buckets // 2
        out = (rel > 0).long() * nb
        rel = rel.abs()
        exact = nb // 2
        large = exact + (torch.log(rel.float() / exact) / math.log(max_dist / exact) * (nb - exact)).long()
        large = torch.min(large, torch.full_like(large, nb - 1))
        return out + torch.where(rel < exact, rel, large)

    x = F.embedding(ids, sd["token_embedding.weight"])
    b, n = ids.shape
    rel = torch.arange(n).unsqueeze(0) - torch.arange(n).unsqueeze(1)
    layers = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    for i in range(layers):
        p = f"blocks.{i}."
        e = F.embedding(bucket(rel), sd[p + "pos_embedding.embedding.weight"]).permute(2, 0, 1).unsqueeze(0)
        h = norm(x, sd[p + "norm1.weight"])
        c = sd[p + "attn.q.weight"].shape[0] // num_heads
        q, k, v = (F.linear(h, sd[p + f"attn.{t}.weight"]).view(b, n, num_heads, c) for t in "qkv")
        bias = e.expand(b, -1, -1, -1).clone()
        bias.masked_fill_(mask.view(b, 1, 1, n) == 0, torch.finfo(x.dtype).min)
        attn = F.softmax(torch.einsum("binc,bjnc->bnij", q, k) + bias, dim=-1)
        y = torch.einsum("bnij,bjnc->binc", attn, v).reshape(b, n, num_heads * c)
        x = x + F.linear(y, sd[p + "attn.o.weight"])
        h = norm(x, sd[p + "norm2.weight"])
        gate = F.gelu(F.linear(h, sd[p + "ffn.gate.0.weight"]), approximate="tanh")
        x = x + F.linear(F.linear(h, sd[p + "ffn.fc1.weight"]) * gate, sd[p + "ffn.fc2.weight"])
    return norm(x, sd["norm.weight"])


# ---- writing a tiny model in the ORIGINAL layout ---------------------------------------------------------------------
def save_original_dit(model, folder: Path, model_type: str, shards: int, dtype=None) -> None:
    """A VACE model as VideoX-Fun's VaceWanTransformer3DModel writes it: model_type "t2v", vace_layers, vace_in_dim."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    sd = {k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in dit_to_original(model.state_dict()).items()}
    vace = {"_class_name": "VaceWanTransformer3DModel", "vace_layers": list(cfg.vace_layers),
            "vace_in_dim": cfg.vace_in_channels} if "vace_layers" in cfg else {"_class_name": "WanModel"}
    (folder / "config.json").write_text(json.dumps({
        **vace, "_diffusers_version": "0.33.0",
        "dim": cfg.num_attention_heads * cfg.attention_head_dim,
        "eps": cfg.eps, "ffn_dim": cfg.ffn_dim, "freq_dim": cfg.freq_dim, "in_dim": cfg.in_channels,
        "model_type": model_type, "num_heads": cfg.num_attention_heads, "num_layers": cfg.num_layers,
        "out_dim": cfg.out_channels, "text_len": 512}, indent=2))
    if shards == 1:
        save_file(sd, str(folder / "diffusion_pytorch_model.safetensors"))
        return
    keys = sorted(sd)
    weight_map = {}
    for s in range(shards):
        name = f"diffusion_pytorch_model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[s::shards]}
        save_file(part, str(folder / name))
        weight_map.update({k: name for k in part})
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def write_original(spec, comps: dict, src: Path) -> None:
    layout = spec.layout
    if layout == "ti2v":
        save_original_dit(comps["transformer"], src, "ti2v", shards=2)
    else:
        mt = {"t2v_a14b": "t2v", "i2v_a14b": "i2v", "vace_a14b": "t2v"}[layout]
        save_original_dit(comps["transformer"], src / "high_noise_model", mt, shards=3)
        # the low-noise expert as one bf16 file, like a real bf16 release: conversion must keep the dtype
        save_original_dit(comps["transformer_2"], src / "low_noise_model", mt, shards=1, dtype=torch.bfloat16)
    vcfg = comps["vae"].config
    vae_sd = vae_to_original(comps["vae"].state_dict(), vcfg.is_residual, vcfg.num_res_blocks)
    torch.save(vae_sd, src / ("Wan2.2_VAE.pth" if vcfg.is_residual else "Wan2.1_VAE.pth"))
    torch.save(t5_to_original(comps["text_encoder"].state_dict()), src / T5_FILE)
    build_tokenizer(src / "google" / "umt5-xxl", spec.text_len)


class Case:
    """A tiny model: its random diffusers components, its original-layout folder, and the converted folder."""

    def __init__(self, root: Path, model: str, via_cli: bool):
        self.spec = build(compose_cfg([f"model={model}", f"paths.tiny_model_dir={root}/converted"]).model)
        self.comps = build_components(self.spec)
        self.src = root / "original"
        write_original(self.spec, self.comps, self.src)
        self.comps["vae"].save_config(root / "ref_vae")  # the tiny model's own (random) latent statistics
        model_arg = original.MODEL_OF_LAYOUT[self.spec.layout]
        if via_cli:
            from wanexp.cli.convert import main

            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = main(["--src", str(self.src), "--dst", str(self.spec.path), "--model", model_arg,
                           "--vae-config", str(root / "ref_vae" / "config.json")])
            assert rc == 0
            self.output = buf.getvalue()
        else:
            self.output = "\n".join(original.convert_original(self.src, self.spec.path, self.spec.layout,
                                                              vae_config=root / "ref_vae"))


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory) -> Case:
    return Case(tmp_path_factory.mktemp("ti2v"), "tiny", via_cli=False)


@pytest.fixture(scope="module")
def i2v(tmp_path_factory) -> Case:
    return Case(tmp_path_factory.mktemp("i2v"), "tiny_i2v14b", via_cli=True)


@pytest.fixture(scope="module")
def vace(tmp_path_factory) -> Case:
    return Case(tmp_path_factory.mktemp("vace"), "tiny_vace", via_cli=True)


def assert_same_tensors(loaded: dict, ref: dict) -> None:
    assert loaded.keys() == ref.keys()
    for k in ref:
        assert loaded[k].dtype == ref[k].dtype, k
        assert torch.equal(loaded[k], ref[k]), f"{k} differs"


def public(cfg) -> dict:
    return json.loads(json.dumps({k: v for k, v in dict(cfg).items() if not k.startswith("_")}))


# ---- the converted folder loads through the spec and holds the same tensors ------------------------------------------
@pytest.mark.parametrize("case", ["ti2v", "i2v", "vace"])
def test_converted_folder_loads_through_spec_with_identical_tensors(case, request, tmp_path):
    c: Case = request.getfixturevalue(case)
    spec, comps = c.spec, c.comps
    assert not original.is_original_layout(spec.path)
    spec.check_folder(spec.experts)
    experts = {"dense": "transformer"} if spec.experts == ["dense"] else {"high": "transformer", "low": "transformer_2"}
    for expert, name in experts.items():
        dit = spec.load_transformer(expert)
        ref = comps[name].state_dict()
        if name == "transformer_2":  # written as bf16 (write_original), loaded at spec.dtype=fp32
            ref = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in ref.items()}
        assert_same_tensors(dit.state_dict(), ref)
        assert public(dit.config) == public(comps[name].config)
    vae = spec.load_vae()
    assert_same_tensors(vae.state_dict(), comps["vae"].state_dict())
    assert public(vae.config) == public(comps["vae"].config)
    te = spec.load_text_encoder()
    assert_same_tensors(te.state_dict(), comps["text_encoder"].state_dict())
    ref_cfg = comps["text_encoder"].config
    for key in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads", "relative_attention_num_buckets",
                "relative_attention_max_distance", "dense_act_fn", "is_gated_act", "layer_norm_epsilon"):
        assert getattr(te.config, key) == getattr(ref_cfg, key), key
    tok = spec.load_tokenizer()
    assert tok("a cat, walking")["input_ids"] == build_tokenizer(tmp_path / "tok_ref", spec.text_len)(
        "a cat, walking")["input_ids"]


def test_the_low_noise_expert_keeps_its_bf16_dtype_on_disk(i2v):
    sd = {}
    for f in sorted((i2v.spec.path / "transformer_2").glob("*.safetensors")):
        sd.update(load_file(f))
    assert sd and {t.dtype for t in sd.values()} == {torch.bfloat16}
    assert {t.dtype for t in load_file(next((i2v.spec.path / "transformer").glob("*.safetensors"))).values()} == {
        torch.float32}


@pytest.mark.parametrize("case", ["ti2v", "i2v", "vace"])
def test_pipeline_index_and_scheduler_match_the_layout(case, request):
    c: Case = request.getfixturevalue(case)
    index = json.loads((c.spec.path / "model_index.json").read_text())
    assert index["_class_name"] == c.spec.pipeline_class
    assert index["boundary_ratio"] == c.spec.boundary_ratio
    if case != "vace":  # WanVACEPipeline has no expand_timesteps
        assert index["expand_timesteps"] == bool(c.spec.pipeline_extras.get("expand_timesteps", False))
    dit = ["diffusers", "WanVACETransformer3DModel" if case == "vace" else "WanTransformer3DModel"]
    assert index["transformer"] == dit
    assert index["transformer_2"] == (dit if "low" in c.spec.experts else [None, None])
    sched = json.loads((c.spec.path / "scheduler" / "scheduler_config.json").read_text())
    assert sched["_class_name"] == "UniPCMultistepScheduler"
    assert (sched["flow_shift"], sched["prediction_type"], sched["use_flow_sigmas"]) == (
        c.spec.shift, "flow_prediction", True)
    assert not [p.name for p in c.spec.path.parent.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_cli_prints_what_it_wrote(i2v):
    for part in ("text_encoder/", "tokenizer/", "transformer/", "transformer_2/", "vae/", "scheduler/",
                 "WanImageToVideoPipeline", str(i2v.src / "high_noise_model"), str(i2v.src / "low_noise_model")):
        assert part in i2v.output


def test_layout_table_matches_the_model_configs_and_specs():
    """The one layout table (wan22/layouts.py) agrees with each model YAML and the spec class it names."""
    from hydra.utils import get_class

    from wanexp.models.wan22.layouts import MODELS

    for model, lay in MODELS.items():
        cfg = compose_cfg([f"model={model}", "model.path=/m"]).model
        assert (lay.shift, lay.boundary_ratio, lay.experts) == (cfg.shift, cfg.boundary_ratio, tuple(cfg.experts))
        spec_cls = get_class(cfg._target_)
        assert spec_cls.layout == lay.name
        assert (spec_cls.in_channels, spec_cls.latent_channels, spec_cls.vae_stride) == \
            (lay.in_channels, lay.latent_channels, lay.vae_stride)
        assert original.CLI_MODELS[model] == lay.name


# ---- the name mappings against diffusers' own converters and the original T5 forward ---------------------------------
def test_dit_inverse_names_agree_with_diffusers_converter(ti2v):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    ref = ti2v.comps["transformer"].state_dict()
    orig = dit_to_original(ref)
    assert {k for k in orig if k.startswith("blocks.0.")} >= {
        "blocks.0.self_attn.q.weight", "blocks.0.cross_attn.o.bias", "blocks.0.norm3.weight", "blocks.0.ffn.0.weight",
        "blocks.0.modulation"}
    assert_same_tensors(convert_wan_transformer_to_diffusers(dict(orig)), ref)


@pytest.mark.parametrize("residual", [False, True])
def test_vae_mapping_at_the_real_num_res_blocks(residual):
    """The real VAEs have num_res_blocks=2 (the tiny ones 1); the Wan2.1 names also match diffusers' converter."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    torch.manual_seed(0)
    layout = {"z_dim": 48, "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
              "scale_factor_spatial": 16, "base_dim": 4, "decoder_base_dim": 8,
              "latents_mean": [0.1] * 48, "latents_std": [0.9] * 48} if residual else {"base_dim": 4}
    vae = AutoencoderKLWan(num_res_blocks=2, **layout)
    ref = vae.state_dict()
    orig = vae_to_original(ref, residual, 2)
    if not residual:
        assert_same_tensors(convert_wan_vae_to_diffusers(orig), ref)  # the helper agrees with diffusers
    assert_same_tensors(original.convert_vae_state_dict(orig, residual), ref)
    cfg = original.vae_config(orig, "ti2v" if residual else "t2v_a14b", (vae.config.latents_mean,
                                                                            vae.config.latents_std))
    assert public(AutoencoderKLWan(**cfg).config) == public(vae.config)
    assert original.vae_config(orig, "ti2v" if residual else "t2v_a14b")["latents_mean"] == (
        original.WAN22_LATENTS_MEAN if residual else vae.config.latents_mean)  # Wan2.1: diffusers' defaults


def test_text_encoder_matches_the_original_t5_forward(ti2v):
    te = ti2v.spec.load_text_encoder()
    sd = torch.load(ti2v.src / T5_FILE, map_location="cpu", weights_only=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, te.config.vocab_size, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    with torch.no_grad():
        ours = te(input_ids=ids, attention_mask=mask).last_hidden_state
        ref = wan_t5_forward(sd, ids, mask, te.config.num_heads, te.config.relative_attention_num_buckets)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


# ---- one-line user errors --------------------------------------------------------------------------------------------
def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_missing_t5_file_is_one_line_naming_it(ti2v, tmp_path):
    src = tmp_path / "orig"
    shutil.copytree(ti2v.src, src, ignore=shutil.ignore_patterns(T5_FILE))
    dst = tmp_path / "out" / "conv"
    with pytest.raises(ConfigError) as e:
        original.convert_original(src, dst, "ti2v")
    msg = one_line(e)
    assert str(src / T5_FILE) in msg
    assert not dst.exists() and not (tmp_path / "out").exists()


def test_wrong_and_unknown_layout_and_existing_dst(ti2v, i2v, tmp_path):
    with pytest.raises(ConfigError) as e:
        original.convert_original(ti2v.src, tmp_path / "a", "t2v_a14b")
    assert "--model ti2v5b" in one_line(e)
    with pytest.raises(ConfigError) as e:
        original.convert_original(i2v.src, tmp_path / "b", "t2v_a14b")
    assert "--model i2v14b" in one_line(e)
    with pytest.raises(ConfigError) as e:
        original.convert_original(ti2v.src, tmp_path / "c", "wan21")
    assert "ti2v5b" in one_line(e)
    with pytest.raises(ConfigError) as e:
        original.convert_original(ti2v.src, ti2v.spec.path, "ti2v")
    assert "already exists" in one_line(e)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("case,model", [("ti2v", "ti2v5b"), ("i2v", "i2v14b"), ("vace", "vace14b")])
def test_check_folder_on_an_original_folder_names_the_convert_command(case, model, request):
    c: Case = request.getfixturevalue(case)
    assert original.is_original_layout(c.src)
    spec = build(compose_cfg([f"model={c.spec.name}", "paths.tiny_model_dir=/unused"]).model)
    spec.path = c.src
    with pytest.raises(ConfigError) as e:
        spec.check_folder(spec.experts)
    msg = one_line(e)
    assert "original Wan-AI release layout" in msg
    assert f"python -m wanexp.cli.convert --src {c.src} --dst {c.src}-diffusers --model {model}" in msg


def test_check_folder_keeps_its_message_for_other_folders(tmp_path):
    spec = build(compose_cfg(["model=tiny", f"paths.tiny_model_dir={tmp_path}"]).model)
    spec.path.mkdir(parents=True)
    assert not original.is_original_layout(spec.path)
    with pytest.raises(ConfigError, match="no model_index.json, so this is not a diffusers-format folder"):
        spec.check_folder(spec.experts)


def test_cli_error_exits_2_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "wanexp.cli.convert", "--src", str(tmp_path / "nope"), "--dst",
                        str(tmp_path / "out"), "--model", "ti2v5b"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("wanexp: error: --src ") and r.stderr.count("\n") == 1
    assert "lightning" not in r.stderr.lower()


def test_an_unknown_model_group_is_one_line(tmp_path, capsys):
    """--model is any model group whose family converts; a name with no conf/model file is one line, exit 2."""
    from wanexp.cli.convert import main

    assert main(["--src", str(tmp_path), "--dst", str(tmp_path / "out"), "--model", "ti2v6b"]) == 2
    err = capsys.readouterr().err
    assert err == "wanexp: error: --model ti2v6b: no such model group (conf/model/ti2v6b.yaml)\n"
    assert not (tmp_path / "out").exists()


def test_a_vace_download_and_a_t2v_download_each_name_their_model(vace, tmp_path):
    """The VACE release's experts say model_type "t2v" like T2V-A14B's: their vace_layers tell them apart, and
    converting one as the other is one line naming the right --model, with nothing written."""
    assert original.detect_layout(vace.src) == "vace_a14b"
    with pytest.raises(ConfigError) as e:
        original.convert_original(vace.src, tmp_path / "a", "t2v_a14b")
    assert "--model vace14b" in one_line(e)
    t2v = tmp_path / "t2v"
    shutil.copytree(vace.src, t2v)
    for expert in ("high_noise_model", "low_noise_model"):
        cfg = json.loads((t2v / expert / "config.json").read_text())
        for key in ("vace_layers", "vace_in_dim"):
            cfg.pop(key)
        (t2v / expert / "config.json").write_text(json.dumps(cfg))
    assert original.detect_layout(t2v) == "t2v_a14b"
    with pytest.raises(ConfigError) as e:
        original.convert_original(t2v, tmp_path / "b", "vace_a14b")
    assert "--model t2v14b" in one_line(e)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_control_blocks_keep_their_original_names_apart():
    """The inverse names of the control blocks (tests/single_files.py) against diffusers' converter: before_proj and
    after_proj become proj_in and proj_out, the blocks' own keys as the DiT's."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    names = ["vace_blocks.0.proj_in.weight", "vace_blocks.1.proj_out.bias", "vace_blocks.1.attn1.to_q.weight",
             "vace_blocks.0.norm2.weight", "vace_patch_embedding.weight", "blocks.3.attn2.to_out.0.bias"]
    orig = dit_to_original({n: torch.zeros(1) for n in names})
    assert set(orig) == {"vace_blocks.0.before_proj.weight", "vace_blocks.1.after_proj.bias",
                         "vace_blocks.1.self_attn.q.weight", "vace_blocks.0.norm3.weight",
                         "vace_patch_embedding.weight", "blocks.3.cross_attn.o.bias"}
    assert set(convert_wan_transformer_to_diffusers(orig)) == set(names)


def test_a_vace_config_with_null_control_settings_takes_videox_funs_defaults(vace, tmp_path):
    """VideoX-Fun writes vace_layers/vace_in_dim null when built with its defaults: every second block, and the
    control patch embedding's input channels."""
    cfg = json.loads((vace.src / "high_noise_model" / "config.json").read_text())
    sd = {"vace_patch_embedding.weight": torch.zeros(8, 96, 1, 2, 2)}
    nulled = dict(cfg, vace_layers=None, vace_in_dim=None, num_layers=6)
    got = original.transformer_config(nulled, sd, tmp_path / "config.json", control=True)
    assert got["vace_layers"] == [0, 2, 4] and got["vace_in_channels"] == 96
    with pytest.raises(ConfigError) as e:
        original.transformer_config(dict(cfg, vace_layers="all"), sd, tmp_path / "config.json", control=True)
    assert "needs vace_layers" in one_line(e)
