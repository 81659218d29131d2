"""Users' datasets as they are: DiffSynth CSV, VideoX-Fun JSON/JSONL, .txt caption folders; bad rows and bad media.

Every file here is real: small mp4/mkv clips written with PyAV, PNG/JPEG images written with PIL, and broken
files made from them (zero bytes, random bytes, cut in half, too short, garbage image).
"""
from __future__ import annotations

import json
import logging
import os
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from wanexp.data import media as media_mod
from wanexp.data.media import write_video
from wanexp.data.metadata import MetadataError, Reject, Sample, read_metadata, read_metadata_with_rejects
from wanexp.data.probe import ProbeWarning, probe_sample, probe_samples
from wanexp.data.synthetic import demo_specs, render_frames

NUM_FRAMES, STRIDE, SIZE = 9, 2, 64  # a clip needs frames 0, 2, ..., 16: 17 frames
PROBE = dict(num_frames=NUM_FRAMES, frame_stride=STRIDE, height=SIZE, width=SIZE)
BAD_UTF8 = b"\xff\xfe bad"


# ----------------------------------------------------------------------------- media writers
def _frames(index: int, num_frames: int = 17, height: int = SIZE, width: int = SIZE) -> np.ndarray:
    videos, _ = demo_specs(4, 0, seed=index)
    return render_frames(videos[index % 4], num_frames, height, width)


def _video(path: Path, index: int = 0, num_frames: int = 17) -> Path:
    write_video(path, _frames(index, num_frames))
    return path


def _faststart_video(path: Path, num_frames: int = 17) -> Path:
    """An mp4 with its index (moov) first, as web-ready files are: cut short, it still opens and claims all frames.

    Noise frames, so the bytes spread evenly over the frames and a cut in half loses about half of them.
    """
    frames = np.random.default_rng(1).integers(0, 256, (num_frames, SIZE, SIZE, 3), dtype=np.uint8)
    codec = media_mod._video_codec()
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream(codec, rate=Fraction(16))
        stream.width, stream.height, stream.pix_fmt = SIZE, SIZE, "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return path


def _image(path: Path, width: int = SIZE, height: int = 48) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:, : width // 2] = (200, 40, 40)
    pixels[:, width // 2 :] = (40, 40, 200)
    Image.fromarray(pixels).save(path)
    return path


def _cut_in_half(src: Path, dst: Path) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2])
    return dst


def _write_bad_media(folder: Path) -> None:
    """The broken files, by name: each one is what a real dataset ends up holding sooner or later."""
    rng = np.random.default_rng(0)
    (folder / "bad").mkdir(parents=True, exist_ok=True)
    (folder / "bad" / "zero.mp4").write_bytes(b"")
    (folder / "bad" / "corrupt.mp4").write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _cut_in_half(_faststart_video(folder / "bad" / "whole_faststart.mp4"), folder / "bad" / "truncated.mp4")
    _cut_in_half(_video(folder / "bad" / "whole.mp4"), folder / "bad" / "truncated_noindex.mp4")
    _video(folder / "bad" / "short.mp4", num_frames=NUM_FRAMES - 4)  # too few even at stride 1
    _video(folder / "videos" / "strided.mp4", num_frames=NUM_FRAMES + 3)  # enough at stride 1, not at stride 2
    (folder / "bad" / "garbage.png").write_bytes(rng.integers(0, 256, 512, dtype=np.uint8).tobytes())
    _image(folder / "bad" / "tiny.png", 20, 20)


