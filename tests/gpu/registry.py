"""The GPU acceptance cases, in one registry (`python -m tests.gpu.run --list` prints them).

A case names the GPUs it needs, its phases (commands run in order, each short enough for one device call of at most
10 minutes; everything a later phase needs stays on disk under the work folder), what is read back from its run
folder, and the thresholds the result must meet. The runner (tests/gpu/run.py) runs the phases, writes
``<out>/<case>.json`` and prints PASS/FAIL. Nothing here imports torch: the registry and the read-back are checked
on CPU (tests/unit/test_gpu_registry.py).
"""
from __future__ import annotations

import csv
import json
import math
import operator
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tests.gpu.write_single_files import DIT_FILES, TOKENIZER, UMT5_FILE, VAE_FILE

REPO = Path(__file__).resolve().parents[2]
# tests/gpu files that no case's command names: the runner and the registry, what the builds read, the machine setup
PARTS = {
    "__init__.py": "the package",
    "registry.py": "the cases",
    "run.py": "the runner (python -m tests.gpu.run)",
    "real_sizes.yaml": "the real-size build sections build_random_model.py reads",
    "setup_env.sh": "installs the carried wheels once per machine (run.py's prepare_env)",
    "ab_bench.sh": "the step of two source trees on one card in one call (a change's before and after: "
                   "benchmarks/ti2v5b_h200_2026-11-28.md)",
    "wheels.sh": "the wheels setup_env.sh installs, downloaded here from requirements.lock (.whl/)",
    "fa4_parts.sh": "FlashAttention-4's wheels split for the device machine's carry (attention_fa4)",
    "setup_fa4.sh": "installs them there from the staged parts (attention_fa4)",
}
CAP_GIB = 28  # the user's 32 GB cards, less what the driver, CUDA context and other processes take


@dataclass(frozen=True)
class Ctx:
    """Where a case keeps its state (``work``: models, data, caches, run folders; kept between device calls) and
    writes its results (``out``)."""

    work: Path
    out: Path
    python: str = sys.executable

    def run_dir(self, name: str) -> Path:
        return self.work / "runs" / name

    def results(self, case: str) -> Path:
        """What a case's phases write for the judge (bench JSON, strips): under ``work``, so a later device call on
        the same machine (whose ``out`` starts empty) still reads them; run.py copies them into ``<out>/<case>/``."""
        return self.work / "results" / case  # run.py makes it before each phase


@dataclass(frozen=True)
class KillAt:
    """Kill the phase's process group with SIGKILL once its status.json reports ``step`` (or after ``deadline_s``,
    so the phase ends inside one device call even when steps are slower than expected)."""

    step: int
    deadline_s: int
    run: Callable[[Ctx], Path]  # the run folder whose status.json and checkpoints/ are watched


@dataclass(frozen=True)
class Phase:
    name: str
    argv: Callable[[Ctx], list[str]]
    minutes: float  # expected wall minutes on one H100 (one device call allows 10)
    timeout_s: int = 580
    env: dict = field(default_factory=dict)
    fresh: Callable[[Ctx], list[Path]] | None = None  # removed before the phase runs: a re-run starts clean
    kill: KillAt | None = None


OPS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq, "<": operator.lt, ">": operator.gt}


@dataclass(frozen=True)
class Check:
    """``key`` (dotted, into the case's result) ``op`` ``limit``; ``op="present"`` only records a value. A check is
    evaluated once phase ``after`` (default: the case's last phase) has run; before that it is pending."""

    key: str
    op: str
    limit: object = None
    after: str | None = None
    why: str = ""

    def evaluate(self, result: dict, done: bool) -> tuple[str, object]:
        """(status, value): status is pass, fail or pending (its phase has not run yet)."""
        if not done:
            return "pending", None
        value = lookup(result, self.key)
        if value is None:
            return "fail", None
        if self.op == "present":
            return "pass", value
        try:
            ok = OPS[self.op](value, self.limit)
        except TypeError:
            ok = False
        return ("pass" if ok else "fail"), value


@dataclass(frozen=True)
class Case:
    name: str
    gpus: int
    model: str  # names the benchmarks/ record file
    about: str
    phases: tuple[Phase, ...]
    checks: tuple[Check, ...]
    collect: Callable[[Ctx, dict], dict] = lambda ctx, phases: {}
    record: tuple[str, ...] = ()  # metrics shown in the benchmarks/ markdown row

    def phase(self, name: str) -> Phase:
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(f"{self.name} has no phase {name!r}; its phases are {[p.name for p in self.phases]}")


def lookup(data: dict, key: str):
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def evaluate(case: Case, result: dict) -> tuple[str, list[dict]]:
    """The verdict (PASS, FAIL or PENDING: no check failed but phases are left) and each check's outcome."""
    ran = set(result.get("phases", {}))
    rows = []
    for c in case.checks:
        after = c.after or case.phases[-1].name
        status, value = c.evaluate(result, after in ran)
        rows.append({"key": c.key, "op": c.op, "limit": c.limit, "value": value, "status": status, "why": c.why})
    rows += [{"key": f"phases.{n}.ok", "op": "==", "limit": True, "value": False, "status": "fail",
              "why": p.get("error") or f"phase {n} failed"}
             for n, p in result.get("phases", {}).items() if not p.get("ok")]
    if any(r["status"] == "fail" for r in rows):
        return "FAIL", rows
    return ("PENDING" if any(r["status"] == "pending" for r in rows) else "PASS"), rows


# ---- reading a run folder back ------------------------------------------------------------------------------------
def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def ratio(a: float | None, b: float | None, scale: float = 1) -> float | None:
    """``scale * a / b``, or None when either is missing (a phase that did not run) or zero."""
    return scale * a / b if a and b else None


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def disk_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**30


def run_metrics(run: Path, sessions: list[dict] | None = None, skip: int = 1) -> dict:
    """Losses, step times, peak memory, validation time and disk of a run folder (all its sessions: metrics.csv of
    every logs/version_*, validation/step_*/metrics.json, status.json). ``sessions``: status.json as each earlier
    session left it (a killed session's is overwritten by the next), for the time and memory they add. ``skip``: the
    first logged step times left out of the median (compilation, first loads)."""
    rows = [r for f in sorted(run.glob("logs/version_*/metrics.csv")) for r in csv.DictReader(f.open())]

    def col(name: str) -> list[float]:
        return [float(r[name]) for r in rows if r.get(name) not in (None, "")]

    status = _json(run / "status.json")
    states = [s for s in (sessions or []) if s] + ([status] if status else [])
    losses, times = col("train/loss"), col("perf/step_time_s")
    peaks = col("perf/peak_mem_gib") + [s["peak_mem_gib"] for s in states if _finite(s.get("peak_mem_gib"))]
    peaks += [r["peak_mem_gib"] for s in states for r in s.get("ranks") or [] if _finite(r.get("peak_mem_gib"))]
    vals = sorted(run.glob("validation/step_*/metrics.json"))
    val_seconds = [float(_json(f).get("seconds", math.nan)) for f in vals]
    elapsed = sum(float(s.get("elapsed_s") or 0.0) for s in states)
    lora = sorted(p.name for p in (run / "lora" / "final").glob("*.safetensors"))
    return {
        "state": status.get("state"), "final_step": status.get("step"), "max_steps": status.get("max_steps"),
        "world_size": status.get("world_size"), "replicas_in_sync": status.get("replicas_in_sync"),
        "skipped_steps": status.get("skipped_steps"),
        "loss_count": len(losses), "losses_finite": bool(losses) and all(map(_finite, losses)),
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "median_step_s": statistics.median(times[skip:]) if len(times) > skip else None,
        "peak_mem_gib": max(peaks) if peaks else None,
        "validations": len(vals), "validation_s": val_seconds,
        "validation_total_s": sum(val_seconds) if vals else 0.0,
        "elapsed_s": elapsed or None,
        "val_share": (sum(val_seconds) / elapsed) if elapsed else None,
        # the share at the default cadence (the case validates more often to see several calls in a short run):
        # one validation's mean seconds per (default every_n_steps x the median step)
        "val_share_at_default": share_at_default(val_seconds, statistics.median(times[1:]) if len(times) > 1 else None),
        "run_disk_gib": disk_gib(run) if run.is_dir() else None,
        "checkpoints_gib": disk_gib(run / "checkpoints") if (run / "checkpoints").is_dir() else None,
        "lora_final": lora, "lora_final_files": len(lora),
        "optimizer_fused": (status.get("optimizer") or {}).get("fused"),
    }


def share_at_default(val_seconds: list[float], step_s: float | None) -> float | None:
    """Validation's share of the run at the shipped cadence: one call's mean seconds / (every_n_steps x step)."""
    return statistics.mean(val_seconds) / (default_cadence() * step_s) if val_seconds and step_s else None


def default_cadence() -> int:
    """callbacks.validation.every_n_steps as shipped (conf/callbacks/default.yaml)."""
    import yaml

    conf = yaml.safe_load((REPO / "conf" / "callbacks" / "default.yaml").read_text())
    return int(conf["validation"]["every_n_steps"])


def newest_checkpoint_step(run: Path) -> int:
    steps = [int(p.stem.split("_")[1]) for p in (run / "checkpoints").glob("step_*.ckpt") if p.stem[5:].isdigit()]
    return max(steps, default=0)


# ---- the user's job: real-size TI2V-5B (random weights, real-size UMT5-XXL and VAE) under a 28 GiB cap ------------
CLIPS = 48  # generated 720x1280x24 clips; data.val_fraction=0.1 holds out ~5 of them


def model_dir(ctx: Ctx) -> Path:
    return ctx.work / "ti2v5b_full"  # not $W/ti2v5b: the bench scripts build a DiT-only folder there


def user_data(ctx: Ctx) -> list[str]:
    """The user's data settings (704x1280x17, batch 1, 4 workers) on generated clips, 10 % held out for val/loss."""
    return ["model=ti2v5b", f"model.path={model_dir(ctx)}", "data=synthetic",
            f"paths.data_dir={ctx.work / 'data_user'}",
            "data.height=704", "data.width=1280", "data.num_frames=17", "data.batch_size=1", "data.num_workers=4",
            "data.generate.height=720", "data.generate.width=1280", "data.generate.num_frames=24",
            f"data.generate.num_videos={CLIPS}", "data.generate.num_images=0", "data.val_fraction=0.1",
            f"paths.cache_dir={ctx.work / 'cache'}"]


def train_argv(ctx: Ctx, name: str, steps: int, devices: int, *extra: str) -> list[str]:
    """``python train.py`` from the cache with the defaults (LoRA r32, bf16-mixed, DDP, checkpointing, compiled, the
    default callbacks), validation at its defaults with its cadence at half the run (at step 0, mid-run and the end),
    the process capped at CAP_GIB (MemoryCap)."""
    return [ctx.python, "train.py", *user_data(ctx), f"trainer.devices={devices}", f"trainer.max_steps={steps}",
            f"callbacks.validation.every_n_steps={max(1, steps // 2)}", "callbacks.progress=null",
            "+callbacks.memory_cap._target_=wanexp.callbacks.memory.MemoryCap", f"+callbacks.memory_cap.gib={CAP_GIB}",
            f"paths.output_dir={ctx.run_dir(name)}", f"run_name={name}", *extra]


BUILD = Phase("build", lambda ctx: [ctx.python, "tests/gpu/build_random_model.py", "--model", "ti2v5b", "--entry",
                                    "ti2v5b", "--path", str(model_dir(ctx))], minutes=5)
CACHE = Phase("cache", lambda ctx: [ctx.python, "tests/gpu/capped.py", str(CAP_GIB), "wanexp.cli.cache",
                                    *user_data(ctx), f"paths.output_dir={ctx.run_dir('cache_user')}"], minutes=3)


def train_metrics(name: str) -> Callable[[Ctx, dict], dict]:
    def collect(ctx: Ctx, phases: dict) -> dict:
        sessions = [p["status_at_kill"] for p in phases.values() if p.get("status_at_kill")]
        out = run_metrics(ctx.run_dir(name), sessions)
        out["cache_disk_gib"] = disk_gib(ctx.work / "cache") if (ctx.work / "cache").is_dir() else None
        return out
    return collect


def _common_checks(steps: int, after: str) -> tuple[Check, ...]:
    return (
        Check("metrics.state", "==", "finished", after, "status.json says the run finished"),
        Check("metrics.final_step", ">=", steps, after, "every optimizer step ran"),
        Check("metrics.losses_finite", "==", True, after, "all logged losses finite"),
        Check("metrics.peak_mem_gib", "<=", CAP_GIB, after, f"peak GPU memory within the {CAP_GIB} GiB cap"),
        Check("metrics.lora_final_files", ">=", 2, after, "LoRA files (ComfyUI + diffusers) in lora/final"),
        Check("metrics.run_disk_gib", "present", None, after, "disk used by the run folder, recorded"),
    )


USER_STEPS, KILL_STEP = 1000, 520  # killed 20 steps past the step-500 checkpoint: run 2 redoes them
USER = "user_job_5b_28g"
USER_JOB = Case(
    name=USER, gpus=1, model="ti2v5b",
    about=f"the user's job: real-size TI2V-5B (random weights, real-size UMT5-XXL and VAE), {CLIPS} clips cached, "
          f"python train.py defaults for {USER_STEPS} steps capped at {CAP_GIB} GiB; run 1 killed with SIGKILL near "
          f"step {KILL_STEP}, run 2 continues with resume=auto",
    phases=(
        BUILD, CACHE,
        Phase("train1", lambda ctx: train_argv(ctx, USER, USER_STEPS, 1, "resume=auto"), minutes=8.5,
              env={"CUDA_VISIBLE_DEVICES": "0"}, fresh=lambda ctx: [ctx.run_dir(USER)],
              kill=KillAt(KILL_STEP, deadline_s=520, run=lambda ctx: ctx.run_dir(USER))),
        Phase("train2", lambda ctx: train_argv(ctx, USER, USER_STEPS, 1, "resume=auto"), minutes=6.5,
              env={"CUDA_VISIBLE_DEVICES": "0"}),
    ),
    checks=(
        Check("phases.train1.killed_at_step", ">=", 1, "train1", "run 1 was killed mid-run"),
        Check("phases.train1.checkpoint_step", ">=", 1, "train1", "a checkpoint existed when it was killed"),
        Check("phases.train2.rc", "==", 0, None, "run 2 exits 0"),
        *_common_checks(USER_STEPS, "train2"),
        Check("metrics.validations", ">=", 2, "train2", "validation ran at its cadence"),
        Check("metrics.val_share_at_default", "<=", 0.05, "train2",
              "one validation's seconds / (the default every_n_steps x the median step)"),
    ),
    collect=train_metrics(USER),
    record=("final_step", "median_step_s", "peak_mem_gib", "validations", "validation_total_s",
            "val_share_at_default",
            "run_disk_gib", "lora_final_files"),
)

V100_STEPS = 50
V100 = "v100_path_5b_28g"
V100_JOB = Case(
    name=V100, gpus=1, model="ti2v5b",
    about=f"the user's job on the V100 path: trainer.precision=16-mixed, model.dtype=fp16 (base weights), "
          f"model.compile=false, {V100_STEPS} steps capped at {CAP_GIB} GiB (needs user_job's build and cache)",
    phases=(BUILD, CACHE,
            Phase("train", lambda ctx: train_argv(ctx, V100, V100_STEPS, 1, "trainer.precision=16-mixed",
                                                  "model.dtype=fp16", "model.compile=false", "overwrite=true"),
                  minutes=4, env={"CUDA_VISIBLE_DEVICES": "0"}, fresh=lambda ctx: [ctx.run_dir(V100)])),
    checks=(Check("phases.train.rc", "==", 0, None, "exits 0"), *_common_checks(V100_STEPS, "train")),
    collect=train_metrics(V100),
    record=("final_step", "median_step_s", "peak_mem_gib", "skipped_steps", "validation_total_s", "lora_final_files"),
)

PCIE_STEPS = 100
PCIE = "user_job_5b_2gpu_pcie"
PCIE_JOB = Case(
    name=PCIE, gpus=2, model="ti2v5b",
    about=f"the user's job on 2 GPUs (DDP) without peer-to-peer (NCCL_P2P_DISABLE=1: traffic through the host, as "
          f"on PCIe cards), {PCIE_STEPS} steps, each process capped at {CAP_GIB} GiB",
    phases=(BUILD, CACHE,
            Phase("train", lambda ctx: train_argv(ctx, PCIE, PCIE_STEPS, 2, "overwrite=true"), minutes=5,
                  env={"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_P2P_DISABLE": "1"}, fresh=lambda ctx: [ctx.run_dir(PCIE)])),
    checks=(Check("phases.train.rc", "==", 0, None, "exits 0"), *_common_checks(PCIE_STEPS, "train"),
            Check("metrics.world_size", "==", 2, None, "two ranks"),
            Check("metrics.replicas_in_sync", "==", True, None, "both replicas hold the same LoRA weights")),
    collect=train_metrics(PCIE),
    record=("final_step", "median_step_s", "peak_mem_gib", "validation_total_s", "replicas_in_sync"),
)

LOADER = "loader_5b"
LOADER_JOB = Case(
    name=LOADER, gpus=1, model="ti2v5b",
    about="the data loader at the user's settings: samples/s from raw media vs from the cache, 4 workers",
    phases=(BUILD, CACHE,
            Phase("run", lambda ctx: [ctx.python, "-m", "wanexp.cli.bench_loader", *user_data(ctx),
                                      "+bench.batches=40", f"paths.output_dir={ctx.run_dir(LOADER)}"], minutes=2)),
    checks=(Check("phases.run.rc", "==", 0, None, "exits 0"),),
)


# ---- parts shared by the cases below --------------------------------------------------------------------------------
def dit_dir(ctx: Ctx) -> Path:
    return ctx.work / "ti2v5b"  # the real-size TI2V-5B DiT alone (build_transformer.py): what the bench loads


def light_dir(ctx: Ctx) -> Path:
    return ctx.work / "ti2v5b_light"  # the real-size TI2V-5B DiT with light encoders (real_sizes.yaml ti2v5b_light)


def a14b_dir(ctx: Ctx) -> Path:
    return ctx.work / "i2v14b_light"  # both real-size I2V-A14B experts with light encoders


BUILD_DIT = Phase("build_dit", lambda ctx: [ctx.python, "tests/gpu/build_transformer.py", "--model", "ti2v5b",
                                            "--path", str(dit_dir(ctx))], minutes=2)
BUILD_LIGHT = Phase("build_light", lambda ctx: [ctx.python, "tests/gpu/build_random_model.py", "--model", "ti2v5b",
                                                "--entry", "ti2v5b_light", "--path", str(light_dir(ctx))], minutes=3)


def light_data(ctx: Ctx) -> list[str]:
    """The real-size 5B from the cache of 48 generated 704x1280x17 clips (no epoch boundary in a short run)."""
    return ["model=ti2v5b", f"model.path={light_dir(ctx)}", "data=synthetic", f"paths.data_dir={ctx.work / 'data5'}",
            "data.height=704", "data.width=1280", "data.num_frames=17", "data.batch_size=1", "data.num_workers=4",
            "data.generate.height=704", "data.generate.width=1280", "data.generate.num_frames=17",
            "data.generate.num_videos=48", "data.generate.num_images=0", f"paths.cache_dir={ctx.work / 'cache5'}",
            "trainer.precision=bf16-mixed"]


CACHE_LIGHT = Phase("cache_light", lambda ctx: [ctx.python, "-m", "wanexp.cli.cache", *light_data(ctx),
                                                f"paths.output_dir={ctx.run_dir('cache_light')}"], minutes=3)


