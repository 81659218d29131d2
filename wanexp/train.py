"""run(cfg): check -> build the components -> seed -> fit -> finish. The one place that instantiates configs.

``main()`` is the ``python train.py`` entry: Hydra composes the config (typed by wanexp/config/schema.py), ``cli``
runs it, and every user-input error, at composition or later, is one line on stderr with exit code 2.
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
import traceback
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from wanexp.config import CONF_DIR, check_config, check_paths, one_line_error, register
from wanexp.errors import ConfigError, Interrupted, UserError, say_error
from wanexp.config.rules import switched_off
from wanexp.runfolder import RunLock, checkpoint_kind, clear_run_folder, remove_stale_temporaries, resume_path


def quiet_warnings() -> None:
    """Drop the library warnings a user cannot act on (each one says why); warnings about their settings stay."""
    # The frozen VAE and text encoder stay in eval mode on purpose; Lightning's pytree shim warns on every batch.
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    # The datamodule resumes the data order itself (wanexp/data/datamodule.py), which Lightning cannot see.
    warnings.filterwarnings("ignore", message=r".*resuming from a checkpoint that ended before the epoch ended.*")
    # Several adapters on one base (DMD: generator + critic) is by design.
    warnings.filterwarnings("ignore", message=r".*Already found a `peft_config` attribute in the model.*")
    # data.num_workers is set per data group (4 for the user's data; the demo's 0 on purpose: loader processes only
    # slow a small CPU run), and from the cache a batch is one file read; python -m wanexp.cli.bench_loader measures
    # what more workers give.
    warnings.filterwarnings("ignore", message=r".*does not have many workers which may be a bottleneck.*")
    # Lightning counts log_every_n_steps over the whole run, not per epoch: an epoch shorter than it (make demo's two
    # clips) still logs every N steps.
    warnings.filterwarnings("ignore", message=r".*is smaller than the logging interval.*")


quiet_warnings()


def instantiate_named(nodes: DictConfig | None) -> list:
    """The generic swap point: one object per named node with a ``_target_`` (a null or false node is off)."""
    return [build(node) for node in (nodes or {}).values() if not switched_off(node)]


def build_datamodule(cfg: DictConfig, spec, context=None):
    """The run's datamodule (``cfg.data``) with the model's encoder facts and, for a run, its context (None: one
    process). Both are dataclasses, passed past Hydra's instantiate, which would turn them into dicts."""
    extra = {} if context is None else {"context": context}
    return build(cfg.data, _partial_=True, seed=int(cfg.seed))(encoders=spec.encoder_info(), **extra)


