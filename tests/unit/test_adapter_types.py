"""LoRA, DoRA, LoKr and LoHa: their files reproduce the trained model, in ComfyUI's arithmetic and in diffusers.

A tiny random Wan DiT (2 blocks) carries each adapter kind with every parameter random (rank 4, alpha 2, so a format
that drops the scale shows). Its exported files, applied to the bare base, must give the adapted model's output (fp32,
<= 1e-5 absolute on outputs of magnitude ~1); the other checks compare the effective weights (peft's merge of the
adapter into each base weight, <= 1e-5 absolute on weights of magnitude ~0.3), which is what the output is made of and
much cheaper than a forward on this machine.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests import wan_adapters as lora
from wanexp.errors import ConfigError

TINY = dict(num_attention_heads=2, attention_head_dim=8, ffn_dim=32, num_layers=2, text_dim=16, freq_dim=16,
            in_channels=4, out_channels=4, patch_size=[1, 2, 2])
TARGETS = ["q", "k", "v", "o", "ffn.0", "ffn.2"]
# kind -> (adapter class, use_dora, rank). lokr_lowrank: rank 1 makes peft split the second factor (lokr_w2_a/_b), so
# ComfyUI's alpha/dim applies; at rank 4 both factors of the tiny layers are full and ComfyUI applies no alpha.
KINDS = {"lora": (lora.LoraAdapter, False, 4), "dora": (lora.LoraAdapter, True, 4),
         "lokr": (lora.LokrAdapter, False, 4), "lokr_lowrank": (lora.LokrAdapter, False, 1),
         "loha": (lora.LohaAdapter, False, 4)}
TOL = 1e-5


def _adapter(kind, alpha=2.0, init_from=None):
    cls, dora, rank = KINDS[kind]
    return cls(name=kind, rank=rank, alpha=alpha, dropout=0.0, targets=TARGETS, attention=["self", "cross"],
               init_from=init_from, use_dora=dora)


def _base():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    t = WanTransformer3DModel(**TINY).float()
    t.requires_grad_(False)
    return t


def _out(t):
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 4, 3, 4, 4, generator=g), torch.randn(1, 8, 16, generator=g)
    with torch.no_grad():
        return t(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=text, return_dict=False)[0]


def _randomize(t, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in t.named_parameters():
            if lora.is_adapter_key(name):  # a DoRA magnitude stays near its row norm, as training keeps it
                p.copy_(p * (1 + 0.2 * torch.randn(p.shape, generator=g)) if "magnitude" in name
                        else torch.randn(p.shape, generator=g) * 0.3)


def _effective(t) -> dict[str, torch.Tensor]:
    """Every base weight with the active adapter merged in by peft (DoRA included), by its plain module name."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    m = copy.deepcopy(t)
    for layer in m.modules():
        if isinstance(layer, BaseTunerLayer):
            layer.merge()
    return {k.replace(".base_layer", ""): v for k, v in m.state_dict().items() if not lora.is_adapter_key(k)}


