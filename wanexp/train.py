"""run(cfg): pre-flight (wanexp.composition) -> build the run's parts -> seed -> fit -> finish.

``main()`` is the ``python train.py`` entry: Hydra composes the config (typed by wanexp/config/schema.py), ``cli``
runs it, and every user-input error, at composition or later, is one line on stderr with exit code 2. What only a
training run needs (the Trainer, the resume check, the run folder, W&B's end) is here; what other commands share
(the builders, the pre-flight, the Hydra entry) is in wanexp/composition.py.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from wanexp.composition import (Preflight, build, build_datamodule, hydra_main, launch_rank, preflight,
                                read_resume_checkpoint)
from wanexp.config.rules import switched_off
from wanexp.errors import ConfigError, Interrupted, UserError, say_error
from wanexp.runfolder import RunLock, checkpoint_kind, clear_run_folder, remove_stale_temporaries, resume_path


def instantiate_named(nodes: DictConfig | None) -> list:
    """The generic swap point: one object per named node with a ``_target_`` (a null or false node is off)."""
    return [build(node) for node in (nodes or {}).values() if not switched_off(node)]


def build_trainer(cfg: DictConfig, out: Path, context=None):
    """The Trainer of a run; ``context`` (a wanexp.context.RunContext) is handed to the callbacks that read it."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar

    from wanexp.context import hand_over

    loggers = instantiate_named(cfg.logger)
    callbacks = instantiate_named(cfg.callbacks)
    if context is not None:
        hand_over(context, callbacks)
    strategy = cfg.parallel.strategy
    strategy = build(strategy) if OmegaConf.is_dict(strategy) else strategy
    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    if kwargs.get("profiler") is None:  # times the loader wait per step (perf/loader_wait_frac)
        from wanexp.callbacks.status_file import LoaderWait

        kwargs["profiler"] = LoaderWait()
    if cfg.parallel.name != "deepspeed":  # DeepSpeed writes its own checkpoint folders
        from wanexp.callbacks.checkpoint import AtomicCheckpointIO

        kwargs["plugins"] = [AtomicCheckpointIO()]
    # callbacks.checkpoint=null: no checkpoint callback at all (Lightning's default one would save a checkpoint, its
    # LoRA export and the loss plot at every epoch's end, under logs/); the run saves one at its end (_fit)
    trainer = L.Trainer(**kwargs, strategy=strategy, logger=loggers or False,
                        callbacks=callbacks, default_root_dir=str(out),
                        enable_progress_bar=any(isinstance(c, ProgressBar) for c in callbacks),
                        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                        use_distributed_sampler=False, enable_model_summary=False)
    return trainer


def start_services(trainer) -> None:
    """Start the loggers that reach a service (W&B: a login or network failure refuses the run, before the run
    folder is cleared or written)."""
    from lightning.pytorch.loggers import WandbLogger

    for lg in trainer.loggers:
        if isinstance(lg, WandbLogger):
            lg.experiment


def log_config(trainer, cfg: DictConfig) -> None:
    """The run's config to every logger (CSV: logs/version_N/hparams.yaml; W&B: the run's config)."""
    for lg in trainer.loggers:
        lg.log_hyperparams(redacted(OmegaConf.to_container(cfg, resolve=True)))


def check_resume(module, ckpt: str, parallel: str) -> None:
    """The checkpoint of a resume agrees with this run's settings (the module's own check), read before the run
    writes anything, so that a refused resume leaves its run folder as it was."""
    module.check_resume(read_resume_checkpoint(ckpt, parallel)["wanexp"])


SECRET_KEYS = ("api_key", "apikey", "token", "password", "secret")


