"""Time one LoRA training step: the plain diffusers+peft loop (baseline) and wanexp's LightningModule step.

Both run on the same card in one process, from the same local model folder, on cached-latent-shaped inputs
(random latents and text embeddings: throughput does not depend on values). Prints a table and writes JSON.

    python -m wanexp.cli.bench --model-path /models/Wan2.2-TI2V-5B-Diffusers --height 704 --width 1280 --frames 17
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from wanexp.perf import transformer_step_flops

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_steps(step, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def baseline_step(model_path: str, latent_shape, text_len: int, rank: int, ckpt: bool, device):
    """The plain loop of performance.md: bf16 DiT, fp32 peft LoRA, AdamW, scalar timestep, eager."""
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig

    t = WanTransformer3DModel.from_pretrained(model_path, subfolder="transformer", dtype=torch.bfloat16).to(device)
    t.requires_grad_(False)
    t.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS))
    params = [p for n, p in t.named_parameters() if "lora_" in n]
    for p in params:
        p.data = p.data.float()
        p.requires_grad_(True)
    if ckpt:
        t.enable_gradient_checkpointing()
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(latent_shape, device=device, generator=g)
    text = torch.randn(latent_shape[0], text_len, t.config.text_dim, device=device, dtype=torch.bfloat16, generator=g)

    def step():
        sigma = torch.rand(x0.shape[0], device=device)
        noise = torch.randn_like(x0)
        x_t = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * noise
        pred = t(x_t.to(torch.bfloat16), sigma * 1000, text, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), noise - x0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return t, step


def wanexp_step(model_path: str, latent_shape, text_len: int, rank: int, ckpt: bool, device):
    """The training step as `python train.py` builds it (model, adapter, objective and optimizer from the default
    config: TI2V conditioning with per-token timesteps and first-frame draws), on encoded-batch-shaped inputs."""
    from wanexp.config import compose
    from wanexp.models.encode import EncodedBatch
    from wanexp.module import WanModule
    from wanexp.train import build

    cfg = compose(["model=ti2v5b", f"model.path={model_path}", f"model.gradient_checkpointing={ckpt}",
                   f"model.text_len={text_len}", "model.first_frame_cond=0.5", f"adapter.rank={rank}",
                   f"adapter.alpha={rank}"])
    o = cfg.optim
    module = WanModule(build(cfg.model), build(cfg.adapter), build(cfg.objective), cfg.boundary,
                       optimizer=build(o.optimizer), lr=o.lr,
                       schedule={k: o[k] for k in ("scheduler", "warmup_steps", "min_lr_ratio")}, load_encoders=False)
    module.configure_model()
    module.to(device).train()
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(latent_shape, device=device, generator=g)
    dim = module.transformers["dense"].config.text_dim
    text = torch.randn(latent_shape[0], text_len, dim, device=device, dtype=torch.bfloat16, generator=g)
    batch = EncodedBatch(x0, text)

    def step():
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss = module.objective(batch, module.denoiser).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return module, step


def measure(name, builder, args, latent_shape, device) -> dict:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, step = builder(args.model_path, latent_shape, args.text_len, args.rank, args.ckpt, device)
    times = _time_steps(step, args.warmup, args.steps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    cfg = json.loads((Path(args.model_path) / "transformer" / "config.json").read_text())
    flops = transformer_step_flops(cfg, latent_shape, args.text_len, args.ckpt)
    tokens = latent_shape[0] * latent_shape[2] * (latent_shape[3] // 2) * (latent_shape[4] // 2)
    med = statistics.median(times)
    del model, step
    gc.collect()
    return {"path": name, "tokens": tokens, "ckpt": args.ckpt, "median_s": med, "times_s": times,
            "peak_gib": peak, "tflops": flops / med / 1e12}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True, help="local diffusers-format TI2V-5B folder (transformer/ is used)")
    ap.add_argument("--height", type=int, default=704)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--ckpt", action="store_true", help="activation (gradient) checkpointing")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--paths", default="baseline,wanexp")
    ap.add_argument("--json", default=None, help="append results to this JSON file")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    latent_shape = (args.batch, 48, (args.frames - 1) // 4 + 1, args.height // 16, args.width // 16)
    builders = {"baseline": baseline_step, "wanexp": wanexp_step}
    results = [measure(p, builders[p], args, latent_shape, device) for p in args.paths.split(",")]
    base = next((r for r in results if r["path"] == "baseline"), None)
    print(f"{'path':10} {'tokens':>7} {'ckpt':>5} {'step ms':>9} {'TFLOP/s':>8} {'peak GiB':>9} {'vs baseline':>11}")
    for r in results:
        ratio = base["median_s"] / r["median_s"] if base else float("nan")
        r["speedup_vs_baseline"] = ratio
        print(f"{r['path']:10} {r['tokens']:>7} {str(r['ckpt']):>5} {1000 * r['median_s']:>9.1f} "
              f"{r['tflops']:>8.1f} {r['peak_gib']:>9.1f} {ratio:>10.2f}x")
    if args.json:
        path = Path(args.json)
        old = json.loads(path.read_text()) if path.exists() else []
        info = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__}
        path.write_text(json.dumps(old + [dict(r, **info) for r in results], indent=2))
    return results


if __name__ == "__main__":
    main()
