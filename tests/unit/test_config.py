"""Every shipped config composes; bad combinations fail before anything loads, with one line naming the fix."""
from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import CONF, compose_cfg, run_cli
from wanexp.config.errors import ConfigError
from wanexp.config.validate import check_config, check_files, validate

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


ALL_OPTIONS = [(g, o) for g in GROUPS for o in options(g)]


def test_expected_groups_and_options_exist():
    assert options("model") == ["i2v14b", "t2v14b", "ti2v5b", "tiny", "tiny_i2v14b", "tiny_t2v14b"]
    assert options("boundary") == ["full", "high", "low"]
    assert options("data") == ["mbc_5k", "mbc_full", "synthetic"]
    assert options("parallel") == ["ddp", "deepspeed", "fsdp", "single"]
    assert options("logger") == ["csv", "none", "wandb"]
    assert "lora" in options("objective") and "demo" in options("experiment") and "rank_lr" in options("sweep")


def test_defaults_are_the_users_real_case():
    cfg = compose_cfg([])
    assert (cfg.model.name, cfg.boundary.name, cfg.objective.name, cfg.data.name, cfg.parallel.name) == (
        "ti2v5b", "full", "lora", "mbc_5k", "ddp")
    assert OmegaConf.is_missing(cfg.model, "path")


