"""Summarise a run folder: loss, step time and peak memory from metrics.csv, and the LoRA files written."""
from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path


def main(run_dir: str, skip: int = 2) -> dict:
    out = Path(run_dir)
    rows = [r for f in sorted((out / "logs").glob("version_*/metrics.csv")) for r in csv.DictReader(open(f))]

    def col(name):
        return [float(r[name]) for r in rows if r.get(name)]

    times, losses, peaks = col("perf/step_time_s"), col("train/loss"), col("perf/peak_mem_gib")
    tflops = col("perf/tflops")
    summary = {
        "run": str(out),
        "steps": len(losses),
        "losses": losses,
        "all_finite": all(x == x and abs(x) != float("inf") for x in losses),
        "median_step_s_after_warmup": statistics.median(times[skip:]) if len(times) > skip else None,
        "step_times_s": times,
        "peak_mem_gib": max(peaks) if peaks else None,
        "tflops": statistics.median(tflops[skip:]) if len(tflops) > skip else None,
        "lora_files": sorted(str(p.relative_to(out)) for p in (out / "lora").rglob("*.safetensors")),
        "status": json.loads((out / "status.json").read_text()),
    }
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main(sys.argv[1])
