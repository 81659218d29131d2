#!/usr/bin/env bash
# Issue 8's open gap, one GPU, one call (~9 minutes): `python train.py` from the cache is 12-21 % slower than the
# benchmark's step with the same GPU work (README, "The path users run"). A/B runs of the training loop's host
# settings, each timed by tests.helpers.StepTimer over steps 31-39 (no log step; GPU synchronized at both ends, no
# profiler), the benchmark's step on the same card, then the default run under py-spy (tests/gpu/spy_summary.py sums it).
#   A default (parallel=single, log every 10)       B without expandable_segments (parallel.env={})
#   C data.num_workers=0 (no loader processes, no pin-memory thread)
#   D every callback off (status, checkpoint, LoRA export, validation, preemption, progress)
# Every item has its own time limit (what is left before DEADLINE s). Logs and results in $OUT.
source "$(dirname "$0")/setup_env.sh"
set +e
prepare_5b 12
CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 -m wanexp.cli.bench --model-path "$M5" --frames 17 --ckpt --paths wanexp \
  --no-check --warmup 3 --steps 10 --json "$OUT/bench.json" 2>&1 | grep -v -e Loading -e "kept in float32" | tail -3
RUN=(python3 train.py "${D5[@]}" parallel=single trainer.devices=1 trainer.max_steps=40 trainer.log_every_n_steps=10
     callbacks.progress=null callbacks.checkpoint.every_n_train_steps=1000 callbacks.validation.every_n_steps=0
     +callbacks.timer._target_=tests.helpers.StepTimer +callbacks.timer.start=30 +callbacks.timer.steps=9)
ab() {  # ab NAME OVERRIDES...
  local name=$1; shift
  CUDA_VISIBLE_DEVICES=0 timeout "$(left)" "${RUN[@]}" paths.output_dir="$W/runs/$name" run_name=$name "$@" \
    > "$OUT/$name.log" 2>&1
  say "$name (rc $?): $(grep wanexp-timer "$OUT/$name.log")"
}
ab A_default
ab B_no_expandable 'parallel.env={}'
ab C_no_workers data.num_workers=0
ab D_no_callbacks callbacks.status=null callbacks.checkpoint=null callbacks.lora_export=null callbacks.validation=null \
  callbacks.preemption=null
say "py-spy: the default run"
SPY=/tmp/site/bin/py-spy
CUDA_VISIBLE_DEVICES=0 timeout "$(left)" $SPY record --native --idle --threads -r 50 -f raw -o "$OUT/spy.txt" -- \
  "${RUN[@]}" paths.output_dir="$W/runs/spy" run_name=spy > "$OUT/spy_run.log" 2>&1
say "py-spy rc=$?: $(grep wanexp-timer "$OUT/spy_run.log")"
[ -s "$OUT/spy.txt" ] && python3 tests/gpu/spy_summary.py "$OUT/spy.txt" | tee "$OUT/spy_summary.txt" | head -60
say done
