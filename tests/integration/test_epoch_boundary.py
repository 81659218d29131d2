"""A run crosses epoch boundaries without writing anything at them: with callbacks.checkpoint=null (no checkpoint
callback at all) there is no checkpoint and no LoRA export at an epoch's end; the run saves checkpoints/last.ckpt
when a signal stops it and at its end, where resume=last finds it."""
from __future__ import annotations

import pytest

from tests.integration.conftest import tiny_run
from wanexp.errors import Interrupted

# SIGINT at the end of step 6: the run saves at the end of step 7 (epoch 1: 5 batches per epoch) and stops
STOP_AT_6 = ["+callbacks.zz_signal._target_=tests.helpers.SignalAtStep", "+callbacks.zz_signal.step=6",
             "+callbacks.zz_signal.signum=2"]


def test_without_checkpointing_nothing_is_written_at_an_epoch_end(shared_dir, tmp_path):
    out = tmp_path / "run"
    common = ["model=tiny", "callbacks.checkpoint=null", "trainer.max_steps=12", "trainer.log_every_n_steps=100"]
    with pytest.raises(Interrupted) as e:
        tiny_run(shared_dir, out, [*common, *STOP_AT_6])
    assert e.value.step == 7 and e.value.checkpoint == str(out / "checkpoints" / "last.ckpt")
    assert [p.relative_to(out).as_posix() for p in out.rglob("*.ckpt")] == ["checkpoints/last.ckpt"]
    assert sorted(p.name for p in (out / "lora").iterdir()) == ["step_000007"]  # the stop's, none at step 5
    r = tiny_run(shared_dir, out, [*common, "resume=last"])  # over the boundary after step 10, to step 12
    assert r["global_step"] == 12
    assert [p.relative_to(out).as_posix() for p in out.rglob("*.ckpt")] == ["checkpoints/last.ckpt"]
    assert sorted(p.name for p in (out / "lora").iterdir()) == ["final", "step_000007", "step_000012"]  # not 10
