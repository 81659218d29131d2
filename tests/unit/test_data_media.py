"""Unit tests for metadata reading, media decoding and the synthetic demo dataset."""

from __future__ import annotations

import csv
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import count_decoding
from wanexp.data import media as media_mod
from wanexp.data.media import MediaError, load_clip, write_video
from wanexp.data.metadata import (
    MetadataError,
    Reject,
    Sample,
    missing_files,
    read_metadata,
    read_metadata_with_rejects,
)
from wanexp.data.synthetic import COLORS, DIRECTIONS, demo_specs, make_demo_dataset, render_frames


# ----------------------------------------------------------------------------- helpers
def _counter_video(path: Path, num_frames: int, height: int = 32, width: int = 32) -> Path:
    """Video whose frame i is a flat grey of level 10 * i (easy to identify after decoding)."""
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    for i in range(num_frames):
        frames[i] = min(255, 10 * i)
    write_video(path, frames, fps=16)
    return path


def _frame_levels(clip: torch.Tensor) -> list[int]:
    """Recover the frame indices of a ``_counter_video`` clip."""
    levels = ((clip + 1.0) * 127.5).mean(dim=(0, 2, 3))
    return [round(float(v) / 10.0) for v in levels]


def _centroid(frame_chw: torch.Tensor, rgb: tuple[int, int, int], tol: float = 70.0) -> tuple[float, float]:
    """(x, y) centroid of pixels within ``tol`` of colour ``rgb``."""
    pixels = (frame_chw + 1.0) * 127.5
    dist = (pixels - torch.tensor(rgb, dtype=torch.float32)[:, None, None]).norm(dim=0)
    ys, xs = torch.nonzero(dist < tol, as_tuple=True)
    assert len(xs) > 20, "shape not found in frame"
    return float(xs.float().mean()), float(ys.float().mean())


def _write_csv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)
    return path


# ----------------------------------------------------------------------------- metadata
def test_read_csv_resolves_relative_paths(tmp_path: Path) -> None:
    meta = _write_csv(
        tmp_path / "meta.csv",
        ["video", "prompt"],
        [["videos/a.mp4", "a cat"], ["b.png", " a dog "], ["/abs/c.MOV", "a bird"]],
    )
    samples = read_metadata(meta)
    assert samples == [
        Sample(str(tmp_path / "videos" / "a.mp4"), "a cat", "video"),
        Sample(str(tmp_path / "b.png"), "a dog", "image"),
        Sample("/abs/c.MOV", "a bird", "video"),
    ]
    other = tmp_path / "elsewhere"
    assert read_metadata(meta, root=other)[0].path == str(other / "videos" / "a.mp4")


def test_read_csv_alternative_columns(tmp_path: Path) -> None:
    meta = _write_csv(tmp_path / "m.csv", ["file_name", "Caption"], [["x.jpg", "hello"]])
    assert read_metadata(meta) == [Sample(str(tmp_path / "x.jpg"), "hello", "image")]


def test_read_json_and_jsonl(tmp_path: Path) -> None:
    rows = [{"video": "v/1.mp4", "prompt": "one"}, {"image": "i/2.webp", "text": "two"}]
    expected = [
        Sample(str(tmp_path / "v" / "1.mp4"), "one", "video"),
        Sample(str(tmp_path / "i" / "2.webp"), "two", "image"),
    ]
    (tmp_path / "m.json").write_text(json.dumps(rows))
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_metadata(tmp_path / "m.json") == expected
    assert read_metadata(str(tmp_path / "m.jsonl")) == expected


