"""The Wan2.2-Animate family end to end on the CPU (model=tiny_animate, the diffusers folder's layout at tiny sizes):
clips with their pose and face videos -> wanexp.cli.cache (the latents with the reference slot, the reference
condition, pose latents, face pixels and CLIP features of each; a clip whose face video is missing rejected with its
reason) -> training stopped after 2 steps and resumed to the LoRA of an uninterrupted run, bit for bit -> the LoRA
files (ComfyUI's with the blocks' original Wan names, no face adapter; the diffusers file loads back into the DiT)
-> wanexp-sample --image --pose-video --face-video through diffusers' WanAnimatePipeline with that LoRA. Replacement
mode (background and mask videos) through the cache and a training step."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

FPS = 16
ROOT = Path(__file__).resolve().parents[2]


def _frames(n: int, size: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    base = g.integers(0, 255, size=(1, size // 8, size // 8, 3))
    frames = np.repeat(np.repeat(base, 8, axis=1), 8, axis=2).repeat(n, axis=0)
    return np.clip(frames + np.arange(n)[:, None, None, None] * 4, 0, 255).astype(np.uint8)


@pytest.fixture
def clips(tmp_path):
    """Three clips with pose, face, background and mask videos, one more whose face video is missing."""
    from wanexp.data.media import write_video

    data = tmp_path / "data"
    data.mkdir()
    rows = []
    for i in range(4):
        write_video(data / f"dance{i}.mp4", _frames(12, 32, i), FPS)
        write_video(data / f"pose{i}.mp4", _frames(12, 32, 10 + i), FPS)
        write_video(data / f"bg{i}.mp4", _frames(12, 32, 20 + i), FPS)
        mask = np.zeros((12, 32, 32, 3), np.uint8)
        mask[:, 8:24, 8:24] = 255
        write_video(data / f"mask{i}.mp4", mask, FPS)
        if i < 3:
            write_video(data / f"face{i}.mp4", _frames(12, 24, 30 + i), FPS)
        rows.append({"video": f"dance{i}.mp4", "prompt": f"a person dancing {i}", "pose_video": f"pose{i}.mp4",
                     "face_video": f"face{i}.mp4", "background_video": f"bg{i}.mp4", "mask_video": f"mask{i}.mp4"})
    with (data / "metadata.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return tmp_path


def _overrides(root, *extra) -> list[str]:
    return ["experiment=demo", "model=tiny_animate", f"paths.tiny_model_dir={root}/models",
            f"paths.output_dir={root}/run", f"data.cache_dir={root}/cache", f"data.metadata={root}/data/metadata.csv",
            "data.generate=null", "data.num_frames=9", "data.height=32", "data.width=32", "data.probe=true",
            "data.max_reject_fraction=0.5", "adapter.rank=4", "adapter.alpha=2", "optim.lr=1e-2",
            "optim.warmup_steps=0", "optim.scheduler=constant", "trainer.log_every_n_steps=1",
            "callbacks.progress=null", "callbacks.checkpoint.every_n_train_steps=1", "callbacks.validation=null",
            *extra]


def _train(*overrides) -> dict:
    from tests.conftest import compose_cfg
    from wanexp.train import run

    return run(compose_cfg(list(overrides)))


def _lora(checkpoint):
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return state["global_step"], {k: v for k, v in state["state_dict"].items() if ".lora_" in k}


def _cache(monkeypatch, capsys, overrides):
    from wanexp.cli import cache
    from wanexp.data.cache import CacheIndex

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # main sets it for Hydra: unset again after the test
    monkeypatch.delenv("HYDRA_FULL_ERROR")
    monkeypatch.setattr(sys, "argv", ["wanexp-cache", *overrides])
    cache.main()
    capsys.readouterr()
    index = CacheIndex(Path([o for o in overrides if o.startswith("data.cache_dir=")][-1].split("=", 1)[1]))
    return index, {e["media"]: e["key"] for e in index.entries.values() if e["kind"] == "latent"}


def test_animate_caches_trains_resumes_exports_and_samples(clips, monkeypatch, capsys):
    root, run = clips, clips / "run"
    # 1. the cache: each clip with its pose and face videos; the clip without a face video rejected with the reason
    index, latents = _cache(monkeypatch, capsys, _overrides(root))
    assert sorted(latents) == [str(root / "data" / f"dance{i}.mp4") for i in range(3)]
    rejects = [json.loads(x) for f in sorted((root / "cache").glob("rejects*.jsonl"))
               for x in f.read_text().splitlines()]
    assert [r["path"] for r in rejects] == [str(root / "data" / "dance3.mp4")]
    assert rejects[0]["reason"] == f"face_video: {root / 'data' / 'face3.mp4'}: file not found"
    stored = index.load(latents[str(root / "data" / "dance0.mp4")])
    assert sorted(stored) == ["face_pixels", "image_embeds", "latents", "pose_latents", "reference_latents"]
    assert stored["latents"].shape == (16, 4, 4, 4) and stored["reference_latents"].shape == (20, 4, 4, 4)
    assert stored["pose_latents"].shape == (16, 3, 4, 4) and stored["face_pixels"].shape == (3, 9, 16, 16)
    assert stored["image_embeds"].shape == (5, 32)
    other = index.load(latents[str(root / "data" / "dance1.mp4")])
    assert not torch.equal(stored["pose_latents"], other["pose_latents"])
    assert not torch.equal(stored["face_pixels"], other["face_pixels"])

    # 2. train from the cache: 2 steps, then resumed to 4 = 4 steps straight, bit for bit
    _train(*_overrides(root, "trainer.max_steps=2"))
    step, first = _lora(run / "checkpoints" / "last.ckpt")
    modules = {k.split(".lora_")[0].removeprefix("transformers.dense.") for k in first}
    assert step == 2 and {"blocks.0.attn1.to_q", "blocks.1.attn2.to_v", "blocks.1.ffn.net.0.proj",
                          "blocks.0.ffn.net.2"} <= modules
    assert not any(m.startswith("face_adapter") for m in modules)
    _train(*_overrides(root, "trainer.max_steps=4", "resume=last"))
    step, last = _lora(run / "checkpoints" / "last.ckpt")
    assert step == 4 and all(not torch.equal(first[k], last[k]) for k in first if ".lora_B." in k)
    _train(*_overrides(root, "trainer.max_steps=4", f"paths.output_dir={root}/straight"))
    _, straight = _lora(root / "straight" / "checkpoints" / "last.ckpt")
    assert straight.keys() == last.keys() and all(torch.equal(straight[k], last[k]) for k in last)

    # 3. the LoRA files: ComfyUI's keys are the blocks' original Wan names; the diffusers file loads back as trained
    from hydra.utils import instantiate

    from tests.conftest import compose_cfg

    final = run / "lora" / "final"
    comfy = load_file(next(final.glob("*_comfyui.safetensors")))
    names = {k.removeprefix("diffusion_model.").rsplit(".", 2)[0] for k in comfy if not k.endswith(".alpha")}
    assert all(k.startswith("diffusion_model.blocks.") for k in comfy)
    assert {"blocks.0.self_attn.q", "blocks.1.cross_attn.o", "blocks.0.ffn.0", "blocks.1.ffn.2"} <= names
    spec = instantiate(compose_cfg(_overrides(root)).model, _convert_="all")
    transformer = spec.load_transformer("dense")
    transformer.load_lora_adapter(str(final), weight_name=next(final.glob("*_diffusers.safetensors")).name,
                                  prefix="transformer", adapter_name="back")
    loaded = {k: v for k, v in transformer.state_dict().items() if ".lora_" in k}
    assert len(loaded) == len(last)
    for key, value in loaded.items():
        assert torch.equal(value, last["transformers.dense." + key.replace(".back.", ".default.")]), key

    # 4. wanexp-sample --run with the reference image and the motion videos: diffusers' pipeline with the LoRA
    from PIL import Image

    from wanexp.cli import sample

    Image.fromarray(_frames(1, 32, 7)[0]).save(root / "ref.png")
    data = root / "data"
    args = ["--run", str(run), "--prompt", "a person dancing", "--image", str(root / "ref.png"), "--pose-video",
            str(data / "pose1.mp4"), "--face-video", str(data / "face1.mp4"), "--frames", "9", "--steps", "2",
            "--guidance", "1", "--device", "cpu", "--save-latents"]
    res = sample.main([*args, "--out", str(root / "one")])
    (entry,) = res["samples"]
    assert entry["latents"].shape == (1, 16, 3, 4, 4) and len(entry["timesteps"]) == 2 and res["loras"]
    assert entry["pose_video"] == str(data / "pose1.mp4") and entry["face_video"] == str(data / "face1.mp4")
    with av.open(entry["file"]) as f:
        assert sum(1 for _ in f.decode(video=0)) == 9
    # the LoRA changes the sample; the base model (--teacher) is the same pipeline without it
    res = sample.main([*args, "--teacher", "--teacher-steps", "2", "--teacher-guidance", "1",
                       "--out", str(root / "teacher")])
    assert res["samples"][0]["latent_mse"] > 0


def test_replacement_mode_caches_the_background_inside_the_mask_and_trains(clips, monkeypatch, capsys):
    root = clips
    replace = _overrides(root, "model.animate_mode=replacement", f"data.cache_dir={root}/cache_r",
                         f"paths.output_dir={root}/replace", "trainer.max_steps=1")
    index, latents = _cache(monkeypatch, capsys, replace)
    animation, _ = _cache(monkeypatch, capsys, _overrides(root, f"data.cache_dir={root}/cache_a"))
    key = latents[str(root / "data" / "dance0.mp4")]
    stored = index.load(key)
    mask = stored["reference_latents"][:4, 1:]  # the segment's mask: 1 - the mask video at the latent size
    kept = torch.ones(4, 4)
    kept[1:3, 1:3] = 0  # the mask's white square (pixels 8-23, latents 1-2): generated; the rest kept (the codec's
    torch.testing.assert_close(mask, kept.expand_as(mask), rtol=0, atol=0.02)  # rounding of white aside)
    plain = animation.load(next(e["key"] for e in animation.entries.values()
                                if e["kind"] == "latent" and e["media"] == str(root / "data" / "dance0.mp4")))
    assert torch.equal(plain["latents"], stored["latents"]) and key not in {e for e in animation.entries}
    assert not torch.equal(plain["reference_latents"], stored["reference_latents"])
    _train(*replace)
    assert next((root / "replace" / "lora" / "final").glob("*_diffusers.safetensors")).is_file()


def test_samples_without_their_motion_videos_are_refused_in_one_line(clips, monkeypatch, capsys):
    from PIL import Image

    from wanexp.cli import sample

    run = clips / "straight"
    _train(*_overrides(clips, "trainer.max_steps=1", f"paths.output_dir={run}"))
    Image.fromarray(_frames(1, 32, 7)[0]).save(clips / "ref.png")
    base = ["--run", str(run), "--prompt", "a person", "--image", str(clips / "ref.png"), "--device", "cpu"]
    for extra, line in (([], "--pose-video given 0 time(s) for 1 --prompt(s)"),
                        (["--pose-video", "x.mp4", "--face-video", str(clips / "data" / "face0.mp4")],
                         "--pose-video x.mp4: file not found"),
                        (["--audio", "a.wav"], "--audio: model=tiny_animate takes no audio")):
        with pytest.raises(SystemExit):
            sample.main([*base, *extra])
        assert line in capsys.readouterr().err
    # validation during training animates held-out clip i's first frame with its own pose and face videos
    from wanexp.models.animate import pipeline

    given = []
    generate = pipeline.AnimatePipeline.generate

    def spy(self, prompt, seed, shape, *args, **kwargs):
        given.append((args[5], kwargs.get("inputs")))  # the reference image, the control videos
        return generate(self, prompt, seed, shape, *args, **kwargs)

    monkeypatch.setattr(pipeline.AnimatePipeline, "generate", spy)
    _train(*[o for o in _overrides(clips, "trainer.max_steps=1", f"paths.output_dir={clips}/val",
                                   "callbacks.validation.every_n_steps=1", "callbacks.validation.steps=1",
                                   "callbacks.validation.at_start=false", "callbacks.validation.loss_samples=0")
             if o != "callbacks.validation=null"])
    assert given and all(img is not None and set(inp) == {"pose_video", "face_video"} for img, inp in given)
    assert list((clips / "val" / "validation").rglob("*.mp4"))


def test_checkpointing_and_block_swap_train_the_same_lora(clips, monkeypatch, capsys):
    """Gradient checkpointing (the DiT blocks' and the face adapter's: recomputed in the backward) and block swap
    (1 of the 2 blocks' frozen weights in host memory) give the plain run's LoRA exactly."""
    root = clips
    _cache(monkeypatch, capsys, _overrides(root))

    def trained(name, *extra):
        result = _train(*_overrides(root, "trainer.max_steps=2", f"paths.output_dir={root}/{name}", *extra))
        return result, load_file(next((root / name / "lora" / "final").glob("*_diffusers.safetensors")))

    _, plain = trained("plain")
    result, checkpointed = trained("checkpointed", "model.gradient_checkpointing=true")
    transformer = result["module"].transformers["dense"]
    assert transformer.is_gradient_checkpointing and transformer.face_adapter[0].forward.__name__ == "run"
    _, swapped = trained("swap", "model.blocks_to_swap=1")
    for other in (checkpointed, swapped):
        assert plain.keys() == other.keys() and all(torch.equal(plain[k], other[k]) for k in plain)


@pytest.mark.slow  # two train.py processes
def test_animate_trains_with_ddp_on_two_ranks_from_windows_of_the_clips(clips, shared_dir):
    """2 ranks (DDP over gloo) from the clips themselves, each sample a window of its clip at stride 2 whose pose and
    face videos are read at the same frames: the run ends with the ranks' LoRA in sync and its files written."""
    import json

    from tests.conftest import run_cli

    res = run_cli(_overrides(clips, f"paths.tiny_model_dir={shared_dir}", "parallel=ddp", "trainer.accelerator=cpu",
                             "trainer.devices=2", "parallel.strategy.timeout_s=120", "data.use_cache=false",
                             "data.window=uniform", "data.windows_per_clip=2", "data.frame_stride=2",
                             "data.num_frames=5", "trainer.max_steps=2"), timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    status = json.loads((clips / "run" / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 2 and status["world_size"] == 2
    assert status["replicas_in_sync"] is True
    assert list((clips / "run" / "lora" / "final").glob("*.safetensors"))
