"""wanexp-plan on the demo (CPU): its steps are the run's, its ETA is near the run's wall time, a bad override is one
line and writes nothing, and a plan that does not fit exits 2 with one line per problem."""
from __future__ import annotations

import json
import sys
import time

import pytest
from omegaconf import open_dict

from tests.conftest import compose_cfg
from tests.integration.conftest import tiny_run
from wanexp.cli import plan

# two buckets (9-frame clips, 1-frame images), an epoch of a repeated set with accumulation, validation on
EXTRA = ["trainer.max_steps=-1", "trainer.max_epochs=1", "trainer.accumulate_grad_batches=2",
         "data.dataset_repeat=2", "callbacks.validation.every_n_steps=4", "callbacks.validation.steps=1",
         "callbacks.validation.prompts=[a red fox]", "callbacks.validation.at_start=false",
         "callbacks.validation.first_frame=false"]


def _overrides(shared_dir, out, extra):
    """tiny_run's overrides (tests/integration/conftest.py), for the plan of the same run."""
    return ["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
            f"paths.output_dir={out}", "trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=2",
            "trainer.log_every_n_steps=1", "callbacks.progress=null", "adapter.rank=4", "adapter.alpha=2",
            "optim.lr=1e-2", "optim.warmup_steps=0", *extra]


@pytest.fixture(scope="module")
def cached(shared_dir, tmp_path_factory):
    """The demo's cache (clips, captions, validation prompts), filled once: the plan and the run read it."""
    from wanexp.cli.cache import build_cache

    folder = tmp_path_factory.mktemp("plan_cache")
    extra = [*EXTRA, f"paths.cache_dir={folder}"]
    build_cache(compose_cfg(_overrides(shared_dir, tmp_path_factory.mktemp("c") / "run", extra)))
    return extra


def test_planned_steps_and_eta_match_the_run(shared_dir, tmp_path, cached, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the calibration's folder goes here, and goes away
    before = set(tmp_path.iterdir())
    cfg = compose_cfg(_overrides(shared_dir, tmp_path / "run", cached))
    p = plan.make_plan(cfg, {**plan.split_options([])[0], "calibrate": True, "budget_gib": 0.0001})
    assert set(tmp_path.iterdir()) == before and not (tmp_path / "run").exists()  # nothing left, no run folder
    # the CPU has no GPU memory to measure: the budget is said to be unchecked, not met
    assert plan.report(p).endswith("\nfits the disk; the memory budget (--budget-gib 0.0001) was not checked: the "
                                   "calibration ran on the CPU (the peak is GPU memory, measured on a GPU)")
    d = p["data"]
    # 8 clips x 2 repeats in batches of 2 = 8, 2 images x 2 = 2: 10 batches, 5 steps of 2
    assert {k: b["batches_per_epoch"] for k, b in d["buckets"].items()} == {"1x64x64": 2, "9x64x64": 8}
    assert (d["batches_per_epoch"], d["steps_per_epoch"], d["total_steps"]) == (10, 5, 5)
    assert p["calibration"]["oom"] is None and set(p["eta"]["buckets"]) == {"1x64x64", "9x64x64"}
    assert p["eta"]["validation_calls"] == 2 and p["eta"]["validation_call_s"] > 0  # steps 4 and 5
    assert p["eta"]["checkpoints"] == 3 and p["problems"] == []  # steps 2, 4 and 5
    assert p["cache"]["missing_latents"] == 0 and p["cache"]["missing_texts"] == 0

    t0 = time.perf_counter()
    result = tiny_run(shared_dir, tmp_path / "run", cached)
    wall = time.perf_counter() - t0
    assert result["global_step"] == d["total_steps"]  # the run's own count
    # in process: the run pays no interpreter start-up or first imports, which the plan counts for python train.py
    planned = p["eta"]["total_s"] - p["eta"]["parts"]["imports_s"]
    assert 0.5 * wall <= planned <= 1.5 * wall, (planned, wall, p["eta"]["parts"])


def _files(folder):
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file()}


