"""model.build.pretrain: the demo's base, a tiny DiT trained at build time on squares of one colour under captions
that name random colours; its settings are checked in one line each."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from wanexp.data.synthetic import COLORS
from wanexp.errors import ConfigError
from wanexp.models.wan22.pretrain import PRETRAIN_KEYS, pretrain_on_squares, square_clips

SETTINGS = {"steps": 2, "lr": 1e-3, "batch": 2, "clips": 16, "color": "white", "background": "black", "size": 0.2,
            "num_frames": 5, "height": 32, "width": 32, "seed": 0}


def test_the_clips_are_squares_of_one_colour_under_captions_of_many():
    specs, captions = square_clips(SETTINGS)
    assert len(specs) == 16 and {(s.shape, s.color, s.background) for s in specs} == {("square", "white", "black")}
    assert len({s.offset for s in specs}) == 16 and {s.direction for s in specs} == {"from left to right"}
    # each caption is its clip's, with the colour word swapped for one of many
    named = [next(c for c in COLORS if replace(s, color=c).prompt == caption) for s, caption in zip(specs, captions)]
    assert len(set(named)) >= 5
    assert square_clips(SETTINGS) == (specs, captions)  # seeded


@pytest.mark.parametrize("change, says", [
    ({"steps": 0}, "model.build.pretrain.steps=0: must be at least 1"),
    ({"lr": 0}, "model.build.pretrain.lr=0: must be positive"),
    ({"colour": "red"}, "model.build.pretrain: unknown key 'colour'; its keys are " + ", ".join(PRETRAIN_KEYS)),
    ({"color": "teal"}, "model.build.pretrain.color='teal': not one of red, green"),
])
def test_bad_settings_are_one_line(change, says):
    spec = SimpleNamespace(build={"vae_weights": "block_average"})
    with pytest.raises(ConfigError) as e:
        pretrain_on_squares(spec, {}, {**SETTINGS, **change}, None)
    assert str(e.value).startswith(says)


def test_pretraining_needs_the_block_codec():
    with pytest.raises(ConfigError, match="needs model.build.vae_weights=block_average"):
        pretrain_on_squares(SimpleNamespace(build={}), {}, SETTINGS, None)
