"""Audio of a sample: where it comes from, decoding to 16 kHz mono float32 (PyAV), and the span of one clip.

The speech-to-video references load audio with ``librosa.load(path, sr=16000)``: the first audio stream, channels
averaged to mono, resampled to 16 kHz, samples counted from the stream's first sample (no start-offset handling).
:func:`read_audio` gives the same signal through PyAV (FFmpeg's band-limited resampler instead of soxr) for any
container FFmpeg reads: a video's own audio stream or a .wav/.mp3/.flac/.m4a file.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from wanexp.data.media import _DECODE_ERRORS, _reason
from wanexp.errors import MediaError

__all__ = ["SAMPLE_RATE", "SIDE_EXTENSIONS", "audio_for_clip", "find_audio", "read_audio", "resample"]

SAMPLE_RATE = 16000
"""The rate wav2vec2 reads (and the references resample every audio to)."""

SIDE_EXTENSIONS = (".wav", ".mp3", ".flac")
"""Audio files looked for beside a clip, same name, in this order (lower or upper case)."""


def _to_mono(planes: list[np.ndarray], rate: int, target: int, count: int) -> np.ndarray:
    """Resampled ``(channels, n)`` planes of ``count`` source samples at ``rate`` -> one float32 channel of exactly
    ``ceil(count * target / rate)`` samples (librosa's length convention), the channels averaged."""
    if not planes:
        return np.zeros(0, dtype=np.float32)
    mono = np.concatenate(planes, axis=1).mean(axis=0, dtype=np.float64).astype(np.float32)
    length = math.ceil(count * target / rate)
    if len(mono) >= length:
        return mono[:length]
    return np.pad(mono, (0, length - len(mono)))


def _resample_frames(frames, target: int, declared: int | None = None, slack: int = 0) -> tuple[np.ndarray, int]:
    """Run decoded audio frames through one resampler (planar float, channel layout kept, ``target`` Hz), then
    average the channels. Returns the mono samples and the number of source samples they stand for.

    ``declared``: the stream's stated length in source samples; decoded samples past it by at most ``slack`` (one
    codec frame: the encoder's padding of its last frame, which AAC decoders return) are dropped.
    """
    resampler = av.AudioResampler(format="fltp", layout=None, rate=target)
    planes: list[np.ndarray] = []
    count, rate = 0, None
    for frame in frames:
        rate = rate or frame.sample_rate
        count += frame.samples
        planes.extend(out.to_ndarray() for out in resampler.resample(frame))
    if rate is None:
        return np.zeros(0, dtype=np.float32), 0
    planes.extend(out.to_ndarray() for out in resampler.resample(None))
    if declared is not None and 0 < count - declared <= slack:
        count = declared
    return _to_mono(planes, rate, target, count), count


def _declared_samples(stream) -> tuple[int | None, int]:
    """An audio stream's stated length in samples at its own rate (None if unknown) and its codec frame size."""
    if not stream.duration or not stream.time_base or not stream.rate:
        return None, 0
    return round(stream.duration * stream.time_base * stream.rate), int(stream.codec_context.frame_size or 0)


def resample(samples: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float samples at ``rate`` -> float32 samples at ``target`` (FFmpeg's resampler; same array if equal)."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 1:
        raise ValueError(f"samples must be one mono channel (1-D), got shape {samples.shape}")
    if rate == target or samples.size == 0:
        return samples
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[None]), format="fltp", layout="mono")
    frame.sample_rate, frame.pts, frame.time_base = int(rate), 0, Fraction(1, int(rate))
    return _resample_frames([frame], target)[0]


def read_audio(path: str | os.PathLike[str], sample_rate: int = SAMPLE_RATE) -> tuple[np.ndarray, int]:
    """The first audio stream of a video or audio file as float32 mono samples at ``sample_rate`` (channels
    averaged, resampled), and that rate. The samples start at the stream's first decoded sample (an mp4's encoder
    priming already skipped by FFmpeg) and end at its stated duration. No audio stream, missing or undecodable
    file: a one-line MediaError."""
    path = os.fspath(path)
    try:
        with av.open(path, mode="r") as container:
            if not container.streams.audio:
                raise MediaError(f"{path}: no audio stream")
            stream = container.streams.audio[0]
            samples, count = _resample_frames(container.decode(stream), sample_rate, *_declared_samples(stream))
    except MediaError:
        raise
    except _DECODE_ERRORS as exc:
        raise MediaError(f"{path}: cannot decode audio ({_reason(exc)})") from None
    if count == 0:
        raise MediaError(f"{path}: the audio stream has no samples")
    return samples, sample_rate


def audio_for_clip(samples: np.ndarray, rate: int, start_s: float, frames: int, fps: float) -> np.ndarray:
    """The samples under a clip of ``frames`` frames at ``fps`` starting at ``start_s`` seconds: exactly
    ``round(frames * rate / fps)`` samples from ``round(start_s * rate)``, zeros appended where the audio ends first.

    The clip's frame ``i`` shows time ``start_s + i / fps`` and lasts ``1 / fps``, so the span is ``frames / fps``
    seconds, the last frame's own included.
    """
    if frames < 1 or fps <= 0 or rate <= 0 or start_s < 0:
        raise ValueError(f"need frames >= 1, fps > 0, rate > 0, start_s >= 0; got {frames}, {fps}, {rate}, {start_s}")
    samples = np.asarray(samples, dtype=np.float32)
    start = round(start_s * rate)
    length = round(frames * rate / fps)
    segment = samples[start : start + length]
    if len(segment) < length:
        segment = np.pad(segment, (0, length - len(segment)))
    return segment


def _has_audio_stream(path: str) -> bool:
    try:
        with av.open(path, mode="r") as container:
            return bool(container.streams.audio)
    except _DECODE_ERRORS as exc:
        raise MediaError(f"{path}: cannot open to look for an audio stream ({_reason(exc)})") from None


def _beside(video: Path) -> Path | None:
    """The first same-name audio file beside ``video`` (``SIDE_EXTENSIONS``, lower then upper case)."""
    for ext in SIDE_EXTENSIONS:
        for suffix in (ext, ext.upper()):
            candidate = video.with_suffix(suffix)
            if candidate != video and candidate.is_file():
                return candidate
    return None


def find_audio(video_path: str | os.PathLike[str], audio_path: str | os.PathLike[str] | None = None) -> str:
    """The audio source of a sample: its explicit ``audio_path`` (a metadata column), else a same-name
    .wav/.mp3/.flac beside the clip, else the clip's own audio stream. None of these: a one-line MediaError."""
    video = Path(video_path)
    if audio_path is not None and os.fspath(audio_path) != "":
        if not Path(audio_path).is_file():
            raise MediaError(f"{audio_path}: audio file not found (the audio_path of {video})")
        return os.fspath(audio_path)
    side = _beside(video)
    if side is not None:
        return str(side)
    if not video.is_file():
        raise MediaError(f"{video}: file not found")
    if _has_audio_stream(str(video)):
        return str(video)
    names = "/".join(f"{video.stem}{ext}" for ext in SIDE_EXTENSIONS)
    raise MediaError(
        f"{video}: no audio stream and no {names} beside it; add an audio_path column or put the audio beside the clip"
    )
