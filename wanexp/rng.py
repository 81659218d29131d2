"""The random streams a training step draws from (torch CPU and CUDA, Python, NumPy), as plain tensors and numbers.

A checkpoint stores every rank's state so that a resumed run draws the same timesteps, noise and first-frame choices
as an uninterrupted one would have. The states are tensors, ints and tuples only, so checkpoints still load with
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import random

import numpy as np
import torch


def _this_rank_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's generator
    return state


def get_rng_state(gather: bool = False) -> list[dict]:
    """One state per rank, in rank order. ``gather`` (every rank must call it then) collects all ranks'."""
    state = _this_rank_state()
    if not gather or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return [state]
    states: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(states, state)
    return states


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
