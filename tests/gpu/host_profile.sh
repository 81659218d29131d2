#!/usr/bin/env bash
# Where the host's time goes in `python train.py` on a GPU (issue 8: the gap between train.py's step and the bench's):
# the real-size TI2V-5B (random weights, light encoders) trains from the cache at 704x1280x17 under py-spy (carried as
# a wheel), sampling every thread with native frames, idle waits included. $OUT/spy.txt holds the collapsed stacks;
# tests/gpu/spy_summary.py prints the training loop's time by frame.
source "$(dirname "$0")/setup_env.sh"
set +e
STEPS=${SPY_STEPS:-100}
M5="$W/ti2v5b_light"
python3 tests/gpu/build_random_model.py --model ti2v5b --entry ti2v5b_light --path "$M5" 2>&1 | grep -v "should be kept" | tail -1
D5=(model=ti2v5b model.path="$M5" data=synthetic paths.data_dir="$W/data5" data.height=704 data.width=1280
    data.num_frames=17 data.batch_size=1 data.num_workers=4 data.generate.height=704 data.generate.width=1280
    data.generate.num_frames=17 data.generate.num_videos=${SPY_VIDEOS:-12} data.generate.num_images=0
    paths.cache_dir="$W/cache" trainer.precision=bf16-mixed)
python3 -m wanexp.cli.cache "${D5[@]}" paths.output_dir="$W/cache_run5" > "$OUT/cache5.log" 2>&1 || tail -20 "$OUT/cache5.log"
SPY=/tmp/site/bin/py-spy
CUDA_VISIBLE_DEVICES=0 timeout ${SPY_TIMEOUT:-300} $SPY record --native --idle --threads -r ${SPY_RATE:-50} -f raw \
  -o "$OUT/spy.txt" -- python3 train.py "${D5[@]}" parallel=${SPY_PARALLEL:-single} trainer.devices=1 \
  trainer.max_steps=$STEPS trainer.log_every_n_steps=10 callbacks.progress=null callbacks.checkpoint.every_n_train_steps=1000 \
  callbacks.validation.every_n_steps=0 paths.output_dir="$W/runs/spy" run_name=spy > "$OUT/spy_run.log" 2>&1
echo "train.py under py-spy rc=$?"; grep -v -i warn "$OUT/spy_run.log" | tail -5
python3 - "$W/runs/spy" <<'PY' | tee "$OUT/spy_steps.txt"
import csv, glob, sys
rows = list(csv.DictReader(open(glob.glob(sys.argv[1] + "/logs/*/metrics.csv")[0])))
print("perf/step_time_s by log step:", [(r["step"], round(float(r["perf/step_time_s"]), 3)) for r in rows if r.get("perf/step_time_s")])
PY
python3 tests/gpu/spy_summary.py "$OUT/spy.txt" | tee "$OUT/spy_summary.txt"
