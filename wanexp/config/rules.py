"""Rules that span groups (the schema checks each field alone), and path checks that load nothing.

Each failure is one ConfigError line: the key and value, the problem, and what to change.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from wanexp.config.schema import OptimizerConfig, typed_node
from wanexp.errors import ConfigError


def check_boundary(cfg: DictConfig) -> None:
    """Runs before the schema walk: a one-expert boundary interpolates the model's boundary_ratio."""
    m, b = cfg.model, cfg.boundary
    if b.name in ("high", "low") and m.boundary_ratio is None:
        raise ConfigError(
            f"boundary={b.name} with model={m.name}: {m.name} is one dense model with no expert boundary; "
            "use boundary=full, or a model with high and low noise experts (e.g. model=i2v14b|t2v14b) to train one"
        )


def check_booleans(cfg: DictConfig, overrides) -> None:
    """A true/false key given on the command line takes true or false. OmegaConf's bool nodes also convert any
    integer (2 is true, 0 false) and yes/no/on/off, so each override's value is read as Hydra parsed it, before that
    conversion, and held to the type of the key it sets (an interpolation, ``${...}``, is held by OmegaConf)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf.nodes import BooleanNode

    for o in OverridesParser.create().parse_overrides([str(x) for x in overrides]):
        if o.is_sweep_override() or o.is_delete():
            continue
        parent_key, _, leaf = o.key_or_group.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if not isinstance(parent, DictConfig) or leaf not in parent:
            continue
        value = o.value()
        if isinstance(value, str) and "${" in value:  # an interpolation: OmegaConf checks what it resolves to
            continue
        if isinstance(parent._get_node(leaf), BooleanNode) and value is not None and not isinstance(value, bool):
            raise ConfigError(f"{o.key_or_group}={o.get_value_element_as_str()}: must be true or false")


def command_line(cfg: DictConfig) -> list[str]:
    """The overrides a run was given: ``overrides`` (wanexp.train keeps Hydra's record there), else Hydra's record
    when Hydra composed this config; none for a config composed otherwise."""
    if cfg.get("overrides") is not None:
        return list(cfg.overrides)
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def frame_rule_problem(n: int, rule) -> str | None:
    """What is wrong with a frame count under the model's frame rule [m, r] (n % m == r), or None."""
    m, r = (int(x) for x in rule)
    if n % m == r % m:
        return None
    lower = n - (n - r) % m
    lower = lower if lower >= 1 else lower + m
    upper = lower + m if lower < n else lower
    return f"must be {m}k+{r} (e.g. {lower} or {upper}) for the {m}x temporal VAE"


def validation_frames(cfg: DictConfig) -> list[tuple[str, int]]:
    """(the refusal's head, the frame count) of each [height, width, frames] entry of ``callbacks.validation.shapes``."""
    shapes = OmegaConf.select(cfg, "callbacks.validation.shapes", default=None)
    if not OmegaConf.is_list(shapes):
        return []
    return [(f"callbacks.validation.shapes: {list(c)} has {c[2]} frames; frames", int(c[2])) for c in shapes
            if OmegaConf.is_list(c) and len(c) == 3 and isinstance(c[2], int)]


def check_rules(cfg: DictConfig, model_folder: bool = False) -> None:
    """The rules across groups; ``model_folder``: also whether ``model.path`` exists, before the rules that import the
    model's or the objective's class (and torch)."""
    check_booleans(cfg, command_line(cfg))
    m, b, d, p = cfg.model, cfg.boundary, cfg.data, cfg.parallel
    if OmegaConf.is_missing(m, "path"):
        raise ConfigError(f"model.path is not set: pass model.path=/path/to/local/diffusers/folder (or a single "
                          f".safetensors DiT file) for model={m.name}")
    if d.get("datasets") is None and not d.generate and not str(d.metadata).strip():  # the templates' required key
        raise ConfigError(f"data.metadata is not set: data={d.name} reads your own data; pass data.metadata=/path/to/"
                          "it (a folder of clips with caption files, or a CSV/JSON/JSONL file)")
    if not b.sigma_min < b.sigma_max:
        raise ConfigError(f"boundary sigma range [{b.sigma_min}, {b.sigma_max}]: sigma_min must be below sigma_max")
    for head, frames in [(f"data.num_frames={d.num_frames}:", d.num_frames), *validation_frames(cfg)]:
        problem = frame_rule_problem(frames, m.frame_rule)
        if problem:
            raise ConfigError(f"{head} {problem}")
    for key in ("height", "width"):
        v = d[key]
        if v % m.hw_multiple:
            down = v - v % m.hw_multiple
            raise ConfigError(f"data.{key}={v}: model={m.name} needs a multiple of {m.hw_multiple} "
                              f"(e.g. {down or m.hw_multiple} or {down + m.hw_multiple})")
    check_buckets(cfg)
    check_dataset_shapes(cfg)
    if d.window != "first" and not d.probe:
        raise ConfigError(f"data.window={d.window} with data.probe=false: windows need each clip's frame count; "
                          "set data.probe=true or data.window=first")
    if p.name in ("deepspeed",) and cfg.trainer.accelerator == "cpu":
        raise ConfigError(f"parallel={p.name} with trainer.accelerator=cpu: {p.name} needs GPUs; use parallel=ddp on CPU")
    if p.name == "deepspeed":
        check_deepspeed(cfg)
    check_dora(cfg)
    t = cfg.trainer
    if t.max_steps == 0:  # Lightning would train nothing, and no step would have LoRA files to export
        raise ConfigError("trainer.max_steps=0: trains no step; set trainer.max_steps to the optimizer steps (>= 1), "
                          "or to -1 with trainer.max_epochs=N")
    if t.max_steps == -1 and t.max_epochs is None:  # Lightning's fallback: 1000 epochs
        raise ConfigError("trainer.max_steps=-1 with trainer.max_epochs=null: nothing ends the run; set "
                          "trainer.max_epochs=N (or trainer.max_steps=N)")
    if p.sp_size > 1:  # sequence parallel (wanexp/models/sequence.py)
        if p.name not in ("ddp", "fsdp"):
            raise ConfigError(f"parallel.sp_size={p.sp_size} with parallel={p.name}: sequence parallel runs under "
                              "parallel=ddp or parallel=fsdp")
        family = model_class(cfg)
        if not family.sequence_parallel:
            raise ConfigError(f"parallel.sp_size={p.sp_size}: model={m.name} has no sequence parallel; set "
                              "parallel.sp_size=1")
        if not family.wanexp_forward(bool(m.fast_modulation)):
            raise ConfigError(f"parallel.sp_size={p.sp_size} needs wanexp's transformer forward: set "
                              "model.fast_modulation=true")
        devices = t.devices if isinstance(t.devices, int) else None
        if devices is not None and (devices * t.num_nodes) % p.sp_size:
            raise ConfigError(f"parallel.sp_size={p.sp_size} with {devices * t.num_nodes} device(s): the device count "
                              f"must be a multiple of sp_size; set trainer.devices to a multiple of {p.sp_size}")
    if str(t.precision) == "16-mixed":  # fp16 autocast with a grad scaler: the path for GPUs without fast bf16
        if t.accelerator == "cpu":
            raise ConfigError("trainer.precision=16-mixed with trainer.accelerator=cpu: fp16 mixed precision needs a "
                              "GPU; use trainer.precision=32 (or bf16-mixed) on CPU")
        if m.dtype == "bf16":
            raise ConfigError("trainer.precision=16-mixed with model.dtype=bf16: fp16 autocast over bf16 weights "
                              "mixes the two formats; set model.dtype=fp16 (V100: no fast bf16) or fp32")
    if (str(t.precision) == "16-mixed" or m.dtype == "fp16") and not m.fast_modulation:  # fast.stream_dtypes
        raise ConfigError("model.fast_modulation=false with fp16 compute: diffusers' block keeps the residual stream "
                          "in fp16, where a trained DiT's values overflow; set model.fast_modulation=true (wanexp's "
                          "forward keeps it in fp32)")
    if m.fp8:  # models/fp8.py: FP8 buffers, a bf16 GEMM output
        if p.name in ("fsdp", "deepspeed"):
            raise ConfigError(f"model.fp8=true with parallel={p.name}: the FP8 weights are not sharded (FSDP would "
                              "cast them to its param_dtype); use parallel=ddp, or model.fp8=false to shard")
        if str(t.precision) not in ("bf16-mixed", "bf16-true"):
            raise ConfigError(f"model.fp8=true with trainer.precision={t.precision}: the FP8 GEMMs return bf16; set "
                              "trainer.precision=bf16-mixed")
    _check_low_vram(m, p)
    check_cuda_graphs(cfg)
    check_devices(t.devices)
    for group in ("logger", "callbacks"):
        for name, node in (cfg[group] or {}).items():
            if not switched_off(node):
                _check_target(f"{group}.{name}", node)
    if model_folder:
        check_model_path(cfg)
    check_family(cfg)
    check_objective(cfg)
    check_optim(cfg)
    check_ema(cfg)
    check_validation_images(cfg)


def check_objective(cfg: DictConfig) -> None:
    """The objective's own rules (``Objective.check`` of the class its ``_target_`` names), after every rule above:
    importing the class imports torch (seconds), which the other config errors are spared. A group that no
    ConfigStore schema typed at composition (an objective from outside wanexp) is first typed and range-checked by
    the schema its class names, and replaced by the typed node, so the run gets that schema's defaults too."""
    cls = objective_class(cfg.objective)
    schema = getattr(cls, "schema", None)
    if schema is not None and not dataclasses.is_dataclass(OmegaConf.get_type(cfg.objective)):
        cfg.objective = typed_node(cfg.objective, schema, "objective")
    cls.check(cfg)


def model_class(cfg: DictConfig) -> type:
    """The spec class ``model._target_`` names, imported (nothing is built; its module imports torch, so the rules
    that ask it run after ``model.path``'s check)."""
    from hydra.utils import get_class

    return get_class(str(cfg.model._target_))


def check_family(cfg: DictConfig) -> None:
    """The model family's own rules (``ModelSpec.check_groups`` of the spec class), on the data and adapter groups as
    plain dicts: the family sees its groups, never the whole config."""
    adapter = cfg.get("adapter")
    model_class(cfg).check_groups(OmegaConf.to_container(cfg.data, resolve=True),
                                  None if adapter is None else OmegaConf.to_container(adapter, resolve=True))


def check_validation_images(cfg: DictConfig) -> None:
    """``callbacks.validation.images`` needs a model that samples image-to-video (its spec's image conditioning)."""
    v = (cfg.callbacks or {}).get("validation")
    if switched_off(v) or not v.get("images"):
        return
    spec = model_class(cfg)
    if not (spec.needs_image_latent or spec.draws_first_frame):
        raise ConfigError(f"callbacks.validation.images with model={cfg.model.name}: the model has no image "
                          "conditioning (text-to-video only); set callbacks.validation.images=null, or train a "
                          "model with image conditioning (e.g. model=ti2v5b or model=i2v14b)")


def objective_class(node: DictConfig) -> type:
    """The class ``objective._target_`` names, imported (nothing is built); a name that does not import, or that
    is no objective, is one line."""
    from hydra.utils import get_class

    target = node.get("_target_")
    try:
        cls = get_class(str(target))
    except (ImportError, ValueError) as e:
        cause = str(e.__cause__ or e).strip().splitlines()[0]
        raise ConfigError(f"objective._target_={target}: cannot import it ({cause}); pick an objective with "
                          "objective=<name> (a YAML in conf/objective/ or on hydra.searchpath), or fix the class "
                          "path") from None
    if not callable(getattr(cls, "check", None)):  # duck-typed: config imports no objective
        raise ConfigError(f"objective._target_={target}: not an objective (a subclass of "
                          "wanexp.objectives.base.Objective); point it at an objective class")
    return cls


def switched_off(node) -> bool:
    """A named logger or callback set to null or false (0 too) is off."""
    return node is None or (isinstance(node, (bool, int)) and not node)


def check_devices(devices) -> None:
    """trainer.devices as Lightning takes it: auto, a count (-1: all), or GPU indices (a list or "0,1")."""
    value = OmegaConf.to_container(devices) if OmegaConf.is_list(devices) else devices
    if isinstance(value, list):
        ok = bool(value) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    elif isinstance(value, bool):
        ok = False
    elif isinstance(value, int):
        ok = value >= 1 or value == -1
    else:
        text = str(value).strip()
        indices = text.strip(",").split(",")
        ok = text in ("auto", "-1") or bool(text) and all(i.strip().isdigit() for i in indices)
    if not ok:
        raise ConfigError(f"trainer.devices={value}: must be auto, a device count (N >= 1; -1: all of them) or a "
                          "list of GPU indices (e.g. [0,1])")


def check_buckets(cfg: DictConfig) -> None:
    """Every shape the data trains at, before anything loads: each data.buckets entry is [height, width] in
    multiples of model.hw_multiple, and data.token_budget holds one video sample of each shape (a sample over the
    budget would still train, at batch 1, past the memory the budget was set for). A bad bucket otherwise shows only
    as a shape error at its first batch, after the probe and the cache have gone through the whole data set."""
    m, d = cfg.model, cfg.data
    buckets = [list(b) if OmegaConf.is_list(b) else b for b in (d.buckets or [])]
    for i, b in enumerate(buckets):
        if not isinstance(b, list) or len(b) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                                         for v in b):
            raise ConfigError(f"data.buckets[{i}]={b}: each bucket is [height, width] in pixels; e.g. "
                              "data.buckets=[[704,1280],[1280,704],[960,960]]")
        if b[0] % m.hw_multiple or b[1] % m.hw_multiple:
            down, up = ([_multiple_near(v, m.hw_multiple, side) for v in b] for side in (-1, 1))
            options = f"{down} or {up}" if down != up else f"{down}"
            raise ConfigError(f"data.buckets[{i}]={b}: height and width must be multiples of {m.hw_multiple} for "
                              f"model={m.name}; use the nearest, e.g. {options}")
    if d.token_budget:
        # the base height x width trains every sample whose media size is unknown (data.probe=false) or no bucket
        shapes = buckets if buckets and d.probe else buckets + [[d.height, d.width]]
        for h, w in shapes:
            tokens = _dit_tokens(d.num_frames, h, w, m.hw_multiple, m.frame_rule)
            if tokens > d.token_budget:
                where = f"data.buckets entry [{h}, {w}]" if [h, w] in buckets else f"data.height x data.width {h}x{w}"
                raise ConfigError(f"data.token_budget={d.token_budget}: one sample of the {where} at "
                                  f"data.num_frames={d.num_frames} is {tokens} DiT tokens, more than the budget; set "
                                  f"data.token_budget >= {tokens}, or a smaller bucket or data.num_frames")


