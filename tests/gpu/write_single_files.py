"""Write a TI2V-5B diffusers folder's weights as the single files ComfyUI users have (Comfy-Org's repackaged files).

    python tests/gpu/write_single_files.py SRC_FOLDER OUT_DIR [--formats fp16,fp8_e4m3fn,fp8_scaled] [--json PATH]

Into OUT_DIR, from SRC_FOLDER's transformer/, vae/, text_encoder/ and tokenizer/ (e.g. tests/gpu/build_random_model.py's
real-size ti2v5b):

* the DiT, once per format: ``wan2.2_ti2v_5B_fp16.safetensors``, ``..._fp8_e4m3fn`` (the blocks' linear weights cast
  to float8_e4m3fn) and ``..._fp8_scaled`` (those weights over one float32 ``scale_weight`` each, and the
  ``scaled_fp8`` marker); the original Wan names under ``model.diffusion_model.``, every other tensor in fp16;
* the VAE, ``wan2.2_vae.safetensors``: the original Wan names, fp16;
* UMT5-XXL, ``umt5_xxl_fp8_e4m3fn_scaled.safetensors``: transformers' names (one ``shared.weight``), the encoder
  blocks' linear weights in scaled float8, the rest fp16, the ``scaled_fp8`` marker, and the tokenizer as bytes in
  ``spiece_model`` (where ComfyUI's file carries its SentencePiece model);
* ``tokenizer/``, a copy of the folder's (UMT5 files carry no tokenizer wanexp reads).

Tensors are read, converted (on the GPU when there is one) and written one at a time (tests/single_files.py's
StreamedSafetensors): host memory holds a tensor, never a model. The DiT's source tensors are read once for all its
formats. One line per file: size, seconds, and the stored values' error against the folder's (largest absolute,
relative over the file); ``--json`` writes the same.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root on the path (tests.single_files)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DIT_FILES = {"fp16": "wan2.2_ti2v_5B_fp16.safetensors", "fp8_e4m3fn": "wan2.2_ti2v_5B_fp8_e4m3fn.safetensors",
             "fp8_scaled": "wan2.2_ti2v_5B_fp8_scaled.safetensors"}
VAE_FILE = "wan2.2_vae.safetensors"
UMT5_FILE = "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
TOKENIZER = "tokenizer"
DIT_PREFIX = "model.diffusion_model."
FP8_FORMS = {"fp16": None, "fp8_e4m3fn": "plain", "fp8_scaled": "scaled"}  # format -> tests.single_files.quantize
TI2V_CHANNELS = 48


class Source:
    """The tensors of a component folder's safetensors files by name, read one at a time (the files stay open)."""

    def __init__(self, folder: Path):
        from contextlib import ExitStack

        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise SystemExit(f"{folder}: no .safetensors weights (a diffusers folder, e.g. build_random_model.py's)")
        self.stack, self.handles, self.shapes = ExitStack(), {}, {}
        for f in files:
            handle = self.stack.enter_context(safe_open(str(f), "pt"))
            for name in handle.keys():
                self.handles[name], self.shapes[name] = handle, tuple(handle.get_slice(name).get_shape())

    def get(self, name: str):
        return self.handles[name].get_tensor(name)

    def close(self) -> None:
        self.stack.close()


class Target:
    """One file of a component (``key`` names it in the reports): each source tensor's name in it (``names``: source
    -> file), the dtype of the tensors not quantized, the float8 form (None, "plain", "scaled") of those
    ``quantized(source name, shape)`` picks, and tensors written as they are (markers)."""

    def __init__(self, key: str, path: Path, names: dict, dtype, fp8: str | None = None, quantized=None,
                 extra: dict | None = None, scale_marker: str | None = None):
        import torch

        from tests.single_files import FP8

        self.key, self.path, self.names, self.dtype, self.fp8 = key, path, names, dtype, fp8
        self.quantized = (lambda name, shape: False) if fp8 is None else quantized
        self.extra = dict(extra or {})
        if fp8 == "scaled":  # ComfyUI's mark of a scaled-fp8 file: an empty float8 tensor
            self.extra[scale_marker] = torch.empty(0, dtype=FP8)
        self.error = {"max_abs_err": 0.0, "sq_err": 0.0, "sq": 0.0, "quantized": 0}

    def entries(self, shapes: dict) -> dict:
        import torch

        from tests.single_files import FP8

        out = {}
        for src, name in self.names.items():
            if self.quantized(src, shapes[src]):
                out[name] = (FP8, shapes[src])
                if self.fp8 == "scaled":
                    out[scale_name(name)] = (torch.float32, ())
            else:
                out[name] = (self.dtype, shapes[src])
        out.update({k: (v.dtype, tuple(v.shape)) for k, v in self.extra.items()})
        return out

    def write(self, f, src: str, value, exact) -> None:
        """Source tensor ``src`` (``value``, on the converting device; ``exact``: it in float32) stored into the open
        file ``f``."""
        from tests.single_files import dequantize, quantize

        name = self.names[src]
        if self.quantized(src, tuple(value.shape)):
            q, scale = quantize(value, self.fp8)
            f.put(name, q)
            if scale is not None:
                f.put(scale_name(name), scale)
            held = dequantize(q, scale)
            self.error["quantized"] += 1
        else:
            stored = value.to(self.dtype)
            f.put(name, stored)
            held = stored.float()
        diff = held - exact
        self.error["max_abs_err"] = max(self.error["max_abs_err"], float(diff.abs().max()) if diff.numel() else 0.0)
        self.error["sq_err"] += float(diff.square().sum())
        self.error["sq"] += float(exact.square().sum())

    def report(self, seconds: float) -> dict:
        e = self.error
        return {"file": self.path.name, "gib": self.path.stat().st_size / 2**30, "seconds": round(seconds, 1),
                "tensors": len(self.names), "quantized": e["quantized"], "max_abs_err": e["max_abs_err"],
                "rel_err": (e["sq_err"] / e["sq"]) ** 0.5 if e["sq"] else 0.0}


