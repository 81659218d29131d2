"""wanexp-plan's pieces: the bandwidth formula and the all-reduce share, its options, the calibration's subset and
timing rows, the ETA's sum and the fit check."""
from __future__ import annotations

import time

import pytest
from omegaconf import OmegaConf

from wanexp.cli import plan, plan_calibrate, plan_comm
from wanexp.errors import ConfigError


def test_bus_bandwidth_is_nccl_tests_formula_and_its_inverse():
    algbw, busbw = plan_comm.bus_bandwidth(8 << 20, 0.004, 4)
    assert algbw == pytest.approx((8 << 20) / 0.004)
    assert busbw == pytest.approx(algbw * 2 * 3 / 4)  # busbw = algbw * 2(n-1)/n
    assert plan_comm.allreduce_seconds(8 << 20, busbw, 4) == pytest.approx(0.004)
    assert plan_comm.bus_bandwidth(100, 1.0, 2)[1] == pytest.approx(100)  # n=2: bus = algorithm bandwidth
    assert plan_comm.allreduce_seconds(1 << 30, 1e9, 1) == 0.0  # one process: nothing to reduce


def test_allreduce_share_of_a_step():
    # 100 MB at a 50 GB/s bus over 2 ranks: 100e6 * 2 * 1/2 / 50e9 = 2 ms
    t = plan_comm.allreduce_seconds(100_000_000, 50e9, 2)
    assert t == pytest.approx(0.002)
    assert plan_comm.allreduce_share(100_000_000, 50e9, 2, 0.100) == pytest.approx(0.02)  # measured with it
    assert plan_comm.allreduce_share(100_000_000, 50e9, 2, 0.098, measured_with_it=False) == pytest.approx(0.02)