def redacted(node):
    """The config as written to the run folder and the loggers: values of secret-looking keys (a W&B api_key, a
    token) replaced by ``***``. (W&B itself reads its key from the environment or ~/.netrc, never from the config.)"""
    if isinstance(node, dict):
        return {k: "***" if any(s in str(k).lower() for s in SECRET_KEYS) and v is not None else redacted(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [redacted(v) for v in node]
    return node


def run(cfg: DictConfig) -> dict:
    """Train one run described by a composed config. Returns paths of what it wrote."""
    # Checks and light components first: a bad run fails in seconds, before Lightning or any weight loads.
    pre = preflight(cfg, verbose=launch_rank() == 0)

    out = Path(cfg.paths.output_dir).resolve()
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)  # every callback and logger writes under this absolute folder
    found = resume_path(cfg.resume, out)  # resume=last with no checkpoint, or not a checkpoint: before any write
    if found is not None:
        checkpoint_kind(found, cfg.parallel.name)
    lock = None
    if launch_rank() == 0:
        lock = RunLock(out, cfg.guard.lock_stale_s)
        lock.check_free()  # a live run's folder: one line before the checks read it; taken once they all pass
    try:
        return _fit(cfg, pre, out, lock)
    finally:
        if lock is not None:  # refused before it started (no config.yaml written): the lock it made goes too
            lock.release(discard=not lock.started)


def take_run_folder(lock: RunLock, out: Path) -> None:
    """Rank 0, once every check passed: lock the run folder (creating it), then remove the temporary files of
    writes a kill interrupted. Nothing in the folder is touched before this."""
    lock.acquire()
    stale = remove_stale_temporaries(out)
    if stale:
        print(f"wanexp: removed {len(stale)} temporary file(s) of an interrupted write in {out} "
              f"(e.g. {stale[0].name})", flush=True)


def _fit(cfg: DictConfig, pre: Preflight, out: Path, lock: RunLock | None = None) -> dict:
    spec, adapter, objective = pre.spec, pre.adapter, pre.objective
    import lightning as L

    from wanexp.callbacks.lora_export import LoraExport
    from wanexp.context import RunContext
    from wanexp.module import DiffusionModule
    from wanexp.optim import scaled_lr

    # The run-wide facts, built once and handed to the datamodule, the module and the callbacks (wanexp/context.py)
    context = RunContext.from_config(cfg)
    dm = build_datamodule(cfg, spec, context)
    dm.hold_rejects()
    dm.prepare()
    dm.setup("fit")  # reads and checks the metadata and media before any weights load
    if dm.prompts_only:  # a file of prompts alone (wanexp/data/prompts.py): only an objective needing no clip takes it
        from wanexp.data.prompts import check_prompts_only

        check_prompts_only(objective, spec, cfg.data.metadata)
        if launch_rank() == 0:
            print(f"wanexp: data: training from prompts only ({dm.report['prompts_only']} prompts in "
                  f"{cfg.data.metadata}, no media)", flush=True)
    if launch_rank() == 0:
        r = dm.report
        if r.get("rejected") or r.get("warnings"):
            print(f"wanexp: data: {r['rejected']} of {r['rows']} rows rejected, {r['warnings']} warnings "
                  f"(reasons in {r['rejects_file']})", flush=True)
        for note in r.get("notes") or ():  # media cropped into a shape of the other orientation (one line a dataset)
            print(f"wanexp: data: {note}", flush=True)
        c = r.get("cache") or {}
        if c.get("used"):
            print(f"wanexp: data: training from the cache {c['dir']} (the VAE and text encoder are not loaded)")
        elif c.get("missing_entries"):
            print(f"wanexp: data: encoding online: the cache {c['dir']} lacks {c['missing_entries']} entries of this "
                  "run; python -m wanexp.cli.cache with the same overrides fills it", flush=True)
    ckpt = resume_path(cfg.resume, out)
    if cfg.resume == "auto" and launch_rank() == 0:
        print(f"wanexp: resume=auto: {f'continuing from {Path(ckpt).resolve()}' if ckpt else 'no checkpoint yet, starting fresh'}",
              flush=True)
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    with open_dict(cfg):
        if objective.manual:  # several adapters, each step trains one: the objective clips per adapter
            cfg.trainer.gradient_clip_val = None
        # Parameters a step may leave without a gradient on some rank: the other adapter (DMD), or an expert that no
        # sample of this rank's batch was routed to (two A14B experts): DDP must not wait for them.
        if cfg.parallel.name == "ddp" and (objective.manual or len(spec.trained_experts(cfg.boundary.name)) > 1):
            cfg.parallel.strategy.find_unused_parameters = True

    trainer = build_trainer(cfg, out, context)
    o = cfg.optim
    sp, dp_size = context.sp_size, context.dp_size(trainer)
    effective = int(cfg.data.batch_size) * dp_size * int(cfg.trainer.accumulate_grad_batches)
    lr = scaled_lr(float(o.lr), o.lr_scaling, effective, int(o.reference_batch))
    if trainer.global_rank == 0:
        lrs = f"lr {lr:g} (optim.lr={o.lr:g}, lr_scaling={o.lr_scaling}, reference_batch={o.reference_batch})"
        if objective.manual:  # one optimizer per adapter, with the objective's own settings
            lrs = "lr " + ", ".join(f"{k} {v['lr']:g}" for k, v in objective.optimizer_settings().items()) + \
                f" (objective={objective.name}; each step trains one adapter)"
        ranks = f"{dp_size} data-parallel rank(s) of {sp} device(s) each (parallel.sp_size)" if sp > 1 else \
            f"{trainer.world_size} device(s)"
        print(f"wanexp: effective batch {effective} = {cfg.data.batch_size} per device x {ranks} x "
              f"{cfg.trainer.accumulate_grad_batches} accumulation; {lrs}", flush=True)
        epoch = dm.epoch_line(dp_size)  # each dataset's samples per epoch, a bucket's last step filled on these ranks
        if epoch:
            print(f"wanexp: data: samples per epoch: {epoch}", flush=True)
    module = DiffusionModule(spec, adapter, objective, cfg.boundary, optimizer=build(o.optimizer), lr=lr,
                       schedule={k: o[k] for k in ("scheduler", "warmup_steps", "min_lr_ratio")},
                       max_steps=int(cfg.trainer.max_steps or -1), load_encoders=not dm.cached,
                       allow_resume_changes=bool(cfg.allow_resume_changes),
                       max_bad_steps=int(cfg.guard.max_bad_steps), seed=int(cfg.seed), context=context)
    if ckpt is not None:
        check_resume(module, ckpt, cfg.parallel.name)
    if trainer.global_rank == 0:  # before anything is written or loaded: can the folder hold what the run keeps?
        from wanexp.disk import check_disk, estimate

        check_disk(out, estimate(pre.trained, OmegaConf.to_container(cfg.callbacks, resolve=True),
                                 int(cfg.trainer.max_steps or -1)))
    # Every check passed: the run starts here. Until now it wrote nothing into the run folder.
    if lock is not None:
        take_run_folder(lock, out)
    start_services(trainer)
    if trainer.global_rank == 0:
        if cfg.overwrite and ckpt is None:
            clear_run_folder(out)
        dm.write_held_rejects()  # the data check's reject lists (held since setup: a refused run writes none)
    log_config(trainer, cfg)
    if trainer.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(redacted(OmegaConf.to_container(cfg, resolve=True))))
    if lock is not None:
        lock.started = True
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt, weights_only=True)  # nothing is unpickled
    if trainer.checkpoint_callback is None:  # checkpointing switched off: one checkpoint at the end
        trainer.save_checkpoint(str(out / "checkpoints" / "last.ckpt"))  # collective: every rank calls it
    export = next((c for c in trainer.callbacks if isinstance(c, LoraExport)), None)
    files = [str(f) for f in export.finalize(trainer.global_step)] if export and trainer.global_rank == 0 else []
    return {"output_dir": str(out), "lora_files": files, "checkpoint": str(out / "checkpoints" / "last.ckpt"),
            "global_step": trainer.global_step, "rank": trainer.global_rank, "module": module, "trainer": trainer}