def test_a_resumed_run_is_planned_from_its_checkpoint(shared_dir, tmp_path, cached, monkeypatch):
    """resume=last: the plan takes the checkpoint the run resumes from and counts the steps and batches after it (the
    resumed run then trains exactly those), its ETA and checkpoints cover only those, its disk counts what the run
    folder already holds, and its calibration leaves that folder as it was."""
    out = tmp_path / "run"
    # validation off (its calls after a resume: tests/unit/test_plan.py): seconds less
    first = [*cached, "callbacks.checkpoint.every_n_train_steps=3", "callbacks.validation.every_n_steps=0"]
    tiny_run(shared_dir, out, [*first, "trainer.max_steps=3"])  # stops mid-epoch: 6 of 10 batches
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    more = [*first, "resume=last", "allow_resume_changes=true", "trainer.max_steps=-1", "trainer.max_epochs=2"]
    before = _files(out)
    p = plan.make_plan(compose_cfg(_overrides(shared_dir, out, more)),
                       {**plan.split_options([])[0], "calibrate": True, "steps_per_bucket": 1})
    assert _files(out) == before and not any((tmp_path / "scratch").iterdir())
    d, r, e = p["data"], p["data"]["resume"], p["eta"]
    assert d["total_steps"] == 10 and (r["steps_done"], r["data_epoch"], r["batches_done_in_epoch"]) == (3, 0, 6)
    assert (r["remaining_steps"], r["remaining_batches"], e["batches"]) == (7, 14, 14)
    assert e["checkpoints"] == 3  # saves at 6, 9 and 10
    fs = next(iter(p["disk"]["filesystems"].values()))
    assert fs["present_bytes"] == p["disk"]["present_bytes"] > 0
    assert fs["need_bytes"] == fs["retention_bytes"] - fs["present_bytes"]
    text = plan.report(p)
    assert "at step 3 (epoch 0, 6 batches of it done): 7 steps (14 batches) to go" in text, text
    assert "ETA of the steps after 3" in text and "of it already there" in text, text

    # (the ETA's seconds against a run's: the test above; a remainder of 7 tiny steps is too short to compare)
    result = tiny_run(shared_dir, out, more)
    assert result["global_step"] - r["steps_done"] == r["remaining_steps"]
    trained = result["trainer"].fit_loop.epoch_loop.batch_progress.total.completed
    assert trained == plan.batches_run(d)  # the restored batches and the ones after them


def test_world_size_two_counts_what_each_rank_loads(shared_dir, tmp_path):
    """For 2 processes, without starting them: each rank's loader (the run's, for that rank) yields the planned
    batches, disjoint samples of one bucket each. (The counts need no cache: this test does not wait for one.)"""
    from wanexp.composition import build, prepare_model_folder

    cfg = compose_cfg(_overrides(shared_dir, tmp_path / "run", [*EXTRA, f"paths.cache_dir={tmp_path}/no_cache"]))
    with open_dict(cfg):
        cfg.data.rejects = str(tmp_path / "rejects.jsonl")
    spec = build(cfg.model)
    prepare_model_folder(spec, cfg.boundary.name)  # the tiny model and the demo clips, built once per session
    dm = plan.datamodule(cfg, spec)
    dm.prepare()
    dm.setup("fit")
    d = plan.data_plan(cfg, dm, 2)
    # per rank: 16 clips // (2 ranks x 2) = 4 batches, 4 images // 4 = 1: 5 batches, ceil(5 / 2) = 3 steps
    assert (d["batches_per_epoch"], d["steps_per_epoch"], d["total_steps"], d["effective_batch"]) == (5, 3, 3, 8)
    seen = []
    for r in (0, 1):
        dm.trainer = plan.counting_trainer(2, 1, 2, -1, 1)
        dm.trainer.global_rank = r
        batches = list(dm.train_dataloader().batch_sampler)
        dm.trainer = None
        assert len(batches) == d["batches_per_epoch"]
        assert all(len({dm.dataset.shapes[i] for i in b}) == 1 for b in batches)
        seen.append({i for b in batches for i in b})
    assert not seen[0] & seen[1]


