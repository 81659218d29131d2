"""The GPU case single_files_5b's scripts on a tiny TI2V-5B-layout model (CPU, bf16 like the real-size build):
tests/gpu/write_single_files.py writes ComfyUI's files (names, dtypes, float8 scales and markers read back from their
headers; safetensors reads them), and tests/gpu/compare_single_files.py loads each through wanexp's single-file path
and finds it equal to the folder's weights as the file stores them, in the run's dtypes; a loader that drops the fp8
scale is caught. tests/single_files.py's streamed writer against safetensors' own."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.conftest import compose_cfg
from tests.gpu import compare_single_files, write_single_files
from tests.gpu.registry import CASES, SINGLE, SINGLE_PARTS
from tests.gpu.write_single_files import DIT_FILES, UMT5_FILE, VAE_FILE
from tests.single_files import StreamedSafetensors, dit_to_original
from wanexp.composition import build
from wanexp.models.family import safetensors_problem
from wanexp.models.tiny import ensure_tiny_model
from wanexp.models.wan22 import single_file

RUN_DTYPES = ["model.dtype=bf16", "model.text_encoder_dtype=bf16"]  # the real-size run's (model=ti2v5b); VAE fp32
DIT_PREFIX = "model.diffusion_model."  # ComfyUI's repackaged DiT files' names


def header(path) -> dict:
    """{name: (safetensors dtype, shape)} of a file, from its header."""
    with safe_open(str(path), "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}


def folder_header(folder) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in header(f).items()}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The tiny model built in bf16 (as build_random_model.py builds the real size), its single files written by the
    script's command line, and the script's JSON."""
    root = tmp_path_factory.mktemp("single_gpu")
    spec = build(compose_cfg(["model=tiny", f"paths.tiny_model_dir={root}"]).model)
    torch.set_default_dtype(torch.bfloat16)
    try:
        ensure_tiny_model(spec, dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(torch.float32)
    out = root / "files"
    write_single_files.main([str(spec.path), str(out), "--json", str(root / "written.json")])
    return spec.path, out, json.loads((root / "written.json").read_text())


def test_the_files_carry_comfyuis_names_dtypes_and_scales(written):
    folder, out, reports = written
    src = folder_header(folder / "transformer")
    block_linears = [k for k, (_, shape) in src.items() if k.startswith("blocks.") and len(shape) == 2]
    fp16, plain, scaled = (header(out / DIT_FILES[f]) for f in ("fp16", "fp8_e4m3fn", "fp8_scaled"))
    assert all(k.startswith(DIT_PREFIX) for k in fp16) and {d for d, _ in fp16.values()} == {"F16"}
    assert len(fp16) == len(src) and fp16[DIT_PREFIX + "head.modulation"][1] == src["scale_shift_table"][1]
    q = DIT_PREFIX + "blocks.0.self_attn.q"
    assert plain[q + ".weight"][0] == "F8_E4M3" and not any(k.endswith((".scale_weight", "scaled_fp8")) for k in plain)
    assert scaled[q + ".weight"][0] == "F8_E4M3" and scaled[q + ".scale_weight"] == ("F32", ())
    assert scaled[DIT_PREFIX + "scaled_fp8"] == ("F8_E4M3", (0,))  # ComfyUI's marker, under the prefix
    for h in (plain, scaled):
        assert sorted(k for k, (d, _) in h.items() if d == "F8_E4M3" and k.endswith(".weight")) == sorted(
            DIT_PREFIX + k for k in dit_to_original({k: k for k in block_linears}))
        assert h[DIT_PREFIX + "blocks.0.norm3.weight"][0] == h[DIT_PREFIX + "patch_embedding.weight"][0] == "F16"
    assert reports["dit_fp8_scaled"]["quantized"] == reports["dit_fp8_e4m3fn"]["quantized"] == len(block_linears)
    vae = header(out / VAE_FILE)
    assert "decoder.middle.0.residual.0.gamma" in vae and {d for d, _ in vae.values()} == {"F16"}
    umt5 = header(out / UMT5_FILE)
    attn = "encoder.block.0.layer.0.SelfAttention"
    assert umt5[f"{attn}.q.weight"][0] == "F8_E4M3" and umt5[f"{attn}.q.scale_weight"] == ("F32", ())
    assert umt5[f"{attn}.relative_attention_bias.weight"][0] == umt5["shared.weight"][0] == "F16"
    assert "encoder.embed_tokens.weight" not in umt5 and umt5["scaled_fp8"] == ("F8_E4M3", (0,))
    assert umt5["spiece_model"][0] == "U8" and (out / "tokenizer" / "tokenizer.json").is_file()
    for f in (*DIT_FILES.values(), VAE_FILE, UMT5_FILE):
        assert safetensors_problem(out / f) is None and not (out / f"{f}.partial").exists()
    assert 0 < reports["dit_fp8_scaled"]["rel_err"] < reports["dit_fp8_e4m3fn"]["rel_err"]


def test_each_file_loads_as_the_folders_weights_as_the_file_stores_them(written, tmp_path):
    folder, out, reports = written
    path = tmp_path / "compare.json"
    results = compare_single_files.main([str(folder), str(out), "--model", "tiny", "--set", *RUN_DTYPES,
                                         "--json", str(path)])
    assert set(results) == set(SINGLE_PARTS) and json.loads(path.read_text())["device"] == "cpu"
    for part, r in results.items():
        assert r["exact"] and r["dtypes_match"] and r["keys_match"] and r["max_abs_vs_stored"] == 0.0, (part, r)
    assert all(results[f"dit_{f}"]["config_match"] for f in DIT_FILES)
    assert results["dit_fp16"]["quantized"] == 0 and results["vae"]["quantized"] == 0
    assert results["dit_fp8_scaled"]["quantized"] == reports["dit_fp8_scaled"]["quantized"]
    limit = next(c.limit for c in CASES[SINGLE].checks if c.key == "metrics.compare.dit_fp8_scaled.rel_err")
    assert 0 < results["dit_fp8_scaled"]["rel_err"] <= limit
    assert results["dit_fp16"]["max_abs_diff"] < 1e-6  # bf16 -> fp16 is exact but where fp16 runs out of range


def test_the_comparison_catches_a_loader_that_drops_the_fp8_scale(written, monkeypatch):
    folder, out, _ = written
    stored = single_file.WeightFile.tensor

    def unscaled(self, name):
        return self._get(name).float() if name in self.scales else stored(self, name)

    monkeypatch.setattr(single_file.WeightFile, "tensor", unscaled)
    results = compare_single_files.main([str(folder), str(out), "--model", "tiny", "--formats", "fp8_scaled",
                                         "--set", *RUN_DTYPES])
    assert not results["dit_fp8_scaled"]["exact"] and not results["umt5_fp8_scaled"]["exact"]
    assert results["vae"]["exact"]  # no scales in it


def test_the_streamed_writer_lays_out_a_file_safetensors_reads_as_its_own(tmp_path):
    torch.manual_seed(0)
    tensors = {"b.weight": torch.randn(3, 5).to(torch.float8_e4m3fn), "a.scale": torch.tensor(0.5),
               "c": torch.randn(7, dtype=torch.float16), "d": torch.arange(5, dtype=torch.uint8),
               "e": torch.randn(2, 3, dtype=torch.bfloat16), "marker": torch.empty(0, dtype=torch.float8_e4m3fn)}
    entries = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    with StreamedSafetensors(tmp_path / "mine.safetensors", entries, {"format": "pt"}) as f:
        for name in reversed(list(tensors)):  # any order
            f.put(name, tensors[name])
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    mine, theirs = load_file(tmp_path / "mine.safetensors"), load_file(tmp_path / "theirs.safetensors")
    assert mine.keys() == theirs.keys()
    for k in theirs:
        a, b = (t.reshape(-1).view(torch.uint8) for t in (mine[k], theirs[k]))
        assert mine[k].dtype == theirs[k].dtype and mine[k].shape == theirs[k].shape and torch.equal(a, b), k
    with safe_open(str(tmp_path / "mine.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    raw = (tmp_path / "mine.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % 8 == 0
    layout = sorted((v["data_offsets"][0], tensors[k].dtype.itemsize) for k, v in json.loads(raw[8:8 + n]).items()
                    if k != "__metadata__")
    assert all(start % size == 0 for start, size in layout)  # each tensor aligned to its element size
    assert [size for _, size in layout] == sorted((size for _, size in layout), reverse=True)

    with pytest.raises(ValueError, match="the header says"):
        with StreamedSafetensors(tmp_path / "bad.safetensors", entries) as f:
            f.put("c", tensors["c"].float())
    with pytest.raises(ValueError, match="1 tensors never written"):
        with StreamedSafetensors(tmp_path / "bad.safetensors", entries) as f:
            for name in list(tensors)[1:]:
                f.put(name, tensors[name])
    assert not list(tmp_path.glob("bad*"))  # neither the file nor its .partial
