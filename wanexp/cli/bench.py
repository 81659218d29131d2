"""Time one LoRA training step three ways on the same card, and check that wanexp's step computes the plain function.

    plain         the plain reference loop of the model's family (``ModelSpec.plain_loop``; Wan2.2's is
                  wanexp/models/wan22/plain_loop.py), as users write it: the diffusers DiT in bf16, peft LoRA (rank r,
                  alpha = r) with fp32 LoRA parameters, the forward under torch.autocast(bf16), fp32 MSE,
                  torch.optim.AdamW(params, lr) (PyTorch's default implementation: foreach, not fused), eager, one
                  timestep per sample.
    plain_tokens  a family with per-token timesteps (TI2V-5B): the same loop with the pipeline's per-token timesteps
                  (shape (B, tokens)), the first latent frame clean at t=0 (what a correct TI2V step computes).
    plain_compiled, plain_tokens_compiled   (--paths all, or named)
                  the same loops with each transformer block compiled (``block.compile()`` for each block, the one
                  line a skilled user adds; --compile-backend, default inductor), checkpointed with --ckpt as the
                  eager loops are (diffusers' enable_gradient_checkpointing: each compiled block under
                  torch.utils.checkpoint).
    wanexp        the project's step as `python train.py` builds it from the default config (+ --set overrides):
                  DiffusionModule with its spec (fast modulation, compiled blocks, attention backend as configured),
                  adapter, objective (sigma, noise and first-frame draws, the layout's conditioning, masked loss) and
                  the configured optimizer through wanexp.optim.build_optimizer (fused AdamW on a GPU); forward under
                  autocast as trainer.precision=bf16-mixed runs it. What is not timed: Lightning's loop, logging and
                  callbacks.

Numerics: the wanexp step and the plain loop of the same function (plain_tokens for TI2V-5B with a clean first frame
and without; plain for A14B) are run on identical weights (the same random LoRA A and B) and inputs (the same sigma,
noise and first-frame draws): the relative error of the DiT output and of the LoRA gradients is printed. With the
plain loop's function also run in fp32 (--fp32-floor; on by default where it fits), each bf16 path's distance to it
is printed too. The compiled plain loop of that function (plain_tokens_compiled, or plain_compiled for A14B) is checked
the same way, when it runs. A path passes when it is within --tol (1e-2) of the plain bf16 loop, or no further from
the fp32 function than the plain loop is (a compiled graph may round in other places than eager bf16: see
``verdict``); the command exits 1 when a path does neither.

    python -m wanexp.cli.bench --model-path /models/Wan2.2-TI2V-5B-Diffusers --frames 17 --json bench.json
    python -m wanexp.cli.bench --model t2v14b --model-path /models/Wan2.2-T2V-A14B-Diffusers --height 480 \\
        --width 832 --frames 81 --ckpt --paths plain,wanexp --json bench.json

Inputs are cached-latent-shaped random tensors (throughput does not depend on values). The table gives ms/step (median
after warm-up), TFLOP/s (the family's FLOP formula), % of 790 TFLOP/s (a large bf16 matmul on H100), peak
GiB (torch.cuda.max_memory_allocated, weights included) and each path's speed-up over the strongest plain loop (the
fastest plain path measured; the JSON also has the speed-up over each plain loop); each path's
line below the table also gives its steps run back to back (``back_to_back_s``: no sync between steps, as a training
loop runs them; the table's steps are each synchronized so that each can be timed).
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from wanexp.errors import ConfigError, UserError, refuse
from wanexp.models.attention import deactivate_fa4

PEAK_TFLOPS = 790.0  # a large bf16 matmul on one H100 (docs/performance.md)
CHECK_SEED = 1234


def plain_loop(model: str):
    """The plain reference loop of model group ``model``'s family (``ModelSpec.plain_loop``: a module with
    ``supports``, ``folder``, ``dense``, ``geometry``, ``step_flops``, ``plain_model``, ``plain_inputs``,
    ``plain_forward``, ``plain_loss``, ``plain_step``); one line when there is none for it."""
    from wanexp.models.family import spec_class

    loop = spec_class(model, "--model").plain_loop()
    if loop is None or not loop.supports(model):
        raise ConfigError(f"--model {model}: its family has no plain reference loop for this model to compare "
                          "against (the bench times a DiT whose input is the latents alone)")
    return loop


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


def _time_back_to_back(step, steps: int) -> float:
    """Mean seconds per step of ``steps`` steps run as a training loop runs them: no sync between steps (the host
    queues the next step while the GPU runs this one), the GPU synchronized at both ends only."""
    _sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync()
    return (time.perf_counter() - t0) / steps


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _autocast(device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


# ---- the plain loop ----------------------------------------------------------------------------------------------
PLAIN_PATHS = ("plain", "plain_compiled", "plain_tokens", "plain_tokens_compiled")
PATHS = (*PLAIN_PATHS, "wanexp")


def plain_kind(name: str) -> tuple[bool, bool]:
    """(per-token timesteps, blocks compiled) of a plain path."""
    return name.startswith("plain_tokens"), name.endswith("_compiled")


def default_paths(per_token: bool, compiled: bool = False) -> list[str]:
    """The plain loops that apply (per-token ones for TI2V only; the compiled ones with ``compiled``: --paths all),
    then wanexp."""
    return [p for p in PLAIN_PATHS if (per_token or not plain_kind(p)[0]) and (compiled or not plain_kind(p)[1])] \
        + ["wanexp"]


# ---- wanexp's step -----------------------------------------------------------------------------------------------
def wanexp_module(args, device):
    from wanexp.config import compose
    from wanexp.module import DiffusionModule
    from wanexp.composition import build

    overrides = [f"model={args.model}", f"model.path={args.model_path}", f"model.gradient_checkpointing={args.ckpt}",
                 f"model.text_len={args.text_len}", f"adapter.rank={args.rank}", f"adapter.alpha={args.rank}",
                 *([] if args.loop.dense(args.model) else [f"boundary={args.boundary}"]), *args.set]
    cfg = compose(overrides)
    o = cfg.optim
    module = DiffusionModule(build(cfg.model), build(cfg.adapter), build(cfg.objective), cfg.boundary,
                       optimizer=build(o.optimizer), lr=o.lr,
                       schedule={k: o[k] for k in ("scheduler", "warmup_steps", "min_lr_ratio")}, load_encoders=False,
                       max_steps=1000)
    module.configure_model()
    module.to(device).train()
    return module, cfg


def wanexp_step(args, device, data, module_cfg=None):
    from wanexp.models.encoders import EncodedBatch

    module, cfg = module_cfg or wanexp_module(args, device)
    opt = module.configure_optimizers()["optimizer"]  # wanexp.optim.build_optimizer, as training builds it
    batch = EncodedBatch(*data)

    def step():
        if module.spec.cuda_graphs:  # as DiffusionModule.training_step
            torch.compiler.cudagraph_mark_step_begin()
        with _autocast(device):
            loss = module.objective(batch, module.denoiser).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    m = cfg.model
    info = {"optimizer": f"{type(opt).__module__}.{type(opt).__name__} fused={opt.defaults.get('fused')}",
            "fast_modulation": bool(m.fast_modulation), "compile": bool(m.compile),
            "attention_backend": m.attention_backend, "first_frame_cond": float(m.first_frame_cond),
            "overrides": list(args.set)}
    return module, step, info


# ---- numerics: wanexp's step vs the plain loop of the same function -----------------------------------------------
def lora_tensors(named_params, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random values for every LoRA tensor (B too, so that A gets a gradient), by parameter name."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, p in sorted(named_params):
        out[n] = torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5)
    return out


def _lora_names(named):
    """Parameter name -> name relative to the transformer (wanexp's are prefixed by transformers.<expert>.)."""
    return [(n.split(".", 2)[2] if n.startswith("transformers.") else n, p) for n, p in named if "lora_" in n]


def draws(objective, sigma_range, x0, first_frame_cond: float, seed: int):
    """The objective's draws for a generator seeded ``seed``, in its order: sigma, noise, first frame."""
    g = torch.Generator().manual_seed(seed)
    sigma = objective.sample_sigmas(x0.shape[0], *sigma_range, generator=g)
    noise = torch.randn(x0.shape, generator=g, dtype=x0.dtype)
    first = torch.rand(x0.shape[0], generator=g) < float(first_frame_cond)
    return sigma, noise, first


def reference(args, device, data, objective, sigma_range, per_token: bool, dtype=torch.bfloat16,
              model=None) -> list[dict]:
    """Plain loop outputs and LoRA gradients for each first-frame case (fresh model, or ``model``: a plain_model
    (transformer, LoRA params); seeded LoRA values); with ``dtype=float32`` the same function in fp32 without autocast
    (the exact function, up to fp32 rounding)."""
    loop = args.loop
    t, params = model or loop.plain_model(args, device, dtype)
    named = _lora_names(t.named_parameters())
    values = lora_tensors(named, CHECK_SEED)
    with torch.no_grad():
        for n, p in named:
            p.copy_(values[n])
    x0, text = data
    refs = []
    for ffc in ((1.0, 0.0) if per_token else (0.0,)):
        sigma, noise, first = draws(objective, sigma_range, x0, ffc, CHECK_SEED)
        sigma, noise = sigma.to(device), noise.to(device)
        hidden, timestep, mask = loop.plain_inputs(x0, noise, sigma, first, per_token)
        s = sigma.view(-1, 1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * noise
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=dtype != torch.float32):
            pred = loop.plain_forward(t, hidden.to(dtype), timestep, text.to(dtype))
        loss = loop.plain_loss(pred, noise - x0, mask)
        loss.backward()
        refs.append({"first_frame_cond": ffc, "x_t": x_t.cpu(), "out": pred.detach().float().cpu(),
                     "grads": {n: p.grad.detach().cpu() for n, p in named}, "loss": loss.item()})
        t.zero_grad(set_to_none=True)
    del t, params
    return refs, values


class Recorder:
    """Wraps the module's denoiser to keep what the objective fed it and what it returned."""

    def __init__(self, denoiser):
        self.inner, self.seen = denoiser, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, x_t, sigma, batch):
        pred = self.inner(x_t, sigma, batch)
        self.seen = {"x_t": x_t.detach(), "out": pred.velocity.detach().float()}
        return pred


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def grads_rel(grads: dict, ref: dict) -> float:
    names = sorted(ref)
    return rel(torch.cat([grads[n].flatten() for n in names]), torch.cat([ref[n].flatten() for n in names]))


