"""The GPU acceptance registry (tests/gpu/registry.py) and its runner (tests/gpu/run.py), on CPU: the cases are
well-formed, a run folder is read back into the numbers the thresholds judge, a failing result fails, the runner
kills a phase at its step and keeps its record for the next call, and --dry-run prints the commands."""
from __future__ import annotations

import csv
import json
import sys
import shutil
from pathlib import Path

import pytest
import yaml

from tests.gpu import registry, run
from tests.gpu.registry import CAP_GIB, CASES, USER_JOB, USER_STEPS, Case, Check, Ctx, KillAt, Phase, default_cadence

REPO = registry.REPO


def test_cases_are_well_formed(tmp_path):
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    for name, case in CASES.items():
        assert name == case.name and case.gpus >= 1 and case.phases, name
        phases = [p.name for p in case.phases]
        assert len(set(phases)) == len(phases), name
        for p in case.phases:
            assert p.minutes <= 10 and p.timeout_s <= 600, f"{name}/{p.name} does not fit one device call"
            argv = p.argv(ctx)
            assert argv and all(isinstance(a, str) for a in argv), f"{name}/{p.name}"
            scripts = [a for a in argv if a.endswith((".py", ".sh")) and not a.startswith(("+", "/"))]
            assert all((REPO / s).is_file() for s in scripts), f"{name}/{p.name}: {scripts}"
        for c in case.checks:
            assert c.op in (*registry.OPS, "present") and (c.after is None or c.after in phases), f"{name}: {c}"
    sizes = yaml.safe_load((REPO / "tests/gpu/real_sizes.yaml").read_text())
    build = USER_JOB.phase("build").argv(ctx)
    assert sizes[build[build.index("--entry") + 1]]["text_encoder"]["d_model"] == 4096  # UMT5-XXL, real size


def test_user_job_is_the_users_defaults_killed_then_resumed(tmp_path):
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    assert [p.name for p in USER_JOB.phases] == ["build", "cache", "train1", "train2"]
    train1, train2 = USER_JOB.phase("train1"), USER_JOB.phase("train2")
    args = train1.argv(ctx)
    assert args == train2.argv(ctx) and "resume=auto" in args  # the same command continues the same run
    assert f"+callbacks.memory_cap.gib={CAP_GIB}" in args and f"trainer.max_steps={USER_STEPS}" in args
    assert "data.val_fraction=0.1" in args and f"callbacks.validation.every_n_steps={USER_STEPS // 2}" in args
    assert not any(a.startswith(("adapter.", "model.compile", "trainer.precision", "model.gradient")) for a in args)
    assert 250 < train1.kill.step < USER_STEPS and train2.kill is None  # past the first checkpoint (every 250)


