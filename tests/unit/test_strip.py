"""The validation's before/after strip: the first, middle and last frames of the base's and the LoRA's videos, a row per
video, quantised as the mp4s are written; rows of narrower shapes padded with black."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from wanexp.sampling import strip_frames, write_strip


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