def check_dataset_shapes(cfg: DictConfig) -> None:
    """Each data.datasets entry's own height, width and buckets are multiples of model.hw_multiple, as the group's
    are (the datamodule checks the entries' other keys when it reads them, before anything loads)."""
    m, sets = cfg.model, cfg.data.get("datasets")
    entries = sets.items() if OmegaConf.is_dict(sets) else enumerate(sets) if OmegaConf.is_list(sets) else []
    for name, e in entries:
        if not OmegaConf.is_dict(e):
            continue
        name = e.get("name") or name
        if e.get("window") not in (None, "first") and not cfg.data.probe:
            raise ConfigError(f"data.datasets.{name}.window={e.window} with data.probe=false: windows need each "
                              "clip's frame count; set data.probe=true or that dataset's window=first")
        for key in ("height", "width"):
            v = e.get(key)
            if isinstance(v, int) and v % m.hw_multiple:
                raise ConfigError(f"data.datasets.{name}.{key}={v}: model={m.name} needs a multiple of "
                                  f"{m.hw_multiple} (e.g. {_multiple_near(v, m.hw_multiple, -1)} or "
                                  f"{_multiple_near(v, m.hw_multiple, 1)})")
        for i, b in enumerate(e.get("buckets") or []):
            b = list(b) if OmegaConf.is_list(b) else b
            if isinstance(b, list) and len(b) == 2 and all(isinstance(v, int) for v in b) and (
                    b[0] % m.hw_multiple or b[1] % m.hw_multiple):
                raise ConfigError(f"data.datasets.{name}.buckets[{i}]={b}: height and width must be multiples of "
                                  f"{m.hw_multiple} for model={m.name}")