def cli(cfg: DictConfig) -> None:
    """Run a composed config, print where the LoRA files are; bad input or a full disk exits 2 with one line, a bug
    1 with its traceback. A point of a multirun that does not finish raises PointStopped instead of exiting: Hydra
    records it and the sweep goes on to its next point."""
    try:
        _adopt_sweep_folder(cfg)
    except UserError as e:  # the sweep's own settings: every point would be refused alike
        say_error(str(e))
        sys.exit(2)
    config = Path(cfg.paths.output_dir) / "config.yaml"  # written once a run starts: a refused run leaves it as it was
    written = _mtime(config)
    try:
        result = run(cfg)
    except Interrupted as e:
        _finish_wandb(failed=True)
        import signal

        print(f"wanexp: interrupted by {signal.Signals(e.signum).name} at step {e.step}; saved {e.checkpoint}; "
              "continue with resume=last", file=sys.stderr, flush=True)
        sys.exit(e.code)
    except Exception as e:
        from wanexp.disk import stop_line

        _finish_wandb(failed=True)
        line = stop_line(e, cfg.paths.output_dir)  # the user's input or disk: one line; a bug: its traceback
        if line is None:
            traceback.print_exc()
        else:
            say_error(line)
        code = 1 if line is None else 2
        if _in_multirun():
            from wanexp.callbacks.sweep import PointStopped

            state = "refused" if _mtime(config) == written else "failed"
            raise PointStopped(state, line or f"{type(e).__name__}: {e}", code) from None
        sys.exit(code)
    _finish_wandb(failed=False)  # the next point of a sweep starts its own W&B run
    if result["rank"] == 0:
        print("\n".join(end_lines(cfg, result)))