def test_missing_files(tmp_path: Path) -> None:
    (tmp_path / "here.mp4").write_bytes(b"x")
    meta = _write_csv(tmp_path / "m.csv", ["video", "prompt"], [["here.mp4", "a"], ["gone.mp4", "b"]])
    assert missing_files(read_metadata(meta)) == [str(tmp_path / "gone.mp4")]


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("meta.txt", "video,prompt\na.mp4,x\n", ".csv"),
        ("meta.csv", "clip,prompt\na.mp4,x\n", "video, image, file_name, path"),
        ("meta.csv", "video,prompt\n", "no rows"),
        ("meta.csv", "", "empty"),
        ("meta.csv", "video,prompt\nnotes.txt,x\n", ".txt"),
        ("meta.json", "[]", "no rows"),
        ("meta.json", '{"video": "a.mp4"}', "list"),
        ("meta.jsonl", '{"clip": "a.mp4", "prompt": "x"}\n', "clip"),
        ("meta.jsonl", '{"video": "a.mp4", "prompt": "x"}\n{broken\n', "line 2"),
    ],
)
def test_metadata_errors(tmp_path: Path, name: str, content: str, needle: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(MetadataError) as info:
        read_metadata(path)
    message = str(info.value)
    assert name in message and needle in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("name", "content", "line"),
    [
        ("meta.csv", "video,prompt\na.mp4,x\nb.mp4,\n", "3"),
        ("meta.json", '[{"video": "a.mp4", "prompt": "x"}, {"video": "b.mp4", "prompt": "  "}]', "1 (entry 2)"),
    ],
)
def test_metadata_row_rejects(tmp_path: Path, name: str, content: str, line: str) -> None:
    """A bad row is rejected (and left out by read_metadata); the other rows survive."""
    path = tmp_path / name
    path.write_text(content)
    samples, rejects = read_metadata_with_rejects(path)
    assert samples == [Sample(str(tmp_path / "a.mp4"), "x", "video")]
    assert rejects == [Reject(f"{path}:{line}", str(tmp_path / "b.mp4"), "empty prompt")]
    assert read_metadata(path) == samples


def test_metadata_missing_file(tmp_path: Path) -> None:
    with pytest.raises(MetadataError, match="nope.csv.*not found"):
        read_metadata(tmp_path / "nope.csv")
    assert issubclass(MetadataError, ValueError)


# ----------------------------------------------------------------------------- synthetic + decode
@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_dataset(tmp_path_factory.mktemp("demo") / "data")


def test_demo_dataset_files(demo: Path) -> None:
    assert demo.name == "metadata.csv"
    with demo.open(newline="") as fh:
        reader = csv.reader(fh)
        assert next(reader) == ["video", "prompt"]
        rows = list(reader)
    assert len(rows) == 10
    assert all(not os.path.isabs(rel) for rel, _ in rows)
    samples = read_metadata(demo)
    assert missing_files(samples) == []
    assert [s.kind for s in samples] == ["video"] * 8 + ["image"] * 2
    assert len({s.prompt for s in samples}) == 10
    assert not [p for p in demo.parent.parent.iterdir() if p.name.startswith(".")], "temp folder left behind"


def test_demo_clip_moves_in_described_direction(demo: Path) -> None:
    videos, _ = demo_specs(8, 2, seed=0)
    samples = read_metadata(demo)
    assert {s.direction for s in videos} == set(DIRECTIONS)
    for sample, spec in zip(samples, videos):
        assert sample.prompt == spec.prompt
        assert spec.color in sample.prompt and spec.shape in sample.prompt and spec.direction in sample.prompt
        clip = load_clip(sample, num_frames=17, height=128, width=128)
        assert clip.shape == (3, 17, 128, 128) and clip.dtype == torch.float32
        assert float(clip.min()) >= -1.0 and float(clip.max()) <= 1.0
        assert float(clip.max() - clip.min()) > 1.0
        x0, y0 = _centroid(clip[:, 0], COLORS[spec.color])
        x1, y1 = _centroid(clip[:, -1], COLORS[spec.color])
        dx, dy = DIRECTIONS[spec.direction]
        moved_along = (x1 - x0) * dx + (y1 - y0) * dy
        moved_across = abs((x1 - x0) * dy) + abs((y1 - y0) * dx)
        assert moved_along > 20, (sample.prompt, (x0, y0), (x1, y1))
        assert moved_across < 3, (sample.prompt, (x0, y0), (x1, y1))


