"""wanexp.cli.bench's summary: every path against the strongest (fastest) plain loop, in one table; the paths each
model runs by default; the GPU case that times them all reads the ratios back."""
from __future__ import annotations

import json

import pytest

from tests.gpu import registry, run
from tests.gpu.registry import CASES, Ctx
from wanexp.cli.bench import default_paths, speedups, table


def _row(path: str, ms: float) -> dict:
    return {"path": path, "median_s": ms / 1000, "tflops": 1.0, "pct_of_peak": 0.1, "peak_gib": 10.0}


def test_every_path_is_compared_with_the_fastest_plain_loop():
    results = [_row("plain", 392.9), _row("plain_compiled", 260.0), _row("plain_tokens", 420.0),
               _row("plain_tokens_compiled", 249.8), _row("wanexp", 255.8)]
    assert speedups(results) == "plain_tokens_compiled"
    by = {r["path"]: r for r in results}
    assert by["wanexp"]["speedup_vs_strongest"] == pytest.approx(249.8 / 255.8)
    assert by["plain"]["speedup_vs_strongest"] == pytest.approx(249.8 / 392.9)
    assert by["plain_tokens_compiled"]["speedup_vs_strongest"] == 1.0
    assert by["wanexp"]["speedup_vs_plain_tokens"] == pytest.approx(420.0 / 255.8)  # each plain loop's, in the JSON
    lines = table(results, "plain_tokens_compiled")
    assert lines[0].endswith(": plain_tokens_compiled") and "vs strongest" in lines[1]
    assert len(lines) == 2 + len(results)  # one table, a row per path
    assert lines[2 + 4].split()[:2] == ["wanexp", "255.8"] and lines[2 + 4].rstrip().endswith("0.98x")
    assert lines[2 + 3].endswith("<- strongest") and sum("<- strongest" in line for line in lines) == 1


def test_without_a_plain_loop_there_is_no_ratio():
    results = [_row("wanexp", 255.8)]
    assert speedups(results) is None and results[0]["speedup_vs_strongest"] is None
    assert table(results, None)[2].split()[-1] == "-"


def test_paths_all_adds_the_compiled_plain_loops_to_the_default():
    assert default_paths(True) == ["plain", "plain_tokens", "wanexp"]
    assert default_paths(True, compiled=True) == ["plain", "plain_compiled", "plain_tokens", "plain_tokens_compiled",
                                                  "wanexp"]
    assert default_paths(False, compiled=True) == ["plain", "plain_compiled", "wanexp"]  # A14B: no per-token t
    eager_only = [_row("plain", 392.9), _row("wanexp", 255.8)]
    assert table(eager_only, speedups(eager_only))[0].endswith("plain (no compiled plain loop measured: --paths all "
                                                                "adds them)")


