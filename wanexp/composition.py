"""The builders and the pre-flight every command that composes a run shares (train, plan, cache, bench_loader).

``preflight(cfg)`` is the sequence that refuses a bad run before anything loads or is written: the config checks,
the model folder, the model built once on the meta device (the adapters' modules and shapes, the block-swap count,
the trained parameters the disk estimate and the memory plan count), and the memory plan (``wanexp.memory_plan``).
``hydra_main(task)`` is the Hydra entry of every such command: it composes the config and runs ``task`` on it.
"""
from __future__ import annotations

import atexit
import functools
import gc
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from wanexp.config import CONF_DIR, check_config, check_optional_groups, check_paths, one_line_error, register
from wanexp.config.folders import config_roots, shadowed_options, with_user_config_dir
from wanexp.errors import ConfigError, UserError, say_error
from wanexp.runfolder import checkpoint_kind


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


# ---- builders ------------------------------------------------------------------------------------------------------
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


def build_datamodule(cfg: DictConfig, spec, context=None):
    """The run's datamodule (``cfg.data``) with the model's encoder facts and, for a run, its context (None: one
    process). Both are dataclasses, passed past Hydra's instantiate, which would turn them into dicts."""
    extra = {} if context is None else {"context": context}
    return build(cfg.data, _partial_=True, seed=int(cfg.seed))(encoders=spec.encoder_info(), **extra)


def prepare_model_folder(spec, boundary: str) -> None:
    """The model folder a run needs: a tiny model is built into it first (only those have ``build``), then every
    component the run loads is checked (one line naming what is missing, or a weight file whose header shows it
    corrupt or truncated)."""
    if spec.build:
        from wanexp.models.tiny import ensure_tiny_model

        ensure_tiny_model(spec)
    spec.check_folder(spec.trained_experts(boundary))


