"""ComfyUI's adapter arithmetic, which wanexp's files must merge to exactly: each kind's per-module tensors and
scale, the weight a module's file patches in (DoRA too), and several LoRAs of the same modules as one."""
from __future__ import annotations

import torch

from wanexp.adapters.naming import COMFY_PREFIX
from wanexp.errors import ConfigError

# ComfyUI (comfy/lora.py:load_lora, comfy/weight_adapter/{lora,lokr,loha,base}.py) reads, per module prefix ``x``:
# ``x.alpha``, ``x.dora_scale`` and the kind's tensors (``x.lora_up.weight``/``x.lora_down.weight``, ``x.lokr_w1`` or
# ``x.lokr_w1_a``/``x.lokr_w1_b``, the same for w2, ``x.hada_w1_a`` ... ``x.hada_w2_b``). Its scale is alpha/dim with
# dim the inner size of a low-rank factor (LoKr: only when a factor is low-rank, else 1; no alpha: 1). DoRA: a
# ``dora_scale`` of shape (out, 1) makes ComfyUI compute ``dora_scale / (|W|_row + eps) * (W + scale * diff)`` with
# |W| the row norm of the base weight; peft trains ``m / |W + scale * diff|_row * (W + scale * diff)``, so the file's
# dora_scale is m * (|W| + eps) / |W + scale * diff| (needs the base weight at export).
DORA_EPS = torch.finfo(torch.float32).eps  # ComfyUI patches in fp32 and adds that dtype's eps to the norm


_COMFY_KIND = {"lora_up.weight": "lora", "lora_B.weight": "lora", "lokr_w1": "lokr", "lokr_w1_a": "lokr",
               "lokr_w2": "lokr", "lokr_w2_a": "lokr", "hada_w1_a": "loha"}


KIND_NAMES = {"lora": "LoRA", "lokr": "LoKr", "loha": "LoHa"}


