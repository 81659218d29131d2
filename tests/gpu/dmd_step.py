"""Time and size DMD's training steps on a real-size DiT (random weights), one GPU; and the fp16/bf16 output error.

    python tests/gpu/dmd_step.py --model-path DIR [--frames 17] [--steps 8] [--json F]

The generator and critic steps run as DiffusionModule._manual_step does (the default objective=dmd config: student steps
1000/750/500/250, CFG 6, one base serving as teacher, generator and critic), under bf16 autocast with the fused AdamW
of each adapter; the text embeddings are random (no UMT5 needed). Prints the median step time of each phase, the peak
memory, and then the relative output error of one forward with fp16 and bf16 base weights against fp32.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch


def build_module(model_path: str, overrides: list[str]):
    from wanexp.config import compose
    from wanexp.module import DiffusionModule
    from wanexp.composition import build

    cfg = compose(["model=ti2v5b", f"model.path={model_path}", "objective=dmd", "model.first_frame_cond=0.5",
                   *overrides])
    o = cfg.optim
    module = DiffusionModule(build(cfg.model), build(cfg.adapter), build(cfg.objective), cfg.boundary,
                       optimizer=build(o.optimizer), lr=o.lr,
                       schedule={k: o[k] for k in ("scheduler", "warmup_steps", "min_lr_ratio")}, load_encoders=False)
    module.configure_model()
    return module, cfg


def dmd_timing(args) -> dict:
    from wanexp.adapters import use_adapter
    from wanexp.models.encoders import EncodedBatch
    from wanexp.optim import build_optimizer

    dev = torch.device("cuda")
    module, cfg = build_module(args.model_path, [f"model.gradient_checkpointing={args.ckpt}", "adapter.rank=64",
                                                 "adapter.alpha=32"])
    module.to(dev).train()
    obj = module.objective
    opts = {}
    for name, o in obj.optimizer_settings().items():
        params = [p for n, p in module.named_parameters() if p.requires_grad and f".{name}." in n]
        opts[name] = build_optimizer(module.optimizer_factory, params, float(o["lr"]),
                                     weight_decay=float(o["weight_decay"]), eps=float(o["eps"]), betas=tuple(o["betas"]))
    t = next(iter(module.transformers.values()))
    lat = (1, 48, (args.frames - 1) // 4 + 1, args.height // 16, args.width // 16)
    g = torch.Generator(device=dev).manual_seed(0)
    batch = EncodedBatch(torch.randn(lat, device=dev, generator=g),
                         torch.randn(1, 512, t.config.text_dim, device=dev, generator=g, dtype=torch.bfloat16))
    neg = torch.zeros(1, 512, t.config.text_dim, device=dev, dtype=torch.bfloat16)
    modules = list(module.transformers.values())
    times = {"gen": [], "critic": []}
    exits = {"gen": [], "critic": []}
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps * (obj.generator_every + 1)):
        phase = obj.phase(step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = obj(batch, module.denoiser, step=step, negative_text=neg)
        with use_adapter(modules, out.adapter):
            out.loss.backward()
        opt = opts[phase]
        torch.nn.utils.clip_grad_norm_([p for grp in opt.param_groups for p in grp["params"] if p.grad is not None],
                                       obj.optimizer_settings()[phase]["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times[phase].append(time.perf_counter() - t0)
            exits[phase].append(obj.exit_step(step))
    res = {"tokens": lat[2] * (lat[3] // 2) * (lat[4] // 2), "ckpt": args.ckpt, "rank": 64,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
           **{f"{p}_median_s": statistics.median(v) for p, v in times.items() if v},
           **{f"{p}_times_s": v for p, v in times.items()}, **{f"{p}_exit_steps": v for p, v in exits.items()}}
    per_cycle = obj.generator_every * res["critic_median_s"] + res["gen_median_s"]
    res["mean_step_s"] = per_cycle / (obj.generator_every + 1)
    del module, opts
    torch.cuda.empty_cache()
    return res


def dtype_error(args) -> dict:
    """One forward of the DiT with fp16 and with bf16 weights (and autocast) against fp32, same inputs."""
    from diffusers import WanTransformer3DModel

    dev = torch.device("cuda")
    ref = WanTransformer3DModel.from_pretrained(args.model_path, subfolder="transformer", dtype=torch.float32).to(dev)
    g = torch.Generator(device=dev).manual_seed(1)
    lat = (1, 48, (args.frames - 1) // 4 + 1, args.height // 16, args.width // 16)
    x = torch.randn(lat, device=dev, generator=g)
    text = torch.randn(1, 512, ref.config.text_dim, device=dev, generator=g)
    t = torch.tensor([700.0], device=dev)
    with torch.no_grad():
        y32 = ref(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0].float()
        out = {}
        for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            m = copy.deepcopy(ref).to(dt)  # rounded once from the fp32 weights
            with torch.autocast("cuda", dtype=dt):
                y = m(hidden_states=x.to(dt), timestep=t, encoder_hidden_states=text.to(dt), return_dict=False)[0]
            y = y.float()
            out[name] = {"rel_err": float((y - y32).norm() / y32.norm()), "finite": bool(torch.isfinite(y).all()),
                         "max_abs": float(y.abs().max())}
            del m
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--height", type=int, default=704)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--ckpt", action="store_true")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3, help="generator/critic cycles timed")
    ap.add_argument("--json")
    ap.add_argument("--skip-dtype", action="store_true")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "dmd": dmd_timing(args)}
    if not args.skip_dtype:
        res["dtype_error"] = dtype_error(args)
    print(json.dumps({k: v for k, v in res.items()}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
