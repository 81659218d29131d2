"""Pre-flight check of media files: find the samples training cannot use, without decoding whole videos.

``probe_sample`` opens one file and returns a ``ProbeResult``: the media's size and frame count, or a
one-line reject reason, plus warnings. A video is decoded only up to the last frame a clip needs,
frame ``(num_frames - 1) * frame_stride`` (of the clip at the rate it is resampled to, ``fps``), so a truncated
file whose header promises more frames is caught while a long video costs no more than one clip. An image is
verified and decoded.

``probe_samples`` probes many samples on a thread pool (PyAV and PIL release the GIL while decoding)
and returns ``(good samples, rejects, warnings)`` in input order.

Reject reasons (``ProbeResult.reason`` / ``Reject.reason``):

* ``file not found``, ``not a file``, ``cannot read file (<error>)``, ``empty file (0 bytes)``
* ``cannot open video (<error>)``, ``no video stream``, ``video has no frames``,
  ``cannot decode first frame (<error>)``
* ``truncated or corrupt video: decoding failed at frame <n> of <header or ?> (<error>)``, or, when the
  stream just ends before the frame count in its header, ``truncated video: only <n> of <header> frames decode``
* ``too few frames: <n>, needs <f> (num_frames=<f>, at frame_stride 1)`` (a video with fewer frames than
  ``(num_frames - 1) * frame_stride + 1`` but at least ``num_frames`` trains at a lower stride, as ``load_clip`` does,
  with the warning ``short video: <n> frames, so frame_stride <s> is lowered to <t>``). With ``fps`` (the rate clips
  are resampled to, ``wanexp.data.windows``) frames are counted at that rate, and a clip of another rate too short for
  ``num_frames`` there is ``too few frames: <n> at <r> fps (<s> s) are <m> at <fps> fps, needs <f> (...)``
* ``cannot read image (<error>)``
* ``unknown media type '<kind>'``

Warnings (the sample stays usable): ``small <image|video> <w>x<h>: upscaled <f>x to cover <width>x<height>``
when the media must be enlarged more than ``UPSCALE_WARN`` times to cover the size it trains at (with ``resolutions``,
the aspect bucket the datamodule assigns it; else ``width`` x ``height``);
``damaged after frame <n> (<error>); only the first <n> frames are readable`` for a video without a frame
count in its header whose tail, past the frames a clip needs, does not read; with ``fps``:
``low frame rate: <r> fps, resampled to <fps> fps by repeating frames`` (a video below 90 % of that rate) and
``no frame rate in the file: its frames are taken as <fps> fps``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction

import av
from PIL import Image

from wanexp.data.metadata import Reject, Sample
from wanexp.data.windows import resampled_frames, source_frame, window_span

__all__ = ["UPSCALE_WARN", "ProbeResult", "ProbeWarning", "probe_sample", "probe_samples", "stream_fps"]

UPSCALE_WARN = 2.0  # warn when the media must be enlarged more than this to cover height x width
LOW_RATE_WARN = Fraction(9, 10)  # warn when a video's rate is below this share of the rate it is resampled to

_VIDEO_ERRORS: tuple[type[BaseException], ...] = (av.error.FFmpegError, OSError, ValueError, EOFError, RuntimeError)
_IMAGE_ERRORS: tuple[type[BaseException], ...] = (
    OSError, ValueError, EOFError, SyntaxError, Image.DecompressionBombError,
)


@dataclass(frozen=True)
class ProbeResult:
    """What probing one sample found: ``reason`` is None when usable (then ``width``/``height``/``frames`` are set).

    ``frames`` is the number of frames available: 1 for an image; for a video the container's frame
    count when it has one (checked by decoding up to the last needed frame), else the frames decoded
    plus the packets left after them, counted at the rate clips are resampled to (``fps``, when given).
    ``source_fps``: the video's own frame rate (None: an image, or a file that states none).
    """

    sample: Sample
    width: int = 0
    height: int = 0
    frames: int = 0
    reason: str | None = None
    warnings: tuple[str, ...] = ()
    source_fps: Fraction | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class ProbeWarning:
    """A usable sample worth a look: ``source`` and ``path`` are the media path, ``reason`` one line."""

    source: str
    path: str
    reason: str


def _one_line(exc: BaseException) -> str:
    """The error text on one line, without the file name FFmpeg errors repeat."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split())