def _multiple_near(value: int, multiple: int, side: int) -> int:
    """The multiple of ``multiple`` (at least ``multiple``) at or below (side -1) or at or above (1) ``value``."""
    down = max(multiple, value - value % multiple)
    up = down if value % multiple == 0 or down > value else down + multiple
    return down if side < 0 else up


def _dit_tokens(frames: int, height: int, width: int, hw_multiple: int, frame_rule) -> int:
    """DiT tokens of one sample without loading the model: latent frames (a frame rule [m, r]'s (F - r) / m + r: the
    m-x temporal VAE keeps the first r frames alone; one frame per temporal patch) x the spatial patches, which are
    hw_multiple pixels a side (VAE stride x patch size)."""
    m, r = (int(x) for x in frame_rule)
    return ((frames - r) // m + r) * (height // hw_multiple) * (width // hw_multiple)

def check_deepspeed(cfg: DictConfig) -> None:
    """parallel=deepspeed: what DeepSpeed through Lightning can train (one optimizer; every rank runs the same
    modules), and that the package is there."""
    m, b, s = cfg.model, cfg.boundary, cfg.parallel.strategy
    if b.name == "full" and m.boundary_ratio is not None:
        raise ConfigError(f"parallel=deepspeed with model={m.name} boundary=full: each sample goes to one of two "
                          "experts, so ranks run different modules, which ZeRO's collectives cannot follow; use "
                          "parallel=ddp, or train one expert with boundary=high|low")
    if s.stage == 3 and m.compile:
        raise ConfigError(f"parallel.strategy.stage=3 with model.compile=true: ZeRO-3 gathers each weight inside the "
                          "compiled blocks, which recompile on every call and break activation checkpointing; set "
                          "model.compile=false, or use parallel.strategy.stage=2 or parallel=fsdp (its blocks compile)")
    if s.offload_parameters and s.stage != 3:
        raise ConfigError(f"parallel.strategy.offload_parameters=true with parallel.strategy.stage={s.stage}: "
                          "DeepSpeed offloads weights only under ZeRO stage 3; set parallel.strategy.stage=3 or "
                          "parallel.strategy.offload_parameters=false")
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("parallel=deepspeed: the deepspeed package is not installed; pip install 'wanexp[deepspeed]' "
                          "(or deepspeed) on the GPU node, or use parallel=ddp|fsdp")


def _check_target(key: str, node: DictConfig) -> None:
    """A swap point's _target_ must name an installed package (checked without importing it)."""
    if not OmegaConf.is_dict(node):
        raise ConfigError(f"{key}={node}: must be a node with a _target_ (the class to instantiate), or null (or "
                          f"false) to turn it off")
    target = node.get("_target_")
    if not target:
        raise ConfigError(f"{key}: has no _target_; give the class to instantiate (e.g. {key}._target_=pkg.Class) "
                          f"or disable it with {key}=null")
    top = str(target).split(".")[0]
    if importlib.util.find_spec(top) is None:
        raise ConfigError(f"{key}._target_={target}: package {top!r} is not installed; install it or change {key}")
    for cls, (packages, install) in LOGGER_PACKAGES.items():
        if str(target).endswith(cls) and all(importlib.util.find_spec(p) is None for p in packages):
            raise ConfigError(f"{key}: {cls} needs the {packages[0]} package, which is not installed; {install}, or "
                              "use logger=csv")


# Lightning's loggers import their package only when built: each one's package (any of them) and its install line.
LOGGER_PACKAGES = {
    "WandbLogger": (("wandb",), "pip install wandb"),
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "pip install tensorboard"),
    "MLFlowLogger": (("mlflow",), "pip install mlflow"),
    "CometLogger": (("comet_ml",), "pip install comet-ml"),
    "NeptuneLogger": (("neptune",), "pip install neptune"),
}