def bf16_floor(refs: list[dict], exact: list[dict]) -> list[dict]:
    """How far the plain bf16 loop is from the fp32 function (per first-frame case): two bf16 computations of the
    same function (other kernels, other accumulation orders) differ from each other by about as much."""
    return [{"plain_out_vs_fp32": rel(r["out"], e["out"]), "plain_grad_vs_fp32": grads_rel(r["grads"], e["grads"]),
             "out": e["out"], "grads": e["grads"]} for r, e in zip(refs, exact)]


def check(module, data, refs, values, tol: float, floor: list[dict] | None = None) -> list[dict]:
    from wanexp.models.encoders import EncodedBatch

    named = _lora_names(module.named_parameters())
    assert sorted(n for n, _ in named) == sorted(values), "wanexp's LoRA tensors differ from the plain loop's"
    with torch.no_grad():
        for n, p in named:
            p.copy_(values[n])
    device = data[0].device
    rec = Recorder(module.denoiser)
    spec = module.spec
    saved_ffc = spec.first_frame_cond
    rows = []
    for ref in refs:
        spec.first_frame_cond = ref["first_frame_cond"]
        with _autocast(device):
            loss = module.objective(EncodedBatch(*data), rec, generator=torch.Generator().manual_seed(CHECK_SEED)).loss
        loss.backward()
        # the objective drew what the plain loop drew (sigma, noise, first frame): x_t is the same tensor
        got = {"x_t": rec.seen["x_t"].float().cpu(), "out": rec.seen["out"].cpu(),
               "grads": {n: p.grad.cpu() for n, p in named}, "loss": loss.item()}
        rows.append(compare(got, ref, None if floor is None else floor[len(rows)]))
        module.zero_grad(set_to_none=True)
    spec.first_frame_cond = saved_ffc
    for r in rows:
        verdict(r, tol)
    return rows


