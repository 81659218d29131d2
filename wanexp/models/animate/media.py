"""The control videos' files: their size, read without decoding."""
from __future__ import annotations

from pathlib import Path

from wanexp.errors import ConfigError


def video_size(path: str) -> tuple[int, int]:
    """(width, height) of a video's first stream; a missing or unreadable file is a ConfigError naming why."""
    import av

    if not Path(path).is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        with av.open(str(path)) as f:
            if not f.streams.video:
                raise ConfigError(f"{path}: no video stream")
            stream = f.streams.video[0]
            return int(stream.codec_context.width), int(stream.codec_context.height)
    except av.error.FFmpegError as e:
        raise ConfigError(f"{path}: cannot read the video ({' '.join(str(e).split())})") from None
