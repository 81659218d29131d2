"""The S2V family's pieces without training (wanexp/models/s2v/spec.py, encoders.py, adapter_naming.py): the audio
input's columns and fallbacks, audio dropout, the DiT input (the generated frames only), the adapter names of the
audio cross-attention, the family's data rules, and loading the release's own VAE/UMT5 .pth files."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import compose_cfg
from wanexp.data.metadata import read_metadata_with_rejects
from wanexp.errors import ConfigError


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    from hydra.utils import instantiate

    from wanexp.models.tiny import ensure_tiny_model

    root = tmp_path_factory.mktemp("s2v")
    s = instantiate(compose_cfg(["model=tiny_s2v", f"paths.tiny_model_dir={root}"]).model, _convert_="all")
    ensure_tiny_model(s)
    return s


def test_audio_comes_from_its_column_else_the_clip_itself(tmp_path, spec):
    (tmp_path / "m.csv").write_text("video,prompt,audio_path\na.mp4,one,a.wav\nb.mp4,two,\n")
    samples, rejects = read_metadata_with_rejects(tmp_path / "m.csv", inputs=tuple(spec.sample_inputs),
                                                  fallbacks=spec.sample_input_fallbacks)
    assert not rejects
    assert [s.inputs for s in samples] == [(("audio", str(tmp_path / "a.wav")),), (("audio", str(tmp_path / "b.mp4")),)]
    # a family without fallbacks still rejects the row
    _, rejects = read_metadata_with_rejects(tmp_path / "m.csv", inputs=("audio",))
    assert [r.reason.split(" (")[0] for r in rejects] == ["no audio", "no audio"]


def test_audio_dropout_zeroes_the_features_of_its_share_of_samples(spec):
    audio = torch.rand(64, 3, 32, 8) + 0.1
    cond = {"audio": audio, "ref_latents": torch.ones(64, 16, 1, 4, 4)}
    out = spec.sample_condition(cond, 64, torch.Generator().manual_seed(0))
    zeroed = out["audio"].flatten(1).eq(0).all(1)
    kept = out["audio"].flatten(1).eq(audio.flatten(1)).all(1)
    assert torch.equal(zeroed | kept, torch.ones(64, dtype=torch.bool)) and 1 <= zeroed.sum() <= 16  # p = 0.1
    assert torch.equal(zeroed, torch.rand(64, generator=torch.Generator().manual_seed(0)) < 0.1)
    assert out["ref_latents"] is cond["ref_latents"]
    spec.audio_dropout, before = 0.0, spec.audio_dropout
    try:
        assert spec.sample_condition(cond, 64, torch.Generator().manual_seed(0)) is cond
    finally:
        spec.audio_dropout = before


def test_x0_is_the_generated_frames_and_the_reference_is_frame_0(spec):
    """A clip of 9 frames: the reference frame and 8 generated frames through the VAE once; latent 0 is the
    reference (the first frame alone), latents 1-2 the clip's x0, and the DiT's velocity covers exactly them (no
    mask). The audio features are the generated frames' (frame 0's dropped)."""
    from wanexp.models.s2v.audio_encoder import audio_features

    from wanexp.models.wan22.encoders import encode_video

    encoders = spec.load_encoders()
    pixels = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    x0, cond = encoders.encode_media({"pixels": pixels})
    assert x0.shape == (1, 16, 2, 4, 4) and sorted(cond) == ["ref_latents"]
    torch.testing.assert_close(cond["ref_latents"], encode_video(encoders.vae, pixels[:, :, :1]), rtol=0, atol=1e-5)
    torch.testing.assert_close(x0, encode_video(encoders.vae, pixels)[:, :, 1:], rtol=0, atol=0)
    samples = torch.sin(torch.arange(9000) / 7.0)
    audio = encoders.encode_audio(samples[None], 9)
    every = audio_features(encoders.audio_encoder, samples.numpy(), 16000, 16, 9)
    assert audio.shape == (1, 3, 32, 8) and torch.equal(audio[0], every[..., 1:])
    sigma = torch.tensor([0.5])
    hidden, timestep, mask = spec.model_inputs(x0, x0, sigma, cond)
    assert hidden is x0 and mask is None and torch.equal(timestep, torch.tensor([500.0]))
    transformer = spec.load_transformer("dense")
    cond["audio"] = torch.rand(1, 3, 32, 8)
    v = spec.transformer_call(transformer, hidden, timestep, torch.rand(1, 64, 32), cond)
    assert v.shape == x0.shape


def test_the_audio_cross_attention_has_the_original_injector_names():
    from wanexp.models.s2v.adapter_naming import S2V_NAMING as naming

    assert naming.to_original("blocks.4.audio_injector.attn.to_out.0") == "audio_injector.injector.1.o"
    assert naming.from_original("audio_injector.injector.1.o") == "blocks.4.audio_injector.attn.to_out.0"
    assert naming.to_original("blocks.39.audio_injector.attn.to_k") == "audio_injector.injector.11.k"
    assert naming.to_original("blocks.3.attn2.to_v") == "blocks.3.cross_attn.v"
    assert naming.from_original("blocks.3.ffn.0") == "blocks.3.ffn.net.0.proj"
    with pytest.raises(ValueError):
        naming.from_original("audio_injector.injector.12.q")  # the released model has 12 injectors
    assert naming.configured_kinds(["q", "o"], ["audio"]) == ["audio_injector.q", "audio_injector.o"]


@pytest.mark.parametrize("override, message", [
    ("data.frame_stride=2", "data.frame_stride=2: S2V clips keep every frame"),
])
def test_data_settings_that_would_misalign_the_audio_are_refused(override, message):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from wanexp.models.family import load_class

    cfg = compose_cfg(["model=tiny_s2v", override])
    with pytest.raises(ConfigError, match=message):
        load_class(cfg.model._target_).check_groups(OmegaConf.to_container(cfg.data, resolve=True), None)
    instantiate(compose_cfg(["model=tiny_s2v"]).model, _convert_="all")


def test_audio_dropout_on_a_family_without_audio_is_one_line():
    from wanexp.composition import build

    with pytest.raises(ConfigError, match="model.audio_dropout=0.1: model=tiny has no audio input"):
        build(compose_cfg(["model=tiny", "model.audio_dropout=0.1"]).model)


def test_the_release_vae_and_umt5_pth_files_load_as_their_converted_folders(spec, tmp_path):
    """The release ships Wan2.1_VAE.pth and the UMT5 .pth (original names): written from the tiny build's folders
    with the original-layout tests' inverse names, they load to the same tensors."""
    import shutil

    from tests.unit.test_original_layout import t5_to_original, vae_to_original
    from wanexp.models.wan22.original import T5_FILE

    release = tmp_path / "release"
    shutil.copytree(spec.path, release)
    vae, te = spec.load_vae(), spec.load_text_encoder()
    torch.save(vae_to_original(vae.state_dict(), False, vae.config.num_res_blocks), release / "Wan2.1_VAE.pth")
    torch.save(t5_to_original(te.state_dict()), release / T5_FILE)
    shutil.rmtree(release / "vae")
    shutil.rmtree(release / "text_encoder")
    other = type(spec)(**{**_args(spec), "path": str(release)})
    other.check_folder(["dense"])
    for a, b in ((vae, other.load_vae()), (te, other.load_text_encoder())):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert other.encoder_info().cond_id["vae_file"][0] == str(release / "Wan2.1_VAE.pth")
    (release / "Wan2.1_VAE.pth").unlink()
    with pytest.raises(ConfigError, match=r"no Wan2.1_VAE.pth \(the VAE\)"):
        other.check_folder(["dense"])


