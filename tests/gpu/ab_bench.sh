#!/bin/bash
# The step of two source trees on the same card in one call: wanexp.cli.bench with checkpointing at 704x1280x17
# (4,400 tokens, the real-size TI2V-5B DiT with random weights), the compiled per-token plain loop and wanexp's step,
# alternating old, new, old, new. Prepare the old tree on this machine, then run it on the GPU with the wheels:
#     git archive <old commit> wanexp conf tests/gpu train.py pyproject.toml | (mkdir -p .ab/old && tar -x -C .ab/old)
#     bash tests/gpu/ab_bench.sh        (on the GPU machine, carrying .whl and .ab; results in $OUT)
set -uo pipefail
ROOT=$PWD
export OUT=${OUT:-/tmp/out}
source tests/gpu/setup_env.sh
SITE=${WANEXP_SITE:-/tmp/site}
python3 tests/gpu/build_transformer.py --model ti2v5b --path /tmp/dit 2>&1 | tail -2
run() {  # label, source tree
  (cd "$2" && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$SITE:$2 timeout 170 python3 -m wanexp.cli.bench --model-path /tmp/dit \
     --frames 17 --ckpt --paths plain_tokens_compiled,wanexp --warmup 3 --steps 6 --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1)
  echo "$1 rc=$? $(date +%T)"; tail -4 "$OUT/$1.log"
}
for r in ${AB_ORDER:-old1:.ab/old new1:. old2:.ab/old new2:.}; do
  run "${r%%:*}" "$ROOT/${r#*:}"
done
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    for run in json.load(open(f))[-1:]:
        print(os.path.basename(f), {r["path"]: (round(r["median_s"] * 1000, 1), round(r["back_to_back_s"] * 1000, 1),
                                      round(r["peak_gib"], 2)) for r in run["results"]})
PY