def fake_run(run_dir: Path, losses=(0.5, 0.4, 0.3), peak=20.0, val_seconds=(5.0, 5.0, 5.0), elapsed=1000.0,
             state="finished", step=USER_STEPS) -> None:
    """A run folder as train.py leaves it: metrics.csv, status.json, validation/*/metrics.json, lora/final."""
    logs = run_dir / "logs" / "version_0"
    logs.mkdir(parents=True)
    with (logs / "metrics.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, ["step", "train/loss", "perf/step_time_s", "perf/peak_mem_gib"])
        w.writeheader()
        for i, loss in enumerate(losses):
            w.writerow({"step": i, "train/loss": loss, "perf/step_time_s": 0.4, "perf/peak_mem_gib": peak})
    (run_dir / "status.json").write_text(json.dumps({"state": state, "step": step, "max_steps": USER_STEPS,
                                                     "elapsed_s": elapsed, "peak_mem_gib": peak, "world_size": 1}))
    for i, s in enumerate(val_seconds):
        (run_dir / "validation" / f"step_{i * 500:06d}").mkdir(parents=True)
        (run_dir / "validation" / f"step_{i * 500:06d}" / "metrics.json").write_text(json.dumps({"seconds": s}))
    (run_dir / "lora" / "final").mkdir(parents=True)
    for f in ("x_comfyui.safetensors", "x_diffusers.safetensors"):
        (run_dir / "lora" / "final" / f).write_bytes(b"0" * 1024)


PHASES_DONE = {"build": {"ok": True, "rc": 0}, "cache": {"ok": True, "rc": 0},
               "train1": {"ok": True, "rc": -9, "killed_at_step": 560, "checkpoint_step": 500,
                          "status_at_kill": {"elapsed_s": 400.0, "peak_mem_gib": 21.0, "step": 560}},
               "train2": {"ok": True, "rc": 0}}


def judged(tmp_path, phases=PHASES_DONE, **run_kwargs) -> dict:
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    fake_run(ctx.run_dir(USER_JOB.name), **run_kwargs)
    return run.judge(USER_JOB, ctx, json.loads(json.dumps(phases)), ["NVIDIA H100 80GB HBM3"])


def test_thresholds_pass_a_good_run_and_read_its_numbers(tmp_path):
    result = judged(tmp_path)
    assert result["verdict"] == "PASS", [c for c in result["checks"] if c["status"] != "pass"]
    m = result["metrics"]
    assert m["peak_mem_gib"] == 21.0  # the killed session's peak counts too
    assert m["validations"] == 3 and m["val_share"] == pytest.approx(15.0 / 1400.0)  # both sessions' seconds
    assert m["val_share_at_default"] == pytest.approx(5.0 / (default_cadence() * 0.4))  # one call per cadence
    assert m["lora_final_files"] == 2 and m["run_disk_gib"] > 0
    assert run.summary_line(result).startswith("PASS user_job_5b_28g")


@pytest.mark.parametrize("bad, key", [
    ({"losses": (0.5, float("nan"), 0.3)}, "metrics.losses_finite"),
    ({"peak": CAP_GIB + 0.5}, "metrics.peak_mem_gib"),
    ({"val_seconds": (55.0, 60.0, 65.0)}, "metrics.val_share_at_default"),  # 60 s / (2500 x 0.4 s) = 6 %
    ({"state": "failed", "step": 700}, "metrics.state"),
])
def test_a_failing_result_fails(tmp_path, bad, key):
    result = judged(tmp_path, **bad)
    assert result["verdict"] == "FAIL"
    assert key in [c["key"] for c in result["checks"] if c["status"] == "fail"]
    assert run.summary_line(result).startswith("FAIL")


def test_failed_phase_fails_and_missing_phases_are_pending(tmp_path):
    phases = {k: v for k, v in PHASES_DONE.items() if k != "train2"}
    assert judged(tmp_path / "a", phases=phases)["verdict"] == "PENDING"  # run 1's status says running: not judged
    phases["train1"] = dict(phases["train1"], ok=False, error="killed before any checkpoint was written")
    assert judged(tmp_path / "b", phases=phases)["verdict"] == "FAIL"


def test_check_without_its_value_fails():
    assert Check("metrics.x", "<=", 1).evaluate({"metrics": {}}, True)[0] == "fail"
    assert Check("metrics.x", "<=", 1).evaluate({"metrics": {"x": "a"}}, True)[0] == "fail"
    assert Check("metrics.x", "<=", 1).evaluate({}, False)[0] == "pending"


# a stand-in for train.py: status.json every 10 ms, a checkpoint at step 3, never ends by itself
WRITER = """import json, os, sys, time, pathlib
run = pathlib.Path(sys.argv[1]); (run / "checkpoints").mkdir(parents=True, exist_ok=True)
for step in range(1, 100000):
    if step == 3:
        (run / "checkpoints" / "step_000003.ckpt").write_text("x")
    (run / ".s").write_text(json.dumps({"step": step, "elapsed_s": step / 100}))
    os.replace(run / ".s", run / "status.json")
    time.sleep(0.01)
"""


def fake_case(ends: bool = False) -> Case:
    def argv(ctx):
        return [sys.executable, "-c", "pass" if ends else WRITER, str(ctx.run_dir("fake"))]
    return Case(name="fake", gpus=1, model="tiny", about="a fake", checks=(Check("phases.run1.rc", "present"),),
                phases=(Phase("run1", argv, minutes=0.1, timeout_s=30, fresh=lambda ctx: [ctx.run_dir("fake")],
                              kill=KillAt(5, deadline_s=20, run=lambda ctx: ctx.run_dir("fake"))),))


@pytest.fixture
def runner(monkeypatch, tmp_path):
    monkeypatch.setattr(run, "prepare_env", lambda: {**__import__("os").environ, "PYTHONPATH": str(REPO)})

    def call(*args):
        return run.main([*args, "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--gpus", "1"])
    return call


def test_runner_kills_at_the_step_and_keeps_the_record(runner, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(run.CASES, "fake", fake_case())
    assert runner("fake", "--record", str(tmp_path / "bench")) == 0
    phase = json.loads((tmp_path / "w" / "state" / "fake.json").read_text())["phases"]["run1"]
    assert phase["ok"] and phase["rc"] == -9 and 5 <= phase["killed_at_step"] < 1000 and phase["checkpoint_step"] == 3
    result = json.loads((tmp_path / "o" / "fake.json").read_text())
    assert result["verdict"] == "PASS" and (tmp_path / "o" / "fake" / "run1.log").is_file()
    assert "PASS fake" in capsys.readouterr().out
    (row,) = list((tmp_path / "bench").glob("tiny_*.md"))  # no GPU here: the file names the hardware "cpu"
    assert "| fake | PASS |" in row.read_text()

    monkeypatch.setitem(run.CASES, "fake", fake_case(ends=True))  # ended before its kill: the phase failed
    assert runner("fake") == 1
    assert "FAIL fake" in capsys.readouterr().out


def test_dry_run_prints_the_commands_and_writes_nothing(runner, tmp_path, capsys):
    assert run.main(["user_job_5b_28g", "user_job_5b_2gpu_pcie", "--dry-run", "--gpus", "1",
                     "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert out.count(" train.py model=ti2v5b ") == 3 and "build_random_model.py" in out and "wanexp.cli.cache" in out
    assert "NCCL_P2P_DISABLE=1" in out and "SIGKILL at step" in out
    assert "SKIP user_job_5b_2gpu_pcie: needs 2 GPU(s), 1 present" in out
    assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists()


def test_skip_and_bad_names(runner, monkeypatch, capsys):
    monkeypatch.setattr(run, "run_case", lambda *a: pytest.fail("a case that should be skipped ran"))
    assert runner("user_job_5b_2gpu_pcie") == 0
    assert "SKIP user_job_5b_2gpu_pcie: needs 2 GPU(s), 1 present" in capsys.readouterr().out
    assert runner("no_such_case") == 2 and runner("user_job_5b_28g", "--phase", "nope") == 2
    assert "has no phase 'nope'" in capsys.readouterr().err


def test_hw_slug():
    assert run.hw_slug(["NVIDIA H100 80GB HBM3"]) == "h100"
    assert run.hw_slug(["NVIDIA H200"] * 2) == "h200x2" and run.hw_slug([]) == "cpu"


def test_rejudge_recomputes_the_share_at_the_shipped_cadence(tmp_path):
    """A stored result judged again: its validation share is recomputed at today's default cadence from the measured
    seconds and step time (the stored figure was computed at another default)."""
    result = judged(tmp_path)
    step = result["metrics"]["median_step_s"]
    result["metrics"].update(validation_s=[0.04 * default_cadence() * step] * 3, val_share_at_default=0.5)
    stored = tmp_path / "stored.json"
    stored.write_text(json.dumps(result))
    assert run.main(["--rejudge", str(stored), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "user_job_5b_28g.json").read_text())
    assert again["metrics"]["val_share_at_default"] == pytest.approx(0.04) and again["verdict"] == "PASS"


def cited_files(ctx: Ctx) -> set[str]:
    """The tests/gpu files the cases' commands run or read (the paths in their arguments)."""
    cited = set()
    for case in CASES.values():
        for p in case.phases:
            for a in p.argv(ctx):
                if a.startswith("tests/gpu/"):
                    cited.add(a.split("/", 2)[2])
    return cited


def test_every_file_in_tests_gpu_is_a_cases_script_or_a_part(tmp_path):
    """A script that no case runs is a stray: it becomes a case (with thresholds) or goes. The registry's own parts
    (PARTS: the runner, the sizes its builds read, the machine setup) are named with their reason."""
    files = {p.name for p in (REPO / "tests/gpu").iterdir() if p.is_file() and p.suffix != ".pyc"}
    cited = cited_files(Ctx(tmp_path / "w", tmp_path / "o"))
    assert not cited - files, f"cases run files that are not in tests/gpu: {sorted(cited - files)}"
    assert not set(registry.PARTS) - files, f"PARTS names missing files: {sorted(set(registry.PARTS) - files)}"
    stray = sorted(files - cited - set(registry.PARTS))
    assert not stray, f"tests/gpu files no case runs (register them as a case's phase, or remove them): {stray}"


def test_list_and_dry_run_of_every_case_on_cpu(tmp_path, capsys):
    """Every case lists, and prints each phase's command without a GPU (its GPU count: SKIP when fewer)."""
    assert run.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for name, case in CASES.items():
        assert f"{name} " in listed and f"{case.gpus} GPU(s)" in listed
        assert run.main([name, "--dry-run", "--gpus", "0", "--out", str(tmp_path / "o"),
                         "--work", str(tmp_path / "w")]) == 0
        out = capsys.readouterr().out
        assert all(f"## {name}/{p.name} " in out for p in case.phases), name
        assert f"SKIP {name}: needs {case.gpus} GPU(s), 0 present" in out
    assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists()


def test_multi_gpu_cases_declare_their_gpus(tmp_path):
    """A phase that trains on N devices makes the case need N GPUs and sees N of them (CUDA_VISIBLE_DEVICES); a
    command's overrides name each key once (Hydra refuses a key given twice)."""
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    assert {c.gpus for c in CASES.values()} >= {1, 2, 4}
    for name, case in CASES.items():
        for p in case.phases:
            argv = p.argv(ctx)
            keys = [a.split("=", 1)[0].lstrip("+") for a in argv if "=" in a and not a.startswith("-")]
            assert len(keys) == len(set(keys)), f"{name}/{p.name}: a key given twice"
            devices = [int(a.split("=")[1]) for a in argv if a.startswith("trainer.devices=")]
            nproc = [int(argv[i + 1]) for i, a in enumerate(argv) if a == "--nproc_per_node"]
            for n in devices + nproc:
                assert n <= case.gpus, f"{name}/{p.name} uses {n} GPUs; the case declares {case.gpus}"
                assert len(p.env.get("CUDA_VISIBLE_DEVICES", "").split(",")) == n, f"{name}/{p.name}"


def bench_file(path: Path, rows: dict, numerics_ok=True, errors: dict | None = None) -> None:
    """A bench JSON as wanexp.cli.bench appends it: results per path, numerics rows."""
    results = [{"path": k, "median_s": v[0], "peak_gib": v[1], "back_to_back_s": v[0],
                **({"speedup_vs_plain_tokens": 1.0 if k == "plain_tokens" else rows["plain_tokens"][0] / v[0]}
                   if "plain_tokens" in rows else {})} for k, v in rows.items()]
    numerics = [{"path": k, "out_rel_err": e[0], "grad_rel_err_all": e[1]} for k, e in (errors or {}).items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"results": [], "numerics": []},  # an older run in the same file: the last counts
                                {"results": results, "numerics": numerics, "numerics_ok": numerics_ok}]))


def judge_case(case: Case, tmp_path, phases: list[str]) -> dict:
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    return run.judge(case, ctx, {p: {"ok": True, "rc": 0} for p in phases}, ["NVIDIA H100 80GB HBM3"])


@pytest.mark.parametrize("fp8_peak, verdict", [(26.7, "PASS"), (30.5, "FAIL")])
def test_a_bench_case_reads_its_json_and_judges_the_thresholds(tmp_path, fp8_peak, verdict):
    """fp8_5b from the bench's JSON: FP8's error and time against the bf16 step, its memory saving."""
    case = CASES["fp8_5b"]
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    for name in ("fp8", "fp8_ckpt"):
        bench_file(registry.bench_json(ctx, "fp8_5b", name),
                   {"plain_tokens": (0.42, 47.4), "wanexp": (0.250, 31.2),
                    "wanexp [model.fp8=true]": (0.244, fp8_peak)},
                   errors={"wanexp": (7.5e-3, 1.9e-3), "wanexp [model.fp8=true]": (2.2e-2, 3.7e-2)})
    result = judge_case(case, tmp_path, [p.name for p in case.phases])
    assert result["verdict"] == verdict, [c for c in result["checks"] if c["status"] != "pass"]
    m = result["metrics"]["fp8"]
    assert m["wanexp"]["speedup"] == pytest.approx(0.42 / 0.25)
    assert m["wanexp_model_fp8_true"]["vs_wanexp"] == pytest.approx(0.250 / 0.244)
    assert m["fp8_saves_gib"] == pytest.approx(31.2 - fp8_peak)
    row = run.record_row(case, result, tmp_path / "bench")
    assert f"fp8.fp8_saves_gib {31.2 - fp8_peak:.4g}" in row.read_text()  # dotted record keys


def test_a_strategy_case_reads_its_run_folders_and_scaling(tmp_path):
    """strategy_5b_4gpu from its run folders: each run finished, DDP's replicas in sync, samples/s over one GPU."""
    case = CASES["strategy_5b_4gpu"]
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    for run_name, step in (("5b_ddp_1", 0.40), ("5b_ddp_4", 0.41), ("5b_fsdp_4", 0.73)):
        fake_run(ctx.run_dir(run_name), losses=(0.5,) * 8, step=14)
        status = json.loads((ctx.run_dir(run_name) / "status.json").read_text())
        (ctx.run_dir(run_name) / "status.json").write_text(json.dumps({**status, "replicas_in_sync": True}))
        with (ctx.run_dir(run_name) / "logs/version_0/metrics.csv").open("a", newline="") as f:
            for i in range(6):
                csv.writer(f).writerow([10 + i, 0.5, step, 12.0])
    result = judge_case(case, tmp_path, [p.name for p in case.phases])
    assert result["metrics"]["ddp_4_scaling"] == pytest.approx(4 * 0.40 / 0.41)
    assert result["verdict"] == "PASS", [c for c in result["checks"] if c["status"] != "pass"]
    slow = json.loads(json.dumps(result))
    slow["metrics"]["ddp_4_scaling"] = 3.0
    assert registry.evaluate(case, slow)[0] == "FAIL"


@pytest.mark.parametrize("grid_warm, verdict", [(11.0, "PASS"), (12.4, "FAIL")])
def test_a_generation_case_compares_the_warm_samples_and_keeps_the_first(tmp_path, grid_warm, verdict):
    """generate_a14b_4gpu from each phase's metrics.json: seconds per step are the last (warm) sample's, the speed-up
    is warm against warm, the first sample's seconds per step are kept beside them and in the benchmark row."""
    case = CASES[registry.A14B_GEN4]
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    for name, first, warm, peaks in (("gen_1", 40.8, 39.1, [60.6]), ("gen_cfg2_sp2", 12.3, grid_warm, [21.6] * 4)):
        folder = ctx.results(case.name) / name
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({
            "timing": [{"denoise_s": first, "steps": 6}, {"denoise_s": warm, "steps": 6}],
            "processes": {"peak_gib": peaks, "world": len(peaks), "sp": 1, "cfg": 1}}))
    result = judge_case(case, tmp_path, [p.name for p in case.phases])
    assert result["verdict"] == verdict, [c for c in result["checks"] if c["status"] != "pass"]
    m = result["metrics"]["gen_cfg2_sp2"]
    assert m["s_per_step"] == pytest.approx(grid_warm / 6) and m["first_s_per_step"] == pytest.approx(12.3 / 6)
    assert m["speedup"] == pytest.approx(39.1 / grid_warm)
    row = run.record_row(case, result, tmp_path / "bench").read_text()
    assert "gen_cfg2_sp2.first_s_per_step 2.05" in row and "gen_1.first_s_per_step 6.8" in row


