"""LoRA files (ComfyUI + diffusers, one pair per trained expert) with every checkpoint and at the end of a run.

The weights come from the checkpoint's state dict, which every strategy has already gathered on rank 0 (DDP: the
module's own; FSDP: the full LoRA tensors), so export never needs its own collectives.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from lightning.pytorch.callbacks import Callback

EXPERT_SUFFIX = {"dense": "", "high": "_high_noise", "low": "_low_noise"}


class LoraExport(Callback):
    """``flag_above``: an export holding a weight with a magnitude above this (or a non-finite one) is flagged as
    diverged: a warning, and ``lora_flagged`` in status.json lists the step, the expert and the largest magnitude."""

    def __init__(self, output_dir: str, flag_above: float):
        self.root = Path(output_dir) / "lora"
        self.flag_above = float(flag_above)

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_rank != 0:
            return
        meta = {"wanexp_model": pl_module.spec.name, "wanexp_step": trainer.global_step,
                "wanexp_boundary": pl_module.boundary_name, **pl_module.objective.export_metadata()}
        custom = pl_module.objective.export_checkpoint
        if custom is not None:  # e.g. KD: the student as a pipeline folder
            custom(pl_module, checkpoint["state_dict"], self.step_dir(trainer.global_step))
            return
        for expert, transformer in pl_module.transformers.items():
            prefix = f"transformers.{expert}."
            files = pl_module.adapter.export(checkpoint["state_dict"], prefix, transformer,
                                             self.step_dir(trainer.global_step),
                                             f"{pl_module.spec.name}_lora{EXPERT_SUFFIX[expert]}",
                                             adapter_name=pl_module.objective.export,
                                             meta=dict(meta, wanexp_expert=expert))
            largest = max((float(v.detach().abs().max()) if torch.isfinite(v).all() else float("inf")
                           for k, v in checkpoint["state_dict"].items()
                           if k.startswith(prefix) and ".lora_" in k and v.numel()), default=0.0)
            if not largest <= self.flag_above:  # also catches inf/nan
                self._flag(trainer, expert, largest, files)

    def _flag(self, trainer, expert: str, largest: float, files) -> None:
        entry = {"step": trainer.global_step, "expert": expert, "max_abs": largest,
                 "files": [str(f) for f in files or []]}
        print(f"wanexp: warning: the LoRA files of step {trainer.global_step} ({expert}) hold a weight of magnitude "
              f"{largest:g} > callbacks.lora_export.flag_above={self.flag_above:g}: the run may have diverged "
              "(flagged in status.json as lora_flagged)", flush=True)
        for cb in trainer.callbacks:
            if hasattr(cb, "lora_flagged"):
                cb.lora_flagged(trainer, entry)

    def finalize(self, step: int) -> list[Path]:
        """Copy the last step's files to lora/final (rank 0, after the final checkpoint)."""
        final = self.root / "final"
        tmp = self.root / ".final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(self.step_dir(step), tmp, symlinks=True)  # a KD student links the teacher's VAE etc.
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return sorted(final.iterdir())
