"""Where a training step's time goes, measured inside ``python train.py`` (``callbacks.profile.steps=N``).

For N optimizer steps after ``start_step`` (and one warm-up step before them) the step runs under torch.profiler
and, on a GPU, under CUDA's sync debug mode. At the end each rank writes ``DIR/profile/rank{R}.json`` (and
``trace_rank{R}.json``, a Chrome/Perfetto trace, with ``trace: true``); rank 0 prints one line:

- ``wall_ms``: the host's time per step over the window (the GPU is synchronized at both ends, so this is the step
  time a run sees);
- ``gpu_busy_ms``: the time at least one kernel or copy ran; ``wall - busy`` is time the GPU waited for the host;
  ``gpu_gaps``: the longest such waits, with the kernels around them (where in the step they fall);
- ``gpu_ms_by_kind``: kernel time by kind (GEMM, attention, Triton-fused, optimizer, communication, other);
- ``host_waits``: the CUDA runtime calls in which the host waited for the GPU (calls and ms per step);
  ``runtime_calls``: the CUDA runtime calls that took the host the most time (launches, copies, allocations);
- ``gc``: Python's garbage collections by generation (collections and host ms per step): pauses of the host;
- ``sync_sites``: where in the Python code each synchronizing CUDA operation was issued (``.item()``, a copy to the
  host, a blocking copy from pageable memory, ...), from ``torch.cuda.set_sync_debug_mode``, with counts.

The profiled steps are slower than the others: tracing costs the host a few µs per CUDA runtime call, and a TI2V-5B
step makes ~10,000 (on an H100 its steps took ~550 ms profiled against ~420 ms), so ``wall_ms`` and the GPU's idle
time are upper bounds where the host is the limit; kernel times, sync sites and GC pauses are not affected. The other
steps are untouched.
"""
from __future__ import annotations

import gc
import json
import time
import traceback
import warnings
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from wanexp.perf import HOST_WAITS, gpu_busy_ms, gpu_gaps, gpu_time_by_kind, runtime_calls

SYNC_WARNING = "synchronizing CUDA operation"