def test_every_demo_caption_fits_the_tiny_models_text_length(tmp_path: Path) -> None:
    """The demo trains no truncated caption: each possible caption, through the tiny models' own tokenizer, is at
    most model.text_len tokens (a longer one is a 'caption is N tokens, truncated' warning on every demo run)."""
    from omegaconf import OmegaConf

    from tests.conftest import CONF
    from wanexp.data.synthetic import SHAPES, SPEEDS, ShapeSpec
    from wanexp.models.wan22.build import build_tokenizer
    from wanexp.text import clean_prompt

    text_len = OmegaConf.load(CONF / "model" / "tiny.yaml").text_len
    build_tokenizer(tmp_path / "tok", text_len)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    specs = [ShapeSpec(shape, color, background, 0.1, 0.0, direction, speed) for shape in SHAPES for color in COLORS
             for background in COLORS for direction in (*DIRECTIONS, None) for speed in SPEEDS]
    prompts = sorted({clean_prompt(s.prompt) for s in specs}, key=len)
    ids = tokenizer(prompts, add_special_tokens=True, verbose=False).input_ids
    assert max(len(t) for t in ids) <= text_len, prompts[-1]


def test_demo_image_gives_one_frame(demo: Path) -> None:
    _, images = demo_specs(8, 2, seed=0)
    sample = read_metadata(demo)[-1]
    assert sample.kind == "image"
    clip = load_clip(sample, num_frames=17, height=64, width=96)
    assert clip.shape == (3, 1, 64, 96)
    x, y = _centroid(clip[:, 0], COLORS[images[-1].color])
    assert 20 < x < 76 and 10 < y < 54


def test_demo_is_deterministic(tmp_path: Path) -> None:
    a, b = demo_specs(8, 2, seed=3), demo_specs(8, 2, seed=3)
    assert a == b and demo_specs(8, 2, seed=4) != a
    frames = render_frames(a[0][0], 5, 32, 48)
    assert frames.shape == (5, 32, 48, 3) and frames.dtype == np.uint8
    assert not np.array_equal(frames[0], frames[-1])


