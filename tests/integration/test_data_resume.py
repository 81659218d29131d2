"""Exact resume of the data order: a run stopped mid-epoch and resumed sees exactly the batches an uninterrupted run
sees, in the same order (one process and two DDP ranks); every epoch draws a new order. Stopped and resumed (chains
over epoch ends, loader workers, aspect buckets, two DDP ranks), a run ends with the uninterrupted LoRA, bit for bit."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import compose_cfg, run_cli
from tests.helpers import CliRun
from tests.integration.conftest import tiny_run
from wanexp.data.synthetic import make_demo_dataset

RECORD = ["+callbacks.recorder._target_=tests.helpers.BatchRecorder", "callbacks.checkpoint.every_n_train_steps=1"]


def recorded(result) -> list[list[int]]:
    return next(c for c in result["trainer"].callbacks if type(c).__name__ == "BatchRecorder").batches


@pytest.mark.parametrize("stop", [3, 5, 6])  # mid-epoch 0 (5 batches per epoch), its end, mid-epoch 1
def test_resume_mid_epoch_continues_with_exactly_the_unseen_batches(shared_dir, tmp_path, stop, full_order):
    full = full_order
    assert len(full) == 9
    epoch0, epoch1 = full[:5], full[5:9]
    assert epoch0[:len(epoch1)] != epoch1  # a new order each epoch
    first = recorded(tiny_run(shared_dir, tmp_path / "cut", ["model=tiny", *RECORD, f"trainer.max_steps={stop}"]))
    rest = recorded(tiny_run(shared_dir, tmp_path / "cut", ["model=tiny", *RECORD, "resume=last",
                                                           "trainer.max_steps=9", "allow_resume_changes=true"]))
    assert first + rest == full


# Bit-identical resume: a constant schedule, so a session may stop early (trainer.max_steps) without changing the lr.
EXACT = ["model=tiny", "optim.scheduler=constant", "callbacks.checkpoint.every_n_train_steps=1"]


def lora(result) -> dict:
    return {n: p.detach().clone() for n, p in result["module"].named_parameters() if p.requires_grad}


def assert_same_lora(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
        max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def uninterrupted_run(shared_dir, tmp_path_factory) -> tuple[dict, list[list[int]]]:
    """12 steps without a stop (5 batches per epoch), no loader workers: its LoRA and its batches (the order of
    the data does not depend on the schedule, so the stops above and the resumes below share this one run)."""
    r = tiny_run(shared_dir, tmp_path_factory.mktemp("full") / "run", [*EXACT, *RECORD, "trainer.max_steps=12"])
    return lora(r), recorded(r)


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run) -> dict:
    return uninterrupted_run[0]


@pytest.fixture(scope="module")
def full_order(uninterrupted_run) -> list[list[int]]:
    """The batches of the first 9 steps without a stop, for every stop above."""
    assert len(uninterrupted_run[1]) == 12
    return uninterrupted_run[1][:9]


def test_chained_resumes_over_epoch_ends_are_bit_identical(shared_dir, tmp_path, uninterrupted):
    """Stopped at an epoch's last step (5), resumed to the next epoch's last step (10), resumed from that resumed
    run's checkpoint to step 11 and again to the end: the LoRA of the uninterrupted run, bit for bit."""
    out = tmp_path / "cut"
    for i, stop in enumerate([5, 10, 11, 12]):
        r = tiny_run(shared_dir, out, [*EXACT, f"trainer.max_steps={stop}", *(["resume=last"] if i else [])])
    assert_same_lora(uninterrupted, lora(r))


def _stop_at(step: int) -> list[str]:
    """SIGINT to this process at the end of ``step``: the run saves the next step's checkpoint and stops."""
    return ["+callbacks.zz_signal._target_=tests.helpers.SignalAtStep", f"+callbacks.zz_signal.step={step}",
            "+callbacks.zz_signal.signum=2"]


def test_sigint_and_resume_with_loader_workers_are_bit_identical(shared_dir, tmp_path, uninterrupted):
    """data.num_workers=2 (workers draw the first batches when the loader starts, before Lightning sets the epoch):
    a SIGINT in epoch 1, resume=last, and the LoRA equals the uninterrupted run's without workers."""
    from wanexp.errors import Interrupted

    out, common = tmp_path / "cut", [*EXACT, "data.num_workers=2", "trainer.max_steps=12"]
    with pytest.raises(Interrupted) as e:
        tiny_run(shared_dir, out, [*common, *_stop_at(6)])
    assert e.value.step == 7  # mid-epoch 1
    assert_same_lora(uninterrupted, lora(tiny_run(shared_dir, out, [*common, "resume=last"])))


def _bucketed_data(root: Path) -> Path:
    """Landscape, portrait and square clips (and one image of each) in one metadata file."""
    from wanexp.data.synthetic import make_demo_dataset

    rows = ["video,prompt"]
    for name, (h, w) in {"land": (96, 128), "port": (128, 96), "square": (96, 96)}.items():
        meta = make_demo_dataset(root / name, num_videos=4, num_images=1, num_frames=9, height=h, width=w)
        rows += [f"{name}/{line}" for line in meta.read_text().splitlines()[1:]]
    (root / "metadata.csv").write_text("\n".join(rows) + "\n")
    return root / "metadata.csv"


