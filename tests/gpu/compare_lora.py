"""Check two LoRA export folders hold the same modules, shapes and metadata (e.g. DDP vs FSDP runs)."""
from __future__ import annotations

import sys
from pathlib import Path

from safetensors import safe_open


def describe(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            keys = sorted(h.keys())
            shapes = {k: tuple(h.get_slice(k).get_shape()) for k in keys}
            nonzero_b = sum(1 for k in keys if ("lora_B" in k or "lora_up" in k) and h.get_tensor(k).abs().max() > 0)
            out[f.name] = (shapes, nonzero_b, sorted((h.metadata() or {}).keys()))
    return out


def main(a: str, b: str) -> None:
    da, db = describe(Path(a)), describe(Path(b))
    assert da.keys() == db.keys(), (da.keys(), db.keys())
    for name in da:
        assert da[name][0] == db[name][0], f"{name}: different tensors"
        assert da[name][1] > 0 and db[name][1] > 0, f"{name}: LoRA B all zero"
        assert da[name][2] == db[name][2], f"{name}: different metadata keys"
        print(f"{name}: {len(da[name][0])} tensors, same shapes; trained B tensors {da[name][1]} / {db[name][1]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