def test_the_optimizer_case_reads_each_run_and_its_step_over_adamws(tmp_path):
    """optimizers_5b from its run folders: each optimizer's run finished, its median step (the first three left out)
    over AdamW's, its peak; the EMA run holds the EMA's files beside the raw ones."""
    case = CASES[registry.OPTIM]
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    steps = {"adamw": 0.40, "adamw8bit": 0.42, "prodigy": 0.44, "came": 0.46, "adafactor": 0.45, "adamw_ema": 0.41}
    for key, step in steps.items():
        folder = ctx.run_dir(f"5b_optim_{key}")
        fake_run(folder, losses=(0.5,) * 4, step=registry.OPTIM_STEPS)
        with (folder / "logs/version_0/metrics.csv").open("a", newline="") as f:
            for i in range(7):
                csv.writer(f).writerow([4 + i, 0.5, step, 12.5])
        if key == "adamw_ema":
            for name in ("x_ema_comfyui.safetensors", "x_ema_diffusers.safetensors"):
                (folder / "lora" / "final" / name).write_bytes(b"0" * 1024)
    result = judge_case(case, tmp_path, [p.name for p in case.phases])
    assert result["verdict"] == "PASS", [c for c in result["checks"] if c["status"] != "pass"]
    m = result["metrics"]
    assert m["came"]["step_vs_adamw"] == pytest.approx(0.46 / 0.40) and m["adamw"]["step_vs_adamw"] == 1.0
    assert m["prodigy"]["peak_mem_gib"] == 20.0  # status.json's peak over the logged 12.5
    no_ema = json.loads(json.dumps(result))
    no_ema["metrics"]["adamw_ema"]["lora_final_files"] = 2
    assert registry.evaluate(case, no_ema)[0] == "FAIL"


