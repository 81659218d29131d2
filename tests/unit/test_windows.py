"""Frame windows: the pure start-frame functions of ``wanexp.data.windows`` and ``load_clip(..., start=...)``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import count_decoding
from wanexp.data import media as media_mod
from wanexp.data.media import MediaError, load_clip, write_video
from wanexp.data.metadata import Sample
from wanexp.data.windows import (
    RANDOM_START,
    WINDOW_MODES,
    expand,
    fit_window,
    random_start,
    window_span,
    window_starts,
)


# ----------------------------------------------------------------------------- window_starts
def test_modes_and_span() -> None:
    assert WINDOW_MODES == ("first", "uniform", "chunks", "random")
    assert window_span(17, 1) == 17
    assert window_span(17, 2) == 33
    assert window_span(1, 5) == 1


@pytest.mark.parametrize("mode", ["first", "uniform", "chunks"])
def test_exactly_one_window(mode: str) -> None:
    assert window_starts(17, 17, 1, mode, count=4) == [0]
    assert window_starts(33, 17, 2, mode, count=4) == [0]


@pytest.mark.parametrize("mode", ["first", "uniform", "chunks"])
def test_shorter_than_one_window_gives_start_0(mode: str) -> None:
    assert window_starts(16, 17, 1, mode, count=3) == [0]
    assert window_starts(32, 17, 2, mode, count=3) == [0]  # the loader lowers the stride
    assert window_starts(0, 17, 1, mode, count=3) == [0]


def test_first() -> None:
    assert window_starts(100, 17, 1, "first") == [0]
    assert window_starts(100, 17, 2, "first", count=5) == [0]


def test_uniform_spreads_from_start_to_end() -> None:
    # 100 frames, span 17: starts 0 .. 83; 4 windows at round(i * 83 / 3) = 0, 27.67, 55.33, 83
    starts = window_starts(100, 17, 1, "uniform", count=4)
    assert starts == [0, 28, 55, 83]
    assert starts[-1] + window_span(17, 1) == 100  # the last window ends at the last frame
    assert window_starts(100, 17, 1, "uniform", count=2) == [0, 83]
    assert window_starts(100, 17, 1, "uniform", count=1) == [0]
    # rounding is half up: last = 9, count 3 -> 0, 4.5, 9
    assert window_starts(26, 17, 1, "uniform", count=3) == [0, 5, 9]


def test_uniform_stride_2() -> None:
    # span 33 in 100 frames: starts 0 .. 67
    starts = window_starts(100, 17, 2, "uniform", count=3)
    assert starts == [0, 34, 67]
    assert starts[-1] + (17 - 1) * 2 == 99


def test_uniform_count_larger_than_possible_starts() -> None:
    # 19 frames, span 17: only starts 0, 1, 2 exist -> three distinct windows, not ten
    assert window_starts(19, 17, 1, "uniform", count=10) == [0, 1, 2]
    assert window_starts(18, 17, 1, "uniform", count=3) == [0, 1]
    with pytest.raises(ValueError, match="count"):
        window_starts(100, 17, 1, "uniform", count=0)


def test_chunks() -> None:
    assert window_starts(100, 17, 1, "chunks", count=0) == [0, 17, 34, 51, 68]  # 85..99 is a short tail
    assert window_starts(100, 17, 1, "chunks", count=-1) == [0, 17, 34, 51, 68]
    assert window_starts(100, 17, 1, "chunks", count=2) == [0, 17]
    assert window_starts(100, 17, 1, "chunks", count=50) == [0, 17, 34, 51, 68]  # more than fit
    assert window_starts(102, 17, 1, "chunks", count=0) == [0, 17, 34, 51, 68, 85]  # exactly six
    # stride 2: span 33
    assert window_starts(100, 17, 2, "chunks", count=0) == [0, 33, 66]
    assert window_starts(98, 17, 2, "chunks", count=0) == [0, 33]
    for s in window_starts(1000, 17, 3, "chunks", count=0):  # non-overlapping, each inside the clip
        assert s % window_span(17, 3) == 0 and s + window_span(17, 3) <= 1000


def test_random_and_bad_arguments() -> None:
    assert window_starts(100, 17, 1, "random", count=4) == []
    with pytest.raises(ValueError, match="window mode"):
        window_starts(100, 17, 1, "middle")
    with pytest.raises(ValueError):
        window_starts(100, 0, 1, "first")
    with pytest.raises(ValueError):
        window_starts(100, 17, 0, "first")


def test_single_frame_windows() -> None:
    assert window_starts(5, 1, 3, "chunks", count=0) == [0, 1, 2, 3, 4]
    assert window_starts(5, 1, 3, "uniform", count=3) == [0, 2, 4]


# ----------------------------------------------------------------------------- random_start
def test_random_start_range_and_spread() -> None:
    starts = [random_start(100, 17, 1, seed=0, epoch=e, index=i) for e in range(20) for i in range(50)]
    assert min(starts) == 0 and max(starts) == 83  # the whole valid range, inclusive
    assert len(set(starts)) > 60
    starts2 = [random_start(100, 17, 2, seed=3, epoch=0, index=i) for i in range(500)]
    assert all(0 <= s <= 67 for s in starts2)


def test_random_start_deterministic() -> None:
    a = [random_start(100, 17, 1, seed=7, epoch=2, index=i) for i in range(30)]
    b = [random_start(100, 17, 1, seed=7, epoch=2, index=i) for i in range(30)]
    assert a == b
    # it changes with the epoch, the seed and the index
    assert a != [random_start(100, 17, 1, seed=7, epoch=3, index=i) for i in range(30)]
    assert a != [random_start(100, 17, 1, seed=8, epoch=2, index=i) for i in range(30)]
    assert len(set(a)) > 10


def test_random_start_same_in_another_process() -> None:
    """No dependence on Python's salted hash(): another interpreter draws the same starts."""
    code = (
        "from wanexp.data.windows import random_start;"
        "print([random_start(1000, 17, 1, 5, 1, i) for i in range(8)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=Path(__file__).resolve().parents[2],
    ).stdout.strip()
    assert out == str([random_start(1000, 17, 1, 5, 1, i) for i in range(8)])