def compare(got: dict, ref: dict, floor: dict | None) -> dict:
    """One numerics row: a path's input, output and LoRA gradients (``got``, keyed as reference() keys them) against
    the plain bf16 loop's (``ref``) and, with ``floor``, both against the fp32 function."""
    grad_err = {n: rel(g, ref["grads"][n]) for n, g in got["grads"].items()}
    worst = max(grad_err, key=grad_err.get)
    row = {"first_frame": bool(ref["first_frame_cond"]),
           "input_max_abs_diff": (got["x_t"].float() - ref["x_t"]).abs().max().item(),
           "out_rel_err": rel(got["out"], ref["out"]), "grad_rel_err_all": grads_rel(got["grads"], ref["grads"]),
           "grad_rel_err_worst": grad_err[worst], "grad_worst_tensor": worst,
           "loss": got["loss"], "loss_plain": ref["loss"]}
    if floor is not None:  # both bf16 computations measured against the fp32 function
        row.update(out_vs_fp32=rel(got["out"], floor["out"]), grad_vs_fp32=grads_rel(got["grads"], floor["grads"]),
                   plain_out_vs_fp32=floor["plain_out_vs_fp32"], plain_grad_vs_fp32=floor["plain_grad_vs_fp32"])
    return row


def check_plain(label: str, got: list[dict], refs: list[dict], tol: float,
                floor: list[dict] | None = None) -> list[dict]:
    """The numerics rows of a compiled plain loop: its reference() (same seeded LoRA values and draws) against the
    eager plain loop's, per first-frame case."""
    rows = [compare(g, r, None if floor is None else floor[i]) for i, (g, r) in enumerate(zip(got, refs))]
    return [verdict({**r, "path": label}, tol) for r in rows]


