#!/usr/bin/env bash
# FP8 base (issue 8, model.fp8=true), one GPU of compute capability >= 8.9: `python -m wanexp.cli.bench` on the
# real-size TI2V-5B DiT (random weights) at 704x1280x17 without and with checkpointing, the default step against
# the same step with model.fp8=true: ms/step, peak GiB, and the output / LoRA-gradient error of each against the
# plain per-token loop (FP8's is reported, not held to the bf16 tolerance). JSON + text in $OUT.
source "$(dirname "$0")/setup_env.sh"
set +e
python3 tests/gpu/build_transformer.py --model ti2v5b --path "$W/ti2v5b" || fail build
B="python3 -m wanexp.cli.bench --model-path $W/ti2v5b --frames 17 --json $OUT/fp8.json --variants model.fp8=true"
$B --paths plain_tokens,wanexp --warmup 3 --steps 8 2>&1 | grep -v -e Loading -e "kept in float32" | tee "$OUT/fp8.txt" \
  || fail "fp8 no ckpt"
$B --paths plain_tokens,wanexp --ckpt --warmup 3 --steps 8 2>&1 | grep -v -e Loading -e "kept in float32" \
  | tee -a "$OUT/fp8.txt" || fail "fp8 ckpt"
exit $FAILED
