"""Run a module (``python tests/gpu/capped.py GIB module args...``) with this process's CUDA memory capped at GIB GiB:
a run that needs more fails with an out-of-memory error instead of using the larger card."""
import runpy
import sys

import torch

gib, module, *args = sys.argv[1:]
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(min(1.0, float(gib) * 2**30 / total), 0)
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__")