def test_random_start_short_clip() -> None:
    assert random_start(17, 17, 1, 0, 0, 0) == 0  # exactly one window
    assert random_start(10, 17, 2, 0, 0, 0) == 0  # shorter: the loader lowers the stride
    assert {random_start(18, 17, 1, 0, e, 0) for e in range(50)} == {0, 1}


# ----------------------------------------------------------------------------- fit_window
def test_fit_window() -> None:
    assert fit_window(100, 17, 2, 10) == (10, 2)  # fits as asked
    assert fit_window(100, 17, 2, 0) == (0, 2)
    assert fit_window(17, 5, 8, 0) == (0, 4)  # start 0: the historical stride lowering
    assert fit_window(100, 17, 4, 60) == (60, 2)  # stride lowered from start: 60 + 16 * 2 = 92 <= 99
    assert fit_window(100, 17, 4, 90) == (83, 1)  # not even stride 1 fits: shift back, end at frame 99
    assert fit_window(100, 17, 1, 500) == (83, 1)
    assert fit_window(17, 17, 3, 5) == (0, 1)
    assert fit_window(16, 17, 1, 0) is None  # fewer than num_frames: unusable
    assert fit_window(10, 1, 3, 4) == (4, 3)
    assert fit_window(10, 1, 3, 40) == (9, 3)
    with pytest.raises(ValueError):
        fit_window(100, 17, 1, -1)


# ----------------------------------------------------------------------------- expand
def test_expand() -> None:
    a = Sample("/d/a.mp4", "a", "video")
    b = Sample("/d/b.png", "b", "image")
    c = Sample("/d/c.mp4", "c", "video")
    samples, frames = [a, b, c], [100, 1, 20]
    assert expand(samples, frames, 17, 1, "first", 1) == [(a, 0), (b, 0), (c, 0)]
    assert expand(samples, frames, 17, 1, "chunks", 0) == [
        (a, 0), (a, 17), (a, 34), (a, 51), (a, 68), (b, 0), (c, 0)
    ]
    assert expand(samples, frames, 17, 1, "uniform", 3) == [
        (a, 0), (a, 42), (a, 83), (b, 0), (c, 0), (c, 2), (c, 3)
    ]
    assert expand(samples, frames, 17, 1, "random", 3) == [(a, RANDOM_START), (b, 0), (c, RANDOM_START)]
    assert RANDOM_START == -1
    assert expand([], [], 17, 1, "chunks", 0) == []
    with pytest.raises(ValueError, match="length"):
        expand(samples, frames[:2], 17, 1, "first", 1)
    with pytest.raises(ValueError, match="window mode"):
        expand(samples, frames, 17, 1, "bogus", 1)


# ----------------------------------------------------------------------------- load_clip(start=...)
N_SOURCE = 25  # gray levels 0, 10, ..., 240: well separated, inside uint8


def _counter_video(path: Path, num_frames: int = N_SOURCE, size: int = 32) -> Path:
    """Frame i is a flat gray of level 10 * i."""
    frames = np.empty((num_frames, size, size, 3), dtype=np.uint8)
    for i in range(num_frames):
        frames[i] = 10 * i
    write_video(path, frames, fps=16)
    return path


