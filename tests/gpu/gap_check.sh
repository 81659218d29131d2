#!/usr/bin/env bash
# Issue 8's gap, one GPU, one call (~6 minutes; more with GAP_HOST=1 or GAP_PROBE=1): is `python train.py` from the
# cache slower than the benchmark's step, and where does the difference come from?
#  1. (GAP_HOST=1) Host time per step: the 5B's depth and LoRA layout at tiny widths and a tiny shape (real_sizes.yaml
#     host30), where the GPU's kernels take microseconds and a step's wall time is the host's time to issue it: the
#     bench's step vs train.py's step (Lightning, loader, callbacks), loader processes on and off.
#  2. The real-size 5B at 704x1280x17 (ckpt, compiled, 48 clips: no epoch boundary in steps 21-40): the user's
#     default train.py run (DDP) over steps 21-40, the bench's step (synchronized each step, and back to back; numerics
#     against the plain loop) with model.compile_checkpoint on (default) and off; GAP_PROBE=1: tests/gpu/gap_probe.py,
#     train.py's path and loops without Lightning on the same module in one process (its docstring lists them).
#  3. (GAP_BUDGET=1, default) model.memory_budget_gib=30 at 27,280 tokens with the process capped at 30 GiB.
# train.py windows are timed by tests.helpers.StepTimer (GPU synchronized at both ends, no profiler).
source "$(dirname "$0")/setup_env.sh"
set +e
COMMON=(trainer.devices=1 trainer.log_every_n_steps=10 callbacks.progress=null
        callbacks.checkpoint.every_n_train_steps=1000 callbacks.validation.every_n_steps=0
        +callbacks.timer._target_=tests.helpers.StepTimer +callbacks.timer.start=20 +callbacks.timer.steps=20
        trainer.max_steps=41)
if [ "${GAP_HOST:-0}" = 1 ]; then
say "1. host time per step (host30: 30 blocks, tiny widths, 64x64x5)"
MH="$W/host30"
python3 tests/gpu/build_random_model.py --model ti2v5b --entry host30 --path "$MH" --dtype fp32 2>&1 | tail -1
DH=(model=ti2v5b model.path="$MH" data=synthetic paths.data_dir="$W/datah" data.height=64 data.width=64
    data.num_frames=5 data.batch_size=1 data.num_workers=4 data.generate.height=64 data.generate.width=64
    data.generate.num_frames=5 data.generate.num_videos=48 data.generate.num_images=0 paths.cache_dir="$W/cacheh"
    trainer.precision=bf16-mixed)
python3 -m wanexp.cli.cache "${DH[@]}" paths.output_dir="$W/cache_runh" > "$OUT/cacheh.log" 2>&1 || tail -5 "$OUT/cacheh.log"
CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 -m wanexp.cli.bench --model-path "$MH" --height 64 --width 64 \
  --frames 5 --text-len 64 --ckpt --paths wanexp --no-check --warmup 5 --steps 20 --json "$OUT/bench_host.json" 2>&1 \
  | grep -v -e Loading -e "kept in float32" | tail -2
ab() {  # ab NAME DATA_OVERRIDES_ARRAY_NAME OVERRIDES...
  local name=$1; local -n data=$2; shift 2
  CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 train.py "${data[@]}" "${COMMON[@]}" paths.output_dir="$W/runs/$name" \
    run_name=$name "$@" > "$OUT/$name.log" 2>&1
  say "$name (rc $?): $(grep wanexp-timer "$OUT/$name.log")"
}
ab host_train DH parallel=single
ab host_train_no_workers DH parallel=single data.num_workers=0
fi
say "2. real-size 5B 704x1280x17"
prepare_5b 48
# the user's default run (parallel=ddp) from the cache, steps 21-40 (log steps 30 and 40 included)
CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 train.py "${D5[@]}" "${COMMON[@]}" parallel=ddp \
  paths.output_dir="$W/runs/train_ddp" run_name=train_ddp > "$OUT/train_ddp.log" 2>&1
rc=$?; [ $rc = 0 ] || fail "train.py ddp"
say "train.py ddp (rc $rc): $(grep wanexp-timer "$OUT/train_ddp.log")"; grep -e Error -e "^wanexp: LoRA" "$OUT/train_ddp.log" | tail -3
# the bench's step (numerics checked against the plain per-token loop), and with the eager checkpoint
CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 -m wanexp.cli.bench --model-path "$M5" --frames 17 --ckpt --paths wanexp \
  --variants model.compile_checkpoint=false --warmup 3 --steps 10 --json "$OUT/bench_5b.json" 2>&1 \
  | grep -v -e Loading -e "kept in float32" | tail -9 || fail "bench 5b"
if [ "${GAP_PROBE:-0}" = 1 ]; then  # train.py's path and loops without Lightning in one process
  CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 tests/gpu/gap_probe.py "${D5[@]}" parallel=single trainer.devices=1 \
    paths.output_dir="$W/runs/probe" run_name=probe > "$OUT/probe.log" 2>&1
  say "gap_probe rc=$?"; grep -e "^probe:" -e Error "$OUT/probe.log"
fi
if [ "${GAP_BUDGET:-1}" = 1 ]; then  # 27,280 tokens, the process capped at 30 GiB: the budget's blocks, checkpointed
  say "3. model.memory_budget_gib=30 at 27,280 tokens, capped at 30 GiB"
  CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 tests/gpu/capped.py 30 wanexp.cli.bench --model-path "$M5" \
    --ckpt --paths wanexp --no-check --frames 121 --warmup 1 --steps 3 --variants "model.memory_budget_gib=30" \
    --json "$OUT/budget.json" 2>&1 | grep -v -e Loading -e "kept in float32" | tail -4 || fail "budget 27,280 tokens"
fi
say done
exit $FAILED
