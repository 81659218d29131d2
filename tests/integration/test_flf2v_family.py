"""First-last-frame to video end to end on the CPU (model=tiny_flf2v: the tiny I2V-A14B folder, trained on a first and
a last frame): clips, one row with a ``last_image`` and one whose ``last_image`` is missing -> wanexp.cli.cache (the
condition latent of each clip ends on its row's image, else on its trained window's last frame; the missing image
rejected with its reason) -> training from the cache, resumed from its step-2 checkpoint to the LoRA of an
uninterrupted run, bit for bit -> ComfyUI LoRA files named as I2V-A14B's -> wanexp-sample --first/--last, the last
frame reaching every transformer call as diffusers' ``last_image`` condition; bad --last input refused in one line."""
from __future__ import annotations

import csv
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.conftest import compose_cfg
from wanexp.cli import sample

FPS, FRAMES, SIZE = 16, 9, 32  # 12-frame clips: the trained window is frames 0..8, its last frame is not the clip's


def _clip(n: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    base = g.integers(0, 255, size=(1, 5, 5, 3))
    frames = np.repeat(np.repeat(base, 8, axis=1), 8, axis=2).repeat(n, axis=0)
    return np.clip(frames + np.arange(n)[:, None, None, None] * 18, 0, 255).astype(np.uint8)


def _image(path: Path, seed: int) -> Path:
    from PIL import Image

    Image.fromarray(np.random.default_rng(seed).integers(0, 255, size=(40, 60, 3)).astype(np.uint8)).save(path)
    return path


@pytest.fixture
def data(tmp_path):
    from wanexp.data.media import write_video

    d = tmp_path / "data"
    d.mkdir()
    rows = []
    for i, last in enumerate(["end.png", "", "", "gone.png"]):
        write_video(d / f"c{i}.mp4", _clip(12, i), FPS)
        rows.append({"video": f"c{i}.mp4", "prompt": f"a square moving {i}", "last_image": last})
    _image(d / "end.png", 7)
    with (d / "metadata.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["video", "prompt", "last_image"])
        writer.writeheader()
        writer.writerows(rows)
    return tmp_path


def _overrides(root, shared_dir, *extra) -> list[str]:
    return ["experiment=demo", "model=tiny_flf2v", "boundary=full", f"paths.tiny_model_dir={shared_dir}/models",
            f"paths.output_dir={root}/run", f"data.cache_dir={root}/cache", f"data.metadata={root}/data/metadata.csv",
            "data.generate=null", f"data.num_frames={FRAMES}", f"data.height={SIZE}", f"data.width={SIZE}",
            "data.max_reject_fraction=0.5", "data.batch_size=2", "adapter.rank=4", "adapter.alpha=2",
            "optim.lr=1e-2", "optim.warmup_steps=0", "optim.scheduler=constant", "trainer.max_steps=4",
            "callbacks.checkpoint.every_n_train_steps=2", "trainer.log_every_n_steps=1", "callbacks.progress=null",
            "callbacks.validation=null",
            *extra]


def _lora(folder: Path) -> dict:
    return {p.name: load_file(str(p)) for p in sorted((folder / "lora" / "final").glob("*.safetensors"))}


def test_flf2v_caches_trains_resumes_exports_and_samples_first_to_last(data, shared_dir, trained, tmp_path,
                                                                       monkeypatch, capsys):
    from wanexp.cli import cache
    from wanexp.composition import build
    from wanexp.data.cache import CacheIndex
    from wanexp.data.media import load_clip
    from wanexp.generation import condition_image
    from wanexp.models.wan22.encoders import encode_image_condition
    from wanexp.train import run

    root, d = data, data / "data"
    # 1. the cache: each clip's latents and its first-last condition; the row whose last_image is missing rejected
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # main sets it for Hydra: unset again after the test
    monkeypatch.delenv("HYDRA_FULL_ERROR")
    monkeypatch.setattr("sys.argv", ["wanexp-cache", *_overrides(root, shared_dir)])
    cache.main()
    index = CacheIndex(root / "cache")
    latents = {Path(e["media"]).name: e["key"] for e in index.entries.values() if e["kind"] == "latent"}
    assert sorted(latents) == ["c0.mp4", "c1.mp4", "c2.mp4"]
    rejects = "".join(f.read_text() for f in sorted((root / "cache").glob("rejects*.jsonl")))
    assert f"last_image {d / 'gone.png'}: file not found" in rejects and "c3.mp4" in rejects
    spec = build(compose_cfg(_overrides(root, shared_dir)).model)
    vae = spec.load_vae()
    for name, last in (("c0.mp4", load_clip(d / "end.png", 1, SIZE, SIZE)[:, 0]),
                       ("c1.mp4", load_clip(d / "c1.mp4", FRAMES, SIZE, SIZE)[:, -1])):
        clip = load_clip(d / name, FRAMES, SIZE, SIZE)
        stored = index.load(latents[name])
        assert sorted(stored) == ["image_latent", "latents"]
        expected = encode_image_condition(vae, clip[None, :, 0], FRAMES, last[None])[0]
        torch.testing.assert_close(stored["image_latent"], expected, rtol=0, atol=1e-6)
    # the window's last frame, not the clip's (frame 11): another condition
    whole = load_clip(d / "c1.mp4", 12, SIZE, SIZE)
    other = encode_image_condition(vae, whole[None, :, 0], FRAMES, whole[None, :, -1])[0]
    assert (index.load(latents["c1.mp4"])["image_latent"] - other).abs().max() > 1e-4

    # 2. training from the cache; resumed from the step-2 checkpoint it ends on the uninterrupted run's LoRA exactly
    capsys.readouterr()
    straight = run(compose_cfg(_overrides(root, shared_dir)))
    assert straight["global_step"] == 4 and "data: training from the cache" in capsys.readouterr().out
    resumed = run(compose_cfg(_overrides(root, shared_dir, f"paths.output_dir={root}/resumed",
                                         f"resume={root}/run/checkpoints/step_000002.ckpt")))
    assert resumed["global_step"] == 4
    first, again = _lora(root / "run"), _lora(root / "resumed")
    assert first.keys() == again.keys() and len(first) == 4
    for name in first:
        assert first[name].keys() == again[name].keys()
        assert all(torch.equal(first[name][k], again[name][k]) for k in first[name]), name

    # 3. the ComfyUI files hold exactly the keys an I2V-A14B run's do (ComfyUI loads them as it loads those)
    i2v = Path(trained("tiny_i2v14b")["output_dir"]) / "lora" / "final"
    for expert in ("high", "low"):
        with safe_open(str(root / "run" / "lora" / "final" / f"tiny_flf2v_lora_{expert}_noise_comfyui.safetensors"),
                       "pt") as f:
            ours = set(f.keys())
        with safe_open(str(i2v / f"tiny_i2v14b_lora_{expert}_noise_comfyui.safetensors"), "pt") as f:
            assert ours == set(f.keys())
        assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in ours

    # 4. wanexp-sample --first/--last: every transformer call's 20 condition channels are the mask and the latents
    # of [first, zeros, last] as training builds them; the second prompt's other last frame gives another condition
    from tests.helpers import record_condition_channels

    seen = record_condition_channels(monkeypatch, 16)
    first_img, lasts = _image(tmp_path / "first.png", 1), [_image(tmp_path / "a.png", 2), d / "end.png"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = sample.main(["--run", str(root / "run"), "--prompt", "a", "--prompt", "b", "--steps", "2", "--guidance",
                           "1", "--device", "cpu", "--out", str(tmp_path / "out"),
                           *[a for p in lasts for a in ("--first", str(first_img), "--last", str(p))]])
    assert [e["last_image"] for e in res["samples"]] == [str(p) for p in lasts] and len(seen) == 4
    mask = spec.model_inputs(torch.zeros(1, 16, 3, 4, 4), None, torch.tensor([1.0]),
                             {"image_latent": torch.zeros(1, 16, 3, 4, 4)})[0][:, 16:20]
    # the first frame as --image hands it over (a PIL image: the crop quantised to 8 bits), the last as training
    # crops it
    first_px = torch.from_numpy(np.array(condition_image(first_img, SIZE, SIZE))).permute(2, 0, 1)[None] / 127.5 - 1
    expected = [encode_image_condition(vae, first_px, FRAMES, load_clip(p, 1, SIZE, SIZE)[:, 0][None]) for p in lasts]
    for k, cond in enumerate(seen):
        assert torch.equal(cond[:, :4], mask)
        assert (cond[:, 4:] - expected[k // 2]).abs().max() < 1e-5
        assert (cond[:, 4:] - expected[1 - k // 2]).abs().max() > 1e-3  # (a random tiny VAE: small latents)


def test_last_frame_errors_are_one_line_before_any_weights_load(data, shared_dir, tmp_path, monkeypatch, capsys):
    from wanexp.composition import build
    from wanexp.models.tiny import ensure_tiny_model

    def no_weights(name):
        raise AssertionError("a pipeline was loaded")

    monkeypatch.setattr("wanexp.models.wan22.pipeline.pipeline_class", no_weights)
    from omegaconf import OmegaConf

    flf = tmp_path / "flf"  # a run folder's config (no weights are read before the refusals)
    flf.mkdir()
    OmegaConf.save(compose_cfg(_overrides(data, shared_dir)), flf / "config.yaml", resolve=True)
    ti2v = ensure_tiny_model(build(compose_cfg(["model=tiny", f"paths.tiny_model_dir={shared_dir}/models"]).model))
    good, missing = _image(tmp_path / "good.png", 0), tmp_path / "missing.png"
    cases = [
        (["--run", str(flf), "--image", str(good), "--last", str(missing)], f"--last {missing}: file not found"),
        (["--run", str(flf), "--image", str(good)],
         "--last given 0 time(s) for 1 --prompt(s) (model=tiny_flf2v is first-last-frame to video)"),
        (["--model-path", str(ti2v), "--first", str(good), "--last", str(good)],
         "--last: model=ti2v5b has no first-last-frame conditioning"),
    ]
    ensure_tiny_model(build(compose_cfg(["model=tiny_flf2v", f"paths.tiny_model_dir={shared_dir}/models"]).model))
    from tests.helpers import assert_samples_refused

    assert_samples_refused(cases, capsys, tmp_path / "out")
    # a folder of I2V-A14B weights sampled without --run: the first-last-frame group when --last is given
    i2v = Path(shared_dir) / "models" / "tiny_i2v14b"
    assert sample._folder_model(i2v).name == "i2v14b" and sample._folder_model(i2v, last=True).name == "flf2v14b"


def test_validation_videos_end_on_each_held_out_clips_last_frame(data, shared_dir, monkeypatch):
    """Validation samples prompt i with held-out sample i's first frame and its last: the row's ``last_image``, else
    its trained window's last frame (as the cache conditions training), handed to diffusers as ``last_image``."""
    from wanexp.data.media import load_clip
    from wanexp.models.wan22 import pipeline
    from wanexp.train import run

    root, d = data, data / "data"
    given: list = []
    generate = pipeline.generate

    def spy(pipe, *args, **kwargs):
        given.append(kwargs.get("last_image"))
        return generate(pipe, *args, **kwargs)

    monkeypatch.setattr("wanexp.models.wan22.pipeline.generate", spy)
    base = [o for o in _overrides(root, shared_dir) if o != "callbacks.validation=null"]
    out = run(compose_cfg(base + [
        "trainer.max_steps=1", "callbacks.validation.every_n_steps=1", "callbacks.validation.at_start=false",
        "callbacks.validation.prompts=[a,b,c]", "callbacks.validation.seeds=[0]", "callbacks.validation.steps=1",
        "callbacks.validation.loss_samples=0", "data.val_fraction=0"]))
    assert out["global_step"] == 1 and len(given) == 3 and all(g is not None for g in given)
    own = {f"c{i}.mp4": load_clip(d / f"c{i}.mp4", FRAMES, SIZE, SIZE)[:, -1] for i in (1, 2)}
    expected = [load_clip(d / "end.png", 1, SIZE, SIZE)[:, 0], *own.values()]
    got = [(g[0] * 2 - 1) for g in given]  # the pipeline's [0, 1] back to the clips' [-1, 1]
    assert all(any(torch.allclose(x, e, atol=1e-6) for e in expected) for x in got)
    assert len({tuple(x.flatten()[:8].tolist()) for x in got}) == 3  # each prompt its own sample's last frame


@pytest.mark.slow  # two train.py processes
def test_flf2v_trains_with_ddp_on_two_ranks_from_windows_of_the_clips(data, shared_dir):
    """2 ranks (DDP over gloo) from the clips themselves, each sample a window of its clip at stride 2 ending on the
    window's last frame (or the row's last image): both experts train and the ranks end with the same LoRA."""
    import json

    from tests.conftest import run_cli

    res = run_cli(_overrides(data, shared_dir, "parallel=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                             "parallel.strategy.timeout_s=120", "data.use_cache=false", "data.window=uniform",
                             "data.windows_per_clip=2", "data.frame_stride=2", "data.num_frames=5", "data.batch_size=1",
                             "trainer.max_steps=2"), timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    status = json.loads((data / "run" / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 2 and status["world_size"] == 2
    assert status["replicas_in_sync"] is True
    assert len(_lora(data / "run")) >= 4  # ComfyUI and diffusers files of both experts
