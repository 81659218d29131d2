"""The Wan2.2-Animate family's pieces without training (wanexp/models/animate/): what its encoders give the DiT equals
what diffusers' WanAnimatePipeline gives it for the same inputs (animation and replacement), the DiT input and its
loss mask (the reference slot left out), the LoRA's modules (the blocks', not the face adapter's), the data rules
(the one-line refusal of a metadata file without pose/face columns) and the mode."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import compose_cfg
from wanexp.errors import ConfigError

F, H, W = 9, 32, 32


@pytest.fixture(scope="module")
def spec(shared_dir):
    return _spec(shared_dir)


def _spec(shared_dir, *extra):
    from hydra.utils import instantiate

    from wanexp.models.tiny import ensure_tiny_model

    s = instantiate(compose_cfg(["model=tiny_animate", f"paths.tiny_model_dir={shared_dir}", *extra]).model,
                    _convert_="all")
    ensure_tiny_model(s)
    return s


def _frames(n, h, w, seed, binary=False):
    g = np.random.default_rng(seed)
    if binary:
        block = (g.random((n, h // 8, w // 8, 1)) > 0.5).astype(np.uint8) * 255
        return np.repeat(np.repeat(np.repeat(block, 8, 1), 8, 2), 3, 3)
    return g.integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)


def _pixels(frames):
    """uint8 (F, H, W, 3) -> (1, 3, F, H, W) in [-1, 1], as wanexp.data.media decodes a clip."""
    return (torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0)


def _pil(frames):
    from PIL import Image

    return [Image.fromarray(f) for f in frames]


def _pipeline_call(spec, mode, videos, image, prompt_embeds):
    """The keyword arguments WanAnimatePipeline gives the transformer at its first call."""
    from wanexp.models.animate.pipeline import build_animate_pipeline

    transformer = spec.load_transformer("dense")
    pipe = build_animate_pipeline(spec, transformer, spec.load_vae(), spec.load_scheduler())
    seen = {}

    def hook(module, args, kwargs):
        seen.setdefault("call", kwargs)

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        pipe(image=image, prompt_embeds=prompt_embeds, height=H, width=W, segment_frame_length=F,
             num_inference_steps=1, guidance_scale=1.0, mode=mode, generator=torch.Generator().manual_seed(0),
             output_type="latent", **videos)
    finally:
        handle.remove()
    return seen["call"], transformer


@pytest.mark.parametrize("mode", ["animation", "replacement"])
def test_the_encoders_give_the_dit_what_the_diffusers_pipeline_gives_it(shared_dir, mode):
    """One clip, its pose and face videos (and background and mask): the reference latents (mask and latent
    channels of the reference slot and the segment), the pose latents, the face pixels, the CLIP image features and
    the text reach the transformer exactly as WanAnimatePipeline passes them at a segment's first step; only the
    noise differs (the pipeline's own draw against the training x_t)."""
    spec = _spec(shared_dir, f"model.animate_mode={mode}")
    face = spec.face_size()
    clip, pose, face_frames = _frames(F, H, W, 0), _frames(F, H, W, 1), _frames(F, face, face, 2)
    background, mask = _frames(F, H, W, 3), _frames(F, H, W, 4, binary=True)
    encoders = spec.load_encoders()
    batch = {"pixels": _pixels(clip), "pose_video": _pixels(pose), "face_video": _pixels(face_frames),
             "prompt": ["a person dances"]}
    videos = {"pose_video": _pil(pose), "face_video": _pil(face_frames)}
    if mode == "replacement":
        batch.update(background_video=_pixels(background), mask_video=_pixels(mask))
        videos.update(background_video=_pil(background), mask_video=_pil(mask))
    x0, cond = encoders.encode_media(batch)
    text = encoders.encode_prompts(batch["prompt"])
    got, transformer = _pipeline_call(spec, "replace" if mode == "replacement" else "animate", videos,
                                      _pil(clip[:1])[0], text)
    ours = {}

    def hook(module, args, kwargs):
        ours.setdefault("call", kwargs)

    transformer.register_forward_pre_hook(hook, with_kwargs=True)
    sigma = torch.tensor([0.5])
    hidden, timestep, _ = spec.model_inputs(torch.randn_like(x0), x0, sigma, cond)
    spec.transformer_call(transformer, hidden, timestep, text, cond)
    ours = ours["call"]
    assert x0.shape == (1, 16, 1 + (F - 1) // 4 + 1, H // 8, W // 8)
    assert encoders.decode(x0).shape == (1, 3, F, H, W)  # the clip's frames: the reference slot is not decoded
    assert ours["hidden_states"].shape == got["hidden_states"].shape == (1, 36, *x0.shape[2:])
    close = dict(rtol=0, atol=2e-6)
    torch.testing.assert_close(ours["hidden_states"][:, 16:], got["hidden_states"][:, 16:], **close)
    for key in ("pose_hidden_states", "face_pixel_values", "encoder_hidden_states_image", "encoder_hidden_states"):
        assert ours[key].shape == got[key].shape, key
        torch.testing.assert_close(ours[key], got[key], **close, msg=key)
    # the segment's mask: 0 everywhere (animation), 1 - the mask video at the latent size (replacement)
    segment_mask = ours["hidden_states"][0, 16:20, 1:]
    if mode == "animation":
        assert segment_mask.eq(0).all()
    else:
        assert segment_mask.eq(0).any() and segment_mask.eq(1).any()
    assert ours["hidden_states"][0, 16:20, 0].eq(1).all()  # the reference slot: given


def test_the_loss_covers_the_clip_and_not_the_reference_slot(spec):
    x0 = torch.randn(2, 16, 4, 4, 4)
    cond = {"reference_latents": torch.randn(2, 20, 4, 4, 4)}
    hidden, timestep, mask = spec.model_inputs(x0 + 1, x0, torch.tensor([0.25, 0.5]), cond)
    assert torch.equal(hidden, torch.cat([x0 + 1, cond["reference_latents"]], dim=1))
    assert torch.equal(timestep, torch.tensor([250.0, 500.0]))
    assert mask.shape == (2, 1, 4, 1, 1) and not mask[:, :, 0].any() and mask[:, :, 1:].all()


def test_the_lora_trains_the_blocks_attention_and_ffn_and_not_the_face_adapter(spec):
    import re

    naming = spec.adapter_naming
    names = [n for n, m in spec.load_transformer("dense").named_modules() if isinstance(m, torch.nn.Linear)]
    regex = re.compile(naming.target_regex(["q", "k", "v", "o", "ffn.0", "ffn.2"], None))
    targeted = [n for n in names if regex.match(n)]
    assert len(targeted) == 2 * (2 * 4 + 2)  # 2 blocks: self and cross attention's q, k, v, o and the FFN's two
    assert any(n.startswith("face_adapter.") for n in names) and not any("face_adapter" in n for n in targeted)
    assert not any("add_k_proj" in n or "add_v_proj" in n for n in targeted)
    assert naming.to_original("blocks.1.attn2.to_v") == "blocks.1.cross_attn.v"
    assert naming.from_original("blocks.0.ffn.2") == "blocks.0.ffn.net.2"


def test_a_metadata_file_without_pose_or_face_columns_is_refused_in_one_line(tmp_path, spec):
    (tmp_path / "m.csv").write_text("video,prompt\na.mp4,one\nb.mp4,two\n")
    data = {"metadata": str(tmp_path / "m.csv"), "root": None, "window": "first", "frame_stride": 1}
    with pytest.raises(ConfigError) as e:
        type(spec).check_groups(data, None)
    line = str(e.value)
    assert "\n" not in line and "pose_video and face_video" in line and "wan/modules/animate/preprocess" in line
    # a file where some rows have them: each row without is a reject of its own, with its reason
    (tmp_path / "m.csv").write_text("video,prompt,pose_video,face_video\na.mp4,one,p.mp4,f.mp4\nb.mp4,two,,\n")
    type(spec).check_groups(data, None)
    from wanexp.data.metadata import read_metadata_with_rejects

    samples, rejects = read_metadata_with_rejects(tmp_path / "m.csv", inputs=tuple(spec.sample_inputs))
    assert len(samples) == 1 and rejects[0].reason.startswith("no pose_video")


def test_the_mode_picks_the_sample_inputs(shared_dir):
    assert list(_spec(shared_dir).sample_inputs) == ["pose_video", "face_video"]
    replace = _spec(shared_dir, "model.animate_mode=replacement")
    assert list(replace.sample_inputs) == ["pose_video", "face_video", "background_video", "mask_video"]
    with pytest.raises(ConfigError, match="model.animate_mode=dance: allowed values are animation, replacement"):
        _spec_of(shared_dir, "model=tiny_animate", "model.animate_mode=dance")
    with pytest.raises(ConfigError, match="model.animate_mode=animation: model=tiny has no modes"):
        _spec_of(shared_dir, "model=tiny", "model.animate_mode=animation")


def _spec_of(shared_dir, *overrides):
    from wanexp.composition import build
    from wanexp.config import check_schema

    cfg = compose_cfg([*overrides, f"paths.tiny_model_dir={shared_dir}"])
    check_schema(cfg)
    return build(cfg.model)


def test_a_control_file_that_cannot_be_read_is_a_reject_reason(tmp_path, spec):
    assert spec.check_sample_input("pose_video", str(tmp_path / "none.mp4")) == \
        f"pose_video: {tmp_path / 'none.mp4'}: file not found"
    (tmp_path / "bad.mp4").write_bytes(b"not a video")
    assert spec.check_sample_input("face_video", str(tmp_path / "bad.mp4")).startswith(
        f"face_video: {tmp_path / 'bad.mp4'}: cannot read the video")


def test_an_animate_folder_is_sampled_as_animate14b_not_as_i2v14b(spec):
    """Its DiT has I2V-A14B's channels (36 in, 16 out): wanexp-sample --model-path tells them apart by its class."""
    from wanexp.cli import sample

    assert sample._folder_model(spec.path).name == "animate14b"


def test_the_memory_formula_counts_the_released_dits_weights():
    """The planner's weight estimate of the released Animate DiT (built on the meta device: 17.3 B parameters, the
    face adapter's 0.84 B and the added image key/value projections included) is its bf16 size within 0.1 %."""
    from diffusers import WanAnimateTransformer3DModel

    from wanexp.models.animate.build import REAL_TRANSFORMER, transformer_config
    from wanexp.models.animate.memory import AnimateMemory
    from wanexp.models.animate.spec import AnimateSpec

    with torch.device("meta"):
        dit = WanAnimateTransformer3DModel(**transformer_config(AnimateSpec, REAL_TRANSFORMER, 1280))
    actual = sum(p.numel() for p in dit.parameters()) * 2 / 2**30
    assert AnimateMemory().weights_gib(dict(dit.config), 2, 2, 40) == pytest.approx(actual, rel=1e-3)
    blocks = sum(p.numel() for p in dit.blocks.parameters()) * 2 / 2**30
    assert AnimateMemory().weights_gib(dict(dit.config), 2, 2, 0) == pytest.approx(actual - blocks, rel=1e-2)


def test_the_planner_counts_the_dits_tokens_with_the_reference_slot(spec):
    """The memory planner's token count for a clip of F frames is the DiT input's: the reference slot's latent frame
    and the clip's (F - 1) / 4 + 1, as the encoders build it."""
    from wanexp.memory_plan import _tokens

    face = spec.face_size()
    batch = {"pixels": _pixels(_frames(F, H, W, 0)), "pose_video": _pixels(_frames(F, H, W, 1)),
             "face_video": _pixels(_frames(F, face, face, 2)), "prompt": ["a person dances"]}
    x0, _ = spec.load_encoders().encode_media(batch)
    pt, ph, pw = spec.patch
    dit_tokens = x0.shape[2] // pt * (x0.shape[3] // ph) * (x0.shape[4] // pw)
    data = compose_cfg(["model=tiny_animate", "data=synthetic", f"data.num_frames={F}", f"data.height={H}",
                        f"data.width={W}", "data.batch_size=1"]).data
    assert _tokens(data, spec, 1) == dit_tokens


def _released_cfg(folder, frames: int, *overrides):
    """model=animate14b over a folder holding the released DiT's config.json alone (all the memory plan reads), at
    480 x 832 x ``frames``, batch 1, every block checkpointed."""
    import json

    from wanexp.config import compose
    from wanexp.models.animate.build import REAL_TRANSFORMER, transformer_config
    from wanexp.models.animate.spec import AnimateSpec

    (folder / "transformer").mkdir()
    config = {"_class_name": "WanAnimateTransformer3DModel", **transformer_config(AnimateSpec, REAL_TRANSFORMER, 1280)}
    (folder / "transformer" / "config.json").write_text(json.dumps(config))
    return compose(["model=animate14b", f"model.path={folder}", "data=synthetic", "data.generate=null",
                    "data.height=480", "data.width=832", f"data.num_frames={frames}", "data.batch_size=1",
                    "model.gradient_checkpointing=true", *overrides])


# The real-size Animate DiT's peak GPU memory, LoRA r32 with every block and face adapter checkpointed, from the GPU
# case animate_14b (benchmarks/animate14b_h200_2026-11-29/animate_14b.json): (frames, blocks swapped, peak GiB)
MEASURED_PEAKS = ((41, 37, 24.997), (77, 0, 63.844))


@pytest.mark.parametrize("frames,swapped,peak", MEASURED_PEAKS)
def test_the_planners_estimate_is_the_measured_peak(tmp_path, frames, swapped, peak):
    """The planner's estimate (weights at the swapped block count, the checkpointed blocks' and face adapter's kept
    inputs, one block's recompute, the LoRA's training state) of the released DiT at 480x832 is the peak the GPU case
    measured within 3 % (the tokens without the reference slot or the face adapter's inputs left out: 7-12 % under)."""
    from wanexp.composition import build
    from wanexp.memory_plan import FitEstimate

    cfg = _released_cfg(tmp_path, frames, "trainer.precision=bf16-mixed", "adapter.rank=32")
    assert FitEstimate(cfg, build(cfg.model), None).need(swapped) == pytest.approx(peak, rel=0.03)


def test_the_original_release_folder_is_refused_in_one_line_naming_the_diffusers_download(tmp_path):
    """A model.path holding Wan's own Animate layout (its CLIP as a .pth, the relighting LoRA, no model_index.json)
    is one line naming the diffusers download to use; another folder without model_index.json keeps the generic
    line."""
    from wanexp.composition import build
    from wanexp.config import compose

    for name in ("config.json", "Wan2.1_VAE.pth", "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth",
                 "relighting_lora.ckpt"):
        (tmp_path / "release" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "release" / name).write_text("{}")
    (tmp_path / "other").mkdir()
    for folder, expected in (("release", "Wan-AI/Wan2.2-Animate-14B-Diffusers"), ("other", "not a diffusers")):
        spec = build(compose(["model=animate14b", f"model.path={tmp_path / folder}"]).model)
        with pytest.raises(ConfigError) as err:
            spec.check_folder(["dense"])
        assert expected in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("files,expected", [
    (("Wan2.1_VAE.pth", "models_t5_umt5-xxl-enc-bf16.pth", "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"),
     "download Wan-AI/Wan2.2-Animate-14B-Diffusers"),
    (("Wan2.2_VAE.pth", "models_t5_umt5-xxl-enc-bf16.pth"), "python -m wanexp.cli.convert"),
    ((), "none of the model groups'"),
], ids=["animate-release", "wan-release", "unknown"])
def test_wanexp_sample_gives_a_release_in_its_own_layout_its_familys_advice(tmp_path, files, expected):
    """wanexp-sample --model-path on a folder without model_index.json: the Animate release names the diffusers
    download, a Wan-AI release the conversion command, anything else the generic line; one line each."""
    from wanexp.cli import sample

    for name in files:
        (tmp_path / name).write_text("")
    with pytest.raises(ConfigError) as err:
        sample._folder_model(tmp_path)
    assert expected in str(err.value) and "\n" not in str(err.value) and "model.path" not in str(err.value)


@pytest.mark.parametrize("model", ["tiny_animate", "tiny_vace"])
def test_sequence_parallel_is_refused_by_the_rules_for_a_family_without_it(model):
    """parallel.sp_size=2 with a family that does not split its tokens (Animate: diffusers' forward; VACE: its control
    hints) is one line from the rules, before anything is built."""
    from wanexp.config.rules import check_rules

    sp = ["parallel=ddp", "parallel.sp_size=2", "trainer.devices=2", "trainer.accelerator=cpu"]
    with pytest.raises(ConfigError, match=f"parallel.sp_size=2: model={model} has no sequence parallel"):
        check_rules(compose_cfg([f"model={model}", *sp]))


@pytest.mark.parametrize("overrides,expected", [
    (["model.fast_modulation=true"], "model.fast_modulation=true: model=tiny_animate's DiT runs diffusers' forward"),
    (["model.offload_activations=true", "model.gradient_checkpointing=true"],
     "needs wanexp's transformer forward, which model=tiny_animate does not have"),
], ids=["fast_modulation", "offload_activations"])
def test_the_settings_of_wanexps_forward_are_refused_for_animate(shared_dir, overrides, expected):
    """Animate's DiT runs diffusers' forward: the settings that hook into wanexp's are one line each, never ignored."""
    from wanexp.composition import build

    with pytest.raises(ConfigError, match=expected):
        build(compose_cfg(["model=tiny_animate", f"paths.tiny_model_dir={shared_dir}", *overrides]).model)


def test_the_planners_refusal_suggests_only_what_animate_can_use(tmp_path, monkeypatch):
    """A run that does not fit even with every block swapped: the refusal names fewer frames, not offloaded activations
    or sequence parallel, which Animate does not have."""
    import wanexp.memory_plan as plan
    from wanexp.composition import build

    cfg = _released_cfg(tmp_path, 77, "trainer.precision=bf16-mixed", "model.blocks_to_swap=auto")
    monkeypatch.setattr(plan, "usable_gib", lambda cfg: 31.0)  # a 32 GB card
    with pytest.raises(ConfigError) as err:
        plan.resolve_blocks_to_swap(cfg, build(cfg.model), verbose=False)
    line = str(err.value)
    assert "fewer frames" in line and "offload_activations" not in line and "sp_size" not in line


@pytest.mark.parametrize("hw", ["v100_32g", "h100_80g"])
def test_the_hw_presets_size_animates_block_swap(tmp_path, hw):
    """A card preset (model.memory_budget_gib, blocks_to_swap=auto) composes with Animate, every block checkpointed:
    the budget sizes the swap. The 32 GB card's preset plans 480x832x41 for all of its 28 GiB (33 blocks swapped;
    the capped GPU case, planning for 90 % of a 28 GiB GPU without a budget, swapped 37); the 80 GB card's swaps
    none."""
    from wanexp.composition import build
    from wanexp.memory_plan import resolve_blocks_to_swap

    cfg = _released_cfg(tmp_path, 41, f"hw={hw}")
    n = resolve_blocks_to_swap(cfg, build(cfg.model), verbose=False)
    assert n == {"v100_32g": 33, "h100_80g": 0}[hw]


@pytest.mark.parametrize("model,expected", [("tiny_animate", True), ("tiny_s2v", True), ("tiny", False)])
def test_a_compile_the_family_does_not_apply_is_said_at_start(model, expected):
    """model.compile=true (the hw presets set it) on a family that does not compile its blocks (Animate, S2V) gives
    one start line saying so, never a silent no-op; Wan2.2's compiles and says nothing."""
    from wanexp.composition import build, compile_notice

    spec = build(compose_cfg([f"model={model}", "model.path=/m", "model.compile=true"]).model)
    line = compile_notice(spec)
    assert (line is not None) == expected
    if expected:
        assert f"model={model}'s blocks run uncompiled" in line and "\n" not in line
