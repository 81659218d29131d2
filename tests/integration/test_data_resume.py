"""Exact resume of the data order: a run stopped mid-epoch and resumed sees exactly the batches an uninterrupted run
sees, in the same order (one process and two DDP ranks); every epoch draws a new order."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import run_cli
from tests.integration.conftest import tiny_run

RECORD = ["+callbacks.recorder._target_=tests.helpers.BatchRecorder", "callbacks.checkpoint.every_n_train_steps=1"]


def recorded(result) -> list[list[int]]:
    return next(c for c in result["trainer"].callbacks if type(c).__name__ == "BatchRecorder").batches


@pytest.mark.parametrize("stop", [3, 5, 6])  # mid-epoch 0 (5 batches per epoch), its end, mid-epoch 1
def test_resume_mid_epoch_continues_with_exactly_the_unseen_batches(shared_dir, tmp_path, stop):
    full = recorded(tiny_run(shared_dir, tmp_path / "full", ["model=tiny", *RECORD, "trainer.max_steps=9"]))
    assert len(full) == 9
    epoch0, epoch1 = full[:5], full[5:9]
    assert epoch0[:len(epoch1)] != epoch1  # a new order each epoch
    first = recorded(tiny_run(shared_dir, tmp_path / "cut", ["model=tiny", *RECORD, f"trainer.max_steps={stop}"]))
    rest = recorded(tiny_run(shared_dir, tmp_path / "cut", ["model=tiny", *RECORD, "resume=last",
                                                           "trainer.max_steps=9", "allow_resume_changes=true"]))
    assert first + rest == full


@pytest.mark.slow
def test_resume_mid_epoch_under_ddp_gives_each_rank_its_unseen_batches(shared_dir, tmp_path):
    common = ["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={tmp_path}/data",
              "data.generate.num_videos=16", "data.generate.num_images=0", "parallel=ddp", "trainer.accelerator=cpu",
              "trainer.devices=2", "callbacks.progress=null", "callbacks.checkpoint.every_n_train_steps=1",
              "+callbacks.recorder._target_=tests.helpers.BatchRecorder"]

    def run(out, log, steps, *extra, code=0):
        res = run_cli([*common, f"paths.output_dir={out}", f"+callbacks.recorder.path={log}",
                       f"trainer.max_steps={steps}", *extra], timeout=600)
        assert res.returncode == code, res.stderr[-3000:]

    def read(log, rank):
        return [json.loads(line)["index"] for line in open(f"{log}.rank{rank}")]

    run(tmp_path / "full", tmp_path / "full.jsonl", 6)  # 16 clips / (2 ranks x 2) = 4 batches per epoch
    # cut by a SIGUSR1 that only rank 1 receives, late in step 2 (after the step-end check): rank 1 sees it at step
    # 3's end, where the flag is all-reduced; the ranks read the result at step 4's end, both save step 4 and stop
    run(tmp_path / "cut", tmp_path / "cut.jsonl", 6, "+callbacks.zz_signal._target_=tests.helpers.SignalAtStep",
        "+callbacks.zz_signal.step=2", "+callbacks.zz_signal.signum=10", "+callbacks.zz_signal.rank=1", code=138)
    status = json.loads((tmp_path / "cut" / "status.json").read_text())
    assert status["state"] == "interrupted" and status["signal"] == "SIGUSR1" and status["step"] == 4
    assert len(read(tmp_path / "cut.jsonl", 0)) == len(read(tmp_path / "cut.jsonl", 1)) == 4
    run(tmp_path / "cut", tmp_path / "cut.jsonl", 6, "resume=last")
    for rank in (0, 1):
        assert read(tmp_path / "cut.jsonl", rank) == read(tmp_path / "full.jsonl", rank)
    seen = [i for rank in (0, 1) for b in read(tmp_path / "full.jsonl", rank)[:4] for i in b]
    assert sorted(seen) == list(range(16))  # one epoch: every clip once, on one rank