FP32_MARGIN = 1.1  # a path as far from the fp32 function as the plain bf16 loop, within 10 %, computes it as well


def verdict(r: dict, tol: float) -> dict:
    """A numerics row passes when the inputs were the same and either its output and LoRA gradients are within
    ``tol`` of the plain bf16 loop's, or (with the fp32 function measured) they are no further from the fp32 function
    than the plain loop's are (``FP32_MARGIN``). Two bf16 computations that round in other places (a compiled graph
    that keeps a fused chain in fp32, e.g. model.compile_checkpoint) differ from each other by up to the bf16 floor
    itself, while being as close to the exact function. Sets ``ok`` and ``ok_by`` ("plain", "fp32" or None)."""
    near_plain = r["out_rel_err"] <= tol and r["grad_rel_err_all"] <= tol and r["grad_rel_err_worst"] <= tol
    near_exact = "out_vs_fp32" in r and r["out_vs_fp32"] <= FP32_MARGIN * r["plain_out_vs_fp32"] \
        and r["grad_vs_fp32"] <= FP32_MARGIN * r["plain_grad_vs_fp32"]
    same_input = r["input_max_abs_diff"] < 1e-5
    r["ok_by"] = None if not same_input else "plain" if near_plain else "fp32" if near_exact else None
    r["ok"] = r["ok_by"] is not None
    return r


FP32_FULL, FP32_SHORT = 0.4, 0.8  # the fp32 transformer's share of the GPU up to which each plan runs
SHORT_LATENT_FRAMES = 2  # the short clip of the numerics check: its first latent frames (TI2V: one clean, one noisy)


def fp32_plan(args, device) -> str:
    """Where the fp32 function runs (--fp32-floor): ``"full"`` on the bench's clip, ``"short"`` with the whole
    numerics check (plain bf16 loop, fp32 function, each wanexp path) on the clip's first SHORT_LATENT_FRAMES latent
    frames, or ``"off"``. ``on`` is full; ``auto`` is full where the fp32 transformer (twice its bf16 files) takes at
    most 40 % of the GPU (TI2V-5B on an 80 GB card), short where at most 80 % (an A14B expert's 57 GB on an 80 GB
    card, where its fp32 step with checkpointing runs on a short clip), else off. The error is per token:
    a short clip measures the same function as a long one."""
    if args.fp32_floor != "auto":
        return {"on": "full", "short": "short", "off": "off"}[args.fp32_floor]
    if device.type != "cuda":
        return "full"
    sub = args.loop.folder(args.model)
    size = 2 * sum(f.stat().st_size for f in (Path(args.model_path) / sub).glob("*.safetensors"))
    share = size / torch.cuda.get_device_properties(device).total_memory
    return "full" if share <= FP32_FULL else "short" if share <= FP32_SHORT else "off"


PROFILE_LISTS = ("longest kernel", "top kernels", "gaps")  # profile_kinds' entries that are not ms per step
PROFILE_TOP_JSON, PROFILE_TOP_PRINTED = 100, 25  # the kernels with the most GPU time: in --json, and printed


