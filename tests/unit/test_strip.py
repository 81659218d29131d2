"""The validation's before/after strip: the first, middle and last frames of the base's and the LoRA's videos, a row per
video, quantised as the mp4s are written; rows of narrower shapes padded with black."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from wanexp.generation import strip_frames, write_strip


def _video(frames: int, h: int, w: int, offset: float) -> torch.Tensor:
    """Frame i is a flat grey of (i + offset) / 255: its value names it."""
    values = (torch.arange(frames, dtype=torch.float32) + offset) / 255.0
    return values.view(frames, 1, 1, 1).expand(frames, h, w, 3).clone()


def test_the_strip_holds_first_middle_last_frames_of_base_then_lora_a_row_per_video(tmp_path):
    rows = [(strip_frames(_video(9, 4, 6, 0)), strip_frames(_video(9, 4, 6, 100))),
            (strip_frames(_video(5, 2, 3, 50)), strip_frames(_video(5, 2, 3, 150)))]
    path = tmp_path / "strip.png"
    write_strip(path, rows)
    grid = np.asarray(Image.open(path))
    assert grid.shape == (4 + 2, 6 * 6, 3) and not list(tmp_path.glob("*.tmp"))
    # row 1: frames 0, 4, 8 of the base (values 0, 4, 8), then of the LoRA (100, 104, 108), each 6 pixels wide
    assert [int(grid[0, 6 * k, 0]) for k in range(6)] == [0, 4, 8, 100, 104, 108]
    # row 2 (2 x 3 frames): frames 0, 2, 4; the rest of the row is black padding
    assert [int(grid[4, 3 * k, 0]) for k in range(6)] == [50, 52, 54, 150, 152, 154]
    assert not grid[4:, 18:].any()


def test_each_row_is_labelled_with_its_video_and_prompt_and_each_frame_with_what_it_is(tmp_path):
    """With labels, a band of text sits above each row: the row's label (video and prompt) on its first line, then
    over each of the six frames which it is (base/LoRA first/middle/last); the frames below are unchanged."""
    from wanexp.generation import label_band

    rows = [(strip_frames(_video(9, 64, 64, 0)), strip_frames(_video(9, 64, 64, 100))),
            (strip_frames(_video(9, 64, 64, 50)), strip_frames(_video(9, 64, 64, 150)))]
    labels = ["p0_s0: a red fox runs through fresh snow", "p1_s0: waves roll onto a sandy beach"]
    path = tmp_path / "strip.png"
    write_strip(path, rows, labels)
    grid = np.asarray(Image.open(path))
    bands = [label_band((64, 6 * 64, 3), label) for label in labels]
    h = bands[0].shape[0]
    assert grid.shape == (2 * (h + 64), 6 * 64, 3)
    for k, (pair, band) in enumerate(zip(rows, bands)):
        top = k * (h + 64)
        assert (grid[top:top + h] == band).all() and (grid[top + h:top + h + 64] == np.concatenate(pair, 1)).all()
    # the label is drawn: legible white text on black, different labels give different first lines
    first, second = slice(0, int(0.55 * h)), slice(int(0.6 * h), h)
    assert bands[0].max() > 200 and (bands[0][first] != bands[1][first]).any()
    # the second line names each of the six frames, the same in every row
    assert all(bands[0][second, 64 * c:64 * (c + 1)].max() > 200 for c in range(6))
    assert (bands[0][second] == bands[1][second]).all()
