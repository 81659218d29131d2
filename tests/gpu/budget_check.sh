#!/usr/bin/env bash
# One-GPU device call: model.memory_budget_gib (checkpoint only the blocks a budget needs) on a real-size TI2V-5B DiT
# (random weights), the process capped at 30 GiB (the user's 32 GB cards): step time and peak against every block
# checkpointed, at 704x1280x17 (4,400 tokens) and 704x1280x121 (27,280 tokens). Results go to $OUT.
source "$(dirname "$0")/setup_env.sh"
set +e
python3 tests/gpu/build_transformer.py --model ti2v5b --path "$W/ti2v5b" || fail build
B="python3 tests/gpu/capped.py 30 wanexp.cli.bench --model-path $W/ti2v5b --ckpt --paths wanexp --no-check --json $OUT/budget.json"
$B --frames 17 --warmup 3 --steps 6 --variants "model.memory_budget_gib=30;model.memory_budget_gib=20" 2>&1 \
  | grep -v -e Loading -e "kept in float32" | tee "$OUT/budget_short.txt" || fail "budget 4,400 tokens"
$B --frames 121 --warmup 1 --steps 3 --variants "model.memory_budget_gib=30" 2>&1 \
  | grep -v -e Loading -e "kept in float32" | tee "$OUT/budget_long.txt" || fail "budget 27,280 tokens"
exit $FAILED
