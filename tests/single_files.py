"""Single weight files as ComfyUI users have them, written from a model's diffusers / transformers tensors (tests only).

* Names: the DiT's and the VAE's original Wan names (:func:`dit_to_original`, :func:`vae_to_original`, written from
  wan/modules/{model,vae2_1,vae2_2}.py of the Wan2.2 repo, independently of wanexp's converters); ComfyUI stores UMT5
  under transformers' own names.
* Storage: a float dtype, or float8_e4m3fn weights (:func:`quantize`): ``plain`` (a cast), ``scaled`` (ComfyUI's
  "scaled fp8": the weight over one float32 scale, its absolute maximum / 448, stored as ``<layer>.scale_weight``
  beside a ``scaled_fp8`` marker tensor) or ``weight_scale`` (one scale per row, ComfyUI's newer
  ``<layer>.weight_scale``).
* :class:`StreamedSafetensors`: a safetensors file whose header is written first and whose tensors are then written
  one at a time, each at its place, so that a model is never held whole in memory.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint8: "U8",
                      torch.int8: "I8", torch.int32: "I32", torch.int64: "I64"}


# ---- diffusers -> original names (the inverse mapping, written from the original Wan2.2 modules) ---------------------
def dit_to_original(sd: dict) -> dict:
    """diffusers WanTransformer3DModel (or WanVACETransformer3DModel) -> original WanModel (wan/modules/model.py;
    VACE: VaceWanModel) names."""
    top = {"scale_shift_table": "head.modulation", "proj_out.weight": "head.head.weight",
           "proj_out.bias": "head.head.bias"}
    emb = {"condition_embedder.time_embedder.linear_1.": "time_embedding.0.",
           "condition_embedder.time_embedder.linear_2.": "time_embedding.2.",
           "condition_embedder.text_embedder.linear_1.": "text_embedding.0.",
           "condition_embedder.text_embedder.linear_2.": "text_embedding.2.",
           "condition_embedder.time_proj.": "time_projection.1."}
    block = {"attn1.to_q.": "self_attn.q.", "attn1.to_k.": "self_attn.k.", "attn1.to_v.": "self_attn.v.",
             "attn1.to_out.0.": "self_attn.o.", "attn1.norm_q.": "self_attn.norm_q.",
             "attn1.norm_k.": "self_attn.norm_k.",
             "attn2.to_q.": "cross_attn.q.", "attn2.to_k.": "cross_attn.k.", "attn2.to_v.": "cross_attn.v.",
             "attn2.to_out.0.": "cross_attn.o.", "attn2.norm_q.": "cross_attn.norm_q.",
             "attn2.norm_k.": "cross_attn.norm_k.",
             "norm2.": "norm3.",  # the affine cross-attention norm: norm3 in the original
             "ffn.net.0.proj.": "ffn.0.", "ffn.net.2.": "ffn.2.", "scale_shift_table": "modulation"}
    leaves = {**block, "proj_in.": "before_proj.", "proj_out.": "after_proj."}
    out = {}
    for k, v in sd.items():
        if k in top:
            out[top[k]] = v
            continue
        if k.startswith(("patch_embedding.", "vace_patch_embedding.")):
            out[k] = v
            continue
        pre = next((p for p in emb if k.startswith(p)), None)
        if pre is not None:
            out[emb[pre] + k[len(pre):]] = v
            continue
        # a VACE model's control blocks (wan/modules/vace_model.py's VaceWanAttentionBlock): a block's keys plus the
        # input projection of the first (before_proj) and each one's output projection (after_proj)
        m = re.fullmatch(r"(vace_blocks|blocks)\.(\d+)\.(.+)", k)
        rest = m.group(3)
        pre = next(p for p in leaves if rest.startswith(p))
        out[f"{m.group(1)}.{m.group(2)}.{leaves[pre]}{rest[len(pre):]}"] = v
    return out


_RES_INV = {"norm1.gamma": "residual.0.gamma", "conv1.weight": "residual.2.weight", "conv1.bias": "residual.2.bias",
            "norm2.gamma": "residual.3.gamma", "conv2.weight": "residual.6.weight", "conv2.bias": "residual.6.bias",
            "conv_shortcut.weight": "shortcut.weight", "conv_shortcut.bias": "shortcut.bias"}


def vae_to_original(sd: dict, residual: bool, num_res_blocks: int) -> dict:
    """diffusers AutoencoderKLWan -> original WanVAE_ names (vae2_2.py when ``residual``, else vae2_1.py)."""
    R = num_res_blocks
    out = {}
    for k, v in sd.items():
        if k.startswith("quant_conv."):
            out["conv1." + k.split(".", 1)[1]] = v
            continue
        if k.startswith("post_quant_conv."):
            out["conv2." + k.split(".", 1)[1]] = v
            continue
        part, rest = k.split(".", 1)
        stack = {"encoder": "downsamples", "decoder": "upsamples"}[part]
        if rest.startswith("conv_in."):
            o = "conv1." + rest[len("conv_in."):]
        elif rest == "norm_out.gamma":
            o = "head.0.gamma"
        elif rest.startswith("conv_out."):
            o = "head.2." + rest[len("conv_out."):]
        elif m := re.fullmatch(r"mid_block\.resnets\.(\d)\.(.+)", rest):
            o = f"middle.{2 * int(m.group(1))}.{_RES_INV[m.group(2)]}"
        elif m := re.fullmatch(r"mid_block\.attentions\.0\.(.+)", rest):
            o = f"middle.1.{m.group(1)}"
        elif residual and (m := re.fullmatch(r"(?:down|up)_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest)):
            o = f"{stack}.{m.group(1)}.{stack}.{m.group(2)}.{_RES_INV[m.group(3)]}"
        elif residual and (m := re.fullmatch(r"(?:down|up)_blocks\.(\d+)\.(?:downsampler|upsampler)\.(.+)", rest)):
            # Down_ResidualBlock: R ResidualBlocks then the Resample; Up_ResidualBlock: R + 1 then the Resample
            o = f"{stack}.{m.group(1)}.{stack}.{R if part == 'encoder' else R + 1}.{m.group(2)}"
        elif not residual and part == "encoder" and (m := re.fullmatch(r"down_blocks\.(\d+)\.(.+)", rest)):
            leaf = m.group(2)  # Wan2.1 encoder: the same flat list on both sides
            o = f"downsamples.{m.group(1)}.{_RES_INV.get(leaf, leaf)}"
        elif not residual and (m := re.fullmatch(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest)):
            # Wan2.1 Decoder3d: one flat list, per stage R + 1 ResidualBlocks then one Resample
            o = f"upsamples.{int(m.group(1)) * (R + 2) + int(m.group(2))}.{_RES_INV[m.group(3)]}"
        elif not residual and (m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.(.+)", rest)):
            o = f"upsamples.{int(m.group(1)) * (R + 2) + R + 1}.{m.group(2)}"
        else:
            raise AssertionError(f"test helper has no original name for {k}")
        out[f"{part}.{o}"] = v
    return out


# ---- float8 storage --------------------------------------------------------------------------------------------------
def _per_row(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return scale.reshape(-1, *[1] * (x.dim() - 1)) if scale.dim() else scale


def quantize(v: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``v`` in float8_e4m3fn and its float32 scale (None for ``plain``): ``plain`` casts; ``scaled`` divides by one
    scale, ``weight_scale`` by one per row, each the absolute maximum over 448 (e4m3fn's largest value)."""
    if form == "plain":
        return v.to(FP8), None
    if form not in ("scaled", "weight_scale"):
        raise ValueError(f"float8 form {form!r}: one of plain, scaled, weight_scale")
    x = v.float()
    amax = x.abs().amax(dim=1) if form == "weight_scale" else x.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (x / _per_row(scale, x)).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 values a float8 tensor and its scale stand for."""
    x = q.float()
    return x if scale is None else x * _per_row(scale, x)


# ---- a safetensors file written tensor by tensor ---------------------------------------------------------------------
class StreamedSafetensors:
    """A safetensors file holding the tensors ``entries`` names ({name: (dtype, shape)}), each written by
    :meth:`put` in any order. The layout is safetensors' own (largest element size first, then by name: every tensor
    starts aligned to its element size, no gaps). Written as ``<path>.partial`` and renamed once every tensor is in
    (as a context manager); an error leaves no file."""

    def __init__(self, path, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict | None = None):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        header: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
        self.places: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        end = 0
        for name in sorted(entries, key=lambda n: (-entries[n][0].itemsize, n)):
            dtype, shape = entries[name][0], tuple(entries[name][1])
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [end, end + size]}
            self.places[name] = (dtype, shape, end)
            end += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
        self.start, self.size, self.left = 8 + len(blob), 8 + len(blob) + end, set(entries)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.partial, "wb")
        self.file.write(len(blob).to_bytes(8, "little") + blob)
        self.file.truncate(self.size)

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Writes ``tensor`` (any device) as ``name``, whose dtype and shape the header gave."""
        if name not in self.left:
            raise ValueError(f"{self.path.name}: {name} is not in the header, or was written already")
        dtype, shape, offset = self.places[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path.name}: {name} is {tensor.dtype} {list(tensor.shape)}, the header says "
                             f"{dtype} {list(shape)}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self.file.seek(self.start + offset)
        self.file.write(data)
        self.left.discard(name)

    def __enter__(self) -> "StreamedSafetensors":
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.file.close()
        if kind is None and self.left:
            self.partial.unlink()
            raise ValueError(f"{self.path.name}: {len(self.left)} tensors never written, e.g. {sorted(self.left)[:2]}")
        if kind is None:
            os.replace(self.partial, self.path)
        else:
            self.partial.unlink(missing_ok=True)
