"""The attention kernels a Wan2.2 DiT can run on a Hopper or Blackwell GPU, timed on its shapes: cuDNN's fused SDPA
(what torch's default SDPA runs there), torch's built-in flash kernel (FlashAttention-2) and FlashAttention-4 (the
`flash-attn-4` package, which torch's flash backend runs once ``wanexp.models.attention.activate_fa4`` registered it,
as ``model.attention_backend=fa4`` does); forward alone and forward + backward, and each kernel's output and gradients
against an fp32 reference where that fits. Device machine only (FlashAttention-4 installed: tests/gpu/setup_fa4.sh).

    python tests/gpu/attention_ab.py --json $OUT/attention_ab.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from wanexp.models.attention import activate_fa4, deactivate_fa4, fa4_missing

# name: (heads, query tokens, key tokens, head dim); the layout a diffusers attention processor passes (B, S, H, D)
SHAPES = {
    "5b_self_4400": (24, 4400, 4400, 128),  # TI2V-5B, 704x1280x17
    "5b_cross_4400": (24, 4400, 512, 128),  # its cross-attention on the 512 text tokens
    "5b_self_27280": (24, 27280, 27280, 128),  # 704x1280x121
    "a14b_self_32760": (40, 32760, 32760, 128),  # an A14B expert, 480x832x81
}
REFERENCE_MAX_TOKENS = 8192  # the fp32 reference (math backend) holds H x Sq x Sk floats


def attention_flop(heads: int, sq: int, sk: int, dim: int) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs: two GEMMs forward, five backward."""
    fwd = 4.0 * heads * sq * sk * dim
    return fwd, fwd * 3.5


def sdpa(q, k, v, backend):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)


def timed(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm())


def run_shape(name: str, kernels: dict, iters: int, warmup: int) -> dict:
    heads, sq, sk, dim = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, s, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
               for s in (sq, sk, sk))
    grad = torch.randn(1, sq, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = None
    if max(sq, sk) <= REFERENCE_MAX_TOKENS:
        qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
        out = sdpa(qf, kf, vf, SDPBackend.MATH)
        out.backward(grad.float())
        ref = (out.detach(), qf.grad, kf.grad, vf.grad)
    fwd_flop, step_flop = attention_flop(heads, sq, sk, dim)
    row: dict = {"shape": [heads, sq, sk, dim], "fwd_tflop": fwd_flop / 1e12, "fwd_bwd_tflop": step_flop / 1e12}
    first = None
    for label, (backend, activate) in kernels.items():
        activate()
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        try:
            t0 = time.perf_counter()
            out = sdpa(qq, kk, vv, backend)
            out.backward(grad)
            torch.cuda.synchronize()
            first_call_s = time.perf_counter() - t0
        except Exception as e:  # a kernel that does not take this shape: recorded, the others still run
            row[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(f"{name} {label}: {row[label]['error']}", flush=True)
            continue
        res = {"first_call_s": first_call_s}
        got = (out.detach(), qq.grad, kk.grad, vv.grad)
        if ref is not None:
            res.update(out_rel_err=rel(got[0], ref[0]), grad_rel_err=max(rel(a, b) for a, b in zip(got[1:], ref[1:])))
        if first is None:
            first = (label, got)
        else:
            res[f"out_rel_diff_vs_{first[0]}"] = rel(got[0], first[1][0])
            res[f"grad_rel_diff_vs_{first[0]}"] = max(rel(a, b) for a, b in zip(got[1:], first[1][1:]))
        del got, out
        qq.grad = kk.grad = vv.grad = None

        def fwd():
            with torch.no_grad():
                sdpa(qq, kk, vv, backend)

        def fwd_bwd():
            o = sdpa(qq, kk, vv, backend)
            o.backward(grad)
            qq.grad = kk.grad = vv.grad = None

        tf, tfb = timed(fwd, iters, warmup), timed(fwd_bwd, iters, warmup)
        mf, mfb = statistics.median(tf), statistics.median(tfb)
        res.update(fwd_ms=mf * 1e3, fwd_bwd_ms=mfb * 1e3, fwd_tflops=fwd_flop / mf / 1e12,
                   fwd_bwd_tflops=step_flop / mfb / 1e12, fwd_all_ms=[x * 1e3 for x in tf],
                   fwd_bwd_all_ms=[x * 1e3 for x in tfb])
        row[label] = res
        print(f"{name} {label}: fwd {mf * 1e3:.2f} ms ({res['fwd_tflops']:.0f} TFLOP/s), fwd+bwd {mfb * 1e3:.2f} ms "
              f"({res['fwd_bwd_tflops']:.0f} TFLOP/s)"
              + (f", out err {res['out_rel_err']:.2e}, grad err {res['grad_rel_err']:.2e}" if ref is not None else "")
              + "".join(f", {k} {v:.2e}" for k, v in res.items() if "diff_vs" in k), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "capability": list(torch.cuda.get_device_capability())}
    kernels = {"cudnn": (SDPBackend.CUDNN_ATTENTION, deactivate_fa4),
               "flash_builtin": (SDPBackend.FLASH_ATTENTION, deactivate_fa4)}
    missing = fa4_missing()
    if missing:  # recorded: the A/B then runs without it
        info["fa4_unavailable"] = missing
        print(f"FA4 not available: {missing}", flush=True)
    else:
        from importlib.metadata import version

        info["flash_attn_4"] = version("flash-attn-4")
        kernels["fa4"] = (SDPBackend.FLASH_ATTENTION, activate_fa4)
    results = {"info": info, "shapes": {}}
    for name in args.shapes.split(","):
        iters = args.iters if SHAPES[name][1] <= 8192 else max(3, args.iters // 4)
        results["shapes"][name] = run_shape(name, kernels, iters, args.warmup)
        torch.cuda.empty_cache()
    deactivate_fa4()
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
