"""Decode videos/images into normalised clip tensors and write mp4 files (PyAV)."""

from __future__ import annotations

import os
import uuid
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from wanexp.data.metadata import Sample, media_kind
from wanexp.data.probe import stream_fps
from wanexp.data.windows import fit_window, resampled_frames, source_frame
from wanexp.errors import MediaError

__all__ = ["MediaError", "load_clip", "resize_crop", "write_video"]

# Errors PyAV / PIL raise for missing, unreadable or corrupt files.
_DECODE_ERRORS: tuple[type[BaseException], ...] = (av.error.FFmpegError, OSError, ValueError, EOFError)


# Source pixels converted to float per chunk; bounds peak memory for large videos (~100 MB).
_CHUNK_PIXELS = 1 << 23


def resize_crop(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Resize float ``(..., C, H, W)`` frames to cover ``height x width`` (aspect kept), then center-crop."""
    src_h, src_w = frames.shape[-2:]
    scale = max(height / src_h, width / src_w)
    new_h = max(height, round(src_h * scale))
    new_w = max(width, round(src_w * scale))
    if (new_h, new_w) != (src_h, src_w):
        lead = frames.shape[:-3]
        flat = frames.reshape(-1, *frames.shape[-3:])
        flat = F.interpolate(flat, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False)
        frames = flat.reshape(*lead, *flat.shape[-3:])
    top = (new_h - height) // 2
    left = (new_w - width) // 2
    return frames[..., top : top + height, left : left + width]


def _to_clip(frames: list[np.ndarray], height: int, width: int) -> torch.Tensor:
    """uint8 ``(H, W, 3)`` frames -> float32 ``(3, T, height, width)`` in [-1, 1].

    Works on chunks of frames rather than frame by frame: far fewer torch ops, which
    matters when torch's thread pool competes with the decoder for a few cores.
    """
    src_h, src_w = frames[0].shape[:2]
    chunk = max(1, _CHUNK_PIXELS // (src_h * src_w))
    parts: list[torch.Tensor] = []
    for start in range(0, len(frames), chunk):
        batch = torch.from_numpy(np.stack(frames[start : start + chunk]))  # (N, H, W, 3) uint8
        batch = batch.permute(0, 3, 1, 2).to(torch.float32)
        parts.append(resize_crop(batch, height, width))
    clip = torch.cat(parts).permute(1, 0, 2, 3)  # (3, T, height, width)
    return (clip / 127.5 - 1.0).clamp_(-1.0, 1.0).contiguous()


def _load_image(path: str, height: int, width: int) -> torch.Tensor:
    try:
        with Image.open(path) as img:
            rgb = np.asarray(img.convert("RGB"))
    except _DECODE_ERRORS as exc:
        raise MediaError(f"{path}: cannot read image ({_reason(exc)})") from None
    return _to_clip([rgb], height, width)


def _reason(exc: BaseException) -> str:
    """Exception text squeezed onto one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


class _TooShort(Exception):
    """Internal: the video ended after ``count`` frames (``available`` of them at the rate it is resampled to)."""

    def __init__(self, count: int, available: int, source_fps) -> None:
        super().__init__(count)
        self.count, self.available, self.source_fps = count, available, source_fps


def _decode_video(
    path: str, num_frames: int, stride: int, height: int, width: int, *, start: int = 0, trust_header: bool,
    fps: int | None = None,
) -> tuple[torch.Tensor, int, int]:
    """Decode frames start, start + stride, ... of the clip resampled to ``fps`` (``wanexp.data.windows``; None: the
    source frames themselves); stop as soon as the last one is decoded.

    Frames before ``start`` and between the taken ones are decoded (the codec needs them) but never
    converted to arrays. With ``trust_header`` the window is first fitted (``fit_window``: stride
    lowered, then start shifted back) to the frame count stored in the container, when there is one.
    Raises ``_TooShort`` with the number of frames decoded if the stream ends early. Returns the clip and the window
    decoded (its start and stride).
    """
    taken: dict[int, np.ndarray] = {}
    index = -1
    with av.open(path, mode="r") as container:
        if not container.streams.video:
            raise MediaError(f"{path}: no video stream found")
        stream = container.streams.video[0]
        src = stream_fps(stream)
        if trust_header and stream.frames:
            available = resampled_frames(int(stream.frames), src, fps)
            start, stride = fit_window(available, num_frames, stride, start) or (start, stride)
        wanted = [source_frame(start + i * stride, src, fps) for i in range(num_frames)]
        keep = set(wanted)
        for index, frame in enumerate(container.decode(stream)):
            if index in keep:
                taken[index] = frame.to_ndarray(format="rgb24")
                if index >= wanted[-1]:
                    break
    if wanted[-1] not in taken:
        raise _TooShort(index + 1, resampled_frames(index + 1, src, fps), src)
    # a frame taken twice (a low rate) is repeated
    return _to_clip([taken[i] for i in wanted], height, width), start, stride


def _load_video(path: str, num_frames: int, height: int, width: int, stride: int, start: int = 0,
                fps: int | None = None, exact: bool = False) -> tuple[torch.Tensor, int, int]:
    try:
        try:
            return _decode_video(path, num_frames, stride, height, width, start=start, trust_header=not exact,
                                 fps=fps)
        except _TooShort as short:  # header missing or wrong: retry with the real count
            too_short = short
            fitted = None if exact else fit_window(short.available, num_frames, stride, start)
            if fitted:
                return _decode_video(
                    path, num_frames, fitted[1], height, width, start=fitted[0], trust_header=False, fps=fps
                )
    except _TooShort as short:  # pragma: no cover - only if the file changed between passes
        too_short = short
    except MediaError:
        raise
    except _DECODE_ERRORS as exc:
        raise MediaError(f"{path}: cannot decode video ({_reason(exc)})") from None
    count, rate, have = too_short.count, too_short.source_fps, f"{too_short.count} frames"
    if too_short.available != count:  # resampled to another rate than the clip's own
        have += f" at {float(rate):g} fps ({float(count / rate):.2f} s), {too_short.available} at {fps} fps,"
    if exact:
        raise MediaError(f"{path}: video has {have} but the window needs frames {start} to "
                         f"{start + (num_frames - 1) * stride} (every {stride}); it follows its clip frame for frame: "
                         "use one as long as the clip")
    raise MediaError(
        f"{path}: video has {have} but {num_frames} are needed (even at stride 1); "
        "use a longer clip or lower num_frames"
    )


def load_clip_window(
    sample_or_path: Sample | str | os.PathLike[str],
    num_frames: int,
    height: int,
    width: int,
    stride: int = 1,
    *,
    start: int = 0,
    fps: int | None = None,
    exact: bool = False,
) -> tuple[torch.Tensor, int, int]:
    """Load a clip as float32 ``(3, T, height, width)`` in [-1, 1].

    Videos give ``T == num_frames`` frames ``start, start + stride, ..., start + (num_frames - 1) * stride`` of the
    clip resampled to ``fps`` (each the source frame nearest to its time, ``wanexp.data.windows``; None: the source
    frames).
    When the video is too short for that window, the stride is lowered (down to 1) and, if even
    stride 1 does not fit from ``start``, the window shifts back to end at the last frame
    (``wanexp.data.windows.fit_window``); only a video with fewer than ``num_frames`` frames fails. ``exact``: the
    window as asked or a MediaError (a video that follows another frame for frame, e.g. a control video).
    Returns the clip and the window it holds, its first frame and stride (an image: ``start`` and ``stride``).
    Decoding stops after the window's last frame. Images give ``T == 1`` (``start`` and ``fps`` are ignored).
    Frames are resized to cover ``height x width`` and center-cropped.
    """
    if num_frames < 1 or height < 1 or width < 1 or stride < 1:
        raise ValueError(
            f"num_frames, height, width and stride must be >= 1, got {num_frames}, {height}, {width}, {stride}"
        )
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if isinstance(sample_or_path, Sample):
        path, kind = sample_or_path.path, sample_or_path.kind
    else:
        path = os.fspath(sample_or_path)
        kind = media_kind(path)
    if kind == "image":
        return _load_image(path, height, width), start, stride
    if kind == "video":
        return _load_video(path, num_frames, height, width, stride, start, fps, exact)
    raise MediaError(f"{path}: unknown media type {Path(path).suffix or '(no extension)'!r}")


def load_clip(sample_or_path: Sample | str | os.PathLike[str], num_frames: int, height: int, width: int,
              stride: int = 1, **window) -> torch.Tensor:
    """:func:`load_clip_window`'s clip alone (``window``: its keyword arguments ``start``, ``fps``, ``exact``)."""
    return load_clip_window(sample_or_path, num_frames, height, width, stride, **window)[0]


def _video_codec() -> str:
    for name in ("libx264", "mpeg4"):
        try:
            av.codec.Codec(name, "w")
        except (av.error.FFmpegError, ValueError):
            continue
        return name
    raise MediaError("no usable video encoder (libx264 or mpeg4) in this PyAV build")


def _audio_track(audio) -> tuple[np.ndarray, int] | None:
    """``(samples, sample_rate)`` checked: float32 mono samples and an integer rate."""
    if audio is None:
        return None
    samples, sample_rate = audio
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 1 or samples.size == 0:
        raise ValueError(f"audio samples must be one non-empty mono channel (1-D), got shape {samples.shape}")
    if int(sample_rate) != sample_rate or sample_rate <= 0:
        raise ValueError(f"audio sample rate must be a positive integer, got {sample_rate}")
    return samples, int(sample_rate)


def _audio_frame(chunk: np.ndarray, sample_rate: int, pts: int):
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(chunk[None]), format="fltp", layout="mono")
    frame.sample_rate, frame.pts, frame.time_base = sample_rate, pts, Fraction(1, sample_rate)
    return frame


