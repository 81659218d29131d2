#!/usr/bin/env bash
# Issue 8's checks that the README has no GPU figures for yet, in one device call of at most ~9.5 minutes. With two GPUs
# two queues run side by side (each on its own card), else one after the other; every item has its own time limit
# (what is left before DEADLINE s), so a slow item costs only itself. Results and logs go to $OUT.
#   queue 0 (GPU 0): the path users run against the benchmark (strategy_check.sh: the bench's step, `python train.py`
#                    from the cache logging every step and every 10th), then the bf16 paths' distance from fp32
#                    (bench --fp32-floor, ckpt)
#   queue 1 (GPU 1): the FP8 base (bench --variants model.fp8=true, no ckpt), then model.memory_budget_gib=30 at
#                    27,280 tokens with the process capped at 30 GiB
source "$(dirname "$0")/setup_env.sh"
set +e
BENCH="python3 -m wanexp.cli.bench"
quiet() { grep -v -e Loading -e "kept in float32"; }

queue0() {
  say "q0: gap (strategy_check.sh 5b bench|5b_ddp_1)"
  OUT="$OUT/gap" timeout "$(left)" env STRAT_CASES=5b STRAT_ONLY='bench|5b_ddp_1' bash tests/gpu/strategy_check.sh \
    > "$OUT/gap.txt" 2>&1
  say "q0: gap rc=$?"
  say "q0: fp32 floor"
  CUDA_VISIBLE_DEVICES=0 timeout "$(left)" $BENCH --model-path "$W/ti2v5b_light" --frames 17 --ckpt --warmup 2 \
    --steps 4 --fp32-floor --json "$OUT/floor.json" 2>&1 | quiet > "$OUT/floor.txt"
  say "q0: fp32 floor rc=${PIPESTATUS[0]}"
}

queue1() {
  local gpu=$1
  CUDA_VISIBLE_DEVICES=$gpu python3 tests/gpu/build_transformer.py --model ti2v5b --path "$W/ti2v5b"
  say "q1: fp8 (GPU $gpu)"
  CUDA_VISIBLE_DEVICES=$gpu timeout "$(left)" $BENCH --model-path "$W/ti2v5b" --frames 17 --paths plain_tokens,wanexp \
    --variants model.fp8=true --warmup 3 --steps 8 --json "$OUT/fp8.json" 2>&1 | quiet > "$OUT/fp8.txt"
  say "q1: fp8 rc=${PIPESTATUS[0]}"
  say "q1: budget 30 GiB at 27,280 tokens (GPU $gpu)"
  CUDA_VISIBLE_DEVICES=$gpu timeout "$(left)" python3 tests/gpu/capped.py 30 wanexp.cli.bench --model-path "$W/ti2v5b" \
    --ckpt --paths wanexp --no-check --frames 121 --warmup 1 --steps 3 --variants "model.memory_budget_gib=30" \
    --json "$OUT/budget.json" 2>&1 | quiet > "$OUT/budget.txt"
  say "q1: budget rc=${PIPESTATUS[0]}"
}

if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  queue0 & queue1 1; wait
else
  queue0; queue1 0
fi
say "done"
for f in gap.txt floor.txt fp8.txt budget.txt; do echo "=== $f"; grep -v -e "^\s*$" "$OUT/$f" | tail -30; done
