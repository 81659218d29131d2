"""Frame windows: which frames of a long clip a training sample takes. Pure functions, no I/O.

A window is ``num_frames`` frames ``start, start + stride, ..., start + (num_frames - 1) * stride``; it spans
``span = (num_frames - 1) * stride + 1`` consecutive frames (of the clip at its dataset's frame rate, below).
``load_clip(..., start=...)`` decodes one.

Modes (``WINDOW_MODES``), for a clip of ``frames_available`` frames:

* ``first``:   one window at frame 0 (the historical behaviour).
* ``uniform``: ``count`` windows spread evenly: starts ``round(i * (frames_available - span) / (count - 1))`` for
  ``i = 0 .. count - 1``, so the first starts at 0 and the last ends at the clip's last frame; windows may overlap.
  Duplicate starts (a clip with fewer than ``count`` possible starts) are dropped, so a short clip gives fewer.
* ``chunks``:  consecutive non-overlapping windows at ``0, span, 2 * span, ...``, as many as fit, at most ``count``
  (``count <= 0``: all that fit). A tail shorter than ``span`` is not used.
* ``random``:  no fixed start: each epoch the loader draws one with ``random_start`` (VideoX-Fun's random frame crop),
  deterministic in (seed, epoch, index), so every rank and a resumed run see the same window.

A clip too short for one window at ``stride`` gives the single start 0: ``load_clip`` lowers the stride (down to 1),
see ``fit_window``.

Frame rate: frame indexes here count frames of the clip resampled to the dataset's rate (``data.fps``): frame ``k`` is
the source frame nearest to time ``k / fps`` (``source_frame``), so a 60 fps and a 15 fps clip give the same seconds
of motion per window; a clip below that rate repeats frames, one above it skips frames. ``resampled_frames`` counts a
clip's frames at that rate. The stride then takes every ``stride``-th frame of the resampled clip.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from fractions import Fraction

from wanexp.data.metadata import Sample

__all__ = ["RANDOM_START", "WINDOW_MODES", "expand", "fit_window", "random_start", "resampled_frames", "source_frame",
           "window_span", "window_starts"]

from wanexp.config.schema import WINDOW_MODES  # ("first", "uniform", "chunks", "random")

RANDOM_START = -1  # start placeholder in ``expand`` output: draw it with ``random_start`` at load time


def _check(frames_available: int, num_frames: int, stride: int) -> None:
    if num_frames < 1 or stride < 1 or frames_available < 0:
        raise ValueError(
            "num_frames and stride must be >= 1 and frames_available >= 0, "
            f"got num_frames={num_frames}, stride={stride}, frames_available={frames_available}"
        )


def _ratio(source_fps, fps) -> Fraction | None:
    """Source frames per resampled frame (exact), None when no resampling applies (no target or no source rate)."""
    if not fps or not source_fps:
        return None
    return Fraction(source_fps) / Fraction(fps)


def source_frame(k: int, source_fps, fps) -> int:
    """The source frame that resampled frame ``k`` takes: the one nearest to time ``k / fps`` (halves round up).
    ``fps`` or ``source_fps`` None: frame ``k`` itself."""
    ratio = _ratio(source_fps, fps)
    return k if ratio is None else math.floor(k * ratio + Fraction(1, 2))


def resampled_frames(total: int, source_fps, fps) -> int:
    """Frames of a clip of ``total`` source frames at ``source_fps`` when resampled to ``fps``: the times ``k / fps``
    whose nearest source frame is in the clip (``source_frame(k) <= total - 1``). None for either rate: ``total``."""
    ratio = _ratio(source_fps, fps)
    if ratio is None or total <= 0:
        return total
    return math.ceil((total - Fraction(1, 2)) / ratio)


def window_span(num_frames: int, stride: int) -> int:
    """Consecutive source frames one window covers: ``(num_frames - 1) * stride + 1``."""
    return (num_frames - 1) * stride + 1


def fit_window(total: int, num_frames: int, stride: int, start: int = 0) -> tuple[int, int] | None:
    """The ``(start, stride)`` actually decoded from a video of ``total`` frames (None if ``total < num_frames``).

    1. The window fits as asked (``start + (num_frames - 1) * stride <= total - 1``): unchanged.
    2. Else the stride is lowered to the largest that fits from ``start``:
       ``(total - 1 - start) // (num_frames - 1)``, if that is >= 1. (For ``start == 0`` this is the
       historical stride lowering of ``load_clip``.)
    3. Else (not even stride 1 fits from ``start``) the start shifts back so the window ends at the last frame:
       ``(total - num_frames, 1)``.

    One frame (``num_frames == 1``) keeps the stride and takes ``min(start, total - 1)``.
    """
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    _check(total, num_frames, stride)
    if total < num_frames:
        return None
    if num_frames == 1:
        return min(start, total - 1), stride
    room = total - 1 - start
    fitted = min(stride, room // (num_frames - 1)) if room >= 0 else 0
    if fitted >= 1:
        return start, fitted
    return total - num_frames, 1


def window_starts(frames_available: int, num_frames: int, stride: int, mode: str, count: int = 1) -> list[int]:
    """Start frames of the fixed windows of one clip (see the module doc); ``[]`` for ``random``.

    ``count`` is the number of windows for ``uniform`` (>= 1) and the most for ``chunks`` (<= 0: all that fit).
    """
    _check(frames_available, num_frames, stride)
    if mode not in WINDOW_MODES:
        raise ValueError(f"unknown window mode {mode!r}; expected one of {', '.join(WINDOW_MODES)}")
    if mode == "random":
        return []
    span = window_span(num_frames, stride)
    if mode == "first" or frames_available < span:
        return [0]
    if mode == "uniform":
        if count < 1:
            raise ValueError(f"window count must be >= 1 for uniform windows, got {count}")
        last = frames_available - span  # the last valid start: that window ends at the clip's last frame
        if count == 1 or last == 0:
            return [0]
        # round(i * last / (count - 1)), half up, in integers; increasing in i, so duplicates are adjacent
        starts = [(2 * i * last + count - 1) // (2 * (count - 1)) for i in range(count)]
        return sorted(set(starts))
    # chunks
    fit = frames_available // span
    if count > 0:
        fit = min(fit, count)
    return [i * span for i in range(fit)]


def _mix(seed: int, epoch: int, index: int) -> int:
    """A 64-bit integer from (seed, epoch, index), stable across processes and Python versions (no ``hash()``)."""
    digest = hashlib.sha256(f"wanexp-window:{int(seed)}:{int(epoch)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def random_start(frames_available: int, num_frames: int, stride: int, seed: int, epoch: int, index: int) -> int:
    """A start drawn uniformly from ``0 .. frames_available - span`` (0 if the clip is shorter than one window),
    deterministic in (seed, epoch, index): the same on every rank, in every worker and after a resume."""
    _check(frames_available, num_frames, stride)
    last = frames_available - window_span(num_frames, stride)
    if last <= 0:
        return 0
    return random.Random(_mix(seed, epoch, index)).randint(0, last)


def expand(
    samples: Sequence[Sample],
    frames: Sequence[int],
    num_frames: int,
    stride: int,
    mode: str,
    count: int = 1,
) -> list[tuple[Sample, int]]:
    """One ``(sample, start)`` training sample per window, in sample order (windows of a clip together).

    ``frames[i]`` is the frame count of ``samples[i]`` (``ProbeResult.frames``). An image gives one entry at start
    0 in every mode. For ``random`` each video gives one entry with start ``RANDOM_START`` (-1): draw it at load
    time with ``random_start``.
    """
    if len(samples) != len(frames):
        raise ValueError(f"samples and frames differ in length: {len(samples)} vs {len(frames)}")
    if mode not in WINDOW_MODES:
        raise ValueError(f"unknown window mode {mode!r}; expected one of {', '.join(WINDOW_MODES)}")
    out: list[tuple[Sample, int]] = []
    for sample, available in zip(samples, frames):
        if sample.kind == "image":
            out.append((sample, 0))
        elif mode == "random":
            _check(available, num_frames, stride)
            out.append((sample, RANDOM_START))
        else:
            out.extend((sample, start) for start in window_starts(available, num_frames, stride, mode, count))
    return out
