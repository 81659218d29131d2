#!/usr/bin/env bash
# One device-machine call that checks and times the foundation on a real-size TI2V-5B (random weights):
#   1. build the real architecture into a local diffusers folder,
#   2. bench: plain diffusers+peft LoRA step vs wanexp's module step (no ckpt, ckpt), same card,
#   3. a few steps of `python train.py` at 704x1280x17 bf16 through the normal path (VAE + UMT5 + LoRA export).
# Run from the repo root on the device with the wheels in .whl (see README "GPU checks"). Results go to $OUT.
source "$(dirname "$0")/setup_env.sh"

python3 tests/gpu/build_random_model.py --model ti2v5b --path "$W/ti2v5b" 2>&1 | grep -v "should be kept in float32" | tee "$OUT/build.txt"

python3 -m wanexp.cli.bench --model-path "$W/ti2v5b" --json "$OUT/bench.json" 2>&1 | grep -v Loading | tee "$OUT/bench.txt"
python3 -m wanexp.cli.bench --model-path "$W/ti2v5b" --ckpt --json "$OUT/bench.json" 2>&1 | grep -v Loading | tee -a "$OUT/bench.txt"

python3 train.py model=ti2v5b model.path="$W/ti2v5b" data=synthetic paths.data_dir="$W/data" \
  data.height=704 data.width=1280 data.num_frames=17 data.batch_size=1 data.num_workers=2 \
  data.generate.height=704 data.generate.width=1280 data.generate.num_videos=6 data.generate.num_images=0 \
  parallel=single trainer.devices=1 trainer.precision=bf16-mixed trainer.max_steps=8 trainer.log_every_n_steps=1 \
  callbacks.checkpoint.every_n_train_steps=4 model.first_frame_cond=0.5 callbacks.progress=null \
  paths.output_dir="$W/run" run_name=gpu-ti2v5b 2>&1 | grep -v "Loading weights" | tail -20 | tee "$OUT/train_tail.txt"
python3 tests/gpu/summarize_run.py "$W/run" | tee "$OUT/train_summary.json"
