#!/usr/bin/env bash
# The strategy table (issues 11 and 12): `python train.py` from the latent cache with each strategy on 1, 2 and 4 GPUs
# of one host (CUDA_VISIBLE_DEVICES picks them), real-size DiTs with random weights and light encoders
# (real_sizes.yaml: *_light). One JSON row per run in $OUT/strategy.jsonl (tests/gpu/strategy_row.py), logs in $OUT.
#   STRAT_CASES selects the parts (default "5b"):
#     5b      TI2V-5B 704x1280x17 (4,400 tokens): the bench's step ("bench"), sp numerics, ddp 1/2/4, single 1, fsdp 2/4,
#             deepspeed ZeRO-2/3 2, fsdp+sp2 2, objective=dmd 1
#     a14b    I2V-A14B high-noise expert 480x832x81 (32,760 tokens): fsdp 2 (+ a resume), both experts fsdp 2
#     a14b4   the high-noise expert 480x832x81 with fsdp on 4 GPUs
#     a14b720 the high-noise expert at 720x1280x81 (75,600 tokens): fsdp+sp2 on 2 GPUs, fsdp+sp2 on 4 (dp 2)
#     a14bfull both I2V-A14B experts in one fsdp run on 2 GPUs;  dmd14  objective=dmd on the high expert, fsdp 2 GPUs
#   LOG_EVERY (default 1: a step time per step) sets trainer.log_every_n_steps; ROW_SKIP the logged rows left out.
#   STRAT_GPUS="1 2 4" limits the GPU counts (those above the machine's are skipped). A14B rows run eager
#   (A14B_COMPILE=true compiles their blocks; the compile costs a minute per run); STRAT_ONE_GPU_ALL=1 adds fsdp and
#   deepspeed on one GPU. STRAT_ONLY=REGEX runs only the runs (and sp_numerics) whose names match.
#   Runs marked "paired" go two at a time on disjoint GPUs (0.. and n..) when the machine has 2n of them, else one
#   after the other; their rows say so ("paired_with"). The scaling rows (ddp 1/2/4, the A14B 4-GPU rows) run alone.
source "$(dirname "$0")/setup_env.sh"
set +e
CASES=${STRAT_CASES:-5b}
NGPU=$(nvidia-smi -L | wc -l)
GPUS=${STRAT_GPUS:-"1 2 4"}
ONLY=${STRAT_ONLY:-.}
BASE=0
PAIRED=""

# run NAME NGPUS STEPS ARGS...: one training run; its row goes to strategy.jsonl
run() {
  local name=$1 n=$2 steps=$3; shift 3
  [[ $name =~ $ONLY ]] || return 0
  if [ $((BASE + n)) -gt "$NGPU" ] || ! [[ " $GPUS " == *" $n "* ]]; then say "skip $name ($n GPUs)"; return; fi
  local vis; vis=$(seq -s, $BASE $((BASE + n - 1)))
  say "run $name on GPU(s) $vis${PAIRED:+ (paired with $PAIRED)}"
  MASTER_PORT=$((29500 + 7 * BASE)) CUDA_VISIBLE_DEVICES=$vis timeout ${RUN_TIMEOUT:-420} python3 train.py "$@" trainer.devices=$n trainer.max_steps=$steps \
    trainer.log_every_n_steps=${LOG_EVERY:-1} callbacks.progress=null callbacks.checkpoint.every_n_train_steps=1000 \
    callbacks.validation.every_n_steps=0 paths.output_dir="$W/runs/$name" run_name=$name > "$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && { echo "--- $name failed (rc $rc)"; grep -v -e Warning -e warn "$OUT/$name.log" | tail -25; }
  python3 tests/gpu/strategy_row.py "$W/runs/$name" --name "$name" --gpus "$n" --rc $rc ${PAIRED:+--paired-with $PAIRED} \
    --skip "${ROW_SKIP:-3}" \
    "$@" | tee -a "$OUT/strategy.jsonl"
}

