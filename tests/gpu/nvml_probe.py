"""What status.json's GPU readings cost per logged step on this machine: torch.cuda's NVML functions (each starts NVML
and looks the device up again) and the status file's whole reading (wanexp.callbacks.status_file._gpu: memory and
those NVML values). Prints ``nvml: <what> <ms> ms`` per call, the mean of 20 after one untimed call."""
from __future__ import annotations

import time

import torch

from wanexp.callbacks import status_file


def per_call_ms(read, n: int = 20) -> float:
    read()
    t = time.perf_counter()
    for _ in range(n):
        read()
    return 1000 * (time.perf_counter() - t) / n


def main() -> None:
    torch.zeros(1, device="cuda")
    torch_reads = {"torch.cuda.utilization": torch.cuda.utilization, "torch.cuda.power_draw": torch.cuda.power_draw,
                   "torch.cuda.clock_rate": torch.cuda.clock_rate}
    for name, read in torch_reads.items():
        print(f"nvml: {name} {per_call_ms(read):.3f} ms", flush=True)
    print(f"nvml: torch_reads_all {per_call_ms(lambda: [r() for r in torch_reads.values()]):.3f} ms", flush=True)
    print(f"nvml: wanexp_gpu {per_call_ms(status_file._gpu):.3f} ms  {status_file._gpu()}", flush=True)


if __name__ == "__main__":
    main()
