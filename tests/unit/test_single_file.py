"""ComfyUI's single files as weights (wanexp/models/wan22/single_file.py): tiny random models are written as
ComfyUI-style single files (fp16, bf16, fp8 e4m3fn, fp8_scaled with its per-tensor scales and marker, the newer
``weight_scale`` + ``_quantization_metadata`` form; with and without the ``model.diffusion_model.`` prefix), loaded
through ``model.path`` / ``model.<component>_path`` and compared with the same weights loaded from a diffusers folder:
equal tensors, dtypes and configs (fp8: the dequantized values). Bad files are one line naming the key.

The diffusers -> original names and the float8 storage are tests/single_files.py's (the names written from the original
Wan modules); ComfyUI's UMT5 files use transformers' own names.
"""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from tests.conftest import compose_cfg
from tests.single_files import dequantize, dit_to_original, vae_to_original
from tests.single_files import quantize as to_float8
from tests.unit.test_original_layout import t5_to_original
from wanexp.composition import build
from wanexp.errors import ConfigError
from wanexp.models.wan22 import original, single_file
from wanexp.models.wan22.build import build_components, build_tokenizer

BLOCK = {"num_attention_heads": 1, "attention_head_dim": 128, "ffn_dim": 64, "num_layers": 2, "text_dim": 32,
         "freq_dim": 32}  # 128-channel heads, as every released Wan DiT (the files do not store the head count)


def public(cfg) -> dict:
    return json.loads(json.dumps({k: v for k, v in dict(cfg).items() if not k.startswith("_")}))


def write(path: Path, sd: dict, metadata: dict | None = None) -> Path:
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=metadata)
    return path


def dit(in_channels: int = 48, out_channels: int = 48, seed: int = 0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(in_channels=in_channels, out_channels=out_channels, patch_size=[1, 2, 2], **BLOCK)


def comfy_file(sd: dict, to_original, path: Path, dtype, fp8: str | None = None, prefix: str = "",
               quantize=lambda name, v: v.dim() == 2) -> tuple[Path, dict]:
    """``sd`` (diffusers/transformers names) written under the names ``to_original`` gives, as ComfyUI writes its
    files: ``dtype``, or the 2-D weights ``quantize`` picks in float8_e4m3fn: ``fp8="plain"`` (no scale),
    ``"scaled"`` (a per-tensor ``scale_weight``, a ``scale_input`` of 1 and the ``scaled_fp8`` marker) or
    ``"weight_scale"`` (per-row ``weight_scale`` and the layers in ``_quantization_metadata``). Returns the file and
    the values it holds in ``sd``'s names (float32 where dequantized)."""
    names = to_original({k: k for k in sd})  # file name -> sd name
    out, held, layers = {}, {}, {}
    for name, key in names.items():
        v = sd[key]
        if fp8 is None or not name.endswith(".weight") or not quantize(name, v):
            out[name] = held[key] = v.to(dtype)
            continue
        layer = name[:-len(".weight")]
        out[name], scale = to_float8(v, fp8)
        held[key] = dequantize(out[name], scale)
        if fp8 == "plain":
            continue
        if fp8 == "scaled":
            out[f"{layer}.scale_weight"], out[f"{layer}.scale_input"] = scale, torch.ones(())
        else:
            out[f"{layer}.weight_scale"] = scale
            layers[f"{prefix}{layer}"] = {"format": "float8_e4m3fn"}
    if fp8 == "scaled":
        out["scaled_fp8"] = torch.empty(2, dtype=torch.float8_e4m3fn)
    metadata = {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})} if layers else None
    return write(path, {prefix + k: v for k, v in out.items()}, metadata), held


def saved(model, values: dict, folder: Path) -> Path:
    """``model``'s class with ``values`` saved as a diffusers/transformers folder (float32: exactly the values)."""
    model.load_state_dict({k: v.float() for k, v in values.items()}, strict=False)
    model.float().save_pretrained(folder)
    return folder


def assert_same_model(loaded, ref) -> None:
    a, b = loaded.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    for k in b:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), f"{k} differs"
    for (n, x), (m, y) in zip(loaded.named_buffers(), ref.named_buffers()):
        assert n == m and x.dtype == y.dtype and torch.equal(x, y), n


