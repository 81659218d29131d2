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
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
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


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def disk_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**30


def run_metrics(run: Path, sessions: list[dict] | None = None) -> dict:
    """Losses, step times, peak memory, validation time and disk of a run folder (all its sessions: metrics.csv of
    every logs/version_*, validation/step_*/metrics.json, status.json). ``sessions``: status.json as each earlier
    session left it (a killed session's is overwritten by the next), for the time and memory they add."""
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
        "median_step_s": statistics.median(times[1:]) if len(times) > 1 else None,
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


# ---- the device scripts (each writes its own files into the case's out folder) ------------------------------------
def script(name: str, gpus: int, path: str, minutes: float, about: str, env: dict | None = None,
           checks: tuple[Check, ...] = (), collect: Callable[[Ctx, dict], dict] | None = None,
           record: tuple[str, ...] = ()) -> Case:
    """A case that runs one tests/gpu/*.sh (it sources setup_env.sh; $OUT is the case's out folder). The scripts
    exit non-zero when one of their runs fails."""
    def argv(ctx: Ctx) -> list[str]:
        return ["bash", path]

    base = {"WANEXP_GPU_WORK": "{work}", "OUT": "{out}/" + name, "DEADLINE": "570"}
    phase = Phase("run", argv, minutes=minutes, env={**base, **(env or {})})
    return Case(name=name, gpus=gpus, model="ti2v5b", about=about, phases=(phase,),
                checks=(Check("phases.run.rc", "==", 0, None, "the script exits 0"), *checks),
                collect=collect or (lambda ctx, phases: {}), record=record)


def strategy_rows(name: str) -> Callable[[Ctx, dict], dict]:
    def collect(ctx: Ctx, phases: dict) -> dict:
        f = ctx.out / name / "strategy.jsonl"
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.is_file() else []
        bad = [r["name"] for r in rows if r.get("rc") != 0 or not r.get("finite")]
        return {"rows": len(rows), "rows_failed": bad,
                "median_step_s": {r["name"]: r.get("median_step_s") for r in rows},
                "peak_gib": {r["name"]: r.get("peak_gib") for r in rows}}
    return collect


SCRIPTS = (
    script("perf_5b", 1, "tests/gpu/perf_check.sh", 8, "wanexp.cli.bench on real-size DiTs: the plain loops, wanexp's "
           "step, numerics vs the plain loop, knob variants (PERF_CASES)", {"PERF_CASES": "short ckpt"}),
    script("fp8_5b", 1, "tests/gpu/fp8_check.sh", 5, "model.fp8=true against the default step, TI2V-5B 704x1280x17 "
           "(compute capability >= 8.9)"),
    script("budget_5b_30g", 1, "tests/gpu/budget_check.sh", 6, "model.memory_budget_gib at 4,400 and 27,280 tokens, "
           "the process capped at 30 GiB"),
    script("gap_5b", 1, "tests/gpu/gap_check.sh", 7, "python train.py from the cache against the bench's step "
           "(GAP_HOST=1, GAP_PROBE=1 add parts)"),
    script("strategy_5b_2gpu", 2, "tests/gpu/strategy_check.sh", 9, "the strategy table's 5B rows on 1 and 2 GPUs "
           "(STRAT_ONLY picks rows; STRAT_CASES=a14b... the A14B rows)",
           {"STRAT_CASES": "5b", "STRAT_GPUS": "1 2", "STRAT_ONLY": "^5b_(ddp_[12]|fsdp_2)$"},
           checks=(Check("metrics.rows", ">=", 1, None, "rows written"),
                   Check("metrics.rows_failed", "==", [], None, "every row exits 0 with finite losses")),
           collect=strategy_rows("strategy_5b_2gpu"), record=("median_step_s", "peak_gib")),
    script("seams_tiny_2gpu", 2, "tests/gpu/seams_check.sh", 3, "the tiny model through train.py: single, DDP and "
           "FSDP2; fused AdamW; DDP and FSDP2 export the same LoRA tensors"),
    script("deepspeed_2gpu", 2, "tests/gpu/deepspeed_check.sh", 9, "DeepSpeed ZeRO-2/3 (+ offload) on the tiny "
           "model with a resume (DS_CASES='tiny 5b' adds TI2V-5B; needs the deepspeed wheel)", {"DS_CASES": "tiny"}),
    script("distill_2gpu", 2, "tests/gpu/distill_check.sh", 8, "FSDP2 + compile (tiny), 16-mixed fp16 (tiny), "
           "objective=dmd (tiny), DMD step time and memory on the real-size 5B DiT"),
)

CASES: dict[str, Case] = {c.name: c for c in (USER_JOB, V100_JOB, PCIE_JOB, LOADER_JOB, *SCRIPTS)}