# ----------------------------------------------------------------------------- DiffSynth-Studio CSV
# (media path, prompt or raw prompt bytes, expected reject reason or None); line numbers follow the order.
CSV_ROWS: list[tuple[str, str | bytes, str | None]] = [
    ("videos/clip_a.mp4", "a red circle moving from left to right", None),
    ("images/still_b.png", "a blue square, on a white background", None),
    ("videos/clip_c.mp4", 'two lines: "quoted"\nand a comma, here', None),  # spans lines 4-5
    ("images/photo_d.jpg", "a photo", None),
    ("videos/clip_a.mp4", "   ", "empty prompt"),
    ("images/still_b.png", BAD_UTF8, "prompt is not UTF-8"),
    ("notes/readme.xyz", "a file that is not media", "unknown media type '.xyz'"),
    ("", "a prompt without media", "empty media path"),
    ("videos/missing.mp4", "gone", None),
    ("bad/zero.mp4", "zero bytes", None),
    ("bad/corrupt.mp4", "random bytes", None),
    ("bad/truncated.mp4", "cut in half", None),
    ("bad/truncated_noindex.mp4", "cut in half, index lost", None),
    ("bad/short.mp4", "too short", None),
    ("bad/garbage.png", "not an image", None),
    ("bad/tiny.png", "a tiny image", None),
]
# The reject reason each media file gets from the probe (None: usable); prefixes end with "(" or " ".
PROBE_REASONS: dict[str, str | None] = {
    "videos/clip_a.mp4": None,
    "images/still_b.png": None,
    "videos/clip_c.mp4": None,
    "images/photo_d.jpg": None,
    "videos/missing.mp4": "file not found",
    "bad/zero.mp4": "empty file (0 bytes)",
    "bad/corrupt.mp4": "cannot open video (",
    "bad/truncated.mp4": "truncated or corrupt video: decoding failed at frame ",
    "bad/truncated_noindex.mp4": "cannot open video (",
    "bad/short.mp4": "too few frames: 5, needs 9 (num_frames=9, at frame_stride 1)",
    "bad/garbage.png": "cannot read image (",
    "bad/tiny.png": None,
}


def _csv_field(value: str | bytes) -> bytes:
    raw = value if isinstance(value, bytes) else value.encode("utf-8")
    return b'"' + raw.replace(b'"', b'""') + b'"' if any(c in raw for c in b',"\n') else raw


def _csv_lines() -> list[int]:
    """The line each CSV_ROWS row starts on (the header is line 1)."""
    lines, line = [], 2
    for _, prompt, _ in CSV_ROWS:
        lines.append(line)
        line += 1 + (prompt.count("\n") if isinstance(prompt, str) else 0)
    return lines


@pytest.fixture(scope="module")
def diffsynth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("diffsynth")
    _video(folder / "videos" / "clip_a.mp4", 0)
    _video(folder / "videos" / "clip_c.mp4", 1)
    _image(folder / "images" / "still_b.png")
    _image(folder / "images" / "photo_d.jpg", 96, 64)
    _write_bad_media(folder)
    body = b"".join(_csv_field(media) + b"," + _csv_field(prompt) + b"\n" for media, prompt, _ in CSV_ROWS)
    (folder / "train_metadata.csv").write_bytes(b"video,prompt\n" + body)
    # the 5k subset: first rows only, saved by a Windows tool (BOM, CRLF)
    subset = b"".join(_csv_field(m) + b"," + _csv_field(p) + b"\r\n" for m, p, _ in CSV_ROWS[:2])
    (folder / "train_metadata_5k.csv").write_bytes(b"\xef\xbb\xbfvideo,prompt\r\n" + subset)
    return folder


def _expected_csv(folder: Path) -> tuple[list[Sample], list[Reject]]:
    meta = folder / "train_metadata.csv"
    samples, rejects = [], []
    for (media, prompt, reason), line in zip(CSV_ROWS, _csv_lines()):
        path = str(folder / media) if media else ""
        if reason is None:
            kind = "image" if media.endswith((".png", ".jpg")) else "video"
            samples.append(Sample(path, prompt.strip(), kind))
        else:
            rejects.append(Reject(f"{meta}:{line}", path, reason))
    return samples, rejects