def scale_name(weight: str) -> str:
    return weight.removesuffix(".weight") + ".scale_weight"


def write_component(source: Source, targets: list[Target], device: str) -> dict:
    """Every source tensor each target names, read once and stored into each target's file; {target key: report}
    (``seconds``: the component's, its files written together)."""
    from contextlib import ExitStack

    from tests.single_files import StreamedSafetensors

    t0 = time.monotonic()
    with ExitStack() as stack:
        files = [stack.enter_context(StreamedSafetensors(t.path, t.entries(source.shapes))) for t in targets]
        for src in sorted({s for t in targets for s in t.names}):
            value = source.get(src).to(device)
            exact = value.float()
            for t, f in zip(targets, files):
                if src in t.names:
                    t.write(f, src, value, exact)
            del value, exact
        for t, f in zip(targets, files):
            for name, tensor in t.extra.items():
                f.put(name, tensor)
    seconds = time.monotonic() - t0
    return {t.key: t.report(seconds) for t in targets}


def dit_targets(src: Source, out: Path, formats: list[str]) -> list[Target]:
    """The DiT's files: the original Wan names under ``model.diffusion_model.``; the blocks' linear weights in
    float8 in the fp8 formats."""
    import torch

    from tests.single_files import dit_to_original

    names = {diff: DIT_PREFIX + orig for orig, diff in dit_to_original({k: k for k in src.shapes}).items()}

    def block_linear(name: str, shape: tuple) -> bool:
        return name.startswith("blocks.") and name.endswith(".weight") and len(shape) == 2

    return [Target(f"dit_{f}", out / DIT_FILES[f], names, torch.float16, FP8_FORMS[f], block_linear,
                   scale_marker=DIT_PREFIX + "scaled_fp8") for f in formats]


def vae_target(folder: Path, src: Source, out: Path) -> Target:
    import torch

    from tests.single_files import vae_to_original

    cfg = json.loads((folder / "config.json").read_text())
    residual = bool(cfg.get("is_residual", False))
    names = {diff: orig for orig, diff in vae_to_original({k: k for k in src.shapes}, residual,
                                                          int(cfg.get("num_res_blocks", 2))).items()}
    return Target("vae", out / VAE_FILE, names, torch.float16)


def umt5_target(src: Source, tokenizer: Path, out: Path) -> Target:
    """transformers' names, the embedding once (``shared.weight``, which the encoder's embedding is tied to)."""
    import torch

    names = {n: n for n in src.shapes if n != "encoder.embed_tokens.weight"}
    if "shared.weight" not in src.shapes:
        names["encoder.embed_tokens.weight"] = "shared.weight"
    model_file = next((tokenizer / f for f in ("spiece.model", "tokenizer.json") if (tokenizer / f).is_file()), None)
    extra = {} if model_file is None else {
        "spiece_model": torch.frombuffer(bytearray(model_file.read_bytes()), dtype=torch.uint8)}

    def encoder_linear(name: str, shape: tuple) -> bool:
        return (name.startswith("encoder.block.") and name.endswith(".weight") and len(shape) == 2
                and "relative_attention_bias" not in name)

    return Target("umt5_fp8_scaled", out / UMT5_FILE, names, torch.float16, "scaled", encoder_linear, extra,
                  scale_marker="scaled_fp8")


def write_all(src_folder: Path, out: Path, formats: list[str], device: str | None = None) -> dict:
    """Every file of the module docstring written from ``src_folder`` into ``out``; {``dit_<format>``, ``vae``,
    ``umt5_fp8_scaled``: report}."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = src_folder / "transformer" / "config.json"
    if not cfg.is_file():
        raise SystemExit(f"{src_folder}: no transformer/config.json (a diffusers folder of TI2V-5B's layout)")
    if json.loads(cfg.read_text()).get("in_channels") != TI2V_CHANNELS:
        raise SystemExit(f"{src_folder}: not a TI2V-5B-layout DiT ({TI2V_CHANNELS} input channels); this writes "
                         "TI2V-5B's files")
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for component, targets in (("transformer", lambda s: dit_targets(s, out, formats)),
                               ("vae", lambda s: [vae_target(src_folder / "vae", s, out)]),
                               ("text_encoder", lambda s: [umt5_target(s, src_folder / TOKENIZER, out)])):
        source = Source(src_folder / component)
        try:
            written = write_component(source, targets(source), device)
        finally:
            source.close()
        for r in written.values():
            print(f"write_single_files: {r['file']} {r['gib']:.2f} GiB in {r['seconds']:.0f} s, {r['tensors']} tensors "
                  f"({r['quantized']} in float8), max_abs_err {r['max_abs_err']:.3e} rel_err {r['rel_err']:.3e}",
                  flush=True)
        reports.update(written)
    shutil.rmtree(out / TOKENIZER, ignore_errors=True)
    shutil.copytree(src_folder / TOKENIZER, out / TOKENIZER)
    return reports


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", type=Path, help="a diffusers folder (transformer/, vae/, text_encoder/, tokenizer/)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--formats", default=",".join(DIT_FILES), help=f"the DiT's formats, of {', '.join(DIT_FILES)}")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in DIT_FILES]
    if unknown or not formats:
        raise SystemExit(f"--formats {args.formats}: name some of {', '.join(DIT_FILES)}")
    reports = write_all(args.src, args.out, formats)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