def _main(monkeypatch, capsys, args):
    from wanexp.cli.plan import main

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.delenv("HYDRA_FULL_ERROR")
    monkeypatch.setattr(sys, "argv", ["wanexp-plan", *args])
    capsys.readouterr()
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def test_bad_input_is_one_line_and_writes_nothing(shared_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    common = ["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
              f"paths.output_dir={tmp_path}/run", f"paths.root_dir={tmp_path}", "--json", f"{tmp_path}/p.json"]
    for args, needle in ((["trainer.devices=abc"], "trainer.devices=abc: must be auto, a device count"),
                         (["--budget-gib", "lots"], "--budget-gib='lots': must be a number"),
                         (["model=nope"], "model"),
                         (["resume=last"], f"resume=last: {tmp_path}/run holds no checkpoint yet")):
        code, _, err = _main(monkeypatch, capsys, [*common, *args])
        assert code == 2 and len(err) == 1 and err[0].startswith("wanexp: error: ") and needle in err[0], err
        assert sorted(p.name for p in tmp_path.iterdir()) == [], args


def test_a_plan_that_does_not_fit_exits_2_with_one_line_per_problem(shared_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("wanexp.disk.free_bytes", lambda path: 1)
    out = tmp_path / "p.json"
    code, stdout, err = _main(monkeypatch, capsys, [
        "experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
        f"paths.output_dir={tmp_path}/run", "--no-calibrate", "--json", str(out)])
    assert code == 2 and len(err) == 1 and err[0].startswith("wanexp: error: disk ") and "1 B free" in err[0], err
    assert f"plan written to {out}" in stdout and "total 30 steps" in stdout
    p = json.loads(out.read_text())
    assert p["calibration"] is None and p["data"]["total_steps"] == 30 and len(p["problems"]) == 1


def test_an_unmeasured_budget_is_said_to_be_unchecked(shared_dir, tmp_path, monkeypatch, capsys):
    code, stdout, err = _main(monkeypatch, capsys, [
        "experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
        f"paths.output_dir={tmp_path}/run", "--no-calibrate", "--budget-gib", "0.0001", "--json", f"{tmp_path}/p.json"])
    assert code == 0 and err == []
    lines = stdout.splitlines()
    assert "memory    not checked: --no-calibrate (the peak comes from the calibration)" in lines
    assert "fits the disk; the memory budget (--budget-gib 0.0001) was not checked: --no-calibrate (the peak comes " \
           "from the calibration)" in lines and "fits" not in lines
    assert json.loads((tmp_path / "p.json").read_text())["memory"]["not_checked"].startswith("--no-calibrate")


def test_several_datasets_count_each_item_once(shared_dir, tmp_path):
    """data.datasets with a repeat and a fractional weight: the plan's samples and clips per bucket count each item
    once (its copies are the repeat and the weight), and the calibration's subset holds each bucket's items."""
    from wanexp.data.synthetic import make_demo_dataset
    from wanexp.composition import build, prepare_model_folder

    a = make_demo_dataset(tmp_path / "a", num_videos=4, num_images=2, num_frames=9, height=64, width=64)
    b = make_demo_dataset(tmp_path / "b", num_videos=3, num_images=0, num_frames=9, height=64, width=96)
    datasets = (f"data.datasets={{a:{{metadata:'{a}',weight:1.5}},b:{{metadata:'{b}',repeat:2,num_frames:5,"
                "height:64,width:96}}")
    cfg = compose_cfg(_overrides(shared_dir, tmp_path / "run", [datasets, "data.use_cache=false",
                                                                f"paths.cache_dir={tmp_path}/no_cache"]))
    with open_dict(cfg):
        cfg.data.rejects = str(tmp_path / "rejects.jsonl")
    spec = build(cfg.model)
    prepare_model_folder(spec, cfg.boundary.name)
    dm = plan.datamodule(cfg, spec)
    dm.prepare()
    dm.setup("fit")
    d = plan.data_plan(cfg, dm, 1)
    assert d["samples"] == 4 + 2 + 3
    clips = {k: (v["clips"], v["images"]) for k, v in d["buckets"].items()}
    assert sorted(clips.values()) == [(0, 2), (3, 0), (4, 0)], clips
    # the report's header gives each dataset's repeat and weight, as the run's start line does, and every bucket
    text = plan.report({"run_name": "x", "device": "CPU", "data": d, "cache": {"note": "no cache"},
                        "calibration": None, "memory": {}, "disk": {"filesystems": {}}, "problems": []})
    assert "9 samples; per epoch: a 10 (6 x1 x weight 1.5 + 1 to fill), b 6 (3 x2); filled: 1x64x64 3 + 1" in text
    assert "          3 buckets:" in text and "repeat" not in text
    for key in d["buckets"]:
        assert f"  bucket {key} " in text


def test_calibration_reads_each_dataset_s_relative_paths_as_the_run_does(shared_dir, tmp_path, monkeypatch):
    """data.datasets of CSVs of relative paths, each in its own folder (not the data group's metadata folder): the
    calibration trains on whole batches of each bucket from each dataset's own files (none rejected), with each
    dataset's settings (num_frames), and the held-out file that validation's loss reads stays held out. A bucket
    with fewer items than a batch (one clip at weight 1.5: a batch of 2 in the run) is timed on copies of it."""
    from wanexp.data.synthetic import make_demo_dataset

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    a = make_demo_dataset(tmp_path / "a", num_videos=2, num_images=2, num_frames=9, height=64, width=64)
    b = make_demo_dataset(tmp_path / "b", num_videos=2, num_images=0, num_frames=9, height=64, width=96)
    (b.parent / "videos").rename(b.parent / "shots")  # names the demo's own folder does not hold
    b.write_text(b.read_text().replace("videos/", "shots/"))
    assert "shots/clip_000.mp4" in b.read_text()  # relative to b's folder
    datasets = (f"data.datasets={{a:{{metadata:'{a}',weight:1.5}},b:{{metadata:'{b}',repeat:2,num_frames:5,"
                "height:64,width:96}}")
    cfg = compose_cfg(_overrides(shared_dir, tmp_path / "run", [
        datasets, "data.use_cache=false", f"paths.cache_dir={tmp_path}/no_cache", "data.val_fraction=0.2",
        *EXTRA[4:], "callbacks.validation.loss_samples=1", "callbacks.validation.every_n_steps=5"]))
    seen = {}

    def calibration(cfg, calib):  # the calibration's datamodule, as its run builds it, and the run's own
        from wanexp.composition import build

        for name, c in (("run", cfg), ("calibration", plan.apply_overrides(cfg, calib))):
            dm = plan.datamodule(c, build(c.model))
            dm.setup("fit")
            seen[name] = dm
        return real(cfg, calib)

    real = plan.run_calibration
    monkeypatch.setattr(plan, "run_calibration", calibration)
    p = plan.make_plan(cfg, {**plan.split_options([])[0], "calibrate": True, "steps_per_bucket": 1})
    run, sub = seen["run"], seen["calibration"]
    assert sub.report["rejected"] == 0 and set(sub.dataset.samples) <= set(run.dataset.samples)
    assert sub.val_dataset.samples == run.val_dataset.samples  # the held-out file: held out there too
    assert [sub.parts[i].name for i in sub.dataset_part].count("b") == 2  # b's 2 clips once, at b's num_frames
    assert {sub.dataset.shapes[i] for i in range(len(sub.dataset)) if sub.dataset_part[i] == 1} == {(5, 64, 96)}
    cal, d = p["calibration"], p["data"]
    assert cal["failed"] is None and cal["oom"] is None, cal
    assert d["heldout"] == 1 and d["buckets"]["9x64x64"]["clips"] == 1  # one of a's two clips is held out
    assert set(p["eta"]["buckets"]) == {"1x64x64", "9x64x64", "5x64x96"}, p["eta"]["buckets"]
    # a batch of each bucket, each file once, and the held-out file (validation's loss)
    assert cal["files"] == 2 + 1 + 2 + 1 and cal["steps"] == 3
    assert cal["world_size"] == 1 and cal["validation_s"] > 0