def stream_fps(stream) -> Fraction | None:
    """A PyAV video stream's frame rate: its average rate, else the rate FFmpeg guesses; None if it states none."""
    rate = stream.average_rate or stream.guessed_rate
    return Fraction(rate) if rate else None


def nearest_resolution(width: int, height: int, resolutions: list[tuple[int, int]]) -> tuple[int, int]:
    """The (height, width) in ``resolutions`` whose aspect ratio is closest to ``width / height`` (log distance)."""
    aspect = math.log(width / height)
    return min(resolutions, key=lambda hw: (abs(math.log(hw[1] / hw[0]) - aspect), -hw[0] * hw[1]))


def _upscale_warning(what: str, src_w: int, src_h: int, width: int, height: int,
                     resolutions: Sequence[tuple[int, int]] | None = None) -> tuple[str, ...]:
    if resolutions and src_w > 0 and src_h > 0:  # the bucket this file trains at, as the datamodule assigns it
        height, width = nearest_resolution(src_w, src_h, [tuple(r) for r in resolutions])
    scale = max(height / max(src_h, 1), width / max(src_w, 1))  # resize_crop scales to cover, aspect kept
    if scale > UPSCALE_WARN:
        return (f"small {what} {src_w}x{src_h}: upscaled {scale:.1f}x to cover {width}x{height}",)
    return ()


def _probe_image(sample: Sample, width: int, height: int, resolutions=None) -> ProbeResult:
    try:
        with Image.open(sample.path) as img:
            img.verify()  # structure and checksums, no pixels
        with Image.open(sample.path) as img:
            img.load()  # verify() misses truncated JPEG data
            src_w, src_h = img.size
    except _IMAGE_ERRORS as exc:
        return ProbeResult(sample, reason=f"cannot read image ({_one_line(exc)})")
    warnings = _upscale_warning("image", src_w, src_h, width, height, resolutions)
    return ProbeResult(sample, src_w, src_h, 1, warnings=warnings)


def _rate_warnings(src: Fraction | None, fps: int | None) -> tuple[str, ...]:
    if fps and src is None:
        return (f"no frame rate in the file: its frames are taken as {fps} fps",)
    if fps and src < fps * LOW_RATE_WARN:
        return (f"low frame rate: {float(src):g} fps, resampled to {fps} fps by repeating frames",)
    return ()


def _probe_video(sample: Sample, num_frames: int, frame_stride: int, width: int, height: int,
                 resolutions=None, fps: int | None = None) -> ProbeResult:
    try:
        container = av.open(sample.path, mode="r")
    except _VIDEO_ERRORS as exc:
        return ProbeResult(sample, reason=f"cannot open video ({_one_line(exc)})")
    with container:
        if not container.streams.video:
            return ProbeResult(sample, reason="no video stream")
        stream = container.streams.video[0]
        src = stream_fps(stream)

        def at_fps(count: int) -> int:  # source frames -> frames at the rate the clip trains at
            return resampled_frames(count, src, fps)

        # source frames 0 .. the window's last: (num_frames - 1) * frame_stride frames after the first, at fps
        needed = source_frame(window_span(num_frames, frame_stride) - 1, src, fps) + 1
        least = source_frame(num_frames - 1, src, fps) + 1  # at frame_stride 1
        # The loader lowers the stride (down to 1) for a short video, as load_clip does: below num_frames it is
        # unusable.

        def too_few(count: int) -> ProbeResult:
            if at_fps(count) == count:
                return ProbeResult(
                    sample,
                    reason=f"too few frames: {count}, needs {num_frames} (num_frames={num_frames}, at frame_stride 1)",
                )
            return ProbeResult(sample, reason=f"too few frames: {count} at {float(src):g} fps ({float(count / src):.2f}"
                                              f" s) are {at_fps(count)} at {fps} fps, needs {num_frames} (num_frames="
                                              f"{num_frames}, at frame_stride 1)")

        header = int(stream.frames or 0)  # 0: the container does not say (mkv, webm, some avi)
        decoded, packets, src_w, src_h, damage = 0, 0, 0, 0, ""
        try:
            for packet in container.demux(stream):
                packets += packet.size > 0  # the last packet is an empty one that flushes the decoder
                if decoded >= needed:
                    continue  # no frame count in the header: count the packets left, without decoding
                for frame in stream.decode(packet):
                    if decoded == 0:
                        src_w, src_h = frame.width, frame.height
                        if 0 < header < least:  # the first frame shows the file decodes; the header: too short
                            return too_few(header)
                    decoded += 1
                if decoded >= needed and header:
                    break
        except _VIDEO_ERRORS as exc:
            if decoded == 0:
                return ProbeResult(sample, reason=f"cannot decode first frame ({_one_line(exc)})")
            if decoded < min(needed, max(header, least)):
                return ProbeResult(
                    sample,
                    reason=f"truncated or corrupt video: decoding failed at frame {decoded} of {header or '?'} "
                    f"({_one_line(exc)})",
                )
            # the needed frames decode; the damage is past them, where the loader never reads
            damage = f"damaged after frame {packets} ({_one_line(exc)}); only the first {packets} frames are readable"
        if decoded == 0:
            return ProbeResult(sample, reason="video has no frames")
        if decoded < needed and header > decoded:
            return ProbeResult(sample, reason=f"truncated video: only {decoded} of {header} frames decode")
        if decoded < least:
            return too_few(decoded)
        frames = at_fps(header or max(packets, decoded))
        if decoded < needed:
            stride = (at_fps(decoded) - 1) // (num_frames - 1) if num_frames > 1 else frame_stride
            damage = f"short video: {at_fps(decoded)} frames, so frame_stride {frame_stride} is lowered to {stride}"
    warnings = _upscale_warning("video", src_w, src_h, width, height, resolutions) + ((damage,) if damage else ())
    return ProbeResult(sample, src_w, src_h, frames, warnings=warnings + _rate_warnings(src, fps), source_fps=src)