def tiny_data(ctx: Ctx, precision: str = "bf16-mixed", dtype: str = "bf16") -> list[str]:
    """The demo experiment's tiny model and clips on the GPU, bf16 base weights (or ``dtype``)."""
    return ["experiment=demo", "trainer.accelerator=gpu", f"trainer.precision={precision}", f"model.dtype={dtype}",
            "trainer.log_every_n_steps=1", f"paths.tiny_model_dir={ctx.work / 'tiny'}",
            f"paths.data_dir={ctx.work / 'data_tiny'}"]


def train(name: str, gpus: int, steps: int, data: Callable[[Ctx], list[str]], *extra: str, minutes: float = 3,
          phase: str | None = None, fresh: bool = True, env: dict | None = None, validate_every: int = 0) -> Phase:
    """``python train.py`` into run folder ``name`` on ``gpus`` GPUs (the first ones), ``steps`` steps, no validation
    (or every ``validate_every`` steps), a checkpoint only where ``extra`` asks; ``fresh=False`` keeps the folder (a
    resume)."""
    visible = ",".join(map(str, range(gpus)))

    def argv(ctx: Ctx) -> list[str]:
        return [ctx.python, "train.py", *data(ctx), f"trainer.devices={gpus}", f"trainer.max_steps={steps}",
                "callbacks.progress=null", f"callbacks.validation.every_n_steps={validate_every}",
                f"paths.output_dir={ctx.run_dir(name)}", f"run_name={name}", *extra]
    return Phase(phase or name, argv, minutes=minutes, env={"CUDA_VISIBLE_DEVICES": visible, **(env or {})},
                 fresh=(lambda ctx: [ctx.run_dir(name)]) if fresh else None)


def bench(name: str, case: str, *args: str, model: Callable[[Ctx], Path] = dit_dir, cap: int | None = None,
          minutes: float = 4) -> Phase:
    """``wanexp.cli.bench`` on one GPU; its JSON is ``<work>/results/<case>/<name>.json`` (copied to ``<out>/<case>/``) (removed first: the bench appends).
    ``cap``: the process capped at that many GiB (tests/gpu/capped.py)."""
    def argv(ctx: Ctx) -> list[str]:
        head = ["tests/gpu/capped.py", str(cap), "wanexp.cli.bench"] if cap else ["-m", "wanexp.cli.bench"]
        return [ctx.python, *head, "--model-path", str(model(ctx)), *args, "--json", str(bench_json(ctx, case, name))]
    return Phase(name, argv, minutes=minutes, env={"CUDA_VISIBLE_DEVICES": "0"},
                 fresh=lambda ctx: [bench_json(ctx, case, name)])


def bench_json(ctx: Ctx, case: str, name: str) -> Path:
    return ctx.results(case) / f"{name}.json"


def _slug(label: str) -> str:
    """'wanexp [model.fp8=true]' -> 'wanexp_model_fp8_true' (a key the dotted checks can name)."""
    return re.sub(r"\W+", "_", label).strip("_")


def bench_metrics(path: Path) -> dict:
    """One bench JSON (its last run): per path (slugged) the median and back-to-back seconds, peak GiB, the speedup
    against the plain per-token loop and ``vs_wanexp`` (wanexp's default step time / this path's), the numerics
    verdict and, per path, the largest output and LoRA-gradient errors against the plain loop, and the card's mean
    SM clock and power while the path's steps ran (``sm_mhz``, ``power_w``; the run's ``power_limit_w``)."""
    runs = json.loads(path.read_text()) if path.is_file() else []
    if not runs:
        return {}
    run = runs[-1]
    rows = {_slug(r["path"]): r for r in run.get("results", [])}
    base = rows.get("wanexp", {}).get("median_s")
    out: dict = {"numerics_ok": run.get("numerics_ok"), "tokens": run.get("tokens"), "device": run.get("device"),
                 "power_limit_w": run.get("power_limit_w")}
    for key, r in rows.items():
        out[key] = {"median_s": r.get("median_s"), "back_to_back_s": r.get("back_to_back_s"),
                    "peak_gib": r.get("peak_gib"), "tflops": r.get("tflops"),
                    "speedup": r.get("speedup_vs_plain_tokens"),
                    "vs_wanexp": ratio(base, r.get("median_s")),
                    "sm_mhz": r.get("card", {}).get("sm_mhz"), "power_w": r.get("card", {}).get("power_w")}
    for c in run.get("numerics", []):
        row = out.setdefault(_slug(c["path"]), {})
        row["out_rel_err"] = max(row.get("out_rel_err", 0.0), c["out_rel_err"])
        row["grad_rel_err"] = max(row.get("grad_rel_err", 0.0), c["grad_rel_err_all"])
    return out


def bench_results(case: str, *names: str) -> Callable[[Ctx, dict], dict]:
    def collect(ctx: Ctx, phases: dict) -> dict:
        return {n: bench_metrics(bench_json(ctx, case, n)) for n in names}
    return collect


def runs(**folders: str) -> Callable[[Ctx, dict], dict]:
    """Reads run folders back: ``key=run_name`` gives ``metrics.<key>`` (run_metrics, 3 warm-up steps left out of the
    median step: compilation, first loads)."""
    def collect(ctx: Ctx, phases: dict) -> dict:
        return {key: run_metrics(ctx.run_dir(name), skip=3) for key, name in folders.items()}
    return collect


def both(*collects: Callable[[Ctx, dict], dict]) -> Callable[[Ctx, dict], dict]:
    def collect(ctx: Ctx, phases: dict) -> dict:
        return {k: v for c in collects for k, v in c(ctx, phases).items()}
    return collect


def finished(key: str, steps: int, after: str | None = None) -> tuple[Check, ...]:
    """Run ``key`` finished every step with finite losses and wrote its LoRA files."""
    return (Check(f"metrics.{key}.state", "==", "finished", after or key, f"{key}: status.json says finished"),
            Check(f"metrics.{key}.final_step", ">=", steps, after or key, f"{key}: every optimizer step ran"),
            Check(f"metrics.{key}.losses_finite", "==", True, after or key, f"{key}: all logged losses finite"),
            Check(f"metrics.{key}.lora_final_files", ">=", 1, after or key, f"{key}: LoRA files in lora/final"))


def in_sync(key: str, after: str | None = None) -> Check:
    return Check(f"metrics.{key}.replicas_in_sync", "==", True, after or key,
                 f"{key}: every rank holds the same LoRA weights")


def log_value(ctx: Ctx, case: str, phase: str, pattern: str) -> float | None:
    """The last number ``pattern`` (a regex with one group) matches in a phase's log."""
    log = ctx.work / "logs" / case / f"{phase}.log"
    found = re.findall(pattern, log.read_text(errors="replace")) if log.is_file() else []
    return float(found[-1]) if found else None


TIMER = ["+callbacks.timer._target_=tests.helpers.StepTimer", "+callbacks.timer.start=20",
         "+callbacks.timer.steps=20", "trainer.log_every_n_steps=10", "callbacks.checkpoint.every_n_train_steps=1000"]
TIMER_MS = r"wanexp-timer: steps \d+-\d+ mean ([\d.]+) ms"


# ---- the step benchmark (docs/performance.md): real-size DiTs, one GPU ----------------------------------------------
PERF = "perf_5b"
KNOBS = "model.compile=false;model.fast_modulation=false;model.attention_backend=_native_cudnn;" \
        "model.attention_backend=_native_flash"
PERF_JOB = Case(
    name=PERF, gpus=1, model="ti2v5b",
    about="wanexp.cli.bench on the real-size TI2V-5B DiT: the plain loops, wanexp's step and its numerics at 4,400 "
          "tokens without and with checkpointing (knob variants, profiled; the fp32 function) and at 27,280 tokens",
    phases=(BUILD_DIT,
            bench("short", PERF, "--frames", "17", "--warmup", "3", "--steps", "6", "--profile",
                  "plain_tokens,wanexp", "--variants", KNOBS, minutes=5),
            bench("ckpt", PERF, "--frames", "17", "--ckpt", "--warmup", "3", "--steps", "6", "--fp32-floor"),
            bench("long", PERF, "--frames", "121", "--ckpt", "--warmup", "1", "--steps", "3", "--profile", minutes=5)),
    checks=(
        *(Check(f"metrics.{p}.numerics_ok", "==", True, p, f"{p}: wanexp computes the plain loop's function")
          for p in ("short", "ckpt", "long")),
        Check("metrics.short.wanexp.speedup", ">=", 1.4, "short", "vs the plain per-token loop (1.67x, H100)"),
        Check("metrics.ckpt.wanexp.speedup", ">=", 1.5, "ckpt", "vs the plain per-token loop (1.87x, H100)"),
        Check("metrics.ckpt.wanexp.peak_gib", "<=", 14, "ckpt", "12.4 GiB measured (H100)"),
        Check("metrics.long.wanexp.speedup", ">=", 1.25, "long", "vs the plain per-token loop (1.42x, H100)"),
        Check("metrics.long.wanexp.peak_gib", "<=", 26, "long", "23.3 GiB measured (H100)"),
    ),
    collect=bench_results(PERF, "short", "ckpt", "long"),
    record=tuple(f"{p}.wanexp.{k}" for p in ("short", "ckpt", "long") for k in ("median_s", "speedup", "peak_gib")),
)

A14B_DIT = "perf_a14b"
A14B_DIT_JOB = Case(
    name=A14B_DIT, gpus=1, model="a14b",
    about="wanexp.cli.bench on one real-size A14B expert (T2V-A14B's DiT) at 480x832x81 (32,760 tokens), ckpt; "
          "the build takes ~28 GB of disk (the 5B DiT folder is removed first)",
    phases=(Phase("build_dit", lambda ctx: [ctx.python, "tests/gpu/build_transformer.py", "--model", "t2v14b",
                                            "--path", str(ctx.work / "t2v14b")], minutes=5,
                  fresh=lambda ctx: [dit_dir(ctx)]),
            bench("bench", A14B_DIT, "--model", "t2v14b", "--height", "480", "--width", "832", "--frames", "81",
                  "--ckpt", "--warmup", "1", "--steps", "2", model=lambda ctx: ctx.work / "t2v14b", minutes=6)),
    checks=(Check("metrics.bench.numerics_ok", "==", True, None, "wanexp computes the plain loop's function"),
            Check("metrics.bench.wanexp.speedup", ">=", 1.15, None, "vs the plain loop (1.28x, H100)"),
            Check("metrics.bench.wanexp.peak_gib", "<=", 56, None, "53.3 GiB measured (H100)")),
    collect=bench_results(A14B_DIT, "bench"),
    record=("bench.wanexp.median_s", "bench.wanexp.speedup", "bench.wanexp.peak_gib"),
)

FP8 = "fp8_5b"
# each wanexp variant's label in the bench (what --profile names) and its key among the metrics (_slug of the label)
FP8_VARIANT_PATH = "wanexp [model.fp8=true]"
FP8_VARIANT = _slug(FP8_VARIANT_PATH)
FP8_GRAPHS = "model.fp8=true model.cuda_graphs=true"  # FP8 runs below the power limit: the host's time is left
FP8_GRAPHS_VARIANT_PATH = f"wanexp [{FP8_GRAPHS}]"
FP8_GRAPHS_VARIANT = _slug(FP8_GRAPHS_VARIANT_PATH)
SAC_VARIANT_PATH = "wanexp [model.selective_checkpointing=true]"  # selective activation checkpointing (fast.py)
SAC_VARIANT = _slug(SAC_VARIANT_PATH)
GRAPHS = "model.cuda_graphs=true"  # the compiled blocks replayed as CUDA graphs (fast.compile_blocks)
GRAPHS_VARIANT_PATH = f"wanexp [{GRAPHS}]"
GRAPHS_VARIANT = _slug(GRAPHS_VARIANT_PATH)
SAC_GRAPHS = f"model.selective_checkpointing=true {GRAPHS}"
SAC_GRAPHS_VARIANT_PATH = f"wanexp [{SAC_GRAPHS}]"
SAC_GRAPHS_VARIANT = _slug(SAC_GRAPHS_VARIANT_PATH)
# the memory budget choosing which blocks to checkpoint, and how (fast.plan_blocks), with the graphs
BUDGET_GRAPHS = {gib: f"model.memory_budget_gib={gib} {GRAPHS}" for gib in (22,)}
BUDGET_GRAPHS_VARIANT = {gib: _slug(f"wanexp [{v}]") for gib, v in BUDGET_GRAPHS.items()}
# the same with the FP8 base (half the frozen weights' memory): the targets' 20 GiB and low-memory 13 GiB settings
FP8_BUDGET_GRAPHS = {gib: f"model.fp8=true model.memory_budget_gib={gib} {GRAPHS}" for gib in (20, 13)}
FP8_BUDGET_GRAPHS_VARIANT = {gib: _slug(f"wanexp [{v}]") for gib, v in FP8_BUDGET_GRAPHS.items()}
FP8_JOB = Case(
    name=FP8, gpus=1, model="ti2v5b",
    about="model.fp8=true against the default step on the real-size TI2V-5B DiT at 704x1280x17, without and with "
          "checkpointing (compute capability >= 8.9); FP8's error is measured, not held to bf16's tolerance",
    phases=(BUILD_DIT,
            *(bench(name, FP8, *ckpt, "--paths", "plain_tokens,wanexp", "--variants", "model.fp8=true",
                    "--warmup", "3", "--steps", "8") for name, ckpt in (("fp8", ()), ("fp8_ckpt", ("--ckpt",))))),
    checks=(*(Check(f"metrics.{p}.numerics_ok", "==", True, p, f"{p}: the bf16 step computes the plain loop's "
                    "function") for p in ("fp8", "fp8_ckpt")),
            Check(f"metrics.fp8.{FP8_VARIANT}.out_rel_err", "<=", 0.05, "fp8", "output error 2.2e-2 measured (H100)"),
            Check(f"metrics.fp8.{FP8_VARIANT}.grad_rel_err", "<=", 0.075, "fp8", "LoRA grads 3.7e-2 measured"),
            Check(f"metrics.fp8.{FP8_VARIANT}.vs_wanexp", ">=", 0.8, "fp8",
                  "against bf16: 0.84-1.03x measured on the H100, 2026-11-27 (the FP8 step is host-bound)"),
            Check("metrics.fp8.fp8_saves_gib", ">=", 3, "fp8", "FP8 base weights save memory (4.5 GiB measured)"),
            Check("metrics.fp8_ckpt.fp8_saves_gib", ">=", 3, "fp8_ckpt", "and with checkpointing")),
    collect=lambda ctx, phases: {n: fp8_saving(bench_metrics(bench_json(ctx, FP8, n))) for n in ("fp8", "fp8_ckpt")},
    record=tuple(f"{p}.{k}" for p in ("fp8", "fp8_ckpt") for k in ("wanexp.median_s", f"{FP8_VARIANT}.median_s",
                                                                 "fp8_saves_gib", f"{FP8_VARIANT}.out_rel_err")),
)


def fp8_saving(m: dict) -> dict:
    peaks = [m.get(k, {}).get("peak_gib") for k in ("wanexp", FP8_VARIANT)]
    return {**m, "fp8_saves_gib": peaks[0] - peaks[1] if None not in peaks else None}


BUDGET = "budget_5b_30g"
BUDGETS = "model.memory_budget_gib=30;model.memory_budget_gib=20"
BUDGET_JOB = Case(
    name=BUDGET, gpus=1, model="ti2v5b",
    about="model.memory_budget_gib (checkpoint only the blocks a budget needs) against every block checkpointed, "
          "the bench's step on the real-size TI2V-5B DiT at 4,400 and 27,280 tokens, the process capped at 30 GiB",
    phases=(BUILD_DIT,
            bench("short", BUDGET, "--frames", "17", "--ckpt", "--paths", "wanexp", "--no-check", "--warmup", "3",
                  "--steps", "6", "--variants", BUDGETS, cap=30),
            bench("long", BUDGET, "--frames", "121", "--ckpt", "--paths", "wanexp", "--no-check", "--warmup", "1",
                  "--steps", "3", "--variants", "model.memory_budget_gib=30", cap=30, minutes=5)),
    checks=(Check("phases.short.rc", "==", 0, "short", "4,400 tokens: no out-of-memory under the 30 GiB cap"),
            Check("metrics.short.wanexp_model_memory_budget_gib_30.peak_gib", "<=", 30, "short", "within budget 30"),
            Check("metrics.short.wanexp_model_memory_budget_gib_20.peak_gib", "<=", 20, "short", "within budget 20"),
            Check("metrics.short.wanexp_model_memory_budget_gib_30.vs_wanexp", ">=", 1.05, "short",
                  "fewer blocks checkpointed: faster than every block (8 of 30 kept)"),
            Check("phases.long.rc", "==", 0, "long", "27,280 tokens: no out-of-memory under the 30 GiB cap"),
            Check("metrics.long.wanexp_model_memory_budget_gib_30.peak_gib", "<=", 30, "long", "within budget 30"),
            Check("metrics.long.wanexp_model_memory_budget_gib_30.vs_wanexp", ">=", 0.98, "long",
                  "no slower than every block checkpointed (3.73 s against 3.76 s)")),
    collect=bench_results(BUDGET, "short", "long"),
    record=tuple(f"{p}.{k}.{m}" for p in ("short", "long") for k in ("wanexp", "wanexp_model_memory_budget_gib_30")
                 for m in ("median_s", "peak_gib")),
)


# ---- train.py against the bench's step (docs/performance.md) ------------------------------------------------------
GAP = "gap_5b"


def gap_metrics(ctx: Ctx, phases: dict) -> dict:
    b = bench_metrics(bench_json(ctx, GAP, "bench"))
    ms = log_value(ctx, GAP, "train", TIMER_MS)
    step = b.get("wanexp", {}).get("median_s")
    probe = {k: log_value(ctx, GAP, "probe", rf"probe: {k} ([\d.]+) ms")
             for k in ("fit_default", "manual_fixed_synced", "manual_fixed", "manual_loader", "fit_bare",
                       "fit_no_workers")}
    return {"bench": b, "train_ms": ms, "train_over_bench": ratio(ms, step, scale=1e-3),
            "probe_ms": probe}


GAP_JOB = Case(
    name=GAP, gpus=1, model="ti2v5b",
    about="the user's default python train.py (DDP, every default callback, 4 workers) from the cache on the real-size "
          "TI2V-5B (light encoders), steps 21-40 timed by tests.helpers.StepTimer, against the bench's step (and "
          "with the eager checkpoint); the probe phase: train.py's loop and loops without Lightning in one process",
    phases=(BUILD_LIGHT, CACHE_LIGHT,
            train("train_ddp", 1, 41, light_data, *TIMER, "parallel=ddp", phase="train", minutes=4),
            bench("bench", GAP, "--frames", "17", "--ckpt", "--paths", "wanexp", "--variants",
                  "model.compile_checkpoint=false", "--warmup", "3", "--steps", "10",
                  model=light_dir),
            Phase("probe", lambda ctx: [ctx.python, "tests/gpu/gap_probe.py", *light_data(ctx), "parallel=single",
                                        "trainer.devices=1", f"paths.output_dir={ctx.run_dir('probe')}",
                                        "run_name=probe"], minutes=6, env={"CUDA_VISIBLE_DEVICES": "0"},
                  fresh=lambda ctx: [ctx.run_dir("probe")])),
    checks=(Check("metrics.train_over_bench", "<=", 1.03, "bench", "train.py within 3 % of the bench's step "
                  "(336.5 against 333 ms, H100)"),
            Check("metrics.bench.numerics_ok", "==", True, "bench", "the bench's step computes the plain function"),
            Check("metrics.probe_ms.fit_default", "present", None, "probe", "train.py's loop in the probe"),
            Check("metrics.probe_ms.manual_fixed", "present", None, "probe", "the loop without Lightning")),
    collect=gap_metrics, record=("train_ms", "bench.wanexp.median_s", "train_over_bench", "probe_ms"),
)