def comfy_module_params(kind: str, params: dict[str, torch.Tensor], rank: int, alpha: float,
                        weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One module's peft-named adapter weights (scale alpha/rank, peft's) -> ComfyUI's names and scale (see above).
    ``weight``: the base weight, needed for a DoRA magnitude only."""
    if kind == "lora":
        a, b = params["lora_A.weight"], params["lora_B.weight"]
        out = {"lora_down.weight": a, "lora_up.weight": b, "alpha": torch.tensor(float(alpha))}
        m = params.get("lora_magnitude_vector.weight", params.get("lora_magnitude_vector"))
        if m is not None:
            w = weight.float()
            merged = w + (alpha / rank) * (b @ a)
            out["dora_scale"] = (m * (w.norm(dim=1) + DORA_EPS) / merged.norm(dim=1)).unsqueeze(1).contiguous()
        return out
    out = dict(params)
    if kind == "lokr" and "lokr_w1_a" not in params and "lokr_w2_a" not in params:
        out["lokr_w1"] = params["lokr_w1"] * (alpha / rank)  # two full factors: ComfyUI applies no alpha
    else:  # peft uses one rank for every low-rank factor, the dim ComfyUI divides alpha by
        out["alpha"] = torch.tensor(float(alpha))
    return out


def _comfy_scale(params: dict, dim: int | None) -> float:
    alpha = params.get("alpha")
    return float(alpha) / dim if alpha is not None and dim is not None else 1.0


def comfy_diff(params: dict[str, torch.Tensor], shape=None) -> tuple[torch.Tensor, float]:
    """(unscaled weight difference, scale) of one module's ComfyUI-named params, as ComfyUI computes them; reshaped
    to ``shape`` (the weight's) when given."""
    diff, scale = _comfy_diff(params)
    return (diff if shape is None else diff.reshape(shape)), scale


def _comfy_diff(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    p = {k: v.float() for k, v in params.items()}
    if "lora_up.weight" in p or "lora_B.weight" in p:
        up, down = p.get("lora_up.weight", p.get("lora_B.weight")), p.get("lora_down.weight", p.get("lora_A.weight"))
        return up @ down, _comfy_scale(p, down.shape[0])
    if any(k.startswith("lokr_") for k in p):
        dim = None
        w1 = p.get("lokr_w1")
        if w1 is None:
            w1, dim = p["lokr_w1_a"] @ p["lokr_w1_b"], p["lokr_w1_b"].shape[0]
        w2 = p.get("lokr_w2")
        if w2 is None:
            w2, dim = p["lokr_w2_a"] @ p["lokr_w2_b"], p["lokr_w2_b"].shape[0]
        return torch.kron(w1, w2), _comfy_scale(p, dim)
    diff = (p["hada_w1_a"] @ p["hada_w1_b"]) * (p["hada_w2_a"] @ p["hada_w2_b"])
    return diff, _comfy_scale(p, p["hada_w1_b"].shape[0])


def patched_weight(weight: torch.Tensor, params: dict[str, torch.Tensor], strength: float = 1.0) -> torch.Tensor:
    """The weight ComfyUI's LoRA loader makes of ``weight`` and one module's params at ``strength`` (fp32), also for a
    peft DoRA magnitude (``lora_magnitude_vector``, a diffusers file): ``m / |W + diff|_row * (W + diff)``."""
    w = weight.float()
    diff, scale = comfy_diff(params, w.shape)
    dora, mag = params.get("dora_scale"), params.get("lora_magnitude_vector")
    if dora is None and mag is None:
        return w + (strength * scale) * diff
    calc = w + scale * diff
    if mag is not None:
        calc = calc * (mag.float() / calc.norm(dim=1)).unsqueeze(1)
    else:
        on_rows = dora.shape[0] == w.shape[0]
        norm = w.norm(dim=1, keepdim=True) if on_rows else calc.norm(dim=0, keepdim=True)
        calc = calc * (dora.float().reshape(-1, 1) if on_rows else dora.float().reshape(1, -1)) / (norm + DORA_EPS)
    return calc if strength == 1.0 else w + strength * (calc - w)


def concat_loras(files: list, weights: list[float], naming) -> dict[str, torch.Tensor]:
    """Several LoRAs of the same modules (of any ranks) as one ComfyUI-named LoRA of rank sum(ranks):
    A = [A_1; A_2; ...] (rows), B = [w_1 s_1 B_1, w_2 s_2 B_2, ...] (columns), alpha = its rank (scale 1), so B @ A
    is sum_i w_i s_i B_i @ A_i exactly (s_i: file i's alpha/rank). Averaging the A's and B's instead would need one
    rank and add the cross terms B_1 A_2 + B_2 A_1."""
    first = files[0]
    for f in files:
        if f.kind != "lora" or f.dora:
            raise ConfigError(f"{f.what}: a {f.label} adapter; combining is exact for LoRA files only (a sum of "
                              "Kronecker/Hadamard products or DoRA norms is not one adapter of that kind)")
        if set(f.modules) != set(first.modules):
            only = sorted(set(f.modules) ^ set(first.modules))
            raise ConfigError(f"{f.what}: its layout differs from {first.what} (modules {only[0]} ... ({len(only)} "
                              "differ)); combine LoRAs of the same targets")
    out = {}
    for module in sorted(first.modules):
        downs, ups = [], []
        for f, w in zip(files, weights):
            p = f.modules[module]
            scale = _comfy_scale(p, p["lora_down.weight"].shape[0])
            downs.append(p["lora_down.weight"])
            ups.append(p["lora_up.weight"] * (w * scale))
        key = COMFY_PREFIX + naming.to_original(module)
        out[f"{key}.lora_down.weight"] = torch.cat(downs).contiguous()
        out[f"{key}.lora_up.weight"] = torch.cat(ups, dim=1).contiguous()
        out[f"{key}.alpha"] = torch.tensor(float(sum(d.shape[0] for d in downs)))
    return out
