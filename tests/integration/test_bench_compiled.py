"""wanexp.cli.bench's compiled plain loops on the tiny model (CPU): each transformer block compiled as a user compiles
it, under diffusers' checkpointing, checked against the eager plain loop, and the strongest plain loop named."""
from __future__ import annotations

import json

from tests.conftest import compose_cfg
from wanexp.models.tiny import ensure_tiny_model
from wanexp.composition import build


def test_the_compiled_plain_loop_runs_checkpointed_and_is_checked(shared_dir, tmp_path, capsys):
    from torch._dynamo.utils import counters

    from wanexp.cli import bench

    cfg = compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models"])
    ensure_tiny_model(build(cfg.model))
    graphs = counters["stats"]["unique_graphs"]
    # backend eager: dynamo captures each block (what block.compile() does) without inductor's CPU codegen time
    results = bench.main(["--model-path", cfg.model.path, "--height", "64", "--width", "64", "--frames", "9",
                          "--text-len", "16", "--rank", "4", "--warmup", "0", "--steps", "1", "--ckpt",
                          "--paths", "plain_tokens,plain_tokens_compiled", "--compile-backend", "eager",
                          "--fp32-floor", "off", "--json", str(tmp_path / "bench.json")])
    assert counters["stats"]["unique_graphs"] > graphs  # the blocks were compiled
    assert [r["path"] for r in results] == ["plain_tokens", "plain_tokens_compiled"]
    run = json.loads((tmp_path / "bench.json").read_text())[-1]
    fastest = min(results, key=lambda r: r["median_s"])
    assert run["strongest_plain"] == fastest["path"] and fastest["speedup_vs_strongest"] == 1.0
    assert run["results"][1]["compile"] == "eager" and run["compile_backend"] == "eager"
    # the compiled loop is checked like wanexp's step: both first-frame cases, on the same draws; with the eager
    # backend it runs the eager loop's kernels, so it matches it exactly
    rows = run["numerics"]
    assert [(c["path"], c["first_frame"]) for c in rows] == [("plain_tokens_compiled", True),
                                                             ("plain_tokens_compiled", False)]
    assert run["numerics_ok"] and all(c["ok_by"] == "plain" for c in rows)
    assert all(c["out_rel_err"] == 0.0 and c["grad_rel_err_all"] == 0.0 and c["input_max_abs_diff"] == 0.0
               for c in rows)
    out = capsys.readouterr().out
    assert f"strongest plain loop (fastest measured): {fastest['path']}" in out and "vs strongest" in out
