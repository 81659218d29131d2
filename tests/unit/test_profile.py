"""callbacks.profile and the profiler summaries of wanexp.perf: GPU time by kernel kind, GPU busy time and gaps
(annotation spans left out), the host's CUDA runtime waits, the code line a sync came from, and the callback's window
of steps in a real `python train.py` run."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from wanexp.callbacks.profile import StepProfile, describe, sync_site
from wanexp.perf import HOST_WAITS, gpu_busy_ms, gpu_gaps, gpu_time_by_kind, gpu_top_kernels, runtime_calls

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def ev(name, start_us, end_us, device=CUDA, annotation=False):
    """A torch.profiler FunctionEvent's fields that the summaries read."""
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start_us, end=end_us,
                                                      elapsed_us=lambda: end_us - start_us))


EVENTS = [  # one "step" (times in µs): two GEMMs overlapping on two streams, a gap, attention, the optimizer
    ev("nvjet_sm90_tst_192x160", 0, 4000),
    ev("ampere_bf16_gemm_nn", 3000, 6000),
    ev("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 9000, 11000),
    ev("triton_poi_fused_add_mul_0", 11000, 11500),
    ev("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 12000, 12400),
    ev("Optimizer.step#AdamW.step", 11900, 30000, annotation=True),  # a GPU-side span of a whole phase
    ev("DistributedDataParallel.forward", 0, 30000, annotation=True),
    ev("cudaLaunchKernel", 0, 10, device=CPU),
    ev("cudaLaunchKernel", 20, 34, device=CPU),
    ev("cudaStreamSynchronize", 6000, 9000, device=CPU),
    ev("aten::mm", 0, 100, device=CPU),
]


def test_gpu_time_by_kind_leaves_out_annotation_spans():
    kinds, longest = gpu_time_by_kind(EVENTS, steps=1)
    assert kinds == {"gemm": 7.0, "attention": 2.0, "fused elementwise (triton)": 0.5, "optimizer": 0.4}
    assert longest["gemm"] == "nvjet_sm90_tst_192x160"
    assert gpu_time_by_kind(EVENTS, steps=2)[0]["gemm"] == 3.5  # per step


def test_top_kernels_sum_each_name_over_its_calls():
    events = EVENTS + [ev("triton_poi_fused_add_mul_0", 13000, 16000)]  # a second call of one kernel
    top = gpu_top_kernels(events, steps=2, top=3)
    assert top[0] == [2.0, 0.5, "gemm", "nvjet_sm90_tst_192x160"]  # 4 ms in 1 call, over 2 steps
    assert top[1] == [1.75, 1.0, "fused elementwise (triton)", "triton_poi_fused_add_mul_0"]  # 0.5 + 3 ms, 2 calls
    assert [t[3] for t in top[2:]] == ["ampere_bf16_gemm_nn"]
    assert all("Optimizer.step" not in t[3] for t in gpu_top_kernels(events, steps=1))


def test_gpu_busy_counts_overlap_once_and_gaps_name_their_kernels():
    # busy: [0, 6000] + [9000, 11500] + [12000, 12400] = 6000 + 2500 + 400 µs
    assert gpu_busy_ms(EVENTS, steps=1) == 8.9
    gaps = gpu_gaps(EVENTS)
    assert [round(g[0], 3) for g in gaps] == [3.0, 0.5]
    assert gaps[0][1:] == ["ampere_bf16_gemm_nn", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"]


def test_runtime_calls_and_host_waits():
    calls = runtime_calls(EVENTS, steps=1)
    assert list(calls) == ["cudaStreamSynchronize", "cudaLaunchKernel"]  # by time; aten ops are not runtime calls
    assert calls["cudaLaunchKernel"] == [2.0, 0.024]
    assert runtime_calls(EVENTS, steps=1, names=HOST_WAITS) == {"cudaStreamSynchronize": [1.0, 3.0]}


def test_sync_site_is_the_innermost_frame_outside_torch():
    stack = [SimpleNamespace(filename="/x/wanexp/module.py", lineno=206, name="_log_metrics"),
             SimpleNamespace(filename="/v/lib/python3.12/site-packages/lightning/fabric/utilities/apply_func.py",
                             lineno=134, name="to_item"),
             SimpleNamespace(filename="/v/lib/python3.12/site-packages/torch/_tensor.py", lineno=1, name="item"),
             SimpleNamespace(filename="/usr/lib/python3.12/warnings.py", lineno=2, name="_showwarnmsg")]
    assert sync_site(stack) == "lightning/fabric/utilities/apply_func.py:134 (to_item)"
    assert sync_site(stack[:1]) == "x/wanexp/module.py:206 (_log_metrics)"


def test_describe_one_line():
    line = describe({"wall_ms": 400.0, "gpu_busy_ms": 300.0, "gpu_idle_ms": 100.0,
                     "host_waits": {"cudaStreamSynchronize": [2.0, 1.5]}, "gc": {"gen0": [0.5, 0.2]},
                     "sync_sites": {"wanexp/module.py:206 (_log_metrics)": 1.0}})
    assert "GPU busy 300.0 ms (75%)" in line and "idle 100.0 ms" in line
    assert "cudaStreamSynchronize 2.0x 1.5 ms" in line and "gen0" in line and "1 at wanexp/module.py:206" in line


def test_a_run_profiles_the_steps_after_a_warm_up(tiny_overrides, tmp_path, capsys):
    """callbacks.profile.steps=3 from start_step=2: step 3 warms the profiler up, steps 4-6 are measured, rank0.json
    and the trace are written and one line is printed (wanexp.train.run in process)."""
    from tests.conftest import compose_cfg
    from wanexp.train import run

    run(compose_cfg([*tiny_overrides, "trainer.max_steps=7", "callbacks.validation.every_n_steps=0",
                     "callbacks.profile.start_step=2", "callbacks.profile.steps=3", "callbacks.profile.trace=true"]))
    out = SimpleNamespace(stdout=capsys.readouterr().out)
    folder = tmp_path / "run" / "profile"
    summary = json.loads((folder / "rank0.json").read_text())
    assert summary["steps"] == [4, 6] and summary["device"] == "cpu"
    assert summary["wall_ms"] > 0 and summary["gpu_busy_ms"] is None and "gc" in summary
    assert (folder / "trace_rank0.json").stat().st_size > 0
    assert "wanexp: profile of steps 4-6:" in out.stdout


def test_a_run_that_ends_inside_the_window_writes_nothing_and_says_so(tmp_path, capsys):
    cb = StepProfile(str(tmp_path), start_step=2, steps=3)
    trainer = SimpleNamespace(global_step=2, global_rank=0)
    module = SimpleNamespace(device=torch.device("cpu"))
    cb.on_train_batch_start(trainer, module, None, 0)
    assert cb._prof is not None
    trainer.global_step = 3
    cb.on_train_batch_end(trainer, module, None, None, 0)  # warm-up done: measuring
    cb.on_train_end(trainer, module)
    assert cb._prof is None and not (tmp_path / "profile").exists()
    assert "the run ended before the profiled steps did" in capsys.readouterr().out
    import gc
    assert cb._gc_pause not in gc.callbacks
