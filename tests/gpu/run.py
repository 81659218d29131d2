"""Run GPU acceptance cases from tests/gpu/registry.py and judge them against their thresholds.

    python -m tests.gpu.run --list
    python -m tests.gpu.run user_job_5b_28g --phase build,cache --out $OUT     # one device call per phase group
    python -m tests.gpu.run user_job_5b_28g --phase train1 --out $OUT
    python -m tests.gpu.run user_job_5b_28g --phase train2 --out $OUT --record $OUT/benchmarks
    python -m tests.gpu.run user_job_5b_28g v100_path_5b_28g --dry-run         # the commands, nothing run

Each case's phases run in order (``--phase`` picks some); what a phase leaves (models, caches, run folders, and the
phase records in ``<work>/state/<case>.json``) stays under ``--work`` for the next call; re-running a phase drops
the records of the phases after it. After the phases ``<out>/<case>.json`` holds the phase records, the metrics
read back from the run folder, each check and the verdict, and one line is printed: PASS, FAIL, PENDING (no check
failed, phases left) or SKIP (more GPUs needed than present). The exit code is 1 when a case failed, else 0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.gpu.registry import (CASES, REPO, Case, Ctx, Phase, evaluate, lookup, newest_checkpoint_step,
                                 share_at_default)

SITE = os.environ.get("WANEXP_SITE", "/tmp/site")  # where setup_env.sh installs the carried wheels
FA4_SITE = os.environ.get("WANEXP_FA4_SITE", "/tmp/fa4site")  # where setup_fa4.sh installs FlashAttention-4
LOG_TAIL = 400  # lines of each phase's log copied to <out>/<case>/


def visible_gpus() -> list[str]:
    """Names of the GPUs this process may use (nvidia-smi, narrowed by CUDA_VISIBLE_DEVICES); none without a driver."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=60).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return []
    names = [n.strip() for n in names if n.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        keep = [int(i) for i in visible.split(",") if i.strip().isdigit()]
        names = [names[i] for i in keep if i < len(names)]
    return names


def hw_slug(names: list[str]) -> str:
    """'NVIDIA H100 80GB HBM3' x2 -> 'h100x2' (the benchmarks/ file name)."""
    if not names:
        return "cpu"
    m = re.search(r"\b([A-Z]+\d+[A-Z]*)\b", names[0].replace("NVIDIA", ""))
    base = (m.group(1) if m else re.sub(r"\W+", "", names[0])).lower()
    return base + (f"x{len(names)}" if len(names) > 1 else "")


def phase_env(ctx: Ctx, phase: Phase) -> dict:
    fill = {"work": str(ctx.work), "out": str(ctx.out)}
    return {k: v.format(**fill) for k, v in phase.env.items()}


def describe(case: Case, ctx: Ctx, phases: list[Phase]) -> list[str]:
    lines = [f"# {case.name}: {case.gpus} GPU(s); {case.about}"]
    for p in phases:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in phase_env(ctx, p).items())
        kill = f"; SIGKILL at step {p.kill.step} (or after {p.kill.deadline_s} s)" if p.kill else ""
        fresh = f"; removes {', '.join(map(str, p.fresh(ctx)))} first" if p.fresh else ""
        lines.append(f"## {case.name}/{p.name} (~{p.minutes:g} min, limit {p.timeout_s} s{kill}{fresh})")
        lines.append((env + " " if env else "") + shlex.join(p.argv(ctx)))
    return lines


