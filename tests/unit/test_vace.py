"""VACE control (model=tiny_vace, wanexp/models/wan22/vace.py) against the references: the 96 control channels a
training sample gets are what diffusers' WanVACEPipeline builds for the same video, mask and reference image; wanexp's
forward of a VACE expert is diffusers'; the adapter naming reaches the base and the control blocks under ComfyUI's and
peft's names; bad control inputs are rejected with their reason."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import compose_cfg
from wanexp.composition import build
from wanexp.errors import ConfigError
from wanexp.models.tiny import ensure_tiny_model
from wanexp.models.wan22 import vace

F, H, W = 9, 32, 48  # 3 latent frames of 4 x 6


@pytest.fixture(scope="module")
def spec(shared_dir):
    s = build(compose_cfg(["model=tiny_vace", f"paths.tiny_model_dir={shared_dir}/models"]).model)
    ensure_tiny_model(s)
    return s


@pytest.fixture(scope="module")
def pipe(spec):
    return spec.make_pipeline({"high": spec.load_transformer("high"), "low": spec.load_transformer("low")},
                              spec.load_vae(), spec.load_scheduler(), image=False).pipe


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    video = torch.rand(1, 3, F, H, W, generator=g) * 2 - 1
    mask = (torch.rand(1, 1, F, H, W, generator=g) > 0.5).float().expand(-1, 3, -1, -1, -1)
    return video, mask, torch.rand(3, H, W, generator=g) * 2 - 1


@pytest.mark.parametrize("reference", [False, True])
def test_control_channels_are_wan_vace_pipelines(spec, pipe, reference):
    """video * (1 - mask) and video * mask latents (16 + 16), the mask folded 8x8 (64), a reference's latent frame
    first: the pipeline's prepare_video_latents + prepare_masks, on the same pixels and VAE."""
    video, mask, ref = _inputs(0)
    refs = [[ref]] if reference else [[]]
    expected = torch.cat([pipe.prepare_video_latents(video, mask, refs, None, torch.device("cpu")),
                          pipe.prepare_masks(mask, refs, None)], dim=1)
    ours = vace.control_channels(pipe.vae, video, mask, spec.vae_stride, ref[None] if reference else None)
    assert ours.shape == (1, 96, 3 + reference, H // 8, W // 8) == expected.shape
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    other = vace.control_channels(pipe.vae, video, 1 - mask, spec.vae_stride, ref[None] if reference else None)
    assert (other - expected).abs().max() > 0.5  # the mask matters (its folded channels flip)


def test_the_encoders_build_the_control_and_prepend_the_reference(spec, pipe):
    """A batch's cond holds the control channels; a row's reference adds its latent as x0's first frame; the mask
    read from the control video's own file (a row without control_mask) means none; rows with and without a
    reference in one batch are one line."""
    from wanexp.models.wan22.encoders import encode_video

    enc = vace.VaceEncoders(pipe.vae, None, None, 64, spec.vae_stride)
    video, mask, ref = _inputs(1)
    pixels = _inputs(2)[0]
    ref4 = torch.cat([ref, torch.ones(1, H, W)])[None]
    x0, cond = enc.encode_media({"pixels": pixels, "control_video": video, "control_mask": mask * 2 - 1,
                                 "reference_image": ref4})
    torch.testing.assert_close(x0[:, :, 1:], encode_video(pipe.vae, pixels), rtol=0, atol=0)
    torch.testing.assert_close(x0[:, :, :1], encode_video(pipe.vae, ref[None, :, None]), rtol=0, atol=0)
    torch.testing.assert_close(cond["vace_context"],
                               vace.control_channels(pipe.vae, video, mask, spec.vae_stride, ref[None]), rtol=0, atol=0)
    _, own = enc.encode_media({"pixels": pixels, "control_video": video, "control_mask": video.clone(),
                               "reference_image": torch.zeros_like(ref4)})
    torch.testing.assert_close(own["vace_context"], vace.control_channels(pipe.vae, video, torch.ones_like(video),
                                                                          spec.vae_stride), rtol=0, atol=0)
    two = torch.cat([ref4, torch.zeros_like(ref4)])
    with pytest.raises(ConfigError, match="mixes rows with and without a reference_image"):
        enc.encode_media({"pixels": pixels.expand(2, -1, -1, -1, -1), "control_video": video.expand(2, -1, -1, -1, -1),
                          "reference_image": two})


def test_wanexp_forward_of_a_vace_expert_is_diffusers(spec):
    """The per-frame-modulation forward with its control branch (each control block run just before its hint is
    added) equals diffusers' WanVACETransformer3DModel.forward, and so do its gradients, checkpointed and with the
    control tokens offloaded (model.offload_activations)."""
    t = spec.load_transformer("high")
    g = torch.Generator().manual_seed(0)
    x, c, text = torch.randn(2, 16, 3, 4, 6, generator=g), torch.randn(2, 96, 3, 4, 6, generator=g), \
        torch.randn(2, 64, 32, generator=g)
    ts = torch.tensor([900.0, 300.0])
    scale = torch.tensor([1.0, 0.5])
    assert t.forward.__func__.__name__ == "transformer_forward"
    t.enable_gradient_checkpointing()  # the checkpoint function; run() switches it on and off
    watched = [t.vace_blocks[0].proj_in.weight, t.vace_blocks[1].proj_out.weight, t.vace_blocks[1].attn1.to_q.weight,
               t.blocks[3].ffn.net[2].weight, t.vace_patch_embedding.weight]

    def run(forward, checkpointing: bool, offload: bool):
        t.gradient_checkpointing, t._wanexp_offload_activations = checkpointing, offload
        for p in watched:
            p.requires_grad_(True)
            p.grad = None
        out = forward(hidden_states=x, timestep=ts, encoder_hidden_states=text, control_hidden_states=c,
                      control_hidden_states_scale=scale, return_dict=False)[0]
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in watched]

    stock, stock_grads = run(lambda **kw: type(t).forward(t, **kw), False, False)
    for checkpointing, offload in ((False, False), (True, False), (True, True)):
        out, grads = run(t, checkpointing, offload)
        torch.testing.assert_close(out, stock, rtol=0, atol=0)
        for got, want in zip(grads, stock_grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert all(float(g.abs().sum()) > 0 for g in stock_grads)


def test_adapter_targets_reach_the_base_and_the_control_blocks(spec):
    """q..ffn.2 select the base blocks' modules (the default), vace.q..vace.ffn.2 the control blocks' (DiffSynth's
    --lora_base_model vace); names map to ComfyUI's diffusion_model.(vace_)blocks.N and back, kohya's too."""
    import re

    naming = spec.adapter_naming
    default = re.compile(naming.target_regex(["q", "k", "v", "o", "ffn.0", "ffn.2"], None))
    control = re.compile(naming.target_regex(["vace.q", "vace.ffn.2"], ["self"]))
    names = [n for n, m in spec.load_transformer("high").named_modules() if isinstance(m, torch.nn.Linear)]
    picked = [n for n in names if default.fullmatch(n)]
    assert len(picked) == 4 * 10 and all(n.startswith("blocks.") for n in picked)
    assert sorted(n for n in names if control.fullmatch(n)) == [
        "vace_blocks.0.attn1.to_q", "vace_blocks.0.ffn.net.2", "vace_blocks.1.attn1.to_q", "vace_blocks.1.ffn.net.2"]
    assert naming.to_original("vace_blocks.1.attn2.to_out.0") == "vace_blocks.1.cross_attn.o"
    assert naming.from_original("vace_blocks.1.cross_attn.o") == "vace_blocks.1.attn2.to_out.0"
    assert naming.to_original("blocks.3.ffn.net.0.proj") == "blocks.3.ffn.0"
    assert naming.kohya_to_comfy("lora_unet_vace_blocks_0_self_attn_q.lora_down.weight") == \
        "diffusion_model.vace_blocks.0.self_attn.q.lora_down.weight"
    assert naming.kind("vace_blocks.0.ffn.net.2") == "vace.ffn.2" and naming.kind("vace_blocks.0.proj_out") is None
    assert naming.setting_for({"self_attn.q", "vace.self_attn.q"}) == \
        "set adapter.targets=[q,vace.q] adapter.attention=[self]"
    with pytest.raises(ConfigError, match="unknown target 'vace.x'; allowed: q, k, v, o, ffn.0, ffn.2, vace.q"):
        naming.target_regex(["vace.x"], None)


def test_bad_control_inputs_have_a_reason(spec, tmp_path):
    from wanexp.data.media import write_video

    write_video(tmp_path / "k.mp4", np.zeros((5, 16, 16, 3), dtype=np.uint8), 16)
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(tmp_path / "r.png")
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    check = spec.check_sample_input
    assert check("control_video", str(tmp_path / "k.mp4")) is None
    assert check("control_video", str(tmp_path / "r.png")).startswith(f"control_video {tmp_path / 'r.png'}: not a "
                                                                      "video file (one of .avi")
    gone = tmp_path / "gone.mp4"
    assert check("control_video", str(gone)) == f"control_video {gone}: file not found"
    assert check("control_video", str(tmp_path / "broken.mp4")).startswith(f"control_video {tmp_path / 'broken.mp4'}: ")
    assert check("control_mask", str(tmp_path / "r.png")) is None
    assert check("control_mask", str(tmp_path / "k.mp4")) is None
    assert check("control_mask", str(tmp_path / "m.txt")).startswith("control_mask ")
    assert check("reference_image", str(tmp_path / "k.mp4")) is None  # the control video's path: no reference
    assert check("reference_image", str(tmp_path / "x.png")) == f"reference_image {tmp_path / 'x.png'}: file not found"
    # a reference image read at the clip's size, flagged given; the control video's path in its place: zeros
    ref = spec.load_sample_input("reference_image", str(tmp_path / "r.png"), 9, 16, size=(16, 24))
    assert ref.shape == (4, 16, 24) and float(ref[3].min()) == 1.0
    none = spec.load_sample_input("reference_image", str(tmp_path / "k.mp4"), 5, 16, size=(16, 24))
    assert float(none.abs().max()) == 0
    # an image mask holds for every frame
    assert spec.load_sample_input("control_mask", str(tmp_path / "r.png"), 5, 16, size=(16, 24)).shape == (3, 5, 16, 24)


def test_cached_latents_of_other_models_are_never_vaces(spec, shared_dir):
    """The cache keys' cond id sets VACE latents (their control channels) apart from T2V-A14B's on the same VAE."""
    t2v = build(compose_cfg(["model=tiny_t2v14b", f"paths.tiny_model_dir={shared_dir}/models"]).model)
    assert spec.encoder_info().cond_id == "vace_control" != t2v.encoder_info().cond_id
    assert spec.encoder_info().sample_inputs == ("control_video", "control_mask", "reference_image")


def test_the_memory_formula_counts_the_control_blocks(spec):
    """VaceMemory's weights at real size: the parameters of a WanVACETransformer3DModel built on the meta device
    (bf16), within 1 % (the formula leaves out norms and biases)."""
    from diffusers import WanVACETransformer3DModel

    cfg = dict(WanVACETransformer3DModel.load_config(str(spec.path / "transformer")),
               num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40, text_dim=4096,
               freq_dim=256, vace_layers=[0, 5, 10, 15, 20, 25, 30, 35])
    with torch.device("meta"):
        model = WanVACETransformer3DModel.from_config(cfg)
    params = sum(p.numel() for p in model.parameters()) * 2 / 2**30
    formula = spec.memory_formula()
    assert formula.block_count(cfg) == 40
    estimate = formula.weights_gib(cfg, 2, 2, 40)
    assert abs(estimate - params) / params < 0.01, (estimate, params)
    assert formula.weights_gib(cfg, 2, 2, 0) > 8 * (estimate - formula.weights_gib(cfg, 2, 2, 40 - 1)) - 1e-6
    # activations at 480x832x81: every checkpointed control block keeps its control tokens (one bf16 token stream
    # each), in host memory when offloaded (one on its way); T2V-A14B's formula for the rest
    from wanexp.models.wan22.memory import WanMemory

    stream = 32760 * 5120 * 2 / 2**30
    kept = formula.activations_gib(cfg, 32760, True, False, False) - WanMemory().activations_gib(cfg, 32760, True,
                                                                                               False, False)
    offloaded = formula.activations_gib(cfg, 32760, True, True, False) - WanMemory().activations_gib(cfg, 32760,
                                                                                                    True, True, False)
    assert kept == pytest.approx(10 * stream) and offloaded == pytest.approx(3 * stream)


def test_a_build_writes_the_experts_it_names(shared_dir, tmp_path):
    """model.build.experts: a real-size GPU case writes the one expert it trains (a VACE expert is ~35 GB)."""
    from omegaconf import open_dict

    cfg = compose_cfg(["model=tiny_vace", f"paths.tiny_model_dir={tmp_path}"])
    with open_dict(cfg):
        cfg.model.build.experts = ["high"]
    folder = ensure_tiny_model(build(cfg.model))
    assert (folder / "transformer" / "config.json").is_file() and not (folder / "transformer_2").exists()