def write_video(
    path: str | os.PathLike[str],
    frames_uint8: np.ndarray,
    fps: int | float | Fraction = 16,
    audio: tuple[np.ndarray, int] | None = None,
) -> None:
    """Write ``(F, H, W, 3)`` uint8 RGB frames as an mp4 (H.264 yuv420p, else MPEG-4 Part 2).

    ``audio=(samples, sample_rate)``: float mono samples muxed as an AAC stream, cut to the video's duration
    (``F / fps`` seconds; a shorter audio ends early). Odd heights/widths are padded by one edge pixel (yuv420p
    needs even sizes). The file is written under a temporary name and renamed into place, so readers never see a
    partial file.
    """
    frames = np.asarray(frames_uint8)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"frames must have shape (F, H, W, 3) with F >= 1, got {frames.shape}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8, got {frames.dtype}")
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    _, height, width, _ = frames.shape

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{target.suffix or '.mp4'}")
    rate = Fraction(fps).limit_denominator(1001)
    track = _audio_track(audio)
    codec = _video_codec()
    try:
        with av.open(str(tmp), mode="w") as container:
            stream = container.add_stream(codec, rate=rate)
            stream.width = width
            stream.height = height
            stream.pix_fmt = "yuv420p"
            if codec == "libx264":
                stream.options = {"crf": "18", "preset": "veryfast"}
            else:
                stream.bit_rate = max(1_000_000, int(width * height * float(rate) * 0.5))
            if track is not None:
                samples, sample_rate = track
                sound = container.add_stream("aac", rate=sample_rate, layout="mono")
            for index, frame_hwc in enumerate(frames):
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame_hwc), format="rgb24")
                for packet in stream.encode(frame):
                    container.mux(packet)
                if track is not None:  # the samples under this frame: the streams interleave, the audio is cut
                    lo, hi = (min(len(samples), round(i * sample_rate / rate)) for i in (index, index + 1))
                    if hi > lo:
                        for packet in sound.encode(_audio_frame(samples[lo:hi], sample_rate, lo)):
                            container.mux(packet)
            for packet in stream.encode(None):
                container.mux(packet)
            if track is not None:
                for packet in sound.encode(None):
                    container.mux(packet)
        os.replace(tmp, target)
    except (av.error.FFmpegError, OSError) as exc:
        raise MediaError(f"{target}: cannot write video with {codec} ({_reason(exc)})") from None
    finally:
        if tmp.exists():
            tmp.unlink()
