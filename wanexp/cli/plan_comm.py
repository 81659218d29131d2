"""The GPUs of a node for ``wanexp-plan``: all-reduce bus bandwidth, peer-to-peer, and the all-reduce share of a step.

Bandwidth follows nccl-tests' convention: an all-reduce of ``size`` bytes in ``t`` seconds has algorithm bandwidth
``size / t`` and bus bandwidth ``algbw * 2(n-1)/n`` (what each link carries in a ring), comparable across world sizes.
The gradient all-reduce of a step moves the trained parameters' gradients once per optimizer step; DDP overlaps it
with the backward pass, so its share of the step is an upper bound.
"""
from __future__ import annotations

import os
import time

SIZES = (1 << 20, 16 << 20, 64 << 20)  # bytes: small, medium, a LoRA's gradients order of magnitude
P2P_VARS = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE")
SLOW_SHARE = 0.10  # an all-reduce above this share of the step is worth the settings below


def bus_bandwidth(size: int, seconds: float, world: int) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in bytes/s of one all-reduce of ``size`` bytes over ``world`` ranks."""
    algbw = size / seconds
    return algbw, algbw * 2 * (world - 1) / world


def allreduce_seconds(size: int, busbw: float, world: int) -> float:
    """Seconds one all-reduce of ``size`` bytes takes at bus bandwidth ``busbw`` (the inverse of bus_bandwidth)."""
    if world <= 1:
        return 0.0
    return size * 2 * (world - 1) / world / busbw


def allreduce_share(grad_bytes: int, busbw: float, world: int, step_s: float, measured_with_it: bool = True) -> float:
    """The share of an optimizer step spent in the gradient all-reduce (without overlap). ``step_s``: the step as
    measured, with the all-reduce in it (a calibration on every rank) or without (one process: it is added)."""
    t = allreduce_seconds(grad_bytes, busbw, world)
    return min(1.0, t / step_s) if measured_with_it else t / (step_s + t)


def measure(sizes=SIZES, iters: int = 5, warmup: int = 2, group=None) -> list[dict]:
    """All-reduce each size (fp32 elements) on an initialized process group; every rank calls it. CUDA tensors on
    NCCL, CPU tensors on gloo. Returns one row per size: bytes, seconds (median), algbw and busbw (bytes/s)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else \
        torch.device("cpu")
    rows = []
    for size in sizes:
        x = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        times = []
        for i in range(warmup + iters):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        # the slowest rank's time is the collective's time
        t = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        algbw, busbw = bus_bandwidth(x.numel() * 4, float(t.item()), world)
        rows.append({"bytes": x.numel() * 4, "seconds": float(t.item()), "algbw": algbw, "busbw": busbw})
    return rows


def _spawned(rank: int, world: int, backend: str, port: int, sizes, queue) -> None:
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = measure(sizes)
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def measure_spawned(world: int, backend: str = "nccl", sizes=SIZES) -> list[dict]:
    """``measure`` in ``world`` fresh processes (one per GPU), for a plan that runs as one process."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_spawned, args=(world, backend, port, list(sizes), queue), nprocs=world, join=True,
                       start_method="spawn")
    return queue.get()


def peer_access(n: int) -> dict:
    """Whether the CUDA driver lets each pair of the first ``n`` GPUs reach the other directly, and the NCCL
    variables that turn peer-to-peer off or limit it (set in the environment or parallel.env)."""
    import torch

    pairs = {f"{i}-{j}": bool(torch.cuda.can_device_access_peer(i, j)) for i in range(n) for j in range(n) if i != j}
    env = {k: os.environ[k] for k in P2P_VARS if k in os.environ}
    disabled = env.get("NCCL_P2P_DISABLE", "0") not in ("0", "")
    return {"pairs": pairs, "driver_allows": all(pairs.values()) if pairs else None, "env": env,
            "used": bool(pairs) and all(pairs.values()) and not disabled}


def advice(share: float | None, p2p: dict | None) -> list[str]:
    """The parallel.env settings to try when the all-reduce is slow or hangs (docs/multi-gpu.md)."""
    if share is None or share < SLOW_SHARE:
        return []
    tips = []
    if p2p and p2p.get("used"):
        tips.append("+parallel.env.NCCL_P2P_DISABLE=1 (peer-to-peer over PCIe without ACS/IOMMU support can be "
                    "slow or hang)")
    elif p2p and p2p.get("driver_allows") and "NCCL_P2P_DISABLE" in p2p.get("env", {}):
        tips.append("peer-to-peer is off (NCCL_P2P_DISABLE) though the driver allows it: try without it")
    tips += ["+parallel.env.NCCL_IB_DISABLE=1 without InfiniBand",
             "a larger data.batch_size or trainer.accumulate_grad_batches (one all-reduce per optimizer step)"]
    return tips