def prepare_env() -> dict:
    """The carried wheels installed once per machine (tests/gpu/setup_env.sh), on PYTHONPATH with the repo."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    paths = [str(REPO)]
    if (REPO / ".whl").is_dir():
        subprocess.run(["bash", "-c", "source tests/gpu/setup_env.sh"], cwd=REPO, check=True,
                       env=dict(env, OUT=env.get("OUT", "/tmp/wanexp_out")))
        paths.insert(0, SITE)
    paths[:0] = fa4_paths(Path(FA4_SITE))
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def fa4_paths(site: Path) -> list[str]:
    """FlashAttention-4's import paths where tests/gpu/setup_fa4.sh finished installing it on this machine (its
    ``.done``): the phases find it even where the shell that sourced the script did not keep its PYTHONPATH."""
    if not (site / ".done").is_file():
        return []
    return [str(site / "nvidia_cutlass_dsl" / "dsl_packages"), str(site)]


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the process group the phase started: its loader workers too
    except ProcessLookupError:
        pass
    proc.wait()


def run_phase(ctx: Ctx, case: Case, phase: Phase, env: dict) -> dict:
    """Runs one phase; its record: rc, seconds, ok, and for a kill phase the step it was killed at, the newest
    checkpoint then and the status.json it left (the next session overwrites it)."""
    for path in phase.fresh(ctx) if phase.fresh else []:  # a folder (a run, a model) or a file (a bench's JSON)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    log_dir = ctx.work / "logs" / case.name
    log_dir.mkdir(parents=True, exist_ok=True)
    ctx.results(case.name).mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{phase.name}.log"
    t0 = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.Popen(phase.argv(ctx), cwd=REPO, env={**env, **phase_env(ctx, phase)}, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            record = watch(proc, phase, ctx, t0)
        finally:  # the runner stopped (Ctrl-C, SIGTERM): its phase's processes do not outlive it
            if proc.poll() is None:
                _kill(proc)
    record["seconds"] = round(time.monotonic() - t0, 1)
    record["log"] = str(log)
    (ctx.out / case.name).mkdir(parents=True, exist_ok=True)
    for f in ctx.results(case.name).iterdir():  # every result so far, this call's and earlier calls' on this machine
        if f.is_file():
            shutil.copy2(f, ctx.out / case.name / f.name)
    lines = log.read_text(errors="replace").splitlines()
    (ctx.out / case.name / f"{phase.name}.log").write_text("\n".join(lines[-LOG_TAIL:]) + "\n")
    return record


def watch(proc: subprocess.Popen, phase: Phase, ctx: Ctx, t0: float) -> dict:
    """Waits for the phase; a kill phase is killed with SIGKILL at its step (or deadline), anything at its limit."""
    status = phase.kill.run(ctx) / "status.json" if phase.kill else None
    while proc.poll() is None:
        elapsed = time.monotonic() - t0
        if elapsed > phase.timeout_s:
            _kill(proc)
            return {"rc": 124, "ok": False, "error": f"ran past its {phase.timeout_s} s limit"}
        if status is not None:
            state = _read(status)
            if (state.get("step") or 0) >= phase.kill.step or elapsed > kill_deadline(phase):
                _kill(proc)
                ckpt = newest_checkpoint_step(phase.kill.run(ctx))
                return {"rc": proc.returncode, "killed_at_step": state.get("step"), "checkpoint_step": ckpt,
                        "status_at_kill": state, "ok": ckpt > 0,
                        "error": None if ckpt > 0 else "killed before any checkpoint was written"}
        time.sleep(0.2)
    rc = proc.returncode
    if phase.kill:
        return {"rc": rc, "ok": False, "error": f"ended (exit {rc}) before the kill at step {phase.kill.step}"}
    return {"rc": rc, "ok": rc == 0, "error": None if rc == 0 else f"exit {rc}"}


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return {}


def judge(case: Case, ctx: Ctx, phases: dict, gpus: list[str]) -> dict:
    result = {"case": case.name, "about": case.about, "gpus_needed": case.gpus, "gpus": gpus,
              "date": datetime.date.today().isoformat(), "commit": _commit(), "phases": phases}
    try:
        result["metrics"] = case.collect(ctx, phases)
    except Exception as e:  # a half-written run folder: the checks that need its numbers fail
        result["metrics"] = {"error": f"{type(e).__name__}: {e}"}
    result["verdict"], result["checks"] = evaluate(case, result)
    return result


def _commit() -> str | None:
    if os.environ.get("WANEXP_COMMIT"):  # a snapshot of a commit, run outside its git checkout
        return os.environ["WANEXP_COMMIT"]
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def record_row(case: Case, result: dict, folder: Path) -> Path:
    """Appends the case's row to ``<folder>/<model>_<hw>_<date>.md`` (benchmarks/README.md describes them)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{case.model}_{hw_slug(result['gpus'])}_{result['date']}.md"
    if not path.is_file():
        card = result["gpus"][0] if result["gpus"] else "no GPU"
        path.write_text(f"# {case.model} on {len(result['gpus'])}x {card}, {result['date']}\n\n"
                        "| case | verdict | commit | metrics | failed checks |\n|---|---|---|---|---|\n")
    metrics = result.get("metrics", {})
    shown = ", ".join(f"{k} {_fmt(lookup(metrics, k))}" for k in case.record)  # dotted keys, as in the checks
    failed = "; ".join(f"{c['key']} {c['op']} {c['limit']} (got {_fmt(c['value'])})" for c in result["checks"]
                       if c["status"] == "fail") or "-"
    with path.open("a") as fh:
        fh.write(f"| {case.name} | {result['verdict']} | {result['commit']} | {shown or '-'} | {failed} |\n")
    return path


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


def summary_line(result: dict) -> str:
    failed = [c for c in result["checks"] if c["status"] == "fail"]
    if result["verdict"] == "FAIL":
        why = "; ".join(f"{c['key']}={_fmt(c['value'])} (want {c['op']} {c['limit']})" for c in failed)
        return f"FAIL {result['case']}: {why}"
    if result["verdict"] == "PENDING":
        left = sorted({c["key"] for c in result["checks"] if c["status"] == "pending"})
        return f"PENDING {result['case']}: phases done {list(result['phases'])}; checks left {left}"
    return f"PASS {result['case']}: " + ", ".join(f"{c['key']}={_fmt(c['value'])}" for c in result["checks"])


def select_phases(case: Case, names: list[str] | None) -> list[Phase]:
    if not names:
        return list(case.phases)
    return [case.phase(n) for n in names]


