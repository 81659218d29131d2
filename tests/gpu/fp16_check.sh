#!/usr/bin/env bash
# One-GPU device call: the pre-Ampere path (16-mixed, fp16 base weights, grad scaler, fused AdamW, clipping) on the
# tiny model through python train.py, and DMD's step time/memory on a real-size TI2V-5B DiT with activation
# checkpointing (the default). Results go to $OUT.
source "$(dirname "$0")/setup_env.sh"
set +e
T="python3 train.py experiment=demo paths.tiny_model_dir=$W/models paths.data_dir=$W/data trainer.accelerator=gpu \
   callbacks.progress=null trainer.log_every_n_steps=1 data.use_cache=false trainer.devices=1 parallel=single"
$T trainer.precision=16-mixed model.dtype=fp16 trainer.max_steps=8 paths.output_dir=$W/fp16 2>&1 | grep -v Loading \
   | tail -5 | tee "$OUT/fp16.txt"
python3 tests/gpu/summarize_run.py "$W/fp16" | tee -a "$OUT/fp16.txt"
python3 tests/gpu/build_transformer.py --model ti2v5b --path "$W/ti2v5b"
python3 tests/gpu/dmd_step.py --model-path "$W/ti2v5b" --ckpt --skip-dtype --json "$OUT/dmd_5b_ckpt.json" 2>&1 \
   | grep -v Loading | tail -12 | tee "$OUT/dmd_5b_ckpt.txt"
