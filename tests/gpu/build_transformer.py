"""Build only the DiT of a real-size Wan2.2 layout with random weights (bf16, on the GPU) into DIR/transformer.

Enough for `python -m wanexp.cli.bench` (it loads transformer/ only) and much faster than a whole pipeline folder
(no UMT5-XXL, no VAE). Device machine only; throughput does not depend on weight values.

    python tests/gpu/build_transformer.py --model ti2v5b --path /tmp/wan/ti2v5b
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

# The real architectures (diffusers config of transformer/; A14B: each expert has this shape)
SIZES = {
    "ti2v5b": dict(num_attention_heads=24, attention_head_dim=128, ffn_dim=14336, num_layers=30, in_channels=48,
                   out_channels=48),
    "t2v14b": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40, in_channels=16,
                   out_channels=16),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="ti2v5b", choices=list(SIZES))
    ap.add_argument("--path", required=True)
    args = ap.parse_args()
    from diffusers import WanTransformer3DModel

    out = Path(args.path) / "transformer"
    if (out / "config.json").is_file():
        print(f"{out} exists")
        return
    t0 = time.time()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = WanTransformer3DModel(**SIZES[args.model], text_dim=4096, freq_dim=256, patch_size=(1, 2, 2))
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(out, max_shard_size="20GB")
    (Path(args.path) / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    n = sum(p.numel() for p in model.parameters())
    print(f"built {args.model} DiT ({n / 1e9:.2f} B parameters) into {out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
