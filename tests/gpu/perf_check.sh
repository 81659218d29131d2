#!/usr/bin/env bash
# Throughput check (issue 8), one device call: real-size random DiTs, `python -m wanexp.cli.bench` on one card:
# the plain loop (scalar and per-token timesteps), wanexp's step, its numerics against the plain loop, and knob
# variants. Results (JSON with card, torch, date; text tables) go to $OUT.
#   PERF_CASES="short ckpt long a14b" selects the cases (default: short ckpt long):
#     short  TI2V-5B 704x1280x17 (4,400 tokens), no ckpt, + variants (each knob off, SDPA backends)
#     ckpt   the same with activation checkpointing; the numerics also against the fp32 function (--fp32-floor)
#     long   TI2V-5B 704x1280x121 (27,280 tokens), ckpt
#     a14b   A14B high-noise expert 480x832x81 (32,760 tokens), ckpt (builds a 14B DiT: ~28 GB on disk)
source "$(dirname "$0")/setup_env.sh"
set +e  # a failing case is reported and the next one runs
CASES=${PERF_CASES:-short ckpt long}
B="python3 -m wanexp.cli.bench --json $OUT/bench.json"
t0=$(date +%s)
for c in $CASES; do
  echo "=== case $c ($(( $(date +%s) - t0 )) s in)"
  case $c in
    short) python3 tests/gpu/build_transformer.py --model ti2v5b --path "$W/ti2v5b"
           $B --model-path "$W/ti2v5b" --frames 17 --warmup 3 --steps 6 --profile plain_tokens,wanexp \
              --variants "${PERF_VARIANTS:-model.compile=false;model.fast_modulation=false;model.attention_backend=_native_cudnn;model.attention_backend=_native_flash}" ;;
    ckpt)  python3 tests/gpu/build_transformer.py --model ti2v5b --path "$W/ti2v5b"
           $B --model-path "$W/ti2v5b" --frames 17 --ckpt --warmup 3 --steps 6 --fp32-floor ${PERF_CKPT_SET:+--set $PERF_CKPT_SET} ;;
    long)  python3 tests/gpu/build_transformer.py --model ti2v5b --path "$W/ti2v5b"
           $B --model-path "$W/ti2v5b" --frames 121 --ckpt --warmup 1 --steps 3 --profile ${PERF_LONG_SET:+--set $PERF_LONG_SET} ;;
    a14b)  rm -rf "$W/ti2v5b"; python3 tests/gpu/build_transformer.py --model t2v14b --path "$W/t2v14b"
           $B --model t2v14b --model-path "$W/t2v14b" --height 480 --width 832 --frames 81 --ckpt --warmup 1 \
              --steps 2 ${PERF_A14B_SET:+--set $PERF_A14B_SET} ;;
  esac 2>&1 | grep -v -e "Loading" -e "should be kept in float32" | tee -a "$OUT/bench.txt"
  rc=${PIPESTATUS[0]}
  echo "=== case $c rc=$rc" | tee -a "$OUT/bench.txt"
  [ "$rc" = 0 ] || fail "perf case $c"
done
echo "total $(( $(date +%s) - t0 )) s"
exit $FAILED
