"""wanexp.cli.sample: a distilled tiny LoRA samples in its 4 training steps through the diffusers pipeline, with the
same video for the same seed, on the experts its training used."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import av
import pytest
import torch

from tests.conftest import ROOT, compose_cfg
from tests.integration.conftest import tiny_run
from wanexp import generation
from wanexp.cli import sample
from wanexp.objectives.dmd import DMD


@pytest.fixture(scope="module")
def dmd_tiny(shared_dir, tmp_path_factory):
    """A tiny (TI2V-5B layout) DMD run, shared by the tests of this file."""
    return tiny_run(shared_dir, tmp_path_factory.mktemp("dmd") / "run",
                    ["objective=dmd", "objective.generator_every=1", "trainer.max_steps=2"])


def test_a_distilled_lora_samples_on_its_training_steps_and_is_compared_with_the_teacher(dmd_tiny):
    r = dmd_tiny
    objective: DMD = r["module"].objective
    res = sample.main(["--run", r["output_dir"], "--prompt", "a red ball rolls", "--seed", "3", "--teacher",
                       "--teacher-steps", "3", "--teacher-guidance", "2.0", "--device", "cpu"])
    assert res["distilled"] and res["steps"] == 4 and res["guidance"] == 1.0
    (entry,) = res["samples"]
    # the transformer saw exactly the training's student steps (t = 1000 * shifted sigma), no CFG pass
    assert entry["timesteps"] == pytest.approx([1000 * s for s in objective.student_sigmas], rel=1e-5)
    for f in (entry["file"], entry["teacher_file"]):
        with av.open(f) as c:
            frames = [fr for fr in c.decode(video=0)]
        assert len(frames) == r["cfg"].data.num_frames
    assert entry["latent_mse"] > 0 and 0 < entry["ssim"] <= 1 and entry["psnr"] > 0
    saved = json.loads((Path(r["output_dir"]) / "samples" / "metrics.json").read_text())
    assert saved["samples"][0]["timesteps"] == entry["timesteps"]


def test_the_same_seed_gives_the_same_distilled_video(dmd_tiny, tmp_path):
    """The student's re-noising between steps draws from the seed's generator, not from the global one."""
    def latents(seeds: list[int], out: str) -> list[torch.Tensor]:
        res = sample.main(["--run", dmd_tiny["output_dir"], "--prompt", "a red ball rolls", "--device", "cpu",
                           "--out", str(tmp_path / out), *[a for s in seeds for a in ("--seed", str(s))]])
        return [e["latents"] for e in res["samples"]]

    (first, other), (again,) = latents([3, 4], "a"), latents([3], "b")
    assert torch.equal(first, again)
    assert (first - other).abs().max() > 1e-3


@pytest.fixture(scope="module")
def low_noise_dmd(shared_dir, tmp_path_factory):
    """A distilled (DMD) boundary=low LoRA of the tiny T2V-A14B layout."""
    return tiny_run(shared_dir, tmp_path_factory.mktemp("dmd_low") / "run",
                    ["model=tiny_t2v14b", "boundary=low", "trainer.max_steps=2", "objective=dmd",
                     "objective.generator_every=1"])


def test_a_distilled_low_noise_lora_samples_every_step_on_the_low_expert_with_its_lora(low_noise_dmd):
    """Training ran every student step (1000 included, above the boundary) on the low expert with the generator
    adapter: so does the sampler, never the high expert."""
    r = low_noise_dmd
    res = sample.main(["--run", r["output_dir"], "--prompt", "a red ball rolls", "--device", "cpu"])
    (entry,) = res["samples"]
    assert max(entry["timesteps"]) >= 1000 * r["cfg"].model.boundary_ratio  # a step the boundary gives to high
    assert entry["experts"] == [["low", True]] * 4


def test_a_flow_matching_low_noise_lora_samples_high_noise_steps_on_the_base_high_expert(low_noise_dmd, tmp_path):
    """A boundary=low LoRA that is not distilled learned the low side only: steps at t >= boundary run on the base
    high expert (no LoRA), the others on low + LoRA. (The distilled file without its student-step headers is such a
    LoRA: a flow-matching run writes the same files, without those headers.)"""
    from safetensors import safe_open
    from safetensors.torch import save_file

    r = low_noise_dmd
    (src,) = (Path(r["output_dir"]) / "lora" / "final").glob("*_low_noise_diffusers.safetensors")
    with safe_open(str(src), "pt") as f:
        header = {k: v for k, v in f.metadata().items() if not k.startswith("wanexp_student")}
        header["wanexp_objective"] = "flow_matching"
        save_file({k: f.get_tensor(k) for k in f.keys()}, str(tmp_path / src.name), metadata=header)
    data = r["cfg"].data
    res = sample.main(["--model-path", r["cfg"].model.path, "--lora", str(tmp_path / src.name), "--prompt", "a ball",
                       "--height", str(data.height), "--width", str(data.width), "--frames", str(data.num_frames),
                       "--steps", "4", "--guidance", "1", "--device", "cpu", "--out", str(tmp_path / "out")])
    (entry,) = res["samples"]
    assert not res["distilled"]
    boundary = 1000 * r["cfg"].model.boundary_ratio
    expected = [["high", False] if t >= boundary else ["low", True] for t in entry["timesteps"]]
    assert entry["experts"] == expected
    assert {e for e, _ in entry["experts"]} == {"high", "low"}  # both sides of the boundary were sampled


def test_sample_input_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sample.main(["--run", str(tmp_path), "--prompt", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("wanexp: error: --run ") and "no config.yaml there" in err


@pytest.mark.parametrize("channels,group", [((48, 48), "ti2v5b"), ((16, 16), "t2v14b"), ((36, 16), "i2v14b"),
                                            ((20, 20), None)])
def test_a_folder_without_a_run_is_sampled_as_the_model_group_its_transformer_matches(tmp_path, channels, group):
    """--model-path alone: the released model groups' spec classes are asked for their DiT's channels (the tiny
    groups, which share them, are not candidates); a folder none of them has is one line listing them."""
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"in_channels": channels[0],
                                                                      "out_channels": channels[1]}))
    if group is not None:
        assert sample._folder_model(tmp_path).name == group
        return
    with pytest.raises(sample.ConfigError) as e:
        sample._folder_model(tmp_path)
    assert str(e.value) == (f"--model-path {tmp_path}: its transformer (in/out channels 20/20) is none of the model "
                            "groups' (animate14b, flf2v14b, i2v14b, s2v14b, t2v14b, ti2v5b, vace14b); pass a "
                            "diffusers folder of one of them, or --run with the run folder")


def test_an_s2v_release_folder_is_sampled_as_s2v14b(tmp_path):
    """The S2V release has no model_index.json and no transformer/ folder: its top-level config.json names it."""
    from wanexp.models.s2v.original import MODEL_TYPE

    (tmp_path / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE, "dim": 5120}))
    assert sample._folder_model(tmp_path).name == "s2v14b"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t2v", "dim": 5120}))
    with pytest.raises(sample.ConfigError):
        sample._folder_model(tmp_path)


def test_image_quality_metrics_are_the_standard_psnr_and_gaussian_window_ssim():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(2, 11, 11, 3, generator=g) * 0.9
    assert generation.ssim(a, a) == pytest.approx(1.0) and generation.psnr(a, a) == float("inf")
    assert generation.psnr(a, a + 0.1) == pytest.approx(20.0, abs=1e-3)  # MSE 0.01
    b = (a + 0.3 * torch.rand(a.shape, generator=g)).clamp(0, 1)
    # SSIM from its definition (Wang et al. 2004): at every pixel, a window of 11x11 Gaussian weights (sigma 1.5;
    # the borders mirrored), K1 = 0.01, K2 = 0.03; the mean over pixels, channels and frames
    k = torch.exp(-((torch.arange(11) - 5.0) ** 2) / (2 * 1.5**2))
    w = k[:, None] * k[None] / k.sum() ** 2

    def window(x, y):
        mx, my = (w * x).sum(), (w * y).sum()
        vx, vy, cxy = (w * x * x).sum() - mx**2, (w * y * y).sum() - my**2, (w * x * y).sum() - mx * my
        c1, c2 = 0.01**2, 0.03**2
        return (2 * mx * my + c1) * (2 * cxy + c2) / ((mx**2 + my**2 + c1) * (vx + vy + c2))

    def mirrored(v):  # (F, H, W, C) -> (F, C, H + 10, W + 10)
        return torch.nn.functional.pad(v.permute(0, 3, 1, 2), (5, 5, 5, 5), mode="reflect")

    pa, pb = mirrored(a), mirrored(b)
    expected = torch.stack([window(pa[f, c, i:i + 11, j:j + 11], pb[f, c, i:i + 11, j:j + 11])
                            for f in range(2) for c in range(3) for i in range(11) for j in range(11)]).mean()
    assert generation.ssim(a, b) == pytest.approx(float(expected), abs=1e-5)
    noise = torch.rand(2, 16, 16, 3, generator=g)
    assert generation.ssim(noise, torch.rand(noise.shape, generator=g)) < 0.2


# ---- image-to-video from the user's own image -------------------------------------------------------------------
def _wide_image(path: Path, seed: int = 0) -> Path:
    """A 40x120 image of noise: covering a 64x64 sample crops its centre, so a crop and a squeeze differ."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    Image.fromarray((torch.rand(40, 120, 3, generator=g) * 255).to(torch.uint8).numpy()).save(path)
    return path