class StepProfile(Callback):
    """Step ``start_step + 1`` is the profiler's warm-up (its start-up cost lands there, not in the figures); steps
    ``start_step + 2`` .. ``start_step + 1 + steps`` are measured."""

    def __init__(self, output_dir: str, start_step: int = 10, steps: int = 0, trace: bool = False):
        self.dir = Path(output_dir) / "profile"
        self.start_step, self.steps, self.trace = start_step, steps, trace
        self._prof = None
        self._measuring = False
        self._done = False
        self._sites: dict[str, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.steps <= 0 or self._done or self._prof is not None or trainer.global_step != self.start_step:
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        cuda = pl_module.device.type == "cuda"
        # on a GPU only its activity (kernels, copies, CUDA runtime calls): recording every CPU op would slow the host
        # enough to starve the GPU and hide the gaps this is for
        activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        self._prof = profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=self.steps))
        self._prof.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._prof is None:
            return
        cuda = pl_module.device.type == "cuda"
        if not self._measuring and trainer.global_step >= self.start_step + 1:  # the warm-up step is done
            self._prof.step()
            if cuda:
                torch.cuda.synchronize()
            self._catch = warnings.catch_warnings()
            self._catch.__enter__()
            warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
            self._show = warnings.showwarning
            warnings.showwarning = self._record_sync
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            self._gc = {}
            gc.callbacks.append(self._gc_pause)
            self._measuring, self._t0, self._from = True, time.perf_counter(), trainer.global_step
        elif self._measuring and trainer.global_step >= self._from + self.steps:
            self._finish(trainer, pl_module, cuda)

    def _record_sync(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_WARNING not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        site = sync_site(traceback.extract_stack()[:-1])
        self._sites[site] = self._sites.get(site, 0) + 1

    def _gc_pause(self, phase: str, info: dict) -> None:
        """gc.callbacks: the time of each collection by generation (the host stops for it)."""
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif hasattr(self, "_gc_t0"):
            row = self._gc.setdefault(f"gen{info['generation']}", [0, 0.0])
            row[0] += 1
            row[1] += 1000 * (time.perf_counter() - self._gc_t0)

    def _stop(self, cuda: bool) -> None:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        if self._measuring:
            gc.callbacks.remove(self._gc_pause)
            self._catch.__exit__(None, None, None)
        self._prof.__exit__(None, None, None)

    def _finish(self, trainer, pl_module, cuda: bool) -> None:
        self._stop(cuda)
        n = trainer.global_step - self._from  # the optimizer steps measured
        wall = (time.perf_counter() - self._t0) / n
        prof, self._prof, self._done = self._prof, None, True
        events = prof.events()
        kinds, longest = gpu_time_by_kind(events, n)
        busy = gpu_busy_ms(events, n) if cuda else None
        rank = trainer.global_rank
        summary = {
            "steps": [self._from + 1, trainer.global_step], "rank": rank, "device": str(pl_module.device),
            "wall_ms": 1000 * wall, "gpu_busy_ms": busy,
            "gpu_idle_ms": None if busy is None else max(0.0, 1000 * wall - busy),
            "gpu_gaps": gpu_gaps(events) if cuda else None,
            "gpu_ms_by_kind": kinds, "longest_kernel": longest,
            "host_waits": runtime_calls(events, n, names=HOST_WAITS),
            "runtime_calls": runtime_calls(events, n),
            "gc": {gen: [k / n, ms / n] for gen, (k, ms) in sorted(self._gc.items())},
            "sync_sites": {site: k / n for site, k in
                           sorted(self._sites.items(), key=lambda kv: -kv[1])} if cuda else None,
        }
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"rank{rank}.json").write_text(json.dumps(summary, indent=1))
        if self.trace:
            prof.export_chrome_trace(str(self.dir / f"trace_rank{rank}.json"))
        if rank == 0:
            print(f"wanexp: profile of steps {summary['steps'][0]}-{summary['steps'][1]}: " + describe(summary)
                  + f"; {self.dir}/rank0.json", flush=True)

    def on_train_end(self, trainer, pl_module) -> None:  # a run that ends inside the window
        if self._prof is not None:
            self._stop(pl_module.device.type == "cuda")
            self._prof = None
            if trainer.global_rank == 0:
                print("wanexp: profile: the run ended before the profiled steps did (callbacks.profile.start_step="
                      f"{self.start_step}, steps={self.steps}); nothing written", flush=True)


def sync_site(stack) -> str:
    """The innermost frame of a stack outside torch and Python's own modules: where a sync was asked for."""
    for frame in reversed(stack):
        f = frame.filename.replace("\\", "/")
        if "/torch/" in f or f.endswith(("/warnings.py", "wanexp/callbacks/profile.py")) or "<frozen" in f:
            continue
        parts = f.split("/")
        short = "/".join(parts[-3:]) if "site-packages" not in f else "/".join(parts[parts.index("site-packages") + 1:])
        return f"{short}:{frame.lineno} ({frame.name})"
    return "torch (no caller outside torch)"


def describe(summary: dict) -> str:
    """One line: wall, GPU busy/idle, host waits and sync sites per step."""
    out = f"{summary['wall_ms']:.1f} ms/step"
    if summary["gpu_busy_ms"] is not None:
        out += (f", GPU busy {summary['gpu_busy_ms']:.1f} ms ({100 * summary['gpu_busy_ms'] / summary['wall_ms']:.0f}%)"
                f", idle {summary['gpu_idle_ms']:.1f} ms")
    waits = summary["host_waits"]
    out += ", host waits " + (", ".join(f"{k} {n:.1f}x {ms:.1f} ms" for k, (n, ms) in waits.items()) or "none")
    out += ", GC " + (", ".join(f"{g} {n:.2g}x {ms:.1f} ms" for g, (n, ms) in summary["gc"].items()) or "none")
    if summary["sync_sites"] is not None:
        sites = summary["sync_sites"]
        out += ", syncs per step: " + (", ".join(f"{n:g} at {s}" for s, n in list(sites.items())[:4]) or "none")
    return out