def tiny_vae(model: str):
    return build_components(build(compose_cfg([f"model={model}", "paths.tiny_model_dir=/unused"]).model))["vae"]


@functools.lru_cache(maxsize=None)
def model_group(model: str):
    return compose_cfg([f"model={model}", "model.build=null"]).model


def spec_of(overrides: list[str], model: str = "tiny"):
    """The spec of model group ``model`` (no build) with ``model.KEY=VALUE`` overrides (composed once per group)."""
    node = copy.deepcopy(model_group(model))
    for item in overrides:
        key, _, value = item.partition("=")
        OmegaConf.update(node, key.removeprefix("model."), None if value == "null" else value)
    return build(node)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny TI2V model's random VAE, UMT5 and tokenizer, and a 128-channel-head DiT of its layout."""
    root = tmp_path_factory.mktemp("single")
    spec = build(compose_cfg(["model=tiny", f"paths.tiny_model_dir={root}"]).model)
    comps = build_components(spec)
    comps["transformer"] = dit()
    return root, comps


# ---- each component from its file equals the diffusers folder's load -------------------------------------------------
DIT_FILES = {  # file dtype, fp8 form, key prefix, the run's model.dtype
    "fp16_prefixed": (torch.float16, None, "model.diffusion_model.", "bf16"),
    "bf16": (torch.bfloat16, None, "", "bf16"),
    "fp8_e4m3fn": (torch.float16, "plain", "diffusion_model.", "bf16"),
    "fp8_scaled": (torch.float16, "scaled", "model.diffusion_model.", "fp32"),
    "fp8_weight_scale": (torch.bfloat16, "weight_scale", "", "bf16"),
}


@pytest.mark.parametrize("case", DIT_FILES)
def test_a_dit_file_loads_as_the_diffusers_folder_of_its_values(case, tiny, tmp_path):
    from diffusers import WanTransformer3DModel

    root, comps = tiny
    dtype, fp8, prefix, run = DIT_FILES[case]
    model = comps["transformer"]
    path, held = comfy_file(model.state_dict(), dit_to_original, tmp_path / f"wan2.2_ti2v_5B_{case}.safetensors",
                            dtype, fp8, prefix, quantize=lambda name, v: name.startswith("blocks.") and v.dim() == 2)
    folder = saved(dit(), held, tmp_path / "ref")
    spec = spec_of([f"model.path={path}", f"model.dtype={run}"])
    dense = spec.read_transformer("dense")
    assert_same_model(dense, WanTransformer3DModel.from_pretrained(folder, dtype=spec.dtype))
    assert public(dense.config) == public(model.config)
    if run == "bf16":  # the modules diffusers keeps in fp32 stay fp32, as from a folder
        assert dense.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
        assert dense.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    if fp8 == "scaled":  # the per-tensor scale was applied: not the raw float8 values
        raw = held["blocks.0.attn1.to_q.weight"] / (held["blocks.0.attn1.to_q.weight"].abs().amax() / 448)
        assert not torch.equal(dense.blocks[0].attn1.to_q.weight, raw)


def test_a_folder_with_the_transformer_given_as_a_file_takes_the_head_size_from_model_build(tmp_path):
    """model.path a (tiny) diffusers folder, model.transformer_path a file of its DiT: the rest from the folder, and the
    heads from model.build (the files do not store them)."""
    from wanexp.models.tiny import ensure_tiny_model

    base = ["model=tiny", f"paths.tiny_model_dir={tmp_path}"]
    folder_spec = build(compose_cfg(base).model)
    ensure_tiny_model(folder_spec)
    ref = folder_spec.read_transformer("dense")
    path, _ = comfy_file(ref.state_dict(), dit_to_original, tmp_path / "dit.safetensors", torch.float32,
                         prefix="model.diffusion_model.")
    spec = build(compose_cfg([*base, f"model.transformer_path={path}"]).model)
    spec.check_folder(spec.experts)
    assert spec.single_files and spec.transformer_config("dense")["num_attention_heads"] == 2
    assert_same_model(spec.read_transformer("dense"), ref)
    assert spec.load_tokenizer().vocab_size == folder_spec.load_tokenizer().vocab_size
    assert type(spec.load_scheduler()) is type(folder_spec.load_scheduler())  # the folder's own


