"""data.generate.clips: generated clips listed one by one (the demo's red and blue squares) instead of drawn at random;
a clip that names an unknown colour, shape or key is one line naming the entry."""
from __future__ import annotations

import csv

import av
import numpy as np
import pytest

from wanexp.data.synthetic import COLORS, make_demo_dataset
from wanexp.errors import ConfigError

RED = {"shape": "square", "color": "red", "background": "black", "size": 0.2, "direction": "from left to right",
       "speed": "quickly"}


def test_the_listed_clips_are_written_with_their_captions(tmp_path):
    still = {"shape": "circle", "color": "blue", "background": "white", "size": 0.3}
    meta = make_demo_dataset(tmp_path / "d", num_frames=5, height=32, width=48, clips=[RED, still])
    rows = list(csv.reader(meta.open()))
    assert rows == [["video", "prompt"],
                    ["videos/clip_000.mp4", "a red square moving quickly from left to right on black"],
                    ["images/image_000.png", "a blue circle on white"]]
    with av.open(str(meta.parent / rows[1][0])) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 48, 3)
    # the square is red: the brightest pixels of the first frame are near (220, 30, 30), the rest black
    first = frames[0].reshape(-1, 3).astype(float)
    square = first[first.max(axis=1) > 100]
    assert len(square) > 20 and np.abs(square.mean(axis=0) - COLORS["red"]).max() < 40


@pytest.mark.parametrize("clip, says", [
    ({**RED, "color": "teal"}, "data.generate.clips[0].color='teal': not one of red, green"),
    ({k: v for k, v in RED.items() if k != "size"}, "data.generate.clips[0]: 'size' missing"),
    ({**RED, "colour": "red"}, "data.generate.clips[0]: unknown key 'colour'"),
    ({**RED, "speed": None}, "data.generate.clips[0]: a video needs both direction and speed"),
    ({**RED, "size": 0.7}, "data.generate.clips[0].size=0.7: the shape's radius"),
    ("a red square", "data.generate.clips[0]='a red square': expected a mapping"),
])
def test_a_bad_clip_is_one_line_naming_it(tmp_path, clip, says):
    with pytest.raises(ConfigError) as e:
        make_demo_dataset(tmp_path / "d", clips=[clip])
    assert str(e.value).startswith(says) and "\n" not in str(e.value)
    assert not (tmp_path / "d").exists()
