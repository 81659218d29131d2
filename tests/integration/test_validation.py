"""The validation callback: videos of the base model at step 0, of the LoRA every N steps and at the end; a
deterministic held-out loss on rows never trained on; a distilled LoRA sampled on its student steps vs the teacher."""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from tests.integration.conftest import tiny_run
from wanexp.callbacks.sweep import point_row
from wanexp.callbacks.validation import Validation
from wanexp.data.datamodule import heldout_rows

# one prompt, a few sampling steps: seconds on CPU
FAST = ["callbacks.validation.every_n_steps=2", "callbacks.validation.prompts=[a red ball rolls]",
        "callbacks.validation.seeds=[0]", "callbacks.validation.steps=2", "callbacks.validation.loss_samples=2",
        "data.val_fraction=0.2"]


def _frames(path: Path) -> int:
    with av.open(str(path)) as c:
        return sum(1 for _ in c.decode(video=0))


def _rate(path: Path):
    with av.open(str(path)) as c:
        return c.streams.video[0].average_rate


def _logged(out: Path, key: str) -> dict[int, float]:
    (metrics,) = (out / "logs").glob("version_*/metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


def _callback(result) -> Validation:
    return next(c for c in result["trainer"].callbacks if isinstance(c, Validation))


def test_videos_at_step_0_every_n_steps_and_the_end_and_a_deterministic_heldout_loss(shared_dir, tmp_path):
    r = tiny_run(shared_dir, tmp_path / "run", [*FAST, "trainer.max_steps=5"])
    out, cfg = Path(r["output_dir"]), r["cfg"]
    v = out / "validation"
    # the base model once at step 0 (a fresh LoRA is zero: no LoRA video there), the LoRA at 2, 4 and the end (5)
    assert sorted(p.relative_to(v).as_posix() for p in v.rglob("*.mp4")) == [
        "step_000000/p0_s0_base.mp4", "step_000002/p0_s0.mp4", "step_000004/p0_s0.mp4", "step_000005/p0_s0.mp4"]
    assert all(_frames(p) == cfg.data.num_frames for p in v.rglob("*.mp4"))
    assert {_rate(p) for p in v.rglob("*.mp4")} == {cfg.model.fps} == {24}  # the model's native rate
    # the strip: under the video's name and prompt, a row of the base's frames (from step 0) and one of the last
    # LoRA's, each frame enlarged to the strip's tile size (generation.render_strip places them)
    from PIL import Image

    from wanexp.generation import StripGroup, render_strip

    strip = np.asarray(Image.open(v / "strip.png"))
    frames, numbers = _callback(r)._before["p0_s0"]
    expected, boxes = render_strip([StripGroup("p0_s0: a red ball rolls", numbers,
                                               [("base", frames), ("LoRA step 5", frames)])])
    assert strip.shape == expected.shape and numbers == [0, 2, 3, 5, 6, 8]
    scale = boxes[(0, 0, 0)][2] // cfg.data.height
    for c, frame in enumerate(frames):
        top, left, h, w = boxes[(0, 0, c)]
        assert (strip[top:top + h, left:left + w] == frame.repeat(scale, 0).repeat(scale, 1)).all()
    title = boxes[(0, "title")]
    assert (strip[:title[2]] == expected[:title[2]]).all()  # the title as rendered from its label
    # val/loss logged at each validation, in status.jsonl, and read by the sweep summary
    logged = _logged(out, "val/loss")
    assert sorted(logged) == [0, 2, 4, 5] and all(x > 0 for x in logged.values())
    history = [json.loads(x) for x in (out / "status.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history if "val_loss" in h] == [0, 2, 4, 5]
    assert point_row(out)["val_loss"] == pytest.approx(logged[5])
    # the held-out rows: never in the training set; the split depends on the file only, not on the row order
    dm = r["trainer"].datamodule
    held = {s.path for s in dm.val_dataset.samples}
    assert held and held.isdisjoint(s.path for s in dm.dataset.samples)
    paths = [f"clip_{i}.mp4" for i in range(50)]
    shuffled = random.Random(0).sample(paths, len(paths))
    split = dict(zip(paths, heldout_rows(paths, 0.2)))
    assert dict(zip(shuffled, heldout_rows(shuffled, 0.2))) == split and 0 < sum(split.values()) < 50
    # deterministic: the final weights evaluated twice give the value logged at the end, exactly
    cb = _callback(r)
    cb.prompts = []
    module, trainer = r["module"], r["trainer"]
    with torch.no_grad():
        again = [cb._run(trainer, module, 5, base=False)["metrics"]["val/loss"] for _ in range(2)]
    assert again[0] == again[1] == cb.results[-1]["metrics"]["val/loss"]


def test_a_distilled_lora_validates_on_its_student_steps_against_the_teacher(shared_dir, tmp_path, monkeypatch):
    import wanexp.models.wan22.pipeline as wan_pipeline

    calls = []
    generate = wan_pipeline.generate

    def spy(pipe, prompt, seed, s, steps, guidance, negative, *args, **kwargs):
        calls.append((steps, guidance, negative))
        return generate(pipe, prompt, seed, s, steps, guidance, negative, *args, **kwargs)

    monkeypatch.setattr(wan_pipeline, "generate", spy)
    r = tiny_run(shared_dir, tmp_path / "run", [*FAST, "objective=dmd", "objective.generator_every=1",
                                                "trainer.max_steps=2"])
    out = Path(r["output_dir"])
    objective = r["module"].objective
    # the teacher (the base model, once) is the one the student was distilled toward: the objective's CFG scale and
    # negative prompt, not callbacks.validation's
    assert calls[0] == (2, objective.guidance_scale, objective.negative_prompt) and objective.guidance_scale != 5.0
    assert [c[1] for c in calls[1:]] == [1.0, 1.0]  # the student at steps 0 and 2: no CFG
    results = _callback(r).results
    assert [x["step"] for x in results] == [0, 2]
    for x in results:  # the transformer saw exactly the training's student steps, one call each (no CFG pass)
        assert x["timesteps"]["p0_s0"] == pytest.approx([1000 * s for s in objective.student_sigmas], rel=1e-5)
    for key in ("val/teacher_latent_mse", "val/teacher_psnr", "val/teacher_ssim"):
        assert sorted(_logged(out, key)) == [0, 2]
    gap = results[-1]["metrics"]
    assert gap["val/teacher_latent_mse"] > 0 and 0 < gap["val/teacher_ssim"] <= 1 and gap["val/teacher_psnr"] > 0
    assert (out / "validation" / "step_000000" / "p0_s0_base.mp4").is_file()  # the teacher, logged once
    assert (out / "validation" / "step_000002" / "p0_s0.mp4").is_file()


def test_at_start_false_skips_the_step_0_validation(monkeypatch):
    """callbacks.validation.at_start=false: a fresh run starts training at once (the base model's videos take
    minutes on A14B); the first validation comes at every_n_steps."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(Validation, "_validate", lambda self, trainer, module, base=False: calls.append(base))
    kwargs = dict(output_dir="unused", every_n_steps=2, prompts=["p"], seeds=[0], first_frame=False,
                  fps=8, steps=2, guidance=1.0, negative_prompt="", loss_sigmas=[0.5],
                  loss_samples=0, timeout_s=60)
    fresh = SimpleNamespace(global_step=0)
    Validation(**kwargs).on_train_start(fresh, None)
    assert calls == [True]
    Validation(**kwargs, at_start=False).on_train_start(fresh, None)
    assert calls == [True]


def test_a_run_from_the_cache_samples_with_cached_prompts_a_tiled_decode_and_never_loads_umt5(
        shared_dir, tmp_path, monkeypatch):
    """The cache command encodes validation's prompts and negative prompt with the captions, so a run from the cache
    validates without the text encoder (UMT5-XXL: 11 GiB); the VAE decodes in tiles."""
    from tests.integration.test_cache import _cfg
    from wanexp.cli.cache import build_cache
    from wanexp.models.family import ModelSpec

    val = [*FAST, "callbacks.validation.at_start=false", "callbacks.validation.negative_prompt=blurry static"]
    cache = tmp_path / "cache"
    stats = build_cache(_cfg(shared_dir, cache, *val))
    assert stats["texts"] == 10 + 2  # the captions, the validation prompt and the negative prompt

    def no_text_encoder(self):
        raise AssertionError("validation loaded the text encoder")

    tiles = []
    import diffusers

    decode = diffusers.AutoencoderKLWan.decode
    monkeypatch.setattr(ModelSpec, "load_text_encoder", no_text_encoder)
    monkeypatch.setattr(diffusers.AutoencoderKLWan, "decode",
                        lambda self, *a, **k: tiles.append(self.use_tiling) or decode(self, *a, **k))
    r = tiny_run(shared_dir, tmp_path / "run", ["model=tiny", f"data.cache_dir={cache}", "trainer.max_steps=2",
                                                *val])
    assert r["module"].encoders is None
    assert (Path(r["output_dir"]) / "validation" / "step_000002" / "p0_s0.mp4").is_file()
    assert tiles == [True]  # decoded tiled, and the VAE left untiled afterwards
    assert not _callback(r)._vae.use_tiling


def test_validation_shapes_default_to_the_first_bucket_and_can_be_every_bucket():
    from types import SimpleNamespace

    kwargs = dict(output_dir="unused", every_n_steps=2, prompts=["p"], seeds=[0], first_frame=False, fps=8, steps=2,
                  guidance=1.0, negative_prompt="", loss_sigmas=[0.5], loss_samples=0, timeout_s=60)
    dm = SimpleNamespace(resolutions=[(64, 96), (96, 64)], height=32, width=32, num_frames=5)
    assert Validation(**kwargs).sizes(dm) == [{"height": 64, "width": 96, "frames": 5}]
    assert [s["width"] for s in Validation(**kwargs, shapes="buckets").sizes(dm)] == [96, 64]
    assert Validation(**kwargs, shapes=[[32, 64, 9]]).sizes(dm) == [{"height": 32, "width": 64, "frames": 9}]
    flat = SimpleNamespace(resolutions=None, height=32, width=48, num_frames=5)
    assert Validation(**kwargs).sizes(flat) == [{"height": 32, "width": 48, "frames": 5}]
    from wanexp.errors import ConfigError

    for bad in ("all", [[32]]):  # a frame count off the model's frame rule: the config rules (test_config)
        with pytest.raises(ConfigError, match="callbacks.validation.shapes"):
            Validation(**kwargs, shapes=bad)


@pytest.mark.parametrize("strategy, student, kib, refused", [
    ("DDPStrategy", None, 12, True),  # both experts (2 x 6 KiB of bf16) over 90 % of a 12 KiB "card": refused
    ("DDPStrategy", None, 16, False),  # they fit
    ("FSDPStrategy", None, 12, False),  # sharded over the ranks
    ("DDPStrategy", (999, 500), 12, False),  # a distilled one-expert adapter never needs the other expert
])
def test_a_one_expert_a14b_run_that_cannot_hold_both_experts_for_validation_stops_at_start(
        tmp_path, monkeypatch, strategy, student, kib, refused):
    """Under DDP rank 0 samples with the whole other expert (26.6 GiB for A14B): on a GPU that cannot hold both, the
    run stops in setup (before configure_model loads any weight) with one line saying what to set."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from wanexp.errors import ConfigError
    from wanexp.objectives.base import StudentSteps

    for folder in ("transformer", "transformer_2"):  # 6 KiB of bf16 weights each, read from the headers only
        (tmp_path / folder).mkdir()
        save_file({"a": torch.zeros(2, 1024, dtype=torch.bfloat16), "b": torch.zeros(1024, dtype=torch.bfloat16)},
                  str(tmp_path / folder / "m.safetensors"))
    from wanexp.models.family import ModelSpec
    from wanexp.models.wan22.spec import WanSpec

    spec = SimpleNamespace(experts=["high", "low"], boundary_ratio=0.9, path=tmp_path,
                           expert_folders=WanSpec.expert_folders, encoder_folders=WanSpec.encoder_folders)
    spec.load_bytes = lambda experts, encoders: ModelSpec.load_bytes(spec, experts, encoders)
    objective = SimpleNamespace(student_steps=lambda: StudentSteps(student, 5.0) if student else None)
    module = SimpleNamespace(spec=spec, expert_names=["low"], objective=objective, boundary_name="low")
    trainer = SimpleNamespace(strategy=type(strategy, (), {})(), world_size=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=kib * 2**10))
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    cb = Validation(output_dir=str(tmp_path), every_n_steps=2, prompts=["p"], seeds=[0], first_frame=False, fps=8,
                    steps=2, guidance=1.0, negative_prompt="", loss_sigmas=[0.5], loss_samples=0, timeout_s=60)
    if refused:
        with pytest.raises(ConfigError, match="set parallel=fsdp.*callbacks.validation.prompts=\\[\\]"):
            cb._check_other_expert_fits(trainer, module)
    else:
        cb._check_other_expert_fits(trainer, module)


def _wide_image(path: Path, seed: int = 0) -> Path:
    """A 40x120 image of noise: covering a 64x64 sample crops its centre."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    Image.fromarray((torch.rand(40, 120, 3, generator=g) * 255).to(torch.uint8).numpy()).save(path)
    return path


@pytest.mark.parametrize("model", ["tiny", "tiny_i2v14b"])
def test_validation_images_condition_every_video_cropped_as_training_crops(shared_dir, tmp_path, monkeypatch, model):
    """callbacks.validation.images: prompt i is sampled image-to-video from image i, resized and centre-cropped to
    the shape as training crops a clip (not the data's first frames): TI2V's clean latent frame 0, I2V-A14B's 16
    image-condition channels are that image's latents, in every transformer call of the base and the LoRA."""
    import wanexp.models.wan22.pipeline as wan_pipeline
    from wanexp.data.media import load_clip
    from wanexp.models.wan22.encoders import encode_image_condition, encode_video

    seen: list[torch.Tensor] = []
    generate = wan_pipeline.generate

    def spy(pipe, *args, **kwargs):
        i2v = pipe.transformer.config.in_channels != pipe.transformer.config.out_channels

        def hook(m, a, kw):  # I2V: noisy 16 + mask 4 + image 16 channels; TI2V: the clean first latent frame
            seen.append(kw["hidden_states"][:, 20:] if i2v else kw["hidden_states"][:, :, :1])
        hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in {pipe.transformer, pipe.transformer_2}
                 if m is not None]
        try:
            return generate(pipe, *args, **kwargs)
        finally:
            for h in hooks:
                h.remove()

    monkeypatch.setattr(wan_pipeline, "generate", spy)
    images = [_wide_image(tmp_path / "a.png", 0), _wide_image(tmp_path / "b.png", 1)]
    r = tiny_run(shared_dir, tmp_path / "run", [
        f"model={model}", "boundary=full", "trainer.max_steps=2", "callbacks.validation.every_n_steps=2",
        "callbacks.validation.prompts=[a red ball,a blue ball]", "callbacks.validation.steps=1",
        "callbacks.validation.guidance=1.0", "callbacks.validation.loss_samples=0",
        f"callbacks.validation.images=[{images[0]},{images[1]}]"])
    cfg, dm = r["cfg"], r["trainer"].datamodule
    d = cfg.data
    vae = r["module"].spec.load_vae()

    def latents(pixels: torch.Tensor) -> torch.Tensor:  # (3, H, W) -> what conditions the transformer
        if model == "tiny":
            return encode_video(vae, pixels[None, :, None])
        return encode_image_condition(vae, pixels[None], d.num_frames)

    expected = [latents(load_clip(p, 1, d.height, d.width)[:, 0]) for p in images]
    clip = latents(dm.first_frames(1, d.height, d.width)[0])  # without images: the data's first frame
    assert len(seen) == 4  # the base at step 0 and the LoRA at step 2, each 2 prompts x 1 step
    for k, cond in enumerate(seen):
        assert (cond - expected[k % 2]).abs().max() < 1e-2
        assert (cond - expected[1 - k % 2]).abs().max() > 0.1 and (cond - clip).abs().max() > 0.1


def test_validation_images_are_checked_before_the_run_starts(shared_dir, tmp_path):
    """One image per prompt, each a readable image file, on a model that samples image-to-video: else one line at
    start (the config is checked, and the callback built, before any weights load)."""
    from tests.conftest import compose_cfg
    from wanexp.config import check_config
    from wanexp.errors import ConfigError

    good = _wide_image(tmp_path / "good.png")
    (tmp_path / "bad.png").write_text("not a png")
    kwargs = dict(output_dir=str(tmp_path), every_n_steps=2, prompts=["p", "q"], seeds=[0], first_frame=False,
                  fps=8, steps=2, guidance=1.0, negative_prompt="", loss_sigmas=[0.5], loss_samples=0, timeout_s=60)
    assert Validation(**kwargs, images=[good, good]).images == [str(good)] * 2
    for images, expected in (([good], "has 1 image(s) for 2 prompt(s): give one image per prompt"),
                             ([good, tmp_path / "missing.png"], f"{tmp_path / 'missing.png'}: file not found"),
                             ([good, tmp_path / "bad.png"], f"{tmp_path / 'bad.png'}: cannot read image")):
        with pytest.raises(ConfigError, match="^callbacks.validation.images") as e:
            Validation(**kwargs, images=images)
        assert expected in str(e.value) and "\n" not in str(e.value)
    cfg = compose_cfg(["experiment=demo", "model=tiny_t2v14b", f"paths.tiny_model_dir={shared_dir}/models",
                       f"callbacks.validation.images=[{good}]", "callbacks.validation.prompts=[p]"])
    with pytest.raises(ConfigError, match="callbacks.validation.images with model=tiny_t2v14b: the model has no "
                                          "image conditioning"):
        check_config(cfg)