def probe_sample(sample: Sample, num_frames: int, frame_stride: int, height: int, width: int,
                 resolutions: Sequence[tuple[int, int]] | None = None, fps: int | None = None) -> ProbeResult:
    """Check that ``sample`` can give a ``num_frames`` clip at ``frame_stride`` (an image: one frame).
    ``resolutions``: the aspect buckets as (height, width) (``data.buckets``), for the upscale warning. ``fps``: the
    rate clips are resampled to (None: their own frames as they are).

    Never raises for a bad file: problems come back as ``ProbeResult.reason`` (see the module doc).
    """
    if num_frames < 1 or frame_stride < 1 or height < 1 or width < 1:
        raise ValueError(
            "num_frames, frame_stride, height and width must be >= 1, "
            f"got {num_frames}, {frame_stride}, {height}, {width}"
        )
    try:
        size = os.stat(sample.path).st_size
    except FileNotFoundError:
        return ProbeResult(sample, reason="file not found")
    except OSError as exc:
        return ProbeResult(sample, reason=f"cannot read file ({_one_line(exc)})")
    if not os.path.isfile(sample.path):
        return ProbeResult(sample, reason="not a file")
    if size == 0:
        return ProbeResult(sample, reason="empty file (0 bytes)")
    if sample.kind == "image":
        return _probe_image(sample, width, height, resolutions)
    if sample.kind == "video":
        return _probe_video(sample, num_frames, frame_stride, width, height, resolutions, fps)
    return ProbeResult(sample, reason=f"unknown media type {sample.kind!r}")


def probe_samples(
    samples: Iterable[Sample],
    num_frames: int,
    frame_stride: int,
    height: int,
    width: int,
    workers: int | None = None,
    resolutions: Sequence[tuple[int, int]] | None = None,
    fps: int | None = None,
) -> tuple[list[ProbeResult], list[Reject], list[ProbeWarning]]:
    """Probe ``samples`` on ``workers`` threads (default: CPU count, at most 16).

    ``resolutions``, ``fps``: as ``probe_sample`` takes them. Returns the results of the usable samples
    (with their size and frame count), the rejects (``source`` and ``path`` are the media path) and the warnings of
    the usable samples, each in input order.
    """
    items = list(samples)
    workers = workers or min(16, os.cpu_count() or 1)
    if workers <= 1 or len(items) <= 1:
        results = [probe_sample(s, num_frames, frame_stride, height, width, resolutions, fps) for s in items]
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="probe") as pool:
            results = list(pool.map(
                lambda s: probe_sample(s, num_frames, frame_stride, height, width, resolutions, fps), items))
    good: list[ProbeResult] = []
    rejects: list[Reject] = []
    warnings: list[ProbeWarning] = []
    for result in results:
        path = result.sample.path
        if result.reason is not None:
            rejects.append(Reject(source=path, path=path, reason=result.reason))
            continue
        good.append(result)
        warnings += [ProbeWarning(source=path, path=path, reason=text) for text in result.warnings]
    return good, rejects, warnings
