"""Each single file of tests/gpu/write_single_files.py loaded through wanexp's single-file path, against the same
weights loaded from the diffusers folder they were written from.

    python tests/gpu/compare_single_files.py FOLDER FILES_DIR [--model ti2v5b] [--formats ...] [--set KEY=VALUE ...]
        [--json PATH]

The DiT of each format (``model.path`` its file), the VAE and the UMT5 file are loaded as a run loads them
(``model.vae_path``, ``model.text_encoder_path``, ``model.tokenizer_path``; the model group's dtypes, ``--set``
overrides), after the run's checks of the files (``check_folder``); the folder's components load as a folder run's.
Per component (``dit_<format>``, ``vae``, ``umt5_fp8_scaled``):

* ``exact``: every weight equals the folder's weight stored as the file stores it (cast to the file's dtype, or
  quantized to float8 as tests/single_files.py does, over the scale when the file has one) and then cast to the
  folder load's dtype: ``max_abs_vs_stored`` is 0;
* ``dtypes_match``, ``keys_match``: the same parameters in the same dtypes as the folder's load (the modules kept in
  fp32 too); ``config_match`` (DiT): its config, read off the file's shapes, is the folder's;
* ``max_abs_diff``, ``rel_err`` (||loaded - folder|| / ||folder||): the storage's error against the folder's weights;
* ``quantized`` (float8 tensors), ``load_s`` (the single-file load's seconds), ``file_gib``.

The folder's load stands for the values the files were written from: the run's dtypes must hold the folder's exactly
(a bf16 folder, as build_random_model.py writes, loaded in bf16 or fp32). The requantization runs on the GPU when
there is one, as the writer's does. One line per component; ``--json`` writes them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path (tests.*)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.gpu.write_single_files import DIT_FILES, TOKENIZER, UMT5_FILE, VAE_FILE  # noqa: E402

FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def spec_of(overrides: list[str]):
    from wanexp.composition import build
    from wanexp.config import compose

    return build(compose(overrides).model)


def stored(value, plan, name: str):
    """``value`` (a folder weight) as the file of ``plan`` stores its weight ``name``, as float32 (float8:
    dequantized)."""
    import torch

    from tests.single_files import dequantize, quantize

    label = plan.file.dtypes[name]
    if label in FLOAT_DTYPES:
        return value.to(getattr(torch, FLOAT_DTYPES[label])).float()
    if label != "F8_E4M3":
        raise SystemExit(f"{plan.file.path}: {name} is stored as {label}, which write_single_files.py never writes")
    q, scale = quantize(value, "scaled" if name in plan.file.scales else "plain")
    return dequantize(q, scale)


def compare(loaded, folder, plan, device: str) -> dict:
    """``loaded`` (from the file of ``plan``) against ``folder`` (the folder's load), weight by weight on
    ``device``."""
    import torch

    a, b = loaded.state_dict(), folder.state_dict()
    out = {"keys_match": a.keys() == b.keys(), "dtypes_match": True, "max_abs_vs_stored": 0.0, "max_abs_diff": 0.0,
           "tensors": len(b), "quantized": 0}
    sq_err = sq = 0.0
    for key, want in b.items():
        if key not in a:
            continue
        got = a[key]
        out["dtypes_match"] &= got.dtype == want.dtype
        x, g = want.to(device), got.to(device)
        name = plan.names[key]
        out["quantized"] += plan.file.dtypes[name] == "F8_E4M3"
        expect = stored(x, plan, name).to(want.dtype)
        if x.numel():
            out["max_abs_vs_stored"] = max(out["max_abs_vs_stored"], float((g.float() - expect.float()).abs().max()))
            d = g.float() - x.float()
            out["max_abs_diff"] = max(out["max_abs_diff"], float(d.abs().max()))
            sq_err += float(d.square().sum())
            sq += float(x.float().square().sum())
        del x, g, expect
    out["rel_err"] = (sq_err / sq) ** 0.5 if sq else 0.0
    out["exact"] = out["keys_match"] and out["max_abs_vs_stored"] == 0.0
    out["file_gib"] = plan.file.path.stat().st_size / 2**30
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def public(config) -> dict:
    return json.loads(json.dumps({k: v for k, v in dict(config).items() if not k.startswith("_")}))


def timed(load):
    t0 = time.monotonic()
    model = load()
    return model, round(time.monotonic() - t0, 1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="the diffusers folder the files were written from")
    ap.add_argument("files", type=Path, help="write_single_files.py's OUT_DIR")
    ap.add_argument("--model", default="ti2v5b", help="the model group (its dtypes are the run's)")
    ap.add_argument("--formats", default=",".join(DIT_FILES))
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides, e.g. model.dtype=fp16")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    from wanexp.models.wan22 import single_file
    from wanexp.models.tiny import quiet_libraries

    quiet_libraries()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = [f"model={args.model}", *args.set]
    files = args.files
    rest = [f"model.vae_path={files / VAE_FILE}", f"model.text_encoder_path={files / UMT5_FILE}",
            f"model.tokenizer_path={files / TOKENIZER}"]
    folder_spec = spec_of([*base, f"model.path={args.folder}"])
    results: dict = {}

    def report(key: str, result: dict) -> None:
        results[key] = result
        print(f"compare_single_files: {key} " + " ".join(
            f"{k} {v:.3e}" if isinstance(v, float) and k != "load_s" else f"{k} {v}" for k, v in result.items()),
            flush=True)

    spec = None
    ref = folder_spec.read_transformer("dense")
    for fmt in [f for f in args.formats.split(",") if f]:
        spec = spec_of([*base, f"model.path={files / DIT_FILES[fmt]}", *rest])
        spec.check_folder(spec.experts)
        model, seconds = timed(lambda: spec.read_transformer("dense"))
        result = compare(model, ref, single_file.plan(spec, "transformer"), device)
        report(f"dit_{fmt}", {**result, "config_match": public(model.config) == public(ref.config), "load_s": seconds})
        del model
    del ref
    spec = spec or spec_of([*base, f"model.path={files / DIT_FILES['fp16']}", *rest])
    for key, component, load in (("vae", "vae", "load_vae"), ("umt5_fp8_scaled", "text_encoder", "load_text_encoder")):
        ref = getattr(folder_spec, load)()
        model, seconds = timed(getattr(spec, load))
        report(key, {**compare(model, ref, single_file.plan(spec, component), device), "load_s": seconds})
        del model, ref
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device, **results}, indent=1))
    return results


if __name__ == "__main__":
    main()
