"""wanexp.cli.sample: a distilled tiny LoRA samples in its 4 training steps through the diffusers pipeline."""
from __future__ import annotations

import json

import av
import pytest

from tests.integration.conftest import tiny_run
from wanexp.cli import sample
from wanexp.objectives.dmd import DMD


def test_a_distilled_lora_samples_on_its_training_steps_and_is_compared_with_the_teacher(shared_dir, tmp_path):
    r = tiny_run(shared_dir, tmp_path / "run", ["objective=dmd", "objective.generator_every=1", "trainer.max_steps=2"])
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
    saved = json.loads((tmp_path / "run" / "samples" / "metrics.json").read_text())
    assert saved["samples"][0]["timesteps"] == entry["timesteps"]


def test_sample_input_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sample.main(["--run", str(tmp_path), "--prompt", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("wanexp: error: --run ") and "no config.yaml there" in err


def test_image_quality_metrics_are_right_on_known_pairs():
    import torch

    a = torch.rand(2, 16, 16, 3, generator=torch.Generator().manual_seed(0))
    assert sample.ssim(a, a) == pytest.approx(1.0) and sample.psnr(a, a) == float("inf")
    b = (a + 0.1).clamp(0, 1)
    assert sample.psnr(a, a * 0 + 0.5) < sample.psnr(a, b) < 40
    assert sample.ssim(a, torch.rand(a.shape, generator=torch.Generator().manual_seed(1))) < 0.2
