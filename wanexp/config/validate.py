"""Cross-group checks that run before any weight or dataset loads. Each failure is one line: key, problem, fix."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from wanexp.config.errors import ConfigError
from wanexp.lora import target_regex
from wanexp.objectives.timesteps import SCHEMES

PRECISIONS = ("bf16-mixed", "bf16-true", "32", "32-true")
PARALLEL = ("single", "ddp", "fsdp", "deepspeed")
LOGGERS = ("csv", "wandb", "none")
SCHEDULERS = ("constant", "cosine", "linear")
DTYPES = ("bf16", "fp16", "fp32")
TWO_EXPERT_MODELS = "model=i2v14b|t2v14b (or tiny_i2v14b|tiny_t2v14b)"


def _positive_int(value, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key}={value}: must be a positive integer")
    return value


def check_config(cfg: DictConfig) -> None:
    """Pure checks of the composed config (no file system)."""
    m, b, d, o, t = cfg.model, cfg.boundary, cfg.data, cfg.objective, cfg.trainer
    if OmegaConf.is_missing(m, "path"):
        raise ConfigError(f"model.path is not set: pass model.path=/path/to/local/diffusers/folder for model={m.name}")
    for key in ("dtype", "vae_dtype", "text_encoder_dtype"):
        if m[key] not in DTYPES:
            raise ConfigError(f"model.{key}={m[key]}: allowed values are {', '.join(DTYPES)}")
    if m.attention_backend is not None:
        from diffusers.models.attention_dispatch import AttentionBackendName

        names = [a.value for a in AttentionBackendName]
        if m.attention_backend not in names:
            raise ConfigError(f"model.attention_backend={m.attention_backend}: allowed values are null (default), "
                              + ", ".join(n for n in names if not n.endswith("_hub")))
        if m.attention_backend.endswith("_hub"):
            raise ConfigError(f"model.attention_backend={m.attention_backend}: *_hub backends download kernels from a "
                              "hub; use the installed equivalent (e.g. flash, _flash_3, native)")
    if b.name in ("high", "low") and m.boundary_ratio is None:
        raise ConfigError(
            f"boundary={b.name} with model={m.name}: {m.name} is one dense model with no expert boundary; "
            f"use boundary=full, or {TWO_EXPERT_MODELS} to train one expert"
        )
    if b.name not in ("full", "high", "low"):
        raise ConfigError(f"boundary={b.name}: allowed values are full, high, low")
    if not 0.0 <= float(b.sigma_min) < float(b.sigma_max) <= 1.0:
        raise ConfigError(f"boundary sigma range [{b.sigma_min}, {b.sigma_max}] must satisfy 0 <= min < max <= 1")

    frames = _positive_int(d.num_frames, "data.num_frames")
    if (frames - 1) % 4:
        lower, upper = frames - (frames - 1) % 4, frames + 4 - (frames - 1) % 4
        raise ConfigError(f"data.num_frames={frames}: must be 4k+1 (e.g. {lower} or {upper}) for the 4x temporal VAE")
    for key in ("height", "width"):
        v = _positive_int(d[key], f"data.{key}")
        if v % m.hw_multiple:
            down = v - v % m.hw_multiple
            raise ConfigError(
                f"data.{key}={v}: model={m.name} needs a multiple of {m.hw_multiple} "
                f"(e.g. {down or m.hw_multiple} or {down + m.hw_multiple})"
            )
    _positive_int(d.batch_size, "data.batch_size")
    _positive_int(d.frame_stride, "data.frame_stride")
    if d.max_samples is not None:
        _positive_int(d.max_samples, "data.max_samples")

    lc = o.lora
    _positive_int(lc.rank, "objective.lora.rank")
    if float(lc.alpha) <= 0:
        raise ConfigError(f"objective.lora.alpha={lc.alpha}: must be > 0 (scale = alpha / rank)")
    if not 0.0 <= float(lc.dropout) < 1.0:
        raise ConfigError(f"objective.lora.dropout={lc.dropout}: must be in [0, 1)")
    target_regex(list(lc.targets), list(lc.attention))
    if float(o.optim.lr) <= 0:
        raise ConfigError(f"objective.optim.lr={o.optim.lr}: must be > 0")
    if o.optim.scheduler not in SCHEDULERS:
        raise ConfigError(f"objective.optim.scheduler={o.optim.scheduler}: allowed values are {', '.join(SCHEDULERS)}")
    if o.timestep.sampling not in SCHEMES:
        raise ConfigError(f"objective.timestep.sampling={o.timestep.sampling}: allowed values are {', '.join(SCHEMES)}")
    if float(o.timestep.shift) <= 0:
        raise ConfigError(f"objective.timestep.shift={o.timestep.shift}: must be > 0")
    if not 0.0 <= float(o.first_frame_cond) <= 1.0:
        raise ConfigError(f"objective.first_frame_cond={o.first_frame_cond}: must be in [0, 1]")

    if str(t.precision) not in PRECISIONS:
        raise ConfigError(f"trainer.precision={t.precision}: allowed values are {', '.join(PRECISIONS)}")
    _positive_int(t.accumulate_grad_batches, "trainer.accumulate_grad_batches")
    _positive_int(t.checkpoint_every_n_steps, "trainer.checkpoint_every_n_steps")
    p = cfg.parallel
    if p.name not in PARALLEL:
        raise ConfigError(f"parallel={p.name}: allowed values are {', '.join(PARALLEL)}")
    if p.name in ("fsdp", "deepspeed") and t.accelerator == "cpu":
        raise ConfigError(f"parallel={p.name} with trainer.accelerator=cpu: {p.name} needs GPUs; use parallel=ddp on CPU")
    if p.name == "fsdp" and p.sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
        raise ConfigError(f"parallel.sharding_strategy={p.sharding_strategy}: allowed values are FULL_SHARD, "
                          "SHARD_GRAD_OP (for no sharding use parallel=ddp)")
    if p.name == "deepspeed":
        if not 1 <= int(p.stage) <= 3:
            raise ConfigError(f"parallel.stage={p.stage}: DeepSpeed ZeRO stage must be 1, 2 or 3")
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError("parallel=deepspeed: the deepspeed package is not installed; pip install deepspeed "
                              "on the GPU node, or use parallel=ddp|fsdp")
    if cfg.logger.name not in LOGGERS:
        raise ConfigError(f"logger={cfg.logger.name}: allowed values are {', '.join(LOGGERS)}")
    if cfg.logger.name == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logger=wandb: the wandb package is not installed; pip install wandb, or use logger=csv")


def check_files(cfg: DictConfig) -> None:
    """Checks that touch the file system but load nothing: model folder, metadata file, resume checkpoint."""
    m = cfg.model
    if not m.build:  # tiny models are built on first use; real ones must be there
        from hydra.utils import get_class

        spec_cls = get_class(m._target_)
        spec = spec_cls(**{k: v for k, v in OmegaConf.to_container(m, resolve=True).items() if k != "_target_"})
        spec.check_folder(spec.trained_experts(cfg.boundary.name))
    d = cfg.data
    if not d.generate and not Path(d.metadata).is_file():
        raise ConfigError(
            f"data.metadata={d.metadata}: file not found; point data.metadata (or paths.data_dir) at your "
            f"metadata CSV/JSON, or use data=synthetic"
        )
    out = Path(cfg.paths.output_dir)
    if cfg.resume is None and not cfg.overwrite and any((out / "checkpoints").glob("*.ckpt")):
        raise ConfigError(
            f"paths.output_dir={out} already holds checkpoints of an earlier run; pass resume=last to continue it, "
            "a new run_name (or paths.output_dir), or overwrite=true to replace it"
        )
    if cfg.resume not in (None, "last") and not Path(cfg.resume).is_file():
        raise ConfigError(f"resume={cfg.resume}: checkpoint file not found; pass a .ckpt path, resume=last, or resume=null")


def validate(cfg: DictConfig) -> None:
    check_config(cfg)
    check_files(cfg)
