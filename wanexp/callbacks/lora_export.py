"""LoRA files (ComfyUI + diffusers, one pair per trained expert) with every checkpoint and at the end of a run.

The weights come from the checkpoint's state dict, which every strategy has already gathered on rank 0 (DDP: the
module's own; FSDP: the full LoRA tensors), so export never needs its own collectives.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from lightning.pytorch.callbacks import Callback

EXPERT_SUFFIX = {"dense": "", "high": "_high_noise", "low": "_low_noise"}


class LoraExport(Callback):
    def __init__(self, output_dir: str):
        self.root = Path(output_dir) / "lora"

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_rank != 0:
            return
        meta = {"wanexp_model": pl_module.spec.name, "wanexp_step": trainer.global_step,
                "wanexp_boundary": pl_module.boundary_name}
        for expert, transformer in pl_module.transformers.items():
            pl_module.adapter.export(checkpoint["state_dict"], f"transformers.{expert}.", transformer,
                                     self.step_dir(trainer.global_step),
                                     f"{pl_module.spec.name}_lora{EXPERT_SUFFIX[expert]}",
                                     adapter_name=pl_module.objective.export, meta=dict(meta, wanexp_expert=expert))

    def finalize(self, step: int) -> list[Path]:
        """Copy the last step's files to lora/final (rank 0, after the final checkpoint)."""
        final = self.root / "final"
        tmp = self.root / ".final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(self.step_dir(step), tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return sorted(final.iterdir())
