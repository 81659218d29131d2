"""The latents of caches written with other ``model.vae_dtype`` values against a reference cache of the same clips.

    python tests/gpu/compare_caches.py REF_DIR NAME=DIR [NAME=DIR ...]

The caches hold the same clips; their latent entries pair by the clip each index line names (``media`` and the
window's ``start``; the keys differ, the VAE's dtype being part of each). Prints one line per cache: the relative error
(||x - ref|| / ||ref|| over every latent) and the worst clip's, and how many values are not finite (fp16 overflow).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from wanexp.data.cache import CacheIndex


def latents(folder: Path) -> dict[tuple, torch.Tensor]:
    index = CacheIndex(folder)
    return {(e["media"], e["start"]): index.load(k)["latents"].float() for k, e in index.entries.items()
            if "latents" in e["tensors"]}


def compare(ref: dict[tuple, torch.Tensor], other: dict[tuple, torch.Tensor]) -> dict:
    if ref.keys() != other.keys() or any(ref[c].shape != other[c].shape for c in ref):
        raise SystemExit(f"the caches do not hold the same clips ({len(ref)} against {len(other)} latents)")
    pairs = [(ref[c], other[c]) for c in sorted(ref)]
    finite = sum(int((~torch.isfinite(b)).sum()) for _, b in pairs)
    diff = sum(float(((b - a).nan_to_num() ** 2).sum()) for a, b in pairs)
    norm = sum(float((a ** 2).sum()) for a, _ in pairs)
    worst = max(float((b - a).nan_to_num().norm() / a.norm()) for a, b in pairs)
    return {"rel_err": (diff / norm) ** 0.5, "worst_clip_rel_err": worst, "not_finite": finite, "clips": len(pairs)}


def main(argv: list[str]) -> None:
    ref = latents(Path(argv[0]))
    for spec in argv[1:]:
        name, folder = spec.split("=", 1)
        r = compare(ref, latents(Path(folder)))
        print(f"compare_caches: {name} rel_err {r['rel_err']:.3e} worst_clip {r['worst_clip_rel_err']:.3e} "
              f"not_finite {r['not_finite']} clips {r['clips']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
