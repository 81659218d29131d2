"""Whether the installed torch build has kernels for this machine's GPUs, checked before anything loads.

A CUDA build of torch carries machine code for a list of GPU architectures (``torch.cuda.get_arch_list()``: ``sm_XY``
binaries, ``compute_XY`` PTX). A GPU runs a ``sm_XY`` binary of its own major version and a minor version at most
its own, or JIT-compiles ``compute_XY`` PTX of an architecture at most its own. Outside that list ``torch.cuda``
still reports the GPU as available, and the first kernel fails with "no kernel image is available". The case met:
the V100 (compute capability 7.0) under PyPI's torch builds from 2.11 on, which are CUDA 13 (sm_75 and up);
PyTorch's CUDA 12.6 builds (``https://download.pytorch.org/whl/cu126``) still carry sm_70.
"""
from __future__ import annotations

import re

import torch

from wanexp.errors import ConfigError

LEGACY_INDEX = "https://download.pytorch.org/whl/cu126"  # CUDA 12.6 builds: sm_50 to sm_90, Volta (sm_70) included
LEGACY_BELOW = (7, 5)  # capabilities that CUDA 13 no longer compiles for (Maxwell, Pascal, Volta)


def gpu_capability_below(minimum: tuple[int, int]) -> str:
    """"" when there is no GPU or its compute capability is at least ``minimum``, else the GPU's name and capability
    (what a kernel needs: the FP8 GEMM 8.9, Triton's compiled blocks 8.0)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < minimum:
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        return f"{torch.cuda.get_device_name()} (compute capability {cap})"
    return ""


def runs_on(capability: tuple[int, int], archs: list[str]) -> bool:
    """Whether a GPU of ``capability`` (major, minor) runs code of a build compiled for ``archs``."""
    for arch in archs:
        found = re.fullmatch(r"(sm|compute)_(\d+)(\d)[af]?", arch)
        if found is None:
            continue
        kind, built = found.group(1), (int(found.group(2)), int(found.group(3)))
        if kind == "sm" and built[0] == capability[0] and built[1] <= capability[1]:
            return True
        if kind == "compute" and built <= capability:
            return True
    return False


def unsupported_gpu_line(name: str, capability: tuple[int, int], archs: list[str], version: str,
                         cuda: str | None) -> str:
    """The one line that says which GPU this build cannot run and what to install instead."""
    cap = ".".join(map(str, capability))
    built = f"{archs[0]} to {archs[-1]}" if archs else "none"
    head = (f"{name} (compute capability {cap}) has no kernels in the installed torch {version} (CUDA {cuda}, built "
            f"for {built})")
    base = version.split("+")[0]
    if capability < LEGACY_BELOW:
        return (f"{head}; install PyTorch's CUDA 12.6 build of torch {base}: make setup TORCH_CUDA=cu126 (or pip "
                f"install torch=={base}+cu126 --index-url {LEGACY_INDEX}); see docs/memory.md")
    return (f"{head}; install a torch {base} build for sm_{capability[0]}{capability[1]} (its CUDA variant from "
            "https://download.pytorch.org/whl/, e.g. make setup TORCH_CUDA=cu128)")


def check_torch_build(accelerator: str) -> None:
    """Stop with one line (ConfigError) when a visible GPU has no kernels in this torch build; nothing to check on
    the CPU (``trainer.accelerator=cpu``, no GPU) or a ROCm build."""
    if str(accelerator) == "cpu" or not torch.cuda.is_available() or torch.version.hip:
        return
    archs = torch.cuda.get_arch_list()
    if not archs:
        return
    for index in range(torch.cuda.device_count()):
        capability = tuple(torch.cuda.get_device_capability(index))
        if not runs_on(capability, archs):
            raise ConfigError(unsupported_gpu_line(torch.cuda.get_device_name(index), capability, archs,
                                                   torch.__version__, torch.version.cuda))