# ---- model.cuda_graphs in python train.py (docs/performance.md, CUDA graphs) -------------------------------------
GRAPHS_TRAIN = "graphs_train_5b"
VAL_RUN = ["callbacks.validation.at_start=true",
           "callbacks.validation.steps=3", "callbacks.validation.prompts=[a red fox runs through snow]"]


def graphs_train_metrics(ctx: Ctx, phases: dict) -> dict:
    out = {f"{p}_ms": log_value(ctx, GRAPHS_TRAIN, p, TIMER_MS) for p in ("train_default", "train_graphs")}
    runs = {p: run_metrics(ctx.run_dir(p)) for p in ("train_default", "train_graphs")}
    out["validations"] = runs["train_graphs"]["validations"]  # validation/step_*/metrics.json: videos written
    out.update({f"{p}_peak_gib": r["peak_mem_gib"] for p, r in runs.items()})
    out["graphs_over_default"] = (out["train_graphs_ms"] / out["train_default_ms"]
                                  if out["train_graphs_ms"] and out["train_default_ms"] else None)
    return out


GRAPHS_TRAIN_JOB = Case(
    name=GRAPHS_TRAIN, gpus=1, model="ti2v5b",
    about="python train.py with model.cuda_graphs=true on the real-size TI2V-5B (light encoders) from the cache: "
          "validation sampled at step 0 and at the end around 41 training steps (the graphs of sampling and of "
          "training in one process), steps 21-40 timed against the default run's",
    phases=(BUILD_LIGHT, CACHE_LIGHT,
            train("train_graphs", 1, 41, light_data, *TIMER, *VAL_RUN, "model.cuda_graphs=true", minutes=4,
                  validate_every=41),
            train("train_default", 1, 41, light_data, *TIMER, minutes=3)),
    checks=(Check("phases.train_graphs.rc", "==", 0, "train_graphs", "trains and validates with the graphs"),
            Check("metrics.validations", ">=", 2, "train_graphs", "validation videos at step 0 and at the end"),
            Check("metrics.train_graphs_ms", "present", None, "train_graphs", "steps 21-40 timed"),
            Check("metrics.train_default_ms", "present", None, "train_default", "the default run's steps 21-40")),
    collect=graphs_train_metrics, record=("train_graphs_ms", "train_default_ms", "graphs_over_default", "validations",
                                          "train_graphs_peak_gib", "train_default_peak_gib"),
)

HOST = "host_gap_5b"


def host_data(ctx: Ctx, workers: int = 4) -> list[str]:
    """The 5B's depth and LoRA layout at tiny widths (real_sizes.yaml host30) on 64x64x5 clips: a step's wall time is
    the host's time to issue it."""
    return ["model=ti2v5b", f"model.path={ctx.work / 'host30'}", "data=synthetic",
            f"paths.data_dir={ctx.work / 'datah'}",
            "data.height=64", "data.width=64", "data.num_frames=5", "data.batch_size=1", f"data.num_workers={workers}",
            "data.generate.height=64", "data.generate.width=64", "data.generate.num_frames=5",
            "data.generate.num_videos=48", "data.generate.num_images=0", f"paths.cache_dir={ctx.work / 'cacheh'}",
            "trainer.precision=bf16-mixed"]


def host_metrics(ctx: Ctx, phases: dict) -> dict:
    step = bench_metrics(bench_json(ctx, HOST, "bench")).get("wanexp", {}).get("median_s")
    out = {"bench_ms": 1000 * step if step else None}
    for p in ("train", "train_no_workers"):
        out[f"{p}_ms"] = ms = log_value(ctx, HOST, p, TIMER_MS)
        out[f"{p}_over_bench"] = ratio(ms, out["bench_ms"])
    return out


HOST_JOB = Case(
    name=HOST, gpus=1, model="ti2v5b",
    about="the host's time per step: the 5B's 30 blocks at tiny widths (host30, 64x64x5), the bench's step against "
          "python train.py (Lightning, loader, callbacks) with and without loader processes",
    phases=(Phase("build", lambda ctx: [ctx.python, "tests/gpu/build_random_model.py", "--model", "ti2v5b",
                                        "--entry", "host30", "--path", str(ctx.work / "host30"), "--dtype", "fp32"],
                  minutes=1),
            Phase("cache", lambda ctx: [ctx.python, "-m", "wanexp.cli.cache", *host_data(ctx),
                                        f"paths.output_dir={ctx.run_dir('cache_host')}"], minutes=2),
            bench("bench", HOST, "--height", "64", "--width", "64", "--frames", "5", "--text-len", "64", "--ckpt",
                  "--paths", "wanexp", "--no-check", "--warmup", "5", "--steps", "20",
                  model=lambda ctx: ctx.work / "host30", minutes=2),
            train("host_train", 1, 41, host_data, *TIMER, "parallel=single", phase="train", minutes=2),
            train("host_train_nw", 1, 41, lambda ctx: host_data(ctx, workers=0), *TIMER, "parallel=single",
                  phase="train_no_workers", minutes=2)),
    checks=(Check("metrics.train_over_bench", "<=", 1.2, "train", "the training loop's host time within 20 % of the "
                  "bench's (302 against 271 ms, H100 host)"),
            Check("metrics.train_no_workers_ms", "present", None, "train_no_workers", "without loader processes")),
    collect=host_metrics, record=("bench_ms", "train_ms", "train_no_workers_ms"),
)


# ---- strategies through python train.py (docs/multi-gpu.md): real-size DiTs, light encoders, from the cache --------
STEPS5 = 14
STRAT2 = "strategy_5b_2gpu"


def strategy_metrics(folders: dict, scale: tuple[tuple[str, str, int], ...] = (),
                     sp_json: bool = False) -> Callable[[Ctx, dict], dict]:
    def collect(ctx: Ctx, phases: dict) -> dict:
        m = runs(**folders)(ctx, phases)
        for key, base, n in scale:
            a, b = m.get(base, {}).get("median_step_s"), m.get(key, {}).get("median_step_s")
            m[f"{key}_scaling"] = ratio(a, b, scale=n)
        if sp_json:
            m["sp_numerics"] = _json(ctx.results(STRAT2) / "sp_numerics.json")
            m["bench"] = bench_metrics(bench_json(ctx, STRAT2, "bench"))
        return m
    return collect


def _s5(name: str, gpus: int, *extra: str, steps: int = STEPS5, minutes: float = 2.5) -> Phase:
    return train(f"5b_{name}", gpus, steps, light_data, "trainer.log_every_n_steps=1",
                 "callbacks.checkpoint.every_n_train_steps=1000", *extra, phase=name, minutes=minutes)


STRAT2_RUNS = {"ddp_1": "5b_ddp_1", "single_1": "5b_single_1", "ddp_2": "5b_ddp_2", "fsdp_2": "5b_fsdp_2",
               "fsdp_sp2_2": "5b_fsdp_sp2_2", "ds2_2": "5b_ds2_2", "ds3_2": "5b_ds3_2", "dmd_1": "5b_dmd_1",
               "ddp_1_log10": "5b_ddp_1_log10"}
STRAT2_JOB = Case(
    name=STRAT2, gpus=2, model="ti2v5b",
    about="the strategy table's 5B rows (704x1280x17, from the cache): the bench's step, sp numerics (sp=2 vs one "
          "GPU), ddp and single on 1 GPU, ddp, fsdp, fsdp+sp2, DeepSpeed ZeRO-2/3 on 2, objective=dmd, logging "
          "every 10 steps; DeepSpeed needs its wheel",
    phases=(BUILD_LIGHT, CACHE_LIGHT,
            bench("bench", STRAT2, "--frames", "17", "--ckpt", "--paths", "wanexp", "--no-check", "--warmup", "3",
                  "--steps", "10", model=light_dir, minutes=2),
            Phase("sp_numerics", lambda ctx: [ctx.python, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                              "tests/gpu/sp_numerics.py",
                                              "--path", str(light_dir(ctx)), "--ckpt",
                                              "--json", str(ctx.results(STRAT2) / "sp_numerics.json")],
                  minutes=3, env={"CUDA_VISIBLE_DEVICES": "0,1"}),
            _s5("ddp_1", 1, "parallel=ddp"), _s5("single_1", 1, "parallel=single"), _s5("ddp_2", 2, "parallel=ddp"),
            _s5("fsdp_2", 2, "parallel=fsdp"), _s5("fsdp_sp2_2", 2, "parallel=fsdp", "parallel.sp_size=2"),
            _s5("ds2_2", 2, "parallel=deepspeed", "parallel.strategy.stage=2"),
            _s5("ds3_2", 2, "parallel=deepspeed", "parallel.strategy.stage=3", "model.compile=false", minutes=4),
            _s5("dmd_1", 1, "parallel=ddp", "objective=dmd", steps=12),
            train("5b_ddp_1_log10", 1, 44, light_data, "parallel=ddp", "trainer.log_every_n_steps=10",
                  "callbacks.checkpoint.every_n_train_steps=1000", phase="ddp_1_log10", minutes=3)),
    checks=(Check("metrics.sp_numerics.pass", "==", True, "sp_numerics", "sp=2 loss within 1e-2, LoRA grads 5e-2"),
            *(c for key in STRAT2_RUNS for c in finished(key, 12 if key == "dmd_1" else STEPS5)),
            in_sync("ddp_2"), in_sync("ds2_2"),
            Check("metrics.ddp_2_scaling", ">=", 1.8, "ddp_2", "samples/s on 2 GPUs over 1 (1.95x, H100)"),
            Check("metrics.ddp_1.peak_mem_gib", "<=", 14, "ddp_1", "12.7 GiB measured (H100)"),
            Check("metrics.fsdp_2.peak_mem_gib", "<=", 10, "fsdp_2", "FSDP shards the base: 7.7 GiB (H200)")),
    collect=strategy_metrics(STRAT2_RUNS, (("ddp_2", "ddp_1", 2), ("fsdp_2", "ddp_1", 2), ("ds2_2", "ddp_1", 2)),
                             sp_json=True),
    record=(*(f"{k}.median_step_s" for k in STRAT2_RUNS), "ddp_2_scaling", "fsdp_2_scaling", "ds2_2_scaling",
            "fsdp_2.peak_mem_gib", "sp_numerics.grad_rel_err_max"),
)

STRAT4 = "strategy_5b_4gpu"
STRAT4_JOB = Case(
    name=STRAT4, gpus=4, model="ti2v5b",
    about="the strategy table's 4-GPU 5B rows: ddp on 1 and 4 GPUs (scaling), fsdp on 4",
    phases=(BUILD_LIGHT, CACHE_LIGHT, _s5("ddp_1", 1, "parallel=ddp"), _s5("ddp_4", 4, "parallel=ddp"),
            _s5("fsdp_4", 4, "parallel=fsdp")),
    checks=(*finished("ddp_1", STEPS5), *finished("ddp_4", STEPS5), *finished("fsdp_4", STEPS5), in_sync("ddp_4"),
            Check("metrics.ddp_4_scaling", ">=", 3.6, "ddp_4", "samples/s on 4 GPUs over 1 (3.91-4.17x)")),
    collect=strategy_metrics({"ddp_1": "5b_ddp_1", "ddp_4": "5b_ddp_4", "fsdp_4": "5b_fsdp_4"},
                             (("ddp_4", "ddp_1", 4), ("fsdp_4", "ddp_1", 4))),
    record=("ddp_1.median_step_s", "ddp_4.median_step_s", "ddp_4_scaling", "fsdp_4_scaling", "fsdp_4.peak_mem_gib"),
)


def a14b_data(ctx: Ctx, height: int = 480, width: int = 832, boundary: str = "high") -> list[str]:
    """I2V-A14B (one expert: boundary=high; both: full) at HxWx81 from the cache, eager blocks; the clips generated at
    the model's 16 fps (at the generator's default 24 fps, 81 frames are 54 at 16 fps: every clip refused)."""
    folder = "data14" if height == 480 else f"data14_{height}"
    return ["model=i2v14b", f"model.path={a14b_dir(ctx)}", "data=synthetic", f"paths.data_dir={ctx.work / folder}",
            f"data.height={height}", f"data.width={width}", "data.num_frames=81", "data.batch_size=1",
            "data.num_workers=2", f"data.generate.height={height}", f"data.generate.width={width}",
            "data.generate.num_frames=81", "data.generate.fps=16",
            f"data.generate.num_videos={8 if height == 480 else 4}",
            "data.generate.num_images=0", f"paths.cache_dir={ctx.work / 'cache14'}", "trainer.precision=bf16-mixed",
            "model.compile=false", f"boundary={boundary}", "trainer.log_every_n_steps=1"]


def a14b_720(ctx: Ctx) -> list[str]:
    return a14b_data(ctx, 720, 1280)


BUILD_A14B = Phase("build_a14b", lambda ctx: [ctx.python, "tests/gpu/build_random_model.py", "--model", "i2v14b",
                                              "--entry", "i2v14b_light", "--path", str(a14b_dir(ctx))], minutes=8,
                   fresh=lambda ctx: [light_dir(ctx), dit_dir(ctx), vace_dir(ctx), animate_dir(ctx)])  # ~57 GB
CACHE_A14B = Phase("cache_a14b", lambda ctx: [ctx.python, "-m", "wanexp.cli.cache", *a14b_data(ctx),
                                              f"paths.output_dir={ctx.run_dir('cache14')}"], minutes=4)
STRAT_A14B = "strategy_a14b_2gpu"
STRAT_A14B_JOB = Case(
    name=STRAT_A14B, gpus=2, model="a14b",
    about="I2V-A14B at 480x832x81 (32,760 tokens) with FSDP on 2 GPUs: the high-noise expert (checkpoint at step 2, "
          "then resume=last to step 5), both experts (boundary=full), objective=dmd on the high expert",
    phases=(BUILD_A14B, CACHE_A14B,
            train("a14b_high_fsdp_2", 2, 4, a14b_data, "parallel=fsdp", "callbacks.checkpoint.every_n_train_steps=2",
                  phase="fsdp_2", minutes=5),
            train("a14b_high_fsdp_2", 2, 5, a14b_data, "parallel=fsdp", "callbacks.checkpoint.every_n_train_steps=2",
                  "resume=last", "allow_resume_changes=true",
                  phase="resume", fresh=False, minutes=4),
            train("a14b_full_fsdp_2", 2, 4, lambda ctx: a14b_data(ctx, boundary="full"), "parallel=fsdp",
                  phase="full_fsdp_2",
                  minutes=6),
            train("a14b_high_dmd_fsdp_2", 2, 6, a14b_data, "parallel=fsdp", "objective=dmd", phase="dmd_fsdp_2",
                  minutes=7)),
    checks=(*finished("fsdp_2", 5, "resume"), *finished("full_fsdp_2", 4), *finished("dmd_fsdp_2", 6),
            Check("phases.fsdp_2.rc", "==", 0, "fsdp_2", "the first 4 steps, checkpoints at 2 and 4"),
            Check("metrics.fsdp_2.peak_mem_gib", "<=", 42, "resume", "38.7 GiB per GPU measured (H100)")),
    collect=runs(fsdp_2="a14b_high_fsdp_2", full_fsdp_2="a14b_full_fsdp_2", dmd_fsdp_2="a14b_high_dmd_fsdp_2"),
    record=tuple(f"{k}.{m}" for k in ("fsdp_2", "full_fsdp_2", "dmd_fsdp_2")
                 for m in ("median_step_s", "peak_mem_gib")),
)

STRAT_A14B4 = "strategy_a14b_4gpu"
STRAT_A14B4_JOB = Case(
    name=STRAT_A14B4, gpus=4, model="a14b",
    about="the A14B high-noise expert with FSDP on 4 GPUs at 480x832x81, and at 720x1280x81 (75,600 tokens) with "
          "fsdp + sp=2 on 2 and on 4 GPUs (dp 2)",
    phases=(BUILD_A14B, CACHE_A14B,
            train("a14b_high_fsdp_4", 4, 4, a14b_data, "parallel=fsdp", phase="fsdp_4", minutes=5),
            Phase("cache_720", lambda ctx: [ctx.python, "-m", "wanexp.cli.cache", *a14b_720(ctx),
                                            f"paths.output_dir={ctx.run_dir('cache720')}"], minutes=4),
            train("a14b720_high_fsdp_sp2_2", 2, 3, a14b_720, "parallel=fsdp", "parallel.sp_size=2",
                  phase="sp2_720_2", minutes=6),
            train("a14b720_high_fsdp_sp2_4", 4, 3, a14b_720, "parallel=fsdp", "parallel.sp_size=2",
                  phase="sp2_720_4", minutes=6)),
    checks=(*finished("fsdp_4", 4), *finished("sp2_720_2", 3), *finished("sp2_720_4", 3),
            Check("metrics.sp2_720_2.peak_mem_gib", "<=", 48, "sp2_720_2", "43.0 GiB per GPU measured (H100)")),
    collect=runs(fsdp_4="a14b_high_fsdp_4", sp2_720_2="a14b720_high_fsdp_sp2_2", sp2_720_4="a14b720_high_fsdp_sp2_4"),
    record=tuple(f"{k}.{m}" for k in ("fsdp_4", "sp2_720_2", "sp2_720_4") for m in ("median_step_s", "peak_mem_gib")),
)


# ---- the tiny model through train.py on GPUs: the component seams, DeepSpeed, distillation, fp16 -------------------
def compare_lora(name: str, run_a: str, run_b: str, export: str) -> Phase:
    """tests/gpu/compare_lora.py: two runs' LoRA exports hold the same modules, shapes and metadata, B trained."""
    return Phase(name, lambda ctx: [ctx.python, "tests/gpu/compare_lora.py", str(ctx.run_dir(run_a) / "lora" / export),
                                    str(ctx.run_dir(run_b) / "lora" / export)], minutes=0.5)


SEAMS = "seams_tiny_2gpu"
SEAMS_JOB = Case(
    name=SEAMS, gpus=2, model="tiny",
    about="the tiny model through python train.py on one GPU and with DDP and FSDP2 on two (bf16 base, bf16-mixed): "
          "the strategies build from their _target_, AdamW runs fused, DDP and FSDP2 export the same LoRA tensors",
    phases=(*(train(f"tiny_{p}", n, 4, tiny_data, f"parallel={p}", "callbacks.checkpoint.every_n_train_steps=2",
                    phase=p, minutes=1) for p, n in (("single", 1), ("ddp", 2), ("fsdp", 2))),
            compare_lora("compare", "tiny_ddp", "tiny_fsdp", "final")),
    checks=(*(c for p in ("single", "ddp", "fsdp") for c in finished(p, 4)),
            *(Check(f"metrics.{p}.optimizer_fused", "==", True, p, f"{p}: AdamW fused on the GPU")
              for p in ("single", "ddp", "fsdp")),
            Check("metrics.ddp.world_size", "==", 2, "ddp", "two ranks"), in_sync("ddp"), in_sync("fsdp"),
            Check("phases.compare.rc", "==", 0, "compare", "DDP and FSDP2 export the same LoRA tensors")),
    collect=runs(single="tiny_single", ddp="tiny_ddp", fsdp="tiny_fsdp"),
    record=tuple(f"{k}.final_step" for k in ("single", "ddp", "fsdp")),
)

DS = "deepspeed_2gpu"
ZERO = {"zero2": ("parallel.strategy.stage=2",), "zero3": ("parallel.strategy.stage=3",),
        "zero2_offload": ("parallel.strategy.stage=2", "parallel.strategy.offload_optimizer=true")}


def _ds_tiny(name: str, steps: int, *extra: str, resume: bool = False) -> Phase:
    run = f"ds_tiny_{name}"
    return train(run, 2, steps, tiny_data, "trainer.gradient_clip_val=1.0",
                 "callbacks.checkpoint.every_n_train_steps=2",
                 "optim.scheduler=constant", *extra, *(("resume=last",) if resume else ()),
                 phase=name + ("_resume" if resume else ""), fresh=not resume, minutes=1.5)


