"""Run a module or a script (``python tests/gpu/capped.py GIB module|script.py args...``) with this process's CUDA
memory capped at GIB GiB: a run that needs more fails with an out-of-memory error instead of using the larger card.
Under torchrun each process caps its own GPU (LOCAL_RANK)."""
import os
import runpy
import sys

import torch

gib, module, *args = sys.argv[1:]
device = int(os.environ.get("LOCAL_RANK", 0))
total = torch.cuda.get_device_properties(device).total_memory
torch.cuda.set_per_process_memory_fraction(min(1.0, float(gib) * 2**30 / total), device)
sys.argv = [module, *args]
if module.endswith(".py"):
    runpy.run_path(module, run_name="__main__")
else:
    runpy.run_module(module, run_name="__main__")