def _vae(cfg):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(cfg.model.path, subfolder="vae", dtype=torch.float32)


def _squeezed(path: Path, height: int, width: int) -> torch.Tensor:
    """The image resized to the sample's size without keeping its aspect: (1, 3, 1, H, W) in [-1, 1]."""
    import numpy as np
    from PIL import Image

    pixels = torch.from_numpy(np.array(Image.open(path))).permute(2, 0, 1).float()[None]
    pixels = torch.nn.functional.interpolate(pixels / 127.5 - 1, size=(height, width), mode="bilinear",
                                             antialias=True)
    return pixels[:, :, None]


def test_an_image_is_the_first_frame_of_a_ti2v_sample_cropped_as_training_crops(trained, tmp_path):
    """TI2V-5B layout: --image makes the sample image-to-video; its latent frame 0 is the VAE latent of the image
    resized and centre-cropped as training crops a clip (not squeezed), and differs from a text-to-video run's. The
    video is written at the model's rate (model.fps), and the whole path prints no warning."""
    import warnings

    from wanexp.data.media import load_clip
    from wanexp.models.wan22.encoders import encode_video

    r = trained("tiny")
    d = r["cfg"].data
    image = _wide_image(tmp_path / "wide.png")
    args = ["--run", r["output_dir"], "--prompt", "a red ball rolls", "--steps", "2", "--guidance", "1",
            "--device", "cpu"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. diffusers' torch_dtype FutureWarning
        res = sample.main([*args, "--image", str(image), "--out", str(tmp_path / "i2v")])
    text = sample.main([*args, "--out", str(tmp_path / "t2v")])
    (entry,), (plain,) = res["samples"], text["samples"]
    vae = _vae(r["cfg"])
    cropped = encode_video(vae, load_clip(image, 1, d.height, d.width)[None])  # training's latent of the image
    frame0 = entry["latents"][:, :, :1]
    assert (frame0 - cropped).abs().max() < 1e-2  # the image, quantised to 8 bits as a PIL image
    assert (frame0 - encode_video(vae, _squeezed(image, d.height, d.width))).abs().max() > 0.1
    assert (plain["latents"][:, :, :1] - cropped).abs().max() > 1.0
    assert entry["image"] == str(image) and "image" not in plain
    with av.open(entry["file"]) as c:
        assert c.streams.video[0].average_rate == r["cfg"].model.fps == 24
    assert json.loads((tmp_path / "i2v" / "metrics.json").read_text())["fps"] == 24


def test_an_image_conditions_every_step_of_an_i2v_a14b_sample(trained, tmp_path, monkeypatch):
    """I2V-A14B layout: the transformers' 16 image-condition channels are the latents of [image, zeros] with the image
    cropped as training crops it (what training feeds them), at every call; another image gives another condition."""
    from wanexp.data.media import load_clip
    from wanexp.models.wan22.encoders import encode_image_condition

    r = trained("tiny_i2v14b")
    d = r["cfg"].data
    from tests.helpers import record_condition_channels

    seen = record_condition_channels(monkeypatch, 20)
    images = [_wide_image(tmp_path / "a.png", 0), _wide_image(tmp_path / "b.png", 1)]
    res = sample.main(["--run", r["output_dir"], "--prompt", "a red ball", "--prompt", "a blue ball", "--steps", "2",
                       "--guidance", "1", "--device", "cpu", "--out", str(tmp_path / "out"),
                       *[a for p in images for a in ("--image", str(p))]])
    assert len(res["samples"]) == 2 and len(seen) == 4  # 2 prompts x 2 steps, one call each (no CFG)
    vae = _vae(r["cfg"])
    expected = [encode_image_condition(vae, load_clip(p, 1, d.height, d.width)[:, 0][None], d.num_frames)
                for p in images]
    for k, cond in enumerate(seen):
        assert (cond - expected[k // 2]).abs().max() < 1e-2
        assert (cond - expected[1 - k // 2]).abs().max() > 0.1


def test_image_input_errors_are_one_line_before_any_weights_load(trained, shared_dir, tmp_path, monkeypatch, capsys):
    from wanexp.models.tiny import ensure_tiny_model
    from wanexp.composition import build

    def no_weights(name):
        raise AssertionError("a pipeline was loaded")

    monkeypatch.setattr("wanexp.models.wan22.pipeline.pipeline_class", no_weights)
    ti2v, i2v = trained("tiny")["output_dir"], trained("tiny_i2v14b")["output_dir"]
    t2v = ensure_tiny_model(build(compose_cfg(["model=tiny_t2v14b",
                                               f"paths.tiny_model_dir={shared_dir}/models"]).model))
    good, missing = _wide_image(tmp_path / "good.png"), tmp_path / "missing.png"
    (tmp_path / "bad.png").write_text("not a png")
    cases = [
        (["--run", ti2v, "--image", str(missing)], f"--image {missing}: file not found"),
        (["--run", ti2v, "--image", str(tmp_path / "bad.png")], f"--image {tmp_path / 'bad.png'}: cannot read image"),
        (["--run", ti2v, "--image", str(good), "--image", str(good)],
         "--image given 2 time(s) for 1 --prompt(s): pass one --image per --prompt"),
        (["--run", i2v], "--image given 0 time(s) for 1 --prompt(s) (model=tiny_i2v14b is image-to-video)"),
        (["--model-path", str(t2v), "--image", str(good)], "--image: model=t2v14b has no image conditioning"),
    ]
    from tests.helpers import assert_samples_refused

    assert_samples_refused(cases, capsys, tmp_path / "out")


def test_a_dmd_runs_teacher_is_the_one_it_was_distilled_toward(dmd_tiny, tmp_path, monkeypatch):
    """--teacher samples the base model with the run's objective.guidance_scale and objective.negative_prompt (the
    CFG the student was distilled toward), not CFG 5 with the empty prompt; the flags still override them."""
    calls = []
    from wanexp.models.wan22.pipeline import generate

    def spy(pipe, prompt, seed, s, steps, guidance, negative, *args, **kwargs):
        calls.append((steps, guidance, negative))
        return generate(pipe, prompt, seed, s, steps, guidance, negative, *args, **kwargs)

    monkeypatch.setattr("wanexp.models.wan22.pipeline.generate", spy)
    objective = dmd_tiny["cfg"].objective
    assert objective.guidance_scale != 5.0 and objective.negative_prompt  # the defaults this must not fall back to
    args = ["--run", dmd_tiny["output_dir"], "--prompt", "a red ball rolls", "--teacher", "--teacher-steps", "2",
            "--device", "cpu"]
    res = sample.main([*args, "--out", str(tmp_path / "a")])
    assert calls[1] == (2, objective.guidance_scale, objective.negative_prompt)
    assert res["teacher"] == {"steps": 2, "guidance": objective.guidance_scale}
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["negative_prompt"] == objective.negative_prompt
    sample.main([*args, "--teacher-guidance", "3", "--negative-prompt", "blurry", "--out", str(tmp_path / "b")])
    assert calls[3] == (2, 3.0, "blurry")


def test_the_image_to_video_pipeline_class_comes_without_a_warning():
    """diffusers' Wan image-to-video module imports transformers' CLIPImageProcessor (for Wan2.1's CLIP image encoder),
    which without torchvision logs a fallback warning: validation and wanexp-sample get the pipeline class through
    wanexp.models.wan22.pipeline.pipeline_class, which prints nothing. A fresh process: the warning is logged once per process."""
    code = "from wanexp.models.wan22.pipeline import pipeline_class; print(pipeline_class('WanImageToVideoPipeline').__name__)"
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout == "WanImageToVideoPipeline\n" and done.stderr == "", done.stderr