def missing_model_folder(path, name: str) -> str:
    """The one line for a ``model.path`` that does not exist (here, before torch is imported, and in the spec's own
    folder check)."""
    if Path(str(path)).suffix in WEIGHT_FILE_SUFFIXES:
        return f"model.path={path}: file not found; point model.path at a {name} DiT file or a diffusers-format folder"
    return f"model.path={path}: folder not found; point model.path at a local diffusers-format {name} folder"


WEIGHT_FILE_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt", ".gguf")
COMPONENT_PATHS = ("transformer_path", "transformer_2_path", "vae_path", "text_encoder_path", "tokenizer_path")


def check_model_path(cfg: DictConfig) -> None:
    """A ``model.path`` (a folder or a single DiT file) or a component's path (``model.vae_path`` ...) that does not
    exist, said before the model's classes (and torch) are imported; a tiny model's (``model.build``) is built at
    ``model.path``."""
    m = cfg.model
    for key in COMPONENT_PATHS:
        value = m.get(key)
        if value is not None and not Path(value).exists():
            raise ConfigError(f"model.{key}={value}: not found; point it at the component's weight file (or folder)")
    if m.path is None:
        if m.build:
            raise ConfigError(f"model.path=null with model.build: model={m.name} builds its random model into "
                              "model.path; set model.build=null to load the components from their own paths")
        if m.get("transformer_path") is None and m.get("transformer_2_path") is None:
            raise ConfigError("model.path=null: no weights; set model.path to a diffusers-format folder or a DiT "
                              "file, or model.transformer_path (and the other components' paths)")
        return
    if not m.build and not Path(m.path).exists():
        raise ConfigError(missing_model_folder(m.path, m.name))