def test_a_later_device_call_reads_what_an_earlier_phase_wrote(runner, monkeypatch, tmp_path, capsys):
    """Each device call starts with an empty --out: a phase's JSON lives under --work (kept on the warm machine), so
    the call that runs the last phase judges every phase's numbers, and each call's --out gets copies."""
    write = "import json, pathlib, sys; p = pathlib.Path(sys.argv[1]); p.write_text(json.dumps({'v': 7}))"
    case = Case(name="two", gpus=1, model="tiny", about="two calls",
                checks=(Check("metrics.a.v", "==", 7), Check("phases.b.rc", "==", 0)),
                collect=lambda ctx, phases: {"a": json.loads((ctx.results("two") / "a.json").read_text())},
                phases=(Phase("a", lambda ctx: [sys.executable, "-c", write, str(ctx.results("two") / "a.json")],
                              minutes=0.1, timeout_s=30),
                        Phase("b", lambda ctx: [sys.executable, "-c", "pass"], minutes=0.1, timeout_s=30)))
    monkeypatch.setitem(run.CASES, "two", case)
    assert runner("two", "--phase", "a") == 0
    shutil.rmtree(tmp_path / "o")  # the next call's $OUT is a new, empty folder
    assert runner("two", "--phase", "b") == 0
    assert "PASS two" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "two" / "a.json").read_text()) == {"v": 7}