def test_make_demo_dataset_idempotent(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    meta = make_demo_dataset(out, num_videos=2, num_images=1, num_frames=5, height=32, width=32)
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = make_demo_dataset(out, num_videos=5, num_images=0)
    assert again == meta
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == stamps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_make_demo_dataset_race(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(make_demo_dataset(out, num_videos=2, num_images=1, num_frames=5, height=32, width=32))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [out / "metadata.csv"] * 4
    assert missing_files(read_metadata(out / "metadata.csv")) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


def test_make_demo_dataset_refuses_foreign_folder(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    out.mkdir()
    (out / "something.txt").write_text("mine")
    from wanexp.errors import MetadataError

    with pytest.raises(MetadataError, match="exists and holds no metadata.csv"):
        make_demo_dataset(out, num_videos=1, num_images=0, num_frames=2, height=16, width=16)
    assert (out / "something.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no stray generated clips beside it


# ----------------------------------------------------------------------------- stride / length
@pytest.mark.parametrize("ext", [".mp4", ".mkv"])  # mkv has no frame count in its header
def test_stride_and_reduction(tmp_path: Path, ext: str) -> None:
    path = _counter_video(tmp_path / f"count{ext}", 17)
    assert _frame_levels(load_clip(path, 5, 16, 16)) == [0, 1, 2, 3, 4]
    assert _frame_levels(load_clip(path, 5, 16, 16, stride=3)) == [0, 3, 6, 9, 12]
    assert _frame_levels(load_clip(path, 5, 16, 16, stride=4)) == [0, 4, 8, 12, 16]
    # stride 8 needs 33 frames -> reduced to 4
    assert _frame_levels(load_clip(path, 5, 16, 16, stride=8)) == [0, 4, 8, 12, 16]
    # 9 frames at stride 3 needs 25 -> reduced to 2
    assert _frame_levels(load_clip(path, 9, 16, 16, stride=3)) == list(range(0, 17, 2))
    assert _frame_levels(load_clip(path, 17, 16, 16, stride=5)) == list(range(17))


def test_too_short_video(tmp_path: Path) -> None:
    path = _counter_video(tmp_path / "short.mp4", 5)
    with pytest.raises(MediaError) as info:
        load_clip(path, 8, 16, 16, stride=2)
    message = str(info.value)
    assert "short.mp4" in message and "5 frames" in message and "8" in message


def test_decoding_stops_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _counter_video(tmp_path / "long.mp4", 60)
    opened = count_decoding(monkeypatch, media_mod.av)
    clip = load_clip(path, 3, 16, 16, stride=2)
    assert _frame_levels(clip) == [0, 2, 4]
    assert len(opened) == 1 and opened[0].decoded == 5
    assert opened[0].closed


# ----------------------------------------------------------------------------- resize / errors
def test_resize_crop_non_square(tmp_path: Path) -> None:
    # 40x100 (H x W) image: left half red, right half blue, green stripe in the middle columns
    img = np.zeros((40, 100, 3), dtype=np.uint8)
    img[:, :50] = (255, 0, 0)
    img[:, 50:] = (0, 0, 255)
    img[:, 45:55] = (0, 255, 0)
    Image.fromarray(img).save(tmp_path / "wide.png")
    clip = load_clip(tmp_path / "wide.png", num_frames=4, height=64, width=48)
    assert clip.shape == (3, 1, 64, 48)
    # covering 40x100 to 64 rows scales by 1.6 -> 160 wide; the centre crop keeps mostly the stripe
    centre = (clip[:, 0, :, 24] + 1) * 127.5
    assert centre[1].min() > 200 and centre[0].max() < 40

    frames = np.repeat(img[None], 3, axis=0)
    write_video(tmp_path / "wide.mp4", frames)
    vclip = load_clip(tmp_path / "wide.mp4", num_frames=2, height=30, width=31)
    assert vclip.shape == (3, 2, 30, 31)
    assert float(vclip.min()) >= -1.0 and float(vclip.max()) <= 1.0


def test_upscale_small_source(tmp_path: Path) -> None:
    Image.fromarray(np.full((10, 14, 3), 128, np.uint8)).save(tmp_path / "tiny.jpg")
    clip = load_clip(str(tmp_path / "tiny.jpg"), 1, 33, 65)
    assert clip.shape == (3, 1, 33, 65)
    assert torch.allclose(clip, torch.full_like(clip, 128 / 127.5 - 1), atol=0.05)


def test_corrupt_files_raise_media_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    bad_video = tmp_path / "corrupt.mp4"
    bad_video.write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(MediaError, match="corrupt.mp4"):
        load_clip(bad_video, 4, 16, 16)
    bad_image = tmp_path / "corrupt.png"
    bad_image.write_bytes(rng.integers(0, 256, 512, dtype=np.uint8).tobytes())
    with pytest.raises(MediaError, match="corrupt.png"):
        load_clip(bad_image, 1, 16, 16)
    with pytest.raises(MediaError, match="absent.mp4"):
        load_clip(tmp_path / "absent.mp4", 1, 16, 16)
    with pytest.raises(MediaError, match="notes.txt"):
        load_clip(tmp_path / "notes.txt", 1, 16, 16)


def test_write_video_odd_size_and_validation(tmp_path: Path) -> None:
    frames = np.zeros((3, 15, 21, 3), dtype=np.uint8)
    write_video(tmp_path / "odd.mp4", frames)
    assert load_clip(tmp_path / "odd.mp4", 3, 15, 21).shape == (3, 3, 15, 21)
    with pytest.raises(ValueError):
        write_video(tmp_path / "bad.mp4", np.zeros((3, 16, 16), dtype=np.uint8))
    with pytest.raises(ValueError):
        write_video(tmp_path / "bad.mp4", np.zeros((3, 16, 16, 3), dtype=np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.mp4"]


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_clip(tmp_path / "x.mp4", 0, 16, 16)
    with pytest.raises(ValueError):
        load_clip(tmp_path / "x.mp4", 4, 16, 16, stride=0)
