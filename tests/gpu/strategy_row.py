"""One row of the strategy table from a run folder (metrics.csv + status.json): JSON on one line.

    python tests/gpu/strategy_row.py RUN_DIR --name NAME --gpus N --rc RC [train.py overrides...]
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--name", required=True)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--rc", type=int, default=0)
    ap.add_argument("--paired-with", default=None, help="the run that shared the machine at the same time (other GPUs)")
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the median (compile, first loads)")
    args, overrides = ap.parse_known_args()
    out = Path(args.run)
    rows = [r for f in sorted((out / "logs").glob("version_*/metrics.csv")) for r in csv.DictReader(open(f))]

    def col(name):
        return [float(r[name]) for r in rows if r.get(name)]

    times, losses, peaks, tflops = col("perf/step_time_s"), col("train/loss"), col("perf/peak_mem_gib"), col("perf/tflops")
    sps = col("perf/samples_per_s")
    kept = times[args.skip:] if len(times) > args.skip else times[-1:]
    med = statistics.median(kept) if kept else None
    status = json.loads((out / "status.json").read_text()) if (out / "status.json").is_file() else {}
    opts = dict(o.split("=", 1) for o in overrides if "=" in o and not o.startswith(("paths.", "data.generate")))
    sp = int(opts.get("parallel.sp_size", 1))
    row = {
        "name": args.name, "rc": args.rc, "gpus": args.gpus, "model": opts.get("model"), "boundary": opts.get("boundary"),
        "parallel": opts.get("parallel"), "stage": opts.get("parallel.strategy.stage"), "sp": sp,
        "shape": f"{opts.get('data.num_frames')}x{opts.get('data.height')}x{opts.get('data.width')}",
        "steps": len(losses), "finite": bool(losses) and all(x == x and abs(x) != float("inf") for x in losses),
        "median_step_s": med, "samples_per_s": (args.gpus // sp) / med if med else None,
        "samples_per_s_logged": statistics.median(sps[args.skip:]) if len(sps) > args.skip else None,
        "peak_gib": max(peaks) if peaks else None,
        "tflops_per_gpu": statistics.median(tflops[args.skip:]) if len(tflops) > args.skip else None,
        "step_times": [round(t, 3) for t in times],
        "lora_files": len(list((out / "lora").rglob("*.safetensors"))) if (out / "lora").is_dir() else 0,
        "state": status.get("state"), "replicas_in_sync": status.get("replicas_in_sync"), "paired_with": args.paired_with,
        # objective=dmd: each step trains one adapter; train/lr_gen is logged on the generator's steps only
        "phase_step_s": {ph: [round(float(r["perf/step_time_s"]), 3) for r in rows if r.get("perf/step_time_s")
                              and r.get("train/lr_critic") and bool(r.get("train/lr_gen")) == (ph == "gen")]
                         for ph in ("critic", "gen")},
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
