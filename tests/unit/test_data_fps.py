"""Frame rate: clips train resampled to their dataset's rate (data.fps, default model.fps), each frame the source frame
nearest its time, so a 60 fps and a 15 fps clip give the same seconds of motion; a clip too short at that rate is a
reject with its reason; the cache key holds the rate."""
from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import compose_cfg
from wanexp.data.media import MediaError, load_clip, write_video
from wanexp.data.metadata import Sample
from wanexp.data.probe import probe_sample
from wanexp.data.windows import resampled_frames, source_frame
from wanexp.errors import ConfigError

LEVELS_PER_S = 200  # a frame's gray level is its time: 200 levels a second


def _timed_clip(path: Path, fps: int, seconds: float) -> Path:
    """A gray clip whose frame at time t has the level 200 t, so a decoded frame tells the time it shows."""
    n = round(fps * seconds)
    write_video(path, np.stack([np.full((32, 32, 3), round(LEVELS_PER_S * i / fps), np.uint8) for i in range(n)]),
                fps=fps)
    return path


def _times(pixels) -> np.ndarray:
    """The time (s) each frame of a loaded clip (3, T, H, W) in [-1, 1] shows."""
    levels = (pixels.mean(dim=(0, 2, 3)).numpy() + 1) * 127.5
    return levels / LEVELS_PER_S


def test_resampling_picks_the_source_frame_nearest_each_time():
    assert [source_frame(k, 60, 24) for k in range(5)] == [0, 3, 5, 8, 10]  # times 0, 1/24, ... at 2.5 frames each
    assert [source_frame(k, 15, 24) for k in range(6)] == [0, 1, 1, 2, 3, 3]  # a lower rate repeats frames
    assert [source_frame(k, Fraction(30000, 1001), 30) for k in range(3)] == [0, 1, 2]  # NTSC: the same frames
    assert [source_frame(k, 24, None) for k in range(3)] == [0, 1, 2]  # no target: the frames as they are
    assert resampled_frames(60, 60, 24) == 24 and resampled_frames(15, 15, 24) == 24  # one second each
    assert resampled_frames(17, 24, 24) == 17 and resampled_frames(17, None, 24) == 17
    assert all(source_frame(resampled_frames(n, src, 24) - 1, src, 24) <= n - 1 < source_frame(
        resampled_frames(n, src, 24), src, 24) for n in (1, 9, 40) for src in (12, 15, 24, 25, 60))


@pytest.mark.parametrize("stride", [1, 2])
def test_a_60_and_a_15_fps_clip_give_the_same_seconds_of_motion(tmp_path, stride):
    fast, slow = _timed_clip(tmp_path / "fast.mp4", 60, 1.0), _timed_clip(tmp_path / "slow.mp4", 15, 1.0)
    wanted = np.arange(9) * stride / 24  # data.fps 24, then every stride-th frame of that
    for path, rate in ((fast, 60), (slow, 15)):
        times = _times(load_clip(path, 9, 32, 32, stride, fps=24))
        picked = np.array([source_frame(k * stride, rate, 24) / rate for k in range(9)])
        assert np.abs(times - picked).max() < 1.5 / LEVELS_PER_S  # exactly those frames (codec rounding)
        assert np.abs(times - wanted).max() <= 0.5 / rate + 1.5 / LEVELS_PER_S  # the nearest to each time
    # each at its own frames: 9 frames are 0.13 s of the 60 fps clip and 0.53 s of the 15 fps one
    assert _times(load_clip(fast, 9, 32, 32))[-1] == pytest.approx(8 / 60, abs=0.01)
    assert _times(load_clip(slow, 9, 32, 32))[-1] == pytest.approx(8 / 15, abs=0.01)