def check_built_model(spec, adapter, objective, transformers: dict) -> None:
    """What building the model refuses, found before anything loads or is written: each meta-built transformer
    (``ModelSpec.meta_transformers``) is given the run's adapters as the real build gives them (``adapter.init_from``'s
    modules and shapes checked), and ``model.blocks_to_swap`` is held to its blocks. The adapters stay on them."""
    import torch

    from wanexp.models.blockswap import swap_count

    for expert, transformer in transformers.items():
        with torch.device("meta"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter.*")
            for name in objective.adapters:
                adapter.apply(transformer, name)
        swap_count(spec, expert, len(spec.blocks(transformer)))


# ---- the launch ----------------------------------------------------------------------------------------------------
def launch_rank() -> int:
    """This process's global rank as the launcher set it (torchrun/SLURM/Lightning children), before any init."""
    for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


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


# ---- the pre-flight ------------------------------------------------------------------------------------------------
@dataclass
class Preflight:
    """What the pre-flight built and counted: the light components, the trained parameters of the meta-built model
    (``wanexp.disk.trained_parameters``: count, bytes per parameter, bytes of one export) and the memory estimate
    (``wanexp.memory_plan.check_fit``; None: the family gives none)."""

    spec: object
    adapter: object
    objective: object
    trained: tuple[int, int, int] = field(default=(0, 0, 0))
    memory: dict | None = None


def compile_notice(spec) -> str | None:
    """The start line of a run whose model.compile=true (e.g. from an hw preset) the family does not apply, or None."""
    if spec.compile and not spec.compiles_blocks:
        return (f"wanexp: model.compile=true: model={spec.name}'s blocks run uncompiled (the family does not compile "
                "them; set model.compile=false to silence this)")
    return None


def preflight(cfg: DictConfig, verbose: bool = True) -> Preflight:
    """Checks -> model folder -> the model built once on the meta device -> memory plan: a bad run is refused in
    seconds, before Lightning, any weight or any write. ``verbose``: the memory plan's start line (rank 0)."""
    launcher_devices(cfg)
    check_config(cfg, model_folder=True)
    for key, value in (cfg.parallel.env or {}).items():  # before CUDA/NCCL start; children inherit it
        os.environ.setdefault(str(key), str(value))
    from wanexp.gpu_check import check_torch_build  # a GPU this torch build has no kernels for (V100 under CUDA 13)

    check_torch_build(cfg.trainer.accelerator)
    spec, adapter, objective = build(cfg.model), build(cfg.adapter), build(cfg.objective)
    from wanexp.models.fp8 import check_fp8  # model.fp8=true on a GPU without the FP8 GEMM

    check_fp8(spec)
    from wanexp.models.attention import check_attention_kernel  # model.attention_backend=fa4 where it cannot run

    check_attention_kernel(spec.attention_backend, cfg.trainer.accelerator)
    notice = compile_notice(spec)
    if notice and verbose:
        print(notice, flush=True)
    prepare_model_folder(spec, cfg.boundary.name)  # its weight files' headers too (a truncated download)
    check_paths(cfg)
    if int(cfg.parallel.sp_size) > 1:  # sequence parallel splits the heads: checked before any weight loads
        from wanexp.models.sequence import check_heads

        for e in spec.trained_experts(cfg.boundary.name):
            check_heads(int(spec.transformer_config(e)["num_attention_heads"]), int(cfg.parallel.sp_size))
    from wanexp.disk import trained_parameters
    from wanexp.memory_plan import check_fit  # weights + activations, nothing loads

    transformers = spec.meta_transformers(cfg.boundary.name)
    memory = check_fit(cfg, spec, transformers=transformers, verbose=verbose)  # auto: N, and why; then the fit
    trained = trained_parameters(spec, adapter, objective, cfg.boundary.name, transformers)
    check_built_model(spec, adapter, objective, transformers)  # adds the adapters: after the counts
    return Preflight(spec, adapter, objective, trained, memory)


# ---- the Hydra entry -----------------------------------------------------------------------------------------------
def skip_exit_collection() -> None:
    """At exit, after every later-registered handler (W&B, Lightning, loggers, loader workers), move the objects still
    alive out of reach of the interpreter's last garbage collection: it walks every object torch, diffusers and
    Lightning made, 2-3 s per process and rank on the CPU dev machines. Nothing a run keeps waits for it: status,
    checkpoints, LoRA files and the lock are written and closed explicitly before the process ends."""
    atexit.unregister(gc.freeze)  # registered once, also when main runs several times in one process
    atexit.register(gc.freeze)


def print_help(usage: str | None = None) -> None:
    """``--help``: the usage (``usage``, else a line naming this command), the config groups, then the config the
    other arguments compose (what Hydra's own help would print, without the config-group listing that makes it take
    seconds)."""
    from wanexp.config import compose

    overrides = [a for a in sys.argv[1:] if not a.startswith("-")]
    roots = config_roots(sys.argv[1:])  # the shipped conf/ and the user's config folders
    groups = sorted({p.name for root in roots if root.is_dir() for p in root.iterdir()
                     if p.is_dir() and p.name != "hydra"})
    options = {g: sorted({f.stem for root in roots for f in (root / g).glob("*.yaml")}) for g in groups}
    print((usage if usage is not None else f"usage: {Path(sys.argv[0]).name} [group=option ...] [key=value ...] "
           "(the same overrides as python train.py)\n") + "\nconfig groups (group=option):\n" +
          "".join(f"  {g:<11} {', '.join(options[g])}\n" for g in groups) +
          "  (top level)  run_name, seed, tags, resume (null|last|auto|PATH), overwrite, allow_resume_changes, "
          "guard.*\n" + "".join(f"  (your folder) {r}\n" for r in roots if r != CONF_DIR and r.is_dir()), flush=True)
    print("== Config (override any key with key=value; python train.py --cfg job [overrides] prints it resolved) ==\n"
          + OmegaConf.to_yaml(compose(overrides)) + "Hydra's own flags: --hydra-help.", flush=True)


def hydra_main(task, usage: str | None = None) -> None:
    """A command taking the run's overrides (train, cache, plan, bench_loader): compose with Hydra, then run
    ``task(cfg)``. Composition errors are one line, exit 2; ``--help`` prints ``usage`` and the config."""
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from wanexp.callbacks.sweep import PointStopped

    register()
    skip_exit_collection()
    keep_traceback = "HYDRA_FULL_ERROR" in os.environ
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises composition errors to us instead of printing its report

    @functools.wraps(task)
    def composed(cfg: DictConfig):
        from wanexp.config.dataset_files import apply_dataset_file
        from wanexp.config.rules import command_line

        try:  # data.datasets=FILE: its datasets (every point of a sweep would be refused alike)
            apply_dataset_file(cfg, command_line(cfg), say=launch_rank() == 0)
        except UserError as e:
            say_error(str(e))
            sys.exit(2)
        return task(cfg)

    entry = hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")(composed)
    try:
        try:
            sys.argv[1:] = with_user_config_dir(sys.argv[1:])  # ./conf (or WANEXP_CONFIG_DIR) on the search path
            if {"--help", "-h"} & set(sys.argv[1:]):
                print_help(usage)
                return
            check_optional_groups(sys.argv[1:])
        except UserError as e:
            say_error(str(e))
            sys.exit(2)
        shadowed = shadowed_options(config_roots(sys.argv[1:]))
        if shadowed and launch_rank() == 0:
            print(f"wanexp: warning: not used, wanexp ships an option of the same name: {', '.join(shadowed)}; "
                  "rename yours", flush=True)
        entry()
    except PointStopped as e:  # every point ran; the sweep exits with the first stopped point's code
        sys.exit(e.code)
    except (HydraException, OmegaConfBaseException) as e:
        if keep_traceback:
            raise
        say_error(one_line_error(e))
        sys.exit(2)
