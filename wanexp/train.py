"""run(cfg): validate -> seed -> build (the one place that instantiates) -> fit -> finish."""
from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from wanexp.config.errors import ConfigError
from wanexp.config.validate import validate


# The frozen VAE and text encoder stay in eval mode on purpose; Lightning's pytree shim warns on every batch.
warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def build_logger(cfg: DictConfig, out: Path, resume_step: int | None):
    lg = cfg.logger
    if lg.name == "none":
        return False
    if lg.name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        # A resumed session logs beside the earlier ones (Lightning's CSV writer would delete an existing file).
        version = "" if resume_step is None else f"resume_step{resume_step:06d}"
        return CSVLogger(save_dir=str(out), name="logs", version=version)
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(project=lg.project, entity=lg.entity, group=lg.group, name=cfg.run_name, save_dir=str(out),
                       mode=lg.mode, log_model=lg.log_model, tags=list(cfg.tags),
                       config=OmegaConf.to_container(cfg, resolve=True))


def build_callbacks(cfg: DictConfig, out: Path) -> list:
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    from wanexp.callbacks.lora_export import LoraExport
    from wanexp.callbacks.progress import StepProgressBar
    from wanexp.callbacks.status import RunStatus

    c = cfg.callbacks
    cbs = [ModelCheckpoint(dirpath=str(out / "checkpoints"), filename="step_{step:06d}", auto_insert_metric_name=False,
                           every_n_train_steps=int(cfg.trainer.checkpoint_every_n_steps), save_top_k=int(c.keep_checkpoints),
                           monitor="step", mode="max", save_last=False, save_on_train_epoch_end=False)]
    if c.progress:
        cbs.append(StepProgressBar())
    if c.status:
        cbs.append(RunStatus(str(out), cfg.run_name))
    if c.lora_export:
        cbs.append(LoraExport(str(out)))
    if cfg.logger.name != "none":
        cbs.append(LearningRateMonitor(logging_interval="step"))
    return cbs


def build_trainer(cfg: DictConfig, out: Path, resume_step: int | None = None):
    import lightning as L

    from wanexp.parallel import build_strategy

    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.trainer, resolve=True).items()
              if k != "checkpoint_every_n_steps"}
    return L.Trainer(**kwargs, strategy=build_strategy(cfg.parallel), logger=build_logger(cfg, out, resume_step),
                     callbacks=build_callbacks(cfg, out), default_root_dir=str(out),
                     enable_progress_bar=bool(cfg.callbacks.progress), use_distributed_sampler=False,
                     enable_model_summary=False)


def launch_rank() -> int:
    """This process's global rank as the launcher set it (torchrun/SLURM/Lightning children), before any init."""
    import os

    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def clear_run_folder(out: Path) -> None:
    """overwrite=true: remove what an earlier run of this folder wrote (rank 0 only)."""
    import shutil

    for sub in ("checkpoints", "lora", "logs"):
        shutil.rmtree(out / sub, ignore_errors=True)
    (out / "status.json").unlink(missing_ok=True)


def checkpoint_step(path: str | None) -> int | None:
    if path is None:
        return None
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=False).get("global_step", 0))


def resume_path(cfg: DictConfig, out: Path) -> str | None:
    if cfg.resume is None:
        return None
    if cfg.resume == "last":
        last = out / "checkpoints" / "last.ckpt"
        if not last.is_file():
            raise ConfigError(f"resume=last: no {last} yet; start without resume, or pass resume=/path/to/file.ckpt")
        return str(last)
    return str(cfg.resume)