def test_the_probe_counts_frames_at_the_rate_and_rejects_a_clip_too_short_there(tmp_path):
    fast, slow = _timed_clip(tmp_path / "fast.mp4", 60, 1.0), _timed_clip(tmp_path / "slow.mp4", 15, 1.0)
    short = _timed_clip(tmp_path / "short.mp4", 60, 1 / 3)  # 20 frames: 17 at 60 fps, 8 at 24
    video = {p: Sample(str(p), "x", "video") for p in (fast, slow, short)}
    r = probe_sample(video[fast], 17, 1, 32, 32, fps=24)
    assert (r.ok, r.frames, r.source_fps, r.warnings) == (True, 24, 60, ())
    r = probe_sample(video[slow], 17, 1, 32, 32, fps=24)
    assert (r.ok, r.frames, r.warnings) == (True, 24, ("low frame rate: 15 fps, resampled to 24 fps by repeating "
                                                       "frames",))
    r = probe_sample(video[short], 17, 1, 32, 32, fps=24)
    assert r.reason == "too few frames: 20 at 60 fps (0.33 s) are 8 at 24 fps, needs 17 (num_frames=17, at frame_stride 1)"
    assert probe_sample(video[short], 17, 1, 32, 32).ok  # at its own 20 frames it fits
    with pytest.raises(MediaError, match=r"short.mp4: video has 20 frames at 60 fps \(0.33 s\), 8 at 24 fps, but 17 "):
        load_clip(short, 17, 32, 32, fps=24)  # (data.probe=false: the loader says it, never pads)
    r = probe_sample(video[fast], 17, 2, 32, 32, fps=24)  # 24 frames at 24 fps: stride 2 needs 33
    assert r.warnings == ("short video: 24 frames, so frame_stride 2 is lowered to 1",)


def _datamodule(tmp_path, *extra):
    from wanexp.composition import build, build_datamodule, prepare_model_folder

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for name, fps, seconds in (("fast", 60, 1.0), ("slow", 15, 1.0), ("short", 60, 1 / 3)):
        _timed_clip(data / f"{name}.mp4", fps, seconds)
    (data / "meta.csv").write_text("video,prompt\nfast.mp4,a\nslow.mp4,b\nshort.mp4,c\n")
    cfg = compose_cfg(["experiment=demo", f"data.metadata={data}/meta.csv", "data.generate=null", "data.cache_dir=null",
                       "data.num_frames=9", "data.height=32", "data.width=32", "data.max_reject_fraction=0.5",
                       f"data.rejects={tmp_path}/rejects.jsonl", *extra])
    spec = build(cfg.model)
    prepare_model_folder(spec, cfg.boundary.name)  # the datamodule reads the model's tokenizer
    dm = build_datamodule(cfg, spec)
    dm.setup()
    return dm


def test_a_run_resamples_to_the_models_rate_unless_data_fps_says_otherwise(tmp_path):
    dm = _datamodule(tmp_path)  # model=tiny: 24 fps (TI2V-5B's)
    assert [Path(s.path).name for s in dm.dataset.samples] == ["fast.mp4", "slow.mp4"] and dm.dataset.fps == [24, 24]
    assert dm.report["rejected"] == 1 and "short.mp4" in (tmp_path / "rejects.jsonl").read_text()
    fast, slow = (_times(dm.dataset[i]["pixels"]) for i in range(2))
    assert np.abs(fast - np.arange(9) / 24).max() < 0.5 / 60 + 0.01 and np.abs(slow - fast).max() < 0.5 / 15 + 0.01
    dm = _datamodule(tmp_path, "data.fps=12")
    assert dm.dataset.fps == [12, 12] and _times(dm.dataset[0]["pixels"])[-1] == pytest.approx(8 / 12, abs=0.01)
    dm = _datamodule(tmp_path, f"data.datasets=[{{metadata:'{tmp_path}/data/meta.csv',fps:60}}]")  # a dataset's own
    assert dm.dataset.fps == [60, 60, 60] and dm.report["rejected"] == 0  # at 60 fps the 20 frames fit
    assert _times(dm.dataset[1]["pixels"])[-1] == pytest.approx(8 / 60, abs=0.01)  # 15 fps: frames repeat


@pytest.mark.parametrize("override, says", [
    ("data.fps=0", "data.fps=0"),
    ("data.datasets=[{metadata:m.csv,fps:0}]", "data.datasets.0.fps=0: must be an integer >= 1"),
    ("data.datasets=[{metadata:m.csv,fps:2.5}]", "data.datasets.0.fps=2.5: must be an integer >= 1"),
])
def test_a_bad_frame_rate_is_one_line_naming_the_key(tmp_path, override, says):
    from wanexp.config import check_config
    from wanexp.composition import build, build_datamodule

    cfg = compose_cfg(["experiment=demo", override])
    with pytest.raises(ConfigError, match=re.escape(says)):
        check_config(cfg)
        build_datamodule(cfg, build(cfg.model))