def _args(spec) -> dict:
    from omegaconf import OmegaConf

    cfg = compose_cfg(["model=tiny_s2v", f"paths.tiny_model_dir={spec.path.parent}"]).model
    return {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k != "_target_"}


def test_sequence_parallel_is_the_families_own_forward_not_fast_modulation():
    """S2V's forward is wanexp's own (its fast_modulation is false): parallel.sp_size passes the rules; Wan2.2's
    diffusers forward (fast_modulation=false) is refused in one line."""
    from wanexp.config.rules import check_rules

    sp = ["parallel=ddp", "parallel.sp_size=2", "trainer.devices=2", "trainer.accelerator=cpu"]
    check_rules(compose_cfg(["model=tiny_s2v", *sp]))
    with pytest.raises(ConfigError, match="needs wanexp's transformer forward"):
        check_rules(compose_cfg(["model=tiny", "model.fast_modulation=false", *sp]))


def test_the_memory_formula_counts_the_real_size_dit():
    """The planner's weights for the released 14B config (every block resident) are the meta-built DiT's parameters
    within 1 %, audio cross-attention included; every block swapped leaves the two in flight and the rest."""
    from wanexp.models.s2v import build
    from wanexp.models.s2v.memory import S2VMemory
    from wanexp.models.s2v.transformer import WanS2VTransformer

    config = build.real_config()
    with torch.device("meta"):
        model = WanS2VTransformer(**config)
    real = sum(p.numel() for p in model.parameters()) * 2 / 2**30
    f = S2VMemory()
    assert f.weights_gib(config, 2, 2, 40) == pytest.approx(real, rel=0.01)
    blocks = sum(p.numel() for p in model.blocks.parameters()) * 2 / 2**30
    assert f.weights_gib(config, 2, 2, 2) == pytest.approx(real - blocks * 38 / 40, rel=0.01)
    assert f.activations_gib(config, 32760, True, True, True) < f.activations_gib(config, 32760, True, False, True)