def test_resume_with_aspect_buckets_is_bit_identical(shared_dir, tmp_path):
    """Three bucket shapes (6 batches per epoch) and loader workers: a SIGINT in epoch 1, resume=last, the same
    LoRA as without the stop."""
    from wanexp.errors import Interrupted

    meta = _bucketed_data(tmp_path / "data")
    common = [*EXACT, f"data.metadata={meta}", "data.buckets=[[64,96],[96,64],[64,64]]", "data.num_workers=2",
              "data.use_cache=false", "trainer.max_steps=9"]
    full = tiny_run(shared_dir, tmp_path / "full", common)
    assert len(set(full["trainer"].datamodule.dataset.shapes)) >= 3
    with pytest.raises(Interrupted) as e:
        tiny_run(shared_dir, tmp_path / "cut", [*common, *_stop_at(6)])
    assert e.value.step == 7
    assert_same_lora(lora(full), lora(tiny_run(shared_dir, tmp_path / "cut", [*common, "resume=last"])))


def test_resume_with_caption_dropout_is_bit_identical(shared_dir, tmp_path):
    """data.caption_dropout=0.5 (encoded online): stopped mid-epoch 1 (5 batches per epoch) and resumed, the LoRA
    of the run without the stop; the captions a resumed run drops are those the uninterrupted run drops."""
    common = [*EXACT, "data.caption_dropout=0.5", "data.use_cache=false"]
    full = tiny_run(shared_dir, tmp_path / "full", [*common, "trainer.max_steps=7"])
    ds = full["trainer"].datamodule.dataset
    assert 0 < sum(ds[(i, 1)]["prompt"] == "" for i in range(len(ds))) < len(ds)
    tiny_run(shared_dir, tmp_path / "cut", [*common, "trainer.max_steps=6"])
    assert_same_lora(lora(full), lora(tiny_run(shared_dir, tmp_path / "cut", [*common, "trainer.max_steps=7",
                                                                              "resume=last"])))


@pytest.mark.slow
def test_resume_mid_epoch_under_ddp_gives_each_rank_its_unseen_batches(shared_dir, tmp_path):
    """Two A14B experts: each step, each rank routes its 2 samples by their sigmas, so a rank often routes none to
    one expert (without find_unused_parameters DDP stops with a RuntimeError); the runs must neither stop nor hang,
    and the replicas stay in sync. (One set of 2-process runs checks both: each start costs ~20 s of imports.)"""
    common = ["experiment=demo", "model=tiny_t2v14b", "boundary=full", f"paths.tiny_model_dir={shared_dir}/models",
              f"paths.data_dir={tmp_path}/data", "data.generate.num_videos=16", "data.generate.num_images=0",
              "parallel=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "callbacks.progress=null",
              "callbacks.checkpoint.every_n_train_steps=1", "+callbacks.recorder._target_=tests.helpers.BatchRecorder"]

    def args(out, log, steps, *extra):
        return [*common, f"paths.output_dir={out}", f"+callbacks.recorder.path={log}", f"trainer.max_steps={steps}",
                *extra]

    def run(out, log, steps, *extra, code=0):
        res = run_cli(args(out, log, steps, *extra), timeout=600)
        assert res.returncode == code, res.stderr[-3000:]

    def read(log, rank):
        return [json.loads(line)["index"] for line in open(f"{log}.rank{rank}")]

    # the clips first, as the runs' datamodule would generate them (both runs below read them), then the
    # uninterrupted run and the cut one side by side
    data = compose_cfg(common).data
    make_demo_dataset(Path(data.metadata).parent, **dict(data.generate))
    full = CliRun(args(tmp_path / "full", tmp_path / "full.jsonl", 6), tmp_path / "full_log")
    # cut by a SIGUSR1 that only rank 1 receives, late in step 2 (after the step-end check): rank 1 sees it at step
    # 3's end, where the flag is all-reduced; the ranks read the result at step 4's end, both save step 4 and stop
    signal = ["+callbacks.zz_signal._target_=tests.helpers.SignalAtStep", "+callbacks.zz_signal.step=2",
              "+callbacks.zz_signal.signum=10", "+callbacks.zz_signal.rank=1"]
    cut = CliRun(args(tmp_path / "cut", tmp_path / "cut.jsonl", 6, *signal), tmp_path / "cut_log")
    full, cut = full.result(timeout=600), cut.result(timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    status = json.loads((tmp_path / "full" / "status.json").read_text())  # 16 clips / (2 ranks x 2): 4 batches/epoch
    assert status["state"] == "finished" and status["step"] == 6 and status["replicas_in_sync"] is True
    assert cut.returncode == 138, cut.stderr[-3000:]
    status = json.loads((tmp_path / "cut" / "status.json").read_text())
    assert status["state"] == "interrupted" and status["signal"] == "SIGUSR1" and status["step"] == 4
    assert len(read(tmp_path / "cut.jsonl", 0)) == len(read(tmp_path / "cut.jsonl", 1)) == 4
    run(tmp_path / "cut", tmp_path / "cut.jsonl", 6, "resume=last")
    status = json.loads((tmp_path / "cut" / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 6 and status["replicas_in_sync"] is True
    for rank in (0, 1):
        assert read(tmp_path / "cut.jsonl", rank) == read(tmp_path / "full.jsonl", rank)
    seen = [i for rank in (0, 1) for b in read(tmp_path / "full.jsonl", rank)[:4] for i in b]
    assert sorted(seen) == list(range(16))  # one epoch: every clip once, on one rank
    names = sorted(p.name for p in (tmp_path / "full" / "lora" / "final").glob("*.safetensors"))
    assert len(names) == 4  # two files (ComfyUI, diffusers) per expert
    for name in names:  # resumed at an epoch's end
        full, cut = (load_file(tmp_path / run / "lora" / "final" / name) for run in ("full", "cut"))
        assert_same_lora(full, cut)