@pytest.mark.parametrize("residual", [True, False])
def test_a_vae_file_loads_as_the_diffusers_folder_with_the_wan_latent_statistics(residual, tiny, tmp_path):
    """ComfyUI's wan2.2_vae (TI2V-5B) and wan_2.1_vae (A14B): the original Wan VAE names, in fp16 here; the latent
    statistics (not in the file) are the Wan constants."""
    from diffusers import AutoencoderKLWan

    root, comps = tiny
    model = "tiny" if residual else "tiny_t2v14b"
    vae = comps["vae"] if residual else tiny_vae(model)
    cfg = vae.config
    path, held = comfy_file(vae.state_dict(), lambda sd: vae_to_original(sd, cfg.is_residual, cfg.num_res_blocks),
                            tmp_path / "vae.safetensors", torch.float16)
    mean, std = original.LATENT_STATS[cfg.z_dim]
    ref = AutoencoderKLWan(**{**public(cfg), "latents_mean": mean, "latents_std": std})
    folder = saved(ref, held, tmp_path / "ref")
    spec = spec_of([f"model.path={tmp_path}", f"model.vae_path={path}", "model.vae_dtype=bf16"], model)
    loaded = spec.load_vae()
    assert_same_model(loaded, AutoencoderKLWan.from_pretrained(folder, dtype=torch.bfloat16))
    assert public(loaded.config) == public(ref.config)


UMT5_FILES = {  # how the file is written, the run's text_encoder_dtype
    "comfy_fp16": ("fp16", "bf16"),
    "comfy_fp8_scaled": ("scaled", "fp16"),  # transformers keeps `wo` in fp32 under fp16
    "wan_ai_pth": ("pth", "bf16"),
}


@pytest.mark.parametrize("case", UMT5_FILES)
def test_a_umt5_file_loads_as_the_transformers_folder_of_its_values(case, tiny, tmp_path):
    """ComfyUI's umt5_xxl_fp16 / _fp8_e4m3fn_scaled (transformers' names, ``shared.weight`` only, a ``spiece_model``
    beside the weights) and the Wan-AI .pth (the original names)."""
    from transformers import UMT5EncoderModel

    root, comps = tiny
    te = comps["text_encoder"]
    form, run = UMT5_FILES[case]
    sd = {k: v for k, v in te.state_dict().items() if k != "encoder.embed_tokens.weight"}
    if form == "pth":
        held = {k: v.to(torch.bfloat16) for k, v in sd.items()}
        path = tmp_path / "models_t5_umt5-xxl-enc-bf16.pth"
        torch.save(t5_to_original(held), path)
    else:
        path, held = comfy_file(sd, lambda x: x, tmp_path / "umt5.safetensors", torch.float16,
                                None if form == "fp16" else form, quantize=lambda name, v: name.startswith("encoder."))
        if form == "scaled":  # ComfyUI's UMT5 files carry the tokenizer model as a uint8 tensor: not a weight
            from safetensors.torch import load_file

            write(path, {**load_file(path), "spiece_model": torch.arange(8, dtype=torch.uint8)})
    folder = saved(UMT5EncoderModel(te.config), held, tmp_path / "ref")
    spec = spec_of([f"model.path={tmp_path}", f"model.text_encoder_path={path}", f"model.text_encoder_dtype={run}"])
    loaded = spec.load_text_encoder()
    ref = UMT5EncoderModel.from_pretrained(folder, dtype=spec.text_encoder_dtype)
    assert_same_model(loaded, ref)
    if run == "fp16":
        assert loaded.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    ids = torch.tensor([[5, 9, 1, 0]])
    with torch.no_grad():
        assert torch.equal(loaded(ids, torch.tensor([[1, 1, 1, 0]])).last_hidden_state,
                           ref(ids, torch.tensor([[1, 1, 1, 0]])).last_hidden_state)


