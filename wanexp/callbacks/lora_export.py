"""LoRA files (ComfyUI + diffusers, one pair per trained expert) with every checkpoint and at the end of a run."""
from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import Callback

from wanexp.lora import export_lora

EXPERT_SUFFIX = {"dense": "", "high": "_high_noise", "low": "_low_noise"}


def export_all(pl_module, out_dir: Path, meta: dict) -> list[Path]:
    files = []
    for expert, transformer in pl_module.transformers.items():
        stem = f"{pl_module.spec.name}_lora{EXPERT_SUFFIX[expert]}"
        files += export_lora(transformer, out_dir, stem, meta=dict(meta, expert=expert))
    return files


class LoraExport(Callback):
    def __init__(self, output_dir: str):
        self.root = Path(output_dir) / "lora"
        self.final_files: list[Path] = []

    def _meta(self, trainer, pl_module) -> dict:
        lc = pl_module.objective.lora
        return {"wanexp_model": pl_module.spec.name, "wanexp_step": trainer.global_step,
                "wanexp_boundary": pl_module.boundary_name, "wanexp_targets": ",".join(lc["targets"])}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_rank == 0:
            export_all(pl_module, self.root / f"step_{trainer.global_step:06d}", self._meta(trainer, pl_module))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            self.final_files = export_all(pl_module, self.root / "final", self._meta(trainer, pl_module))
