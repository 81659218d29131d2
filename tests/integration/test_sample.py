"""wanexp.cli.sample: a distilled tiny LoRA samples in its 4 training steps through the diffusers pipeline, with the
same video for the same seed, on the experts its training used."""
from __future__ import annotations

import json
from pathlib import Path

import av
import pytest
import torch

from tests.integration.conftest import tiny_run
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


def test_image_quality_metrics_are_the_standard_psnr_and_gaussian_window_ssim():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(2, 11, 11, 3, generator=g) * 0.9
    assert sample.ssim(a, a) == pytest.approx(1.0) and sample.psnr(a, a) == float("inf")
    assert sample.psnr(a, a + 0.1) == pytest.approx(20.0, abs=1e-3)  # MSE 0.01
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
    assert sample.ssim(a, b) == pytest.approx(float(expected), abs=1e-5)
    noise = torch.rand(2, 16, 16, 3, generator=g)
    assert sample.ssim(noise, torch.rand(noise.shape, generator=g)) < 0.2