# ---- a run whose weights are all single files ------------------------------------------------------------------------
def comfy_model_files(root: Path, comps: dict) -> dict:
    """The tiny model as ComfyUI's files: DiT (fp8_scaled, prefixed), VAE (fp16), UMT5 (fp16); and the tokenizer
    folder: {model key: path}."""
    vcfg = comps["vae"].config
    build_tokenizer(root / "tokenizer", 64)
    out = {"path": comfy_file(comps["transformer"].state_dict(), dit_to_original, root / "dit_fp8_scaled.safetensors",
                              torch.float16, "scaled", "model.diffusion_model.")[0],
           "vae_path": comfy_file(comps["vae"].state_dict(),
                                  lambda sd: vae_to_original(sd, vcfg.is_residual, vcfg.num_res_blocks),
                                  root / "vae.safetensors", torch.float16)[0],
           "text_encoder_path": comfy_file(comps["text_encoder"].state_dict(), lambda x: x, root / "umt5.safetensors",
                                           torch.float16)[0],
           "tokenizer_path": root / "tokenizer"}
    return {k: str(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def files(tiny):
    root, comps = tiny
    return comfy_model_files(root / "files", comps)


def overrides(files: dict, **change) -> list[str]:
    return [f"model.{k}={v}" for k, v in {**files, **change}.items() if v is not None]


def test_a_run_from_files_only_checks_counts_and_keys_them(files, tmp_path):
    from safetensors.torch import load_file

    spec = spec_of(overrides(files))
    assert spec.single_files
    spec.check_folder(spec.experts)
    params = {k: sum(v.numel() for n, v in load_file(files[k]).items() if not n.endswith(single_file.MARKERS + (
        ".scale_weight", ".scale_input"))) for k in ("path", "vae_path", "text_encoder_path")}
    assert spec.load_bytes(spec.experts, True) == 4 * sum(params.values())  # fp32 once loaded (model=tiny)
    assert spec.load_bytes(spec.experts, False) == 4 * params["path"]
    assert spec.meta_transformers("full")["dense"].config.num_attention_heads == 1
    sched = spec.load_scheduler()
    assert type(sched).__name__ == "UniPCMultistepScheduler" and sched.config.flow_shift == spec.shift
    info = spec.encoder_info()
    assert (info.vae, info.text_encoder, info.tokenizer) == (files["vae_path"], files["text_encoder_path"],
                                                            files["tokenizer_path"])
    assert json.loads(info.vae_dtype)[1][0] == files["vae_path"]  # the file's identity keys the latent cache
    assert json.loads(info.text_dtype)[1][0] == files["text_encoder_path"]
    encoders = spec.load_encoders()
    with torch.no_grad():
        emb = encoders.encode_prompts(["a red square"])
    assert emb.shape == (1, spec.text_len, 32)


def test_model_path_null_takes_each_component_from_its_key_and_one_file_is_named_once(files):
    dit_file = files["path"]
    spec = spec_of(overrides(files, path="null", transformer_path=dit_file))
    spec.check_folder(spec.experts)
    assert_same_model(spec.read_transformer("dense"), spec_of(overrides(files)).read_transformer("dense"))
    msg = refusal(overrides(files, transformer_path=dit_file))
    assert msg.startswith(f"model.path={dit_file} and model.transformer_path={dit_file} both name the transformer")


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def refusal(overrides_: list[str], model: str = "tiny") -> str:
    spec = spec_of(overrides_, model)
    with pytest.raises(ConfigError) as e:
        spec.check_folder(spec.experts)
    return one_line(e)


@pytest.mark.parametrize("key,says", [
    ("tokenizer_path", "model.tokenizer_path is not set and UMT5 single files carry no tokenizer: set it to a "
                       "tokenizer folder"),
    ("vae_path", "model.vae_path is not set and model.path="),
    ("text_encoder_path", "model.text_encoder_path is not set and model.path="),
])
def test_a_component_no_path_gives_is_one_line_naming_its_key(key, says, files):
    msg = refusal(overrides(files, **{key: None}))
    assert msg.startswith(says) and ("ComfyUI: " in msg) == (key != "tokenizer_path"), msg


@pytest.mark.parametrize("model,in_channels,out_channels,right", [
    ("t2v14b", 48, 48, "model=ti2v5b"), ("ti2v5b", 36, 16, "model=i2v14b"), ("ti2v5b", 16, 16, "model=t2v14b"),
])
def test_a_dit_of_another_layout_names_the_right_model(model, in_channels, out_channels, right, tmp_path):
    path, _ = comfy_file(dit(in_channels, out_channels).state_dict(), dit_to_original, tmp_path / "d.safetensors",
                         torch.float16)
    msg = refusal([f"model.path={path}"], model)
    assert msg.startswith(f"model.path={path}: the DiT of a ") and msg.endswith(f"run with {right}")


def bad_dit_file(case: str, root: Path, files: dict) -> tuple[Path, str]:
    """A DiT file with one problem (written from the good one) and what its refusal says."""
    from safetensors.torch import load_file

    good = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(files["path"]).items()}
    data = Path(files["path"]).read_bytes()
    cases = {
        "garbage": (lambda p: p.write_bytes(b"\x10" + b"\x00" * 7 + b"not json at all!"),
                    "not a readable safetensors file"),
        "truncated": (lambda p: p.write_bytes(data[:len(data) - 100]), "truncated"),
        "vae": (None, "holds a Wan VAE, not a Wan DiT (transformer); it belongs in model.vae_path"),
        "lora": (lambda p: write(p, {"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.zeros(4, 128)}),
                 "holds a LoRA, not a Wan DiT"),
        "missing key": (lambda p: write(p, {k: v for k, v in good.items() if k != "blocks.1.cross_attn.k.bias"}),
                        "does not match the WanTransformer3DModel its shapes describe (missing 1"),
        "wan2.1 i2v": (lambda p: write(p, {**good, "img_emb.proj.0.weight": torch.zeros(4)}),
                       "a Wan2.1 image-to-video DiT"),
        "nvfp4": (lambda p: write(p, good, {"_quantization_metadata": json.dumps(
            {"layers": {"blocks.0.self_attn.q": {"format": "nvfp4"}}})}),
                  "layer blocks.0.self_attn.q is quantized as nvfp4"),
        "int8": (lambda p: write(p, {**good, "blocks.0.ffn.0.weight": torch.zeros(64, 128, dtype=torch.int8)}),
                 "tensor blocks.0.ffn.0.weight is stored as I8"),
        "diffusers names": (lambda p: write(p, {"patch_embedding.weight": torch.zeros(1),
                                                "scale_shift_table": torch.zeros(1)}),
                            "holds a Wan DiT in diffusers' names, which loads from its folder"),
        "block-wise scales": (lambda p: write(p, {**good, "blocks.0.ffn.0.scale_weight": torch.ones(2, 2)}),
                              "block-wise fp8 scales are not read"),
        "gguf": (lambda p: p.write_bytes(b"GGUF"), "a GGUF file"),
    }
    make, says = cases[case]
    if make is None:
        return Path(files["vae_path"]), says
    path = root / ("dit.gguf" if case == "gguf" else "dit.safetensors")
    make(path)
    return path, says


BAD_DIT = ["garbage", "truncated", "vae", "lora", "missing key", "wan2.1 i2v", "nvfp4", "int8", "diffusers names",
           "block-wise scales", "gguf"]


@pytest.mark.parametrize("case", BAD_DIT)
def test_a_bad_dit_file_is_one_line_before_anything_loads(case, files, tmp_path, monkeypatch):
    path, says = bad_dit_file(case, tmp_path, files)
    monkeypatch.setattr(single_file, "_assign", lambda *a: pytest.fail("loaded weights"))
    msg = refusal(overrides(files, path=path))
    assert msg.startswith(f"model.path={path}: ") and says in msg, msg


@pytest.mark.parametrize("key,bad,says", [
    ("vae_path", "path", "holds a Wan DiT (transformer), not a Wan VAE; it belongs in model.transformer_path"),
    ("text_encoder_path", "vae_path", "holds a Wan VAE, not a T5/UMT5 text encoder"),
    ("tokenizer_path", "vae_path", "not a tokenizer folder"),
])
def test_a_file_of_another_component_is_one_line_naming_where_it_belongs(key, bad, says, files):
    msg = refusal(overrides(files, **{key: files[bad] if key != "tokenizer_path" else Path(files[bad]).parent / "x"}))
    assert msg.startswith(f"model.{key}=") and says in msg, msg


def test_the_wrong_vae_and_a_t5_instead_of_umt5_are_one_line(files, tmp_path):
    vae21 = tiny_vae("tiny_t2v14b")
    path, _ = comfy_file(vae21.state_dict(), lambda sd: vae_to_original(sd, False, vae21.config.num_res_blocks),
                         tmp_path / "wan_2.1_vae.safetensors", torch.float16)
    msg = refusal(overrides(files, vae_path=path))
    assert "the Wan2.1 VAE, but model=tiny uses the Wan2.2 VAE" in msg and "wan2.2_vae.safetensors" in msg
    from safetensors.torch import load_file

    t5 = {k: v for k, v in load_file(files["text_encoder_path"]).items()
          if not k.startswith("encoder.block.1.layer.0.SelfAttention.relative_attention_bias")}
    msg = refusal(overrides(files, text_encoder_path=write(tmp_path / "t5xxl.safetensors", t5)))
    assert "a T5 encoder (a relative position bias in block 0 only" in msg and "umt5_xxl_fp16" in msg


def test_an_expert_file_in_the_wrong_slot_and_a_missing_low_expert_are_one_line(files, tmp_path):
    path, _ = comfy_file(dit(16, 16).state_dict(), dit_to_original, tmp_path / "wan2.2_t2v_low_noise_14B.safetensors",
                         torch.float16)
    rest = {k: v for k, v in files.items() if k != "path"}
    msg = refusal([*overrides(rest), f"model.path={path}"], "t2v14b")
    assert "its name says the low-noise expert" in msg and "swap the files" in msg
    from safetensors.torch import load_file

    high = write(tmp_path / "high.safetensors", load_file(path))
    msg = refusal([*overrides(rest), f"model.path={high}"], "t2v14b")
    assert msg.startswith("model.transformer_2_path is not set and the run needs the low-noise expert")
    assert "wan2.2_t2v_low_noise_14B_fp16.safetensors" in msg


def test_the_text_width_of_the_dit_and_the_encoder_must_agree(files, tmp_path):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(1)
    wide = WanTransformer3DModel(in_channels=48, out_channels=48, patch_size=[1, 2, 2], **{**BLOCK, "text_dim": 64})
    path, _ = comfy_file(wide.state_dict(), dit_to_original, tmp_path / "d.safetensors", torch.float16)
    msg = refusal(overrides(files, path=path))
    assert msg.startswith("model.text_encoder_path=") and "width 32, but the DiT" in msg and "64-wide" in msg


# ---- before torch: the paths exist; families without single files refuse them --------------------------------------
def test_paths_are_checked_before_torch_and_other_families_refuse_component_paths(tmp_path):
    from wanexp.config import check_config

    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(["model.path=/nowhere/dit.safetensors"]), model_folder=True)
    assert one_line(e).startswith("model.path=/nowhere/dit.safetensors: file not found")
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg([f"model.path={tmp_path}", "model.vae_path=/nowhere/vae.safetensors"]),
                     model_folder=True)
    assert one_line(e).startswith("model.vae_path=/nowhere/vae.safetensors: not found")
    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg(["model.path=null"]), model_folder=True)
    assert one_line(e).startswith("model.path=null: no weights")
    check_config(compose_cfg(["model.path=null", f"model.transformer_path={tmp_path}"]), model_folder=True)
    with pytest.raises(ConfigError) as e:
        build(compose_cfg(["model=s2v14b", f"model.path={tmp_path}", f"model.vae_path={tmp_path}"]).model)
    assert "model.vae_path: model=s2v14b loads its weights from a model.path folder only" in one_line(e)