# ---- running it ------------------------------------------------------------------------------------------------
def profiled(name: str, profile: str) -> bool:
    """Whether ``--profile``'s value (comma-separated path names; empty: none) names the path ``name``."""
    return name in profile.split(",")


def profile_kinds(step, steps: int = 2) -> dict:
    """GPU time per step by kernel kind (torch.profiler), the step's wall time under the profiler, the kernels with the
    most time and the longest times the GPU waited (with the kernels either side), for a "where the time goes" table.
    Only the GPU's activity is recorded: tracing the host's ops too would slow the host, and so widen the gaps it
    leaves, several times over."""
    from torch.profiler import ProfilerActivity, profile

    from wanexp.perf import gpu_busy_ms, gpu_gaps, gpu_time_by_kind, gpu_top_kernels

    _sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        _sync()
    wall = (time.perf_counter() - t0) / steps
    events = prof.events()
    kinds, top = gpu_time_by_kind(events, steps)
    kinds["total GPU busy"] = gpu_busy_ms(events, steps)
    kinds["step wall (profiled)"] = 1000 * wall
    kinds["longest kernel"] = top
    kinds["top kernels"] = gpu_top_kernels(events, steps, top=PROFILE_TOP_JSON)
    kinds["gaps"] = gpu_gaps(events, top=10, min_ms=0.2)
    return kinds


def card_telemetry(device):
    """The card's SM clock and power, sampled while the bench runs (:class:`wanexp.perf.CardTelemetry`); None on
    the CPU."""
    if device.type != "cuda":
        return None
    from wanexp.perf import CardTelemetry

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    telemetry = CardTelemetry(gpu=f"GPU-{uuid}" if uuid is not None else None)
    atexit.register(telemetry.close)
    return telemetry


def measure(name, make, args, device, data, flops) -> dict:
    _free()
    # each path compiles its own graphs: another path's shapes would make dynamo recompile them dynamic in shape
    torch.compiler.reset()
    t0 = time.perf_counter()
    model, step, info = make()
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _time_steps(step, args.warmup, 0)
    started = time.time()  # after the warm-up (and its compilation): the card's telemetry window
    times = _time_steps(step, 0, args.steps)
    back_to_back = _time_back_to_back(step, args.steps)
    total_s, ended = time.perf_counter() - t0, time.time()
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    med = statistics.median(times)
    telemetry = getattr(args, "telemetry", None)
    if telemetry is not None and (card := telemetry.window(started, ended)):
        info["card"] = card  # the SM clock and power while its steps ran
    if device.type == "cuda" and profiled(name, args.profile):
        info["profile_ms"] = profile_kinds(step)
    del model, step
    _free()
    card = (f", SM {info['card']['sm_mhz']:.0f} MHz at {info['card']['power_w']:.0f} W" if "card" in info else "")
    print(f"wanexp-bench: {name}: {1000 * med:.1f} ms/step, peak {peak:.1f} GiB{card} (built in {build_s:.0f} s)",
          flush=True)
    # timed_at: the timed steps' wall-clock span (Unix seconds; after the warm-up), to line up with telemetry
    return {"path": name, "median_s": med, "timed_at": [started, ended], "times_s": times,
            "back_to_back_s": back_to_back, "peak_gib": peak,
            "tflops": flops / med / 1e12, "pct_of_peak": 100 * flops / med / 1e12 / PEAK_TFLOPS, "build_s": build_s,
            "warmup_and_steps_s": total_s, **info}


# variants measured for their error, not checked against the tolerance
CHANGES_NUMERICS = ("model.fp8=true", "model.fp8_storage=true")


