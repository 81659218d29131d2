"""Multi-process strategies on CPU (gloo) through ``python train.py``, as a user runs them:

- FSDP2 with activation checkpointing and bf16-mixed trains and resumes, also under FSDP2 as torch <= 2.11 had it
  (no input cast while a checkpointed block is recomputed: the CheckpointError a 4-GPU A14B run hit);
- sequence parallel (fsdp, sp=2, checkpointing) trains the same LoRA as one process with sp=1;
- the data-parallel split under sequence parallel (4 processes, dp=2 x sp=2): both ranks of a sequence group get
  the same samples, the two groups disjoint ones.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import compose_cfg, run_cli
from tests.helpers import CliRun
from wanexp.train import run

FAULTS = str(Path(__file__).resolve().parents[1] / "faults")
pytestmark = pytest.mark.slow  # every test here starts train.py processes


def _base(shared_dir, out, steps=4):
    return ["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
            f"paths.output_dir={out}", "data.use_cache=false", f"trainer.max_steps={steps}",
            "callbacks.progress=null", "trainer.log_every_n_steps=1", "optim.warmup_steps=0"]


def _status(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


def test_fsdp_with_checkpointing_and_bf16_trains_and_resumes(shared_dir, tmp_path):
    """Also: free host memory (reported as 1 byte) cannot hold two copies of the base, so the two ranks load and
    shard it one after the other (module.load_turns)."""
    out, loads = tmp_path / "run", tmp_path / "loads.txt"
    args = _base(shared_dir, out) + [
        "parallel=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "parallel.strategy.timeout_s=120",
        "model.gradient_checkpointing=true", "trainer.precision=bf16-mixed", "model.dtype=bf16",
        "callbacks.checkpoint.every_n_train_steps=2"]
    env = {"PYTHONPATH": FAULTS, "WANEXP_TEST_FSDP_NO_RECOMPUTE_CAST": "1", "WANEXP_TEST_FREE_HOST_BYTES": "1",
           "WANEXP_TEST_LOAD_LOG": str(loads)}
    res = run_cli(args, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _status(out)["step"] == 4 and _status(out)["world_size"] == 2
    assert "loading the base in 2 turns of 1 rank(s) per node" in res.stdout + res.stderr
    turns = sorted(tuple(map(float, line.split()[1:])) for line in loads.read_text().splitlines())
    assert len(turns) == 2 and turns[0][1] <= turns[1][0]  # the second rank began after the first had finished
    res = run_cli([a.replace("trainer.max_steps=4", "trainer.max_steps=6") for a in args] + ["resume=last", "allow_resume_changes=true"],
                  timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    status = _status(out)
    assert status["state"] == "finished" and status["step"] == 6
    lora = load_file(str(out / "lora" / "final" / "tiny_lora_diffusers.safetensors"))
    assert all(torch.isfinite(v).all() for v in lora.values())
    assert any(v.abs().max() > 0 for k, v in lora.items() if "lora_B" in k)


def test_sequence_parallel_trains_the_one_process_lora(shared_dir, tmp_path):
    common = ["model.gradient_checkpointing=true", "optim.lr=1e-2", "trainer.max_steps=3"]
    one, two = tmp_path / "one", tmp_path / "sp2"
    # with load turns (free host memory reported as 1 byte): the sequence groups are made by every rank, outside
    # the turns (a rank making them inside its turn waited for the others, who waited for its turn to end)
    sp2 = CliRun(_base(shared_dir, two) + common + [
        "parallel=fsdp", "parallel.strategy.param_dtype=fp32", "parallel.sp_size=2", "trainer.accelerator=cpu",
        "trainer.devices=2", "parallel.strategy.timeout_s=60"], tmp_path / "sp2_log",
        env={"PYTHONPATH": FAULTS, "WANEXP_TEST_FREE_HOST_BYTES": "1"})
    run(compose_cfg(_base(shared_dir, one) + common))  # the one-process reference, here while sp2 starts
    res = sp2.result(timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "1 data-parallel rank(s) of 2 device(s) each" in res.stdout
    assert "loading the base in 2 turns of 1 rank(s) per node" in res.stdout
    a = load_file(str(one / "lora" / "final" / "tiny_lora_diffusers.safetensors"))
    b = load_file(str(two / "lora" / "final" / "tiny_lora_diffusers.safetensors"))
    assert a.keys() == b.keys()
    moved = [k for k in a if "lora_B" in k and a[k].abs().max() > 0]
    assert moved
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5, msg=k)  # Adam amplifies fp32 reduction-order noise


def test_sequence_groups_share_samples_and_data_groups_split_them(shared_dir, tmp_path):
    out, rec = tmp_path / "run", tmp_path / "batches"
    res = run_cli(_base(shared_dir, out, steps=2) + [
        "parallel=ddp", "parallel.sp_size=2", "trainer.accelerator=cpu", "trainer.devices=4",
        "parallel.strategy.timeout_s=120", "data.batch_size=1",
        "+callbacks.recorder._target_=tests.helpers.BatchRecorder", f"+callbacks.recorder.path={rec}"], timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = {r: [json.loads(line)["index"] for line in Path(f"{rec}.rank{r}").read_text().splitlines()]
            for r in range(4)}
    assert all(len(seen[r]) == 2 for r in range(4))
    assert seen[0] == seen[1] and seen[2] == seen[3]  # one sequence group: the same samples
    assert not {i for b in seen[0] for i in b} & {i for b in seen[2] for i in b}  # two data-parallel ranks: disjoint


def test_fsdp_runs_the_same_expert_on_every_rank_each_step(shared_dir, tmp_path):
    """Two A14B experts sharded by FSDP: a rank running one expert while another ran the other would pair their
    (same-shaped) weight all-gathers and mix the experts silently. Each step all ranks must run the same experts,
    and over the run both experts train."""
    out, rec = tmp_path / "run", tmp_path / "experts"
    res = run_cli(_base(shared_dir, out, steps=8) + [
        "model=tiny_t2v14b", "boundary=full", "parallel=fsdp", "parallel.strategy.param_dtype=fp32",
        "trainer.accelerator=cpu", "trainer.devices=2", "data.batch_size=1", "parallel.strategy.timeout_s=120",
        "+callbacks.probe._target_=tests.helpers.ExpertProbe", f"+callbacks.probe.path={rec}"], timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r: [json.loads(line) for line in Path(f"{rec}.rank{r}").read_text().splitlines()] for r in range(2)}
    runs = {r: [row["experts"] for row in rows[r]] for r in range(2)}
    assert len(runs[0]) == 8 and runs[0] == runs[1]
    # the forced expert is the step's only: validation's held-out loss after a step routes per sample again
    assert all(row["routing_after_step"] is None for r in range(2) for row in rows[r])
    assert all(len(e) == 1 for e in runs[0]) and {e[0] for e in runs[0]} == {"high", "low"}
    assert len(list((out / "lora" / "final").glob("*.safetensors"))) == 4


SP_REFUSED = [
    (3, [], "2 attention heads do not divide by 3"),
]


def _cli_here(monkeypatch, capsys, args: list[str]) -> tuple[object, str, str]:
    """``python train.py ARGS``'s entry (wanexp.train.main) in this process, for a command refused before Lightning
    starts: its exit code, stdout and stderr. As in a fresh process, each warning prints to stderr (pytest would
    collect it) under Python's default filters and the entry's own, shown anew; what the run sets in os.environ
    (HYDRA_FULL_ERROR, parallel.env) is undone. A command that reaches Lightning's launcher raises there (exit 1,
    a traceback) instead of starting ranks from this process."""
    import os
    import sys
    import warnings

    from hydra.core.global_hydra import GlobalHydra

    from tests.integration.test_cli_runs import _entry
    from wanexp.composition import quiet_warnings

    def launch(*_, **__):
        raise RuntimeError("the command reached Lightning's launcher: it was not refused before the ranks start")

    monkeypatch.setattr("lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher.launch",
                        launch)
    environ, code = dict(os.environ), 0
    main = _entry(monkeypatch, capsys, args)
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
            warnings.simplefilter("ignore", category)  # python's defaults (the last added comes first)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        quiet_warnings()
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        try:
            main()
        except SystemExit as e:
            code = e.code
        finally:
            os.environ.clear()
            os.environ.update(environ)
            GlobalHydra.instance().clear()
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_shape_that_does_not_split_over_the_sequence_group_fails_before_loading(shared_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    """Each row through python train.py's entry in this process: both checks run in the launching process, before
    Lightning starts the others (so no process of its own is needed)."""
    for sp, extra, message in SP_REFUSED:
        code, out, err = _cli_here(monkeypatch, capsys, _base(shared_dir, tmp_path / f"run{sp}", steps=2) + [
            "parallel=ddp", f"parallel.sp_size={sp}", "trainer.accelerator=cpu", f"trainer.devices={sp}", *extra])
        assert code == 2, (sp, err[-2000:])
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and message in lines[0], err[-2000:]
        assert "Loading" not in out + err and "Traceback" not in err


def test_one_expert_validation_under_fsdp_shards_the_other_expert(shared_dir, tmp_path):
    """A one-expert A14B run samples its validation videos with the other expert from model.path: under FSDP2 every
    rank samples, so that expert is sharded too (each rank holds half of it here), loaded in the load turns. The three
    videos are shared out (rank 1 pads its one with a dropped second call: sharded forwards are collective) and rank 0
    writes them all."""
    from tests.conftest import compose_cfg
    from wanexp.models.tiny import ensure_tiny_model
    from wanexp.composition import build

    out = tmp_path / "run"
    res = run_cli(_base(shared_dir, out, steps=2) + [
        "model=tiny_i2v14b", "boundary=high", "parallel=fsdp", "parallel.strategy.param_dtype=fp32",
        "trainer.accelerator=cpu", "trainer.devices=2", "parallel.strategy.timeout_s=120",
        "callbacks.validation.every_n_steps=2", "callbacks.validation.at_start=false",
        "callbacks.validation.prompts=[a red ball rolls]", "callbacks.validation.seeds=[0,1,2]",
        "callbacks.validation.steps=2", "callbacks.validation.loss_samples=0", "parallel.concurrent_loads=1"],
        timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    for seed in (0, 1, 2):
        assert (out / "validation" / "step_000002" / f"p0_s{seed}.mp4").is_file()
    saved = json.loads((out / "validation" / "step_000002" / "metrics.json").read_text())
    assert saved["sampled_by"] == {"p0_s0": 0, "p0_s1": 1, "p0_s2": 0}
    assert "loading validation's low expert in 2 turns of 1 rank(s) per node" in res.stdout
    assert "wanexp: validation: the low expert from model.path, sharded over 2 ranks" in res.stdout
    other = json.loads((out / "validation" / "step_000002" / "metrics.json").read_text())["other_expert"]
    assert other["name"] == "low" and other["sharded_over"] == 2
    held = other["bytes_here"]  # rank 0's shards
    spec = build(compose_cfg(["model=tiny_i2v14b", f"paths.tiny_model_dir={shared_dir}/models"]).model)
    ensure_tiny_model(spec)
    whole = sum(p.numel() * p.element_size() for p in spec.load_transformer("low").parameters())
    assert abs(held - whole / 2) < 0.02 * whole, (held, whole)


def test_ddp_validation_samples_on_every_rank(shared_dir, tmp_path):
    """Under DDP each rank samples its share of the validation videos with its own replica (prompt k on rank k mod
    2) at the same time, and rank 0 writes and logs every one."""
    out = tmp_path / "run"
    res = run_cli(_base(shared_dir, out, steps=2) + [
        "parallel=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "parallel.strategy.timeout_s=120",
        "callbacks.validation.every_n_steps=2", "callbacks.validation.at_start=false",
        "callbacks.validation.prompts=[a red ball rolls,a blue cube spins]", "callbacks.validation.seeds=[0]",
        "callbacks.validation.steps=2", "callbacks.validation.loss_samples=0"], timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    step = out / "validation" / "step_000002"
    assert (step / "p0_s0.mp4").is_file() and (step / "p1_s0.mp4").is_file()
    saved = json.loads((step / "metrics.json").read_text())
    assert saved["sampled_by"] == {"p0_s0": 0, "p1_s0": 1}
    assert list(saved["videos"]) == ["val/video/p0_s0", "val/video/p1_s0"]
