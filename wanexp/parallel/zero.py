"""DeepSpeed ZeRO (stage 1, 2 or 3) for LoRA on a frozen base, through Lightning's DeepSpeedStrategy.

What differs from Lightning's defaults, and why:

- The config is built here (:func:`zero_config`): ZeRO stage, CPU offload of the optimizer state (stage >= 1) and of
  the parameters (stage 3 only), the torch optimizer of ``configure_optimizers`` as DeepSpeed's client optimizer
  (``zero_allow_untested_optimizer``; ``zero_force_ds_cpu_optimizer: false`` so an offloaded optimizer stays the
  torch AdamW and DeepSpeed never JIT-compiles its CPUAdam, which needs a compiler the GPU image may lack).
  Lightning adds the rest from the Trainer: ``bf16: {enabled: true}`` for ``bf16-mixed``/``bf16-true`` (DeepSpeed
  then holds every parameter in bf16, the LoRA's fp32 master copy in its optimizer, and skips a step whose gradients
  are not finite), ``gradient_clipping`` from ``trainer.gradient_clip_val`` (DeepSpeed clips; Lightning's own
  clipping is a no-op under DeepSpeed) and ``gradient_accumulation_steps`` from ``trainer.accumulate_grad_batches``.
- ZeRO-3: the model is *not* built inside ``deepspeed.zero.Init``. The frozen base loads from disk with diffusers'
  ``from_pretrained`` and peft adds LoRA layers and initialises them in place; neither works on zero.Init's empty
  placeholders. Each rank loads the model normally (as under DDP/FSDP) and ``deepspeed.initialize`` partitions it.
- Checkpoints: DeepSpeed writes a folder per checkpoint (only the trainable weights: ``exclude_frozen_parameters``,
  plus the optimizer shards and Lightning's state). It is written under a temporary name and renamed, and the
  ``.ckpt`` name Lightning asked for becomes a small JSON file naming that folder. So ``resume=last|auto``,
  ``last.ckpt``'s link, retention and the run-folder checks see one ``.ckpt`` file per checkpoint as with every other
  strategy; a kill during a save leaves the previous checkpoint intact. A resume needs the same world size (ZeRO
  shards the optimizer state per rank).
- The checkpoint's ``state_dict`` (what the LoRA export reads) holds the full fp32 value of each trainable parameter,
  gathered on every rank collectively (stage 3: the partitions; stage 1/2: the fp32 master copy) and kept on rank 0,
  never the frozen base.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy

from wanexp.config import ConfigError  # wanexp.errors' (parallel imports config only)

POINTER_FORMAT = "wanexp-deepspeed-checkpoint"
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO 1/2, ZeRO-3
BUCKET = 200_000_000  # elements per reduce / all-gather bucket (DeepSpeed's default)

# DiffusionModule.configure_gradient_clipping is overridden for the other strategies; under DeepSpeed it lands in
# DeepSpeedPrecision.clip_gradients, a no-op, and DeepSpeed clips by the config's gradient_clipping instead.
warnings.filterwarnings("ignore", message=r".*DeepSpeed handles gradient clipping internally.*")


def zero_config(stage: int, offload_optimizer: bool = False, offload_parameters: bool = False,
                bucket_size: int = BUCKET) -> dict[str, Any]:
    """The DeepSpeed config for LoRA on a frozen base (no precision, clipping or accumulation keys: Lightning adds
    those from the Trainer). A pure function: no deepspeed import."""
    if stage not in (1, 2, 3):
        raise ConfigError(f"parallel.strategy.stage={stage}: ZeRO stage must be 1, 2 or 3")
    if offload_parameters and stage != 3:
        raise ConfigError(f"parallel.strategy.offload_parameters=true with parallel.strategy.stage={stage}: DeepSpeed "
                          "offloads parameters only under ZeRO stage 3; set parallel.strategy.stage=3 or "
                          "offload_parameters=false")
    zero: dict[str, Any] = {"stage": stage, "contiguous_gradients": True, "overlap_comm": True,
                            "reduce_scatter": True, "reduce_bucket_size": bucket_size}
    if stage < 3:
        zero.update(allgather_partitions=True, allgather_bucket_size=bucket_size)
    else:
        zero.update(stage3_prefetch_bucket_size=bucket_size, stage3_param_persistence_threshold=1_000_000,
                    stage3_max_live_parameters=1_000_000_000, stage3_max_reuse_distance=1_000_000_000,
                    stage3_gather_16bit_weights_on_model_save=False, sub_group_size=1_000_000_000)
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the torch AdamW built by configure_optimizers
        "zero_force_ds_cpu_optimizer": False,  # offload with the torch optimizer: no CPUAdam to compile
        "train_micro_batch_size_per_gpu": 1,  # only for DeepSpeed's throughput log (buckets change the batch)
        "steps_per_print": 10**12,  # wanexp logs the steps
        "wall_clock_breakdown": False,
    }


class ZeroStrategy(DeepSpeedStrategy):
    def __init__(self, *, stage: int, offload_optimizer: bool, offload_parameters: bool, timeout_s: int,
                 **kwargs):
        super().__init__(config=zero_config(stage, offload_optimizer, offload_parameters),
                         exclude_frozen_parameters=True, timeout=timedelta(seconds=timeout_s), **kwargs)

    # ---- building: no zero.Init (see the module docstring) ----------------------------------------------------
    def model_sharded_context(self):
        from contextlib import nullcontext

        self._init_config_if_needed()
        return nullcontext()

    def _initialize_deepspeed_train(self, model) -> None:
        super()._initialize_deepspeed_train(model)
        for opt in self.optimizers:  # DeepSpeed's ZeRO optimizer wraps the torch one: report that one's settings
            inner = getattr(opt, "optimizer", None)
            if not hasattr(opt, "defaults") and inner is not None and hasattr(inner, "defaults"):
                opt.defaults = inner.defaults

    # ---- the checkpoint's state_dict: full trainable tensors on rank 0 ----------------------------------------
    def lightning_module_state_dict(self) -> dict:
        """A collective (every rank calls it, in the same parameter order); rank 0 gets the tensors."""
        return gather_trainable(self.lightning_module, keep=self.is_global_zero)

    # ---- checkpoints: a folder per save, named by a .ckpt pointer file ----------------------------------------
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("storage_options is not supported by the DeepSpeed strategy")
        filepath = Path(self.broadcast(str(filepath)))
        stamp = self.broadcast(time.time_ns())
        folder = f"{filepath.name}.{stamp}.ds"  # unique: a re-save of the same name never touches the old folder
        tmp = filepath.parent / f".{folder}.tmp"
        if self.is_global_zero:
            filepath.parent.mkdir(parents=True, exist_ok=True)
        self.barrier()
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        try:
            self.deepspeed_engine.save_checkpoint(str(tmp), client_state=state, tag="checkpoint",
                                                  exclude_frozen_parameters=self.exclude_frozen_parameters)
            self.barrier()
            if self.is_global_zero:
                os.replace(tmp, filepath.parent / folder)
                write_pointer(filepath, folder)
                remove_orphan_folders(filepath.parent)
        except OSError as e:
            raise ConfigError(
                f"cannot write checkpoint {filepath} ({e.strerror or e}); the previous checkpoint is intact: free space "
                "or make the folder writable (or set paths.output_dir elsewhere), then continue with resume=last"
            ) from None
        finally:
            if self.is_global_zero and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        return super().load_checkpoint(str(checkpoint_folder(checkpoint_path)), weights_only)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            target = checkpoint_folder(path) if path.is_file() else None
            path.unlink(missing_ok=True)
            if target is not None:
                shutil.rmtree(target, ignore_errors=True)


def gather_trainable(module, keep: bool) -> dict:
    """Full fp32 values of the trainable parameters, collectively on every rank; ``keep``: return them (on CPU).

    DeepSpeed's fp32 master copy when its optimizer holds one (ZeRO 1/2/3, all-reduced or all-gathered), else the
    parameter itself, gathered (ZeRO-3) with ``GatheredParameters`` on that one parameter: never the frozen base."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        full = safe_get_full_fp32_param(p) if _has_master(p) else None
        if full is None:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                full = p.detach().float().clone() if keep else None
        if keep:
            out[name] = full.detach().float().cpu()
    return out


