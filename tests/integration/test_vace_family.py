"""VACE control end to end on the CPU (model=tiny_vace: a tiny random Wan2.2-VACE-Fun-A14B-layout folder): clips with
their control videos (one with a mask video, one with a mask image, one without a mask) and two bad rows (no control
video; a missing one) -> wanexp.cli.cache (each clip's 96 control channels stored beside its latents, as
``control_channels`` builds them from the row's files; the bad rows rejected with their reasons; a changed control
video re-encoded) -> training from the cache, resumed from its step-2 checkpoint to the LoRA of an uninterrupted run,
bit for bit -> ComfyUI files named ``diffusion_model.blocks.N`` (default targets) and ``diffusion_model.vace_blocks.N``
(the ``vace.*`` targets) -> wanexp-sample --control-video/--control-mask/--reference-image, the control channels
reaching every transformer call as training builds them; a dataset without the control_video column refused in one
line."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.conftest import compose_cfg
from wanexp.cli import sample

FPS, FRAMES, SIZE = 16, 9, 32
VACE_TARGETS = "adapter.targets=[q,k,v,o,ffn.0,ffn.2,vace.q,vace.k,vace.v,vace.o,vace.ffn.0,vace.ffn.2]"


def _clip(n: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    base = g.integers(0, 255, size=(1, 4, 4, 3))
    frames = np.repeat(np.repeat(base, 8, axis=1), 8, axis=2).repeat(n, axis=0)
    return np.clip(frames + np.arange(n)[:, None, None, None] * 18, 0, 255).astype(np.uint8)


def _mask(n: int) -> np.ndarray:
    """White on the right half (generate), black on the left (keep), for every frame."""
    m = np.zeros((n, SIZE, SIZE, 3), dtype=np.uint8)
    m[:, :, SIZE // 2:] = 255
    return m


@pytest.fixture
def data(tmp_path):
    from PIL import Image

    from wanexp.data.media import write_video

    d = tmp_path / "data"
    d.mkdir()
    rows = []
    for i, (control, mask) in enumerate([("k0.mp4", "m0.mp4"), ("k1.mp4", ""), ("k2.mp4", "m.png"), ("", ""),
                                         ("gone.mp4", "")]):
        write_video(d / f"c{i}.mp4", _clip(12, i), FPS)
        if control and control != "gone.mp4":
            write_video(d / control, _clip(12, 10 + i), FPS)
        rows.append({"video": f"c{i}.mp4", "prompt": f"a square moving {i}", "control_video": control,
                     "control_mask": mask})
    write_video(d / "m0.mp4", _mask(12), FPS)
    Image.fromarray(_mask(1)[0]).save(d / "m.png")
    Image.fromarray(np.random.default_rng(5).integers(0, 255, size=(40, 60, 3)).astype(np.uint8)).save(d / "ref.png")
    with (d / "metadata.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["video", "prompt", "control_video", "control_mask"])
        writer.writeheader()
        writer.writerows(rows)
    return tmp_path


def _overrides(root, shared_dir, *extra) -> list[str]:
    return ["experiment=demo", "model=tiny_vace", "boundary=full", f"paths.tiny_model_dir={shared_dir}/models",
            f"paths.output_dir={root}/run", f"data.cache_dir={root}/cache", f"data.metadata={root}/data/metadata.csv",
            "data.generate=null", f"data.num_frames={FRAMES}", f"data.height={SIZE}", f"data.width={SIZE}",
            "data.max_reject_fraction=0.5", "data.batch_size=2", "adapter.rank=4", "adapter.alpha=2",
            "optim.lr=1e-2", "optim.warmup_steps=0", "optim.scheduler=constant", "trainer.max_steps=4",
            "callbacks.checkpoint.every_n_train_steps=2", "trainer.log_every_n_steps=1", "callbacks.progress=null",
            "callbacks.validation=null", *extra]


def _lora(folder: Path) -> dict:
    return {p.name: load_file(str(p)) for p in sorted((folder / "lora" / "final").glob("*.safetensors"))}


def _keys(path: Path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def _expected_control(vae, spec, d: Path, control: str, mask: str | None) -> torch.Tensor:
    """The control channels of a row, from its files read as training reads them."""
    from wanexp.data.media import load_clip
    from wanexp.models.wan22.vace import control_channels

    video = load_clip(d / control, FRAMES, SIZE, SIZE)[None]
    if mask is None:
        m = torch.ones_like(video)
    else:
        m = ((load_clip(d / mask, FRAMES if mask.endswith(".mp4") else 1, SIZE, SIZE) + 1) / 2)
        m = m.expand(-1, FRAMES, -1, -1)[None]
    return control_channels(vae, video, m, spec.vae_stride)[0]


def test_vace_caches_trains_resumes_exports_and_samples_with_a_control_video(data, shared_dir, tmp_path, monkeypatch,
                                                                             capsys):
    from wanexp.cli import cache
    from wanexp.composition import build
    from wanexp.data.cache import CacheIndex
    from wanexp.data.media import load_clip, write_video
    from wanexp.errors import MediaError
    from wanexp.train import run

    root, d = data, data / "data"
    # 1. the cache: each clip's latents and control channels; the rows without a usable control video rejected
    monkeypatch.setattr("sys.argv", ["wanexp-cache", *_overrides(root, shared_dir)])
    cache.main()
    index = CacheIndex(root / "cache")
    latents = {Path(e["media"]).name: e["key"] for e in index.entries.values() if e["kind"] == "latent"}
    assert sorted(latents) == ["c0.mp4", "c1.mp4", "c2.mp4"]
    rejects = "".join(f.read_text() for f in sorted((root / "cache").glob("rejects*.jsonl")))
    assert "no control_video (a sample input of this model: set the control_video column)" in rejects
    assert f"control_video {d / 'gone.mp4'}: file not found" in rejects
    spec = build(compose_cfg(_overrides(root, shared_dir)).model)
    vae = spec.load_vae()
    for name, control, mask in (("c0.mp4", "k0.mp4", "m0.mp4"), ("c1.mp4", "k1.mp4", None),
                                ("c2.mp4", "k2.mp4", "m.png")):
        stored = index.load(latents[name])
        assert sorted(stored) == ["latents", "vace_context"] and stored["vace_context"].shape == (96, 3, 4, 4)
        expected = _expected_control(vae, spec, d, control, mask)
        torch.testing.assert_close(stored["vace_context"], expected, rtol=0, atol=1e-6)
    # the masks differ: c0's keeps its left half, c1's (none) generates everywhere
    assert float(index.load(latents["c1.mp4"])["vace_context"][64:].min()) == 1.0
    assert float(index.load(latents["c0.mp4"])["vace_context"][64:].min()) == 0.0

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

    # 3. ComfyUI names: the base blocks by default, the control blocks too with the vace.* targets
    final = root / "run" / "lora" / "final"
    base = _keys(final / "tiny_vace_lora_high_noise_comfyui.safetensors")
    assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in base
    assert "diffusion_model.blocks.3.ffn.2.alpha" in base and not any("vace_blocks" in k for k in base)
    both = run(compose_cfg(_overrides(root, shared_dir, f"paths.output_dir={root}/both", VACE_TARGETS,
                                      "trainer.max_steps=1")))
    assert both["global_step"] == 1
    comfy = _keys(root / "both" / "lora" / "final" / "tiny_vace_lora_high_noise_comfyui.safetensors")
    diffusers = _keys(root / "both" / "lora" / "final" / "tiny_vace_lora_high_noise_diffusers.safetensors")
    for kind in ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.o",
                 "ffn.0", "ffn.2"):
        for n in (0, 1):
            assert f"diffusion_model.vace_blocks.{n}.{kind}.lora_up.weight" in comfy
        assert f"diffusion_model.blocks.0.{kind}.lora_down.weight" in comfy
    assert "transformer.vace_blocks.1.attn2.to_out.0.lora_B.weight" in diffusers
    assert "transformer.blocks.2.ffn.net.0.proj.lora_A.weight" in diffusers
    assert not any("proj_in" in k or "proj_out" in k or "before_proj" in k for k in comfy | diffusers)

    # 4. wanexp-sample with the run's LoRA (both block kinds): every transformer call gets the control channels
    # training builds from the same files; a reference image adds its latent frame before them
    seen: list[torch.Tensor] = []

    def spy(module, args, kwargs):
        seen.append(kwargs["control_hidden_states"].clone())

    from diffusers import WanVACETransformer3DModel

    from wanexp.models.wan22 import pipeline

    generate = pipeline.generate

    def hooked(pipe, *args, **kwargs):
        hooks = [m.register_forward_pre_hook(spy, with_kwargs=True) for m in (pipe.transformer, pipe.transformer_2)]
        assert all(isinstance(m, WanVACETransformer3DModel) for m in (pipe.transformer, pipe.transformer_2))
        try:
            return generate(pipe, *args, **kwargs)
        finally:
            for h in hooks:
                h.remove()

    monkeypatch.setattr("wanexp.models.wan22.pipeline.generate", hooked)
    res = sample.main(["--run", str(root / "both"), "--prompt", "a", "--prompt", "b", "--steps", "2", "--guidance",
                       "1", "--device", "cpu", "--out", str(tmp_path / "out"),
                       "--control-video", str(d / "k0.mp4"), "--control-mask", str(d / "m0.mp4"),
                       "--control-video", str(d / "k1.mp4"), "--control-mask", str(d / "k1.mp4")])
    assert [e["control_video"] for e in res["samples"]] == [str(d / "k0.mp4"), str(d / "k1.mp4")]
    assert len(seen) == 4
    expected = [_expected_control(vae, spec, d, "k0.mp4", "m0.mp4"), _expected_control(vae, spec, d, "k1.mp4", None)]
    for k, got in enumerate(seen):
        assert (got[0] - expected[k // 2]).abs().max() < 1e-5, k
        assert (got[0] - expected[1 - k // 2]).abs().max() > 1e-3
    seen.clear()
    res = sample.main(["--run", str(root / "both"), "--prompt", "a", "--steps", "1", "--guidance", "1", "--device",
                       "cpu", "--out", str(tmp_path / "ref"), "--control-video", str(d / "k0.mp4"),
                       "--reference-image", str(d / "ref.png")])
    assert seen[0].shape[2] == 4 and float(seen[0][0, 64:, 0].abs().max()) == 0.0  # the reference's latent frame
    video = res["samples"][0]["file"]  # the reference frame is generated, then left out: the sample's 9 frames
    assert load_clip(video, FRAMES, SIZE, SIZE).shape[1] == FRAMES
    with pytest.raises(MediaError):
        load_clip(video, FRAMES + 1, SIZE, SIZE)
    assert (seen[0][0, :, 1:, :, :] - _expected_control(vae, spec, d, "k0.mp4", None)).abs()[16:32].max() < 1e-5

    # 5. a changed control video is another cache entry (the key covers the input files)
    write_video(d / "k1.mp4", _clip(12, 99), FPS)
    monkeypatch.setattr("sys.argv", ["wanexp-cache", *_overrides(root, shared_dir)])
    cache.main()
    again = CacheIndex(root / "cache")
    assert sum(e["kind"] == "latent" for e in again.entries.values()) == 4


def test_a_dataset_without_the_control_video_column_is_refused_in_one_line(data, shared_dir, monkeypatch, capsys):
    from wanexp.cli import cache

    d = data / "data"
    with (d / "plain.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["video", "prompt"])
        writer.writeheader()
        writer.writerows([{"video": f"c{i}.mp4", "prompt": "x"} for i in range(3)])
    monkeypatch.setattr("sys.argv", ["wanexp-cache", *_overrides(data, shared_dir, f"data.metadata={d / 'plain.csv'}")])
    with pytest.raises(SystemExit) as e:
        cache.main()
    err = capsys.readouterr().err
    assert e.value.code != 0 and err.count("\n") == 1, err
    assert "3 of 3 samples rejected" in err and "no control_video" in err and "set the control_video column" in err


def test_control_flags_are_one_line_before_any_weights_load(data, shared_dir, tmp_path, monkeypatch, capsys):
    from omegaconf import OmegaConf

    from wanexp.composition import build
    from wanexp.models.tiny import ensure_tiny_model

    def no_weights(name):
        raise AssertionError("a pipeline was loaded")

    monkeypatch.setattr("wanexp.models.wan22.pipeline.pipeline_class", no_weights)
    vace = tmp_path / "vace"
    vace.mkdir()
    OmegaConf.save(compose_cfg(_overrides(data, shared_dir)), vace / "config.yaml", resolve=True)
    ensure_tiny_model(build(compose_cfg(_overrides(data, shared_dir)).model))
    t2v = ensure_tiny_model(build(compose_cfg(["model=tiny_t2v14b",
                                               f"paths.tiny_model_dir={shared_dir}/models"]).model))
    k0, missing = data / "data" / "k0.mp4", tmp_path / "missing.mp4"
    cases = [
        (["--run", str(vace)], "--control-video given 0 time(s) for 1 --prompt(s) (model=tiny_vace takes a "
                               "control_video per sample)"),
        (["--run", str(vace), "--control-video", str(missing)], f"--control-video {missing}: file not found"),
        (["--run", str(vace), "--control-video", str(k0), "--control-mask", str(k0), "--control-mask", str(k0)],
         "--control-mask given 2 time(s) for 1 --prompt(s)"),
        (["--model-path", str(t2v), "--control-video", str(k0)], "--control-video: model=t2v14b takes no "
                                                                  "control_video"),
    ]
    from tests.helpers import assert_samples_refused

    assert_samples_refused(cases, capsys, tmp_path / "out")
    # a folder of VACE weights sampled without --run is the VACE group (its DiT class), not T2V-A14B's
    folder = Path(shared_dir) / "models" / "tiny_vace"
    assert sample._folder_model(folder).name == "vace14b" and sample._folder_model(t2v).name == "t2v14b"


def test_validation_videos_follow_each_held_out_clips_control_video(data, shared_dir, monkeypatch):
    """Validation samples prompt i with held-out sample i's control video (and mask) as the runner's inputs."""
    from wanexp.models.wan22 import pipeline
    from wanexp.train import run

    root, d = data, data / "data"
    given: list = []
    generate = pipeline.generate

    def spy(pipe, *args, **kwargs):
        given.append(kwargs["video"])
        return generate(pipe, *args, **kwargs)

    monkeypatch.setattr("wanexp.models.wan22.pipeline.generate", spy)
    base = [o for o in _overrides(root, shared_dir) if o != "callbacks.validation=null"]
    out = run(compose_cfg(base + [
        "trainer.max_steps=1", "callbacks.validation.every_n_steps=1", "callbacks.validation.at_start=false",
        "callbacks.validation.prompts=[a,b,c]", "callbacks.validation.seeds=[0]", "callbacks.validation.steps=1",
        "callbacks.validation.loss_samples=0", "data.val_fraction=0"]))
    assert out["global_step"] == 1 and len(given) == 3
    from wanexp.data.media import load_clip

    own = [(load_clip(d / f"k{i}.mp4", FRAMES, SIZE, SIZE) + 1) / 2 for i in range(3)]
    for v in given:
        assert any(torch.allclose(v[0].permute(1, 0, 2, 3), o, atol=1e-6) for o in own)
    assert len({tuple(v.flatten()[:64].tolist()) for v in given}) == 3


@pytest.mark.slow  # two train.py processes
def test_vace_trains_with_ddp_on_two_ranks_from_windows_of_the_clips(data, shared_dir):
    """2 ranks (DDP over gloo) from the clips themselves, each sample a window of its clip at stride 2 whose control
    video (and mask video) is read at the same frames: both experts train, the ranks end with the same LoRA and the
    ComfyUI file names the control blocks."""
    import json

    from tests.conftest import run_cli

    res = run_cli(_overrides(data, shared_dir, "parallel=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                             "parallel.strategy.timeout_s=120", "data.use_cache=false", "data.window=uniform",
                             "data.windows_per_clip=2", "data.frame_stride=2", "data.num_frames=5", "data.batch_size=1",
                             "trainer.max_steps=2", VACE_TARGETS), timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    status = json.loads((data / "run" / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 2 and status["world_size"] == 2
    assert status["replicas_in_sync"] is True
    files = _lora(data / "run")
    comfy = next(sd for name, sd in files.items() if "diffusers" not in name and "high" in name)
    assert any(k.startswith("diffusion_model.vace_blocks.") for k in comfy)
