"""Caption dropout's draw: a pure function of (seed, epoch, sample index) at the asked rate."""
from __future__ import annotations

from wanexp.data.datamodule import caption_dropped


def test_draw_has_the_rate_is_repeatable_and_changes_by_epoch():
    n = 20000
    epoch0 = [caption_dropped(7, 0, i, 0.3) for i in range(n)]
    assert abs(sum(epoch0) / n - 0.3) < 0.015
    assert epoch0 == [caption_dropped(7, 0, i, 0.3) for i in range(n)]  # the same value on re-call
    epoch1 = [caption_dropped(7, 1, i, 0.3) for i in range(n)]
    assert abs(sum(epoch1) / n - 0.3) < 0.015 and epoch1 != epoch0
    assert [caption_dropped(8, 0, i, 0.3) for i in range(n)] != epoch0  # and by seed
    agree = sum(a == b for a, b in zip(epoch0, epoch1)) / n  # independent draws agree 0.7^2 + 0.3^2 = 58 % of the time
    assert abs(agree - 0.58) < 0.02
    assert not any(caption_dropped(7, 0, i, 0.0) for i in range(1000))
    assert all(caption_dropped(7, 0, i, 1.0) for i in range(1000))


def test_caption_dropout_on_a_prompts_only_file_is_one_line(tmp_path):
    """Prompts-only metadata (distillation) has no captions to drop: refused, not silently ignored."""
    import pytest

    from tests.conftest import compose_cfg
    from wanexp.errors import UserError
    from wanexp.composition import build

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square drifts left\na blue circle bounces\n")
    cfg = compose_cfg(["experiment=demo", f"data.metadata={prompts}", "data.caption_dropout=0.2",
                       f"paths.output_dir={tmp_path}/run"])
    dm = build(cfg.data, _partial_=True, seed=0)(encoders=None)
    with pytest.raises(UserError, match=r"data.caption_dropout=0.2: .* holds prompts alone.*set data.caption_dropout=0"):
        dm.setup()