def single_files_results(ctx: Ctx, exact: bool = True, scaled_err: float = 0.026) -> None:
    """The write and compare JSONs as tests/gpu/write_single_files.py and compare_single_files.py leave them."""
    folder = ctx.results(registry.SINGLE)
    folder.mkdir(parents=True, exist_ok=True)
    errors = {"dit_fp16": 3e-8, "dit_fp8_e4m3fn": 0.09, "dit_fp8_scaled": scaled_err, "vae": 3e-8,
              "umt5_fp8_scaled": 0.02}
    compare = {p: {"exact": exact or p != "dit_fp8_scaled", "dtypes_match": True, "keys_match": True,
                   "max_abs_vs_stored": 0.0, "max_abs_diff": e, "rel_err": e, "load_s": 12.0,
                   **({"config_match": True} if p.startswith("dit_") else {})} for p, e in errors.items()}
    (folder / "compare.json").write_text(json.dumps({"device": "cuda", **compare}))
    (folder / "written.json").write_text(json.dumps({p: {"gib": 9.3, "seconds": 60.0} for p in errors}))


@pytest.mark.parametrize("bad, key", [
    ({}, None),
    ({"exact": False}, "metrics.compare.dit_fp8_scaled.exact"),
    ({"scaled_err": 0.2}, "metrics.compare.dit_fp8_scaled.rel_err"),
    ({"peak": CAP_GIB + 1.0}, "metrics.train.peak_mem_gib"),
])
def test_the_single_files_case_reads_the_comparison_and_the_run(tmp_path, bad, key):
    """single_files_5b from the compare JSON and the run from the files: every load exact, scaled fp8's error within
    its bound, the run finished under the cap."""
    case = CASES[registry.SINGLE]
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    single_files_results(ctx, **{k: v for k, v in bad.items() if k != "peak"})
    fake_run(ctx.run_dir(registry.SINGLE), losses=(0.5,) * 6, step=registry.SINGLE_STEPS, peak=bad.get("peak", 21.0))
    result = judge_case(case, tmp_path, [p.name for p in case.phases])
    failed = [c["key"] for c in result["checks"] if c["status"] == "fail"]
    assert result["verdict"] == ("PASS" if key is None else "FAIL") and failed == ([key] if key else []), failed
    assert result["metrics"]["compare"]["dit_fp8_e4m3fn"]["rel_err"] == 0.09
    if key is None:
        row = run.record_row(case, result, tmp_path / "bench").read_text()
        assert "compare.dit_fp8_scaled.rel_err 0.026" in row and "written.dit_fp16.gib 9.3" in row


