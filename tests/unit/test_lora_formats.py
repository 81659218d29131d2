"""LoRA files of other trainers as ``adapter.init_from``, and the mode of the LoRA files wanexp writes.

A tiny random Wan DiT (2 blocks) carries a LoRA with rank 4, alpha 2 and random A and B; its weights are written by
hand in each trainer's naming scheme. Loading a file into a run with alpha 8 must give every module the same update
``alpha/rank * B @ A`` as the source adapter (and, where the file's scale is one number, the same A).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from tests import wan_adapters as lora
from wanexp.errors import ConfigError

TINY = dict(num_attention_heads=2, attention_head_dim=8, ffn_dim=32, num_layers=2, text_dim=16, freq_dim=16,
            in_channels=4, out_channels=4, patch_size=[1, 2, 2])
TARGETS = ["q", "k", "v", "o", "ffn.0", "ffn.2"]
RANK, ALPHA, RUN_ALPHA = 4, 2.0, 8.0
# diffusers module suffix -> original Wan name, written out here so the test does not reuse the code's own mapping
ORIGINAL = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
            "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
            "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0",
            "ffn.net.2": "ffn.2"}


def _adapter(init_from=None, rank=RANK, alpha=RUN_ALPHA, targets=TARGETS, attention=("self", "cross")):
    return lora.LoraAdapter(name="lora", rank=rank, alpha=alpha, dropout=0.0, targets=list(targets),
                            attention=list(attention), init_from=init_from)


def _transformer(num_layers=2):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)  # the same frozen base every time
    t = WanTransformer3DModel(**dict(TINY, num_layers=num_layers)).float()
    t.requires_grad_(False)
    return t


@pytest.fixture(scope="module")
def source():
    """Peft-named weights {module: (A, B)} of a rank-4, alpha-2 LoRA with every A and B random."""
    t = _transformer()
    _adapter(alpha=ALPHA).apply(t)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in t.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    sd = lora.adapter_weights(t.state_dict())
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in sd})
    assert len(modules) == 20  # 2 blocks x (8 attention projections + 2 FFN linears)
    return {m: (sd[f"{m}.lora_A.weight"], sd[f"{m}.lora_B.weight"]) for m in modules}


def _original(module: str) -> str:
    block, rest = module.split(".", 2)[1:]
    return f"blocks.{block}.{ORIGINAL[rest]}"


def _musubi(src, alphas=None):
    """kohya/musubi-tuner: lora_unet_blocks_0_self_attn_q.lora_down/lora_up/alpha; ``alphas`` per module."""
    out = {}
    for m, (a, b) in src.items():
        key = "lora_unet_" + _original(m).replace(".", "_")
        alpha = (alphas or {}).get(m, ALPHA)
        out[f"{key}.lora_down.weight"] = a
        out[f"{key}.lora_up.weight"] = b * (ALPHA / alpha)  # the same update under this module's own alpha
        out[f"{key}.alpha"] = torch.tensor(alpha)
    return out


def _aitoolkit_original(src):
    """ai-toolkit's ComfyUI-style file: diffusion_model.blocks.0.self_attn.q.lora_A/lora_B + alpha."""
    out = {}
    for m, (a, b) in src.items():
        key = "diffusion_model." + _original(m)
        out.update({f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b, f"{key}.alpha": torch.tensor(ALPHA)})
    return out


def _diffusers_no_alpha(src):
    """transformer.blocks.0.attn1.to_q.lora_A/lora_B with no alpha anywhere (ai-toolkit, diffusers scripts): scale 1,
    so B holds the source's alpha/rank."""
    out = {}
    for m, (a, b) in src.items():
        out.update({f"transformer.{m}.lora_A.weight": a, f"transformer.{m}.lora_B.weight": b * (ALPHA / RANK)})
    return out


def _diffusers(src):
    """diffusers' save_lora_weights: transformer.* keys, alpha in the lora_adapter_metadata header."""
    return {f"transformer.{m}.lora_{x}.weight": w for m, (a, b) in src.items() for x, w in (("A", a), ("B", b))}


DIFFUSERS_META = {"format": "pt", "lora_adapter_metadata": json.dumps({"transformer.r": RANK,
                                                                       "transformer.lora_alpha": ALPHA})}


def _write(tmp_path, name, tensors, metadata=None):
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)
    return str(path)


def _loaded(path, **kw):
    t = _transformer(kw.pop("num_layers", 2))
    _adapter(path, **kw).apply(t)
    sd = lora.adapter_weights(t.state_dict())
    return {m: (sd[f"{m}.lora_A.weight"], sd[f"{m}.lora_B.weight"]) for m in {k.rsplit(".lora_", 1)[0] for k in sd}}


def _assert_same_update(got, src, run_alpha=RUN_ALPHA):
    assert set(got) == set(src)
    for m, (a, b) in src.items():
        want = (ALPHA / RANK) * b @ a
        assert want.abs().max() > 1e-2, "a zero update would make the check vacuous"
        have = (run_alpha / RANK) * got[m][1] @ got[m][0]
        assert torch.allclose(have, want, atol=1e-6, rtol=1e-5), m