def run_case(case: Case, ctx: Ctx, names: list[str] | None, gpus: list[str], env: dict) -> dict:
    state_file = ctx.work / "state" / f"{case.name}.json"
    phases = _read(state_file).get("phases", {})
    order = [p.name for p in case.phases]
    for phase in select_phases(case, names):
        for later in order[order.index(phase.name):]:  # this phase's outputs change: later records are stale
            phases.pop(later, None)
        print(f"[{case.name}] {phase.name} (~{phase.minutes:g} min)", flush=True)
        phases[phase.name] = run_phase(ctx, case, phase, env)
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps({"phases": phases}, indent=2, default=str))
        if not phases[phase.name]["ok"]:
            print(f"[{case.name}] {phase.name}: {phases[phase.name]['error']}; the next phases are not run",
                  flush=True)
            break
    return judge(case, ctx, phases, gpus)


def kill_deadline(phase) -> float:
    """The kill phase's deadline: its own, or WANEXP_KILL_DEADLINE_S (several phases in one device call)."""
    return float(os.environ.get("WANEXP_KILL_DEADLINE_S", phase.kill.deadline_s))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.run", description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", help="case names (--list prints them)")
    ap.add_argument("--list", action="store_true", help="print the cases, their GPUs, phases and expected minutes")
    ap.add_argument("--dry-run", action="store_true", help="print the commands; run nothing, write nothing")
    ap.add_argument("--phase", default=None, help="comma-separated phases to run (default: all, in order)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "gpu" / "results", help="<case>.json and logs")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("WANEXP_GPU_WORK", REPO / "outputs/gpu/work")),
                    help="models, data, caches, run folders and phase records, kept between calls")
    ap.add_argument("--record", type=Path, default=None, metavar="DIR",
                    help="also append each case's row to DIR/<model>_<hw>_<date>.md (e.g. benchmarks)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs present (default: nvidia-smi)")
    ap.add_argument("--rejudge", type=Path, default=None, metavar="JSON",
                    help="judge a stored <case>.json again against today's checks and shipped defaults (no GPU)")
    args = ap.parse_args(argv)
    if args.rejudge is not None:
        return rejudge(args.rejudge, args.out.resolve(), args.record)
    if args.list:
        for c in CASES.values():
            phases = ", ".join(f"{p.name} ~{p.minutes:g} min" for p in c.phases)
            print(f"{c.name:24s} {c.gpus} GPU(s)  [{phases}]  {c.about}")
        return 0
    unknown = [n for n in args.cases if n not in CASES]
    if unknown or not args.cases:
        print(f"tests.gpu.run: error: {'unknown case ' + ', '.join(unknown) if unknown else 'no case given'}; "
              f"cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.phase.split(",") if n.strip()] if args.phase else None
    ctx = Ctx(work=args.work.resolve(), out=args.out.resolve())
    try:
        picked = {n: select_phases(CASES[n], names) for n in args.cases}
    except KeyError as e:
        print(f"tests.gpu.run: error: {e.args[0]}", file=sys.stderr)
        return 2
    gpus = visible_gpus() if args.gpus is None else [f"GPU {i}" for i in range(args.gpus)]
    if args.dry_run:
        for n, phases in picked.items():
            case = CASES[n]
            print("\n".join(describe(case, ctx, phases)))
            if case.gpus > len(gpus):
                print(f"SKIP {n}: needs {case.gpus} GPU(s), {len(gpus)} present")
        return 0
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds run_phase: it kills its phase
    try:
        return run_cases(args, ctx, names, gpus)
    finally:
        signal.signal(signal.SIGTERM, previous)


def rejudge(stored: Path, out: Path, record: Path | None) -> int:
    """A stored result judged again: the metrics derived from the shipped defaults (the validation share at the
    default cadence) recomputed from its measured numbers, then today's checks. Writes ``<out>/<case>.json``."""
    result = json.loads(stored.read_text())
    case = CASES[result["case"]]
    m = result.get("metrics", {})
    if m.get("validation_s"):
        m["val_share_at_default"] = share_at_default(m["validation_s"], m.get("median_step_s"))
    result["verdict"], result["checks"] = evaluate(case, result)
    result["rejudged"] = {"date": datetime.date.today().isoformat(), "commit": _commit()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{case.name}.json").write_text(json.dumps(result, indent=2, default=str))
    if record is not None:
        print(f"recorded in {record_row(case, result, record)}")
    print(summary_line(result), flush=True)
    return 1 if result["verdict"] == "FAIL" else 0


def run_cases(args, ctx: Ctx, names: list[str] | None, gpus: list[str]) -> int:
    env = None
    failed = False
    for n in args.cases:
        case = CASES[n]
        if case.gpus > len(gpus):
            print(f"SKIP {n}: needs {case.gpus} GPU(s), {len(gpus)} present", flush=True)
            continue
        env = env or prepare_env()
        result = run_case(case, ctx, names, gpus, env)
        ctx.out.mkdir(parents=True, exist_ok=True)
        (ctx.out / f"{n}.json").write_text(json.dumps(result, indent=2, default=str))
        if args.record is not None and result["verdict"] != "PENDING":
            print(f"recorded in {record_row(case, result, args.record)}")
        print(summary_line(result), flush=True)
        failed |= result["verdict"] == "FAIL"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
