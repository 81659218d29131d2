"""parallel=ddp (wanexp/parallel/__init__.py, ddp): Lightning's DDPStrategy with DistributedDataParallel built on the
current CUDA stream (Lightning 2.6 builds it in a new stream, so every backward of a DDP run synced two streams per
parameter and warned about it), and the strategy counted as DDP where wanexp asks (the base's load turns)."""
from __future__ import annotations

import types

import pytest
import torch

from wanexp.parallel import ddp


def test_ddp_is_built_on_the_current_stream(monkeypatch):
    import torch.nn.parallel

    built = []
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda **kw: built.append(kw) or "ddp")

    def no_new_stream(*args, **kwargs):
        raise AssertionError("DDP built in a new CUDA stream")

    monkeypatch.setattr(torch.cuda, "Stream", no_new_stream)
    strategy = ddp(timeout_s=60, find_unused_parameters=False)
    monkeypatch.setattr(type(strategy), "determine_ddp_device_ids", lambda self: [0])  # as on a GPU
    model = torch.nn.Linear(2, 2)
    assert strategy._setup_model(model) == "ddp"
    assert built == [{"module": model, "device_ids": [0], "find_unused_parameters": False}]


@pytest.mark.parametrize("concurrent, turns", [(1, 2), (2, 1)])
def test_the_base_loads_in_turns_under_it(concurrent, turns, capsys):
    from wanexp.module import load_turns

    trainer = types.SimpleNamespace(world_size=2, strategy=ddp(timeout_s=60), num_devices=2, global_rank=0,
                                    local_rank=1)
    module = types.SimpleNamespace(_trainer=trainer, run_context=types.SimpleNamespace(concurrent_loads=concurrent))
    assert load_turns(module) == (turns, 1 if turns == 2 else 0)
    assert ("in 2 turns of 1 rank(s) per node" in capsys.readouterr().out) is (turns == 2)