# pair "NAME N STEPS ARGS..." "NAME N STEPS ARGS...": two runs of N GPUs each at once on GPUs 0..N-1 and N..2N-1 when
# the machine has 2N (and both are selected), else one after the other. Arguments are split on spaces (none inside).
pair() {
  local a=($1) b=($2)
  if [ $((a[1] + b[1])) -le "$NGPU" ] && [[ ${a[0]} =~ $ONLY ]] && [[ ${b[0]} =~ $ONLY ]]; then
    PAIRED=${b[0]} run "${a[@]}" &
    BASE=${a[1]} PAIRED=${a[0]} run "${b[@]}"
    wait
  else
    run "${a[@]}"; run "${b[@]}"
  fi
}

if [[ " $CASES " == *" 5b "* ]]; then
  prepare_5b
  if [[ bench =~ $ONLY ]]; then  # issue 8: the benchmark's wanexp step on the same card, for 5b_ddp_1 (train.py)
    say "bench: wanexp step, TI2V-5B 704x1280x17, ckpt (the train.py default)"
    CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m wanexp.cli.bench --model-path "$M5" --frames 17 --ckpt --paths wanexp \
      --no-check --warmup 3 --steps 10 --json "$OUT/bench_train_path.json" > "$OUT/bench.log" 2>&1
    echo "bench rc=$?"; grep -e "wanexp bench" -e "ms" "$OUT/bench.log" | grep -v Loading | tail -6
  fi
  if [ "$NGPU" -ge 2 ] && [[ sp_numerics =~ $ONLY ]]; then
    say "sp numerics (TI2V-5B, 4,400 tokens, sp=2 vs sp=1)"
    timeout 300 torchrun --nproc_per_node 2 tests/gpu/sp_numerics.py --path "$M5" --ckpt --json "$OUT/sp_numerics.json" \
      > "$OUT/sp_numerics.log" 2>&1; echo "sp numerics rc=$?"; grep -A14 '"tokens"' "$OUT/sp_numerics.log"
  fi
  S=${STEPS5:-14}
  run 5b_ddp_1 1 $S "${D5[@]}" parallel=ddp
  run 5b_single_1 1 $S "${D5[@]}" parallel=single  # one process without the DDP wrapper
  run 5b_ddp_2 2 $S "${D5[@]}" parallel=ddp
  run 5b_ddp_4 4 $S "${D5[@]}" parallel=ddp
  # the user's logging cadence (the default 10): the gap to the bench's step without a host read every step
  LOG_EVERY=10 ROW_SKIP=1 run 5b_ddp_1_log10 1 44 "${D5[@]}" parallel=ddp
  run 5b_fsdp_4 4 $S "${D5[@]}" parallel=fsdp
  pair "5b_fsdp_2 2 $S ${D5[*]} parallel=fsdp" "5b_fsdp_sp2_2 2 $S ${D5[*]} parallel=fsdp parallel.sp_size=2"
  pair "5b_ds2_2 2 $S ${D5[*]} parallel=deepspeed parallel.strategy.stage=2" \
       "5b_ds3_2 2 $S ${D5[*]} parallel=deepspeed parallel.strategy.stage=3 model.compile=false"
  # objective=dmd with the blocks compiled (the default): generator, critic and teacher calls on one compiled base
  run 5b_dmd_1 1 12 "${D5[@]}" parallel=ddp objective=dmd
  if [ -n "${STRAT_ONE_GPU_ALL:-}" ]; then
    pair "5b_fsdp_1 1 $S ${D5[*]} parallel=fsdp" "5b_ds2_1 1 $S ${D5[*]} parallel=deepspeed parallel.strategy.stage=2"
    run 5b_ds3_1 1 $S "${D5[@]}" parallel=deepspeed parallel.strategy.stage=3 model.compile=false
  fi
fi

if [[ " $CASES " == *" a14b"* || " $CASES " == *" dmd14 "* ]]; then
  M14="$W/i2v14b_light"
  # disk: the two 14B experts are ~57 GB; a 64 GB-disk machine needs the 5B model's room
  [ "$(df -Pk "$W" | awk 'NR==2 {print int($4 / 1048576)}')" -lt 120 ] && rm -rf "$W/ti2v5b_light"
  python3 tests/gpu/build_random_model.py --model i2v14b --entry i2v14b_light --path "$M14" 2>&1 | grep -v "should be kept" | tail -1