def build(node: DictConfig, **kwargs):
    """Instantiate one component; a user-input error raised by its constructor stays that error (one line)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as e:
        if isinstance(e.__cause__, UserError):
            raise e.__cause__ from None
        raise


def prepare_model_folder(spec, boundary: str) -> None:
    """The model folder a run needs: a tiny model is built into it first (only those have ``build``), then every
    component the run loads is checked (one line naming what is missing, or a weight file whose header shows it
    corrupt or truncated)."""
    if spec.build:
        from wanexp.models.tiny import ensure_tiny_model

        ensure_tiny_model(spec)
    spec.check_folder(spec.trained_experts(boundary))


def check_built_model(spec, adapter, objective, boundary: str) -> None:
    """What building the model refuses, found before anything loads or is written: each trained expert's transformer
    is built on the meta device from its config.json and given the run's adapters as the real build gives them
    (``adapter.init_from``'s modules and shapes checked), and ``model.blocks_to_swap`` is held to its blocks."""
    import torch

    from wanexp.models.blockswap import swap_count

    for expert in spec.trained_experts(boundary):
        with torch.device("meta"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter.*")  # no values: shapes
            transformer = spec.transformer_type().from_config(spec.transformer_config(expert)).requires_grad_(False)
            for name in objective.adapters:
                adapter.apply(transformer, name)
        swap_count(spec, expert, len(transformer.blocks))


def build_trainer(cfg: DictConfig, out: Path, context=None):
    """The Trainer of a run; ``context`` (a wanexp.context.RunContext) is handed to the callbacks that read it."""
    import lightning as L
    from lightning.pytorch.callbacks import ProgressBar

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
    trainer = L.Trainer(**kwargs, strategy=strategy, logger=loggers or False,
                        callbacks=callbacks, default_root_dir=str(out),
                        enable_progress_bar=any(isinstance(c, ProgressBar) for c in callbacks),
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


def read_resume_checkpoint(ckpt: str, parallel: str) -> dict:
    """A resume's Lightning checkpoint, memory-mapped (only what is read is read: the settings, the step); of a
    DeepSpeed checkpoint, its model states file, which holds the same settings and step. One line when it cannot be
    read or is no wanexp checkpoint. wanexp-plan reads the step of a resume through here too."""
    path = ckpt
    if checkpoint_kind(ckpt, parallel) == "deepspeed":
        from wanexp.parallel.zero import model_states_file

        path = model_states_file(ckpt)
    import torch

    fix = "pass another .ckpt of the run's checkpoints/ folder, or resume=last"
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a damaged zip entry, or content torch.load refuses to unpickle
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"resume={ckpt}: cannot read the checkpoint ({reason}); {fix}") from None
    if not isinstance(checkpoint, dict) or "wanexp" not in checkpoint:
        raise ConfigError(f"resume={ckpt}: not a checkpoint of a wanexp run (it holds no run settings); {fix}")
    return checkpoint


def launcher_devices(cfg: DictConfig, environ=os.environ) -> None:
    """Under torchrun, Lightning takes the ranks from the launcher and needs trainer.devices x trainer.num_nodes to
    match its world: devices=auto (or -1) becomes torchrun's processes per node; a count that differs is one line."""
    if "TORCHELASTIC_RUN_ID" not in environ or "LOCAL_WORLD_SIZE" not in environ:
        return
    local = int(environ["LOCAL_WORLD_SIZE"])
    world = int(environ.get("WORLD_SIZE", local))
    nodes = max(1, world // max(1, local))
    t = cfg.trainer
    devices = OmegaConf.to_container(t.devices) if OmegaConf.is_list(t.devices) else t.devices
    if str(devices).strip() in ("auto", "-1"):
        with open_dict(cfg):
            t.devices = local
    else:
        count = len(devices) if isinstance(devices, list) else \
            len(devices.strip(",").split(",")) if isinstance(devices, str) else int(devices)
        if count != local:
            raise ConfigError(f"trainer.devices={devices} under torchrun with {local} processes per node "
                              f"(LOCAL_WORLD_SIZE={local}): each process drives one device; set "
                              f"trainer.devices={local} (or trainer.devices=auto)")
    if int(t.num_nodes) != nodes:
        raise ConfigError(f"trainer.num_nodes={t.num_nodes} under torchrun with WORLD_SIZE={world} and {local} "
                          f"processes per node: set trainer.num_nodes={nodes}")


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


def launch_rank() -> int:
    """This process's global rank as the launcher set it (torchrun/SLURM/Lightning children), before any init."""
    import os

    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def run(cfg: DictConfig) -> dict:
    """Train one run described by a composed config. Returns paths of what it wrote."""
    # Checks and light components first: a bad run fails in seconds, before Lightning or any weight loads.
    launcher_devices(cfg)
    check_config(cfg, model_folder=True)
    for key, value in (cfg.parallel.env or {}).items():  # before CUDA/NCCL start; children inherit it
        os.environ.setdefault(str(key), str(value))
    from wanexp.gpu_check import check_torch_build  # a GPU this torch build has no kernels for (V100 under CUDA 13)
    check_torch_build(cfg.trainer.accelerator)
    spec, adapter, objective = build(cfg.model), build(cfg.adapter), build(cfg.objective)
    from wanexp.models.fp8 import check_fp8  # model.fp8=true on a GPU without the FP8 GEMM

    check_fp8(spec)
    prepare_model_folder(spec, cfg.boundary.name)  # its weight files' headers too (a truncated download)
    check_paths(cfg)
    if int(cfg.parallel.sp_size) > 1:  # sequence parallel splits the heads: checked before any weight loads
        from wanexp.models.sequence import check_heads

        for e in spec.trained_experts(cfg.boundary.name):
            check_heads(int(spec.transformer_config(e)["num_attention_heads"]), int(cfg.parallel.sp_size))
    from wanexp.models.blockswap import check_fit, resolve_blocks_to_swap  # weights + activations, nothing loads

    resolve_blocks_to_swap(cfg, spec, verbose=launch_rank() == 0)  # model.blocks_to_swap=auto: N, and why
    check_fit(cfg, spec)
    check_built_model(spec, adapter, objective, cfg.boundary.name)

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
        return _fit(cfg, spec, adapter, objective, out, lock)
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


def _fit(cfg: DictConfig, spec, adapter, objective, out: Path, lock: RunLock | None = None) -> dict:
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

        check_disk(out, estimate(spec, adapter, objective, cfg.boundary.name,
                                 OmegaConf.to_container(cfg.callbacks, resolve=True), int(cfg.trainer.max_steps or -1)))
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
    """What a finished run prints (rank 0): the run folder, the first and last logged loss, the LoRA files, and the
    validation's before/after strip when it wrote one."""
    lines = [f"wanexp: finished {cfg.run_name} at step {result['global_step']}; run folder {result['output_dir']}"]
    trend = loss_trend(Path(result["output_dir"]) / "status.jsonl")
    if trend:
        lines.append("wanexp: training loss {:.4g} at step {} -> {:.4g} at step {}".format(*trend))
    label = "LoRA file" if result["module"].objective.export_checkpoint is None else "exported"
    lines += [f"wanexp: {label} {f}" for f in result["lora_files"]]
    strip = next((c.strip for c in result["trainer"].callbacks if getattr(c, "strip", None)), None)
    if strip is not None:
        lines.append(f"wanexp: before/after strip {strip} (the base model's first, middle and last frames, then the "
                     "LoRA's; a row per validation video)")
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


def skip_exit_collection() -> None:
    """At exit, after every later-registered handler (W&B, Lightning, loggers, loader workers), move the objects still
    alive out of reach of the interpreter's last garbage collection: it walks every object torch, diffusers and
    Lightning made, 2-3 s per process and rank on the CPU dev machines. Nothing a run keeps waits for it: status,
    checkpoints, LoRA files and the lock are written and closed explicitly before the process ends."""
    atexit.unregister(gc.freeze)  # registered once, also when main runs several times in one process
    atexit.register(gc.freeze)


def print_help(task=None) -> None:
    """``--help``: the usage, examples and config groups, then the config the other arguments compose (what Hydra's
    own help would print, without the config-group listing that makes it take seconds)."""
    from wanexp.config import compose

    overrides = [a for a in sys.argv[1:] if not a.startswith("-")]
    groups = sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
    print((USAGE if task is None else f"usage: {Path(sys.argv[0]).name} [group=option ...] [key=value ...] "
           "(the same overrides as python train.py)\n") + "\nconfig groups (group=option):\n" +
          "".join(f"  {g.name:<11} {', '.join(sorted(f.stem for f in g.glob('*.yaml')))}\n" for g in groups) +
          "  (top level)  run_name, seed, tags, resume (null|last|auto|PATH), overwrite, allow_resume_changes, "
          "guard.*\n", flush=True)
    print("== Config (override any key with key=value; python train.py --cfg job [overrides] prints it resolved) ==\n"
          + OmegaConf.to_yaml(compose(overrides)) + "Hydra's own flags: --hydra-help.", flush=True)


def main(task=None) -> None:
    """``python train.py`` (or another entry with the same overrides, e.g. the cache command): compose with Hydra,
    then run ``task`` (default :func:`cli`). Composition errors are one line, exit 2."""
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from wanexp.callbacks.sweep import PointStopped

    register()
    skip_exit_collection()
    keep_traceback = "HYDRA_FULL_ERROR" in os.environ
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises composition errors to us instead of printing its report
    entry = hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")(task or cli)
    try:
        if {"--help", "-h"} & set(sys.argv[1:]):
            print_help(task)
            return
        entry()
    except PointStopped as e:  # every point ran; the sweep exits with the first stopped point's code
        sys.exit(e.code)
    except (HydraException, OmegaConfBaseException) as e:
        if keep_traceback:
            raise
        say_error(one_line_error(e))
        sys.exit(2)


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