def _has_master(p) -> bool:
    return hasattr(p, "_hp_mapping") or hasattr(p, "_z3_optimizer")


# ---- the .ckpt pointer files ---------------------------------------------------------------------------------
def write_pointer(filepath: Path, folder: str) -> None:
    """``filepath`` (the .ckpt name) names its DeepSpeed folder, written atomically (temporary file + rename)."""
    filepath = Path(filepath)
    tmp = filepath.with_name(f".{filepath.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump({"format": POINTER_FORMAT, "deepspeed_folder": folder}, f)
        f.flush()
        os.fsync(f.fileno())
    if filepath.is_symlink():
        filepath.unlink()
    os.replace(tmp, filepath)


def read_pointer(path: Path) -> str | None:
    """The folder a .ckpt pointer names, or None when ``path`` is not a pointer."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
        d = json.loads(head)
    except (OSError, ValueError):
        return None
    return d.get("deepspeed_folder") if isinstance(d, dict) and d.get("format") == POINTER_FORMAT else None


def checkpoint_folder(path) -> Path:
    """The DeepSpeed folder of a checkpoint: the folder a .ckpt pointer (or a link to one) names, or ``path`` when it
    is a DeepSpeed folder itself. One line otherwise (e.g. a checkpoint another strategy wrote)."""
    path = Path(path)
    if path.is_dir():
        return path
    real = path.resolve()
    folder = read_pointer(real)
    if folder is None:
        raise ConfigError(f"resume={path}: not a checkpoint written under parallel=deepspeed (a DeepSpeed checkpoint "
                          "is a .ckpt file naming its folder); resume it with the parallel setting that wrote it")
    target = real.parent / folder
    if not target.is_dir():
        raise ConfigError(f"resume={path}: its DeepSpeed folder {target} is missing; resume from another checkpoint "
                          "of the run (pass its .ckpt file)")
    return target


def model_states_file(path) -> Path:
    """The file of a DeepSpeed checkpoint that holds rank 0's model states and the client state (Lightning's
    checkpoint without its weights and optimizer states: the run's settings, the step):
    ``TAG/mp_rank_00_model_states.pt`` (ZeRO 1 and 2) or ``TAG/zero_pp_rank_0_mp_rank_00_model_states.pt`` (ZeRO-3),
    TAG as the folder's ``latest`` file names it. Read before the run starts (wanexp.train.read_resume_checkpoint);
    one line when it is missing."""
    folder = checkpoint_folder(path)
    latest = folder / "latest"
    tag = latest.read_text().strip() if latest.is_file() else "checkpoint"
    for name in MODEL_STATES:
        if (folder / tag / name).is_file():
            return folder / tag / name
    raise ConfigError(f"resume={path}: its DeepSpeed folder {folder} holds no model states ({tag}/{MODEL_STATES[0]} "
                      "or its ZeRO-3 name); resume from another checkpoint of the run (pass its .ckpt file)")


def remove_orphan_folders(folder: Path) -> list[Path]:
    """DeepSpeed folders no .ckpt pointer names any more (a replaced or retired checkpoint's). Rank 0."""
    named = {read_pointer(p) for p in Path(folder).glob("*.ckpt") if p.is_file()}
    gone = [d for d in Path(folder).glob("*.ds") if d.is_dir() and d.name not in named]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone
