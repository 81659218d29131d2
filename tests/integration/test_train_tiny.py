"""End-to-end LoRA training of tiny models of each layout through the real loading and training path."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import tiny_run
from wanexp.models.wan22.spec import WanSpec

EXPECTED_FILES = {
    "tiny": ["tiny_lora_comfyui.safetensors", "tiny_lora_diffusers.safetensors"],
    "tiny_t2v14b": [f"tiny_t2v14b_lora_{e}_noise_{f}.safetensors" for e in ("high", "low") for f in ("comfyui", "diffusers")],
    "tiny_i2v14b": [f"tiny_i2v14b_lora_{e}_noise_{f}.safetensors" for e in ("high", "low") for f in ("comfyui", "diffusers")],
}


@pytest.mark.parametrize("name", list(EXPECTED_FILES))
def test_run_writes_everything_under_output_dir(trained, name):
    r = trained(name)
    out = Path(r["output_dir"])
    assert r["global_step"] == 4
    assert sorted(p.name for p in (out / "lora" / "final").iterdir()) == sorted(EXPECTED_FILES[name])
    # LoRA files with every checkpoint, and the checkpoints themselves
    assert sorted(p.name for p in (out / "lora").iterdir()) == ["final", "step_000002", "step_000004"]
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["last.ckpt", "step_000002.ckpt", "step_000004.ckpt"]
    assert (out / "config.yaml").is_file()
    assert (out / "loss.png").stat().st_size > 0  # the loss curve (wanexp.callbacks.loss_plot)
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 4 and status["loss"] > 0
    rows = list(csv.DictReader(open(out / "logs" / "version_0" / "metrics.csv")))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert any(r.get("perf/samples_per_s") for r in rows) and any(r.get("train/lr") for r in rows)
    waits = [float(r["perf/loader_wait_frac"]) for r in rows if r.get("perf/loader_wait_frac")]
    assert waits and all(0 <= w < 1 for w in waits)
    tflops = [float(r["perf/tflops"]) for r in rows if r.get("perf/tflops")]
    assert len(tflops) == 4 and all(t > 0 for t in tflops)


def test_two_expert_run_routes_samples_by_sigma(trained):
    r = trained("tiny_t2v14b")
    module = r["module"]
    assert list(module.transformers) == ["high", "low"]
    rows = list(csv.DictReader(open(Path(r["output_dir"]) / "logs" / "version_0" / "metrics.csv")))
    seen = {k for row in rows for k, v in row.items() if v and k.startswith("train/loss_")}
    assert {"train/loss_high", "train/loss_low"} & seen  # per-expert losses are logged
    # both experts trained: each got gradients from the samples routed to it
    for expert, transformer in module.transformers.items():
        assert any(p.abs().max() > 0 for n, p in transformer.named_parameters() if "lora_B" in n), expert


@pytest.mark.parametrize("name", list(EXPECTED_FILES))
def test_only_lora_trains_and_base_weights_are_bitwise_unchanged(trained, name):
    r = trained(name)
    module, trainer = r["module"], r["trainer"]
    opt_params = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    lora_params = {id(p) for n, p in module.named_parameters() if "lora_" in n}
    assert opt_params == lora_params and len(lora_params) > 0
    for expert, transformer in module.transformers.items():
        fresh = module.spec.load_transformer(expert)
        fresh_sd = fresh.state_dict()
        trained_base = {k.replace(".base_layer", ""): v for k, v in transformer.state_dict().items() if "lora_" not in k}
        assert set(trained_base) == set(fresh_sd)
        for k, v in fresh_sd.items():
            assert torch.equal(v, trained_base[k]), k
        moved = [p for n, p in transformer.named_parameters() if "lora_B" in n]
        assert any(p.abs().max() > 0 for p in moved)  # B starts at zero: the LoRA did train


def test_checkpoint_holds_lora_weights_only(trained):
    r = trained("tiny")
    ckpt = torch.load(Path(r["output_dir"]) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    keys = list(ckpt["state_dict"])
    assert keys and all("lora_" in k for k in keys)
    assert {k: ckpt["wanexp"][k] for k in ("model", "experts", "boundary")} == {"model": "tiny", "experts": ["dense"], "boundary": "full"}
    assert ckpt["wanexp"]["fixed"]["adapter.rank"] == 4 and ckpt["wanexp"]["schedule"]["adapter.alpha"] == 2.0
    assert ckpt["global_step"] == 4 and ckpt["optimizer_states"]


def test_resume_last_continues_from_the_checkpoint(trained, shared_dir):
    first = trained("tiny")
    out = Path(first["output_dir"]).parent / "resumed"
    shutil.copytree(first["output_dir"], out)
    before = {n: p.detach().clone() for n, p in first["module"].named_parameters() if p.requires_grad}
    # resuming at the checkpoint's own step restores its LoRA weights exactly (not a fresh zero-B init)
    same = tiny_run(shared_dir, out, ["model=tiny", "resume=last", "trainer.max_steps=4"])
    assert same["global_step"] == 4
    after = {n: p.detach() for n, p in same["module"].named_parameters() if p.requires_grad}
    assert set(after) == set(before) and all(torch.equal(before[n], after[n]) for n in before)
    more = tiny_run(shared_dir, out, ["model=tiny", "resume=last", "trainer.max_steps=6", "allow_resume_changes=true"])
    assert more["global_step"] == 6
    assert json.loads((out / "status.json").read_text())["step"] == 6
    # the first session's metrics survive; each resumed session logs beside them
    first_rows = list(csv.DictReader(open(out / "logs" / "version_0" / "metrics.csv")))
    resumed_rows = list(csv.DictReader(open(out / "logs" / "version_2" / "metrics.csv")))
    assert {int(r["step"]) for r in first_rows} >= {0, 3} and max(int(r["step"]) for r in resumed_rows) == 5


def test_high_noise_run_loads_only_the_high_expert(shared_dir, tmp_path):
    base = Path(shared_dir) / "models" / "tiny_i2v14b"
    if not base.exists():
        tiny_run(shared_dir, tmp_path / "warm", ["model=tiny_i2v14b", "trainer.max_steps=1"])
    folder = tmp_path / "only_high"
    shutil.copytree(base, folder, ignore=shutil.ignore_patterns(WanSpec.expert_folders["low"]))
    r = tiny_run(shared_dir, tmp_path / "run", ["model=tiny_i2v14b", "boundary=high", f"model.path={folder}",
                                                "model.build=null", "trainer.max_steps=2"])
    assert list(r["module"].transformers) == ["high"]
    files = sorted(p.name for p in (Path(r["output_dir"]) / "lora" / "final").iterdir())
    assert files == ["tiny_i2v14b_lora_high_noise_comfyui.safetensors", "tiny_i2v14b_lora_high_noise_diffusers.safetensors"]


def test_mixed_precision_accumulation_and_clipping(shared_dir, tmp_path):
    r = tiny_run(shared_dir, tmp_path / "run", [
        "model=tiny", "trainer.precision=bf16-mixed", "trainer.accumulate_grad_batches=2",
        "trainer.gradient_clip_val=0.5", "model.gradient_checkpointing=true", "objective.timestep.sampling=logit_normal",
        "trainer.max_steps=2"])
    assert r["global_step"] == 2
    status = json.loads((Path(r["output_dir"]) / "status.json").read_text())
    assert status["state"] == "finished" and status["accumulate_grad_batches"] == 2
    assert status["steps_per_epoch"] == 3  # 4 video batches + 1 image batch of 2, accumulated by 2 -> ceil(5/2)


def test_bf16_true_with_lora_dropout_and_attention_backend(shared_dir, tmp_path):
    r = tiny_run(shared_dir, tmp_path / "run", ["model=tiny", "trainer.precision=bf16-true", "adapter.dropout=0.1",
                                                "model.attention_backend=native", "trainer.max_steps=2"])
    assert r["global_step"] == 2
    assert all(p.dtype == torch.bfloat16 for n, p in r["module"].named_parameters() if "lora_" in n)


def test_init_from_an_exported_lora_file(trained, shared_dir, tmp_path):
    """adapter.init_from starts from a ComfyUI or diffusers file; a different alpha is folded into B."""
    src = trained("tiny")
    final = Path(src["output_dir"]) / "lora" / "final"
    trained_sd = {n: p.detach().clone() for n, p in src["module"].named_parameters() if "lora_" in n}
    for fmt, alpha, factor in (("comfyui", 2, 1.0), ("diffusers", 4, 0.5)):
        r = tiny_run(shared_dir, tmp_path / fmt, [
            "model=tiny", f"adapter.init_from={final}/tiny_lora_{fmt}.safetensors", f"adapter.alpha={alpha}",
            "optim.lr=1e-12", "trainer.max_steps=1"])
        got = {n: p.detach() for n, p in r["module"].named_parameters() if "lora_" in n}
        assert set(got) == set(trained_sd)
        for n, v in trained_sd.items():
            want = v * factor if "lora_B" in n else v
            assert torch.allclose(got[n], want, atol=1e-6), (fmt, n)


def test_init_from_with_another_rank_is_refused(trained, shared_dir, tmp_path):
    from wanexp.errors import ConfigError

    final = Path(trained("tiny")["output_dir"]) / "lora" / "final"
    with pytest.raises(ConfigError, match="file has rank 4, run has rank 8; set adapter.rank=4"):
        tiny_run(shared_dir, tmp_path / "r", ["model=tiny", "adapter.rank=8",
                                              f"adapter.init_from={final}/tiny_lora_comfyui.safetensors"])


def test_missing_media_files_fail_before_weights_load(shared_dir, tmp_path):
    from wanexp.data.metadata import MetadataError

    meta = tmp_path / "meta.csv"
    meta.write_text("video,prompt\nclips/nowhere.mp4,a red circle\n")
    with pytest.raises(MetadataError, match="1 of 1 samples rejected.*file not found.*data.root"):
        tiny_run(shared_dir, tmp_path / "r", ["model=tiny", f"data.metadata={meta}", "data.generate=null"])


def test_resume_refuses_other_settings_with_one_line(trained, shared_dir, tmp_path):
    from wanexp.errors import ConfigError

    first = trained("tiny")
    out = tmp_path / "again"
    shutil.copytree(first["output_dir"], out)
    with pytest.raises(ConfigError, match=r"^resume: adapter.rank=4 in the checkpoint, 8 now: the checkpoint's weights "
                                          r"have another layout"):
        tiny_run(shared_dir, out, ["model=tiny", "resume=last", "adapter.rank=8"])
    with pytest.raises(ConfigError, match=r"^resume: adapter.alpha=2.0 in the checkpoint, 4.0 now; trainer.max_steps=4 "
                                          r"in the checkpoint, 5 now; .*allow_resume_changes=true"):
        tiny_run(shared_dir, out, ["model=tiny", "resume=last", "adapter.alpha=4", "trainer.max_steps=5"])
    r = tiny_run(shared_dir, out, ["model=tiny", "resume=last", "trainer.max_steps=5", "allow_resume_changes=true"])
    assert r["global_step"] == 5