FORMATS = {
    "musubi": lambda src: (_musubi(src), None),
    "aitoolkit_original": lambda src: (_aitoolkit_original(src), None),
    "aitoolkit_diffusers_no_alpha": lambda src: (_diffusers_no_alpha(src), None),
    "diffusers": lambda src: (_diffusers(src), DIFFUSERS_META),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_init_from_reads_other_trainers_files_with_their_scale(source, tmp_path, fmt):
    tensors, meta = FORMATS[fmt](source)
    got = _loaded(_write(tmp_path, fmt, tensors, meta))
    _assert_same_update(got, source)
    if fmt != "aitoolkit_diffusers_no_alpha":  # one alpha/rank for the whole file: A as trained, the scale in B
        assert all(torch.equal(got[m][0], a) for m, (a, _) in source.items())


def test_init_from_musubi_file_with_per_module_alphas(source, tmp_path):
    mods = sorted(source)
    alphas = {mods[0]: 1.0, mods[1]: 16.0, mods[2]: 3.0}  # the rest keep alpha 2
    got = _loaded(_write(tmp_path, "mixed", _musubi(source, alphas)))
    _assert_same_update(got, source)


def test_foreign_files_load_like_wanexps_own_export(source, tmp_path):
    sd = {f"{m}.lora_{x}.weight": w for m, (a, b) in source.items() for x, w in (("A", a), ("B", b))}
    comfy, _ = lora.export_lora(sd, {"r": RANK, "lora_alpha": ALPHA}, tmp_path / "own", "tiny_lora")
    own = _loaded(str(comfy))
    kohya = _loaded(_write(tmp_path, "musubi", _musubi(source)))
    _assert_same_update(own, source)
    assert all(torch.equal(own[m][0], kohya[m][0]) and torch.equal(own[m][1], kohya[m][1]) for m in own)


def _one_line_error(excinfo, *parts):
    msg = str(excinfo.value)
    assert "\n" not in msg
    for part in parts:
        assert part in msg, (part, msg)


def test_unknown_format_is_one_line_naming_the_file_its_keys_and_the_formats(tmp_path):
    path = _write(tmp_path, "sdxl", {"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.ones(4, 8),
                                     "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.ones(8, 4)})
    with pytest.raises(ConfigError) as e:
        _adapter(path)
    _one_line_error(e, f"adapter.init_from={path}", "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",
                    "lora_unet_", "diffusion_model.", "transformer.")


def test_unreadable_file_is_one_line(tmp_path):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError) as e:
        _adapter(str(path))
    _one_line_error(e, f"adapter.init_from={path}", "safetensors")


def test_rank_mismatch_is_one_line_before_any_model(source, tmp_path):
    path = _write(tmp_path, "musubi", _musubi(source))
    with pytest.raises(ConfigError) as e:
        _adapter(path, rank=8)
    _one_line_error(e, "file has rank 4, run has rank 8; set adapter.rank=4")


def test_target_mismatch_names_what_differs_and_what_to_set(source, tmp_path):
    path = _write(tmp_path, "musubi", _musubi(source))
    with pytest.raises(ConfigError) as e:
        _adapter(path, targets=["q", "k", "v", "o"])
    _one_line_error(e, "ffn.0", "set adapter.targets=[q,k,v,o,ffn.0,ffn.2] adapter.attention=[self,cross]")
    self_only = {k: v for k, v in _aitoolkit_original(source).items() if ".cross_attn." not in k}
    path = _write(tmp_path, "self_only", self_only)
    with pytest.raises(ConfigError) as e:
        _adapter(path)
    _one_line_error(e, "cross_attn.q", "set adapter.targets=[q,k,v,o,ffn.0,ffn.2] adapter.attention=[self]")


def test_modules_wanexp_does_not_train_are_one_line(source, tmp_path):
    tensors = _aitoolkit_original(source)
    tensors.update({"diffusion_model.head.head.lora_A.weight": torch.ones(RANK, 16),
                    "diffusion_model.head.head.lora_B.weight": torch.ones(16, RANK)})
    path = _write(tmp_path, "head", tensors)
    with pytest.raises(ConfigError) as e:
        _adapter(path)
    _one_line_error(e, "proj_out", "adapter.init_from=")


def test_lora_of_another_model_is_one_line(source, tmp_path):
    path = _write(tmp_path, "musubi", _musubi(source))
    with pytest.raises(ConfigError) as e:
        _loaded(path, num_layers=1)
    _one_line_error(e, "blocks.1.", "another model")


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_lora_files_follow_the_umask(tmp_path, umask):
    sd = {"blocks.0.attn1.to_q.lora_A.weight": torch.ones(RANK, 16),
          "blocks.0.attn1.to_q.lora_B.weight": torch.ones(16, RANK)}
    old = os.umask(umask)
    try:
        files = lora.export_lora(sd, {"r": RANK, "lora_alpha": ALPHA}, tmp_path, "tiny_lora")
    finally:
        os.umask(old)
    assert [oct(os.stat(f).st_mode & 0o777) for f in files] == [oct(0o666 & ~umask)] * 2
