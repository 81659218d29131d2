#!/usr/bin/env bash
# Two-GPU checks (device kind nvidia-h100-x2): DDP and FSDP2 through `python train.py`, on the tiny model with bf16
# base weights and on a real-size TI2V-5B (random weights) at 704x1280x17. Results go to $OUT.
source "$(dirname "$0")/setup_env.sh"

for P in ddp fsdp; do
  python3 train.py experiment=demo parallel=$P trainer.accelerator=gpu trainer.devices=2 trainer.precision=bf16-mixed \
    model.dtype=bf16 trainer.max_steps=4 trainer.log_every_n_steps=1 callbacks.checkpoint.every_n_train_steps=2 callbacks.progress=null \
    paths.tiny_model_dir="$W/tiny_models" paths.data_dir="$W/data_tiny" paths.output_dir="$W/tiny_$P" run_name=tiny-$P \
    > "$OUT/tiny_$P.log" 2>&1 || { tail -40 "$OUT/tiny_$P.log"; exit 1; }
  python3 tests/gpu/summarize_run.py "$W/tiny_$P" > "$OUT/tiny_$P.json"
  python3 -c "import json; d=json.load(open('$OUT/tiny_$P.json')); print('tiny $P steps', d['steps'], 'finite', d['all_finite'], 'world', d['status']['world_size'], 'files', len(d['lora_files']), 'in_sync', d['status'].get('replicas_in_sync'))"
done
python3 tests/gpu/compare_lora.py "$W/tiny_ddp/lora/final" "$W/tiny_fsdp/lora/final" | tee "$OUT/lora_compare.txt"

python3 tests/gpu/build_random_model.py --model ti2v5b --path "$W/ti2v5b" 2>&1 | grep -v "should be kept" | tail -1
for P in ddp fsdp; do
  python3 train.py model=ti2v5b model.path="$W/ti2v5b" data=synthetic paths.data_dir="$W/data" \
    data.height=704 data.width=1280 data.num_frames=17 data.batch_size=1 data.num_workers=2 \
    data.generate.height=704 data.generate.width=1280 data.generate.num_videos=8 data.generate.num_images=0 \
    parallel=$P trainer.devices=2 trainer.precision=bf16-mixed trainer.max_steps=6 trainer.log_every_n_steps=1 \
    callbacks.checkpoint.every_n_train_steps=3 callbacks.progress=null paths.output_dir="$W/run5b_$P" run_name=ti2v5b-$P \
    > "$OUT/ti2v5b_$P.log" 2>&1 || { tail -40 "$OUT/ti2v5b_$P.log"; exit 1; }
  python3 tests/gpu/summarize_run.py "$W/run5b_$P" > "$OUT/ti2v5b_$P.json"
  python3 -c "import json; d=json.load(open('$OUT/ti2v5b_$P.json')); print('5B $P steps', d['steps'], 'finite', d['all_finite'], 'median s', d['median_step_s_after_warmup'], 'peak GiB', d['peak_mem_gib'], 'files', len(d['lora_files']), 'in_sync', d['status'].get('replicas_in_sync'), 'tflops', d.get('tflops'))"
done
