"""Build a real-size Wan2.2 model with random weights into a local diffusers folder (device machine only).

No weights can be downloaded there; throughput does not depend on weight values. The folder is then loaded through
`model.path` exactly like a real checkpoint.

    python tests/gpu/build_random_model.py --model ti2v5b --path /tmp/wan/ti2v5b
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import yaml

from wanexp.models.tiny import ensure_tiny_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="ti2v5b")
    ap.add_argument("--path", required=True)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--sizes", default=str(Path(__file__).with_name("real_sizes.yaml")), help="YAML of build sections")
    ap.add_argument("--entry", default=None, help="the build section's name in --sizes (default: --model)")
    args = ap.parse_args()
    from omegaconf import open_dict

    from wanexp.config import compose
    from wanexp.composition import build

    sizes = yaml.safe_load(Path(args.sizes).read_text())[args.entry or args.model]
    cfg = compose([f"model={args.model}", f"model.path={args.path}"])
    with open_dict(cfg):
        cfg.model.build = sizes
    spec = build(cfg.model)
    t0 = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.set_default_dtype(dtype)  # created in the target dtype: two 14B experts in fp32 would not fit one GPU
    try:
        ensure_tiny_model(spec, device=device, dtype=dtype)
    finally:
        torch.set_default_dtype(torch.float32)
    size = sum(f.stat().st_size for f in Path(args.path).rglob("*") if f.is_file()) / 2**30
    print(f"built {args.model} at {args.path}: {size:.1f} GiB in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