def test_diffsynth_csv(diffsynth: Path) -> None:
    samples, rejects = read_metadata_with_rejects(diffsynth / "train_metadata.csv")
    assert (samples, rejects) == _expected_csv(diffsynth)
    assert samples[2].prompt == 'two lines: "quoted"\nand a comma, here'
    assert [r.source.rsplit(":", 1)[1] for r in rejects] == ["7", "8", "9", "10"]  # the multi-line row counts 2

    subset, none = read_metadata_with_rejects(diffsynth / "train_metadata_5k.csv")
    assert none == [] and subset == samples[:2]
    assert [s.kind for s in subset] == ["video", "image"]


def test_read_metadata_leaves_rejects_out(diffsynth: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="wanexp.data.metadata"):
        samples = read_metadata(diffsynth / "train_metadata.csv")
    assert samples == _expected_csv(diffsynth)[0]
    (message,) = [r.getMessage() for r in caplog.records]
    assert "left out 4 of 16 rows" in message and "train_metadata.csv:7: empty prompt" in message


def test_all_rows_rejected_is_an_error(tmp_path: Path) -> None:
    meta = tmp_path / "meta.csv"
    meta.write_bytes(b"video,prompt\na.mp4,\nb.mp4," + BAD_UTF8 + b"\n")
    samples, rejects = read_metadata_with_rejects(meta)
    assert samples == [] and [r.reason for r in rejects] == ["empty prompt", "prompt is not UTF-8"]
    with pytest.raises(MetadataError, match=r"meta.csv: no usable rows, all 2 rejected \(first: .*meta.csv:2: empty"):
        read_metadata(meta)


# ----------------------------------------------------------------------------- VideoX-Fun JSON / JSONL
VXF_ENTRIES: list[tuple[object, str | None]] = [
    ({"file_path": "videos/clip_a.mp4", "text": "a clip", "type": "video"}, None),
    ({"file_path": "images/still_b.png", "text": "a still", "type": "image"}, None),
    ({"file_path": "videos/clip_c.mp4", "text": "no type: the extension decides"}, None),
    ({"file_path": "videos/clip_e.ts", "text": "type decides: a .ts stream", "type": "Video"}, None),
    ({"file_path": "videos/clip_a.mp4", "text": "", "type": "video"}, "empty prompt"),
    ({"file_path": "audio/song.mp3", "text": "a song", "type": "audio"}, "unknown type 'audio'"),
    ({"text": "no media", "type": "image"}, "empty media path"),
    ("just a string", "entry is not a JSON object"),
]


def _expected_vxf(folder: Path, meta: Path, where) -> tuple[list[Sample], list[Reject]]:  # type: ignore[no-untyped-def]
    samples, rejects = [], []
    for number, (entry, reason) in enumerate(VXF_ENTRIES, start=1):
        path = str(folder / entry["file_path"]) if isinstance(entry, dict) and "file_path" in entry else ""
        if reason is None:
            kind = entry.get("type", "").lower() or ("image" if path.endswith(".png") else "video")
            samples.append(Sample(path, entry["text"], kind))
        else:
            rejects.append(Reject(f"{meta}:{where(number)}", path, reason))
    return samples, rejects


def test_videox_fun_json_and_jsonl(diffsynth: Path) -> None:
    as_json = diffsynth / "videox_fun.json"
    as_json.write_text("[\n" + ",\n".join(json.dumps(e) for e, _ in VXF_ENTRIES) + "\n]\n")
    assert read_metadata_with_rejects(as_json) == _expected_vxf(
        diffsynth, as_json, lambda n: f"{n + 1} (entry {n})"
    )
    one_line = diffsynth / "videox_fun_compact.json"
    one_line.write_text(json.dumps([e for e, _ in VXF_ENTRIES]))
    assert read_metadata_with_rejects(one_line) == _expected_vxf(diffsynth, one_line, lambda n: f"1 (entry {n})")

    as_jsonl = diffsynth / "videox_fun.jsonl"
    bad = b'{"file_path": "videos/clip_c.mp4", "text": "' + BAD_UTF8 + b'", "type": "video"}'
    lines = [json.dumps(e).encode() for e, _ in VXF_ENTRIES] + [bad]
    as_jsonl.write_bytes(b"\n".join(lines) + b"\n")
    samples, rejects = read_metadata_with_rejects(as_jsonl)
    expected = _expected_vxf(diffsynth, as_jsonl, str)
    assert samples == expected[0]
    assert rejects == [
        *expected[1],
        Reject(f"{as_jsonl}:{len(lines)}", str(diffsynth / "videos" / "clip_c.mp4"), "prompt is not UTF-8"),
    ]


