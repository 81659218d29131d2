"""Where a step's GPU time goes (torch.profiler events), for the bench and the profile callback. A family's model
FLOPs are its spec's (``ModelSpec.step_flops``; Wan2.2's: wanexp/models/wan22/flops.py)."""
from __future__ import annotations


# ---- where a step's GPU time goes (torch.profiler events) -------------------------------------------------------
KERNEL_KINDS = [  # (kind, substrings of a GPU kernel's name), first match wins
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
    ("fused elementwise (triton)", ("triton",)),
    ("optimizer", ("adam", "multi_tensor")),
    ("communication", ("nccl",)),
]
OTHER_KIND = "other (eager elementwise, copies)"
# CUDA runtime calls in which the host waits for the GPU
HOST_WAITS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def gpu_activity(events) -> list:
    """The kernels, copies and memsets of a torch.profiler's ``events()`` (not the GPU-side spans of annotations such
    as ``Optimizer.step#AdamW.step`` or ``DistributedDataParallel.forward``, which cover whole phases), by start."""
    import torch

    return sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False)), key=lambda e: e.time_range.start)


def gpu_time_by_kind(events, steps: int) -> tuple[dict, dict]:
    """({kind: GPU ms per step}, {kind: name of its longest kernel}) from a torch.profiler's ``events()``."""
    kinds: dict[str, float] = {}
    top: dict[str, tuple[float, str]] = {}
    for e in gpu_activity(events):
        kind = kernel_kind(e.name)
        us = e.time_range.elapsed_us()
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3 / steps
        if us > top.get(kind, (0.0, ""))[0]:
            top[kind] = (us, e.name[:90])
    return kinds, {k: name for k, (_, name) in top.items()}


def gpu_top_kernels(events, steps: int, top: int = 25) -> list[list]:
    """The ``top`` kernels by GPU time, as [ms per step, calls per step, kind, name]: which kernels of a kind the
    time goes to (a Triton kernel's name lists the ops it fused, e.g. ``triton_red_fused_abs_amax_...``)."""
    total: dict[str, list[float]] = {}
    for e in gpu_activity(events):
        t = total.setdefault(e.name, [0.0, 0.0])
        t[0] += e.time_range.elapsed_us() / 1e3 / steps
        t[1] += 1 / steps
    rows = sorted(total.items(), key=lambda kv: -kv[1][0])[:top]
    return [[ms, calls, kernel_kind(name), name[:120]] for name, (ms, calls) in rows]


def kernel_kind(name: str) -> str:
    """A GPU kernel's kind (KERNEL_KINDS) from its name."""
    low = name.lower()
    return next((k for k, keys in KERNEL_KINDS if any(x in low for x in keys)), OTHER_KIND)


def gpu_busy_ms(events, steps: int) -> float:
    """GPU ms per step during which at least one kernel or copy ran (overlapping streams counted once)."""
    busy, end = 0, None
    for e in gpu_activity(events):
        s, t = e.time_range.start, e.time_range.end
        if end is None or s > end:
            busy, end = busy + (t - s), t
        elif t > end:
            busy, end = busy + (t - end), t
    return busy / 1e3 / steps


def gpu_gaps(events, top: int = 5, min_ms: float = 0.5) -> list[list]:
    """The ``top`` longest times no kernel or copy ran, as [ms, kernel before, kernel after]: where in the step the
    GPU waited for the host."""
    gaps, end, last = [], None, ""
    for e in gpu_activity(events):
        if end is not None and (e.time_range.start - end) / 1e3 >= min_ms:
            gaps.append([(e.time_range.start - end) / 1e3, last[:70], e.name[:70]])
        if end is None or e.time_range.end > end:
            end, last = e.time_range.end, e.name
    return sorted(gaps, key=lambda g: -g[0])[:top]


def runtime_calls(events, steps: int, names=None, top: int = 8) -> dict:
    """{CUDA runtime/driver call: [calls per step, host ms per step]}: the ``top`` by time, or those in ``names``
    (e.g. ``HOST_WAITS``: the calls in which the host waited for the GPU)."""
    import torch

    out: dict[str, list[float]] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu") and (
                names is None or e.name in names):
            row = out.setdefault(e.name, [0.0, 0.0])
            row[0] += 1 / steps
            row[1] += e.time_range.elapsed_us() / 1e3 / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1])[:top])


# ---- the card's clock and power while a step runs (nvidia-smi) ----------------------------------------------------
SMI_QUERY = "clocks.sm,power.draw"


class CardTelemetry:
    """The SM clock (MHz) and board power (W) of one GPU, sampled every ``period_ms`` by ``nvidia-smi`` in a
    background process while the bench times its paths; :meth:`window` averages a span. A step that keeps the GPU
    busy draws up to the card's power limit and the driver lowers the SM clock to stay under it, so the same kernels
    take longer: the clock says whether a path's GPU time grew because its kernels did more or ran slower.
    ``command``: what prints ``MHz, W`` lines (tests give a stand-in); without nvidia-smi nothing is sampled.
    These are the readings a user sees in ``nvidia-smi``; status.json reads the same sensors through NVML once per
    update (wanexp/callbacks/status_file.py)."""

    def __init__(self, command: list[str] | None = None, period_ms: int = 100, gpu: str | None = None):
        import shutil
        import subprocess
        import threading
        import time

        self.samples: list[tuple[float, float, float]] = []  # (Unix time, MHz, W)
        self.limit_w = None
        self._proc = None
        if command is None:
            if shutil.which("nvidia-smi") is None:
                return
            sel = ["-i", gpu] if gpu else []
            command = ["nvidia-smi", *sel, f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits",
                       f"-lms={period_ms}"]
            try:
                limit = subprocess.run(["nvidia-smi", *sel, "--query-gpu=power.limit", "--format=csv,noheader,nounits"],
                                       capture_output=True, text=True, timeout=20).stdout.split()
                self.limit_w = float(limit[0]) if limit else None
            except (OSError, subprocess.SubprocessError, ValueError):
                self.limit_w = None
        try:
            self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return

        def read():
            for line in self._proc.stdout:
                try:
                    mhz, watts = (float(x) for x in line.split(",")[:2])
                except ValueError:
                    continue  # "[N/A]" or a partial line
                self.samples.append((time.time(), mhz, watts))

        threading.Thread(target=read, daemon=True).start()

    def window(self, start: float, end: float) -> dict | None:
        """Mean SM clock and power over [start, end] (Unix seconds), with the highest power and the sample count;
        None without samples there."""
        inside = [(m, w) for t, m, w in list(self.samples) if start <= t <= end]
        if not inside:
            return None
        return {"sm_mhz": sum(m for m, _ in inside) / len(inside), "power_w": sum(w for _, w in inside) / len(inside),
                "max_power_w": max(w for _, w in inside), "samples": len(inside)}

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