def check_paths(cfg: DictConfig) -> None:
    """Files a run needs before anything loads: the metadata file (data.datasets' entries name their own, which the
    datamodule reads, each in one line when missing), the resume checkpoint, a free run folder."""
    d = cfg.data
    if d.generate and Path(d.metadata).is_dir():
        raise ConfigError(
            f"data.metadata={d.metadata} is a folder, but data.generate is on: it names the CSV file the generated "
            f"demo clips are listed in (e.g. {Path(d.metadata) / 'synthetic' / 'metadata.csv'}); or set "
            "data.generate=null to train on the media and captions of that folder"
        )
    if not d.generate and d.get("datasets") is None and not Path(d.metadata).exists():  # entries: read one by one
        raise ConfigError(
            f"data.metadata={d.metadata}: file not found; point data.metadata (or paths.data_dir) at your "
            f"metadata CSV/JSON/JSONL or a folder of media with .txt captions, or use data=synthetic"
        )
    out = Path(cfg.paths.output_dir)
    if cfg.resume is None and not cfg.overwrite and any((out / "checkpoints").glob("*.ckpt")):
        raise ConfigError(
            f"paths.output_dir={out} already holds checkpoints of an earlier run; pass resume=last to continue it, "
            "a new run_name (or paths.output_dir), or overwrite=true to replace it"
        )
    if cfg.resume not in (None, "last", "auto"):
        if not Path(cfg.resume).exists():
            raise ConfigError(f"resume={cfg.resume}: checkpoint file not found; pass a .ckpt path, resume=last, "
                              "resume=auto, or resume=null")
        from wanexp.runfolder import checkpoint_kind

        checkpoint_kind(cfg.resume, cfg.parallel.name)  # its bytes: a checkpoint, not config.yaml or a LoRA file


