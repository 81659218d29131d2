"""Numerical faults: a step with a non-finite loss or gradient is skipped and counted; K in a row stop the run with
one line and its checkpoints intact; LoRA exports holding runaway weights are flagged in status.json."""
from __future__ import annotations

import csv
import json
from pathlib import Path

# imported at collection: the log handler Lightning adds on import then holds the real stderr, not the capture of the
# first test that runs cli() in this process
import lightning.pytorch  # noqa: F401
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import compose_cfg
from tests.integration.conftest import tiny_run


def _faulty_objective(tmp_path: Path, nan_loss_at=(), nan_grad_at=()) -> list[str]:
    conf = tmp_path / "conf" / "objective"
    conf.mkdir(parents=True)
    (conf / "faulty.yaml").write_text(
        "_target_: tests.helpers.FaultyFlowMatching\nname: flow_matching\n"
        "timestep: {sampling: uniform, shift: 5.0, logit_mean: 0.0, logit_std: 1.0}\n"
        f"nan_loss_at: {list(nan_loss_at)}\nnan_grad_at: {list(nan_grad_at)}\n")
    return [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "objective=faulty"]


def _lora(out: Path, step: int) -> dict:
    return load_file(out / "lora" / f"step_{step:06d}" / "tiny_lora_comfyui.safetensors")


def test_non_finite_steps_are_skipped_counted_and_leave_the_weights_alone(shared_dir, tmp_path):
    r = tiny_run(shared_dir, tmp_path / "run", [
        *_faulty_objective(tmp_path, nan_loss_at=[2], nan_grad_at=[3]), "trainer.max_steps=4",
        "callbacks.checkpoint.every_n_train_steps=1", "callbacks.checkpoint.save_top_k=-1",
        "callbacks.lora_export.flag_above=1e-9"])  # every export is "diverged" at this threshold
    out = Path(r["output_dir"])
    assert r["global_step"] == 4 and r["module"].skipped_steps == 2
    one, two, three, four = (_lora(out, s) for s in (1, 2, 3, 4))
    assert all(torch.equal(one[k], two[k]) and torch.equal(one[k], three[k]) for k in one)  # steps 2, 3 skipped
    assert any(not torch.equal(three[k], four[k]) for k in three)  # step 4 trained
    opt = [torch.load(out / "checkpoints" / f"step_{s:06d}.ckpt", weights_only=True)["optimizer_states"][0]["state"]
           for s in (1, 3)]
    assert all(torch.equal(opt[0][i]["exp_avg"], opt[1][i]["exp_avg"]) for i in opt[0])  # moments untouched
    rows = [x for x in csv.DictReader(open(out / "logs" / "version_0" / "metrics.csv")) if x.get("train/skipped_steps")]
    assert [float(x["train/skipped_steps"]) for x in rows] == [0.0, 1.0, 2.0, 2.0]
    status = json.loads((out / "status.json").read_text())
    assert status["skipped_steps"] == 2 and status["state"] == "finished"
    assert [e["step"] for e in status["lora_flagged"]] == [1, 2, 3, 4]
    assert all(e["max_abs"] > 0 and e["files"] for e in status["lora_flagged"])
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["wanexp"]["skipped_steps"] == 2


@pytest.mark.parametrize("fused", [False, True])
def test_k_non_finite_steps_in_a_row_stop_the_run_with_one_line(shared_dir, tmp_path, capsys, fused):
    """Steps 3, 4 and 5 have a non-finite loss: the run stops at the third with one line and the weights of step 2.
    A fused AdamW skips on the device and the count is read once the step is issued, at log steps (here every step):
    the same stop."""
    from wanexp.train import cli

    cfg = compose_cfg([
        "experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
        f"paths.output_dir={tmp_path / 'run'}", "callbacks.progress=null", "trainer.max_steps=8",
        "callbacks.checkpoint.every_n_train_steps=1", "trainer.log_every_n_steps=1", "guard.max_bad_steps=3",
        f"optim.optimizer.fused={str(fused).lower()}", *_faulty_objective(tmp_path, nan_loss_at=range(3, 20))])
    with pytest.raises(SystemExit) as e:
        cli(cfg)
    assert e.value.code == 2
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("wanexp: error:")]
    assert "Traceback" not in err and len(errors) == 1
    assert errors[0].startswith("wanexp: error: 3 optimizer steps in a row had a non-finite")
    out = tmp_path / "run"
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 4 and "lora_flagged" not in status
    good = _lora(out, 2)  # the last trained step; the skipped steps 3 and 4 saved the same weights
    assert all(torch.equal(good[k], _lora(out, 4)[k]) for k in good)
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4


def test_a_corrupt_weight_file_is_one_line(shared_dir, tmp_path, capsys):
    """A truncated download: the run stops with one line naming the folder and the file, no traceback, found from
    the file's header before the run folder is made."""
    import shutil

    from wanexp.models.tiny import ensure_tiny_model
    from wanexp.composition import build
    from wanexp.train import cli

    base = ["experiment=demo", f"paths.data_dir={shared_dir}/data", f"paths.output_dir={tmp_path / 'run'}",
            "callbacks.progress=null", "trainer.max_steps=1", "data.use_cache=false"]
    ensure_tiny_model(build(compose_cfg([*base, f"paths.tiny_model_dir={shared_dir}/models"]).model))
    shutil.copytree(shared_dir / "models" / "tiny", tmp_path / "models" / "tiny")
    weights = next((tmp_path / "models" / "tiny" / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SystemExit) as e:
        cli(compose_cfg([*base, f"paths.tiny_model_dir={tmp_path / 'models'}"]))
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("wanexp: error:")]
    assert e.value.code == 2 and "Traceback" not in err and len(errors) == 1, err[-2000:]
    assert f"model.path={tmp_path / 'models' / 'tiny'}: cannot read the dense transformer" in errors[0]
    assert f"({weights.parent.name}/{weights.name}: truncated: it holds " in errors[0]
    assert "corrupt or incomplete" in errors[0] and not (tmp_path / "run").exists()


def test_a_fused_optimizer_skips_on_the_device_without_a_host_sync(shared_dir, tmp_path):
    """AdamW(fused=True) (the default on GPU; CPU has the kernel too): the skip goes through its found_inf input."""
    r = tiny_run(shared_dir, tmp_path / "run", [
        *_faulty_objective(tmp_path, nan_loss_at=[2], nan_grad_at=[3]), "trainer.max_steps=4",
        "optim.optimizer.fused=true", "callbacks.checkpoint.every_n_train_steps=1",
        "callbacks.checkpoint.save_top_k=-1", "callbacks.lora_export.keep_last=-1"])
    out = Path(r["output_dir"])
    assert r["trainer"].optimizers[0].defaults["fused"] and r["module"].skipped_steps == 2
    one, two, three, four = (_lora(out, s) for s in (1, 2, 3, 4))
    assert all(torch.equal(one[k], two[k]) and torch.equal(one[k], three[k]) for k in one)
    assert any(not torch.equal(three[k], four[k]) for k in three)
    state = torch.load(out / "checkpoints" / "step_000004.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    assert all(float(v["step"]) == 2 for v in state.values())  # two real updates
