"""Generate a small captioned demo dataset: mp4 clips of moving shapes, PNG stills, metadata.csv."""

from __future__ import annotations

import csv
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from wanexp.data.media import write_video
from wanexp.errors import ConfigError, MetadataError

__all__ = ["COLORS", "DIRECTIONS", "SHAPES", "ShapeSpec", "clip_specs", "demo_specs", "make_demo_dataset",
           "render_frames"]

METADATA_NAME = "metadata.csv"

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 210),
    "yellow": (240, 220, 40),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "purple": (130, 40, 170),
    "orange": (245, 130, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
# direction name -> unit motion (dx, dy) in image coordinates (y grows downwards)
DIRECTIONS: dict[str, tuple[int, int]] = {
    "from left to right": (1, 0),
    "from right to left": (-1, 0),
    "from top to bottom": (0, 1),
    "from bottom to top": (0, -1),
}
SPEEDS: dict[str, float] = {"slowly": 0.35, "quickly": 0.75}  # fraction of the free span travelled
_MIN_COLOR_DISTANCE = 180.0  # keep shape and background clearly separable after compression


@dataclass(frozen=True)
class ShapeSpec:
    """What one demo item shows; ``direction``/``speed`` are ``None`` for still images."""

    shape: str
    color: str
    background: str
    size: float  # shape radius as a fraction of min(height, width)
    offset: float = 0.0  # perpendicular offset of the path from the centre, fraction of the frame
    direction: str | None = None
    speed: str | None = None

    @property
    def prompt(self) -> str:
        """Plain-words caption of the item, short enough (at most 62 characters) that the tiny models' byte-level
        tokenizer reads it whole at their 64 tokens (model.text_len): the demo trains no truncated caption."""
        article = "an" if self.color[0] in "aeiou" else "a"
        subject = f"{article} {self.color} {self.shape}"
        if self.direction is not None:
            subject += f" moving {self.speed} {self.direction}"
        return f"{subject} on {self.background}"


def _color_distance(a: str, b: str) -> float:
    return float(np.linalg.norm(np.subtract(COLORS[a], COLORS[b], dtype=np.float64)))


def demo_specs(num_videos: int, num_images: int, seed: int = 0) -> tuple[list[ShapeSpec], list[ShapeSpec]]:
    """Deterministic (videos, images) specs; shapes, directions and colours rotate per item."""
    rng = np.random.default_rng(seed)
    names = list(COLORS)
    directions = list(DIRECTIONS)
    speeds = list(SPEEDS)
    shape0, dir0, speed0 = (int(v) for v in rng.integers(0, 1 << 16, size=3))

    def pick_colors() -> tuple[str, str]:
        color = names[int(rng.integers(len(names)))]
        backgrounds = [n for n in names if _color_distance(n, color) >= _MIN_COLOR_DISTANCE]
        return color, backgrounds[int(rng.integers(len(backgrounds)))]

    videos: list[ShapeSpec] = []
    for i in range(num_videos):
        color, background = pick_colors()
        videos.append(
            ShapeSpec(
                shape=SHAPES[(shape0 + i) % len(SHAPES)],
                color=color,
                background=background,
                size=float(rng.uniform(0.10, 0.16)),
                offset=float(rng.uniform(-0.15, 0.15)),
                direction=directions[(dir0 + i) % len(directions)],
                speed=speeds[(speed0 + i // len(directions)) % len(speeds)],
            )
        )
    images: list[ShapeSpec] = []
    for i in range(num_images):
        color, background = pick_colors()
        images.append(
            ShapeSpec(
                shape=SHAPES[(shape0 + 1 + i) % len(SHAPES)],
                color=color,
                background=background,
                size=float(rng.uniform(0.18, 0.28)),
                offset=float(rng.uniform(-0.1, 0.1)),
            )
        )
    return videos, images


def clip_specs(clips) -> list[ShapeSpec]:
    """``data.generate.clips``: a list of mappings of :class:`ShapeSpec` fields (``shape``, ``color``,
    ``background``, ``size``; optional ``offset``, ``direction``, ``speed``), each a video (a still image without
    ``direction``). A name that is not known, or a missing field, is a ConfigError naming the entry."""
    allowed = {"shape": SHAPES, "color": tuple(COLORS), "background": tuple(COLORS), "direction": tuple(DIRECTIONS),
               "speed": tuple(SPEEDS)}
    specs = []
    for i, clip in enumerate(clips):
        where = f"data.generate.clips[{i}]"
        if not hasattr(clip, "keys"):
            raise ConfigError(f"{where}={clip!r}: expected a mapping of shape, color, background, size (offset, "
                              "direction, speed optional)")
        clip = dict(clip)
        unknown = sorted(set(clip) - set(ShapeSpec.__dataclass_fields__))
        missing = [k for k in ("shape", "color", "background", "size") if k not in clip]
        if unknown or missing:
            what = f"unknown key {unknown[0]!r}" if unknown else f"{missing[0]!r} missing"
            raise ConfigError(f"{where}: {what}; its keys are shape, color, background, size (offset, direction, "
                              "speed optional)")
        for key, names in allowed.items():
            if clip.get(key) is not None and clip[key] not in names:
                raise ConfigError(f"{where}.{key}={clip[key]!r}: not one of {', '.join(names)}")
        if (clip.get("direction") is None) != (clip.get("speed") is None):
            raise ConfigError(f"{where}: a video needs both direction and speed, a still image neither")
        if not 0.0 < float(clip["size"]) < 0.5:
            raise ConfigError(f"{where}.size={clip['size']}: the shape's radius as a fraction of the frame, in "
                              "(0, 0.5)")
        specs.append(ShapeSpec(**{**clip, "size": float(clip["size"]), "offset": float(clip.get("offset", 0.0))}))
    return specs


def _shape_mask(shape: str, dx: np.ndarray, dy: np.ndarray, radius: float) -> np.ndarray:
    """Boolean mask of ``shape`` given pixel offsets from its centre."""
    if shape == "circle":
        return dx * dx + dy * dy <= radius * radius
    if shape == "square":
        half = radius * 0.88
        return (np.abs(dx) <= half) & (np.abs(dy) <= half)
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= radius * 1.15
    if shape == "triangle":  # pointing up, apex at -radius, base at +radius
        rel = (dy + radius) / (2.0 * radius)  # 0 at apex, 1 at base
        return (rel >= 0.0) & (rel <= 1.0) & (np.abs(dx) <= rel * radius)
    raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")


def render_frames(spec: ShapeSpec, num_frames: int, height: int, width: int) -> np.ndarray:
    """Draw ``spec`` as uint8 ``(num_frames, height, width, 3)`` frames."""
    radius = spec.size * min(height, width)
    ys = np.arange(height, dtype=np.float32)[:, None] + 0.5
    xs = np.arange(width, dtype=np.float32)[None, :] + 0.5
    mx, my = DIRECTIONS[spec.direction] if spec.direction is not None else (0, 0)
    travel = SPEEDS[spec.speed] if spec.speed is not None else 0.0
    span_x, span_y = (width - 2 * radius) * travel, (height - 2 * radius) * travel
    # perpendicular offset: horizontal motion shifts y, vertical motion (or none) shifts x
    base_x = width / 2 + (spec.offset * width if mx == 0 else 0.0)
    base_y = height / 2 + (spec.offset * height if mx != 0 else 0.0)

    background = np.array(COLORS[spec.background], dtype=np.uint8)
    color = np.array(COLORS[spec.color], dtype=np.uint8)
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for t in range(num_frames):
        progress = t / (num_frames - 1) if num_frames > 1 else 0.5
        cx = base_x + mx * (progress - 0.5) * span_x
        cy = base_y + my * (progress - 0.5) * span_y
        frames[t] = background
        frames[t][_shape_mask(spec.shape, xs - cx, ys - cy, radius)] = color
    return frames


def _build(folder: Path, videos: list[ShapeSpec], images: list[ShapeSpec], num_frames: int, height: int, width: int,
           fps: int) -> None:
    rows: list[tuple[str, str]] = []
    for i, spec in enumerate(videos):
        rel = f"videos/clip_{i:03d}.mp4"
        write_video(folder / rel, render_frames(spec, num_frames, height, width), fps=fps)
        rows.append((rel, spec.prompt))
    if images:
        (folder / "images").mkdir(parents=True, exist_ok=True)
    for i, spec in enumerate(images):
        rel = f"images/image_{i:03d}.png"
        Image.fromarray(render_frames(spec, 1, height, width)[0]).save(folder / rel)
        rows.append((rel, spec.prompt))
    with (folder / METADATA_NAME).open("w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(("video", "prompt"))
        writer.writerows(rows)


def make_demo_dataset(
    out_dir: str | os.PathLike[str],
    num_videos: int = 8,
    num_images: int = 2,
    num_frames: int = 17,
    height: int = 128,
    width: int = 128,
    fps: int = 24,
    seed: int = 0,
    clips=None,
) -> Path:
    """Build the demo dataset in ``out_dir`` (if needed) and return its ``metadata.csv`` path. The clips are written
    at ``fps`` (default: the tiny model's native rate, model.fps, so the demo trains them without resampling).
    ``clips`` (:func:`clip_specs`): exactly these items (the videos in their order, then the stills) instead of
    ``num_videos`` + ``num_images`` drawn from ``seed``.

    Idempotent: an existing ``out_dir/metadata.csv`` is returned untouched, whatever the
    arguments. Crash- and race-safe: files are built in a temporary sibling folder that is
    renamed into place; a process that loses a race discards its copy and uses the winner's.
    """
    if clips is not None:
        specs = clip_specs(clips)
        if not specs:
            raise ConfigError("data.generate.clips=[]: list at least one clip, or set it to null")
        videos = [s for s in specs if s.direction is not None]
        images = [s for s in specs if s.direction is None]
    elif num_videos < 0 or num_images < 0 or num_videos + num_images == 0:
        raise ValueError(f"need at least one item, got num_videos={num_videos}, num_images={num_images}")
    else:
        videos, images = demo_specs(num_videos, num_images, seed)
    if num_frames < 1 or height < 2 or width < 2:
        raise ValueError(f"num_frames must be >= 1 and height/width >= 2, got {num_frames}, {height}, {width}")
    out = Path(os.path.abspath(os.path.expanduser(os.fspath(out_dir))))
    metadata = out / METADATA_NAME
    if metadata.is_file():
        return metadata

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        _build(tmp, videos, images, num_frames, height, width, fps)
        try:
            os.rename(tmp, out)  # atomic; also replaces an empty out_dir on POSIX
        except OSError:
            if metadata.is_file():  # another process won the race
                return metadata
            raise MetadataError(
                f"data.metadata={metadata}: the generated demo clips go into {out}, which exists and holds no "
                f"{METADATA_NAME} (nothing was written there); point data.metadata (or paths.data_dir) at a new "
                "folder, or set data.generate=null to train on media you have"
            ) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return metadata