def blocks_to_swap_setting(value) -> int | str:
    """model.blocks_to_swap as given: a block count (null: 0) or "auto" (resolved from the memory budget or the GPU
    by wanexp.models.blockswap.resolve_blocks_to_swap, once the model's config is readable)."""
    if value is None or value == "auto":
        return value or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"model.blocks_to_swap={value}: must be a block count (an integer >= 0), auto (the fewest "
                          "blocks that fit model.memory_budget_gib, or this GPU's free memory) or null; set "
                          "model.blocks_to_swap=N or model.blocks_to_swap=auto")
    return value


def _check_low_vram(m, p) -> None:
    """model.fp8_storage and model.blocks_to_swap (wanexp/models/blockswap.py) against the other settings."""
    swap = blocks_to_swap_setting(m.get("blocks_to_swap"))
    if m.get("fp8_storage") and m.fp8:
        raise ConfigError("model.fp8_storage=true with model.fp8=true: the FP8 base already stores its weights in FP8; "
                          "set one of them to false")
    if not swap:
        return
    knob = f"model.blocks_to_swap={swap}"
    if p.name in ("fsdp", "deepspeed"):
        raise ConfigError(f"{knob} with parallel={p.name}: sharded weights are gathered by the strategy, not swapped; "
                          "use parallel=ddp (or one GPU) with block swap, or model.blocks_to_swap=0 to shard")
    if m.fp8:
        raise ConfigError(f"{knob} with model.fp8=true: the FP8 GEMM layers are not swapped; use "
                          "model.fp8_storage=true with block swap (the FP8 bytes move), or model.fp8=false")