@pytest.mark.parametrize("group,option", ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_every_option_composes_and_resolves(group, option):
    overrides = [f"{group}={option}"]
    if group == "boundary" and option != "full":
        overrides.append("model=t2v14b")  # high/low need a two-expert model
    cfg = compose_cfg(overrides)
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    if group == "boundary" and option != "full":
        assert resolved["boundary"]["name"] == option
        assert 0.875 in (resolved["boundary"]["sigma_min"], resolved["boundary"]["sigma_max"])
    if group == "model" and option.startswith("tiny"):
        check_config(cfg)  # tiny models carry their own path and sizes that fit the synthetic data
    if group == "sweep":
        assert cfg.sweep.name == option


def test_sweep_grid_is_rank_by_lr():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", ["sweep=rank_lr"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert params["objective.lora.rank"] == "16,32,64" and params["objective.optim.lr"] == "5e-5,1e-4"


def test_a14b_boundaries_interpolate_from_the_model():
    assert compose_cfg(["model=t2v14b", "boundary=high"]).boundary.sigma_min == 0.875
    assert compose_cfg(["model=i2v14b", "boundary=low"]).boundary.sigma_max == 0.9
    i2v = compose_cfg(["model=i2v14b"]).model
    assert (i2v.shift, i2v._target_) == (5.0, "wanexp.models.spec.I2VA14BSpec")


BAD = [
    (["model=ti2v5b", "boundary=low"], "boundary=low with model=ti2v5b", "use boundary=full"),
    (["model=ti2v5b", "boundary=high"], "boundary=high with model=ti2v5b", "model=i2v14b|t2v14b"),
    (["data.num_frames=16"], "data.num_frames=16", "4k+1"),
    (["data.height=700"], "data.height=700", "multiple of 32"),
    (["model=t2v14b", "data.width=840"], "data.width=840", "multiple of 16"),
    (["model.dtype=fp8"], "model.dtype=fp8", "bf16, fp16, fp32"),
    (["model.attention_backend=fast"], "model.attention_backend=fast", "native"),
    (["model.attention_backend=flash_hub"], "model.attention_backend=flash_hub", "download kernels"),
    (["objective.lora.targets=[q,qkv]"], "objective.lora.targets", "allowed: q, k, v, o, ffn.0, ffn.2"),
    (["objective.lora.attention=[self,both]"], "objective.lora.attention", "self, cross"),
    (["objective.lora.rank=0"], "objective.lora.rank=0", "positive integer"),
    (["objective.timestep.sampling=beta"], "objective.timestep.sampling=beta", "uniform, logit_normal"),
    (["objective.optim.scheduler=step"], "objective.optim.scheduler=step", "constant, cosine, linear"),
    (["trainer.precision=16-mixed"], "trainer.precision=16-mixed", "bf16-mixed"),
    (["parallel=fsdp", "trainer.accelerator=cpu"], "parallel=fsdp with trainer.accelerator=cpu", "parallel=ddp"),
]


@pytest.mark.parametrize("overrides,key,fix", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_combinations_name_key_and_fix(overrides, key, fix):
    cfg = compose_cfg(["model.path=/somewhere", *overrides])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    msg = str(e.value)
    assert key in msg and fix in msg and "\n" not in msg


def test_missing_model_path_is_named():
    with pytest.raises(ConfigError, match="model.path is not set"):
        check_config(compose_cfg([]))


def test_model_folder_checks(tmp_path):
    with pytest.raises(ConfigError, match="folder not found"):
        check_files(compose_cfg([f"model.path={tmp_path}/nope"]))
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match="no model_index.json"):
        check_files(compose_cfg([f"model.path={tmp_path}/m"]))


def _fake_folder(root, subfolders, in_channels=16):
    root.mkdir()
    (root / "model_index.json").write_text("{}")
    for s in subfolders:
        (root / s).mkdir()
        name = "tokenizer_config.json" if s == "tokenizer" else "config.json"
        (root / s / name).write_text(json.dumps({"in_channels": in_channels}))
    return root


def test_high_noise_run_needs_only_the_high_expert(tmp_path):
    folder = _fake_folder(tmp_path / "t2v", ["transformer", "vae", "text_encoder", "tokenizer"])
    data = tmp_path / "meta.csv"
    data.write_text("video,prompt\na.mp4,x\n")
    check_files(compose_cfg(["model=t2v14b", "boundary=high", f"model.path={folder}", f"data.metadata={data}"]))
    with pytest.raises(ConfigError, match="transformer_2/"):
        check_files(compose_cfg(["model=t2v14b", "boundary=low", f"model.path={folder}", f"data.metadata={data}"]))
    with pytest.raises(ConfigError, match="transformer_2/"):
        check_files(compose_cfg(["model=t2v14b", "boundary=full", f"model.path={folder}", f"data.metadata={data}"]))


def test_wrong_layout_folder_is_caught(tmp_path):
    folder = _fake_folder(tmp_path / "t2v", ["transformer", "transformer_2", "vae", "text_encoder", "tokenizer"])
    with pytest.raises(ConfigError, match="in_channels=16 but model=i2v14b expects 36"):
        check_files(compose_cfg(["model=i2v14b", f"model.path={folder}"]))


def test_missing_metadata_and_resume(tmp_path):
    folder = _fake_folder(tmp_path / "m", ["transformer", "vae", "text_encoder", "tokenizer"], in_channels=48)
    with pytest.raises(ConfigError, match="data.metadata=.*file not found.*data=synthetic"):
        validate(compose_cfg([f"model.path={folder}", f"data.metadata={tmp_path}/missing.csv"]))
    meta = tmp_path / "meta.csv"
    meta.write_text("video,prompt\na.mp4,x\n")
    with pytest.raises(ConfigError, match="resume=.*checkpoint file not found"):
        validate(compose_cfg([f"model.path={folder}", f"data.metadata={meta}", f"resume={tmp_path}/x.ckpt"]))


@pytest.mark.parametrize("args,needle", [
    (["model=ti2v5b", "boundary=low", "model.path=/nowhere"], "boundary=low with model=ti2v5b"),
    (["model.path=/nowhere/Wan2.2-TI2V-5B"], "model.path=/nowhere/Wan2.2-TI2V-5B: folder not found"),
    (["experiment=demo", "data.num_frames=8"], "data.num_frames=8: must be 4k+1"),
])
def test_cli_bad_input_exits_2_with_one_line(args, needle, tmp_path):
    res = run_cli([*args, f"paths.output_dir={tmp_path}/run"], timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("wanexp: error:")]
    assert len(errors) == 1 and needle in errors[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fresh_run_refuses_a_folder_with_checkpoints(tmp_path):
    folder = _fake_folder(tmp_path / "m", ["transformer", "vae", "text_encoder", "tokenizer"], in_channels=48)
    meta = tmp_path / "meta.csv"
    meta.write_text("video,prompt\na.mp4,x\n")
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step_000010.ckpt").write_bytes(b"x")
    base = [f"model.path={folder}", f"data.metadata={meta}", f"paths.output_dir={out}"]
    with pytest.raises(ConfigError, match="already holds checkpoints.*resume=last.*overwrite=true"):
        validate(compose_cfg(base))
    validate(compose_cfg([*base, "resume=last"]))
    validate(compose_cfg([*base, "overwrite=true"]))