def test_file_level_problems_still_raise(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text('[{"file_path": "a.mp4", "text": "x"},')
    with pytest.raises(MetadataError, match="broken.json: invalid JSON"):
        read_metadata_with_rejects(tmp_path / "broken.json")
    (tmp_path / "nocaption.jsonl").write_text('{"file_path": "a.mp4", "type": "video"}\n')
    with pytest.raises(MetadataError, match="nocaption.jsonl: no prompt column"):
        read_metadata_with_rejects(tmp_path / "nocaption.jsonl")
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "empty_folder" / "notes.txt").write_text("no media here")
    with pytest.raises(MetadataError, match="empty_folder: no media files found"):
        read_metadata_with_rejects(tmp_path / "empty_folder")
    with pytest.raises(MetadataError, match="absent: metadata file not found"):
        read_metadata_with_rejects(tmp_path / "absent")


# ----------------------------------------------------------------------------- .txt caption folder
@pytest.fixture(scope="module")
def captions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("captions")
    _video(folder / "clip1.mp4", 0)
    (folder / "clip1.txt").write_text("a clip\n")
    _image(folder / "sub" / "still.png")
    (folder / "sub" / "still.txt").write_text("  a still image  ")
    mkv = folder / "sub" / "deeper" / "clip2.mkv"  # mkv keeps no frame count: the probe counts packets
    write_video(mkv, _frames(2))
    (folder / "sub" / "deeper" / "clip2.txt").write_bytes("ünïcödé caption".encode())
    _video(folder / "nocap.mp4", 3)
    _image(folder / "empty.png")
    (folder / "empty.txt").write_text(" \n ")
    _video(folder / "badcap.mp4", 1)
    (folder / "badcap.txt").write_bytes(BAD_UTF8)
    _image(folder / "tiny.jpg", 20, 20)
    (folder / "tiny.txt").write_text("a tiny image")
    _image(folder / ".hidden.png")  # hidden: skipped, as are leftovers of interrupted writes
    (folder / ".hidden.txt").write_text("hidden")
    (folder / "orphan.txt").write_text("a caption without media")
    (folder / "readme.md").write_text("not media")
    return folder


def test_caption_folder(captions: Path) -> None:
    samples, rejects = read_metadata_with_rejects(captions, root="/ignored")
    assert samples == [
        Sample(str(captions / "clip1.mp4"), "a clip", "video"),
        Sample(str(captions / "sub" / "deeper" / "clip2.mkv"), "ünïcödé caption", "video"),
        Sample(str(captions / "sub" / "still.png"), "a still image", "image"),
        Sample(str(captions / "tiny.jpg"), "a tiny image", "image"),
    ]
    reasons = {
        "badcap.mp4": "caption is not UTF-8",
        "empty.png": "empty caption",
        "nocap.mp4": "no caption file 'nocap.txt'",
    }
    assert rejects == [Reject(str(captions / n), str(captions / n), r) for n, r in reasons.items()]
    assert read_metadata(captions) == samples


def test_probe_caption_folder(captions: Path) -> None:
    samples = read_metadata(captions)
    results = [probe_sample(s, **PROBE) for s in samples]
    assert [(r.ok, r.width, r.height, r.frames) for r in results] == [
        (True, SIZE, SIZE, 17), (True, SIZE, SIZE, 17), (True, SIZE, 48, 1), (True, 20, 20, 1)
    ]
    assert results[3].warnings == ("small image 20x20: upscaled 3.2x to cover 64x64",)
    assert all(not r.warnings for r in results[:3])