def check_cuda_graphs(cfg: DictConfig) -> None:
    """model.cuda_graphs=true (wanexp/models/wan22/fast.py, compile_blocks): a recorded graph replays fixed addresses
    and one step's order of block calls, which these settings change from step to step or call into. Each refusal
    names its fix, and model.cuda_graphs=false as the other way out where there is one."""
    m, p, t = cfg.model, cfg.parallel, cfg.trainer
    if not m.get("cuda_graphs"):
        return
    swap = blocks_to_swap_setting(m.get("blocks_to_swap"))
    other_way = True
    if not m.compile:
        problem = "replays the compiled blocks: set model.compile=true"
    elif t.accelerator == "cpu":
        problem = "records CUDA graphs, and trainer.accelerator=cpu runs on the CPU; set trainer.accelerator=gpu"
    elif not model_class(cfg).compiles_blocks:
        problem = (f"replays compiled blocks, and model={m.name} does not compile its blocks; set "
                   "model.cuda_graphs=false")
        other_way = False
    elif p.name in ("fsdp", "deepspeed"):
        problem = (f"with parallel={p.name}: sharded parameters are gathered to new addresses each step; use "
                   "parallel=ddp")
    elif p.sp_size > 1:
        problem = (f"with parallel.sp_size={p.sp_size}: sequence parallel's collectives run in the blocks' checkpoint; "
                   "set parallel.sp_size=1")
    elif swap:
        problem = f"with model.blocks_to_swap={swap}: swapped weights move every step; set model.blocks_to_swap=0"
    elif m.get("offload_activations"):
        problem = ("with model.offload_activations=true: the offloaded checkpoint copies to host memory in the block "
                   "call; set model.offload_activations=false")
    elif t.accumulate_grad_batches != 1:
        problem = (f"with trainer.accumulate_grad_batches={t.accumulate_grad_batches}: the next replay overwrites the "
                   "gradients being accumulated; set trainer.accumulate_grad_batches=1")
    elif not objective_class(cfg.objective).one_forward:
        problem = (f"with objective={cfg.objective.get('name')}: its step runs more than one forward; set "
                   "model.cuda_graphs=false")
        other_way = False
    else:
        return
    raise ConfigError(f"model.cuda_graphs=true {problem}" + (" (or model.cuda_graphs=false)" if other_way else ""))


def check_dora(cfg: DictConfig) -> None:
    """adapter.use_dora: the DoRA export reads each adapted base weight whole on rank 0 (adapters.merge.comfy_module_params)."""
    a, p, m = cfg.adapter, cfg.parallel, cfg.model
    if not a.get("use_dora"):
        return
    sharded = p.name == "fsdp" or (p.name == "deepspeed" and p.strategy.get("stage") == 3)
    if sharded:
        raise ConfigError(f"adapter.use_dora=true with parallel={p.name}: the DoRA export needs each base weight whole "
                          "on rank 0, which sharding keeps apart; use parallel=ddp (or deepspeed stage 2)")
    if m.get("fp8") or m.get("fp8_storage"):
        raise ConfigError("adapter.use_dora=true with an FP8 base: DoRA's magnitude is computed from the base weight "
                          "as trained and exported; set model.fp8=false and model.fp8_storage=false")