DS_JOB = Case(
    name=DS, gpus=2, model="tiny",
    about="DeepSpeed ZeRO-2, ZeRO-3 and ZeRO-2 with the optimizer offloaded on the tiny model (2 GPUs, bf16, "
          "clipping): 4 steps (checkpoint + LoRA at 2 and 4), then resume=last to step 6; ZeRO-2's LoRA against "
          "DDP's (needs the deepspeed wheel)",
    phases=(_ds_tiny("ddp", 4, "parallel=ddp"),
            *(p for z, extra in ZERO.items() for p in (_ds_tiny(z, 4, "parallel=deepspeed", *extra),
                                                       _ds_tiny(z, 6, "parallel=deepspeed", *extra, resume=True))),
            compare_lora("compare", "ds_tiny_ddp", "ds_tiny_zero2", "step_000004")),
    checks=(*finished("ddp", 4), *(c for z in ZERO for c in finished(z, 6, f"{z}_resume")),
            *(Check(f"phases.{z}.rc", "==", 0, z, f"{z}: the first 4 steps") for z in ZERO),
            *(in_sync(z) for z in ZERO),
            Check("phases.compare.rc", "==", 0, "compare", "ZeRO-2 and DDP export the same LoRA tensors at step 4")),
    collect=runs(ddp="ds_tiny_ddp", **{z: f"ds_tiny_{z}" for z in ZERO}),
    record=tuple(f"{z}.{m}" for z in ZERO for m in ("final_step", "peak_mem_gib")),
)

DS5 = "deepspeed_5b_2gpu"
DS5_RUNS = {f"zero{s}_x{g}": (s, g) for s in (2, 3) for g in (1, 2)}
DS5_JOB = Case(
    name=DS5, gpus=2, model="ti2v5b",
    about="DeepSpeed ZeRO-2 and ZeRO-3 on the real-size TI2V-5B (light encoders, from the cache) at 704x1280x17 on 1 "
          "and 2 GPUs, 6 steps each (ZeRO-3 eager: it refuses compiled blocks)",
    phases=(BUILD_LIGHT, CACHE_LIGHT,
            *(train(f"ds5b_{k}", g, 6, light_data, "parallel=deepspeed", f"parallel.strategy.stage={s}",
                    "trainer.log_every_n_steps=1", "callbacks.checkpoint.every_n_train_steps=3",
                    *(("model.compile=false",) if s == 3 else ()), phase=k, minutes=3)
              for k, (s, g) in DS5_RUNS.items())),
    checks=(*(c for k in DS5_RUNS for c in finished(k, 6)), in_sync("zero2_x2"), in_sync("zero3_x2")),
    collect=runs(**{k: f"ds5b_{k}" for k in DS5_RUNS}),
    record=tuple(f"{k}.{m}" for k in DS5_RUNS for m in ("median_step_s", "peak_mem_gib")),
)

DISTILL = "distill_2gpu"


def dmd_phase(name: str, *extra: str) -> Phase:
    return Phase(name, lambda ctx: [ctx.python, "tests/gpu/dmd_step.py", "--model-path", str(dit_dir(ctx)), *extra,
                                    "--json", str(ctx.results(DISTILL) / f"{name}.json")],
                 minutes=4, env={"CUDA_VISIBLE_DEVICES": "0"})


def distill_metrics(ctx: Ctx, phases: dict) -> dict:
    m = runs(fsdp_compile="tiny_fsdp_compile", fp16="tiny_fp16", dmd_tiny="tiny_dmd")(ctx, phases)
    for name in ("dmd_5b", "dmd_5b_ckpt"):
        res = _json(ctx.results(DISTILL) / f"{name}.json")
        m[name] = {**res.get("dmd", {}), "dtype_error": res.get("dtype_error")}
    return m


TINY_EAGER = ("data.use_cache=false",)
DISTILL_JOB = Case(
    name=DISTILL, gpus=2, model="ti2v5b",
    about="FSDP2 with compiled blocks (tiny, 2 GPUs), 16-mixed with fp16 base weights (tiny), objective=dmd (tiny); "
          "the DMD generator/critic step time and peak on the real-size TI2V-5B DiT with and without checkpointing, "
          "and the fp16/bf16 forward error against fp32",
    phases=(train("tiny_fsdp_compile", 2, 4, tiny_data, *TINY_EAGER, "parallel=fsdp", "model.compile=true",
                  phase="fsdp_compile", minutes=2),
            train("tiny_fp16", 1, 8, lambda ctx: tiny_data(ctx, "16-mixed", "fp16"), *TINY_EAGER, "parallel=single",
                  phase="fp16", minutes=1),
            train("tiny_dmd", 1, 12, tiny_data, *TINY_EAGER, "parallel=single", "objective=dmd", phase="dmd_tiny",
                  minutes=1),
            BUILD_DIT, dmd_phase("dmd_5b"), dmd_phase("dmd_5b_ckpt", "--ckpt", "--skip-dtype")),
    checks=(*finished("fsdp_compile", 4), *finished("fp16", 8), *finished("dmd_tiny", 12),
            Check("metrics.fp16.optimizer_fused", "==", True, "fp16", "fused AdamW with the grad scaler"),
            Check("metrics.dmd_5b.dtype_error.fp16.finite", "==", True, "dmd_5b", "an fp16 forward stays finite"),
            Check("metrics.dmd_5b.dtype_error.fp16.rel_err", "<=", 0.02, "dmd_5b", "fp16 weights' output error"),
            Check("metrics.dmd_5b_ckpt.peak_gib", "<=", 17, "dmd_5b_ckpt", "14.8 GiB measured (H200)"),
            Check("metrics.dmd_5b_ckpt.mean_step_s", "present", None, "dmd_5b_ckpt", "mean step over a 5:1 cycle")),
    collect=distill_metrics,
    record=tuple(f"{p}.{m}" for p in ("dmd_5b", "dmd_5b_ckpt") for m in ("mean_step_s", "peak_gib")),
)

CASES: dict[str, Case] = {c.name: c for c in (
    USER_JOB, V100_JOB, PCIE_JOB, LOADER_JOB, PERF_JOB, A14B_DIT_JOB, FP8_JOB, BUDGET_JOB, GAP_JOB,
    GRAPHS_TRAIN_JOB, HOST_JOB,
    STRAT2_JOB, STRAT4_JOB, STRAT_A14B_JOB, STRAT_A14B4_JOB, SEAMS_JOB, DS_JOB, DS5_JOB, DISTILL_JOB)}