def _frame_indices(clip: torch.Tensor) -> list[int]:
    """The source frame of each frame of a ``_counter_video`` clip (asserts each is close to a level)."""
    levels = ((clip + 1.0) * 127.5).mean(dim=(0, 2, 3))
    out = []
    for v in levels.tolist():
        i = round(v / 10.0)
        assert abs(v - 10 * i) < 3.5, f"mean {v:.1f} is not near any source level"
        out.append(i)
    return out


@pytest.fixture(scope="module", params=[".mp4", ".mkv"])  # mkv: no frame count in the header (second pass)
def counter(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _counter_video(tmp_path_factory.mktemp("win") / f"count{request.param}")


def test_load_clip_start_0_unchanged(counter: Path) -> None:
    assert _frame_indices(load_clip(counter, 5, 16, 16)) == [0, 1, 2, 3, 4]
    assert _frame_indices(load_clip(counter, 5, 16, 16, start=0)) == [0, 1, 2, 3, 4]
    assert _frame_indices(load_clip(counter, 5, 16, 16, stride=3, start=0)) == [0, 3, 6, 9, 12]
    assert _frame_indices(load_clip(counter, 5, 16, 16, stride=8, start=0)) == [0, 6, 12, 18, 24]  # lowered to 6


def test_load_clip_middle_start(counter: Path) -> None:
    assert _frame_indices(load_clip(counter, 5, 16, 16, start=7)) == [7, 8, 9, 10, 11]
    assert _frame_indices(load_clip(counter, 1, 16, 16, start=13)) == [13]


def test_load_clip_stride_2(counter: Path) -> None:
    assert _frame_indices(load_clip(counter, 5, 16, 16, stride=2, start=3)) == [3, 5, 7, 9, 11]
    # exactly the last window at stride 2: 16 + 4 * 2 = 24
    assert _frame_indices(load_clip(counter, 5, 16, 16, stride=2, start=16)) == [16, 18, 20, 22, 24]


def test_load_clip_near_end(counter: Path) -> None:
    # stride 4 from 10 needs frame 26: lowered to 3 (10 + 4 * 3 = 22)
    assert _frame_indices(load_clip(counter, 5, 16, 16, stride=4, start=10)) == [10, 13, 16, 19, 22]
    # stride 1 from 22 needs frame 26: shifted back so the window ends at the last frame (24)
    assert _frame_indices(load_clip(counter, 5, 16, 16, start=22)) == [20, 21, 22, 23, 24]
    assert _frame_indices(load_clip(counter, 5, 16, 16, stride=2, start=23)) == [20, 21, 22, 23, 24]
    assert _frame_indices(load_clip(counter, 5, 16, 16, start=1000)) == [20, 21, 22, 23, 24]
    assert _frame_indices(load_clip(counter, 1, 16, 16, start=1000)) == [24]
    assert _frame_indices(load_clip(counter, N_SOURCE, 16, 16, stride=2, start=3)) == list(range(N_SOURCE))


def test_load_clip_start_errors(counter: Path, tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="25 frames but 26"):
        load_clip(counter, N_SOURCE + 1, 16, 16, start=0)
    with pytest.raises(ValueError, match="start"):
        load_clip(counter, 5, 16, 16, start=-1)
    # an image ignores the start
    from PIL import Image

    Image.fromarray(np.full((8, 8, 3), 128, np.uint8)).save(tmp_path / "img.png")
    assert load_clip(tmp_path / "img.png", 5, 16, 16, start=9).shape == (3, 1, 16, 16)


def test_windows_from_window_starts_decode(counter: Path) -> None:
    """Every window window_starts gives decodes to exactly its frames (no lowering, no shift)."""
    for mode, count in (("uniform", 3), ("chunks", 0)):
        for start in window_starts(N_SOURCE, 4, 2, mode, count):
            assert _frame_indices(load_clip(counter, 4, 16, 16, stride=2, start=start)) == [
                start, start + 2, start + 4, start + 6
            ]


def test_start_decodes_only_up_to_window_and_converts_only_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _counter_video(tmp_path / "long.mp4")
    opened = count_decoding(monkeypatch, media_mod.av)
    clip = load_clip(path, 3, 16, 16, stride=2, start=9)
    assert _frame_indices(clip) == [9, 11, 13]
    assert len(opened) == 1 and opened[0].decoded == 14  # frames 0 .. 13, none after the window
    assert opened[0].converted == [9, 11, 13]  # frames before the start and between taken ones stay undecoded to arrays
