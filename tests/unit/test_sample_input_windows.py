"""A sample's inputs follow its clip's window (ModelSpec.load_sample_input's ``start`` and ``stride``, given by
wanexp.data.datamodule.load_media): a control video, pose video or audio is read at the frames (times) of the window
the clip holds, a short clip's fitted window included; a control video too short for the window is one line, not a
shifted window; and the families take any window (S2V: stride 1, one audio feature per frame)."""
from __future__ import annotations

import wave

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import compose_cfg
from wanexp.composition import build
from wanexp.data.datamodule import load_media
from wanexp.data.media import load_clip, write_video
from wanexp.data.metadata import Sample
from wanexp.errors import ConfigError, MediaError

H, W, FPS = 32, 48, 16


def _video(path, frames: int):
    """Frame k a flat grey of level 20 k: every frame tells its index."""
    levels = (np.arange(frames) * 20).astype(np.uint8)
    write_video(path, np.broadcast_to(levels[:, None, None, None], (frames, H, W, 3)).copy(), fps=FPS)
    return str(path)


def _load(spec, clip, inputs, frames, stride, start):
    sample = Sample(path=clip, prompt="", kind="video", inputs=tuple(inputs))
    return load_media(sample, frames, H, W, stride, start, FPS, spec.load_sample_input)


@pytest.fixture(scope="module")
def vace_spec(shared_dir):
    return build(compose_cfg(["model=tiny_vace", f"paths.tiny_model_dir={shared_dir}/models"]).model)


def test_a_control_video_follows_the_clips_window_frame_for_frame(vace_spec, tmp_path):
    clip = _video(tmp_path / "clip.mp4", 12)
    item = _load(vace_spec, clip, [("control_video", clip), ("control_mask", clip)], 3, 2, 4)
    assert torch.equal(item["control_video"], item["pixels"]) and torch.equal(item["control_mask"], item["pixels"])
    assert not torch.equal(item["pixels"], load_clip(clip, 3, H, W, 2, fps=FPS))  # not the file's first frames
    # a clip too short for its window holds a fitted one (stride lowered): its inputs follow that window
    short = _video(tmp_path / "short.mp4", 6)
    item = _load(vace_spec, short, [("control_video", short)], 4, 2, 0)
    assert torch.equal(item["control_video"], item["pixels"])


def test_a_control_video_too_short_for_the_window_is_one_line(vace_spec, tmp_path):
    clip, control = _video(tmp_path / "clip.mp4", 12), _video(tmp_path / "control.mp4", 6)
    with pytest.raises(MediaError) as e:
        _load(vace_spec, clip, [("control_video", control)], 3, 2, 4)
    line = str(e.value)
    assert line.startswith(f"{control}: video has 6 frames but the window needs frames 4 to 8 (every 2)")
    assert "\n" not in line
    assert _load(vace_spec, clip, [("control_video", control)], 3, 2, 0)["control_video"].shape == (3, 3, H, W)


def test_a_pose_video_follows_the_clips_window(shared_dir, tmp_path):
    from hydra.utils import instantiate

    from wanexp.models.tiny import ensure_tiny_model

    spec = instantiate(compose_cfg(["model=tiny_animate", f"paths.tiny_model_dir={shared_dir}"]).model,
                       _convert_="all")
    ensure_tiny_model(spec)
    clip = _video(tmp_path / "clip.mp4", 12)
    item = _load(spec, clip, [("pose_video", clip), ("face_video", clip)], 3, 2, 4)
    assert torch.equal(item["pose_video"], item["pixels"])  # the clip is at its own size
    face = spec.face_size()
    assert torch.equal(item["face_video"], load_clip(clip, 3, face, face, 2, start=4, fps=FPS))


def test_the_audio_follows_the_clips_window(tmp_path):
    spec = build(compose_cfg(["model=tiny_s2v", f"paths.tiny_model_dir={tmp_path}/models"]).model)
    rate = 16000
    ramp = (np.arange(rate) % 30000).astype(np.int16)  # one second, each sample its own value
    with wave.open(str(tmp_path / "talk.wav"), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(ramp.tobytes())
    audio = spec.load_sample_input("audio", str(tmp_path / "talk.wav"), 3, FPS, start=4)
    want = ramp[4 * rate // FPS: 7 * rate // FPS].astype(np.float32) / 32768  # frames 4-6: 0.25 s to 0.4375 s
    assert audio.shape == (3 * rate // FPS,) and np.allclose(audio.numpy(), want, atol=1e-4)


@pytest.mark.parametrize("model, overrides, refused", [
    ("tiny_vace", ["data.frame_stride=2", "data.window=uniform"], None),
    ("tiny_animate", ["data.frame_stride=2", "data.window=random"], None),
    ("tiny_s2v", ["data.window=uniform"], None),
    ("tiny_s2v", ["data.frame_stride=2"], "data.frame_stride=2: S2V clips keep every frame"),
])
def test_the_families_take_any_window(model, overrides, refused):
    from wanexp.models.family import load_class

    cfg = compose_cfg([f"model={model}", *overrides])
    data = OmegaConf.to_container(cfg.data, resolve=True)
    check = load_class(cfg.model._target_).check_groups
    if refused is None:
        check(data, None)
        return
    with pytest.raises(ConfigError) as e:
        check(data, None)
    assert str(e.value).startswith(refused) and "\n" not in str(e.value)
