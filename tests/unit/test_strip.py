"""The validation's before/after strip: per video its name and prompt over a row of the base model's frames and a row of
the LoRA's, a column per frame (up to six, evenly spaced, quantised as the mp4s are written), small frames enlarged
to a readable size; narrower videos padded."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from wanexp.generation import STRIP_BACKGROUND, STRIP_TILE, StripGroup, render_strip, strip_frames, write_strip


def _video(frames: int, h: int, w: int, offset: float) -> torch.Tensor:
    """Frame i is a flat grey of (i + offset) / 255: its value names it."""
    values = (torch.arange(frames, dtype=torch.float32) + offset) / 255.0
    return values.view(frames, 1, 1, 1).expand(frames, h, w, 3).clone()


def _group(title: str, base: torch.Tensor, lora: torch.Tensor, step: int = 7) -> StripGroup:
    (b, numbers), (a, _) = strip_frames(base), strip_frames(lora)
    return StripGroup(title, numbers, [("base", b), (f"LoRA step {step}", a)])


def test_strip_frames_are_evenly_spaced_from_the_first_to_the_last():
    frames, numbers = strip_frames(_video(9, 2, 3, 10))
    assert numbers == [0, 2, 3, 5, 6, 8] and frames.shape == (6, 2, 3, 3) and frames.dtype == np.uint8
    assert [int(f[0, 0, 0]) for f in frames] == [10, 12, 13, 15, 16, 18]
    assert strip_frames(_video(5, 2, 3, 0))[1] == [0, 1, 2, 3, 4]  # fewer frames than columns: every one


def test_the_strip_holds_base_and_lora_rows_a_column_per_frame_enlarged_to_a_readable_size(tmp_path):
    groups = [_group("p0_s0: a", _video(9, 16, 24, 0), _video(9, 16, 24, 100)),
              _group("p1_s0: b", _video(5, 8, 12, 50), _video(5, 8, 12, 150))]
    grid, boxes = render_strip(groups)
    path = tmp_path / "strip.png"
    write_strip(path, groups)
    assert (np.asarray(Image.open(path)) == grid).all() and not list(tmp_path.glob("*.tmp"))
    # video 1 (16 x 24 frames): x8 -> 128 x 192 tiles; frames 0, 2, 3, 5, 6, 8 of the base then of the LoRA
    for row, offset in ((0, 0), (1, 100)):
        for c, k in enumerate([0, 2, 3, 5, 6, 8]):
            top, left, h, w = boxes[(0, row, c)]
            assert (h, w) == (STRIP_TILE, 192)
            assert (grid[top:top + h, left:left + w] == k + offset).all()
    # video 2 (8 x 12): x16 -> 128 x 192, five columns; the rest of its rows is background padding
    top, left, h, w = boxes[(1, 1, 4)]
    assert (h, w) == (STRIP_TILE, 192) and (grid[top:top + h, left:left + w] == 154).all()
    assert (grid[top:top + h, left + w:] == STRIP_BACKGROUND).all() and grid.shape[1] > left + w
    # tiles do not overlap and lie below the title and the column header, right of the row labels
    assert boxes[(0, 0, 1)][1] > boxes[(0, 0, 0)][1] + 192 - 1 and boxes[(0, 1, 0)][0] >= boxes[(0, 0, 0)][0] + 128
    assert boxes[(0, 0, 0)][0] >= sum(boxes[(0, "header")][::2]) and boxes[(0, 0, 0)][1] >= boxes[(0, 0)][3]
    # frames at least as high as a tile stay as they are
    grid, boxes = render_strip([_group("big", _video(3, 200, 100, 0), _video(3, 200, 100, 9))])
    assert boxes[(0, 1, 2)][2:] == (200, 100)


def test_each_row_is_labelled_with_its_video_and_prompt_and_each_frame_with_what_it_is():
    """Text sits in the title (the video's name and prompt), over each column (its frame number) and left of each row
    ("base", "LoRA step N"): white on the background, different where the words differ, the same where they do
    not; a long prompt wraps instead of being cut."""
    prompt = ("p0_s0: a red square moving quickly from left to right on black, filmed from above in the soft light "
              "of an early summer morning by a drone")
    groups = [_group(prompt, _video(5, 16, 16, 0), _video(5, 16, 16, 100), step=200),
              _group("p1_s0: waves roll onto a beach", _video(5, 16, 16, 0), _video(5, 16, 16, 100), step=200)]
    grid, boxes = render_strip(groups)

    def region(key):
        top, left, h, w = boxes[key]
        return grid[top:top + h, left:left + w]

    for key in [(0, "title"), (0, "header"), (0, 0), (0, 1), (1, "title")]:
        assert region(key).max() > 200, key  # white text drawn there
    assert region((0, 0)).shape == region((0, 1)).shape and (region((0, 0)) != region((0, 1))).any()  # base / LoRA
    assert (region((0, 0)) == region((1, 0))).all() and (region((0, 1)) == region((1, 1))).all()  # same labels
    assert (region((0, "header")) == region((1, "header"))).all()  # frames 0..4 in both
    assert region((0, "title")).shape[0] > region((1, "title")).shape[0]  # the long prompt wraps onto more lines
    # the column header names each column apart: frame 0 and frame 1 differ, both drawn
    top, left, h, _ = boxes[(0, "header")]
    w = boxes[(0, 0, 1)][1] - boxes[(0, 0, 0)][1]
    cells = [grid[top:top + h, left + c * w:left + (c + 1) * w] for c in range(2)]
    assert all(c.max() > 200 for c in cells) and (cells[0] != cells[1]).any()