def test_the_gpu_case_times_every_path_and_reads_the_ratio_to_the_strongest(tmp_path):
    case = CASES[registry.VS_COMPILED]
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    bench_phases = [p for p in case.phases if p.name in registry.VS_RUNS]
    assert [p.name for p in case.phases] == ["build_dit", "bench", "bench_ckpt", "long"]  # one call (~9.5 min)
    for p in bench_phases:
        argv = p.argv(ctx)
        assert argv[argv.index("--paths") + 1].split(",") == default_paths(True, compiled=True)
        assert ("--ckpt" in argv) == (p.name == "bench_ckpt") and argv[argv.index("--frames") + 1] == "17"
    # the FP8 base runs in the bench phase's process, as a variant of wanexp's step (no checkpointing)
    fp8 = case.phases[1].argv(ctx)  # and the CUDA graphs (model.cuda_graphs), alone and with FP8
    assert fp8[fp8.index("--variants") + 1].split(";") == ["model.fp8=true", registry.GRAPHS, registry.FP8_GRAPHS]
    assert {registry.FP8_VARIANT_PATH, registry.GRAPHS_VARIANT_PATH, registry.FP8_GRAPHS_VARIANT_PATH} <= set(
        fp8[fp8.index("--profile") + 1].split(","))
    for p in (case.phases[2], case.phases[3]):  # selective checkpointing beside the checkpointed step and at length
        argv = p.argv(ctx)
        assert argv[argv.index("--variants") + 1].split(";")[0] == "model.selective_checkpointing=true"
        assert registry.SAC_VARIANT_PATH in argv[argv.index("--profile") + 1].split(",")
    ckpt = case.phases[2].argv(ctx)  # with the graphs: every block selective, and the budget choosing (22 GiB; the
    # FP8 base at the targets' 20 and 13 GiB)
    assert ckpt[ckpt.index("--variants") + 1].split(";")[1:] == [
        registry.SAC_GRAPHS, *registry.BUDGET_GRAPHS.values(), *registry.FP8_BUDGET_GRAPHS.values()]
    assert registry.FP8_BUDGET_GRAPHS[13] == "model.fp8=true model.memory_budget_gib=13 model.cuda_graphs=true"
    times = {"bench": (392.9, 255.0, 420.0, 249.8, 255.8), "bench_ckpt": (568.0, 440.0, 683.8, 433.9, 344.8)}
    for name, ms in times.items():
        results = [_row(p, t) for p, t in zip(default_paths(True, compiled=True), ms)]
        if name == "bench":
            results += [{**_row(registry.FP8_VARIANT_PATH, 243.8), "peak_gib": 26.7},
                        _row(registry.GRAPHS_VARIANT_PATH, 244.0),
                        {**_row(registry.FP8_GRAPHS_VARIANT_PATH, 205.0),
                         "card": {"sm_mhz": 1890.0, "power_w": 655.0, "max_power_w": 690.0, "samples": 20}}]
        else:  # selective checkpointing, a variant of the checkpointed step, and with the graphs
            results += [{**_row(registry.SAC_VARIANT_PATH, 301.0), "peak_gib": 16.9},
                        {**_row(registry.SAC_GRAPHS_VARIANT_PATH, 289.1), "peak_gib": 16.0},
                        {**_row(f"wanexp [{registry.BUDGET_GRAPHS[22]}]", 279.5), "peak_gib": 18.4},
                        {**_row(f"wanexp [{registry.FP8_BUDGET_GRAPHS[20]}]", 235.0), "peak_gib": 16.6},
                        {**_row(f"wanexp [{registry.FP8_BUDGET_GRAPHS[13]}]", 249.2), "peak_gib": 11.6}]
        strongest = speedups(results)
        path = registry.bench_json(ctx, registry.VS_COMPILED, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        numerics = [{"path": registry.FP8_VARIANT_PATH, "out_rel_err": 2.2e-2, "grad_rel_err_all": 3.7e-2}]
        path.write_text(json.dumps([{"results": results, "numerics": numerics if name == "bench" else [],
                                     "numerics_ok": True, "strongest_plain": strongest}]))
    # 27,280 tokens with checkpointing (TFLOP/s)
    long = case.phases[3].argv(ctx)
    assert long[long.index("--frames") + 1] == "121" and "--ckpt" in long
    results = [_row("plain_tokens_compiled", 4100.0), {**_row("wanexp", 3760.0), "tflops": 486.0},
               _row(registry.SAC_VARIANT_PATH, 3300.0)]
    strongest = speedups(results)
    registry.bench_json(ctx, registry.VS_COMPILED, "long").write_text(json.dumps(
        [{"results": results, "numerics": [], "numerics_ok": True, "strongest_plain": strongest}]))
    result = run.judge(case, ctx, {p.name: {"ok": True, "rc": 0} for p in case.phases}, ["NVIDIA H100 80GB HBM3"])
    m = result["metrics"]
    assert m["bench"][registry.FP8_VARIANT]["median_s"] == pytest.approx(0.2438)
    assert m["bench"][registry.FP8_VARIANT]["out_rel_err"] == 2.2e-2 and m["long"]["wanexp"]["tflops"] == 486.0
    assert m["long"]["wanexp"]["vs_strongest"] == pytest.approx(4100.0 / 3760.0)
    assert m["bench"]["strongest_plain"] == "plain_tokens_compiled"
    assert m["bench_ckpt"]["wanexp"]["vs_strongest"] == pytest.approx(433.9 / 344.8)
    assert m["bench_ckpt"][registry.SAC_VARIANT]["median_s"] == pytest.approx(0.301)
    assert m["long"][registry.SAC_VARIANT]["median_s"] == pytest.approx(3.3)
    assert m["bench_ckpt"][registry.BUDGET_GRAPHS_VARIANT[22]]["vs_strongest"] == pytest.approx(433.9 / 279.5)
    assert m["bench_ckpt"][registry.FP8_BUDGET_GRAPHS_VARIANT[20]]["vs_strongest"] == pytest.approx(433.9 / 235.0)
    assert m["bench_ckpt"][registry.FP8_BUDGET_GRAPHS_VARIANT[13]]["peak_gib"] == 11.6
    assert m["bench"][registry.GRAPHS_VARIANT]["median_s"] == pytest.approx(0.244)
    assert (m["bench"][registry.FP8_GRAPHS_VARIANT]["sm_mhz"], m["bench"][registry.FP8_GRAPHS_VARIANT]["power_w"]) == \
        (1890.0, 655.0)  # the card's clock and power while the path ran
    assert m["bench"][registry.GRAPHS_VARIANT]["sm_mhz"] is None  # none sampled (a CPU run, or no nvidia-smi)
    assert result["verdict"] == "PASS", [c for c in result["checks"] if c["status"] != "pass"]
    row = run.record_row(case, result, tmp_path / "bench").read_text()
    assert "bench.strongest_plain plain_tokens_compiled" in row and f"bench_ckpt.wanexp.vs_strongest " \
        f"{433.9 / 344.8:.4g}" in row
    over = json.loads(path.read_text())  # the FP8 low-memory setting over its 13 GiB: that check fails, no other
    over[0]["results"][-1]["peak_gib"] = 13.4
    path.write_text(json.dumps(over))
    failed = run.judge(case, ctx, {p.name: {"ok": True, "rc": 0} for p in case.phases}, ["NVIDIA H100 80GB HBM3"])
    assert [c["key"] for c in failed["checks"] if c["status"] != "pass"] == [
        f"metrics.bench_ckpt.{registry.FP8_BUDGET_GRAPHS_VARIANT[13]}.peak_gib"] and failed["verdict"] == "FAIL"


def test_an_unknown_path_is_refused_before_any_model_is_read(tmp_path, capsys):
    from wanexp.cli import bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--model-path", str(tmp_path / "absent"), "--paths", "plain,plain_tokens_compild"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown path 'plain_tokens_compild' (one of plain, plain_compiled, plain_tokens, " in err


def test_profile_covers_exactly_the_paths_it_names():
    """``--profile plain_tokens_compiled`` profiles that path alone; a variant is named as the summary prints it;
    without --profile (its empty default) nothing is profiled."""
    from wanexp.cli.bench import profiled

    assert profiled("plain_tokens_compiled", "plain_tokens_compiled")
    assert not profiled("wanexp", "plain_tokens_compiled")
    assert profiled("wanexp [model.fp8=true]", "wanexp,wanexp [model.fp8=true]")
    assert not profiled("wanexp", "")
