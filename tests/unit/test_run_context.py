"""wanexp/context.py: the run-wide facts, and the ranks read from the trainer when asked."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from wanexp.context import RunContext, TakesRunContext, hand_over


def test_ranks_of_a_sequence_group_share_a_data_parallel_rank():
    ctx = RunContext(sp_size=2)
    ranks = [SimpleNamespace(global_rank=r, world_size=4) for r in range(4)]
    assert [ctx.dp_rank(t) for t in ranks] == [0, 0, 1, 1]
    assert {ctx.dp_size(t) for t in ranks} == {2}
    assert [RunContext().dp_rank(t) for t in ranks] == [0, 1, 2, 3] and RunContext().dp_size(ranks[0]) == 4


def test_without_a_trainer_it_is_one_process_that_logs_nothing():
    ctx = RunContext(sp_size=2, concurrent_loads=1)
    assert (ctx.rank(None), ctx.world_size(None), ctx.dp_rank(None), ctx.dp_size(None)) == (0, 1, 0, 1)
    assert ctx.logs_this_step(None) is False


def test_the_context_is_frozen_and_checks_its_group_size():
    ctx = RunContext(sp_size=2, concurrent_loads=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.sp_size = 1
    with pytest.raises(ValueError, match="sp_size=0"):
        RunContext(sp_size=0)


def test_hand_over_reaches_the_parts_that_take_it_and_the_status_callback_is_one():
    from wanexp.callbacks.status_file import RunStatus

    ctx = RunContext(sp_size=4, concurrent_loads=2)
    status, other = RunStatus(output_dir="unused", run_name="x"), SimpleNamespace()
    assert status.run_context == RunContext()  # the one-process default until handed over
    hand_over(ctx, [status, other])
    assert status.run_context is ctx and not hasattr(other, "run_context")
    assert isinstance(status, TakesRunContext)


def test_from_config_reads_the_parallel_group():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"parallel": {"sp_size": 2, "concurrent_loads": None}})
    assert RunContext.from_config(cfg) == RunContext(sp_size=2)
    cfg.parallel.concurrent_loads = 3
    assert RunContext.from_config(cfg) == RunContext(sp_size=2, concurrent_loads=3)


@pytest.mark.parametrize("flops, logged", [(3e12, True), (0.0, False)])
def test_tflops_are_logged_only_for_a_family_that_counts_its_flops(tmp_path, flops, logged):
    """perf/tflops is the model FLOPs of the window over its time; a family without a FLOP formula (its step counts
    none) logs no TFLOP/s at all, rather than a measured-looking 0."""
    from types import SimpleNamespace

    from wanexp.callbacks.status_file import RunStatus

    status = RunStatus(output_dir=str(tmp_path), run_name="x")
    status._window, status._window_start = [2.0, 4, 400, flops], 0
    got = {}
    module = SimpleNamespace(log_dict=lambda metrics, **kw: got.update(metrics))
    status._log_window(SimpleNamespace(global_step=2, profiler=None), module)
    assert ("perf/tflops" in got) == logged and got["perf/step_time_s"] == 1.0
    if logged:
        assert got["perf/tflops"] == pytest.approx(1.5)