def run(cfg: DictConfig) -> dict:
    """Train one run described by a composed config. Returns paths of what it wrote."""
    validate(cfg)  # before the heavy imports: a bad run fails in seconds

    import lightning as L
    from hydra.utils import instantiate

    from wanexp.callbacks.lora_export import LoraExport
    from wanexp.models.build import ensure_tiny_model
    from wanexp.module import WanLoraModule

    out = Path(cfg.paths.output_dir).resolve()
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)
    spec = instantiate(cfg.model, _convert_="all")
    experts = spec.trained_experts(cfg.boundary.name)
    if spec.build:
        ensure_tiny_model(spec)
    spec.check_folder(experts)
    dm = instantiate(cfg.data, seed=int(cfg.seed))
    dm.prepare()
    dm.setup("fit")  # reads and checks the metadata before any weights load
    ckpt = resume_path(cfg, out)
    if cfg.overwrite and ckpt is None and launch_rank() == 0:
        clear_run_folder(out)
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)

    module = WanLoraModule(spec, instantiate(cfg.objective, _convert_="all"), cfg.boundary,
                           max_steps=int(cfg.trainer.max_steps or -1))
    trainer = build_trainer(cfg, out, checkpoint_step(ckpt))
    if trainer.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
    trainer.save_checkpoint(str(out / "checkpoints" / "last.ckpt"))  # collective: every rank calls it
    export = next((c for c in trainer.callbacks if isinstance(c, LoraExport)), None)
    files = [str(f) for f in export.finalize(trainer.global_step)] if export and trainer.global_rank == 0 else []
    return {"output_dir": str(out), "lora_files": files, "checkpoint": str(out / "checkpoints" / "last.ckpt"),
            "global_step": trainer.global_step, "rank": trainer.global_rank, "module": module, "trainer": trainer}


def _input_errors() -> tuple[type[BaseException], ...]:
    from wanexp.data.media import MediaError
    from wanexp.data.metadata import MetadataError

    return (ConfigError, MetadataError, MediaError)


def cli(cfg: DictConfig) -> None:
    """The Hydra entry: run, print where the LoRA files are; bad input exits 2 with one line."""
    try:
        _adopt_sweep_folder(cfg)
        result = run(cfg)
    except _input_errors() as e:
        _finish_wandb(failed=True)
        # Raised in a DataLoader worker, the message carries the worker's traceback: its last line is the error.
        lines = str(e).strip().splitlines() or [type(e).__name__]
        print(f"wanexp: error: {lines[-1]}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception:
        _finish_wandb(failed=True)
        traceback.print_exc()
        sys.exit(1)
    _finish_wandb(failed=False)  # the next point of a sweep starts its own W&B run
    if result["rank"] == 0:
        print(f"wanexp: finished {cfg.run_name} at step {result['global_step']}; run folder {result['output_dir']}")
        for f in result["lora_files"]:
            print(f"wanexp: LoRA file {f}")


def _adopt_sweep_folder(cfg: DictConfig) -> None:
    """In a multirun, each point runs in Hydra's job folder and is named after its overrides."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    devices = str(cfg.trainer.devices)
    if devices != "1" and not (devices == "auto" and _gpu_count() <= 1):
        raise ConfigError(
            f"a multirun sweep with trainer.devices={devices}: each point would relaunch the whole sweep on every rank; "
            "run multi-GPU points with python sweeps/launch.py (same overrides), or set trainer.devices=1"
        )
    hc = HydraConfig.get()
    swept = set(OmegaConf.to_container(hc.sweeper.get("params") or {}).keys())
    pairs = [o.split("=", 1) for o in hc.overrides.task if "=" in o]
    chosen = [f"{k}={v}" for k, v in pairs if k in swept] or [f"{k}={v}" for k, v in pairs if "/" not in v]
    with open_dict(cfg):
        cfg.paths.output_dir = hc.runtime.output_dir
        sweep = OmegaConf.select(cfg, "sweep.name", default="multirun")
        cfg.run_name = f"{sweep}/{hc.job.num}_" + ",".join(chosen)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _finish_wandb(failed: bool) -> None:
    mod = sys.modules.get("wandb")
    if mod is not None and getattr(mod, "run", None) is not None:
        mod.finish(exit_code=1 if failed else 0)