def main(argv=None) -> list[dict]:
    """Run the benchmark; returns the results (one dict per path); exits 1 when the numerics check fails."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True, help="local diffusers-format folder (transformer/ is used)")
    ap.add_argument("--model", default="ti2v5b", help="the model group (conf/model) whose family's plain loop runs")
    ap.add_argument("--boundary", default="high", help="A14B: the expert trained (its transformer/ folder: high)")
    ap.add_argument("--height", type=int, default=704)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--ckpt", action="store_true", help="activation (gradient) checkpointing")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--paths", default=None, help=f"comma list of {','.join(PATHS)}, or all (default: the eager plain "
                    "loops that apply and wanexp; all adds the compiled plain loops)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the compiled plain loops (block.compile(backend=...))")
    ap.add_argument("--variants", default="", help="extra wanexp runs, ';'-separated lists of space-separated "
                    "overrides, e.g. 'model.compile=false;model.attention_backend=_native_cudnn'")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides for the wanexp path")
    ap.add_argument("--tol", type=float, default=1e-2, help="numerics check: largest relative error allowed")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--fp32-floor", nargs="?", const="on", default="auto", choices=["auto", "on", "short", "off"],
                    help="also run the plain loop's function in fp32 and print how far each bf16 path is from it "
                         "(the bf16 noise floor: what the difference between two bf16 paths should be compared with; "
                         "a path as close to it as the plain loop passes the check). on: on the bench's clip; short: "
                         "the whole numerics check on the clip's first 2 latent frames; auto (default): on where the "
                         "fp32 transformer takes at most 40 %% of the GPU (TI2V-5B on an 80 GB card), short where at "
                         "most 80 %% (an A14B expert on an 80 GB card), else off")
    ap.add_argument("--profile", nargs="?", const="wanexp", default="",
                    help="GPU time by kernel kind for these paths (default: wanexp), the kernels with the most time "
                         "and the GPU's longest waits")
    ap.add_argument("--json", default=None, help="append this run (results + card, torch, date) to this JSON file")
    args = ap.parse_args(argv)
    unknown = [p for p in args.paths.split(",") if p not in PATHS] if args.paths not in (None, "all") else []
    if unknown:  # before any model is read
        ap.error(f"--paths: unknown path {unknown[0]!r} (one of {', '.join(PATHS)})")
    args.loop = loop = plain_loop(args.model)
    folder = Path(args.model_path) / loop.folder(args.model)
    if not (folder / "config.json").is_file():  # before any model is read
        raise ConfigError(f"--model-path {args.model_path}: no {folder.name}/config.json there; point it at a local "
                          f"diffusers-format {args.model} folder")
    if args.json:  # made now: the JSON is written after minutes of benchmarking
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    if loop.dense(args.model):
        args.boundary = "full"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.telemetry = card_telemetry(device)
    geo = loop.geometry(args.model, args.model_path)
    ft, fh, fw = geo["vae_stride"]
    per_token = geo["per_token"]
    latent_shape = (args.batch, geo["latent_channels"], (args.frames - 1) // ft + 1, args.height // fh,
                    args.width // fw)
    flops = loop.step_flops(geo["config"], latent_shape, args.text_len, args.ckpt)
    pt, ph, pw = geo["patch"]
    tokens = latent_shape[2] // pt * (latent_shape[3] // ph) * (latent_shape[4] // pw)
    g = torch.Generator(device=device).manual_seed(0)
    x0 = torch.randn(latent_shape, device=device, generator=g)
    text = torch.randn(args.batch, args.text_len, geo["text_dim"], device=device, generator=g).to(torch.bfloat16)
    data = (x0, text)
    paths = default_paths(per_token, args.paths == "all") if args.paths in (None, "all") else args.paths.split(",")
    # the compiled plain loop of the function the numerics check measures is checked too
    plain_ref = "plain_tokens" if per_token else "plain"
    checked = [p for p in ("wanexp", plain_ref + "_compiled") if p in paths] if not args.no_check else []
    variants = [v.split() for v in args.variants.split(";") if v.strip()]
    print(f"wanexp bench: {args.model} {args.height}x{args.width}x{args.frames}, latents {tuple(latent_shape)}, "
          f"{tokens} tokens, ckpt={args.ckpt}, LoRA r{args.rank}, {flops / 1e12:.1f} TFLOP/step, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}", flush=True)

    results, checks = [], []
    refs = values = floor = None
    plan = fp32_plan(args, device)
    check_data = data
    if plan == "short" and latent_shape[2] > SHORT_LATENT_FRAMES:
        check_data = (x0[:, :, :SHORT_LATENT_FRAMES].contiguous(), text)
    if checked:  # the plain loop's output and LoRA gradients, kept on the host
        if check_data is not data:
            print(f"wanexp bench: the numerics check runs on the clip's first {SHORT_LATENT_FRAMES} latent frames "
                  f"(--fp32-floor {args.fp32_floor}: the fp32 function on a short clip; on: on the whole clip)",
                  flush=True)
        _free()
        refs, values = reference(args, device, check_data, _objective(args), _sigma_range(args), per_token)
        _free()
        if plan != "off":
            exact, _ = reference(args, device, check_data, _objective(args), _sigma_range(args), per_token,
                                 torch.float32)
            floor = bf16_floor(refs, exact)
            del exact
            _free()
    for name in paths:
        if name in PLAIN_PATHS:
            def make_plain(name=name):
                deactivate_fa4()  # a plain loop runs torch's own kernels, whatever a variant before it set
                tokens_t, compiled = plain_kind(name)
                model = loop.plain_model(args, device, compiled=compiled)
                if refs is not None and name in checked:  # before timing: warms the compiled blocks up too
                    got, _ = reference(args, device, check_data, _objective(args), _sigma_range(args), per_token,
                                       model=model)
                    checks.extend(check_plain(name, got, refs, args.tol, floor))
                    if check_data is not data:  # else the timed steps would run graphs made dynamic in shape
                        torch.compiler.reset()
                return loop.plain_step(args, device, data, tokens_t, compiled, model)

            results.append(measure(name, make_plain, args, device, data, flops))
        elif name == "wanexp":
            for extra in [[]] + variants:
                run_args = argparse.Namespace(**{**vars(args), "set": [*args.set, *extra]})
                label = "wanexp" + (f" [{' '.join(extra)}]" if extra else "")

                def make(run_args=run_args, label=label):
                    module_cfg = wanexp_module(run_args, device)
                    if refs is not None:  # before timing: the check's steps also warm the compiled blocks up
                        rows = check(module_cfg[0], check_data, refs, values, args.tol, floor)
                        for r in rows:
                            r["path"] = label
                        checks.extend(rows)
                        if check_data is not data:  # else the timed steps would run graphs made dynamic in shape
                            torch.compiler.reset()
                    return wanexp_step(run_args, device, data, module_cfg)

                results.append(measure(label, make, args, device, data, flops))

    for r in results:
        r.update(tokens=tokens, ckpt=args.ckpt, flops=flops)
    strongest = speedups(results)
    print("\n" + "\n".join(table(results, strongest)))
    for r in results:
        print(f"  {r['path']}: {r.get('optimizer')}; times ms {[round(1000 * t, 1) for t in r['times_s']]}; "
              f"back to back (no sync between steps) {1000 * r['back_to_back_s']:.1f} ms/step")
        if "card" in r:
            c, limit = r["card"], args.telemetry.limit_w
            print(f"    the card while they ran: SM clock {c['sm_mhz']:.0f} MHz, power {c['power_w']:.0f} W (highest "
                  f"{c['max_power_w']:.0f} W" + (f", limit {limit:.0f} W)" if limit else ")"))
    for r in results:
        if "profile_ms" in r:
            print(f"  {r['path']}: GPU ms/step by kernel kind: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r["profile_ms"].items()
                              if k not in PROFILE_LISTS))
            print(f"    longest kernel of each kind: {r['profile_ms']['longest kernel']}")
            print(f"    the {PROFILE_TOP_PRINTED} kernels with the most GPU time (ms/step, calls/step, kind, name; "
                  f"--json holds {PROFILE_TOP_JSON}):")
            for ms, calls, kind, name in r["profile_ms"]["top kernels"][:PROFILE_TOP_PRINTED]:
                print(f"      {ms:7.2f} {calls:6.0f}  {kind[:10]:10} {name}")
            print("    the longest times the GPU waited (ms, kernel before, kernel after):")
            for ms, before, after in r["profile_ms"]["gaps"]:
                print(f"      {ms:7.2f}  {before}  ->  {after}")
    ok = True
    if checks:
        ref_name = "plain_tokens" if per_token else "plain"
        print(f"\nnumerics vs the plain loop ({ref_name} function), bf16, tolerance {args.tol:g}:")
        for c in checks:
            changes = any(k in c["path"] for k in CHANGES_NUMERICS)  # reported, not held to the tolerance
            ok &= c["ok"] or changes
            word = {"plain": "ok", "fp32": "ok (as close to the fp32 function as the plain loop)"}.get(
                c["ok_by"], "differs (this knob changes the numerics)" if changes else "FAILED")
            print(f"  {c['path'][:40]:40} first_frame={str(c['first_frame']):5} out rel err {c['out_rel_err']:.2e}  "
                  f"LoRA grad rel err {c['grad_rel_err_all']:.2e} (worst tensor {c['grad_rel_err_worst']:.2e})  "
                  f"input diff {c['input_max_abs_diff']:.1e}  {word}")
            if "out_vs_fp32" in c:
                print(f"  {'':40} {'':17} vs fp32: out {c['out_vs_fp32']:.2e} (plain {c['plain_out_vs_fp32']:.2e})  "
                      f"LoRA grad {c['grad_vs_fp32']:.2e} (plain {c['plain_grad_vs_fp32']:.2e})")
    if args.json:
        path = Path(args.json)
        old = json.loads(path.read_text()) if path.exists() else []
        run = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "command": " ".join(sys.argv), "model": args.model,
               "shape": [args.height, args.width, args.frames], "latent_shape": list(latent_shape),
               "tokens": tokens, "ckpt": args.ckpt, "rank": args.rank, "flops_per_step": flops,
               "results": results, "numerics": checks, "numerics_ok": ok, "fp32_plan": plan,
               "check_latent_frames": check_data[0].shape[2], "strongest_plain": strongest,
               "compile_backend": args.compile_backend,
               "power_limit_w": args.telemetry.limit_w if args.telemetry is not None else None}
        path.write_text(json.dumps(old + [run], indent=2))
    if not ok:
        unsettled = "" if floor is not None else (" within --tol, and the fp32 function that could settle it did "
                                                   "not run (--fp32-floor short or on, with fewer --frames if needed)")
        failed = sorted({c["path"] for c in checks
                         if not c["ok"] and not any(k in c["path"] for k in CHANGES_NUMERICS)})
        print(f"wanexp bench: error: {', '.join(failed)} does not compute the plain loop's function{unsettled} (see "
              "numerics above)", file=sys.stderr)
        raise SystemExit(1)
    return results


def speedups(results: list[dict]) -> str | None:
    """Sets each path's ``speedup_vs_<plain path>`` for every plain loop measured and ``speedup_vs_strongest``
    against the fastest of them (the baseline a skilled user would have: compiled blocks, where that is faster);
    returns that loop's name (None without a plain loop)."""
    bases = [r for r in results if r["path"] in PLAIN_PATHS]
    strongest = min(bases, key=lambda b: b["median_s"]) if bases else None
    for r in results:
        for b in bases:
            r[f"speedup_vs_{b['path']}"] = b["median_s"] / r["median_s"]
        r["speedup_vs_strongest"] = strongest["median_s"] / r["median_s"] if strongest else None
    return strongest["path"] if strongest else None


