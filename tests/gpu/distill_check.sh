#!/usr/bin/env bash
# One two-GPU device call for the distillation and precision paths (issues 8 and 9). Results go to $OUT.
#   1. tiny model under FSDP2 on 2 GPUs with the blocks compiled (model.compile=true) through python train.py
#   2. tiny model, 16-mixed with fp16 base weights (grad scaler, fused AdamW, clipping) on 1 GPU
#   3. tiny model, objective=dmd through python train.py on 1 GPU (two fused optimizers, manual optimization)
#   4. real-size TI2V-5B DiT (random weights): DMD generator/critic step time and peak memory at 704x1280x17,
#      and the fp16/bf16 forward error against fp32; then the DMD step with activation checkpointing
source "$(dirname "$0")/setup_env.sh"
set +e
T="python3 train.py experiment=demo paths.tiny_model_dir=$W/models paths.data_dir=$W/data trainer.accelerator=gpu \
   callbacks.progress=null trainer.log_every_n_steps=1 data.use_cache=false"
t0=$(date +%s)
echo "=== fsdp+compile ($(( $(date +%s) - t0 )) s)"
$T trainer.devices=2 parallel=fsdp model.compile=true model.dtype=bf16 trainer.precision=bf16-mixed \
   trainer.max_steps=4 paths.output_dir=$W/fsdp 2>&1 | grep -v Loading | tail -6 | tee "$OUT/fsdp_compile.txt" \
  || fail "fsdp+compile"
python3 tests/gpu/summarize_run.py "$W/fsdp" | tee -a "$OUT/fsdp_compile.txt"
echo "=== fp16 ($(( $(date +%s) - t0 )) s)"
CUDA_VISIBLE_DEVICES=0 $T trainer.devices=1 parallel=single trainer.precision=16-mixed model.dtype=fp16 \
   trainer.max_steps=8 paths.output_dir=$W/fp16 2>&1 | grep -v Loading | tail -5 | tee "$OUT/fp16.txt" || fail fp16
python3 tests/gpu/summarize_run.py "$W/fp16" | tee -a "$OUT/fp16.txt"
echo "=== dmd tiny ($(( $(date +%s) - t0 )) s)"
CUDA_VISIBLE_DEVICES=0 $T trainer.devices=1 parallel=single objective=dmd model.dtype=bf16 \
   trainer.precision=bf16-mixed trainer.max_steps=12 paths.output_dir=$W/dmd 2>&1 | grep -v Loading | tail -5 \
   | tee "$OUT/dmd_tiny.txt" || fail "dmd tiny"
python3 tests/gpu/summarize_run.py "$W/dmd" | tee -a "$OUT/dmd_tiny.txt"
echo "=== dmd 5B ($(( $(date +%s) - t0 )) s)"
CUDA_VISIBLE_DEVICES=0 python3 tests/gpu/build_transformer.py --model ti2v5b --path "$W/ti2v5b"
CUDA_VISIBLE_DEVICES=0 python3 tests/gpu/dmd_step.py --model-path "$W/ti2v5b" --json "$OUT/dmd_5b.json" 2>&1 \
   | grep -v Loading | tail -40 | tee "$OUT/dmd_5b.txt" || fail "dmd 5B"
# with activation checkpointing (the training default); the dtype errors were measured above
CUDA_VISIBLE_DEVICES=0 python3 tests/gpu/dmd_step.py --model-path "$W/ti2v5b" --ckpt --skip-dtype \
   --json "$OUT/dmd_5b_ckpt.json" 2>&1 | grep -v Loading | tail -12 | tee "$OUT/dmd_5b_ckpt.txt" || fail "dmd 5B ckpt"
echo "=== done ($(( $(date +%s) - t0 )) s)"
exit $FAILED
