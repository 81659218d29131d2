"""A run over a data set holding one bad file of each kind finishes; every bad row is listed with its reason."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.integration.conftest import tiny_run
from tests.unit.test_data_formats import _write_bad_media

BAD_ROWS = {  # metadata row -> the reason it is rejected with
    "bad/zero.mp4,zero bytes": "empty file (0 bytes)",
    "bad/corrupt.mp4,random bytes": "cannot open video (",
    "bad/truncated.mp4,cut in half": "truncated or corrupt video: decoding failed at frame ",
    "bad/short.mp4,too short": "too few frames: 5, needs 9",
    "bad/garbage.png,not an image": "cannot read image (",
    "clips/missing.mp4,gone": "file not found",
    "bad/notes.xyz,not media": "unknown media type '.xyz'",
    "bad/tiny.png,": "empty prompt",
}

# the bad files are written at write_video's 16 fps: the runs train at that rate (model=tiny's own is 24), so a clip
# needs the frames the probe finds missing in them
AT_THEIR_RATE = "data.fps=16"

LONG_CAPTION = " ".join(["a long caption"] * 6)  # 89 characters: the demo's own captions fit the tiny model's 64 tokens


@pytest.fixture
def messy_data(shared_dir, tmp_path) -> Path:
    src = Path(shared_dir) / "data" / "synthetic"
    if not (src / "metadata.csv").exists():  # the demo clips, generated once per session
        tiny_run(shared_dir, tmp_path / "warm", ["model=tiny", "trainer.max_steps=1"])
    data = tmp_path / "messy"
    shutil.copytree(src, data)
    _write_bad_media(data)
    (data / "bad" / "notes.xyz").write_text("x")
    rows = (data / "metadata.csv").read_bytes().rstrip(b"\n") + b"\n"
    rows += "\n".join(BAD_ROWS).encode() + b"\n" + b"bad/tiny.png,caf\xe9 au lait\n" + b"bad/tiny.png,a tiny image\n"
    rows += f"videos/clip_000.mp4,{LONG_CAPTION}\n".encode()
    (data / "metadata.csv").write_bytes(rows)
    return data


def test_a_run_skips_every_bad_row_and_lists_it(shared_dir, tmp_path, messy_data):
    r = tiny_run(shared_dir, tmp_path / "run", [
        "model=tiny", f"data.metadata={messy_data}/metadata.csv", "data.generate=null", AT_THEIR_RATE,
        "data.max_reject_fraction=0.6", "trainer.max_steps=2"])
    assert r["global_step"] == 2
    out = Path(r["output_dir"])
    lines = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    rejects = [(x["path"].removeprefix(str(messy_data) + "/"), x["reason"]) for x in lines if x["kind"] == "reject"]
    for row, reason in BAD_ROWS.items():
        path = row.split(",")[0]
        assert any(p == path and got.startswith(reason) for p, got in rejects), (path, reason, rejects)
    assert any(x["reason"] == "prompt is not UTF-8" and x["source"].endswith(f":{1 + 10 + len(BAD_ROWS) + 1}") for x in lines)
    warnings = [x for x in lines if x["kind"] == "warning"]
    upscaled = [w for w in warnings if "upscaled" in w["reason"]]
    assert [w["path"].endswith("bad/tiny.png") for w in upscaled] == [True]
    # the tiny model reads 64 tokens (its tokenizer: one a byte): a longer caption is warned, not rejected
    long = [w for w in warnings if w["reason"].startswith("caption is ")]
    assert [w["reason"] for w in long] == [f"caption is {len(LONG_CAPTION) + 1} tokens, truncated to 64 "
                                           "(model.text_len)"]
    assert len(upscaled) + len(long) == len(warnings)
    status = json.loads((out / "status.json").read_text())
    assert status["data"]["rejected"] == len(BAD_ROWS) + 1 and status["data"]["rows"] == 10 + len(BAD_ROWS) + 3
    assert status["data"]["long_captions"] == len(long)


def test_mostly_broken_data_stops_before_training(shared_dir, tmp_path, messy_data):
    from wanexp.errors import MetadataError

    with pytest.raises(MetadataError, match=r"9 of 21 samples rejected, more than data.max_reject_fraction=0.05 "
                                            r"\(first: .*; all in .*rejects.jsonl\)"):
        tiny_run(shared_dir, tmp_path / "run", ["model=tiny", f"data.metadata={messy_data}/metadata.csv",
                                                "data.generate=null", AT_THEIR_RATE])
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_clip_that_fails_during_training_is_replaced_and_listed(shared_dir, tmp_path):
    """Unprobed (data.probe=false), a corrupt clip fails in the loader: its batch takes the next clip of the bucket,
    the failure is listed per rank, and past data.max_reject_fraction of the drawn samples the run stops."""
    src = Path(shared_dir) / "data" / "synthetic"
    if not (src / "metadata.csv").exists():
        tiny_run(shared_dir, tmp_path / "warm", ["model=tiny", "trainer.max_steps=1"])
    data = tmp_path / "data"
    shutil.copytree(src, data)
    (data / "broken.mp4").write_bytes(bytes(range(256)) * 64)
    rows = (data / "metadata.csv").read_text().rstrip("\n") + "\nbroken.mp4,a clip that does not decode\n"
    (data / "metadata.csv").write_text(rows)
    common = ["model=tiny", f"data.metadata={data}/metadata.csv", "data.generate=null", "data.probe=false"]
    r = tiny_run(shared_dir, tmp_path / "run", [*common, "data.max_reject_fraction=0.5", "trainer.max_steps=6"])
    assert r["global_step"] == 6
    out = Path(r["output_dir"])
    lines = [json.loads(x) for x in (out / "rejects-online-r000.jsonl").read_text().splitlines()]
    assert lines and all(x["path"].endswith("broken.mp4") and "cannot" in x["reason"] for x in lines)
    assert json.loads((out / "status.json").read_text())["rejected_online"] == len(lines)
    from wanexp.errors import MetadataError

    with pytest.raises(MetadataError, match=r"samples failed to decode during training, more than "
                                            r"data.max_reject_fraction=0.05"):
        tiny_run(shared_dir, tmp_path / "strict", [*common, "trainer.max_steps=12"])