# ---- low VRAM: block swap and FP8 storage (docs/memory.md), one GPU capped ---------------------------------------
# Each capped bench runs in the same device call as the uncapped default step it is compared with: run the phases
# named in each case's `about` together (--phase base,swap, then --phase base2,swap_fp8).
ALLOC = {"CUDA_VISIBLE_DEVICES": "0", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # as train.py sets it


def lowvram_bench(name: str, case: str, *args: str, model: Callable[[Ctx], Path] = dit_dir, cap: int | None = None,
                  minutes: float = 4) -> Phase:
    """:func:`bench` with the allocator setting train.py applies (parallel.env), one GPU."""
    import dataclasses

    return dataclasses.replace(bench(name, case, *args, model=model, cap=cap, minutes=minutes), env=dict(ALLOC))


def step_ratio(case: str, pairs: dict[str, tuple[str, str]]) -> Callable[[Ctx, dict], dict]:
    """The bench JSONs of ``case`` read back, and for each ``key: (capped, baseline)`` the capped wanexp step's median
    over the baseline's (``<key>_ratio``) and the capped run's peak (``<key>_peak_gib``)."""
    def collect(ctx: Ctx, phases: dict) -> dict:
        names = {n for pair in pairs.values() for n in pair}
        out = {n: bench_metrics(bench_json(ctx, case, n)) for n in names}
        for key, (capped, base) in pairs.items():
            c, b = (out[capped].get("wanexp", {}), out[base].get("wanexp", {}))
            out[f"{key}_ratio"] = ratio(c.get("median_s"), b.get("median_s"))
            out[f"{key}_peak_gib"] = c.get("peak_gib")
        return out
    return collect


A14B_SHAPE = ("--model", "t2v14b", "--height", "480", "--width", "832", "--frames", "81", "--ckpt", "--paths",
              "wanexp", "--no-check", "--warmup", "1", "--steps", "2")
SWAP_A14B, SWAP_A14B_N, SWAP_A14B_FP8_N = "lowvram_a14b_28g", 40, 34


def _a14b_dir(ctx: Ctx) -> Path:
    return ctx.work / "t2v14b"  # the DiT of perf_a14b's build_dit


LOWVRAM_A14B_JOB = Case(
    name=SWAP_A14B, gpus=1, model="a14b",
    about=f"one real-size A14B expert (T2V-A14B's DiT; the I2V high-noise expert differs only in its patch "
          f"embedding's 36 input channels), LoRA r32, 480x832x81, checkpointing, the process capped at {CAP_GIB} GiB: "
          f"model.blocks_to_swap={SWAP_A14B_N} (call --phase base,swap), and with model.fp8_storage=true and "
          f"blocks_to_swap={SWAP_A14B_FP8_N} (call --phase base2,swap_fp8); FP8 storage with offloaded activations and "
          "compiled blocks, no swap (--phase build_dit,base,fp8_fit); each against the uncapped default step "
          "(compiled, no swap) in the same call",
    phases=(Phase("build_dit", lambda ctx: [ctx.python, "tests/gpu/build_transformer.py", "--model", "t2v14b",
                                            "--path", str(_a14b_dir(ctx))], minutes=5,
                  fresh=lambda ctx: [dit_dir(ctx)]),
            lowvram_bench("base", SWAP_A14B, *A14B_SHAPE, model=_a14b_dir),
            lowvram_bench("swap", SWAP_A14B, *A14B_SHAPE, "--set", f"model.blocks_to_swap={SWAP_A14B_N}",
                          "model.compile=false", "model.offload_activations=true", model=_a14b_dir, cap=CAP_GIB),
            lowvram_bench("base2", SWAP_A14B, *A14B_SHAPE, model=_a14b_dir),
            lowvram_bench("swap_fp8", SWAP_A14B, *A14B_SHAPE, "--set", f"model.blocks_to_swap={SWAP_A14B_FP8_N}",
                          "model.fp8_storage=true", "model.compile=false", "model.offload_activations=true",
                          model=_a14b_dir, cap=CAP_GIB),
            lowvram_bench("fp8_fit", SWAP_A14B, *A14B_SHAPE, "--set", "model.fp8_storage=true",
                          "model.offload_activations=true", model=_a14b_dir, cap=CAP_GIB)),
    checks=(Check("phases.swap.rc", "==", 0, "swap", f"block swap: no out-of-memory under the {CAP_GIB} GiB cap"),
            Check("metrics.swap_peak_gib", "<=", CAP_GIB, "swap", "the capped step's peak"),
            Check("metrics.swap_ratio", "<=", 1.5, "swap", "capped with block swap / uncapped default step"),
            Check("phases.swap_fp8.rc", "==", 0, "swap_fp8", f"FP8 storage + swap: no out-of-memory at {CAP_GIB} GiB"),
            Check("metrics.swap_fp8_peak_gib", "<=", CAP_GIB, "swap_fp8", "the capped step's peak"),
            Check("metrics.swap_fp8_ratio", "<=", 1.5, "swap_fp8", "capped with FP8 storage and swap / uncapped"),
            Check("phases.fp8_fit.rc", "==", 0, "fp8_fit", f"FP8 storage, offloaded activations: fits {CAP_GIB} GiB"),
            Check("metrics.fp8_fit_peak_gib", "<=", CAP_GIB, "fp8_fit", "the capped step's peak"),
            Check("metrics.fp8_fit_ratio", "<=", 1.25, "fp8_fit", "capped with FP8 storage (compiled) / uncapped")),
    collect=step_ratio(SWAP_A14B, {"swap": ("swap", "base"), "swap_fp8": ("swap_fp8", "base2"),
                                   "fp8_fit": ("fp8_fit", "base")}),
    record=("base.wanexp.median_s", "swap.wanexp.median_s", "swap_ratio", "swap_peak_gib",
            "base2.wanexp.median_s", "swap_fp8.wanexp.median_s", "swap_fp8_ratio", "swap_fp8_peak_gib",
            "fp8_fit.wanexp.median_s", "fp8_fit_ratio", "fp8_fit_peak_gib"),
)

LOWVRAM_5B, LOWVRAM_5B_CAP = "lowvram_5b_16g", 16
FP8S_VARIANT = "wanexp_model_fp8_storage_true"
FIVE_B_SHAPE = ("--frames", "17", "--ckpt", "--paths", "wanexp", "--no-check", "--warmup", "3", "--steps", "6")
LOWVRAM_5B_JOB = Case(
    name=LOWVRAM_5B, gpus=1, model="ti2v5b",
    about=f"the real-size TI2V-5B DiT at 704x1280x17, checkpointing, the process capped at {LOWVRAM_5B_CAP} GiB (24 GB "
          "cards): the default step, and model.blocks_to_swap=10 with model.fp8_storage=true (recorded), against the "
          "uncapped default step in the same call (--phase build_dit,base,capped); FP8 storage's error against the "
          "plain loop (--phase error)",
    phases=(BUILD_DIT,
            lowvram_bench("base", LOWVRAM_5B, *FIVE_B_SHAPE),
            lowvram_bench("capped", LOWVRAM_5B, *FIVE_B_SHAPE, "--variants",
                          "model.blocks_to_swap=10 model.fp8_storage=true model.compile=false", cap=LOWVRAM_5B_CAP),
            lowvram_bench("error", LOWVRAM_5B, "--frames", "17", "--paths", "plain_tokens,wanexp", "--variants",
                          "model.fp8_storage=true", "--warmup", "1", "--steps", "2")),
    checks=(Check(f"metrics.error.{FP8S_VARIANT}.out_rel_err", "<=", 0.05, "error",
                  "FP8 storage's output error vs the plain bf16 loop, real-size 5B (FP8 GEMM: 2.2e-2)"),
            Check(f"metrics.error.{FP8S_VARIANT}.grad_rel_err", "<=", 0.075, "error", "and its LoRA gradients' error"),Check("phases.capped.rc", "==", 0, "capped", f"no out-of-memory under the {LOWVRAM_5B_CAP} GiB cap"),
            Check("metrics.capped_peak_gib", "<=", LOWVRAM_5B_CAP, "capped", "the capped default step's peak"),
            Check("metrics.capped_ratio", "<=", 1.2, "capped", "capped / uncapped default step"),
            Check("metrics.capped.wanexp_model_blocks_to_swap_10_model_fp8_storage_true_model_compile_false.median_s",
                  "present", None, "capped", "swap + FP8 storage under the cap, recorded")),
    collect=both(step_ratio(LOWVRAM_5B, {"capped": ("capped", "base")}), bench_results(LOWVRAM_5B, "error")),
    record=("base.wanexp.median_s", "capped.wanexp.median_s", "capped_ratio", "capped_peak_gib",
            f"error.{FP8S_VARIANT}.out_rel_err", f"error.{FP8S_VARIANT}.grad_rel_err",
            "capped.wanexp_model_blocks_to_swap_10_model_fp8_storage_true_model_compile_false.median_s",
            "capped.wanexp_model_blocks_to_swap_10_model_fp8_storage_true_model_compile_false.peak_gib"),
)

CASES.update({c.name: c for c in (LOWVRAM_A14B_JOB, LOWVRAM_5B_JOB)})


# ---- wanexp-plan against the run it plans: real-size TI2V-5B, two buckets, validation on (one H100) ---------------
PLAN, PLAN_STEPS = "plan_5b", 500


def plan_data(ctx: Ctx) -> list[str]:
    """The user's data settings on generated clips plus generated images: two buckets (17x704x1280, 1x704x1280);
    validation every 250 steps (at step 0, 250 and 500) so that a 500-step run holds several calls."""
    own = {"paths.data_dir": str(ctx.work / "data_plan"), "data.generate.num_images": "16"}
    return [*(a for a in user_data(ctx) if a.split("=", 1)[0] not in own), *(f"{k}={v}" for k, v in own.items()),
            "callbacks.validation.every_n_steps=250", "callbacks.progress=null", f"run_name={PLAN}",
            f"paths.output_dir={ctx.run_dir(PLAN)}", f"trainer.max_steps={PLAN_STEPS}", "trainer.devices=1"]


def plan_json(ctx: Ctx, case: str = PLAN) -> Path:
    return ctx.work / case / "plan.json"  # kept with the work (a later device call runs the train phase)


def plan_metrics(case: str) -> Callable[[Ctx, dict], dict]:
    """The plan's ETA and peak against the run's wall time (the train phase's seconds) and peak (status.json), and
    its all-reduce part (bandwidth at the gradients' size, peer access, share of a step) where it measured one."""
    def collect(ctx: Ctx, phases: dict) -> dict:
        planned = _json(plan_json(ctx, case))
        run = run_metrics(ctx.run_dir(case))
        eta = (planned.get("eta") or {}).get("total_s")
        peak = (planned.get("memory") or {}).get("peak_gib")
        wall = (phases.get("train") or {}).get("seconds")
        comm = planned.get("comm") or {}
        return {**run, "plan": str(plan_json(ctx, case)),
                "planned_steps": (planned.get("data") or {}).get("total_steps"), "planned_eta_s": eta,
                "planned_peak_gib": peak, "train_wall_s": wall,
                "eta_error": abs(eta - wall) / wall if eta and wall else None,
                "peak_error": abs(peak - run["peak_mem_gib"]) / run["peak_mem_gib"]
                if peak and run.get("peak_mem_gib") else None,
                "eta_parts": (planned.get("eta") or {}).get("parts"), "comm": comm,
                "grad_busbw_gbs": (comm.get("grad_busbw") or 0) / 1e9 or None,
                "grad_allreduce_ms": (comm.get("grad_allreduce_s") or 0) * 1e3 or None,
                "allreduce_share": comm.get("share")}
    return collect


def plan_and_run(case: str, args: Callable[[Ctx], list[str]], gpus: str, train_minutes: float) -> tuple:
    """The plan phase (its JSON kept with the work) and the planned run's train phase, on the GPUs ``gpus``."""
    return (Phase("plan", lambda ctx: [ctx.python, "-m", "wanexp.cli.plan", *args(ctx), "--budget-gib",
                                       str(CAP_GIB), "--json", str(plan_json(ctx, case))], minutes=4,
                  env={"CUDA_VISIBLE_DEVICES": gpus}),
            Phase("train", lambda ctx: [ctx.python, "train.py", *args(ctx), "overwrite=true"],
                  minutes=train_minutes, env={"CUDA_VISIBLE_DEVICES": gpus}, fresh=lambda ctx: [ctx.run_dir(case)]))


def plan_checks(steps: int, eta_tol: float) -> tuple[Check, ...]:
    return (Check("phases.train.rc", "==", 0, "train", "the planned run exits 0"),
            Check("metrics.planned_steps", "==", steps, "plan", "the plan's total steps"),
            Check("metrics.final_step", "==", steps, "train", "the run's steps"),
            Check("metrics.eta_error", "<=", eta_tol, "train", "|planned ETA - wall time| / wall time"),
            Check("metrics.peak_error", "<=", 0.05, "train", "|planned peak - measured peak| / measured peak"))


PLAN_JOB = Case(
    name=PLAN, gpus=1, model="ti2v5b",
    about=f"wanexp-plan (calibrated: a few steps per bucket, validation calls in the run's order, one checkpoint) "
          f"of a {PLAN_STEPS}-step "
          "python train.py run of real-size TI2V-5B (random weights) from a cache of generated clips and images (two "
          "buckets), validation on; then that run: planned ETA within 10 % of its wall time, peak within 5 %",
    phases=(BUILD,
            Phase("cache", lambda ctx: [ctx.python, "-m", "wanexp.cli.cache", *plan_data(ctx)], minutes=4),
            *plan_and_run(PLAN, plan_data, "0", train_minutes=7)),
    checks=(Check("phases.plan.rc", "==", 0, "plan", f"the plan fits (one H100, --budget-gib {CAP_GIB})"),
            *plan_checks(PLAN_STEPS, 0.10)),
    collect=plan_metrics(PLAN),
    record=("planned_eta_s", "train_wall_s", "eta_error", "planned_peak_gib", "peak_mem_gib", "peak_error",
            "validations", "median_step_s"),
)

CASES[PLAN] = PLAN_JOB


# ---- wanexp-plan on two GPUs of one node: the all-reduce part measured, then the planned DDP run (light encoders) ----
PLAN2, PLAN2_STEPS = "plan_5b_2gpu", 100


def plan2_args(ctx: Ctx) -> list[str]:
    return [*light_data(ctx), "trainer.devices=2", f"trainer.max_steps={PLAN2_STEPS}", "callbacks.progress=null",
            "callbacks.validation.every_n_steps=0", f"run_name={PLAN2}", f"paths.output_dir={ctx.run_dir(PLAN2)}"]


CASES[PLAN2] = Case(
    name=PLAN2, gpus=2, model="ti2v5b",
    about=f"wanexp-plan with trainer.devices=2 (one process, two GPUs: the all-reduce measured between them, peer "
          f"access, the gradient all-reduce's share of the step), then that {PLAN2_STEPS}-step DDP run of the "
          "real-size TI2V-5B DiT (light encoders) from the cache of 48 generated clips, validation off",
    phases=(BUILD_LIGHT, CACHE_LIGHT, *plan_and_run(PLAN2, plan2_args, "0,1", train_minutes=4)),
    checks=(Check("phases.plan.rc", "==", 0, "plan", "the plan fits"),
            Check("metrics.comm.sizes", "present", None, "plan", "all-reduce bus bandwidth measured at several sizes"),
            Check("metrics.grad_allreduce_ms", "present", None, "plan", "the gradient all-reduce's time predicted"),
            *plan_checks(PLAN2_STEPS, 0.15)),
    collect=plan_metrics(PLAN2),
    record=("planned_eta_s", "train_wall_s", "eta_error", "planned_peak_gib", "peak_mem_gib", "peak_error",
            "grad_busbw_gbs", "grad_allreduce_ms", "allreduce_share", "comm.p2p", "median_step_s"),
)


# ---- learnability: training learns (tests/learn_toy.py, the CPU test's code, larger) -----------------------------
LEARN = "learnability"


def learn_dir(ctx: Ctx) -> Path:
    return ctx.results(LEARN)  # strip.png and learnability.json; run.py copies them into the record folder


CASES[LEARN] = Case(
    name=LEARN, gpus=1, model="toy",
    about="a Wan-architecture DiT (4 layers, width 128) trained from scratch on toy latent videos (a moving square of "
          "colour A), a LoRA tuned on colour B through wanexp's adapter, flow-matching objective and export (loaded "
          "as diffusers loads it), and a 4-step DMD student of the base: the LoRA's samples change hue toward B, the "
          "base's do not; the student's samples are closer (PSNR of the sorted values) to the 50-step teacher's than "
          "the untrained 4-step sampler's; strip.png: first/middle/last frames of base, LoRA, teacher, student",
    phases=(Phase("learn", lambda ctx: [ctx.python, "-m", "tests.learn_toy", "--out", str(learn_dir(ctx)),
                                        "--scale", "3"], minutes=4),),
    checks=(Check("phases.learn.rc", "==", 0, "learn", "the toy runs exit 0"),
            Check("metrics.hue_base", ">", 0.1, "learn", "the base generates colour A (hue > 0)"),
            Check("metrics.hue_lora", "<", 0.0, "learn", "the LoRA's samples moved to colour B (hue < 0)"),
            Check("metrics.psnr_gain", ">", 0.5, "learn", "DMD: the 4-step student closer to the teacher (dB)"),
            Check("metrics.strip", "present", None, "learn", "the sample strip PNG")),
    collect=lambda ctx, phases: _json(learn_dir(ctx) / "learnability.json"),
    record=("hue_base", "hue_lora", "psnr_untrained", "psnr_student", "psnr_gain", "psnr_teacher_reseeded", "seconds"),
)


# ---- the step against the strongest plain loop: every plain loop, compiled ones included (one H100) ----------------
VS_COMPILED = "perf_vs_compiled"
VS_PATHS = "plain,plain_compiled,plain_tokens,plain_tokens_compiled,wanexp"
VS_RUNS = ("bench", "bench_ckpt")
VS_MORE = ("long",)  # 27,280 tokens with checkpointing
# GPU time by kernel kind: the strongest loop, wanexp and (without checkpointing) the opt-in FP8 base
VS_PROFILE = ("--profile", "plain_tokens_compiled,wanexp")


def strongest_metrics(case: str, *names: str) -> Callable[[Ctx, dict], dict]:
    """bench_metrics of each bench JSON plus, per path, ``vs_strongest`` (its speed-up against the fastest plain
    loop of the same run) and the run's ``strongest_plain``."""
    def collect(ctx: Ctx, phases: dict) -> dict:
        out = {}
        for n in names:
            path = bench_json(ctx, case, n)
            m = bench_metrics(path)
            runs = json.loads(path.read_text()) if path.is_file() else []
            if runs:
                m["strongest_plain"] = runs[-1].get("strongest_plain")
                for r in runs[-1].get("results", []):
                    m.setdefault(_slug(r["path"]), {})["vs_strongest"] = r.get("speedup_vs_strongest")
            out[n] = m
        return out
    return collect


PERF_VS_COMPILED_JOB = Case(
    name=VS_COMPILED, gpus=1, model="ti2v5b",
    about="wanexp.cli.bench on the real-size TI2V-5B DiT at 704x1280x17 (4,400 tokens), every path in one process: "
          "the plain loops (scalar and per-token timesteps, eager and with each block compiled) and wanexp's step, "
          "without (bench) and with checkpointing (bench_ckpt); each path's speed-up against the strongest (fastest) "
          "plain loop; the opt-in FP8 base (model.fp8=true, in bench, alone and with the graphs), selective "
          "checkpointing (model.selective_checkpointing=true, in bench_ckpt and long), the memory budget with the "
          "graphs (bench_ckpt: bf16 in 22 GiB, the FP8 base in 20 and 13 GiB) and 27,280 tokens with "
          "checkpointing (long) against the compiled per-token loop; the card's clock and power per path. One call "
          "per phase after build_dit",
    phases=(BUILD_DIT,
            bench("bench", VS_COMPILED, "--frames", "17", "--paths", VS_PATHS, "--variants",
                  f"model.fp8=true;{GRAPHS};{FP8_GRAPHS}", "--warmup", "3", "--steps", "6", "--profile",
                  f"{VS_PROFILE[1]},{FP8_VARIANT_PATH},{GRAPHS_VARIANT_PATH},{FP8_GRAPHS_VARIANT_PATH}", minutes=6.5),
            bench("bench_ckpt", VS_COMPILED, "--frames", "17", "--ckpt", "--paths", VS_PATHS, "--warmup", "3",
                  "--steps", "6", "--variants",
                  ";".join(("model.selective_checkpointing=true", SAC_GRAPHS, *BUDGET_GRAPHS.values(),
                            *FP8_BUDGET_GRAPHS.values())), "--profile",
                  f"{VS_PROFILE[1]},{SAC_VARIANT_PATH},{SAC_GRAPHS_VARIANT_PATH},wanexp [{BUDGET_GRAPHS[22]}],"
                  f"wanexp [{FP8_BUDGET_GRAPHS[20]}]", minutes=8),
            bench("long", VS_COMPILED, "--frames", "121", "--ckpt", "--paths", "plain_tokens_compiled,wanexp",
                  "--variants", "model.selective_checkpointing=true", "--warmup", "1", "--steps", "3", "--no-check",
                  "--profile", f"wanexp,{SAC_VARIANT_PATH}", minutes=6)),
    checks=(
        *(Check(f"metrics.{p}.numerics_ok", "==", True, p, f"{p}: wanexp and the compiled per-token plain loop "
                "compute the plain loop's function") for p in VS_RUNS),
        *(Check(f"metrics.{p}.strongest_plain", "present", None, p, f"{p}: the fastest plain loop") for p in VS_RUNS),
        Check("metrics.bench.wanexp.vs_strongest", ">=", 0.95, "bench",
              "no slower than the strongest plain loop (0.96-1.00x measured 2026-11-29 on an H200; target 1.2x)"),
        Check("metrics.bench_ckpt.wanexp.vs_strongest", ">=", 0.98, "bench_ckpt",
              "vs the strongest checkpointed plain loop (1.03x measured 2026-11-27; the target is 1.33x)"),
        Check(f"metrics.bench_ckpt.{BUDGET_GRAPHS_VARIANT[22]}.vs_strongest", ">=", 1.2, "bench_ckpt",
              "a 22 GiB budget with the graphs (1.23-1.27x measured 2026-11-29 on an H200; the target is 1.33x)"),
        Check(f"metrics.bench_ckpt.{BUDGET_GRAPHS_VARIANT[22]}.peak_gib", "<=", 20, "bench_ckpt",
              "within the target's 20 GiB (18.4 GiB measured)"),
        Check(f"metrics.bench_ckpt.{FP8_BUDGET_GRAPHS_VARIANT[20]}.vs_strongest", ">=", 1.33, "bench_ckpt",
              "the FP8 base in a 20 GiB budget with the graphs: the target (1.46-1.47x measured 2026-11-29, H200)"),
        Check(f"metrics.bench_ckpt.{FP8_BUDGET_GRAPHS_VARIANT[20]}.peak_gib", "<=", 20, "bench_ckpt",
              "within the target's 20 GiB (16.6 GiB measured)"),
        Check(f"metrics.bench_ckpt.{FP8_BUDGET_GRAPHS_VARIANT[13]}.median_s", "<=", 0.300, "bench_ckpt",
              "the low-memory target's 300 ms (247.6-249.2 ms measured 2026-11-29, H200, FP8 base with the graphs)"),
        Check(f"metrics.bench_ckpt.{FP8_BUDGET_GRAPHS_VARIANT[13]}.peak_gib", "<=", 13, "bench_ckpt",
              "the low-memory target's 13 GiB (11.6-12.1 GiB measured)"),
        Check(f"metrics.bench.{GRAPHS_VARIANT}.median_s", "present", None, "bench",
              "the graphs without checkpointing (1.01x the default measured 2026-11-29)"),
        Check(f"metrics.bench.{FP8_VARIANT}.median_s", "present", None, "bench",
              "the FP8 base's step (target 180 ms; 209.6-265 ms measured 2026-11-29 on an H200; with "
              "the graphs and the noise drawn on the device 201.5-204.8 ms)"),
        Check(f"metrics.bench.{FP8_VARIANT}.out_rel_err", "<=", 0.05, "bench", "its output error (2.2e-2 measured)"),
        Check(f"metrics.bench.{FP8_GRAPHS_VARIANT}.median_s", "present", None, "bench",
              "the FP8 base with the graphs (208.1 ms against 209.6 without them, 2026-11-29, H200)"),
        Check("metrics.long.wanexp.tflops", ">=", 460, "long",
              "27,280 tokens with checkpointing (484 TFLOP/s measured 2026-11-27; the target is 550)"),
        Check("metrics.bench_ckpt.wanexp.peak_gib", "<=", 14, "bench_ckpt", "12.4 GiB measured (H100)"),
        *(Check(f"metrics.{p}.{SAC_VARIANT}.median_s", "present", None, p,
                f"{p}: selective checkpointing's step (target: 270 ms at <= 20 GiB at 4,400 tokens)")
          for p in ("bench_ckpt", "long")),
    ),
    collect=strongest_metrics(VS_COMPILED, *VS_RUNS, *VS_MORE),
    record=(*(f"{p}.{k}" for p in VS_RUNS for k in (
        "strongest_plain", *(f"{path}.median_s" for path in VS_PATHS.split(",")),
        *(f"{path}.peak_gib" for path in ("plain_tokens_compiled", "wanexp")), "wanexp.vs_strongest")),
            *(f"bench.{FP8_VARIANT}.{k}" for k in ("median_s", "out_rel_err", "grad_rel_err", "peak_gib")),
            *(f"long.{k}" for k in ("plain_tokens_compiled.median_s", "wanexp.median_s", "wanexp.tflops",
                                    "wanexp.vs_strongest")),
            *(f"{p}.{SAC_VARIANT}.{k}" for p in ("bench_ckpt", "long")
              for k in ("median_s", "peak_gib", "tflops", "out_rel_err", "grad_rel_err")),
            *(f"{p}.{path}.{k}" for p in VS_RUNS for path in ("plain_tokens_compiled", "wanexp")
              for k in ("sm_mhz", "power_w")),
            *(f"{p}.{v}.{k}" for p, v in (("bench", GRAPHS_VARIANT), ("bench", FP8_GRAPHS_VARIANT),
                                          ("bench_ckpt", SAC_GRAPHS_VARIANT),
                                          *(("bench_ckpt", v) for v in (*BUDGET_GRAPHS_VARIANT.values(),
                                                                         *FP8_BUDGET_GRAPHS_VARIANT.values())))
              for k in ("median_s", "peak_gib", "vs_strongest", "out_rel_err", "grad_rel_err", "sm_mhz", "power_w"))),
)

CASES[VS_COMPILED] = PERF_VS_COMPILED_JOB


# ---- FlashAttention-4 against cuDNN's SDPA: the kernels alone and in the step (one Hopper GPU) --------------------
FA4_CASE = "attention_fa4"
FA4_SET = "model.attention_backend=fa4"
FA4_VARIANT = _slug(f"wanexp [{FA4_SET}]")
FA4_STEP = {  # label -> variant: without checkpointing, where the graphs take the host's launch time away
    "graphs": GRAPHS, "graphs_fa4": f"{GRAPHS} {FA4_SET}", "fp8_graphs": FP8_GRAPHS,
    "fp8_graphs_fa4": f"{FP8_GRAPHS} {FA4_SET}"}
FA4_STEP_VARIANT = {k: _slug(f"wanexp [{v}]") for k, v in FA4_STEP.items()}
FA4_CKPT = f"{FP8_BUDGET_GRAPHS[20]} {FA4_SET}"
FA4_CKPT_VARIANT = _slug(f"wanexp [{FA4_CKPT}]")
FA4_LONG_BUDGET = f"model.memory_budget_gib=60 {FA4_SET}"  # 27,280 tokens as an 80 GB card's user would set it
FA4_LONG_BUDGET_VARIANT = _slug(f"wanexp [{FA4_LONG_BUDGET}]")
FA4_CKPT_BF16 = f"model.memory_budget_gib=23 {GRAPHS} {FA4_SET}"  # bf16 within 20 GiB (19.5 GiB measured)
FA4_CKPT_BF16_VARIANT = _slug(f"wanexp [{FA4_CKPT_BF16}]")


def fa4_metrics(ctx: Ctx, phases: dict) -> dict:
    """The kernels' JSON and the benches', and FA4's step over cuDNN's in each pair that differs only in it."""
    out = strongest_metrics(FA4_CASE, "short", "ckpt", "long")(ctx, phases)
    out["kernels"] = _json(ctx.results(FA4_CASE) / "kernels.json").get("shapes", {})
    s, long = out.get("short", {}), out.get("long", {})

    def over(m: dict, fa4: str, base: str) -> float | None:
        return ratio(m.get(fa4, {}).get("median_s"), m.get(base, {}).get("median_s"))

    out["fa4_over_cudnn"] = {"short": over(s, FA4_VARIANT, "wanexp"),
                             "graphs": over(s, FA4_STEP_VARIANT["graphs_fa4"], FA4_STEP_VARIANT["graphs"]),
                             "fp8_graphs": over(s, FA4_STEP_VARIANT["fp8_graphs_fa4"], FA4_STEP_VARIANT["fp8_graphs"]),
                             "long": over(long, FA4_VARIANT, "wanexp")}
    return out


ATTENTION_FA4_JOB = Case(
    name=FA4_CASE, gpus=1, model="ti2v5b",
    about="model.attention_backend=fa4 (FlashAttention-4; install: tests/gpu/fa4_parts.sh here, then source "
          "tests/gpu/setup_fa4.sh after setup_env.sh in each device call) against cuDNN's SDPA on a Hopper GPU: the "
          "kernels alone at the Wan2.2 shapes (tests/gpu/attention_ab.py), then the real-size TI2V-5B step at 4,400 "
          "tokens without checkpointing (bf16 and FP8, with the graphs), with the compiled checkpoint (bf16 within 20 "
          "GiB and the FP8 base in a 20 GiB budget, with the graphs) and at 27,280 tokens with every block "
          "checkpointed and in a 60 GiB budget. One call per phase after build_dit",
    phases=(BUILD_DIT,
            Phase("kernels", lambda ctx: [ctx.python, "tests/gpu/attention_ab.py", "--json",
                                          str(ctx.results(FA4_CASE) / "kernels.json")], minutes=1.5),
            bench("short", FA4_CASE, "--frames", "17", "--paths", "plain_compiled,wanexp", "--variants",
                  ";".join((FA4_SET, *FA4_STEP.values())), "--warmup", "3", "--steps", "6", "--fp32-floor", "off",
                  "--profile", f"wanexp,wanexp [{FA4_SET}]", minutes=7),
            bench("ckpt", FA4_CASE, "--frames", "17", "--ckpt", "--paths", "plain_tokens_compiled,wanexp",
                  "--variants", f"{FA4_SET};{FA4_CKPT_BF16};{FP8_BUDGET_GRAPHS[20]};{FA4_CKPT}", "--warmup", "3",
                  "--steps", "6", "--fp32-floor", "on", minutes=8.5),
            bench("long", FA4_CASE, "--frames", "121", "--ckpt", "--paths", "wanexp", "--variants",
                  f"{FA4_SET};{FA4_LONG_BUDGET}", "--warmup", "1", "--steps", "2", "--no-check", minutes=6)),
    checks=(
        Check("metrics.kernels.5b_self_27280.fa4.fwd_bwd_tflops", ">=", 580, "kernels",
              "FA4 at 27,280 tokens, forward + backward (622 TFLOP/s measured 2026-11-29 on an H200; cuDNN 544)"),
        Check("metrics.kernels.5b_self_4400.fa4.grad_rel_err", "<=", 5e-3, "kernels",
              "its gradients against fp32 (2.4e-3, as cuDNN's)"),
        Check("metrics.short.numerics_ok", "==", True, "short", "every path computes the plain loop's function"),
        Check("metrics.fa4_over_cudnn.fp8_graphs", "<=", 0.97, "short",
              "FP8 with the graphs, FA4 over cuDNN (198.4 / 211.2 ms = 0.94 measured 2026-11-29)"),
        Check("metrics.fa4_over_cudnn.long", "<=", 0.95, "long",
              "27,280 tokens, FA4 over cuDNN (0.90 measured with the compiled checkpoint, 2026-11-29)"),
        Check(f"metrics.long.{FA4_VARIANT}.tflops", ">=", 550, "long",
              "27,280 tokens with every block checkpointed (553 TFLOP/s measured 2026-11-29 on an H200)"),
        Check(f"metrics.short.{FA4_STEP_VARIANT['fp8_graphs_fa4']}.vs_strongest", ">=", 1.2, "short",
              "without checkpointing against the strongest plain loop of the same call (1.23x, 2026-11-29)"),
        Check("metrics.ckpt.numerics_ok", "==", True, "ckpt", "FA4 in the compiled checkpoint's recompute (against "
              "the fp32 function: the compiled checkpoint is 1.5e-2 from the plain bf16 loop, nearer fp32 than it)"),
        Check(f"metrics.ckpt.{FA4_CKPT_BF16_VARIANT}.median_s", "<=", 0.270, "ckpt",
              "bf16 checkpointed step (265.7-266.2 ms measured 2026-11-29 on an H200)"),
        Check(f"metrics.ckpt.{FA4_CKPT_BF16_VARIANT}.peak_gib", "<=", 20, "ckpt", "... within 20 GiB (19.5)"),
        Check(f"metrics.ckpt.{FA4_CKPT_VARIANT}.vs_strongest", "present", None, "ckpt",
              "the FP8 base in a 20 GiB budget with FA4 (1.49x measured 2026-11-29)"),
    ),
    collect=fa4_metrics,
    record=("fa4_over_cudnn.short", "fa4_over_cudnn.graphs", "fa4_over_cudnn.fp8_graphs", "fa4_over_cudnn.long",
            *(f"short.{FA4_STEP_VARIANT['fp8_graphs_fa4']}.{k}" for k in ("median_s", "vs_strongest")),
            *(f"long.{v}.{k}" for v in (FA4_VARIANT, FA4_LONG_BUDGET_VARIANT) for k in ("tflops", "peak_gib")),
            *(f"ckpt.{v}.{k}" for v in (FA4_CKPT_VARIANT, FA4_CKPT_BF16_VARIANT)
              for k in ("median_s", "vs_strongest", "peak_gib"))),
)
CASES[FA4_CASE] = ATTENTION_FA4_JOB


# ---- the cache at the VAE's speed: the real-size TI2V-5B VAE and UMT5-XXL on 48 generated clips (one H100) --------
CACHE_SPEED = "cache_speed_5b"
RATE = r"cache rank 0: ([\d.]+) samples/s, "
VAE_RATE = r"the VAE alone ([\d.]+) samples/s"
SHARE = r"samples/s \((\d+) % of it\)"


def cache_speed_dir(ctx: Ctx, dtype: str) -> Path:
    return ctx.work / "cache_speed" / dtype


def cache_speed(dtype: str) -> Phase:
    """The cache command with model.vae_dtype=``dtype`` into an empty cache (the user's data settings, 4 workers)."""
    def argv(ctx: Ctx) -> list[str]:
        data = [a for a in user_data(ctx) if not a.startswith("paths.cache_dir=")]
        return [ctx.python, "-m", "wanexp.cli.cache", *data, f"paths.cache_dir={cache_speed_dir(ctx, dtype)}",
                f"model.vae_dtype={dtype}", f"paths.output_dir={ctx.run_dir(f'cache_{dtype}')}"]
    return Phase(f"cache_{dtype}", argv, minutes=3, env={"CUDA_VISIBLE_DEVICES": "0"},
                 fresh=lambda ctx: [cache_speed_dir(ctx, dtype)])


VAE_DTYPES = ("fp32", "bf16", "fp16")


def cache_speed_metrics(ctx: Ctx, phases: dict) -> dict:
    """Each phase's final rate line: samples/s, the VAE's own samples/s and the first as a share of the second (%);
    each dtype's latents against fp32's (compare_caches.py)."""
    out = {f"cache_{d}": {"samples_per_s": log_value(ctx, CACHE_SPEED, f"cache_{d}", RATE),
                          "vae_samples_per_s": log_value(ctx, CACHE_SPEED, f"cache_{d}", VAE_RATE),
                          "share_pct": log_value(ctx, CACHE_SPEED, f"cache_{d}", SHARE)} for d in VAE_DTYPES}
    for d in VAE_DTYPES[1:]:
        for k in ("rel_err", "worst_clip", "not_finite"):
            out[f"cache_{d}"][k] = log_value(ctx, CACHE_SPEED, "compare", rf"compare_caches: {d} .*{k} ([\d.e+-]+)")
    return out


CASES[CACHE_SPEED] = Case(
    name=CACHE_SPEED, gpus=1, model="ti2v5b",
    about=f"python -m wanexp.cli.cache on the real-size TI2V-5B (VAE and UMT5-XXL, random weights), {CLIPS} generated "
          "clips at 704x1280x17, 4 loader workers, with model.vae_dtype=fp32 (TF32 convolutions), bf16 and fp16: the "
          "cache's samples/s against its VAE's own (decode, resize, writes overlapped with the VAE); bf16's and "
          "fp16's latents against fp32's",
    phases=(BUILD, *(cache_speed(d) for d in VAE_DTYPES),
            Phase("compare", lambda ctx: [ctx.python, "tests/gpu/compare_caches.py",
                                          str(cache_speed_dir(ctx, "fp32") / "synthetic"),
                                          *(f"{d}={cache_speed_dir(ctx, d) / 'synthetic'}" for d in VAE_DTYPES[1:])],
                  minutes=1)),
    checks=(*(Check(f"phases.cache_{d}.rc", "==", 0, f"cache_{d}", "exits 0") for d in VAE_DTYPES),
            *(Check(f"metrics.cache_{d}.share_pct", ">=", 90, f"cache_{d}",
                    "the cache's samples/s within 10 % of the VAE encode alone") for d in VAE_DTYPES),
            Check("metrics.cache_bf16.rel_err", "<=", 0.03, "compare", "bf16 latents near fp32's (1.4e-2 measured "
                  "2026-11-26)"),
            Check("metrics.cache_fp16.not_finite", "==", 0, "compare", "no fp16 overflow in the latents"),
            Check("metrics.cache_bf16.vae_samples_per_s", "present", None, "cache_bf16", "bf16 VAE rate (0.27 s/clip "
                  "measured alone, 2026-11-26)")),
    collect=cache_speed_metrics,
    record=(*(f"cache_{d}.{k}" for d in VAE_DTYPES for k in ("samples_per_s", "vae_samples_per_s", "share_pct")),
            *(f"cache_{d}.{k}" for d in VAE_DTYPES[1:] for k in ("rel_err", "not_finite"))),
)


# ---- generation on several GPUs: wanexp-sample under torchrun (docs/distillation.md, "Sampling") ---------------------
# The real-size TI2V-5B with its real UMT5-XXL and VAE (BUILD), one 480x832x81 prompt, CFG 5, 10 steps, two seeds (the
# first warms up); each process capped at CAP_GIB. Per-step time is the second sample's steps alone (``denoise_s`` of
# wanexp-sample's metrics.json: its first transformer call's start to its last's end), so the rank-0 decode and the
# prompt encoding are left out of the speed-ups.
GEN_SHAPE = ("--height", "480", "--width", "832", "--frames", "81", "--steps", "10", "--guidance", "5",
             "--seed", "0", "--seed", "1", "--prompt", "a red ball rolls down a wooden ramp")
GEN_VISIBLE = {1: "0", 2: "0,1", 4: "0,1,2,3"}


def generate(name: str, case: str, procs: int, *extra: str, env: dict | None = None, minutes: float = 3,
             model: Callable[[Ctx], Path] = None, shape: Callable[[Ctx], list[str]] | None = None,
             cap: int | None = CAP_GIB) -> Phase:
    """``wanexp.cli.sample`` on ``procs`` GPUs (torchrun, each process capped at ``cap`` GiB; None: uncapped), into
    ``<results>/<name>``: the model folder ``model(ctx)`` (default: the TI2V-5B build) at ``shape(ctx)`` (default:
    GEN_SHAPE)."""
    def argv(ctx: Ctx) -> list[str]:
        head = [ctx.python] if procs == 1 else [ctx.python, "-m", "torch.distributed.run", f"--nproc_per_node={procs}"]
        capped = ["tests/gpu/capped.py", str(cap), "wanexp.cli.sample"] if cap else ["-m", "wanexp.cli.sample"]
        folder = (model or model_dir)(ctx)
        return [*head, *capped, "--model-path", str(folder), *(shape(ctx) if shape else GEN_SHAPE), *extra,
                "--out", str(ctx.results(case) / name)]
    from wanexp.cli.sample import ALLOCATOR  # what the command sets itself, too late under capped.py

    return Phase(name, argv, minutes=minutes,
                 env={"CUDA_VISIBLE_DEVICES": GEN_VISIBLE[procs], **ALLOCATOR, **(env or {})},
                 fresh=lambda ctx: [ctx.results(case) / name])


def generation_metrics(case: str, *names: str) -> Callable[[Ctx, dict], dict]:
    """Each phase's metrics.json read back: the last (warm) sample's seconds per step, the first sample's when there
    were several (``first_s_per_step``), the peak per rank and their spread ((max - min) / max), the grid; and each
    phase's speed-up over the one-GPU phase ``gen_1`` (warm against warm)."""
    def collect(ctx: Ctx, phases: dict) -> dict:
        out = {}
        for n in names:
            path = ctx.results(case) / n / "metrics.json"
            if not path.is_file():
                continue
            m = json.loads(path.read_text())
            warm = m["timing"][-1]
            peaks = [p for p in m["processes"]["peak_gib"] if p is not None]
            first = m["timing"][0] if len(m["timing"]) > 1 else None
            out[n] = {"s_per_step": warm["denoise_s"] / warm["steps"], "peak_gib": max(peaks) if peaks else None,
                      "first_s_per_step": first["denoise_s"] / first["steps"] if first else None,
                      "peak_spread": (max(peaks) - min(peaks)) / max(peaks) if peaks else None,
                      "world": m["processes"]["world"], "sp": m["processes"]["sp"], "cfg": m["processes"]["cfg"]}
        for n, v in out.items():  # a compiled phase against the compiled one-GPU phase, if there is one
            base = "gen_1_compiled" if n.endswith("_compiled") and "gen_1_compiled" in out else "gen_1"
            one = out.get(base, {}).get("s_per_step")
            v["speedup"] = one / v["s_per_step"] if one and v["s_per_step"] else None
        return out
    return collect


def generation_record(*names: str) -> tuple[str, ...]:
    """The metrics of :func:`generation_metrics` that a generation case's benchmark row keeps, for each phase."""
    return tuple(f"{p}.{k}" for p in names
                 for k in ("s_per_step", "first_s_per_step", "speedup", "peak_gib", "peak_spread"))


GEN2 = "generate_5b_2gpu"
GEN2_PHASES = ("gen_1", "gen_cfg2", "gen_sp2", "gen_1_compiled", "gen_sp2_compiled", "gen_cfg2_nop2p")
CASES[GEN2] = Case(
    name=GEN2, gpus=2, model="ti2v5b",
    about="wanexp-sample of the real-size TI2V-5B (real UMT5-XXL and VAE, random weights) at 480x832x81, 10 steps, "
          f"CFG 5, each process capped at {CAP_GIB} GiB: one GPU, then 2 GPUs with the default grid (CFG parallel), "
          "sequence parallel (--no-cfg-parallel) eager, and compiled against one GPU compiled, and the default with "
          "NCCL_P2P_DISABLE=1 (PCIe-like cards)",
    phases=(BUILD, generate("gen_1", GEN2, 1), generate("gen_cfg2", GEN2, 2),
            generate("gen_sp2", GEN2, 2, "--no-cfg-parallel"),
            generate("gen_1_compiled", GEN2, 1, "--compile"),
            generate("gen_sp2_compiled", GEN2, 2, "--no-cfg-parallel", "--compile"),
            generate("gen_cfg2_nop2p", GEN2, 2, env={"NCCL_P2P_DISABLE": "1"})),
    checks=(*(Check(f"phases.{p}.rc", "==", 0, p, "exits 0 under the cap") for p in GEN2_PHASES),
            Check("metrics.gen_cfg2.speedup", ">=", 1.8, "gen_cfg2", "2 GPUs' steps/s over one's, default grid"),
            Check("metrics.gen_cfg2.peak_spread", "<=", 0.10, "gen_cfg2", "peak memory within 10 % across the GPUs"),
            Check("metrics.gen_sp2.peak_spread", "<=", 0.10, "gen_sp2", "peak memory within 10 % across the GPUs"),
            Check("metrics.gen_sp2.speedup", "present", None, "gen_sp2", "sequence parallel alone"),
            Check("metrics.gen_sp2_compiled.speedup", "present", None, "gen_sp2_compiled",
                  "compiled blocks, against one GPU's compiled blocks"),
            Check("metrics.gen_cfg2_nop2p.speedup", "present", None, "gen_cfg2_nop2p", "without peer-to-peer")),
    collect=generation_metrics(GEN2, *GEN2_PHASES),
    record=generation_record(*GEN2_PHASES),
)

GEN4 = "generate_5b_4gpu"
CASES[GEN4] = Case(
    name=GEN4, gpus=4, model="ti2v5b",
    about=f"as {GEN2} on 4 GPUs: one GPU, --sp 4 (the 5B's 24 heads split 4 ways), and the default CFG 2 x sp 2",
    phases=(BUILD, generate("gen_1", GEN4, 1), generate("gen_sp4", GEN4, 4, "--no-cfg-parallel"),
            generate("gen_cfg2_sp2", GEN4, 4)),
    checks=(*(Check(f"phases.{p}.rc", "==", 0, p, "exits 0 under the cap") for p in
              ("gen_1", "gen_sp4", "gen_cfg2_sp2")),
            Check("metrics.gen_sp4.speedup", "present", None, "gen_sp4", "sequence parallel alone"),
            Check("metrics.gen_cfg2_sp2.speedup", ">=", 3.4, "gen_cfg2_sp2",
                  "4 GPUs' steps/s over one's, default grid"),
            Check("metrics.gen_sp4.peak_spread", "<=", 0.10, "gen_sp4", "peak memory within 10 % across the GPUs")),
    collect=generation_metrics(GEN4, "gen_1", "gen_sp4", "gen_cfg2_sp2"),
    record=generation_record("gen_1", "gen_sp4", "gen_cfg2_sp2"),
)

GEN1 = "generate_5b_28g"
CASES[GEN1] = Case(
    name=GEN1, gpus=1, model="ti2v5b",
    about="wanexp-sample of the real-size TI2V-5B (real UMT5-XXL and VAE, random weights) on one GPU capped at "
          f"{CAP_GIB} GiB: 480x832x81 and the user's 704x1280x121, 10 steps, CFG 5 (the text encoder runs and is freed "
          "before the DiT loads)",
    phases=(BUILD, generate("gen_1", GEN1, 1),
            generate("gen_704", GEN1, 1, "--height", "704", "--width", "1280", "--frames", "121", minutes=5)),
    checks=(Check("phases.gen_1.rc", "==", 0, "gen_1", "exits 0 under the cap"),
            Check("phases.gen_704.rc", "==", 0, "gen_704", "exits 0 under the cap"),
            Check("metrics.gen_704.peak_gib", "<=", CAP_GIB, "gen_704", "peak under the cap")),
    collect=generation_metrics(GEN1, "gen_1", "gen_704"),
    record=tuple(f"{p}.{k}" for p in ("gen_1", "gen_704") for k in ("s_per_step", "peak_gib")),
)


# ---- Wan2.2-S2V-14B at real size: LoRA training on one 28 GiB GPU, generation on two (docs/s2v.md) -------------------
# The released DiT's shapes with random weights, the full wav2vec2-large, UMT5-XXL and the Wan2.1 VAE (real_sizes.yaml
# s2v14b), as the release folder; two generated 81-frame 480x832 clips with audio tracks.
def s2v_dir(ctx: Ctx) -> Path:
    return ctx.work / "s2v14b"


def s2v_data(ctx: Ctx) -> list[str]:
    return ["model=s2v14b", f"model.path={s2v_dir(ctx)}", "data=synthetic", "data.generate=null",
            f"data.metadata={ctx.work / 's2v_data' / 'metadata.csv'}", "data.height=480", "data.width=832",
            "data.num_frames=81", "data.batch_size=1", "data.num_workers=2",
            f"paths.cache_dir={ctx.work / 'cache_s2v'}",
            "trainer.precision=bf16-mixed"]


def s2v_shape(ctx: Ctx) -> list[str]:
    """One clip of the reference's 80 frames (77 kept after the 3 the first clip drops), CFG 4.5, 4 steps."""
    return ["--height", "480", "--width", "832", "--frames", "77", "--steps", "4", "--guidance", "4.5", "--seed", "0",
            "--prompt", "a person talking to the camera", "--audio", str(ctx.work / "s2v_data" / "speech.wav")]


S2V = "s2v_14b"
S2V_GEN = ("gen_1", "gen_sp2", "gen_cfg2")
CASES[S2V] = Case(
    name=S2V, gpus=2, model="s2v14b",
    about="Wan2.2-S2V-14B at real size (random weights; real wav2vec2-large, UMT5-XXL, Wan2.1 VAE): LoRA r32 at "
          f"480x832x81 on one GPU capped at {CAP_GIB} GiB (the plan sizes block swap to model.memory_budget_gib, the "
          "checkpointed blocks' inputs in host memory), 4 steps from the cache; one 480x832 clip (80 frames, 4 steps, "
          f"CFG 4.5) on one uncapped GPU, then on 2 GPUs each capped at {CAP_GIB} GiB with the weights sharded: "
          "Ulysses sp=2, and CFG parallel",
    phases=(Phase("build_s2v", lambda ctx: [ctx.python, "tests/gpu/build_random_model.py", "--model", "s2v14b",
                                            "--entry", "s2v14b", "--path", str(s2v_dir(ctx))], minutes=5),
            Phase("clips_s2v", lambda ctx: [ctx.python, "tests/gpu/s2v_clips.py", str(ctx.work / "s2v_data")],
                  minutes=0.5),
            Phase("cache_s2v", lambda ctx: [ctx.python, "tests/gpu/capped.py", str(CAP_GIB), "wanexp.cli.cache",
                                            *s2v_data(ctx), f"paths.output_dir={ctx.run_dir('cache_s2v')}"],
                  minutes=2, env={"CUDA_VISIBLE_DEVICES": "0"}),
            Phase("train_s2v", lambda ctx: [ctx.python, "tests/gpu/capped.py", str(CAP_GIB), "train.py",
                                            *s2v_data(ctx), "adapter.rank=32", "trainer.max_steps=4",
                                            "model.gradient_checkpointing=true", "model.offload_activations=true",
                                            f"model.memory_budget_gib={CAP_GIB}", "model.blocks_to_swap=auto",
                                            "callbacks.progress=null", "callbacks.validation.every_n_steps=0",
                                            "trainer.log_every_n_steps=1", f"paths.output_dir={ctx.run_dir('s2v')}",
                                            "run_name=s2v"],
                  minutes=3, fresh=lambda ctx: [ctx.run_dir("s2v")],
                  # train.py's own allocator setting (parallel.env), which comes too late under capped.py: the cap
                  # initialises CUDA before train.py runs
                  env={"CUDA_VISIBLE_DEVICES": "0", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
            generate("gen_1", S2V, 1, model=s2v_dir, shape=s2v_shape, cap=None),
            generate("gen_sp2", S2V, 2, "--sp", "2", "--no-cfg-parallel", "--shard", model=s2v_dir, shape=s2v_shape),
            generate("gen_cfg2", S2V, 2, "--shard", model=s2v_dir, shape=s2v_shape)),
    checks=(*finished("train", 4, "train_s2v"),
            Check("metrics.train.peak_mem_gib", "<=", CAP_GIB, "train_s2v", "the LoRA step under the cap"),
            *(Check(f"phases.{p}.rc", "==", 0, p, "exits 0") for p in S2V_GEN),
            Check("metrics.gen_sp2.peak_spread", "<=", 0.10, "gen_sp2", "peak memory within 10 % across the GPUs"),
            Check("metrics.gen_sp2.peak_gib", "<=", CAP_GIB, "gen_sp2", "each GPU under the cap"),
            Check("metrics.gen_sp2.speedup", "present", None, "gen_sp2", "against one uncapped GPU"),
            Check("metrics.gen_cfg2.speedup", "present", None, "gen_cfg2", "against one uncapped GPU")),
    collect=both(lambda ctx, phases: {"train": run_metrics(ctx.run_dir("s2v"))},
                 generation_metrics(S2V, *S2V_GEN)),
    record=("train.median_step_s", "train.peak_mem_gib",
            *(f"{p}.{k}" for p in S2V_GEN for k in ("s_per_step", "speedup", "peak_gib", "peak_spread"))),
)


# ---- I2V-A14B generation on two 28 GiB GPUs: the experts sharded, the one not in use in host memory -----------------
def a14b_gen_dir(ctx: Ctx) -> Path:
    return ctx.work / "i2v14b_gen"


def a14b_shape(ctx: Ctx) -> list[str]:
    """480x832x81 from a generated image, 6 steps (high-noise then low-noise expert), CFG 3.5; two seeds: the second
    sample's steps are the warm ones the speed-ups compare (the first pays each process's first calls: its
    communicators' first collectives, the kernels' first launches, the allocator's growth)."""
    return ["--height", "480", "--width", "832", "--frames", "81", "--steps", "6", "--guidance", "3.5", "--seed", "0",
            "--seed", "1", "--prompt", "a red ball rolls down a wooden ramp",
            "--image", str(ctx.work / "a14b_image.png")]


A14B_GEN = "generate_a14b_2gpu"
A14B_PHASES = ("gen_1", "gen_sp2_offload", "gen_cfg2_offload", "gen_cfg2_offload_nop2p")
CASES[A14B_GEN] = Case(
    name=A14B_GEN, gpus=2, model="a14b",
    about="I2V-A14B (both real-size experts, the real Wan2.1 VAE, a light UMT5: it is freed before the DiT loads) "
          "at 480x832x81, 6 steps, CFG 3.5: one uncapped GPU with both experts resident, then 2 GPUs each capped at "
          f"{CAP_GIB} GiB with the experts sharded and the one not in use in host memory (--offload-experts): "
          "sequence parallel, and CFG parallel with and without peer-to-peer (NCCL_P2P_DISABLE=1)",
    phases=(Phase("build_a14b_gen", lambda ctx: [ctx.python, "tests/gpu/build_random_model.py", "--model", "i2v14b",
                                                 "--entry", "i2v14b_gen", "--path", str(a14b_gen_dir(ctx))],
                  minutes=7),
            Phase("image", lambda ctx: [ctx.python, "-c", "import numpy as n, PIL.Image as I, sys; I.fromarray("
                                        "n.random.default_rng(0).integers(0, 255, (480, 832, 3), dtype=n.uint8))"
                                        ".save(sys.argv[1])", str(ctx.work / "a14b_image.png")], minutes=0.2),
            generate("gen_1", A14B_GEN, 1, model=a14b_gen_dir, shape=a14b_shape, cap=None, minutes=3),
            generate("gen_sp2_offload", A14B_GEN, 2, "--no-cfg-parallel", "--shard", "--offload-experts",
                     model=a14b_gen_dir, shape=a14b_shape, minutes=3),
            generate("gen_cfg2_offload", A14B_GEN, 2, "--shard", "--offload-experts", model=a14b_gen_dir,
                     shape=a14b_shape, minutes=3),
            # as on PCIe cards without peer-to-peer (the reference user's V100S pair)
            generate("gen_cfg2_offload_nop2p", A14B_GEN, 2, "--shard", "--offload-experts", model=a14b_gen_dir,
                     shape=a14b_shape, env={"NCCL_P2P_DISABLE": "1"}, minutes=3)),
    checks=(*(Check(f"phases.{p}.rc", "==", 0, p, "exits 0") for p in A14B_PHASES),
            *(Check(f"metrics.{p}.peak_gib", "<=", CAP_GIB, p, "each GPU under the cap")
              for p in A14B_PHASES[1:]),
            *(Check(f"metrics.{p}.peak_spread", "<=", 0.10, p, "peak memory within 10 % across the GPUs")
              for p in A14B_PHASES[1:]),
            Check("metrics.gen_cfg2_offload.speedup", ">=", 1.8, "gen_cfg2_offload",
                  "2 GPUs' steps/s over one's, the default grid"),
            Check("metrics.gen_sp2_offload.speedup", "present", None, "gen_sp2_offload",
                  "sequence parallel alone: recorded (the Ulysses all-to-alls on top of the sharded weights)"),
            Check("metrics.gen_cfg2_offload_nop2p.speedup", "present", None, "gen_cfg2_offload_nop2p",
                  "without peer-to-peer: recorded")),
    collect=generation_metrics(A14B_GEN, *A14B_PHASES),
    record=generation_record(*A14B_PHASES),
)


A14B_GEN4 = "generate_a14b_4gpu"
A14B_PHASES4 = ("gen_1", "gen_cfg2_sp2")
CASES[A14B_GEN4] = Case(
    name=A14B_GEN4, gpus=4, model="a14b",
    about=f"as {A14B_GEN} on 4 GPUs: one uncapped GPU with both experts resident, then the default grid on 4 GPUs "
          f"(CFG 2 x sp 2) each capped at {CAP_GIB} GiB with both experts sharded over the 4 (--shard)",
    phases=(CASES[A14B_GEN].phases[0], CASES[A14B_GEN].phases[1],
            generate("gen_1", A14B_GEN4, 1, model=a14b_gen_dir, shape=a14b_shape, cap=None, minutes=4),
            generate("gen_cfg2_sp2", A14B_GEN4, 4, "--shard", model=a14b_gen_dir, shape=a14b_shape, minutes=3)),
    checks=(*(Check(f"phases.{p}.rc", "==", 0, p, "exits 0") for p in A14B_PHASES4),
            Check("metrics.gen_cfg2_sp2.peak_gib", "<=", CAP_GIB, "gen_cfg2_sp2", "each GPU under the cap"),
            Check("metrics.gen_cfg2_sp2.peak_spread", "<=", 0.10, "gen_cfg2_sp2",
                  "peak memory within 10 % across the GPUs"),
            Check("metrics.gen_cfg2_sp2.speedup", ">=", 3.4, "gen_cfg2_sp2",
                  "4 GPUs' steps/s over one's, the default grid")),
    collect=generation_metrics(A14B_GEN4, *A14B_PHASES4),
    record=generation_record(*A14B_PHASES4),
)

# ---- the optimizers by name and the adapter's EMA on the real-size 5B step (docs/configuration.md#optimizers) -----
OPTIM = "optimizers_5b"
OPTIM_STEPS = 10  # the median step over steps 4-10 (the first three: compilation, first loads)
OPTIM_RUNS = {"adamw": (), "adamw8bit": ("optim=adamw8bit",), "prodigy": ("optim=prodigy",), "came": ("optim=came",),
              "adafactor": ("optim=adafactor",), "adamw_ema": ("callbacks.ema.decay=0.999",)}


def optim_metrics(ctx: Ctx, phases: dict) -> dict:
    """Each run's metrics (run_metrics) and its median step over AdamW's (``step_vs_adamw``)."""
    m = runs(**{k: f"5b_optim_{k}" for k in OPTIM_RUNS})(ctx, phases)
    base = m.get("adamw", {}).get("median_step_s")
    for v in m.values():
        v["step_vs_adamw"] = ratio(v.get("median_step_s"), base)
    return m


CASES[OPTIM] = Case(
    name=OPTIM, gpus=1, model="ti2v5b",
    about=f"python train.py (the user's defaults: DDP, bf16-mixed, compiled, checkpointing) on the real-size TI2V-5B "
          f"(light encoders) at 704x1280x17 from the cache, {OPTIM_STEPS} steps with each optimizer by name (AdamW, "
          "optim=adamw8bit, prodigy, came, adafactor) and with callbacks.ema.decay=0.999: each finishes with finite "
          "losses and its LoRA files (the EMA's beside), the median step and peak per optimizer recorded; needs the "
          "bitsandbytes, prodigyopt and came-pytorch wheels (bash tests/gpu/wheels.sh optim: carried in a call after the "
          "one that carried the base wheels, on the same warm machine)",
    phases=(BUILD_LIGHT, CACHE_LIGHT,
            *(train(f"5b_optim_{k}", 1, OPTIM_STEPS, light_data, "parallel=ddp", "trainer.log_every_n_steps=1",
                    "callbacks.checkpoint.every_n_train_steps=1000", *extra, phase=k, minutes=3)
              for k, extra in OPTIM_RUNS.items())),
    checks=(*(c for k in OPTIM_RUNS for c in finished(k, OPTIM_STEPS)),
            *(Check(f"metrics.{k}.{m}", "present", None, k, f"{k}: {what} recorded")
              for k in OPTIM_RUNS for m, what in (("median_step_s", "the median step"), ("peak_mem_gib", "the peak"))),
            Check("metrics.adamw_ema.lora_final_files", "==", 4, "adamw_ema",
                  "the raw and the EMA LoRA files, ComfyUI and diffusers each")),
    collect=optim_metrics,
    record=tuple(f"{k}.{m}" for k in OPTIM_RUNS for m in ("median_step_s", "step_vs_adamw", "peak_mem_gib")),
)


# ---- ComfyUI's single files as the weights: the real-size TI2V-5B written as Comfy-Org's files, loaded, trained ----
SINGLE = "single_files_5b"
SINGLE_STEPS = 6
SINGLE_PARTS = (*(f"dit_{f}" for f in DIT_FILES), "vae", "umt5_fp8_scaled")  # compare_single_files.py's components
MEMORY_CAP = ("+callbacks.memory_cap._target_=wanexp.callbacks.memory.MemoryCap",
              f"+callbacks.memory_cap.gib={CAP_GIB}")


def single_dir(ctx: Ctx) -> Path:
    return ctx.work / "single_files"  # write_single_files.py's files, written from model_dir(ctx)


def single_data(ctx: Ctx) -> list[str]:
    """Only single files (the fp16 DiT as model.path, the VAE, the fp8_scaled UMT5, a tokenizer folder beside them)
    on 4 generated 480x832x17 clips, batch 1."""
    files = single_dir(ctx)
    return ["model=ti2v5b", f"model.path={files / DIT_FILES['fp16']}", f"model.vae_path={files / VAE_FILE}",
            f"model.text_encoder_path={files / UMT5_FILE}", f"model.tokenizer_path={files / TOKENIZER}",
            "data=synthetic", f"paths.data_dir={ctx.work / 'data_single'}", "data.height=480", "data.width=832",
            "data.num_frames=17", "data.batch_size=1", "data.num_workers=2", "data.generate.height=480",
            "data.generate.width=832", "data.generate.num_frames=17", "data.generate.num_videos=4",
            "data.generate.num_images=0", f"paths.cache_dir={ctx.work / 'cache_single'}"]


def single_metrics(ctx: Ctx, phases: dict) -> dict:
    """What the writer and the comparison reported (their JSONs), and the run from the files (run_metrics, the first
    three steps left out of the median: compilation, first loads)."""
    return {"written": _json(ctx.results(SINGLE) / "written.json"),
            "compare": _json(ctx.results(SINGLE) / "compare.json"),
            "train": run_metrics(ctx.run_dir(SINGLE), skip=3)}


CASES[SINGLE] = Case(
    name=SINGLE, gpus=1, model="ti2v5b",
    about="ComfyUI's single files as the weights: the real-size TI2V-5B (random weights, real-size UMT5-XXL and VAE) "
          f"written as Comfy-Org's files ({', '.join(DIT_FILES.values())}, {VAE_FILE}, {UMT5_FILE}; tensor by tensor, "
          "quantized on the GPU), each loaded through model.path / model.*_path and compared with the same weights "
          "loaded from the diffusers folder (equal to them as the file stores them, cast as the run casts; the fp8 "
          f"error measured); then the cache and {SINGLE_STEPS} steps of python train.py from the single files alone "
          f"(480x832x17, validation off) under the {CAP_GIB} GiB cap. Needs ~52 GB of disk for the folder and the "
          "files (the write phase removes the other cases' model builds first)",
    phases=(BUILD,
            Phase("write", lambda ctx: [ctx.python, "tests/gpu/write_single_files.py", str(model_dir(ctx)),
                                        str(single_dir(ctx)), "--json", str(ctx.results(SINGLE) / "written.json")],
                  minutes=3, env={"CUDA_VISIBLE_DEVICES": "0"},
                  fresh=lambda ctx: [single_dir(ctx), dit_dir(ctx), light_dir(ctx), a14b_dir(ctx), _a14b_dir(ctx),
                                     a14b_gen_dir(ctx), s2v_dir(ctx)]),
            Phase("compare", lambda ctx: [ctx.python, "tests/gpu/compare_single_files.py", str(model_dir(ctx)),
                                          str(single_dir(ctx)), "--json", str(ctx.results(SINGLE) / "compare.json")],
                  minutes=4, env={"CUDA_VISIBLE_DEVICES": "0"},
                  fresh=lambda ctx: [ctx.results(SINGLE) / "compare.json"]),
            Phase("cache", lambda ctx: [ctx.python, "tests/gpu/capped.py", str(CAP_GIB), "wanexp.cli.cache",
                                        *single_data(ctx), f"paths.output_dir={ctx.run_dir('cache_single')}"],
                  minutes=1.5, env={"CUDA_VISIBLE_DEVICES": "0"}, fresh=lambda ctx: [ctx.work / "cache_single"]),
            train(SINGLE, 1, SINGLE_STEPS, single_data, *MEMORY_CAP, "trainer.log_every_n_steps=1",
                  "callbacks.checkpoint.every_n_train_steps=1000", phase="train", minutes=3)),
    checks=(Check("phases.write.rc", "==", 0, "write", "the files are written"),
            *(Check(f"metrics.compare.{p}.exact", "==", True, "compare", f"{p}: the file's load is the folder's "
                    "weights as the file stores them (fp16, float8 over its scale), cast as the run casts")
              for p in SINGLE_PARTS),
            *(Check(f"metrics.compare.{p}.dtypes_match", "==", True, "compare", f"{p}: the folder load's dtypes "
                    "(its fp32 modules in fp32)") for p in SINGLE_PARTS),
            *(Check(f"metrics.compare.dit_{f}.config_match", "==", True, "compare", f"dit_{f}: the config read off "
                    "the file's shapes is the folder's") for f in DIT_FILES),
            Check("metrics.compare.dit_fp8_scaled.rel_err", "<=", 0.04, "compare",
                  "scaled fp8's error (e4m3's 3-bit mantissa: 2.6 % on uniform random weights)"),
            Check("metrics.compare.dit_fp8_e4m3fn.rel_err", "present", None, "compare",
                  "unscaled fp8's error, recorded (small weights fall into e4m3's subnormals)"),
            Check("phases.cache.rc", "==", 0, "cache", f"the cache from the VAE and UMT5 files under {CAP_GIB} GiB"),
            *finished("train", SINGLE_STEPS),
            Check("metrics.train.peak_mem_gib", "<=", CAP_GIB, "train", f"within the {CAP_GIB} GiB cap")),
    collect=single_metrics,
    record=(*(f"compare.{p}.{k}" for p in SINGLE_PARTS for k in ("max_abs_diff", "rel_err", "load_s")),
            *(f"written.{p}.{k}" for p in ("dit_fp16", "umt5_fp8_scaled") for k in ("gib", "seconds")),
            "train.median_step_s", "train.peak_mem_gib"),
)


# ---- first-last-frame to video on the real-size I2V-A14B experts under a 28 GiB cap (docs/flf2v.md) -------------------
FLF = "flf2v_a14b"
FLF_STEPS = 4
FLF_SWAPPED = r"model\.blocks_to_swap=auto: (\d+) of \d+ blocks swapped"


def flf2v_data(ctx: Ctx) -> list[str]:
    """a14b_data's clips as model=flf2v14b: the high-noise expert at 480x832x81 from the cache, each clip's first and
    own last frame as its condition (cache entries of their own: the condition differs from I2V's)."""
    return [("model=flf2v14b" if a == "model=i2v14b" else a) for a in a14b_data(ctx)]


CASES[FLF] = Case(
    name=FLF, gpus=1, model="a14b",
    about="first-last-frame to video (model=flf2v14b) on the real-size I2V-A14B experts (random weights, light "
          f"encoders: real_sizes.yaml i2v14b_light): LoRA r32 on the high-noise expert at 480x832x81 under MemoryCap "
          f"{CAP_GIB} GiB, the memory settings the planner picks (model.memory_budget_gib={CAP_GIB}, "
          f"model.blocks_to_swap=auto, the checkpointed blocks' inputs in host memory), {FLF_STEPS} steps from the "
          "cache",
    phases=(BUILD_A14B,
            Phase("cache_flf2v", lambda ctx: [ctx.python, "-m", "wanexp.cli.cache", *flf2v_data(ctx),
                                              f"paths.output_dir={ctx.run_dir('cache_flf2v')}"], minutes=4),
            train(FLF, 1, FLF_STEPS, flf2v_data, *MEMORY_CAP, "adapter.rank=32", "model.gradient_checkpointing=true",
                  "model.offload_activations=true", f"model.memory_budget_gib={CAP_GIB}", "model.blocks_to_swap=auto",
                  "callbacks.checkpoint.every_n_train_steps=1000", phase="train", minutes=7)),
    checks=(Check("phases.cache_flf2v.rc", "==", 0, "cache_flf2v", "the first-last-frame latents cached"),
            *finished("train", FLF_STEPS),
            Check("metrics.train.peak_mem_gib", "<=", CAP_GIB, "train", f"within the {CAP_GIB} GiB cap"),
            Check("metrics.blocks_swapped", "present", None, "train", "the planner's block swap, recorded")),
    collect=lambda ctx, phases: {"train": run_metrics(ctx.run_dir(FLF)),
                                 "blocks_swapped": log_value(ctx, FLF, "train", FLF_SWAPPED)},
    record=("train.median_step_s", "train.peak_mem_gib", "blocks_swapped"),
)


# ---- two GPUs against one over whole runs of a small dataset, epoch boundaries included (docs/performance.md) -------
SCALING = "scaling_5b_2gpu"
SCALING_CLIPS, SCALING_EPOCHS = 24, 5  # an epoch: 24 steps on one GPU, 12 on two (batch 1)
SCALING_SKIP = 3  # the steps before the timed stretch: compilation, the first loads
SCALING_RUNS = {"gpu1": (1, {}), "gpu2": (2, {}), "gpu2_nop2p": (2, {"NCCL_P2P_DISABLE": "1"})}


def scaling_data(ctx: Ctx) -> list[str]:
    """The real-size 5B (light encoders) from the cache of 24 generated 704x1280x17 clips, batch 1, 4 loader workers."""
    return ["model=ti2v5b", f"model.path={light_dir(ctx)}", "data=synthetic", f"paths.data_dir={ctx.work / 'data24'}",
            "data.height=704", "data.width=1280", "data.num_frames=17", "data.batch_size=1", "data.num_workers=4",
            "data.generate.height=704", "data.generate.width=1280", "data.generate.num_frames=17",
            f"data.generate.num_videos={SCALING_CLIPS}", "data.generate.num_images=0",
            f"paths.cache_dir={ctx.work / 'cache24'}", "trainer.precision=bf16-mixed"]


def whole_run_metrics(run: Path, batch: int = 1, skip: int = SCALING_SKIP) -> dict:
    """A run logged at every step (``trainer.log_every_n_steps=1``: status.jsonl holds each step's end on rank 0, taken
    after the step's loss was read from the GPU, so once the GPU finished the step): ``samples_per_s`` from the end of
    step ``skip`` to the end of the last step, epoch boundaries included; the ``median_step_s``; and each epoch
    boundary's cost, ``boundary_s``: the time of the step that opens an epoch (the end of one epoch, Lightning's
    epoch hooks and the next epoch's first batch all land in it) minus the median step."""
    status = _json(run / "status.json")
    history = run / "status.jsonl"
    lines = [json.loads(x) for x in history.read_text().splitlines() if x.strip()] if history.is_file() else []
    times = {int(x["step"]): float(x["time"]) for x in lines if "val" not in x}
    per_epoch, world = status.get("steps_per_epoch"), status.get("world_size")
    steps = [s for s in sorted(times) if s > skip + 1 and s - 1 in times]
    if not steps or not per_epoch or not world or skip not in times:
        return {"samples_per_s": None, "median_step_s": None, "boundary_s": [], "boundary_max_s": None}
    step_s = {s: times[s] - times[s - 1] for s in steps}
    median = statistics.median(step_s.values())
    boundary = [step_s[s] - median for s in steps if (s - 1) % per_epoch == 0]
    last = steps[-1]
    return {"samples_per_s": (last - skip) * batch * world / (times[last] - times[skip]), "median_step_s": median,
            "timed_steps": last - skip, "steps_per_epoch": per_epoch, "boundary_s": boundary,
            "boundary_max_s": max(boundary) if boundary else None,
            "boundary_mean_s": statistics.mean(boundary) if boundary else None}


def scaling_metrics(ctx: Ctx, phases: dict, runs: str = "scale") -> dict:
    """Per run: run_metrics (state, losses, replicas in sync, LoRA files) with the whole-run numbers over it; and the
    two-GPU runs' whole-run samples/s over the one-GPU run's (``<run>_scaling``). ``runs``: the run folders' prefix."""
    m = {key: {**run_metrics(ctx.run_dir(f"{runs}_{key}"), skip=SCALING_SKIP),
               **whole_run_metrics(ctx.run_dir(f"{runs}_{key}"))} for key in SCALING_RUNS}
    one = m["gpu1"].get("samples_per_s")
    for key in ("gpu2", "gpu2_nop2p"):
        two = m[key].get("samples_per_s")
        m[f"{key}_scaling"] = ratio(two, one)
    return m


def scaling_checks(after: str = "") -> tuple[Check, ...]:
    """Every run finished with its LoRA files, the two-GPU runs' replicas in sync, >= 1.95x one GPU's whole-run
    samples/s with and without peer-to-peer, and no epoch boundary over 0.2 s. ``after``: the phases' name prefix."""
    return (*(c for key, (gpus, _) in SCALING_RUNS.items()
              for c in finished(key, SCALING_EPOCHS * SCALING_CLIPS // gpus, after=after + key)),
            *(in_sync(key, after + key) for key in ("gpu2", "gpu2_nop2p")),
            Check("metrics.gpu2_scaling", ">=", 1.95, after + "gpu2",
                  "whole-run samples/s on 2 GPUs over 1, epoch boundaries included"),
            Check("metrics.gpu2_nop2p_scaling", ">=", 1.95, after + "gpu2_nop2p",
                  "the same without peer-to-peer (NCCL_P2P_DISABLE=1)"),
            *(Check(f"metrics.{key}.boundary_max_s", "<=", 0.2, after + key,
                    f"{key}: the costliest of its {SCALING_EPOCHS - 1} epoch boundaries, over the median step")
              for key in SCALING_RUNS))


CACHE24 = Phase("cache24", lambda ctx: [ctx.python, "-m", "wanexp.cli.cache", *scaling_data(ctx),
                                        f"paths.output_dir={ctx.run_dir('cache24')}"],
                minutes=2, env={"CUDA_VISIBLE_DEVICES": "0"})
SCALING_RECORD = (*(f"{key}.{k}" for key in SCALING_RUNS for k in ("samples_per_s", "median_step_s", "boundary_max_s")),
                  "gpu2_scaling", "gpu2_nop2p_scaling")


CASES[SCALING] = Case(
    name=SCALING, gpus=2, model="ti2v5b",
    about=f"whole runs of a small dataset, epoch boundaries included: the real-size TI2V-5B (light encoders) from the "
          f"cache of {SCALING_CLIPS} clips at 704x1280x17, batch 1, 4 loader workers, validation off, logging every "
          f"step, {SCALING_EPOCHS} epochs on one GPU, on two (DDP) and on two without peer-to-peer "
          "(NCCL_P2P_DISABLE=1: traffic through the host, as on PCIe cards); samples/s from the end of step "
          f"{SCALING_SKIP} to the last step, the median step and each epoch boundary's cost (the step opening an "
          "epoch minus the median)",
    phases=(BUILD_LIGHT,
            CACHE24,
            *(train(f"scale_{key}", gpus, SCALING_EPOCHS * SCALING_CLIPS // gpus, scaling_data, "parallel=ddp",
                    "trainer.log_every_n_steps=1", phase=key, minutes=3.5, env=env)
              for key, (gpus, env) in SCALING_RUNS.items())),
    checks=scaling_checks(),
    collect=scaling_metrics,
    record=SCALING_RECORD,
)

# The same whole runs with the fast step (docs/performance.md, CUDA graphs): the compiled blocks replayed as CUDA graphs
# under DDP (the LoRA gradients all-reduced by DDP's hooks outside the graphs) in a 22 GiB memory budget.
SCALING_FAST = "scaling_fast_5b_2gpu"
FAST_STEP = ("model.cuda_graphs=true", "model.memory_budget_gib=22")
FAST_VARIANT = _slug(f"wanexp [{' '.join(FAST_STEP)}]")  # its row in the bench's JSON

CASES[SCALING_FAST] = Case(
    name=SCALING_FAST, gpus=2, model="ti2v5b",
    about=f"{SCALING}'s whole runs (one GPU, two, two without peer-to-peer) with {' '.join(FAST_STEP)}: CUDA graphs "
          "under DDP",
    phases=(BUILD_LIGHT,
            CACHE24,
            *(train(f"fast_{key}", gpus, SCALING_EPOCHS * SCALING_CLIPS // gpus, scaling_data, "parallel=ddp",
                    "trainer.log_every_n_steps=1", *FAST_STEP, phase=f"fast_{key}", minutes=3.5, env=env)
              for key, (gpus, env) in SCALING_RUNS.items())),
    checks=scaling_checks(after="fast_"),
    collect=lambda ctx, phases: scaling_metrics(ctx, phases, runs="fast"),
    record=SCALING_RECORD,
)

# python train.py against the bench's step, re-measured with the default step and with the fast one, at the default
# logging (every 10 steps) and logging every step; and what the status file's GPU readings cost (tests/gpu/nvml_probe.py)
GAP_FAST = "gap_fast_5b"
TIMER_LOG1 = [x if not x.startswith("trainer.log_every_n_steps=") else "trainer.log_every_n_steps=1" for x in TIMER]
GAP_RUNS = {"gap_default": TIMER, "gap_fast": [*TIMER, *FAST_STEP], "gap_fast_log1": [*TIMER_LOG1, *FAST_STEP]}


def gap_fast_metrics(ctx: Ctx, phases: dict) -> dict:
    b = bench_metrics(bench_json(ctx, GAP_FAST, "bench"))
    m = {"bench": b, **{f"{p}_ms": log_value(ctx, GAP_FAST, p, TIMER_MS) for p in GAP_RUNS}}
    for p, path in (("gap_default", "wanexp"), ("gap_fast", FAST_VARIANT), ("gap_fast_log1", FAST_VARIANT)):
        m[f"{p}_over_bench"] = ratio(m[f"{p}_ms"], b.get(path, {}).get("median_s"), scale=1e-3)
    m["nvml_ms"] = {k: log_value(ctx, GAP_FAST, "nvml", rf"nvml: {k} ([\d.]+) ms")
                    for k in ("torch_reads_all", "wanexp_gpu")}
    return m


CASES[GAP_FAST] = Case(
    name=GAP_FAST, gpus=1, model="ti2v5b",
    about="python train.py (DDP on one GPU, every default callback, 4 workers) from the cache of 24 704x1280x17 clips "
          "on the real-size TI2V-5B (light encoders), steps 21-40 timed by tests.helpers.StepTimer (one epoch boundary "
          f"inside), with the default step and with {' '.join(FAST_STEP)} (logging every 10 steps, and every step), "
          "against the bench's step with the same settings in the same call; the status file's NVML reads timed",
    phases=(BUILD_LIGHT,
            CACHE24,
            Phase("nvml", lambda ctx: [ctx.python, "tests/gpu/nvml_probe.py"], minutes=1,
                  env={"CUDA_VISIBLE_DEVICES": "0"}),
            bench("bench", GAP_FAST, "--frames", "17", "--ckpt", "--paths", "wanexp", "--no-check", "--warmup", "3",
                  "--steps", "10", "--variants", " ".join(FAST_STEP), model=light_dir, minutes=3),
            *(train(p, 1, 41, scaling_data, "parallel=ddp", *extra, minutes=3)
              for p, extra in GAP_RUNS.items())),
    checks=(Check("metrics.gap_default_over_bench", "<=", 1.03, "gap_default",
                  "train.py's default step within 3 % of the bench's"),
            Check("metrics.gap_fast_over_bench", "<=", 1.03, "gap_fast",
                  "train.py with the fast step within 3 % of the bench's with the same settings"),
            Check("metrics.gap_fast_log1_ms", "present", None, "gap_fast_log1", "logging every step, timed")),
    collect=gap_fast_metrics,
    record=("gap_default_ms", "gap_fast_ms", "gap_fast_log1_ms", "bench.wanexp.median_s",
            "gap_default_over_bench", "gap_fast_over_bench", "gap_fast_log1_over_bench", "nvml_ms"),
)


# ---- Wan2.2-Animate-14B at real size: LoRA training on one 28 GiB GPU, generation through WanAnimatePipeline ---------
# The released DiT's shapes with random weights (17.3 B parameters, 32.2 GiB in bf16), the CLIP ViT-H/14 vision tower,
# UMT5-XXL and the Wan2.1 VAE (real_sizes.yaml animate14b) as the diffusers folder; two generated 77-frame 480x832
# clips with pose and face videos. The family's DiT runs diffusers' forward: no offloaded activations, so the
# reference's 77-frame segment needs ~35 GiB even with every block swapped (the planner's estimate: 1 + 20 latent
# frames, the face adapter's inputs kept); under the cap it trains 41-frame clips (1 + 11 latent frames, the most that
# fit 90 % of 28 GiB; 49 frames ran out of memory at 37 swapped blocks), and the 77-frame segment trains on one
# uncapped GPU.
def animate_dir(ctx: Ctx) -> Path:
    return ctx.work / "animate14b"


def animate_data(frames: int) -> Callable[[Ctx], list[str]]:
    def data(ctx: Ctx) -> list[str]:
        return ["model=animate14b", f"model.path={animate_dir(ctx)}", "data=synthetic", "data.generate=null",
                f"data.metadata={ctx.work / 'animate_data' / 'metadata.csv'}", "data.height=480", "data.width=832",
                f"data.num_frames={frames}", "data.batch_size=1", "data.num_workers=2",
                f"paths.cache_dir={ctx.work / 'cache_animate'}", "trainer.precision=bf16-mixed"]
    return data


def animate_shape(ctx: Ctx) -> list[str]:
    """One 77-frame segment at 480x832 with the capped run's LoRA, 4 steps, no CFG (the reference's default)."""
    data = ctx.work / "animate_data"
    return ["--run", str(ctx.run_dir("animate")), "--height", "480", "--width", "832", "--frames", "77", "--steps",
            "4", "--guidance", "1", "--seed", "0", "--prompt", "a person dancing", "--image", str(data / "ref.png"),
            "--pose-video", str(data / "pose0.mp4"), "--face-video", str(data / "face0.mp4")]


ANIMATE = "animate_14b"
CAPPED_FRAMES = 41
ANIMATE_PLAN = ("adapter.rank=32", "model.gradient_checkpointing=true", "model.blocks_to_swap=auto",
                "trainer.log_every_n_steps=1")
CASES[ANIMATE] = Case(
    name=ANIMATE, gpus=1, model="animate14b",
    about="Wan2.2-Animate-14B at real size (random weights; real CLIP ViT-H/14, UMT5-XXL, Wan2.1 VAE): LoRA r32 on "
          f"480x832x{CAPPED_FRAMES} clips with their pose and face videos on one GPU capped at {CAP_GIB} GiB (the plan "
          "sizes block swap to the capped GPU, every block and face adapter checkpointed), 4 steps from the cache; "
          "the reference's 77-frame segment, 4 steps on the uncapped GPU; one 77-frame 480x832 sample through "
          "WanAnimatePipeline with the capped run's LoRA",
    phases=(Phase("build_animate", lambda ctx: [ctx.python, "tests/gpu/build_random_model.py", "--model",
                                                "animate14b", "--entry", "animate14b", "--path", str(animate_dir(ctx))],
                  minutes=6, fresh=lambda ctx: [animate_dir(ctx), light_dir(ctx), dit_dir(ctx), a14b_dir(ctx),
                                                _a14b_dir(ctx), a14b_gen_dir(ctx), s2v_dir(ctx), vace_dir(ctx)]),
            # ~45 GB of disk: the other cases' builds go first (the one-GPU machine has 64 GiB)
            Phase("clips_animate", lambda ctx: [ctx.python, "tests/gpu/animate_clips.py",
                                                str(ctx.work / "animate_data")], minutes=0.5),
            *(Phase(f"cache_animate_{f}", lambda ctx, f=f: [ctx.python, "tests/gpu/capped.py", str(CAP_GIB),
                                                           "wanexp.cli.cache", *animate_data(f)(ctx),
                                                           f"paths.output_dir={ctx.run_dir(f'cache_animate_{f}')}"],
                    minutes=2, env={"CUDA_VISIBLE_DEVICES": "0"}) for f in (CAPPED_FRAMES, 77)),
            Phase("train_animate", lambda ctx: [ctx.python, "tests/gpu/capped.py", str(CAP_GIB), "train.py",
                                                *animate_data(CAPPED_FRAMES)(ctx), *ANIMATE_PLAN, "trainer.max_steps=4",
                                                "callbacks.progress=null", "callbacks.validation.every_n_steps=0",
                                                f"paths.output_dir={ctx.run_dir('animate')}", "run_name=animate"],
                  minutes=4, fresh=lambda ctx: [ctx.run_dir("animate")],
                  # train.py's own allocator setting (parallel.env), too late under capped.py (see s2v_14b)
                  env={"CUDA_VISIBLE_DEVICES": "0", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
            train("animate_77", 1, 4, animate_data(77), *ANIMATE_PLAN, phase="train_animate_77", minutes=4),
            generate("gen_1", ANIMATE, 1, model=animate_dir, shape=animate_shape, cap=None, minutes=4)),
    checks=(*finished("animate", 4, "train_animate"),
            Check("metrics.animate.peak_mem_gib", "<=", CAP_GIB, "train_animate", "the LoRA step under the cap"),
            *finished("animate_77", 4, "train_animate_77"),
            Check("metrics.animate_77.peak_mem_gib", "present", None, "train_animate_77",
                  "the 77-frame segment's peak, recorded"),
            Check("phases.gen_1.rc", "==", 0, "gen_1", "a sample with the LoRA through WanAnimatePipeline")),
    collect=both(lambda ctx, phases: {"animate": run_metrics(ctx.run_dir("animate")),
                                      "animate_77": run_metrics(ctx.run_dir("animate_77"))},
                 generation_metrics(ANIMATE, "gen_1")),
    record=("animate.median_step_s", "animate.peak_mem_gib", "animate_77.median_step_s", "animate_77.peak_mem_gib",
            "gen_1.s_per_step", "gen_1.peak_gib"),
)


# ---- VACE control on the real-size Wan2.2-VACE-Fun-A14B high-noise expert under a 28 GiB cap (docs/vace.md) ----------
VACE = "vace_a14b"
VACE_STEPS = 4
VACE_CLIPS = 4
# generated 480x832x81 clips at 16 fps, each its own control video (any video conditions; the control's content
# changes neither memory nor time), in metadata_vace.csv beside the generator's metadata.csv
VACE_DATA = ("import csv, sys\n"
             "from pathlib import Path\n"
             "from wanexp.data.synthetic import make_demo_dataset\n"
             "meta = make_demo_dataset(sys.argv[1], num_videos=int(sys.argv[2]), num_images=0, num_frames=81, "
             "height=480, width=832, fps=16)\n"
             "rows = list(csv.DictReader(meta.open()))\n"
             "with (Path(sys.argv[1]) / 'metadata_vace.csv').open('w', newline='') as f:\n"
             "    w = csv.DictWriter(f, fieldnames=['video', 'prompt', 'control_video'])\n"
             "    w.writeheader()\n"
             "    w.writerows({'video': r['video'], 'prompt': r['prompt'], 'control_video': r['video']}\n"
             "                for r in rows)\n")


def vace_dir(ctx: Ctx) -> Path:
    return ctx.work / "vace14b_high"  # the real-size VACE high-noise expert with light encoders (real_sizes.yaml)


def vace_data(ctx: Ctx) -> list[str]:
    """model=vace14b's high-noise expert at 480x832x81 from the cache, each clip with its control video."""
    return ["model=vace14b", f"model.path={vace_dir(ctx)}", "data=csv",
            f"data.metadata={ctx.work / 'data_vace' / 'metadata_vace.csv'}", "data.height=480", "data.width=832",
            "data.num_frames=81", "data.batch_size=1", "data.num_workers=2",
            f"paths.cache_dir={ctx.work / 'cache_vace'}",
            "trainer.precision=bf16-mixed", "model.compile=false", "boundary=high", "trainer.log_every_n_steps=1"]


CASES[VACE] = Case(
    name=VACE, gpus=1, model="a14b",
    about="VACE control (model=vace14b) on the real-size Wan2.2-VACE-Fun-A14B high-noise expert (random weights, 40 "
          "blocks + 8 VACE blocks, light encoders: real_sizes.yaml vace14b_high, the low-noise expert not written): "
          f"LoRA r32 on the base blocks at 480x832x81 under MemoryCap {CAP_GIB} GiB, the memory settings the planner "
          f"picks (model.memory_budget_gib={CAP_GIB}, model.blocks_to_swap=auto, the checkpointed blocks' inputs in "
          f"host memory), {VACE_STEPS} steps from the cache of {VACE_CLIPS} clips with their control videos",
    phases=(Phase("build_vace", lambda ctx: [ctx.python, "tests/gpu/build_random_model.py", "--model", "vace14b",
                                             "--entry", "vace14b_high", "--path", str(vace_dir(ctx))], minutes=6,
                  fresh=lambda ctx: [light_dir(ctx), dit_dir(ctx), a14b_dir(ctx), _a14b_dir(ctx), a14b_gen_dir(ctx),
                                     s2v_dir(ctx), animate_dir(ctx)]),  # ~35 GB of disk for the expert
            Phase("data_vace", lambda ctx: [ctx.python, "-c", VACE_DATA, str(ctx.work / "data_vace"),
                                            str(VACE_CLIPS)], minutes=2),
            Phase("cache_vace", lambda ctx: [ctx.python, "-m", "wanexp.cli.cache", *vace_data(ctx),
                                             f"paths.output_dir={ctx.run_dir('cache_vace')}"], minutes=4),
            train(VACE, 1, VACE_STEPS, vace_data, *MEMORY_CAP, "adapter.rank=32", "model.gradient_checkpointing=true",
                  "model.offload_activations=true", f"model.memory_budget_gib={CAP_GIB}", "model.blocks_to_swap=auto",
                  "callbacks.checkpoint.every_n_train_steps=1000", phase="train", minutes=8)),
    checks=(Check("phases.build_vace.rc", "==", 0, "build_vace", "the VACE expert built"),
            Check("phases.cache_vace.rc", "==", 0, "cache_vace", "the latents and control channels cached"),
            *finished("train", VACE_STEPS),
            Check("metrics.train.peak_mem_gib", "<=", CAP_GIB, "train", f"within the {CAP_GIB} GiB cap"),
            Check("metrics.blocks_swapped", "present", None, "train", "the planner's block swap, recorded")),
    collect=lambda ctx, phases: {"train": run_metrics(ctx.run_dir(VACE)),
                                 "blocks_swapped": log_value(ctx, VACE, "train", FLF_SWAPPED)},
    record=("train.median_step_s", "train.peak_mem_gib", "blocks_swapped"),
)
