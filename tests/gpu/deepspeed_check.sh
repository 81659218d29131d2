#!/usr/bin/env bash
# DeepSpeed ZeRO checks through `python train.py` (device kind nvidia-h100-x2 or larger; the deepspeed wheel and its
# dependencies come from .whl/, built with DS_BUILD_OPS=0: no op is compiled). Results go to $OUT.
#   tiny   the tiny model, bf16 weights, bf16-mixed, clipping on, 2 GPUs: ZeRO-2, ZeRO-3 and ZeRO-2 with the optimizer
#          offloaded, 4 steps each (checkpoint + LoRA export at 2 and 4), then resume=last to step 6; ZeRO-2 vs DDP LoRA
#   5b     a real-size TI2V-5B (random weights) at 704x1280x17, ZeRO-2 and ZeRO-3 on 1 and 2 GPUs, 6 steps each
# DS_CASES="tiny 5b" (default) picks the groups; DS_5B="2:1 2:2 3:1 3:2" picks stage:GPUs of the 5B runs;
# DS_EXTRA="key=value ..." is added to every 5B run (e.g. model.compile=false).
# A failing case prints its log tail; the next case still runs. The exit code is the number of failed cases.
source "$(dirname "$0")/setup_env.sh"
set +e +o pipefail
CASES=${DS_CASES:-tiny 5b}
NGPU=$(nvidia-smi -L | wc -l)
FAILED=0
python3 -c "import deepspeed, sys; print('deepspeed', deepspeed.__version__)" 2>&1 | grep -v WARNING | tee -a "$OUT/gpu.txt"

run_case() {  # NAME, then train.py overrides
  local name=$1; shift
  local t0=$SECONDS
  python3 train.py "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc, $((SECONDS - t0)) s" | tee -a "$OUT/cases.txt"
  if [ $rc -ne 0 ]; then
    tail -40 "$OUT/$name.log"; FAILED=$((FAILED + 1)); return 1
  fi
}

summarize() {  # NAME RUN_DIR
  python3 tests/gpu/summarize_run.py "$2" > "$OUT/$1.json" 2>/dev/null || { echo "$1: no summary"; return 1; }
  python3 - "$OUT/$1.json" "$1" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1])); s = d["status"]
print(f"{sys.argv[2]}: steps {d['steps']} finite {d['all_finite']} median s/step {d['median_step_s_after_warmup']} "
      f"peak GiB {d['peak_mem_gib']} world {s.get('world_size')} optimizer {s.get('optimizer')} "
      f"LoRA files {len(d['lora_files'])} loss {[round(x, 4) for x in d['losses']]}")
EOF
}

if [[ " $CASES " == *" tiny "* ]]; then
  if [ "$NGPU" -lt 2 ]; then echo "tiny: needs 2 GPUs, found $NGPU; skipped"; else
  TINY=(experiment=demo trainer.accelerator=gpu trainer.devices=2 trainer.precision=bf16-mixed model.dtype=bf16
        trainer.gradient_clip_val=1.0 trainer.log_every_n_steps=1 callbacks.checkpoint.every_n_train_steps=2
        callbacks.progress=null optim.scheduler=constant paths.tiny_model_dir="$W/tiny_models"
        paths.data_dir="$W/data_tiny")
  run_case tiny_ddp "${TINY[@]}" parallel=ddp trainer.max_steps=4 paths.output_dir="$W/ds_tiny_ddp" run_name=tiny-ddp
  for C in "zero2 parallel.strategy.stage=2" "zero3 parallel.strategy.stage=3" \
           "zero2_offload parallel.strategy.stage=2 parallel.strategy.offload_optimizer=true"; do
    set -- $C; N=$1; shift
    D="$W/ds_tiny_$N"
    run_case tiny_$N "${TINY[@]}" parallel=deepspeed "$@" trainer.max_steps=4 paths.output_dir="$D" run_name=tiny-$N \
      && summarize tiny_$N "$D" && ls -la "$D/checkpoints" > "$OUT/tiny_${N}_checkpoints.txt" \
      && run_case tiny_${N}_resume "${TINY[@]}" parallel=deepspeed "$@" trainer.max_steps=6 resume=last \
           paths.output_dir="$D" run_name=tiny-$N \
      && grep -h "Restored all states\|finished" "$OUT/tiny_${N}_resume.log" | tail -2 && summarize tiny_${N}_resume "$D"
  done
  # the same steps under DDP and ZeRO-2 (step 4 of each): the LoRA files should hold nearly the same tensors
  [ -d "$W/ds_tiny_ddp/lora/step_000004" ] && [ -d "$W/ds_tiny_zero2/lora/step_000004" ] && \
    python3 tests/gpu/compare_lora.py "$W/ds_tiny_ddp/lora/step_000004" "$W/ds_tiny_zero2/lora/step_000004" \
      2>&1 | tee "$OUT/tiny_lora_ddp_vs_zero2.txt"
  fi
fi

if [[ " $CASES " == *" 5b "* ]]; then
  [ -f "$W/ti2v5b/model_index.json" ] || python3 tests/gpu/build_random_model.py --model ti2v5b --path "$W/ti2v5b" \
    2>&1 | grep -v "should be kept" | tail -1
  for SG in ${DS_5B:-2:1 2:2 3:1 3:2}; do
    S=${SG%%:*}; G=${SG##*:}
    if [ "$G" -gt "$NGPU" ]; then echo "5b zero$S x$G: only $NGPU GPU(s); skipped"; continue; fi
    D="$W/ds5b_zero${S}_x$G"
    NOCOMPILE=""; [ "$S" = 3 ] && NOCOMPILE=model.compile=false  # ZeRO-3 refuses compiled blocks (config rule)
    run_case ti2v5b_zero${S}_x$G model=ti2v5b model.path="$W/ti2v5b" data=synthetic paths.data_dir="$W/data" \
      data.height=704 data.width=1280 data.num_frames=17 data.batch_size=1 data.num_workers=2 \
      data.generate.height=704 data.generate.width=1280 data.generate.num_videos=8 data.generate.num_images=0 \
      parallel=deepspeed parallel.strategy.stage=$S trainer.devices=$G trainer.precision=bf16-mixed \
      trainer.max_steps=6 trainer.log_every_n_steps=1 callbacks.checkpoint.every_n_train_steps=3 \
      callbacks.validation.every_n_steps=0 callbacks.progress=null paths.output_dir="$D" run_name=ds5b-zero$S-x$G \
      overwrite=true $NOCOMPILE $DS_EXTRA && summarize ti2v5b_zero${S}_x$G "$D"
  done
fi
echo "failed cases: $FAILED" | tee -a "$OUT/cases.txt"
exit $FAILED
