"""The GPU case scaling_5b_2gpu read back on CPU: whole-run samples/s from a run's per-step timestamps (epoch
boundaries included), the median step, each boundary's cost over it, the two-GPU runs over the one-GPU run, and the
thresholds (scaling >= 1.95x, an epoch boundary <= 0.2 s) passing a good set of runs and failing a slow boundary."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gpu import run
from tests.gpu.registry import CASES, SCALING, SCALING_CLIPS, SCALING_EPOCHS, SCALING_RUNS, SCALING_SKIP, Ctx

CASE = CASES[SCALING]


def fake_run(folder: Path, world: int, step_s: float, boundary_s: float) -> None:
    """A run logged at every step: status.json, and status.jsonl with each step's end, the steps opening an epoch
    ``boundary_s`` longer."""
    per_epoch = SCALING_CLIPS // world
    steps = SCALING_EPOCHS * per_epoch
    folder.mkdir(parents=True)
    (folder / "status.json").write_text(json.dumps({"state": "finished", "step": steps, "max_steps": steps,
                                                    "world_size": world, "steps_per_epoch": per_epoch,
                                                    "replicas_in_sync": True if world > 1 else None}))
    t, lines = 1000.0, []
    for step in range(1, steps + 1):
        t += step_s + (boundary_s if step > 1 and (step - 1) % per_epoch == 0 else 0.0)
        lines.append(json.dumps({"step": step, "time": t, "loss": 0.5, "lr": 1e-4, "samples_per_s": 1.0}))
    (folder / "status.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "lora" / "final").mkdir(parents=True)
    (folder / "lora" / "final" / "x_comfyui.safetensors").write_bytes(b"0")
    logs = folder / "logs" / "version_0"
    logs.mkdir(parents=True)
    (logs / "metrics.csv").write_text("step,train/loss,perf/step_time_s\n0,0.5,0.4\n1,0.4,0.4\n")


def judged(tmp_path: Path, steps: dict, boundary: dict) -> dict:
    ctx = Ctx(tmp_path / "w", tmp_path / "o")
    for key, (gpus, _) in SCALING_RUNS.items():
        fake_run(ctx.run_dir(f"scale_{key}"), gpus, steps[key], boundary[key])
    phases = {p.name: {"ok": True, "rc": 0} for p in CASE.phases}
    return run.judge(CASE, ctx, phases, ["NVIDIA H200"] * 2)


def test_whole_runs_give_samples_per_s_the_median_step_and_each_boundarys_cost(tmp_path):
    result = judged(tmp_path, {"gpu1": 0.4, "gpu2": 0.4, "gpu2_nop2p": 0.4},
                    {"gpu1": 0.1, "gpu2": 0.05, "gpu2_nop2p": 0.15})
    assert result["verdict"] == "PASS", [c for c in result["checks"] if c["status"] != "pass"]
    m = result["metrics"]
    one, two = m["gpu1"], m["gpu2"]
    assert one["median_step_s"] == pytest.approx(0.4) and one["boundary_s"] == pytest.approx([0.1] * 4)
    assert two["boundary_s"] == pytest.approx([0.05] * 4) and m["gpu2_nop2p"]["boundary_max_s"] == pytest.approx(0.15)
    timed = SCALING_EPOCHS * SCALING_CLIPS - SCALING_SKIP  # one GPU: steps after the skipped ones, 4 boundaries in
    assert one["samples_per_s"] == pytest.approx(timed / (timed * 0.4 + 4 * 0.1))
    timed2 = SCALING_EPOCHS * SCALING_CLIPS // 2 - SCALING_SKIP
    assert m["gpu2_scaling"] == pytest.approx(2 * timed2 / (timed2 * 0.4 + 4 * 0.05) / one["samples_per_s"])


@pytest.mark.parametrize("steps, boundary, key", [
    ({"gpu1": 0.4, "gpu2": 0.4, "gpu2_nop2p": 0.4}, {"gpu1": 0.0, "gpu2": 0.5, "gpu2_nop2p": 0.0},
     "metrics.gpu2.boundary_max_s"),
    ({"gpu1": 0.4, "gpu2": 0.4, "gpu2_nop2p": 0.43}, {"gpu1": 0.0, "gpu2": 0.0, "gpu2_nop2p": 0.0},
     "metrics.gpu2_nop2p_scaling"),  # 0.4 / 0.43 x 2 = 1.86x
])
def test_a_slow_boundary_or_short_scaling_fails(tmp_path, steps, boundary, key):
    result = judged(tmp_path, steps, boundary)
    assert result["verdict"] == "FAIL"
    assert key in [c["key"] for c in result["checks"] if c["status"] == "fail"]