def table(results: list[dict], strongest: str | None) -> list[str]:
    """The summary: one row per path, its speed-up against the strongest plain loop (speedups())."""
    head = f"{'path':58} {'ms/step':>8} {'TFLOP/s':>8} {'% 790':>6} {'peak GiB':>9} {'vs strongest':>12}"
    compiled = any(plain_kind(r["path"])[1] for r in results if r["path"] in PLAIN_PATHS)
    note = "" if compiled or not strongest else " (no compiled plain loop measured: --paths all adds them)"
    lines = [f"strongest plain loop (fastest measured): {strongest or 'none measured'}{note}", head]
    for r in results:
        ratio = f"{r['speedup_vs_strongest']:>11.2f}x" if strongest else f"{'-':>12}"
        mark = " <- strongest" if r["path"] == strongest else ""
        lines.append(f"{r['path'][:58]:58} {1000 * r['median_s']:>8.1f} {r['tflops']:>8.1f} "
                     f"{r['pct_of_peak']:>6.1f} {r['peak_gib']:>9.1f} {ratio}{mark}")
    return lines


def _objective(args):
    from wanexp.config import compose
    from wanexp.composition import build

    return build(compose([f"model={args.model}", *args.set]).objective)


def _sigma_range(args):
    from wanexp.config import compose

    b = compose([f"model={args.model}", *([f"boundary={args.boundary}"] if not args.loop.dense(args.model) else []),
                 *args.set]).boundary
    return float(b.sigma_min), float(b.sigma_max)


def entry() -> None:
    """The console command (wanexp-bench): main() returns its results for callers; a command returns nothing. Bad
    input is one line and exit 2."""
    try:
        main()
    except UserError as e:
        refuse(str(e))


if __name__ == "__main__":
    entry()