def check_optim(cfg: DictConfig) -> None:
    """The optimizer of ``optim=<name>`` (its schema class's attributes, wanexp.config.schema.OptimizerConfig): its
    package installed (the pip pin named), its learning-rate rule, the parallel strategies and objectives it runs
    under, and on the CPU a package version that has CPU kernels (read from the installed metadata: nothing is
    imported)."""
    o, p = cfg.optim, cfg.parallel
    schema = OmegaConf.get_type(o.optimizer)
    if not (isinstance(schema, type) and issubclass(schema, OptimizerConfig)):
        return  # an optimizer node from outside wanexp's groups: its class checks its own arguments
    name = f"optim={schema.option}"
    if schema.package is not None and importlib.util.find_spec(schema.package[0]) is None:
        raise ConfigError(f"{name}: the {schema.package[0]} package is not installed; pip install {schema.package[1]} "
                          "(or pip install 'wanexp[optim]'), or use optim=adamw")
    if schema.lr_is_multiplier and o.lr_scaling != "none":
        raise ConfigError(f"{name} with optim.lr_scaling={o.lr_scaling}: optim.lr multiplies the optimizer's own "
                          "step-size estimate, which needs no scaling with the batch; set optim.lr_scaling=none (tune "
                          "optim.optimizer.d_coef for larger or smaller steps)")
    if schema.unsharded_only and p.name in ("fsdp", "deepspeed"):
        raise ConfigError(f"{name} with parallel={p.name}: {schema.unsharded_only}; use parallel=ddp (or one device), "
                          "or optim=adamw")
    if o.optimizer.get("relative_step"):
        raise ConfigError(f"optim.optimizer.relative_step=true with {name}: Adafactor's own time-dependent rate "
                          "would replace optim.lr and the schedule; set optim.optimizer.relative_step=false and the "
                          "rate with optim.lr")
    if objective_class(cfg.objective).manual:  # one optimizer per adapter, with the objective's own settings
        if not schema.adapter_overrides:
            raise ConfigError(f"{name} with objective={cfg.objective.name}: each of its adapters sets Adam's betas, "
                              f"eps and weight_decay (objective.<adapter>.*), which {schema.option} does not take; use "
                              "optim=adamw or adamw8bit")
        if schema.lr_is_multiplier:
            raise ConfigError(f"{name} with objective={cfg.objective.name}: each of its adapters sets its own "
                              f"learning rate (objective.<adapter>.lr), which {schema.option} would take as a "
                              "multiplier of its step-size estimate; use optim=adamw or adamw8bit")
    if schema.cpu_from and cfg.trainer.accelerator == "cpu":
        from importlib.metadata import PackageNotFoundError, version

        from packaging.version import Version

        dist = schema.package[1].partition("==")[0]
        try:
            have = version(dist)
        except PackageNotFoundError:  # importable without its metadata (e.g. a source checkout): let it run
            return
        if Version(have) < Version(schema.cpu_from):
            raise ConfigError(f"{name} with trainer.accelerator=cpu: {dist} {have} has no CPU kernels for its "
                              f"optimizers (they came with {schema.cpu_from}); pip install {schema.package[1]}, "
                              "train on a GPU, or use optim=adamw")


def check_ema(cfg: DictConfig) -> None:
    """``callbacks.ema`` (wanexp.callbacks.ema): an EMA of the trained adapter, under the strategies that hold each
    adapter weight on every rank (one device, DDP) or shard it per parameter (FSDP2); not DeepSpeed's engine, nor an
    objective that trains a whole model (KD's student) rather than adapters."""
    node = (cfg.callbacks or {}).get("ema")
    if switched_off(node) or node.get("decay") is None:
        return
    if cfg.parallel.name == "deepspeed":
        raise ConfigError("callbacks.ema.decay with parallel=deepspeed: DeepSpeed keeps the trained weights inside its "
                          "engine's partitions, which the EMA does not follow; use parallel=ddp or fsdp, or "
                          "callbacks.ema.decay=null")
    if objective_class(cfg.objective).export_checkpoint is not None:
        raise ConfigError(f"callbacks.ema.decay with objective={cfg.objective.name}: the objective trains and exports "
                          "a whole model, and the EMA covers adapter weights only; set callbacks.ema.decay=null")