# ----------------------------------------------------------------------------- probing bad media
def test_probe_rejects_bad_media(diffsynth: Path) -> None:
    samples = read_metadata(diffsynth / "train_metadata.csv")
    good, rejects, warnings = probe_samples(samples, **PROBE, workers=4)

    expected_good = [s for s in samples if PROBE_REASONS[os.path.relpath(s.path, diffsynth)] is None]
    assert [r.sample for r in good] == expected_good and all(r.width > 0 and r.frames > 0 for r in good)
    assert [r.path for r in rejects] == [s.path for s in samples if s not in expected_good]
    for reject in rejects:
        expected = PROBE_REASONS[os.path.relpath(reject.path, diffsynth)]
        assert reject.source == reject.path
        assert "\n" not in reject.reason
        if expected.endswith(("(", " ")):  # a prefix; FFmpeg's or PIL's words follow
            assert reject.reason.startswith(expected) and reject.reason.endswith(")"), reject
        else:
            assert reject.reason == expected, reject
    truncated = [r.reason for r in rejects if r.path.endswith("bad/truncated.mp4")]
    assert truncated[0].split("(")[0] in (
        f"truncated or corrupt video: decoding failed at frame {n} of 17 " for n in range(1, 17)
    )
    tiny = str(diffsynth / "bad" / "tiny.png")
    assert warnings == [ProbeWarning(tiny, tiny, "small image 20x20: upscaled 3.2x to cover 64x64")]
    # the same answer on one thread: the order does not depend on scheduling
    assert probe_samples(samples, **PROBE, workers=1) == (good, rejects, warnings)


def test_probe_reports_size_and_frames(diffsynth: Path) -> None:
    video = probe_sample(Sample(str(diffsynth / "videos" / "clip_a.mp4"), "x", "video"), **PROBE)
    assert (video.ok, video.width, video.height, video.frames, video.warnings) == (True, SIZE, SIZE, 17, ())
    image = probe_sample(Sample(str(diffsynth / "images" / "photo_d.jpg"), "x", "image"), **PROBE)
    assert (image.ok, image.width, image.height, image.frames) == (True, 96, 64, 1)
    # the short clip is fine when the clip it must give fits (5 frames at stride 1)
    short = probe_sample(Sample(str(diffsynth / "bad" / "short.mp4"), "x", "video"), 5, 1, SIZE, SIZE)
    assert (short.ok, short.frames) == (True, 5)
    # 12 frames give 9 at stride 1 but not at stride 2: usable, and the loader lowers the stride (load_clip does)
    strided = probe_sample(Sample(str(diffsynth / "videos" / "strided.mp4"), "x", "video"), **PROBE)
    assert strided.ok and strided.frames == 12
    assert strided.warnings == ("short video: 12 frames, so frame_stride 2 is lowered to 1",)
    # a truncated file is usable as long as the frames a clip needs come before the cut
    cut = probe_sample(Sample(str(diffsynth / "bad" / "truncated.mp4"), "x", "video"), 2, 1, SIZE, SIZE)
    assert cut.ok and cut.frames == 17  # the header's count: only the needed frames are decoded
    # a small video that needs more than 2x upscaling warns, and so does a target much larger than the media
    big = probe_sample(Sample(str(diffsynth / "videos" / "clip_a.mp4"), "x", "video"), 9, 2, 160, 96)
    assert big.ok and big.warnings == ("small video 64x64: upscaled 2.5x to cover 96x160",)
    odd = probe_sample(Sample(str(diffsynth / "videos" / "clip_a.mp4"), "x", "gif-ish"), **PROBE)
    assert odd.reason == "unknown media type 'gif-ish'"