def end_lines(cfg: DictConfig, result: dict) -> list[str]:
    """What a finished run prints (rank 0): the run folder, the first and last logged loss and its plot, the LoRA
    files, and the validation's before/after strip when it wrote one."""
    lines = [f"wanexp: finished {cfg.run_name} at step {result['global_step']}; run folder {result['output_dir']}"]
    trend = loss_trend(Path(result["output_dir"]) / "status.jsonl")
    if trend:
        lines.append("wanexp: training loss {:.4g} at step {} -> {:.4g} at step {}".format(*trend))
    plot = Path(result["output_dir"]) / "loss.png"
    if plot.is_file():
        lines.append(f"wanexp: loss curve {plot}")
    label = "LoRA file" if result["module"].objective.export_checkpoint is None else "exported"
    lines += [f"wanexp: {label} {f}" for f in result["lora_files"]]
    strip = next((c.strip for c in result["trainer"].callbacks if getattr(c, "strip", None)), None)
    if strip is not None:
        lines.append(f"wanexp: before/after strip {strip} (per validation video: a row of the base model's frames, "
                     "then a row of the LoRA's)")
    return lines


def loss_trend(history: Path) -> tuple[float, int, float, int] | None:
    """The first and last logged training loss in DIR/status.jsonl (the status callback's lines): (loss, step, loss,
    step), or None without two logged losses (callbacks.status=null, a run shorter than log_every_n_steps)."""
    if not history.is_file():
        return None
    import json

    lines = [json.loads(x) for x in history.read_text().splitlines() if x.strip()]
    logged = [(x["loss"], x["step"]) for x in lines if x.get("loss") is not None]
    return (*logged[0], *logged[-1]) if len(logged) > 1 else None


