"""Every shipped config composes against its schema; bad values and combinations fail before anything loads, in one
line that names the key, the value and what is allowed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import CONF, compose_cfg, run_cli, run_cli_batch
from wanexp.config import check_config, check_paths, compose
from wanexp.config.schema import SCHEMAS, check_schema
from wanexp.errors import ConfigError
from wanexp.models.wan22.spec import TI2VSpec

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


ALL_OPTIONS = [(g, o) for g in GROUPS for o in options(g)]


@pytest.mark.parametrize("group,option", ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_every_option_composes_and_passes_its_schema(group, option):
    overrides = [f"{group}={option}", "model.path=/somewhere"]
    if group == "boundary" and option != "full":
        overrides.append("model=t2v14b")  # high/low need a two-expert model
    if group == "parallel" and option in ("fsdp", "deepspeed"):
        overrides.append("trainer.accelerator=gpu")
    if group == "data" and option in ("folder", "csv"):  # the templates of the user's data: its path is required
        overrides.append("data.metadata=/somewhere")
    cfg = compose_cfg(overrides)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    check_schema(cfg)
    if group != "parallel" or option != "deepspeed":  # the deepspeed rule needs the package (checked below)
        check_config(cfg)


def test_every_group_node_is_typed_by_a_schema():
    cfg = compose_cfg(["model.path=/m"])
    typed = {name: OmegaConf.get_type(cfg[name]).__name__ for name in
             ("model", "boundary", "adapter", "objective", "optim", "data", "parallel", "trainer", "paths")}
    assert typed == {"model": "ModelConfig", "boundary": "BoundaryConfig", "adapter": "LoraConfig",
                     "objective": "FlowMatchingConfig", "optim": "OptimConfig", "data": "DataConfig",
                     "parallel": "ParallelConfig", "trainer": "TrainerConfig", "paths": "PathsConfig"}
    assert OmegaConf.get_type(cfg.callbacks.checkpoint).__name__ == "CheckpointConfig"
    assert OmegaConf.get_type(cfg.parallel.strategy).__name__ == "DDPConfig"
    assert set(SCHEMAS) >= {"model", "optim", "adapter/lora", "objective/flow_matching", "trainer"}


def test_a14b_boundaries_interpolate_from_the_model():
    assert compose_cfg(["model=t2v14b", "boundary=high"]).boundary.sigma_min == 0.875
    assert compose_cfg(["model=i2v14b", "boundary=low"]).boundary.sigma_max == 0.9


def test_sweep_grid_varies_adapter_rank_and_optim_lr():
    params = compose(["sweep=rank_lr"], return_hydra_config=True).hydra.sweeper.params
    assert set(params) == {"adapter.rank", "optim.lr"}
    compose_cfg([f"{k}={v.split(',')[0]}" for k, v in params.items()])  # each swept key exists in the schema


BAD = [
    (["model=ti2v5b", "boundary=low"], "boundary=low with model=ti2v5b", "use boundary=full"),
    (["model=ti2v5b", "boundary=high"], "boundary=high with model=ti2v5b", "model=i2v14b|t2v14b"),
    (["data.num_frames=16"], "data.num_frames=16", "4k+1"),
    (["data.height=700"], "data.height=700", "multiple of 32"),
    (["model=t2v14b", "data.width=840"], "data.width=840", "multiple of 16"),
    (["model.dtype=fp8"], "model.dtype=fp8", "allowed values are bf16, fp16, fp32"),
    (["adapter.rank=0"], "adapter.rank=0", "must be >= 1"),
    (["adapter.dropout=1.0"], "adapter.dropout=1.0", "must be >= 0.0 and < 1.0"),
    (["objective.timestep.sampling=beta"], "objective.timestep.sampling=beta", "uniform, logit_normal"),
    (["optim.scheduler=step"], "optim.scheduler=step", "constant, cosine, linear"),
    (["optim.lr=1e38"], "optim.lr=1e+38", "must be > 0.0 and <= 1.0"),
    (["optim.lr=0"], "optim.lr=0.0", "must be > 0.0"),
    (["optim.lr_scaling=cubic"], "optim.lr_scaling=cubic", "none, linear, sqrt"),
    (["data.num_workers=-1"], "data.num_workers=-1", "must be >= 0"),
    (["trainer.max_steps=0"], "trainer.max_steps=0: trains no step", "-1 with trainer.max_epochs=N"),
    (["trainer.max_steps=-1"], "trainer.max_steps=-1 with trainer.max_epochs=null", "trainer.max_epochs=N"),
    (["trainer.precision=16-true"], "trainer.precision=16-true", "bf16-mixed, bf16-true, 16-mixed"),
    (["model.experts=[dense,mid]"], "model.experts: unknown value 'mid'", "dense, high, low"),
    (["callbacks.checkpoint.save_top_k=-2"], "callbacks.checkpoint.save_top_k=-2", ">= -1"),
    (["parallel=single", "parallel.sp_size=2"], "parallel.sp_size=2 with parallel=single", "parallel=ddp or parallel=fsdp"),
    (["parallel=ddp", "parallel.sp_size=2", "model.fast_modulation=false"], "parallel.sp_size=2 needs",
     "model.fast_modulation=true"),
    (["parallel=fsdp", "parallel.sp_size=2", "trainer.devices=3"], "parallel.sp_size=2 with 3 device(s)",
     "multiple of 2"),
    (["parallel=ddp", "parallel.sp_size=2", "objective=dmd"], "parallel.sp_size=2 with objective=dmd",
     "parallel.sp_size=1"),
    (["parallel.sp_size=0"], "parallel.sp_size=0", ">= 1"),
    (["parallel=ddp", "parallel.sp_size=2", "objective=kd", "objective.feature_weight=0.5"],
     "parallel.sp_size=2 with objective.feature_weight=0.5", "objective.feature_weight=0"),
    (["objective=dmd", "parallel=fsdp", "model=t2v14b", "boundary=full", "trainer.accelerator=gpu"],
     "objective=dmd with parallel=fsdp and model=t2v14b boundary=full", "boundary=high|low"),
    (["parallel=fsdp", "parallel.strategy.sharding_strategy=NO_SHARD", "trainer.accelerator=gpu"],
     "parallel.strategy.sharding_strategy=NO_SHARD", "FULL_SHARD, SHARD_GRAD_OP"),
    (["model.fp8=true", "parallel=fsdp", "trainer.precision=bf16-mixed"], "model.fp8=true with parallel=fsdp",
     "parallel=ddp"),
    (["model.fp8=true", "trainer.precision=32"], "model.fp8=true with trainer.precision=32", "bf16-mixed"),
    (["+callbacks.extra._target_=nowhere_pkg.Callback"], "callbacks.extra._target_=nowhere_pkg.Callback",
     "not installed"),
    (["model=tiny", "data.buckets=[[64,112],[112,64],[96,96]]"], "data.buckets[0]=[64, 112]: height and width "
     "must be multiples of 32 for model=tiny", "e.g. [64, 96] or [64, 128]"),
    (["model=t2v14b", "data.buckets=[[480,832],[840,480]]"], "data.buckets[1]=[840, 480]", "[832, 480] or [848, 480]"),
    (["data.buckets=[[704]]"], "data.buckets[0]=[704]", "each bucket is [height, width]"),
    (["data.buckets=[[704,1280],[1280,704]]", "data.token_budget=4000"],
     "data.token_budget=4000: one sample of the data.buckets entry [704, 1280] at data.num_frames=17 is 4400",
     "data.token_budget >= 4400"),
    (["data.probe=false", "data.buckets=[[352,640]]", "data.token_budget=2000"],
     "data.height x data.width 704x1280", "data.token_budget >= 4400"),
]


@pytest.mark.parametrize("overrides,key,fix", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_values_and_combinations_name_key_and_fix(overrides, key, fix):
    cfg = compose_cfg(["model.path=/somewhere", *overrides])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    msg = str(e.value)
    assert key in msg and fix in msg and "\n" not in msg, msg


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


def check_files(cfg) -> None:
    """What run() checks on disk before Lightning loads: the spec's folder, then the run's paths."""
    from wanexp.composition import build, prepare_model_folder

    prepare_model_folder(build(cfg.model), cfg.boundary.name)
    check_paths(cfg)


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
    with pytest.raises(ConfigError, match="data.metadata=.*file not found.*data=synthetic"):
        check_paths(compose_cfg(["model.path=/m", f"data.metadata={tmp_path}/missing.csv"]))
    meta = tmp_path / "meta.csv"
    meta.write_text("video,prompt\na.mp4,x\n")
    with pytest.raises(ConfigError, match="resume=.*checkpoint file not found"):
        check_paths(compose_cfg(["model.path=/m", f"data.metadata={meta}", f"resume={tmp_path}/x.ckpt"]))


def test_fresh_run_refuses_a_folder_with_checkpoints(tmp_path):
    meta = tmp_path / "meta.csv"
    meta.write_text("video,prompt\na.mp4,x\n")
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step_000010.ckpt").write_bytes(b"x")
    base = ["model.path=/m", f"data.metadata={meta}", f"paths.output_dir={out}"]
    with pytest.raises(ConfigError, match="already holds checkpoints.*resume=last.*overwrite=true"):
        check_paths(compose_cfg(base))
    check_paths(compose_cfg([*base, "resume=last"]))
    check_paths(compose_cfg([*base, "overwrite=true"]))


def test_spec_checks_its_own_values():
    from wanexp.composition import build

    with pytest.raises(ConfigError, match="model.attention_backend=fast: allowed values are null .*native"):
        build(compose_cfg(["model.path=/m", "model.attention_backend=fast"]).model)
    with pytest.raises(ConfigError, match="model.attention_backend=flash_hub: .*download kernels"):
        build(compose_cfg(["model.path=/m", "model.attention_backend=flash_hub"]).model)
    with pytest.raises(ConfigError, match="model.first_frame_cond=0.5: model=t2v14b has no optional first-frame"):
        build(compose_cfg(["model=t2v14b", "model.path=/m", "model.first_frame_cond=0.5"]).model)
    with pytest.raises(ConfigError, match="adapter.targets: unknown target 'qkv'; allowed: q, k, v, o, ffn.0, ffn.2"):
        build(compose_cfg(["model.path=/m", "adapter.targets=[q,qkv]"]).adapter)
    with pytest.raises(ConfigError, match="adapter.attention: unknown value 'both'; allowed: self, cross"):
        build(compose_cfg(["model.path=/m", "adapter.attention=[self,both]"]).adapter)


CLI_BAD = [
    (["model=ti2v5b", "boundary=low", "model.path=/nowhere"], "boundary=low with model=ti2v5b"),
    (["model.path=/nowhere/Wan2.2-TI2V-5B"], "model.path=/nowhere/Wan2.2-TI2V-5B: folder not found"),
    (["experiment=demo", "data.num_frames=8"], "data.num_frames=8: must be 4k+1"),
    (["experiment=demo", "callbacks.validation.shapes=[[32,64,8]]"],
     "callbacks.validation.shapes: [32, 64, 8] has 8 frames; frames must be 4k+1 (e.g. 5 or 9)"),
    # types and ranges, at composition
    (["optim.lr=abc"], "optim.lr=abc: must be a number"),
    (["trainer.max_steps=abc"], "trainer.max_steps=abc: must be an integer"),
    (["data.num_workers=-1"], "data.num_workers=-1: must be >= 0"),
    (["optim.lr=1e38"], "optim.lr=1e+38: must be > 0.0 and <= 1.0"),
    (["optim=sgd"], "optim=sgd: no such option; allowed values are adafactor, adamw, adamw8bit, came, prodigy"),
    (["experiment=demo", "optim=adafactor", "optim.optimizer.relative_step=true"],
     "optim.optimizer.relative_step=true with optim=adafactor: Adafactor's own time-dependent rate"),
    (["experiment=demo", "callbacks.ema.decay=0.999", "objective=kd"],
     "callbacks.ema.decay with objective=kd: the objective trains and exports a whole model"),
    (["adapter.rnak=8"], "adapter.rnak: no such key in adapter"),
    (["experiment=demo", "adapter.targets=[q,qkv]"], "adapter.targets: unknown target 'qkv'"),
    (["guard.max_bad_steps=0"], "guard.max_bad_steps=0: must be >= 1"),
    # an objective's own rule (its class imports torch): after the model folder's existence
    (["model=t2v14b", "model.path=/usr", "objective=kd"], "objective=kd with model=t2v14b boundary=full"),
    (["experiment=demo", "trainer.precision=16-mixed"], "trainer.precision=16-mixed with trainer.accelerator=cpu"),
    (["model.path=/nowhere", "trainer.precision=16-mixed", "trainer.accelerator=gpu"],
     "trainer.precision=16-mixed with model.dtype=bf16: fp16 autocast over bf16 weights"),
    # a tiny model is built only into an absent folder, never into a mistyped path that holds something else
    (["experiment=demo", "model.path=/usr"], "model.path=/usr: exists and is not a model built by model=tiny"),
    # generated demo data names a CSV file; a folder there is a mistake, reported before anything is written
    (["experiment=demo", "data.metadata=/usr"], "data.metadata=/usr is a folder, but data.generate is on"),
    (["experiment=demo", "resume=/nowhere/step_000010.ckpt"], "resume=/nowhere/step_000010.ckpt: checkpoint file "
                                                              "not found"),
    (["experiment=demo", "model.fp8_storage=2"], "model.fp8_storage=2: must be true or false"),
    (["experiment=demo", "model.attention_backend=fa4"],
     "model.attention_backend=fa4: the flash-attn-4 package is not installed: pip install flash-attn-4"),
]


def no_lightning(folder: Path) -> str:
    """A PYTHONPATH where importing Lightning fails: a bad run must be refused before Lightning is imported."""
    fake = folder / "lightning"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text("raise ImportError('lightning was imported before the checks finished')\n")
    return str(folder)


def _cli_bad_args(args: list[str], out: Path, shared: Path) -> list[str]:
    return [*args, f"paths.output_dir={out}", f"paths.tiny_model_dir={shared}/models", f"paths.data_dir={shared}/data"]


@pytest.mark.slow  # one process for all: 10-40 s, started early so that no worker ends on it
def test_cli_bad_input_exits_2_with_one_line_before_lightning(tmp_path, shared_dir):
    """Each CLI_BAD command, refused in one fresh process where Lightning cannot be imported (tests.conftest.
    run_cli_batch: python train.py's entry per command; one process, not one per command: ~8 s of imports each):
    exit code 2, one stderr line naming the problem, no traceback, Lightning not imported, nothing written."""
    outs = [tmp_path / f"{i}" / "run" for i in range(len(CLI_BAD))]
    results = run_cli_batch([_cli_bad_args(args, out, shared_dir) for (args, _), out in zip(CLI_BAD, outs)],
                            tmp_path / "batch", timeout=300, env={"PYTHONPATH": no_lightning(tmp_path / "fake")})
    assert results[0]["outside"] == ""  # the process wrote nothing else (its imports)
    wrong = []
    for (args, needle), out, res in zip(CLI_BAD, outs, results):
        errors = [line for line in res["stderr"].splitlines() if line.startswith("wanexp: error:")]
        if not (res["returncode"] == 2 and len(errors) == 1 and needle in errors[0] and "Traceback" not in
                res["stderr"] and len(res["stderr"].strip().splitlines()) == 1 and res["lightning"] == [] and
                not (out / "checkpoints").exists()):
            wrong.append(f"{' '.join(args)}: exit {res['returncode']}, lightning {res['lightning'][:3]}, stderr "
                         f"{res['stderr'][-1500:]}")
    assert not wrong, "\n".join(wrong)


def test_a_bad_command_line_is_refused_by_train_py_itself(tmp_path, shared_dir):
    """The CLI wiring of the refusals above: python train.py, a process of its own, Lightning not importable."""
    args = _cli_bad_args(["optim.lr=abc"], tmp_path / "run", shared_dir)
    res = run_cli(args, timeout=120, env={"PYTHONPATH": no_lightning(tmp_path / "fake")})
    assert res.returncode == 2 and res.stderr.strip() == "wanexp: error: optim.lr=abc: must be a number", res.stderr
    assert not (tmp_path / "run").exists()


def _schema_fields(schema_name: str) -> dict:
    import dataclasses

    return {f.name: f for f in dataclasses.fields(SCHEMAS[schema_name])}


def _assert_set_only_where_schema_has_no_default(node: dict, schema_name_or_cls, where: str,
                                                 own: tuple = ()) -> list[str]:
    """``own``: keys of ``node`` that a schema entry of their own types (e.g. ``/schema/optimizer/came@optimizer``),
    checked against that schema instead."""
    import dataclasses

    cls = SCHEMAS[schema_name_or_cls] if isinstance(schema_name_or_cls, str) else schema_name_or_cls
    fields = {f.name: f for f in dataclasses.fields(cls)}
    checked = []
    for key, value in node.items():
        if key == "defaults" or key in own:
            continue
        f = fields[key]
        has_default = f.default is not dataclasses.MISSING and f.default != "???" or \
            f.default_factory is not dataclasses.MISSING
        assert not has_default, f"{where}: {key} is set here and defaulted in {cls.__name__}: keep one"
        checked.append(key)
        nested = f.type if isinstance(f.type, type) else None
        if nested is None and isinstance(f.type, str):
            import wanexp.config.schema as schema_module

            nested = getattr(schema_module, f.type, None)
        if dataclasses.is_dataclass(nested) and isinstance(value, dict):
            checked += _assert_set_only_where_schema_has_no_default(value, nested, f"{where}.{key}")
    return checked


def test_each_default_exists_once():
    """A value is either in a YAML file or a schema default, never both (so they cannot disagree)."""
    checked = []
    for path in sorted(CONF.rglob("*.yaml")):
        raw = OmegaConf.to_container(OmegaConf.load(path))
        if not isinstance(raw, dict):
            continue
        entries = [e.removeprefix("/schema/").partition("@") for e in raw.get("defaults", [])
                   if isinstance(e, str) and e.startswith("/schema/")]
        own = tuple(package for _, _, package in entries if package != "_here_")
        for name, _, package in entries:
            node = raw if package == "_here_" else raw.get(package, {})
            checked += _assert_set_only_where_schema_has_no_default(node, name, str(path),
                                                                    own if package == "_here_" else ())
    assert len(checked) > 80
    # and nothing is left unset in the composed default run except the one value a user must give
    def missing(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict):
                yield from missing(v, f"{prefix}{k}.")
            elif v == "???":
                yield f"{prefix}{k}"

    assert list(missing(OmegaConf.to_container(compose_cfg([])))) == ["model.path"]
    OmegaConf.to_container(compose_cfg(["model.path=/m"]), resolve=True, throw_on_missing=True)


# ---- user errors that used to be tracebacks: one line each, before anything loads --------------------------------
_BASE: list = []


def _base(**values):
    """The default run (composed once) with values set as the command line would: dotted key -> value."""
    import copy

    if not _BASE:
        _BASE.append(compose_cfg(["model.path=/somewhere"]))
    cfg = copy.deepcopy(_BASE[0])
    for key, value in values.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    return cfg


LINE_ERRORS = [
    ({"trainer__devices": "abc"}, "trainer.devices=abc: must be auto, a device count (N >= 1; -1: all of them) or a "
                                  "list of GPU indices (e.g. [0,1])"),
    ({"trainer__devices": 0}, "trainer.devices=0: must be auto"),
    ({"trainer__devices": []}, "trainer.devices=[]: must be auto"),
    ({"callbacks__progress": "abc"}, "callbacks.progress=abc: must be a node with a _target_ (the class to "
                                     "instantiate), or null (or false) to turn it off"),
    ({"callbacks__checkpoint": True}, "callbacks.checkpoint=True: must be a node with a _target_"),
]


@pytest.mark.parametrize("values,message", LINE_ERRORS, ids=[str(v) for v, _ in LINE_ERRORS])
def test_more_bad_values_are_one_line(values, message):
    with pytest.raises(ConfigError) as e:
        check_config(_base(**values))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def _true_false_keys(cfg) -> list[str]:
    """Every key of a composed config that holds a bool (OmegaConf's BooleanNode)."""
    from omegaconf import DictConfig
    from omegaconf.nodes import BooleanNode

    def walk(node, prefix: str):
        for key in node.keys():
            if OmegaConf.is_missing(node, key):
                continue
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                yield from walk(child, f"{prefix}{key}.")
            elif isinstance(child, BooleanNode):
                yield f"{prefix}{key}"

    return list(walk(cfg, ""))


def test_every_true_false_key_refuses_another_value_on_the_command_line():
    """OmegaConf turns any integer into a bool (model.fp8_storage=2 was taken as true) and yes/no/on/off too: every
    bool key of the config takes true or false only; anything else is one line naming the key and the value."""
    from wanexp.config.messages import one_line_error
    from wanexp.config.rules import check_booleans

    cfg = compose_cfg(["experiment=demo"])
    keys = _true_false_keys(cfg)
    assert {"model.fp8_storage", "model.compile", "overwrite", "data.probe", "adapter.use_dora"} <= set(keys)
    for key in keys:
        check_booleans(cfg, [f"{key}=true", f"{key}=false", f"{key}=True"])
        for bad in ("2", "0", "1", "yes", "off"):
            with pytest.raises(ConfigError) as e:
                check_booleans(cfg, [f"{key}={bad}"])
            assert str(e.value) == f"{key}={bad}: must be true or false"
    check_booleans(cfg, ["model.compile=true,false", "optim.lr=2", "+extra=2", "~tags"])  # not a bool key's value
    check_booleans(cfg, ["model.compile=${model.gradient_checkpointing}"])  # an interpolation: OmegaConf checks it
    assert compose_cfg(["experiment=demo", "model.compile=${model.gradient_checkpointing}"]).model.compile is False
    with pytest.raises(Exception) as e:  # not a bool at all: OmegaConf refuses it, said in the same words
        compose_cfg(["experiment=demo", "model.fp8_storage=abc"])
    assert one_line_error(e.value) == "model.fp8_storage=abc: must be true or false"


def test_device_settings_lightning_takes_pass():
    for devices in ("auto", 1, -1, [0, 1], "0,1", "1,", 4):
        check_config(_base(trainer__devices=devices))


def test_false_or_zero_turns_a_named_callback_or_logger_off(monkeypatch):
    """callbacks.NAME=false (or 0) is off, as null is: neither checked nor built."""
    import wanexp.train as train

    cfg = compose_cfg(["model.path=/somewhere", "callbacks.progress=false", "callbacks.checkpoint=false",
                       "callbacks.validation=0", "logger.csv=false"])
    check_config(cfg)
    monkeypatch.setattr(train, "build", lambda node: node._target_.rpartition(".")[2])  # what would be built
    built = set(train.instantiate_named(cfg.callbacks))
    assert "StepProgressBar" not in built and "RunCheckpoint" not in built and "Validation" not in built
    assert {"LoraExport", "RunStatus", "Preemption"} <= built
    assert train.instantiate_named(cfg.logger) == []


LOGGERS = [  # every logger the README names, and Lightning's others: the package each needs and its install line
    ("wandb", "wanexp.callbacks.wandb_logger.RunWandbLogger", ["wandb"], "pip install wandb"),
    ("tb", "lightning.pytorch.loggers.TensorBoardLogger", ["tensorboard", "tensorboardX"], "pip install tensorboard"),
    ("mlflow", "lightning.pytorch.loggers.MLFlowLogger", ["mlflow"], "pip install mlflow"),
    ("comet", "lightning.pytorch.loggers.CometLogger", ["comet_ml"], "pip install comet-ml"),
    ("neptune", "lightning.pytorch.loggers.NeptuneLogger", ["neptune"], "pip install neptune"),
]


@pytest.mark.parametrize("name,target,packages,install", LOGGERS, ids=[x[0] for x in LOGGERS])
def test_a_logger_without_its_package_names_the_install(name, target, packages, install, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in packages else real(n, *a))
    cfg = _base(**{f"logger__{name}": {"_target_": target, "save_dir": "/tmp/logs"}})
    with pytest.raises(ConfigError, match=rf"^logger.{name}: \w+ needs the {packages[0]} package, which is not "
                                          rf"installed; {install}, or use logger=csv$"):
        check_config(cfg)
    monkeypatch.setattr(importlib.util, "find_spec", real)
    if all(real(p) is None for p in packages):
        return  # not installed here either: the check above is the one that counts
    check_config(cfg)  # installed: accepted


def test_the_tensorboard_logger_of_the_readme_without_tensorboard_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n.startswith("tensorboard") else real(n, *a))
    cfg = compose_cfg(["model.path=/somewhere", "+logger.tb._target_=lightning.pytorch.loggers.TensorBoardLogger",
                       "+logger.tb.save_dir=outputs/tb"])
    with pytest.raises(ConfigError, match="logger.tb: TensorBoardLogger needs the tensorboard package, which is not "
                                          "installed; pip install tensorboard, or use logger=csv"):
        check_config(cfg)


def _resume_files(tmp_path):
    """What users pass to resume= by mistake: the run's config.yaml, a LoRA file, an empty or truncated .ckpt."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.yaml").write_text("run_name: demo\nseed: 42\n")
    save_file({"lora_A.weight": torch.zeros(2, 2)}, tmp_path / "demo_lora_diffusers.safetensors")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    torch.save({"state_dict": {"w": torch.zeros(64, 64)}, "wanexp": {}}, tmp_path / "whole.ckpt")
    (tmp_path / "cut.ckpt").write_bytes((tmp_path / "whole.ckpt").read_bytes()[:1000])
    return {"config": (tmp_path / "config.yaml", "a text file, not a checkpoint"),
            "lora": (tmp_path / "demo_lora_diffusers.safetensors", "a LoRA export, not a training checkpoint; to "
                     "start a new run from a LoRA pass adapter.init_from=FILE"),
            "empty": (tmp_path / "empty.ckpt", "the file is empty (0 bytes"),
            "cut": (tmp_path / "cut.ckpt", "truncated")}


@pytest.mark.parametrize("which", ["config", "lora", "empty", "cut"])
def test_resume_from_a_file_that_is_no_checkpoint_is_one_line(tmp_path, which):
    from wanexp.runfolder import checkpoint_kind

    path, needle = _resume_files(tmp_path)[which]
    meta = tmp_path / "meta.csv"
    meta.write_text("video,prompt\na.mp4,x\n")
    with pytest.raises(ConfigError) as e:
        check_paths(_base(data__metadata=str(meta), resume=str(path)))
    msg = str(e.value)
    assert msg.startswith(f"resume={path}: ") and needle in msg and "\n" not in msg, msg
    assert "pass a .ckpt file of the run's checkpoints/ folder, or resume=last" in msg
    assert checkpoint_kind(tmp_path / "whole.ckpt", "ddp") == "torch"


def test_torchrun_sets_the_device_count_or_says_what_to_set():
    """Under torchrun (its environment, not launched here) Lightning needs devices x num_nodes = WORLD_SIZE."""
    from wanexp.composition import launcher_devices

    def decide(env, *overrides):
        cfg = _base(**{k.replace(".", "__"): OmegaConf.from_dotlist([o]).trainer[k.split(".")[1]]
                       for o in overrides for k in [o.split("=")[0]]})
        launcher_devices(cfg, env)
        return cfg.trainer.devices, cfg.trainer.num_nodes

    two = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    assert decide({}, "trainer.devices=1") == (1, 1)  # not under torchrun: as configured
    assert decide(two) == (2, 1)  # trainer.devices=auto (the default): torchrun's processes per node
    assert decide(two, "trainer.devices=-1") == (2, 1)
    assert decide(two, "trainer.devices=2") == (2, 1)
    assert decide(two, "trainer.devices=[0,1]") == ([0, 1], 1)
    with pytest.raises(ConfigError, match=r"trainer.devices=1 under torchrun with 2 processes per node "
                                          r"\(LOCAL_WORLD_SIZE=2\): .*; set trainer.devices=2 "
                                          r"\(or trainer.devices=auto\)"):
        decide(two, "trainer.devices=1")  # e.g. experiment=demo's
    nodes = dict(two, WORLD_SIZE="8")
    with pytest.raises(ConfigError, match=r"trainer.num_nodes=1 under torchrun with WORLD_SIZE=8 and 2 processes per "
                                          r"node: set trainer.num_nodes=4"):
        decide(nodes)
    assert decide(nodes, "trainer.num_nodes=4") == (2, 4)


def test_a_refusal_under_torchrun_is_the_root_cause_of_torchruns_report(tmp_path, monkeypatch, capsys):
    """torchrun prints its own ChildFailedError report (a traceback) for any worker that exits non-zero, whatever the
    code; the rank's error file (TORCHELASTIC_ERROR_FILE) makes wanexp's one line that report's root cause, not a
    pointer to torch's docs. python train.py's entry in this process, with a rank's torchrun environment."""
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from wanexp.train import main

    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    error_file.parent.mkdir(parents=True)
    for k, v in {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0",
                 "LOCAL_RANK": "0", "TORCHELASTIC_ERROR_FILE": str(error_file), "HYDRA_FULL_ERROR": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HYDRA_FULL_ERROR")  # main sets it: unset again after the test
    monkeypatch.setattr(sys, "argv", ["train.py", "experiment=demo", f"paths.output_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "trainer.devices=1 under torchrun" in err[0], err
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    report = ChildFailedError("train.py", {0: failure}).format_msg()
    assert f"traceback : {err[0]}" in report and "To enable traceback" not in report, report


def test_hydra_writes_no_run_folder_of_a_single_run():
    """A single run: Hydra's job folder is the working folder and it writes no .hydra/ (wanexp makes the run folder
    after its checks); nor into a multirun point's folder, which may be a live run's (the sweep folder records each
    point: points.jsonl)."""
    run = compose(["model.path=/m"], return_hydra_config=True).hydra
    assert run.run.dir == "." and run.output_subdir is None and not run.job.chdir
    assert compose(["model.path=/m", "sweep=rank_lr"], return_hydra_config=True).hydra.output_subdir is None


class OneClipSpec(TI2VSpec):
    """A family whose own config check (ModelSpec.check_groups) takes one clip a batch and a LoRA of rank <= 8."""

    seen: list = []

    @classmethod
    def check_groups(cls, data, adapter):
        cls.seen.append((type(data), type(adapter)))
        if data["batch_size"] != 1:
            raise ConfigError(f"data.batch_size={data['batch_size']}: this family trains one clip a batch; set "
                              "data.batch_size=1")
        if adapter["rank"] > 8:
            raise ConfigError(f"adapter.rank={adapter['rank']}: this family takes a rank of at most 8")


def test_a_familys_own_config_check_sees_its_groups_as_plain_dicts():
    base = ["model.path=/m", f"model._target_={__name__}.OneClipSpec", "adapter.rank=4"]
    check_config(compose_cfg([*base, "data.batch_size=1"]))
    assert OneClipSpec.seen[-1] == (dict, dict)
    with pytest.raises(ConfigError, match=r"^data.batch_size=2: this family trains one clip a batch"):
        check_config(compose_cfg([*base, "data.batch_size=2"]))
    with pytest.raises(ConfigError, match=r"^adapter.rank=16: this family takes a rank of at most 8"):
        check_config(compose_cfg([*base, "data.batch_size=1", "adapter.rank=16"]))


def test_the_token_budget_counts_latent_frames_by_the_models_frame_rule():
    """The budget's token count takes the latent frames from model.frame_rule [m, r] ((F - r) / m + r): Wan2.2's 4x
    temporal VAE, and a family of another stride."""
    from wanexp.config.rules import _dit_tokens

    assert _dit_tokens(17, 704, 1280, 32, [4, 1]) == 5 * 22 * 40  # TI2V-5B: 4,400 tokens
    assert _dit_tokens(7, 32, 32, 16, [2, 1]) == 4 * 2 * 2  # 2k+1 frames: the first alone, then pairs
    assert _dit_tokens(3, 32, 32, 16, [1, 0]) == 3 * 2 * 2  # a latent per frame