def _assert_same_weights(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= TOL, worst


_CACHE: dict = {}


def trained(kind, tmp_path_factory):
    """(adapted transformer, its effective weights, the exported files) of one kind, made once per session."""
    if kind not in _CACHE:
        t = _base()
        ad = _adapter(kind)
        ad.apply(t)
        _randomize(t)
        files = ad.export(t.state_dict(), "", t, tmp_path_factory.mktemp(kind), "tiny")
        _CACHE[kind] = (t, _effective(t), files)
    return _CACHE[kind]


def patched_base(path, strength=1.0):
    """The bare base with every adapted weight replaced as ComfyUI's loader would (wanexp's mirror of it)."""
    f = lora.read_any_adapter(path, "file")
    t = _base()
    sd = t.state_dict()
    for module, params in f.modules.items():
        sd[f"{module}.weight"] = lora.patched_weight(sd[f"{module}.weight"], params, strength)
    t.load_state_dict(sd)
    return t


@pytest.mark.parametrize("kind", list(KINDS))
def test_comfyui_file_reproduces_the_trained_weights(kind, tmp_path_factory):
    _, want, files = trained(kind, tmp_path_factory)
    assert files[0].name == "tiny_comfyui.safetensors"
    base = _base().state_dict()
    assert max((want[k] - base[k]).abs().max() for k in base) > 1e-2, "the adapter changed nothing: a vacuous check"
    _assert_same_weights(patched_base(files[0]).state_dict(), want)


def test_comfyui_files_reproduce_the_trained_output(tmp_path_factory):
    """The output itself, for the two kinds whose arithmetic differs most from LoRA's (forwards are slow here)."""
    for kind in ("dora", "loha"):
        t, _, files = trained(kind, tmp_path_factory)
        want, got = _out(t), _out(patched_base(files[0]))
        assert (got - want).abs().max() <= TOL, (kind, (got - want).abs().max())


# The tensor names ComfyUI's loader reads per module (comfy/lora.py, comfy/weight_adapter/*.py), written out here.
COMFY_NAMES = {"lora": {"lora_up.weight", "lora_down.weight", "alpha"},
               "dora": {"lora_up.weight", "lora_down.weight", "alpha", "dora_scale"},
               "lokr": {"lokr_w1", "lokr_w2"},  # two full factors: no alpha (ComfyUI would ignore it)
               "lokr_lowrank": {"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"},
               "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}}


@pytest.mark.parametrize("kind", list(KINDS))
def test_comfyui_file_uses_comfyuis_names(kind, tmp_path_factory):
    _, _, files = trained(kind, tmp_path_factory)
    sd = load_file(files[0])
    prefix = "diffusion_model.blocks.0.self_attn.q."
    assert {k[len(prefix):] for k in sd if k.startswith(prefix)} == COMFY_NAMES[kind]
    assert all(k.startswith("diffusion_model.blocks.") for k in sd)
    if kind == "dora":  # per output row, shaped (out, 1) so ComfyUI takes its output-axis branch
        assert sd[prefix + "dora_scale"].shape == (16, 1)


def test_patched_weight_follows_comfyuis_formulas():
    """The mirror against ComfyUI's formulas written out by hand, on 4x4 weights."""
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    w, up, down = r(4, 4), r(4, 2), r(2, 4)
    # LoRA: W + strength * alpha/rank * up @ down
    assert torch.allclose(lora.patched_weight(w, {"lora_up.weight": up, "lora_down.weight": down,
                                                  "alpha": torch.tensor(1.0)}, 0.5), w + 0.5 * 0.5 * up @ down)
    # LoKr, two full factors: alpha ignored; one low-rank factor: alpha / its inner size
    w1, w2 = r(2, 2), r(2, 2)
    assert torch.allclose(lora.patched_weight(w, {"lokr_w1": w1, "lokr_w2": w2, "alpha": torch.tensor(7.0)}),
                          w + torch.kron(w1, w2))
    a, b = r(2, 1), r(1, 2)
    assert torch.allclose(lora.patched_weight(w, {"lokr_w1": w1, "lokr_w2_a": a, "lokr_w2_b": b,
                                                  "alpha": torch.tensor(3.0)}), w + 3.0 * torch.kron(w1, a @ b))
    # LoHa: alpha / hada_w1_b rows
    p = {"hada_w1_a": r(4, 2), "hada_w1_b": r(2, 4), "hada_w2_a": r(4, 2), "hada_w2_b": r(2, 4),
         "alpha": torch.tensor(1.0)}
    assert torch.allclose(lora.patched_weight(w, p), w + 0.5 * (p["hada_w1_a"] @ p["hada_w1_b"]) *
                          (p["hada_w2_a"] @ p["hada_w2_b"]))
    # DoRA with an (out, 1) scale: dora_scale / (|W|_row + eps) * (W + diff), |W| of the base weight
    scale = r(4, 1).abs()
    calc = w + 0.5 * up @ down
    want = calc * scale / (w.norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps)
    got = lora.patched_weight(w, {"lora_up.weight": up, "lora_down.weight": down, "alpha": torch.tensor(1.0),
                                  "dora_scale": scale})
    assert torch.allclose(got, want)


def _pipe():
    """A Wan pipeline around the bare tiny base (no VAE or text encoder: loading an adapter touches the transformer
    only)."""
    from diffusers import WanPipeline

    return WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=_base())


@pytest.mark.parametrize("kind", ["lora", "dora", "lokr", "lokr_lowrank"])
def test_diffusers_file_loads_in_diffusers(kind, tmp_path_factory):
    """The call docs/adapters.md names for each kind's diffusers file: ``pipe.load_lora_weights`` for LoRA and DoRA;
    for LoKr, whose keys (``...to_q.lokr_w1``) diffusers 0.42's pipeline loader refuses (it wants "lora" in every
    key), the transformer's ``load_lora_adapter``, which reads the LoKrConfig from the file's header when told the
    file is safetensors (without ``use_safetensors=True`` it skips the header: alpha = rank, here twice the scale)."""
    _, want, files = trained(kind, tmp_path_factory)
    assert files[1].name == "tiny_diffusers.safetensors"
    pipe = _pipe()
    if kind in ("lora", "dora"):
        pipe.load_lora_weights(str(files[1]), adapter_name="loaded")
    else:
        with pytest.raises(ValueError, match="'lora'"):
            pipe.load_lora_weights(str(files[1]), adapter_name="loaded")
        pipe.transformer.load_lora_adapter(str(files[1]), prefix="transformer", adapter_name="loaded",
                                           use_safetensors=True)
    _assert_same_weights(_effective(pipe.transformer), want)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("which", [0, 1])
def test_load_adapter_loads_each_kinds_files_into_a_pipeline(kind, which, tmp_path_factory):
    """The Wan pipeline's load_adapter (what wanexp-sample calls): every file of every kind, ComfyUI's LoHa included,
    gives the pipeline's transformer the trained weights."""
    from wanexp.models.wan22.pipeline import load_adapter

    _, want, files = trained(kind, tmp_path_factory)
    if which >= len(files):
        pytest.skip("LoHa has one file")
    pipe = _pipe()
    load_adapter(pipe, files[which], "loaded")
    _assert_same_weights(_effective(pipe.transformer), want)


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_recorded_experts_sees_each_kind_on_and_off(kind, tmp_path_factory):
    """A LoKr or LoHa layer has no lora_A: the adapter still counts as on, and as off once disabled."""
    from wanexp.generation import recorded_experts
    from wanexp.models.wan22.pipeline import load_adapter

    files = trained(kind, tmp_path_factory)[2]
    pipe = _pipe()
    load_adapter(pipe, files[-1], "loaded")
    with recorded_experts({"dense": pipe.transformer}) as served:
        _out(pipe.transformer)
        pipe.disable_lora()
        _out(pipe.transformer)
    assert served == [("dense", True), ("dense", False)]


def test_loha_has_no_diffusers_file(tmp_path_factory):
    _, _, files = trained("loha", tmp_path_factory)
    assert [f.name for f in files] == ["tiny_comfyui.safetensors"]  # diffusers' loaders know LoRA and LoKr only


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("which", [0, 1])
def test_init_from_accepts_each_kinds_own_files(kind, which, tmp_path_factory):
    """A run with another alpha (8) starts from the file: the same weights as the trained model."""
    _, want, files = trained(kind, tmp_path_factory)
    if which >= len(files):
        pytest.skip("LoHa has one file")
    t = _base()
    _adapter(kind, alpha=8.0, init_from=str(files[which])).apply(t)
    _assert_same_weights(_effective(t), want)


@pytest.mark.parametrize("file_kind,run_kind,message", [
    ("lokr", "loha", "the file is a LoKr adapter, the run trains LoHa; set adapter=lokr"),
    ("dora", "lora", "the file is a DoRA adapter, the run trains LoRA; set adapter=lora adapter.use_dora=true"),
    ("lora", "lokr", "the file is a LoRA adapter, the run trains LoKr; set adapter=lora"),
    ("loha", "dora", "the file is a LoHa adapter, the run trains DoRA; set adapter=loha"),
])
def test_init_from_another_kind_is_one_line(file_kind, run_kind, message, tmp_path_factory):
    _, _, files = trained(file_kind, tmp_path_factory)
    with pytest.raises(ConfigError) as e:
        _adapter(run_kind, init_from=str(files[0]))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_init_from_of_another_rank_is_one_line(tmp_path_factory):
    _, _, files = trained("loha", tmp_path_factory)
    with pytest.raises(ConfigError, match="file has rank 4, run has rank 8; set adapter.rank=4"):
        lora.LohaAdapter(name="loha", rank=8, alpha=8, dropout=0.0, targets=TARGETS, attention=["self", "cross"],
                         init_from=str(files[0]))


def test_use_dora_on_lokr_is_refused():
    with pytest.raises(ConfigError, match="DoRA is a LoRA variant, adapter=lokr has none; set adapter.use_dora=false"):
        lora.LokrAdapter(name="lokr", rank=4, alpha=4, dropout=0.0, targets=TARGETS, attention=["self"],
                         init_from=None, use_dora=True)


@pytest.mark.parametrize("parallel,model,refused", [
    ({"name": "fsdp", "strategy": {}}, {}, "with parallel=fsdp"),
    ({"name": "deepspeed", "strategy": {"stage": 3}}, {}, "with parallel=deepspeed"),
    ({"name": "deepspeed", "strategy": {"stage": 2}}, {}, None),
    ({"name": "ddp", "strategy": {}}, {"fp8": True}, "with an FP8 base"),
    ({"name": "ddp", "strategy": {}}, {}, None),
])
def test_dora_needs_whole_base_weights(parallel, model, refused):
    from wanexp.config.rules import check_dora

    cfg = OmegaConf.create({"adapter": {"use_dora": True}, "parallel": parallel, "model": model})
    if refused is None:
        check_dora(cfg)
        return
    with pytest.raises(ConfigError, match=refused):
        check_dora(cfg)
    cfg.adapter.use_dora = False
    check_dora(cfg)


def test_files_name_their_adapter_type(tmp_path_factory):
    from safetensors import safe_open

    for kind, label in (("dora", "dora"), ("lokr", "lokr"), ("loha", "loha")):
        for path in trained(kind, tmp_path_factory)[2]:
            with safe_open(str(path), "pt") as f:
                assert f.metadata()["wanexp_adapter"] == label


@pytest.mark.parametrize("kind", ["lokr_lowrank", "loha", "dora"])
def test_init_from_reads_kohya_named_files(kind, tmp_path, tmp_path_factory):
    """musubi-tuner/LyCORIS name modules lora_unet_blocks_0_self_attn_q (the same tensors otherwise)."""
    from safetensors.torch import save_file

    _, want, files = trained(kind, tmp_path_factory)
    sd = load_file(files[0])
    renamed = {}
    for key, w in sd.items():
        module, param = re.match(r"^diffusion_model\.(blocks\.\d+\.(?:self_attn\.|cross_attn\.|ffn\.)\w)\.(.+)$",
                                 key).groups()
        renamed[f"lora_unet_{module.replace('.', '_')}.{param}"] = w
    assert any(k.startswith("lora_unet_blocks_1_ffn_2.") for k in renamed)
    path = tmp_path / "kohya.safetensors"
    save_file(renamed, path)
    t = _base()
    _adapter(kind, alpha=8.0, init_from=str(path)).apply(t)
    _assert_same_weights(_effective(t), want)


def test_init_from_a_dora_scaled_per_input_column_is_one_line(tmp_path, tmp_path_factory):
    """LyCORIS' wd_on_out=false DoRA normalises columns: no peft DoRA reproduces it."""
    from safetensors.torch import save_file

    sd = load_file(trained("dora", tmp_path_factory)[2][0])
    sd = {k: (torch.ones(1, v.shape[0]) if k.endswith(".dora_scale") else v) for k, v in sd.items()}
    save_file(sd, tmp_path / "columns.safetensors")
    with pytest.raises(ConfigError, match="its DoRA scale is per input column .*; use a DoRA file with a per-row"):
        _adapter("dora", init_from=str(tmp_path / "columns.safetensors"))


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_init_from_with_a_and_b_swapped_says_it_looks_transposed(kind, tmp_path, tmp_path_factory):
    """lora_down (A) stored as (out, rank) and lora_up (B) as (rank, in): the ranks read as the modules' output sizes
    (16 and 32 here), which is not what is wrong with the file."""
    from safetensors.torch import save_file

    sd = load_file(trained(kind, tmp_path_factory)[2][0])
    swap = {"lora_down.weight": "lora_up.weight", "lora_up.weight": "lora_down.weight"}
    swapped = {re.sub(r"lora_(down|up)\.weight$", lambda m: swap[m.group(0)], k): v for k, v in sd.items()}
    attn = {k: v for k, v in swapped.items() if "_attn." in k}
    for name, tensors, targets in (("all", swapped, TARGETS), ("attn", attn, ["q", "k", "v", "o"])):
        # attn: square modules only, where every A reads as rank 16 (is still transposed, not "rank 16")
        save_file(tensors, tmp_path / f"{name}.safetensors")
        with pytest.raises(ConfigError) as e:
            lora.LoraAdapter(name=kind, rank=4, alpha=2.0, dropout=0.0, targets=targets, attention=["self", "cross"],
                             init_from=str(tmp_path / f"{name}.safetensors"), use_dora=KINDS[kind][1])
        message = str(e.value)
        assert "looks transposed (lora_A and lora_B swapped" in message and "\n" not in message, message