# ----------------------------------------------------------------------------- probe warnings per aspect bucket
def test_upscale_warning_is_against_each_files_own_bucket(tmp_path: Path) -> None:
    """With data.buckets a file trains at the bucket nearest its aspect ratio, not at data.height x data.width:
    the probe warns only for media that bucket enlarges past UPSCALE_WARN, naming the bucket the datamodule assigns."""
    from tests.conftest import compose_cfg
    from wanexp.composition import build

    _video(tmp_path / "clip.mp4")  # 64x64: trains at 64x64, no upscaling
    _image(tmp_path / "wide.png", 128, 64)  # trains at 64x128 (height x width)
    _image(tmp_path / "tiny.png", 20, 20)  # 3.2x to 64x64
    _image(tmp_path / "tiny_wide.png", 48, 24)  # 2.7x to 64x128
    (tmp_path / "meta.csv").write_text("video,prompt\nclip.mp4,a clip\nwide.png,wide\ntiny.png,tiny\n"
                                       "tiny_wide.png,tiny wide\n")
    data = ["data=synthetic", "data.generate=null", f"data.metadata={tmp_path}/meta.csv", "data.num_frames=9",
            "data.height=256", "data.width=256", "data.num_workers=0", f"data.rejects={tmp_path}/rejects.jsonl"]

    def warned(*extra: str) -> tuple[dict, dict]:
        dm = build(compose_cfg(["model.path=/x", *data, *extra]).data, seed=0)
        samples, shapes, _, _ = dm.items()
        lines = [json.loads(x) for x in (tmp_path / "rejects.jsonl").read_text().splitlines()]
        return ({Path(x["path"]).name: x["reason"] for x in lines if x["kind"] == "warning"},
                {Path(s.path).name: shape for s, shape in zip(samples, shapes)})

    reasons, shapes = warned("data.buckets=[[64,128],[128,64],[64,64]]")
    assert reasons == {"tiny.png": "small image 20x20: upscaled 3.2x to cover 64x64",
                       "tiny_wide.png": "small image 48x24: upscaled 2.7x to cover 128x64"}
    assert shapes["tiny.png"] == (1, 64, 64) and shapes["tiny_wide.png"] == (1, 64, 128)  # what the warnings name
    reasons, _ = warned("data.buckets=null")  # one size for every file: each one is enlarged to 256x256
    assert sorted(reasons) == ["clip.mp4", "tiny.png", "tiny_wide.png", "wide.png"]
    assert reasons["clip.mp4"] == "small video 64x64: upscaled 4.0x to cover 256x256"


def test_compose_time_token_count_matches_the_models_latent_grid() -> None:
    """config.rules counts a bucket's DiT tokens from model.hw_multiple alone (no model import); the spec's VAE
    stride x patch size must give the same count for every shipped model, or the token-budget check would drift."""
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    from tests.conftest import CONF, compose_cfg
    from wanexp.config.rules import _dit_tokens
    from wanexp.data.datamodule import dit_tokens

    for path in sorted((CONF / "model").glob("*.yaml")):
        m = OmegaConf.to_container(compose_cfg([f"model={path.stem}", "model.path=/x"]).model)
        spec = get_class(m["_target_"])
        assert m["hw_multiple"] == spec.vae_stride[1] * spec.patch[1] == spec.vae_stride[2] * spec.patch[2], path.stem
        assert m["frame_rule"][0] == spec.vae_stride[0], path.stem  # the YAML's frame rule is its VAE's stride
        for frames, h, w in ((17, 704, 1280), (81, 480, 832), (1, 64, 96)):
            h, w = h // m["hw_multiple"] * m["hw_multiple"], w // m["hw_multiple"] * m["hw_multiple"]
            rule = m["frame_rule"]
            assert _dit_tokens(frames, h, w, m["hw_multiple"], rule) == dit_tokens((frames, h, w), spec.vae_stride,
                                                                               spec.patch), (path.stem, frames, h, w)
