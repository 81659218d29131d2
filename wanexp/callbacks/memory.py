"""Cap this process's GPU memory, e.g. to check on a large card that a run fits a smaller one."""
from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback


class MemoryCap(Callback):
    """``+callbacks.memory_cap._target_=wanexp.callbacks.memory.MemoryCap +callbacks.memory_cap.gib=30``: the CUDA
    caching allocator refuses more than ``gib`` GiB (torch.cuda.set_per_process_memory_fraction)."""

    def __init__(self, gib: float):
        self.gib = gib

    def setup(self, trainer, pl_module, stage: str) -> None:
        if torch.cuda.is_available():
            device = torch.cuda.current_device()
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.gib * 2**30 / total), device)