@pytest.mark.parametrize("long_fa4_s, verdict", [(3.308, "PASS"), (3.70, "FAIL")])
def test_the_fa4_case_reads_the_kernels_and_each_pair_that_differs_only_in_the_kernel(tmp_path, long_fa4_s, verdict):
    """attention_fa4: the kernels' JSON (attention_ab.py) and the benches; FA4's step over cuDNN's in each pair (the
    2026-11-29 H200 figures pass; FA4 no faster at 27,280 tokens fails that check and the 550 TFLOP/s one)."""
    case = CASES[registry.FA4_CASE]
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    fa4 = f"wanexp [{registry.FA4_SET}]"
    runs = {"short": {"plain_compiled": (0.2466, 31.2), "wanexp": (0.2429, 31.2), fa4: (0.2421, 31.2),
                      **{f"wanexp [{v}]": (t, 26.4) for v, t in zip(registry.FA4_STEP.values(),
                                                                    (0.2380, 0.2332, 0.2112, 0.1984))}},
            "ckpt": {"plain_tokens_compiled": (0.345, 12.3), "wanexp": (0.321, 12.4), fa4: (0.318, 12.4),
                     f"wanexp [{registry.FP8_BUDGET_GRAPHS[20]}]": (0.235, 16.6),
                     f"wanexp [{registry.FA4_CKPT}]": (0.226, 16.6),
                     f"wanexp [{registry.FA4_CKPT_BF16}]": (0.2657, 19.5)},
            "long": {"wanexp": (3.674, 23.3), fa4: (long_fa4_s, 21.4),
                     f"wanexp [{registry.FA4_LONG_BUDGET}]": (3.2, 55.0)}}
    for name, rows in runs.items():
        path = registry.bench_json(ctx, registry.FA4_CASE, name)
        bench_file(path, rows)
        data = json.loads(path.read_text())
        strongest = min(v[0] for k, v in rows.items() if k.startswith("plain")) if name != "long" else None
        for r in data[-1]["results"]:
            r["speedup_vs_strongest"] = strongest / r["median_s"] if strongest else None
            r["tflops"] = 1830.3 / r["median_s"] if name == "long" else None  # TFLOP of a step at 27,280 tokens
        path.write_text(json.dumps(data))
    kernels = {"5b_self_27280": {"fa4": {"fwd_bwd_tflops": 622.0}}, "5b_self_4400": {"fa4": {"grad_rel_err": 2.4e-3}}}
    (ctx.results(registry.FA4_CASE) / "kernels.json").write_text(json.dumps({"shapes": kernels}))
    result = judge_case(case, tmp_path, [p.name for p in case.phases])
    failed = [c["key"] for c in result["checks"] if c["status"] != "pass"]
    assert result["verdict"] == verdict and failed == ([] if verdict == "PASS" else
                                                       ["metrics.fa4_over_cudnn.long",
                                                        f"metrics.long.{registry.FA4_VARIANT}.tflops"]), failed
    ratios = result["metrics"]["fa4_over_cudnn"]
    assert ratios["fp8_graphs"] == pytest.approx(0.1984 / 0.2112) and ratios["long"] == pytest.approx(long_fa4_s / 3.674)
    assert ratios["graphs"] == pytest.approx(0.2332 / 0.2380) and ratios["short"] == pytest.approx(0.2421 / 0.2429)


