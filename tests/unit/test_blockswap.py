"""Block swap (wanexp/models/blockswap.py): the frozen weights of swapped blocks live in host memory and are fetched
at each use; on the CPU the same code path runs with plain copies, so the result is the no-swap result bit for bit."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import compose_cfg
from tests.unit.test_perf_fast import output_and_grads, ti2v_batch, tiny_transformer
from wanexp.config import check_config
from wanexp import memory_plan
from wanexp.errors import ConfigError
from wanexp.models import blockswap, fp8


def four_blocks():
    return tiny_transformer(num_layers=4)


@pytest.mark.parametrize("ckpt", [False, True], ids=["eager", "activation-ckpt"])
def test_swap_gives_the_same_output_and_lora_gradients_bitwise(ckpt):
    ref = tiny_transformer()
    if ckpt:
        ref.enable_gradient_checkpointing()
    t = copy.deepcopy(ref)
    swap = blockswap.enable(t.blocks, 2)
    assert swap.indices == [0, 1]
    swapped = [m for m in t.modules() if isinstance(m, blockswap.SwappedLinear)]
    assert len(swapped) == 2 * 10  # q,k,v,o of both attentions and the FFN's two linears, per block
    # the weights left the module tree: .to() and state_dict() no longer see them; the LoRA parameters stay
    assert sum(p.numel() for p in t.parameters()) < sum(p.numel() for p in ref.parameters())
    assert {n for n, p in t.named_parameters() if p.requires_grad} == \
        {n for n, p in ref.named_parameters() if p.requires_grad}
    assert_same_bitwise(ref, t, *ti2v_batch(2, [True, False]))


def assert_same_bitwise(ref, t, hidden, timestep, text, lora_tensors: int = 40):
    """``t`` gives ``ref``'s output and LoRA gradients bit for bit, in fp32 and under bf16 autocast (every LoRA tensor
    has a gradient: none is cut off)."""
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out_ref, grads_ref = output_and_grads(ref, hidden, timestep, text)
            out, grads = output_and_grads(t, hidden, timestep, text)
        assert torch.equal(out, out_ref)
        assert grads.keys() == grads_ref.keys() and len(grads) == lora_tensors
        for k in grads:
            assert grads_ref[k].abs().max() > 0 and torch.equal(grads[k], grads_ref[k]), k


def test_each_use_copies_from_the_host_tensors():
    """Four swapped blocks, at most two on the device: the forward copies each block once, the backward (recomputing
    each checkpointed block) copies again the two that were dropped; the copies come from the host tensors (changed
    there, the output follows)."""
    ref = four_blocks()
    ref.enable_gradient_checkpointing()
    t = copy.deepcopy(ref)
    swap = blockswap.enable(t.blocks, 4)
    most = []
    load = swap._load

    def counting_load(*args, **kwargs):
        load(*args, **kwargs)
        most.append(len(swap.resident))

    swap._load = counting_load
    hidden, timestep, text = ti2v_batch(2, [True, False])
    out_ref, grads_ref = output_and_grads(ref, hidden, timestep, text)
    out, grads = output_and_grads(t, hidden, timestep, text)
    assert torch.equal(out, out_ref) and all(torch.equal(grads[k], grads_ref[k]) for k in grads)
    assert swap.copies == 6 and max(most) == 2  # 4 in the forward, blocks 1 and 0 again in the backward
    # the host tensor is the source: zero one block's FFN output layer there and in the reference
    swap.host[2]["ffn.net.2.base_layer"]["weight"].zero_()
    swap.resident.clear()
    ref.blocks[2].ffn.net[2].base_layer.weight.data.zero_()
    out_ref, grads_ref = output_and_grads(ref, hidden, timestep, text)
    out, grads = output_and_grads(t, hidden, timestep, text)
    assert torch.equal(out, out_ref) and all(torch.equal(grads[k], grads_ref[k]) for k in grads)


def test_validation_sampling_without_grad_and_a_partial_swap():
    ref = four_blocks()
    t = copy.deepcopy(ref)
    swap = blockswap.enable(t.blocks, 2)
    assert swap.indices == [1, 3]  # spread over the blocks, the last included
    hidden, timestep, text = ti2v_batch(2, [True, False])
    with torch.no_grad():
        a = ref(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
        b = t(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
    assert torch.equal(a, b) and swap.copies == 2


def test_fp8_storage_under_swap_moves_the_fp8_bytes_and_matches_fp8_storage_alone():
    ref = tiny_transformer()
    fp8.store_blocks(ref.blocks)
    t = copy.deepcopy(ref)
    swap = blockswap.enable(t.blocks, 2)
    kinds = {v.dtype for layers in swap.host.values() for tensors in layers.values() for v in tensors.values()}
    assert kinds == {torch.float8_e4m3fn, torch.float32}  # the float8 rows and their fp32 scales
    hidden, timestep, text = ti2v_batch(2, [True, False])
    out_ref, grads_ref = output_and_grads(ref, hidden, timestep, text)
    out, grads = output_and_grads(t, hidden, timestep, text)
    assert torch.equal(out, out_ref) and all(torch.equal(grads[k], grads_ref[k]) for k in grads)


# ---- the configuration --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,message", [
    (["model.blocks_to_swap=4", "parallel=fsdp", "trainer.precision=bf16-mixed"],
     "model.blocks_to_swap=4 with parallel=fsdp"),
    (["model.blocks_to_swap=4", "model.fp8=true", "trainer.precision=bf16-mixed"],
     "model.blocks_to_swap=4 with model.fp8=true"),
    (["model.fp8_storage=true", "model.fp8=true", "trainer.precision=bf16-mixed"],
     "model.fp8_storage=true with model.fp8=true"),
    (["model.blocks_to_swap=-1"], "model.blocks_to_swap=-1: must be >= 0"),
], ids=["fsdp", "fp8-compute", "fp8-both", "negative"])
def test_combinations_refused_in_one_line(overrides, message):
    cfg = compose_cfg(["experiment=demo", *overrides])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_swap_with_compiled_blocks_passes_the_config_check():
    check_config(compose_cfg(["experiment=demo", "model.blocks_to_swap=1", "model.compile=true"]))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_compiled_path_operator_equals_nn_linear(autocast):
    """The operator a compiled block calls (wanexp::swapped_linear, run here outside compile) gives nn.Linear's output
    and input gradient bit for bit, under autocast too (its autocast kernel casts x and bias, the weight follows)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8).requires_grad_(False)
    layer = blockswap.SwappedLinear(lin, blockswap.BlockSwap(), 0, "l")
    x = torch.randn(3, 5, 16, requires_grad=True)
    results = []
    for f in (lin, lambda v: blockswap.swapped_linear(v, layer.bias, layer._handle, 8)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = f(x)
        (grad,) = torch.autograd.grad((out.float() ** 2).sum(), x)
        results.append((out, grad))
    (out_ref, grad_ref), (out, grad) = results
    assert out.dtype == (torch.bfloat16 if autocast else torch.float32) and grad.dtype == torch.float32
    assert torch.equal(out, out_ref) and torch.equal(grad, grad_ref)


def compiled_swap_case(backend: str, n: int):
    """The four-block model with the checkpoint inside the compiled graph (model.compile's default), no swap and
    compiled with ``n`` blocks swapped."""
    from wanexp.models.wan22 import fast

    ref = fast.use_frame_modulation(four_blocks())
    ref.enable_gradient_checkpointing()
    t = fast.compile_blocks(copy.deepcopy(ref), backend=backend)
    return ref, t, blockswap.enable(t.blocks, n)


def test_compiled_blocks_swap_bitwise_and_compile_once():
    """Compiled blocks under block swap: dynamo traces the swapped linears as opaque operators (no graph break, no
    weight in the graph), every block shares one graph (two: the first block's input needs no gradient), a later
    step compiles nothing and still copies from the host; with dynamo's 'eager' backend (the traced graph run as
    traced) the loss and LoRA gradients are the no-swap ones bit for bit. AOT autograd and inductor: the
    WANEXP_COMPILE_TEST test below."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    ref, t, swap = compiled_swap_case("eager", 4)
    torch._dynamo.reset()
    counters.clear()
    hidden, timestep, text = ti2v_batch(2, [True, False])
    out_ref, grads_ref = output_and_grads(ref, hidden, timestep, text)
    for step in range(2):
        copies = swap.copies
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            out, grads = output_and_grads(t, hidden, timestep, text)
        assert torch.equal(out, out_ref) and all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref), step
        assert swap.copies - copies >= 4  # each block's weights come from the host every step
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    # the host tensors are what the compiled graph computes with (no weight was captured as a constant)
    swap.host[2]["ffn.net.2.base_layer"]["weight"].zero_()
    ref.blocks[2].ffn.net[2].base_layer.weight.data.zero_()
    with torch._dynamo.config.patch(error_on_recompile=True):
        out, _ = output_and_grads(t, hidden, timestep, text)
    assert torch.equal(out, output_and_grads(ref, hidden, timestep, text)[0])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_blocks_swap_through_aot_autograd_and_inductor(backend):
    """The same through AOT autograd (the operators' fake shapes, their autograd formula in the joint graph, the
    checkpoint's recompute in the compiled backward): aot_eager bit for bit, inductor (fused fp32 math) within
    1e-5 (5e-2 under bf16 autocast); no recompile on a later step."""
    import os

    from tests.unit.test_perf_fast import CPU_COMPILE_S, rel

    if not os.environ.get("WANEXP_COMPILE_TEST"):
        pytest.skip(f"torch.compile on the CPU takes {CPU_COMPILE_S} s and more here (set WANEXP_COMPILE_TEST=1)")
    import torch._dynamo

    ref, t, swap = compiled_swap_case(backend, 4)
    hidden, timestep, text = ti2v_batch(2, [True, False])
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out_ref, grads_ref = output_and_grads(ref, hidden, timestep, text)
            for step in range(2):
                with torch._dynamo.config.patch(error_on_recompile=step > 0):
                    out, grads = output_and_grads(t, hidden, timestep, text)
        if backend == "aot_eager":
            assert torch.equal(out, out_ref) and all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref)
        else:
            tol = 5e-2 if autocast else 1e-5  # bf16: inductor keeps fused chains in fp32, eager rounds each op
            assert rel(out, out_ref) < tol and max(rel(grads[k], grads_ref[k]) for k in grads_ref) < tol
    assert swap.copies > 0


def test_more_blocks_than_the_model_has_is_refused():
    spec = SimpleNamespace(fp8_storage=False, blocks_to_swap=3, blocks=lambda t: t.blocks)
    with pytest.raises(ConfigError, match=r"model.blocks_to_swap=3: the dense transformer has 2 blocks; set "
                                          r"model.blocks_to_swap to at most 2"):
        blockswap.low_vram(tiny_transformer(), spec, "dense")


A14B = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40, text_dim=4096,
            freq_dim=256, in_channels=36, out_channels=16, patch_size=[1, 2, 2])


def a14b_spec():
    from diffusers import WanTransformer3DModel

    from wanexp.models.wan22.memory import WanMemory

    from wanexp.models.family import ModelSpec

    spec = SimpleNamespace(trained_experts=lambda boundary: ["high"], transformer_config=lambda e: dict(A14B),
                           vae_stride=(4, 8, 8), patch=(1, 2, 2), extra_latent_frames=0, dtype=torch.bfloat16,
                           name="i2v14b", transformer_type=lambda: WanTransformer3DModel, memory_formula=WanMemory,
                           wanexp_forward=lambda fast_modulation: True, sequence_parallel=True)
    spec.meta_transformers = lambda boundary: ModelSpec.meta_transformers(spec, boundary)
    return spec


@pytest.mark.parametrize("overrides,measured", [
    (["model.blocks_to_swap=40", "model.offload_activations=true", "model.compile=false"], 18.15),
    (["model.fp8_storage=true", "model.offload_activations=true"], 26.92),
    ([], 53.20),
], ids=["swap40-offload-eager", "fp8-offload-compiled", "default-compiled"])
def test_the_estimate_matches_the_peaks_measured_on_the_a14b_expert(overrides, measured):
    """The A14B expert at 480x832x81, LoRA r32, on one H100 (benchmarks/a14b_h100_2026-11-27.md): the estimate within
    8 % of each measured peak, never more than 1 GiB under it."""
    cfg = fit_cfg("data.height=480", "data.width=832", "adapter.rank=32", *overrides)
    est = memory_plan.FitEstimate(cfg, a14b_spec())
    need = est.need(int(cfg.model.get("blocks_to_swap") or 0))
    assert abs(need - measured) / measured < 0.08 and need > measured - 1.0, (need, measured)


def fit_cfg(*overrides):
    return compose_cfg(["model=i2v14b", "boundary=high", "model.memory_budget_gib=28", "data.num_frames=81",
                        "data.batch_size=1", "data.buckets=null", "data.token_budget=null", *overrides])


def test_a_run_that_cannot_fit_is_refused_naming_the_options():
    spec = a14b_spec()
    # 480x832x81 on a 28 GiB budget: the bf16 expert alone is ~26.6 GiB, its 40 block inputs 12.5 GiB more, so even
    # every block swapped does not fit (the H100 run went out of memory): the line names the offloaded inputs
    with pytest.raises(ConfigError) as e:
        memory_plan.check_fit(fit_cfg("data.height=480", "data.width=832"), spec)
    line = str(e.value)
    assert line.startswith("model.memory_budget_gib=28: this run needs at least") and "\n" not in line
    assert "model.offload_activations=true" in line and "model.blocks_to_swap=" not in line
    offload = ("data.height=480", "data.width=832", "model.offload_activations=true")
    with pytest.raises(ConfigError) as e:
        memory_plan.check_fit(fit_cfg(*offload), spec)
    line = str(e.value)
    n = int(line.split("model.blocks_to_swap=")[1].split()[0])
    assert 0 < n < 40 and "parallel.sp_size=2" in line and "parallel=fsdp" in line
    memory_plan.check_fit(fit_cfg(*offload, f"model.blocks_to_swap={n}"), spec)
    memory_plan.check_fit(fit_cfg("data.height=480", "data.width=832", "model.memory_budget_gib=null"), spec)
    # 720x1280x81: the activations alone exceed the budget, block swap cannot make room
    with pytest.raises(ConfigError) as e:
        memory_plan.check_fit(fit_cfg("data.height=720", "data.width=1280", "model.blocks_to_swap=40"), spec)
    assert "blocks_to_swap=" not in str(e.value).split("; set ")[1] and "parallel.sp_size=2" in str(e.value)


def test_a_run_with_block_swap_and_fp8_storage_trains_and_exports(shared_dir, tmp_path, capsys):
    """Through wanexp.train.run in process: Lightning moves the module, the swapped weights stay on the host."""
    from safetensors.torch import load_file

    from tests.integration.conftest import tiny_run

    out = tmp_path / "run"
    result = tiny_run(shared_dir, out, ["data.use_cache=false", "trainer.max_steps=2", "model.blocks_to_swap=1",
                                        "model.fp8_storage=true", "model.gradient_checkpointing=true",
                                        "callbacks.validation.every_n_steps=0"])
    printed = capsys.readouterr().out
    assert "frozen linears of the dense transformer stored in FP8" in printed
    assert "model.blocks_to_swap=1: the frozen weights of 1 of 2 blocks" in printed
    swap = result["module"].transformers["dense"]._wanexp_blockswap
    assert swap.indices == [1] and swap.copies >= 1
    assert {v.dtype for v in swap.host[1]["ffn.net.2.base_layer"].values()} == {torch.float8_e4m3fn, torch.float32}
    lora = load_file(str(out / "lora" / "final" / "tiny_lora_diffusers.safetensors"))
    assert lora and all(torch.isfinite(v).all() for v in lora.values())


def test_validations_other_expert_streams_under_block_swap():
    """A one-expert A14B run with block swap: validation's other expert is swapped the same way before it moves."""
    from wanexp.callbacks.validation import _other_expert

    spec = SimpleNamespace(load_transformer=lambda name: four_blocks(), blocks_to_swap=2, fp8_storage=False,
                           blocks=lambda t: t.blocks)
    trainer = SimpleNamespace(strategy=SimpleNamespace(), world_size=1, global_rank=0)
    module = SimpleNamespace(spec=spec, parameters=lambda: iter(()), device=torch.device("cpu"))
    t, held = _other_expert(trainer, module, "low")
    assert t._wanexp_blockswap.indices == [1, 3]
    assert len([m for m in t.blocks[1].modules() if isinstance(m, blockswap.SwappedLinear)]) == 10
    assert held["bytes_here"] < sum(p.numel() * p.element_size() for p in four_blocks().parameters())


def test_a_run_that_cannot_fit_writes_nothing(tiny_overrides, tmp_path):
    """wanexp.train.run refuses before the run folder exists (the CLI prints this line and exits 2)."""
    from wanexp.train import run

    cfg = compose_cfg([*tiny_overrides, "model.gradient_checkpointing=true", "model.fast_modulation=true",
                       "model.memory_budget_gib=0.0001"])
    with pytest.raises(ConfigError, match=r"^model.memory_budget_gib=0.0001: this run needs at least .* per GPU .*; "
                                          r"set .*parallel.sp_size=2 .*parallel=fsdp"):
        run(cfg)
    assert not (tmp_path / "run").exists()


# ---- model.blocks_to_swap=auto ------------------------------------------------------------------------------------
def test_auto_picks_the_fewest_blocks_check_fit_accepts(capsys):
    """auto with a budget: the N it picks passes check_fit, N - 1 is refused (one estimator), the config and the
    spec hold N, and the start line says why."""
    spec = a14b_spec()
    shape = ("data.height=480", "data.width=832", "model.offload_activations=true")
    cfg = fit_cfg(*shape, "model.blocks_to_swap=auto", "model.path=/m", "model.compile=false")
    check_config(cfg)  # auto passes the config rules
    n = memory_plan.resolve_blocks_to_swap(cfg, spec)
    assert 0 < n < 40 and cfg.model.blocks_to_swap == n and spec.blocks_to_swap == n
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wanexp: model.blocks_to_swap=auto: {n} of 40 blocks swapped (the fewest whose weights "
                           "and least activations fit model.memory_budget_gib=28:") and f"; {n - 1} would need" in line
    eager = (*shape, "model.compile=false")
    memory_plan.check_fit(fit_cfg(*eager, f"model.blocks_to_swap={n}"), spec)
    with pytest.raises(ConfigError, match=rf"; set model.blocks_to_swap={n} "):
        memory_plan.check_fit(fit_cfg(*eager, f"model.blocks_to_swap={n - 1}"), spec)
    # compiled blocks (less recompute memory), FP8 storage or a larger budget need fewer; one that fits the whole
    # expert swaps none
    for more in (["model.compile=true"], ["model.compile=false", "model.fp8_storage=true"],
                 ["model.compile=false", "model.memory_budget_gib=34"]):
        assert memory_plan.resolve_blocks_to_swap(fit_cfg(*shape, "model.blocks_to_swap=auto", *more), spec,
                                                verbose=False) < n, more
    assert memory_plan.resolve_blocks_to_swap(fit_cfg(*shape, "model.blocks_to_swap=auto", "model.memory_budget_gib=80"),
                                            spec, verbose=False) == 0


def test_auto_that_cannot_fit_is_the_one_line_refusal_and_no_budget_on_the_cpu_swaps_none(capsys):
    spec = a14b_spec()
    with pytest.raises(ConfigError) as e:
        memory_plan.check_fit(fit_cfg("data.height=720", "data.width=1280", "model.blocks_to_swap=auto"), spec)
    line = str(e.value)
    assert line.startswith("model.memory_budget_gib=28: this run needs at least") and "\n" not in line
    assert "blocks_to_swap=" not in line.split("; set ")[1] and "parallel.sp_size=2" in line
    cfg = fit_cfg("data.height=720", "data.width=1280", "model.blocks_to_swap=auto", "model.memory_budget_gib=null",
                  "trainer.accelerator=cpu")
    assert memory_plan.resolve_blocks_to_swap(cfg, spec) == 0 and cfg.model.blocks_to_swap == 0
    assert "0 of 40 blocks swapped (no model.memory_budget_gib to size it from, and no GPU)" in capsys.readouterr().out


def test_the_fit_check_returns_the_estimate_and_a_family_without_a_formula_plans_nothing(capsys):
    """check_fit hands the pre-flight the estimate at the run's block count (what wanexp-plan reports); a family whose
    spec gives no memory formula is neither checked nor sized: auto swaps none and says why."""
    from types import SimpleNamespace as NS

    cfg = fit_cfg("data.height=480", "data.width=832", "model.blocks_to_swap=20", "model.memory_budget_gib=null")
    got = memory_plan.check_fit(cfg, a14b_spec())
    est = memory_plan.FitEstimate(cfg, a14b_spec())
    assert got == {"need_gib": est.need(20), "weights_gib": est.weights(20), "activations_gib": est.activations,
                   "tokens": est.tokens, "blocks_to_swap": 20, "blocks": 40}
    spec = NS(**{**vars(a14b_spec()), "memory_formula": lambda: None})
    cfg = fit_cfg("data.height=720", "data.width=1280", "model.blocks_to_swap=auto")  # would not fit 28 GiB
    assert memory_plan.check_fit(cfg, spec) is None and cfg.model.blocks_to_swap == 0 and spec.blocks_to_swap == 0
    assert memory_plan.resolve_blocks_to_swap(fit_cfg("model.blocks_to_swap=auto"), spec) == 0
    assert "0 blocks swapped (model=i2v14b's family gives no memory estimate)" in capsys.readouterr().out

def test_auto_without_a_budget_sizes_from_the_gpus_free_memory(monkeypatch, capsys):
    """No model.memory_budget_gib on a GPU (its free memory stood in for): 90 % of it is the budget, the same N a
    budget of that size gives; a GPU too small for every block swapped is the one-line refusal naming it."""
    spec = a14b_spec()
    monkeypatch.setattr(memory_plan, "usable_gib", lambda cfg: 30.0)
    shape = ("data.height=480", "data.width=832", "model.blocks_to_swap=auto", "model.offload_activations=true")
    n = memory_plan.resolve_blocks_to_swap(fit_cfg(*shape, "model.memory_budget_gib=null"), spec)
    assert "fit 90% of this GPU's 30.0 GiB free (27.0 GiB)" in capsys.readouterr().out
    assert n == memory_plan.resolve_blocks_to_swap(fit_cfg(*shape, "model.memory_budget_gib=27"), spec, verbose=False)
    monkeypatch.setattr(memory_plan, "usable_gib", lambda cfg: 16.0)
    with pytest.raises(ConfigError, match=r"^model.blocks_to_swap=auto on a GPU with 16.0 GiB free: this run needs at "
                                          r"least .*; set .*parallel.sp_size=2"):
        memory_plan.check_fit(fit_cfg(*shape, "model.memory_budget_gib=null"), spec)


@pytest.mark.parametrize("value,message", [
    ("-1", "model.blocks_to_swap=-1: must be >= 0"),
    ("foo", "model.blocks_to_swap=foo: must be a block count (an integer >= 0), auto"),
    ("1.5", "model.blocks_to_swap=1.5: must be a block count"),
])
def test_a_bad_blocks_to_swap_exits_2_with_one_line(value, message, tiny_overrides, tmp_path, capsys):
    from wanexp.train import cli

    with pytest.raises(SystemExit) as e:
        cli(compose_cfg([*tiny_overrides, f"model.blocks_to_swap={value}"]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"wanexp: error: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_run_with_auto_swaps_the_count_it_picked_and_records_it(shared_dir, tmp_path, capsys):
    """In process through wanexp.train.run, a four-block tiny model (2 swapped blocks are on the device at once, so
    only 3 or 4 save memory): a budget between the estimated needs of 2 and 3 swapped blocks picks 3; the run swaps
    3 blocks, prints why, and config.yaml holds 3."""
    from omegaconf import OmegaConf

    from tests.integration.conftest import tiny_run
    from wanexp.composition import build, prepare_model_folder

    four = ["model.name=tiny4", "model.build.transformer.num_layers=4", "model.blocks_to_swap=auto",
            "model.gradient_checkpointing=true"]
    # tiny_run's adapter (rank 4): the estimate counts the adapter's parameters and optimizer state
    probe = compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", "adapter.rank=4", *four])
    spec = build(probe.model)
    prepare_model_folder(spec, probe.boundary.name)
    est = memory_plan.FitEstimate(probe, spec)
    assert est.layers == 4 and est.need(3) < est.need(2) == est.need(0)
    budget = (est.need(2) + est.need(3)) / 2
    out = tmp_path / "run"
    result = tiny_run(shared_dir, out, ["data.use_cache=false", "trainer.max_steps=1", *four,
                                        f"model.memory_budget_gib={budget!r}", "callbacks.validation.every_n_steps=0"])
    printed = capsys.readouterr().out
    assert "wanexp: model.blocks_to_swap=auto: 3 of 4 blocks swapped (the fewest whose weights and least " \
           f"activations fit model.memory_budget_gib={budget:g}" in printed
    assert result["module"].transformers["dense"]._wanexp_blockswap.indices == [1, 2, 3]
    saved = OmegaConf.load(out / "config.yaml")
    assert saved.model.blocks_to_swap == 3
