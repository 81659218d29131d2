"""Convert an ORIGINAL Wan-AI Wan2.2 download (as used by DiffSynth-Studio) into a diffusers-format folder, once.

    python -m wanexp.cli.convert --src /models/Wan2.2-TI2V-5B --dst /models/Wan2.2-TI2V-5B-diffusers --model ti2v5b
    python -m wanexp.cli.convert --src /models/Wan2.2-T2V-A14B --dst /models/Wan2.2-T2V-A14B-diffusers --model t2v14b
    python -m wanexp.cli.convert --src /models/Wan2.2-VACE-Fun-A14B --dst /models/Wan2.2-VACE-Fun-A14B-Diffusers \
        --model vace14b

Then set ``model.path`` to the --dst folder. Needs RAM for the largest component (a 14B expert in bf16: ~29 GB) and
disk for a full copy of the weights. See wanexp/models/wan22/original.py for where each name mapping comes from.
"""
from __future__ import annotations

import argparse
import sys

from wanexp.errors import ConfigError, say_error


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m wanexp.cli.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("--src", required=True, help="original Wan-AI folder (config.json / high_noise_model/, *.pth, "
                                                "google/umt5-xxl/)")
    p.add_argument("--dst", required=True, help="diffusers-format folder to create (must not exist or be empty)")
    p.add_argument("--model", required=True, help="the model group (conf/model) --src holds, e.g. ti2v5b, t2v14b, "
                                                  "i2v14b")
    p.add_argument("--from", dest="source", default="original",
                   help="the layout of --src, one the model's family converts (default: original)")
    p.add_argument("--vae-config", default=None,
                   help="optional diffusers VAE config.json (or its folder) whose latent normalisation to use "
                        "instead of the constants of the original release's code")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size of the written weights")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from wanexp.models.family import spec_class

        lines = spec_class(args.model, "--model").convert(args.source, args.src, args.dst,
                                                          vae_config=args.vae_config,
                                                          max_shard_size=args.max_shard_size)
    except ConfigError as e:
        say_error(str(e))
        return 2
    print(f"wrote {args.dst} (diffusers format, --model {args.model}):")
    for line in lines:
        print(f"  {line}")
    print(f"now set model.path={args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