def test_allreduce_measurement_runs_on_a_gloo_group(tmp_path):
    """The measuring loop on a one-process gloo group (two spawned processes take ~25 s of imports here, so the
    several-process path is the GPU's; the formula is checked above)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        rows = plan_comm.measure(sizes=(1 << 16, 1 << 20), iters=2, warmup=1)
    finally:
        dist.destroy_process_group()
    assert [r["bytes"] for r in rows] == [1 << 16, 1 << 20]
    for r in rows:
        assert r["seconds"] > 0 and r["algbw"] == pytest.approx(r["bytes"] / r["seconds"])
        assert r["busbw"] == 0.0  # one rank: nothing crosses a link


def test_advice_when_the_allreduce_is_a_large_share():
    assert plan_comm.advice(0.01, {"used": True}) == []
    tips = plan_comm.advice(0.3, {"used": True, "driver_allows": True, "env": {}})
    assert any("NCCL_P2P_DISABLE=1" in t for t in tips)
    tips = plan_comm.advice(0.3, {"used": False, "driver_allows": True, "env": {"NCCL_P2P_DISABLE": "1"}})
    assert "peer-to-peer is off" in tips[0]


def test_options_are_split_from_the_overrides():
    opts, rest = plan.split_options(["--no-calibrate", "--budget-gib", "28", "model=tiny", "--json=/x.json",
                                     "--steps-per-bucket=2", "trainer.max_steps=5"])
    assert rest == ["model=tiny", "trainer.max_steps=5"]
    assert opts["calibrate"] is False and opts["budget_gib"] == 28.0 and opts["json"] == "/x.json"
    assert opts["steps_per_bucket"] == 2
    with pytest.raises(ConfigError, match="--budget-gib='abc': must be a number"):
        plan.split_options(["--budget-gib", "abc"])
    with pytest.raises(ConfigError, match="--steps-per-bucket=0: must be above 0"):
        plan.split_options(["--steps-per-bucket=0"])


def test_world_size_from_the_launcher_and_the_devices():
    cfg = OmegaConf.create({"trainer": {"devices": 4, "num_nodes": 2, "accelerator": "gpu"}})
    assert plan.world_of(cfg, None, environ={}) == 8
    assert plan.world_of(cfg, 3, environ={}) == 3
    assert plan.world_of(cfg, None, environ={"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "16"}) == 16
    cfg.trainer.devices = "0,1"
    assert plan.world_of(cfg, None, environ={}) == 4


def test_lightning_epoch_limit():
    assert plan.lightning_epochs(None, -1) == 1000 and plan.lightning_epochs(None, 50) == -1
    assert plan.lightning_epochs(3, -1) == 3


def test_batches_run_over_whole_and_partial_epochs():
    data = {"batches_per_epoch": 5, "steps_per_epoch": 3, "accumulate_grad_batches": 2, "total_steps": 7}
    assert plan.batches_run(data) == 2 * 5 + 2  # two epochs, then one step of two batches
    data["total_steps"] = 6
    assert plan.batches_run(data) == 10


def test_subset_takes_whole_batches_of_every_bucket_and_a_files_windows_together():
    shapes = [(9, 64, 64)] * 7 + [(1, 64, 64)] * 3
    keys = ["a", "a", "b", "c", "d", "e", "f", "i", "j", "k"]  # "a" has two windows
    per_batch = {(9, 64, 64): 2, (1, 64, 64): 2}
    chosen, batches, copies = plan_calibrate.choose_subset(shapes, keys, per_batch, needed_batches=2)
    assert batches == {(9, 64, 64): 2, (1, 64, 64): 1} and copies == {}  # the images give one whole batch only
    assert chosen == [0, 1, 2, 3, 7, 8]
    # "b"'s second window comes with it (the subset file lists files: each brings all its windows back)
    chosen, batches, _ = plan_calibrate.choose_subset([(9, 64, 64)] * 4, ["a", "b", "b", "c"], {(9, 64, 64): 2}, 1)
    assert chosen == [0, 1, 2] and batches == {(9, 64, 64): 1}


def test_a_bucket_of_fewer_items_than_a_batch_is_filled_with_copies():
    """Its batches in the run are its items' repeats, weight copies or a filled last batch: the calibration times it
    on copies of its files, as many as the batches need."""
    shapes = [(9, 64, 64)] * 7 + [(1, 64, 64)] * 3
    keys = ["a", "a", "b", "c", "d", "e", "f", "i", "j", "k"]
    chosen, batches, copies = plan_calibrate.choose_subset(shapes, keys, {(9, 64, 64): 8, (1, 64, 64): 2}, 3)
    assert batches == {(9, 64, 64): 3, (1, 64, 64): 1}  # 3 images: one whole batch, as before
    assert chosen == list(range(7)) + [7, 8]  # every 9-frame item
    assert copies == {k: 4 for k in "abcdef"}  # 7 items x 4 = 28 >= 3 batches of 8


def test_bucket_times_first_steady_and_peak():
    rows = [{"shape": [9, 64, 64], "start": 0.0, "next": 3.0, "end": 2.9, "peak_gib": 5.0},
            {"shape": [1, 64, 64], "start": 3.0, "next": 3.5, "end": 3.4, "peak_gib": 2.0},
            {"shape": [9, 64, 64], "start": 3.5, "next": 4.5, "end": 4.4, "peak_gib": 5.5},
            {"shape": [9, 64, 64], "start": 4.5, "next": None, "end": 5.7, "peak_gib": 5.2}]
    t = plan_calibrate.bucket_times(rows)
    assert t["9x64x64"]["first_s"] == 3.0 and t["9x64x64"]["steady_s"] == pytest.approx(1.0)  # fastest of 1.0, 1.2
    assert t["9x64x64"]["once_s"] == pytest.approx(3.0 + 1.0 + 1.2 - 3 * 1.0)
    assert t["9x64x64"]["peak_gib"] == 5.5 and t["9x64x64"]["batches"] == 3
    assert t["1x64x64"] == {"batches": 1, "first_s": 0.5, "steady_s": 0.5, "once_s": 0.0, "peak_gib": 2.0}


def test_a_recompiling_batch_is_paid_once_not_taken_as_the_pace():
    """Measured on an H100: a bucket's batches took 38.1 s (compile), 40.7 s (a recompile: the first batch with the
    first frame as condition) and 0.35 s. The run pays the two compilations once, then 0.35 s a batch."""
    rows, t0 = [], 0.0
    for seconds in (38.1, 40.7, 0.35, 0.36):
        rows.append({"shape": [5, 44, 80], "start": t0, "next": t0 + seconds, "end": t0 + seconds, "peak_gib": 12.8})
        t0 += seconds
    b = plan_calibrate.bucket_times(rows)["5x44x80"]
    assert b["steady_s"] == pytest.approx(0.35)
    assert b["once_s"] == pytest.approx(38.1 + 40.7 - 2 * 0.35 + 0.01)
    data = {"total_steps": 500, "batches_per_epoch": 50, "steps_per_epoch": 50, "accumulate_grad_batches": 1,
            "buckets": {"5x44x80": {"batches_per_epoch": 50}}}
    e = plan.eta(data, {"rows": rows}, _cfg(every_val=0, every_ckpt=0), {"imports_s": 0.0, "data_s": 0.0})
    assert e["parts"]["train_s"] == pytest.approx(500 * 0.35 + b["once_s"])


def test_the_calibration_validates_in_the_run_s_order():
    """A run that samples at its start is calibrated the same way (then mid-way and at its last step), so the
    compiled blocks' variants compile in the run's order; one that does not, mid-way and at the last step."""
    assert plan.validation_overrides(OmegaConf.create({"every_n_steps": 250}), 8) == {
        "callbacks.validation.every_n_steps": 4, "callbacks.validation.at_start": True}
    assert plan.validation_overrides(OmegaConf.create({"every_n_steps": 250, "at_start": False}), 8) == {
        "callbacks.validation.every_n_steps": 4, "callbacks.validation.at_start": False}


def _cfg(every_val=100, at_start=True, every_ckpt=250):
    return OmegaConf.create({"callbacks": {"validation": {"every_n_steps": every_val, "at_start": at_start},
                                           "checkpoint": {"every_n_train_steps": every_ckpt}}})


def test_eta_adds_training_validation_checkpoints_and_start_up():
    data = {"total_steps": 500, "batches_per_epoch": 300, "steps_per_epoch": 300, "accumulate_grad_batches": 1,
            "buckets": {"17x704x1280": {"batches_per_epoch": 200}, "1x704x1280": {"batches_per_epoch": 100}}}
    rows = [{"shape": [17, 704, 1280], "start": 0.0, "next": 10.0},
            {"shape": [17, 704, 1280], "start": 10.0, "next": 10.4},
            {"shape": [1, 704, 1280], "start": 10.4, "next": 12.4},
            {"shape": [1, 704, 1280], "start": 12.4, "next": 12.5}]
    calib = {"rows": rows, "setup_s": 20.0, "end_s": 35.0, "validation_first_s": 40.0, "validation_s": 30.0,
             "validation_second_s": 33.0, "teardown_s": 1.0}
    e = plan.eta(data, calib, _cfg(), {"imports_s": 8.0, "data_s": 2.0})
    mean = (0.4 * 200 + 0.1 * 100) / 300
    assert e["mean_batch_s"] == pytest.approx(mean)
    assert e["parts"]["train_s"] == pytest.approx(500 * mean + 9.6 + 1.9)  # + each bucket's first batch once
    # the first call at the calibration's first call, the next (the first after training) at its second, the
    # others at its last
    assert e["validation_calls"] == 1 + 5 and e["parts"]["validation_s"] == pytest.approx(40.0 + 33.0 + 4 * 30.0)
    no_second = plan.eta(data, {**calib, "validation_second_s": None}, _cfg(), {"imports_s": 8.0, "data_s": 2.0})
    assert no_second["parts"]["validation_s"] == pytest.approx(40.0 + 5 * 30.0)
    assert e["checkpoints"] == 2 and e["parts"]["checkpoint_s"] == pytest.approx(2 * 5.0)  # steps 250, 500
    assert (e["parts"]["imports_s"], e["parts"]["data_s"], e["parts"]["weights_s"]) == (8.0, 2.0, 20.0)
    assert e["total_s"] == pytest.approx(sum(e["parts"].values()))
    e = plan.eta(data, calib, _cfg(every_val=0, at_start=False), {"imports_s": 0, "data_s": 0})
    assert e["validation_calls"] == 0 and e["parts"]["validation_s"] == 0
    # resumed at step 250: the batches after it, calls at 300, 400 and 500 (no base-model call), the save at 500
    e = plan.eta(data, calib, _cfg(), {"imports_s": 8.0, "data_s": 2.0}, done=250)
    assert e["batches"] == 250 and e["parts"]["train_s"] == pytest.approx(250 * mean + 9.6 + 1.9)
    assert e["validation_calls"] == 3 and e["parts"]["validation_s"] == pytest.approx(40.0 + 33.0 + 30.0)
    assert e["checkpoints"] == 1 and e["from_step"] == 250
    e = plan.eta(data, calib, _cfg(), {"imports_s": 0, "data_s": 0}, done=500)  # nothing left to train
    assert (e["batches"], e["parts"]["train_s"], e["validation_calls"], e["checkpoints"]) == (0, 0.0, 0, 0)


def test_a_resume_trains_the_steps_and_batches_after_its_checkpoint():
    # 5 batches per epoch, accumulation 2: steps of 2, 2 and 1 batches; 7 steps = 2 epochs and 1 step
    data = {"batches_per_epoch": 5, "steps_per_epoch": 3, "accumulate_grad_batches": 2, "total_steps": 7}
    r = plan.resumed_part(data, {"steps_done": 4, "checkpoint": "c"})
    assert (r["data_epoch"], r["batches_done_in_epoch"]) == (1, 2)  # epoch 1, its first step's two batches done
    assert (r["remaining_steps"], r["remaining_batches"]) == (3, 12 - 7)
    r = plan.resumed_part(data, {"steps_done": 3, "checkpoint": "c"})  # an epoch's last step: the next one begins
    assert (r["data_epoch"], r["batches_done_in_epoch"], r["remaining_batches"]) == (1, 0, 7)
    assert plan.resumed_part(data, {"steps_done": 9, "checkpoint": "c"})["remaining_steps"] == 0


def test_a_bucket_above_the_budget_is_named_with_the_options():
    e = {"buckets": {"17x704x1280": {"peak_gib": 30.2}, "1x704x1280": {"peak_gib": 12.0}}}
    problems = plan.fit_problems({"end_peak_gib": 20.0}, e, card_gib=79.1, budget=28.0)
    assert len(problems) == 1 and problems[0].startswith("bucket 17x704x1280 peaks at 30.2 GiB, above --budget-gib")
    assert "model.blocks_to_swap" in problems[0] and "sp_size=2" in problems[0] and "parallel=fsdp" in problems[0]
    oom = plan.fit_problems({"oom": "CUDA out of memory", "failed": {"shape": [81, 720, 1280],
                                                                     "error": "OutOfMemoryError"}}, {}, 79.1, None)
    assert oom[0].startswith("bucket 81x720x1280 runs out of GPU memory")
    assert plan.fit_problems({"end_peak_gib": 20.0}, e, card_gib=79.1, budget=None) == []


def test_timer_keeps_a_validation_call_out_of_the_batch_before_it(tmp_path):
    from types import SimpleNamespace

    class Validation:  # what the timer reads of wanexp.callbacks.validation.Validation: its results
        results: list = []

    val = Validation()
    trainer = SimpleNamespace(callbacks=[val], global_step=0, world_size=1, global_rank=0,
                              datamodule=SimpleNamespace(dataset=SimpleNamespace(shapes=[(9, 64, 64)])))
    timer = plan_calibrate.PlanTimer(str(tmp_path / "t.json"))
    batch = {"index": [0]}
    for step in (1, 2, 3):
        timer.on_train_batch_start(trainer, None, batch, 0)
        timer.on_train_batch_end(trainer, None, None, batch, 0)
        if step == 2:
            val.results = [{"seconds": 5.0}]
            time.sleep(0.2)  # the call's time: not the batch's
    timer.on_train_end(trainer, None)
    rows = timer.rows
    assert rows[0]["next"] == rows[1]["start"] and rows[1]["next"] == rows[1]["end"]
    assert rows[2]["start"] - rows[1]["next"] >= 0.2
    assert timer.times["validation_first_s"] == timer.times["validation_s"] == 5.0
    assert (tmp_path / "t.json").is_file()


def test_the_verdict_says_what_was_not_checked():
    why = plan.memory_not_checked
    assert why(None, True, False, 12.0) is None  # a GPU's peak: checked
    assert why(False, False, False, None).startswith("--no-calibrate")
    assert why(None, False, True, None).startswith("no GPU here")
    assert why(True, True, True, None).startswith("the calibration ran on the CPU")
    plan_ = {"problems": [], "memory": {"not_checked": None, "budget_gib": 28.0}}
    assert plan.verdict(plan_) == "fits"
    plan_["memory"]["not_checked"] = "no GPU here"
    assert plan.verdict(plan_) == "fits the disk; the memory budget (--budget-gib 28) was not checked: no GPU here"
    plan_["memory"]["budget_gib"] = None
    assert plan.verdict(plan_) == "fits the disk; GPU memory was not checked: no GPU here"
    assert plan.verdict({**plan_, "problems": ["disk /: needs 2 GiB"]}) == "does not fit:"


def test_the_docs_give_each_default_once_and_as_the_code_has_it():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "plan.md").read_text()
    default = plan.split_options([])[0]["steps_per_bucket"]
    said = [int(n) for line in text.splitlines() if "--steps-per-bucket" in line
            for n in re.findall(r"default (\d+)", line)]
    assert said == [default], said
    assert f"--steps-per-bucket N optimizer steps the calibration times per bucket (default {default})" in plan.OPTIONS
    lines = [line for line in text.splitlines() if line.strip()]
    assert not [a for a, b in zip(lines, lines[1:]) if a == b]  # no line said twice in a row


def test_the_report_lists_every_bucket_and_says_which_were_not_timed():
    """Nine buckets, the calibration out of memory in the sixth: the data part lists all nine, the time part times
    five and says of the other four that the calibration stopped, and where."""
    keys = [f"{f}x64x64" for f in (1, 5, 9, 13, 17, 21, 25, 29, 33)]
    data = {"rows": 9, "rejected": 0, "warnings": 0, "heldout": 0, "samples": 9, "dataset_repeat": 2,
            "per_epoch": "clips 18 (9 x2)",
            "world_size": 1, "data_parallel_size": 1, "batch_size": 1, "accumulate_grad_batches": 1,
            "effective_batch": 1, "batches_per_epoch": 18, "steps_per_epoch": 18, "total_steps": 18, "epochs": 1.0,
            "buckets": {k: {"clips": 1, "images": 0, "samples_per_epoch": 2, "batch_per_rank": 1,
                            "batches_per_epoch": 2} for k in keys}}
    timed = {k: {"steady_s": 0.5, "once_s": 0.0, "peak_gib": 1.0} for k in keys[:5]}
    p = {"run_name": "x", "device": "1 x GPU", "data": data, "cache": {"note": "no cache"},
         "calibration": {"oom": "CUDA out of memory", "failed": {"shape": [21, 64, 64], "error": "OutOfMemoryError"}},
         "eta": {"buckets": timed}, "memory": {"peak_gib": 1.0}, "disk": {"filesystems": {}},
         "problems": ["bucket 21x64x64 runs out of GPU memory on this card; try ..."]}
    lines = plan.report(p).splitlines()
    assert "          9 buckets:" in lines and "clips 18 (9 x2)" in lines[2]
    assert sum(line.startswith("  bucket ") and "samples per epoch" in line for line in lines) == 9
    assert sum(line.startswith("  bucket ") and "s per batch" in line for line in lines) == 5
    untimed = [line for line in lines if "not timed" in line]
    assert len(untimed) == 4 and untimed[0] == ("  bucket 21x64x64       not timed: the calibration stopped in bucket "
                                                "21x64x64 (OutOfMemoryError)")


def test_the_report_gives_the_memory_estimate_or_says_the_family_has_none():
    """The pre-flight's estimate (wanexp.memory_plan, from the family's formula) is one line of the report; a family
    without a formula is one line saying so, not a crash."""
    e = {"need_gib": 26.04, "weights_gib": 12.5, "activations_gib": 13.54, "tokens": 32760, "blocks_to_swap": 20,
         "blocks": 40}
    assert plan.memory_estimate_lines({"estimate": e}) == [
        "memory    estimate 26.0 GiB per GPU at least (12.5 of weights, 20 of 40 blocks swapped, 13.5 of activations "
        "and adapter state at 32760 tokens)"]
    assert plan.memory_estimate_lines({"estimate": {**e, "blocks_to_swap": 0}})[0].startswith(
        "memory    estimate 26.0 GiB per GPU at least (12.5 of weights, 13.5 of activations")
    none = {"estimate": None, "no_estimate": "model=toy's family gives no memory formula"}
    assert plan.memory_estimate_lines(none) == ["memory    no estimate: model=toy's family gives no memory formula"]
