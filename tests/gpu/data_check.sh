#!/usr/bin/env bash
# Device check of the data path (one GPU): real-size TI2V-5B (random weights) at 704x1280x17.
#   1. build the model folder; generate 704x1280 clips and images (DiffSynth-style CSV);
#   2. python -m wanexp.cli.cache: peak GPU memory, disk per sample;
#   3. python train.py from the cache, the default run (activation checkpointing, bf16-mixed, batch 1) capped at
#      30 GiB (a 32 GB card): loader wait per step, step time, peak memory;
#   4. the loader benchmark (raw media vs cache) with 4 workers.
source "$(dirname "$0")/setup_env.sh"
python3 tests/gpu/build_random_model.py --model ti2v5b --path "$W/ti2v5b" 2>&1 | grep -v "should be kept" | tail -1 | tee "$OUT/build.txt"
DATA=(model=ti2v5b model.path="$W/ti2v5b" data=synthetic paths.data_dir="$W/data" data.height=704 data.width=1280
      data.num_frames=17 data.batch_size=1 data.num_workers=4 data.generate.height=720 data.generate.width=1280
      data.generate.num_frames=24 data.generate.num_videos=24 data.generate.num_images=8 paths.cache_dir="$W/cache")
/usr/bin/time -v python3 -m wanexp.cli.cache "${DATA[@]}" paths.output_dir="$W/cache_run" > "$OUT/cache.log" 2>&1 \
  || { tail -30 "$OUT/cache.log"; exit 1; }
grep "wanexp: cache" "$OUT/cache.log"; grep "Maximum resident" "$OUT/cache.log"
du -sh "$W/cache/synthetic" | tee -a "$OUT/cache.log"
python3 train.py "${DATA[@]}" model.gradient_checkpointing=true parallel=single trainer.devices=1 \
  trainer.precision=bf16-mixed trainer.max_steps=24 trainer.log_every_n_steps=1 callbacks.checkpoint.every_n_train_steps=24 \
  callbacks.progress=null +callbacks.memory_cap._target_=wanexp.callbacks.memory.MemoryCap +callbacks.memory_cap.gib=30 \
  paths.output_dir="$W/run_cached" run_name=cached-5b > "$OUT/train_cached.log" 2>&1 || { tail -30 "$OUT/train_cached.log"; exit 1; }
grep "^wanexp:" "$OUT/train_cached.log"
python3 tests/gpu/summarize_run.py "$W/run_cached" > "$OUT/train_cached.json"
python3 - "$W/run_cached" <<'PY' | tee "$OUT/train_cached_summary.txt"
import csv, statistics, sys
from pathlib import Path
rows = [r for f in sorted(Path(sys.argv[1], "logs").glob("version_*/metrics.csv")) for r in csv.DictReader(open(f))]
col = lambda k: [float(r[k]) for r in rows if r.get(k)]
step, wait, peak, loss = col("perf/step_time_s")[4:], col("perf/loader_wait_frac")[4:], col("perf/peak_mem_gib"), col("train/loss")
print(f"from cache, 30 GiB cap: {len(loss)} steps, losses finite {all(l == l for l in loss)}, median step {statistics.median(step):.3f} s, "
      f"median loader wait {100 * statistics.median(wait):.2f}% (max {100 * max(wait):.2f}%), peak {max(peak):.2f} GiB")
PY
python3 -m wanexp.cli.bench_loader "${DATA[@]}" +bench.batches=40 paths.output_dir="$W/bench_run" 2>&1 | grep -E "samples/s|skipped" | tee "$OUT/loader.txt"