def test_the_runner_finds_fa4_where_its_install_finished(tmp_path):
    """tests/gpu/setup_fa4.sh's install on the phases' PYTHONPATH once it is complete (its .done), not before."""
    site = tmp_path / "fa4site"
    (site / "nvidia_cutlass_dsl" / "dsl_packages").mkdir(parents=True)
    assert run.fa4_paths(site) == []  # an install cut short: nothing half-made on the path
    (site / ".done").touch()
    assert run.fa4_paths(site) == [str(site / "nvidia_cutlass_dsl" / "dsl_packages"), str(site)]


@pytest.mark.parametrize("fast_ms, verdict", [(281.0, "PASS"), (300.0, "FAIL")])
def test_the_train_against_bench_case_pairs_each_run_with_the_bench_step_of_its_settings(tmp_path, fast_ms, verdict):
    """gap_fast_5b: train.py's timed steps (StepTimer's line in each phase's log) over the bench's step with the same
    settings: the default run against the bench's default path, the fast runs against its variant's row."""
    case = CASES[registry.GAP_FAST]
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    bench_file(registry.bench_json(ctx, registry.GAP_FAST, "bench"),
               {"wanexp": (0.325, 12.4), f"wanexp [{' '.join(registry.FAST_STEP)}]": (0.2787, 19.0)})
    logs = ctx.work / "logs" / registry.GAP_FAST
    logs.mkdir(parents=True)
    for phase, ms in (("gap_default", 330.0), ("gap_fast", fast_ms), ("gap_fast_log1", 298.9)):
        (logs / f"{phase}.log").write_text(f"loading\nwanexp-timer: steps 21-40 mean {ms} ms\nwanexp: finished\n")
    (logs / "nvml.log").write_text("nvml: torch_reads_all 0.030 ms\nnvml: wanexp_gpu 0.250 ms  {}\n")
    result = judge_case(case, tmp_path, [p.name for p in case.phases])
    assert result["verdict"] == verdict, [c for c in result["checks"] if c["status"] != "pass"]
    m = result["metrics"]
    assert m["gap_default_over_bench"] == pytest.approx(330.0 / 325.0)
    assert m["gap_fast_over_bench"] == pytest.approx(fast_ms / 278.7)
    assert m["gap_fast_log1_over_bench"] == pytest.approx(298.9 / 278.7)
    assert m["nvml_ms"] == {"torch_reads_all": 0.03, "wanexp_gpu": 0.25}