USAGE = """usage: python train.py [group=option ...] [key=value ...]     (installed: wanexp-train ...)
Fine-tune Wan2.2 with LoRA (Hydra composes the run from conf/, Lightning runs it). README.md has the details.

examples:
  python train.py experiment=demo                                # tiny random model, generated clips, CPU, ~1 min
  python train.py data=mbc_5k paths.data_dir=/data/mbc model.path=/models/Wan2.2-TI2V-5B-Diffusers
  python train.py model=i2v14b boundary=high adapter.rank=64 model.path=...
  torchrun --nproc_per_node=8 train.py parallel=fsdp run_name=x model.path=...
  python train.py run_name=x resume=last                         # continue a stopped run
  python train.py -m sweep=rank_lr logger=wandb model.path=...   # rank x lr grid; summary in outputs/sweeps/rank_lr
  WANDB_MODE=offline python train.py logger=wandb ...            # W&B without a login; wandb sync DIR/wandb later
  python train.py --cfg job [overrides]                          # print the composed config and stop
related: wanexp-cache (latents + text once), wanexp-status DIR [--follow], wanexp-sample, wanexp-bench
clusters: hydra/launcher=slurm (one SLURM job per sweep point), hydra/sweeper=optuna_lr (lr search); plugins
"""


def main() -> None:
    """``python train.py``: compose with Hydra, then run :func:`cli`. Composition errors are one line, exit 2."""
    hydra_main(cli, USAGE)


def _mtime(path: Path) -> int | None:
    return path.stat().st_mtime_ns if path.exists() else None


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _adopt_sweep_folder(cfg: DictConfig) -> None:
    """Under Hydra: the command line's overrides are kept in the config (``overrides``: config.yaml, the loggers).
    In a multirun, each point runs in Hydra's job folder and is named after its overrides."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    with open_dict(cfg):
        cfg.overrides = list(hc.overrides.task)
    if hc.mode != RunMode.MULTIRUN:
        return
    devices = str(cfg.trainer.devices)
    # a cluster launcher (hydra-submitit-launcher) starts each point's ranks itself: one job per point
    own_job = "submitit" in str(OmegaConf.select(hc, "launcher._target_", default=""))
    if devices != "1" and not (devices == "auto" and _gpu_count() <= 1) and not own_job:
        raise ConfigError(
            f"a multirun sweep with trainer.devices={devices}: each point would relaunch the whole sweep on every rank; "
            "run multi-GPU points with python sweeps/launch.py (same overrides) or hydra/launcher=slurm, "
            "or set trainer.devices=1"
        )
    from wanexp.callbacks.sweep import sweep_folder_keys

    swept = set(sweep_folder_keys(hc.sweep.dir) or ())  # the sweep config's params and the command line's lists
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
    """End this process's W&B run (rank 0 holds one) as the training ended: finished; interrupted by a signal
    (marked preempting, exit code 128 + signal, resumable); or failed (exit code 2 for bad input, else 1), with the
    error's last line in the run summary. Called inside ``cli``'s ``except`` blocks, so the exception is at hand."""
    mod = sys.modules.get("wandb")
    run = getattr(mod, "run", None) if mod is not None else None
    if run is None:
        if failed and mod is not None:  # e.g. a run W&B could not start: its exit lines now, before wanexp's line
            _wandb_teardown(mod)
        return
    error = sys.exc_info()[1] if failed else None
    code = 1 if failed else 0
    try:
        if isinstance(error, Interrupted):
            code = error.code
            run.summary["wanexp/state"] = "interrupted"
            run.mark_preempting()
        elif error is not None:
            code = 2 if isinstance(error, UserError) else 1
            run.summary["wanexp/state"] = "failed"
            run.summary["wanexp/error"] = (str(error).strip().splitlines() or [type(error).__name__])[-1][:500]
        else:
            run.summary["wanexp/state"] = "failed" if failed else "finished"
    finally:
        mod.finish(exit_code=code)
        if failed:
            _wandb_teardown(mod)


def _wandb_teardown(mod) -> None:
    """W&B prints its last lines (where its logs are) when it shuts down, at exit by default: shut it down now, so
    that wanexp's one line, printed after this, is the last line of a failed run."""
    teardown = getattr(mod, "teardown", None)
    if teardown is not None:
        teardown()
