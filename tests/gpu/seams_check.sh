#!/usr/bin/env bash
# Device check of the component seams (device kind nvidia-h100-x2): the tiny model through `python train.py` on one GPU
# and with DDP and FSDP2 on two, bf16 base weights, bf16-mixed. Checks that the strategies build from their _target_,
# that AdamW runs fused on GPU parameters (status.json), and that DDP and FSDP2 export the same LoRA tensors.
source "$(dirname "$0")/setup_env.sh"
common=(experiment=demo trainer.accelerator=gpu trainer.precision=bf16-mixed model.dtype=bf16 trainer.max_steps=4
        trainer.log_every_n_steps=1 callbacks.checkpoint.every_n_train_steps=2 callbacks.progress=null
        paths.tiny_model_dir="$W/tiny_models" paths.data_dir="$W/data_tiny")
python3 train.py "${common[@]}" parallel=single trainer.devices=1 paths.output_dir="$W/tiny_single" run_name=tiny-single \
  > "$OUT/tiny_single.log" 2>&1 || { tail -40 "$OUT/tiny_single.log"; exit 1; }
for P in ddp fsdp; do
  python3 train.py "${common[@]}" parallel=$P trainer.devices=2 paths.output_dir="$W/tiny_$P" run_name=tiny-$P \
    > "$OUT/tiny_$P.log" 2>&1 || { tail -40 "$OUT/tiny_$P.log"; exit 1; }
done
for P in single ddp fsdp; do
  python3 tests/gpu/summarize_run.py "$W/tiny_$P" > "$OUT/tiny_$P.json"
  python3 -c "import json; d=json.load(open('$OUT/tiny_$P.json')); s=d['status']; print('tiny $P: steps', d['steps'], 'finite', d['all_finite'], 'world', s['world_size'], 'optimizer', s.get('optimizer'), 'lora files', len(d['lora_files']), 'in_sync', s.get('replicas_in_sync'))"
done
python3 tests/gpu/compare_lora.py "$W/tiny_ddp/lora/final" "$W/tiny_fsdp/lora/final" | tee "$OUT/lora_compare.txt"
python3 -c "import torch, functools; from wanexp.optim import build_optimizer; p=torch.nn.Parameter(torch.zeros(3, device='cuda')); print('fused on cuda:', build_optimizer(functools.partial(torch.optim.AdamW, fused=None), [p], 1e-3).defaults['fused'])"