fi
A=(model=i2v14b model.path="$W/i2v14b_light" data=synthetic data.batch_size=1 data.num_workers=2 paths.cache_dir="$W/cache"
   data.generate.num_frames=81 data.generate.num_images=0 trainer.precision=bf16-mixed model.compile=${A14B_COMPILE:-false})
A4=("${A[@]}" paths.data_dir="$W/data14" data.height=480 data.width=832 data.num_frames=81 data.generate.height=480
    data.generate.width=832 data.generate.num_videos=8)
if [[ " $CASES " =~ " "(a14b|a14b4|a14bfull|dmd14)" " ]]; then  # the 480p cache (entries already there are kept)
  python3 -m wanexp.cli.cache "${A4[@]}" boundary=high paths.output_dir="$W/cache_run14" > "$OUT/cache14.log" 2>&1 \
    || { tail -20 "$OUT/cache14.log"; }
  say "cache: $(grep 'wanexp: cache' "$OUT/cache14.log" | tail -1)"
fi
if [[ " $CASES " == *" a14b "* ]]; then
  run a14b_high_fsdp_2 2 4 "${A4[@]}" boundary=high parallel=fsdp callbacks.checkpoint.every_n_train_steps=2
  say "resume a14b_high_fsdp_2 from its last checkpoint for one more step"
  CUDA_VISIBLE_DEVICES=0,1 timeout 420 python3 train.py "${A4[@]}" boundary=high parallel=fsdp trainer.devices=2 \
    trainer.max_steps=5 trainer.log_every_n_steps=1 callbacks.progress=null callbacks.validation.every_n_steps=0 resume=last allow_resume_changes=true \
    paths.output_dir="$W/runs/a14b_high_fsdp_2" run_name=a14b_high_fsdp_2 > "$OUT/a14b_resume.log" 2>&1
  echo "resume rc=$?"; grep "^wanexp:" "$OUT/a14b_resume.log" | tail -4
  python3 tests/gpu/strategy_row.py "$W/runs/a14b_high_fsdp_2" --name a14b_high_fsdp_2_resumed --gpus 2 --rc 0 | tee -a "$OUT/strategy.jsonl"
fi
FULL="a14b_full_fsdp_2 2 4 ${A4[*]} boundary=full parallel=fsdp"
# issue 9: DMD (gen + critic adapters on one base) on one A14B expert, FSDP 2 GPUs: 5 critic steps, then the generator's
DMD="a14b_high_dmd_fsdp_2 2 6 ${A4[*]} boundary=high parallel=fsdp objective=dmd"
if [[ " $CASES " == *" a14bfull "* && " $CASES " == *" dmd14 "* ]]; then
  pair "$FULL" "$DMD"
else
  [[ " $CASES " == *" a14bfull "* ]] && run $FULL
  [[ " $CASES " == *" dmd14 "* ]] && run $DMD
fi
if [[ " $CASES " == *" a14b4 "* ]]; then
  run a14b_high_fsdp_4 4 4 "${A4[@]}" boundary=high parallel=fsdp
fi
if [[ " $CASES " == *" a14b720 "* ]]; then
  A7=("${A[@]}" paths.data_dir="$W/data14_720" data.height=720 data.width=1280 data.num_frames=81 data.generate.height=720
      data.generate.width=1280 data.generate.num_videos=4)
  python3 -m wanexp.cli.cache "${A7[@]}" boundary=high paths.output_dir="$W/cache_run720" > "$OUT/cache720.log" 2>&1 \
    || { tail -20 "$OUT/cache720.log"; }
  run a14b720_high_fsdp_sp2_2 2 3 "${A7[@]}" boundary=high parallel=fsdp parallel.sp_size=2
  run a14b720_high_fsdp_sp2_4 4 3 "${A7[@]}" boundary=high parallel=fsdp parallel.sp_size=2
fi
say "done"
