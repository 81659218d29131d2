"""``model.cuda_graphs`` (wanexp/models/wan22/fast.py, compile_blocks): the compiled blocks in torch.compile's
reduce-overhead mode, their forward and backward recorded once as CUDA graphs and replayed. The CPU has no CUDA graphs,
so what is checked here is what wanexp adds around inductor's graph trees: the compile mode, a new replay at each
training step and at each gradient-free forward (a sampler's step), and the one-line refusals of settings a replay
cannot hold. The GPU cases perf_vs_compiled and graphs_train_5b run the graphs (docs/performance.md)."""
from __future__ import annotations

import types

import pytest
import torch

from tests.conftest import compose_cfg
from tests.unit.test_perf_fast import ti2v_batch, tiny_transformer
from wanexp.models.wan22 import fast

GPU = ["experiment=demo", "trainer.accelerator=gpu", "model.compile=true", "model.cuda_graphs=true"]


@pytest.fixture
def step_marks(monkeypatch):
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    return marks


@pytest.mark.parametrize("graphs", [False, True])
def test_the_blocks_compile_in_reduce_overhead_mode_with_graphs(graphs, monkeypatch):
    calls, t = [], tiny_transformer()  # built first: its imports compile functions of their own
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append(("block", kw)))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(("checkpoint", kw)) or fn)
    fast.compile_blocks(t, cuda_graphs=graphs)
    assert [c[0] for c in calls] == ["block"] * len(t.blocks) + ["checkpoint"]
    assert all(kw.get("mode") == ("reduce-overhead" if graphs else None) for _, kw in calls)
    assert getattr(t, "_wanexp_cuda_graphs", False) is graphs


def test_each_gradient_free_forward_begins_a_replay_and_a_training_forward_does_not(step_marks):
    t = fast.use_frame_modulation(tiny_transformer())
    hidden, timestep, text = ti2v_batch(3, [True, False])

    def run():
        return t(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text, return_dict=False)

    with torch.no_grad():
        run()
    assert step_marks == []  # no graphs: no mark
    t._wanexp_cuda_graphs = True
    with torch.no_grad():
        run(), run()  # e.g. CFG's two forwards of one sampler step
    assert len(step_marks) == 2
    run()[0].sum().backward()  # a training forward: its step marked it (training_step)
    assert len(step_marks) == 2


@pytest.mark.parametrize("graphs", [False, True])
def test_a_training_step_begins_a_replay_with_graphs(graphs, step_marks):
    from wanexp.module import DiffusionModule

    stub = types.SimpleNamespace(spec=types.SimpleNamespace(cuda_graphs=graphs), automatic_optimization=False,
                                 encoders=lambda batch: batch, _manual_step=lambda encoded: "stepped")
    assert DiffusionModule.training_step(stub, {"clips": None}, 0) == "stepped"
    assert len(step_marks) == int(graphs)


def test_a_gpu_run_with_compiled_blocks_may_use_them():
    from wanexp.config import check_config

    check_config(compose_cfg(GPU))


@pytest.mark.parametrize("overrides, message", [
    (["model.compile=false"], "model.cuda_graphs=true replays the compiled blocks: set model.compile=true (or "),
    (["trainer.accelerator=cpu"], "model.cuda_graphs=true records CUDA graphs, and trainer.accelerator=cpu runs on "
                                  "the CPU; set trainer.accelerator=gpu (or model.cuda_graphs=false)"),
    (["model=tiny_animate"], "model.cuda_graphs=true replays compiled blocks, and model=tiny_animate does not compile "
                             "its blocks; set model.cuda_graphs=false"),
    (["parallel=fsdp"], "model.cuda_graphs=true with parallel=fsdp: sharded parameters are gathered to new addresses"),
    (["parallel=ddp", "parallel.sp_size=2", "trainer.devices=2"], "model.cuda_graphs=true with parallel.sp_size=2: "),
    (["model.blocks_to_swap=1"], "model.cuda_graphs=true with model.blocks_to_swap=1: swapped weights move"),
    (["model.offload_activations=true"], "model.cuda_graphs=true with model.offload_activations=true: "),
    (["trainer.accumulate_grad_batches=2"], "model.cuda_graphs=true with trainer.accumulate_grad_batches=2: the next "
                                            "replay overwrites the gradients being accumulated"),
    (["objective=kd"], "model.cuda_graphs=true with objective=kd: its step runs more than one forward; set "
                       "model.cuda_graphs=false"),
    (["objective=dmd"], "model.cuda_graphs=true with objective=dmd: its step runs more than one forward"),
])
def test_settings_a_replay_cannot_hold_are_one_line(overrides, message):
    from wanexp.config import check_config
    from wanexp.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        check_config(compose_cfg([*GPU, *overrides]))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_sampling_leaves_the_graphs_to_training(tmp_path):
    """wanexp-sample builds the run's model group without its model.cuda_graphs (compiled with --compile only)."""
    from wanexp.cli.sample import _spec

    group = compose_cfg(GPU).model
    assert group.cuda_graphs is True
    assert _spec({"model_group": group, "model_path": tmp_path}, None, compile=True).cuda_graphs is False
