"""Adapter files (ComfyUI + diffusers where diffusers loads the kind; one set per trained expert) with every
checkpoint and at the end of a run; with ``callbacks.ema`` the EMA weights' files beside them (``_ema`` after the
adapter kind in their names, the same formats).

The weights come from the checkpoint's state dict, which every strategy has already gathered on rank 0 (DDP: the
module's own; FSDP: the full LoRA tensors), so export never needs its own collectives.

Each export is written into a temporary folder that is renamed to ``lora/step_NNNNNN`` once complete, and a pruned
export is renamed to a temporary name before it is deleted: a ``step_*`` folder is always a whole export, whatever
moment a kill comes (the run's next start removes the temporaries: runfolder.remove_stale_temporaries).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from lightning.pytorch.callbacks import Callback

from wanexp.disk import disk_full_message, is_disk_full
from wanexp.errors import ConfigError, UserError

EXPERT_SUFFIX = {"dense": "", "high": "_high_noise", "low": "_low_noise"}
STEP_FOLDER = re.compile(r"step_(\d+)")
FLAG_FILE = ".flagged"  # in an export flagged as diverged: status.json lists its files, so it is never pruned


class LoraExportWriteError(UserError):
    """A LoRA export could not be written (disk full, read-only folder); the previous exports are intact."""


class LoraExport(Callback):
    """``flag_above``: an export holding a weight with a magnitude above this (or a non-finite one) is flagged as
    diverged: a warning, and ``lora_flagged`` in status.json lists the step, the expert and the largest magnitude.

    Retention: the newest ``keep_last`` step exports (-1: all), every export whose step is a multiple of
    ``keep_every`` (null/0: none) and every flagged one are kept; the others are pruned, oldest first, once a new
    export is complete. ``final`` is a copy of the last step's export."""

    def __init__(self, output_dir: str, flag_above: float, keep_last: int = 3, keep_every: int | None = None):
        if int(keep_last) == 0 or int(keep_last) < -1:
            raise ConfigError(f"callbacks.lora_export.keep_last={keep_last}: must be >= 1 (the newest export is always "
                              "kept) or -1 (keep every export)")
        self.root = Path(output_dir) / "lora"
        self.flag_above = float(flag_above)
        self.keep_last, self.keep_every = int(keep_last), int(keep_every or 0)

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_rank != 0:
            return
        step = trainer.global_step
        target = self.step_dir(step)
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            flagged = self._write(pl_module, checkpoint["state_dict"], step, tmp)
            ema = next((w for c in trainer.callbacks if hasattr(c, "exported")
                        for w in [c.exported(checkpoint)] if w is not None), None)
            if ema is not None:  # callbacks.ema: the EMA weights as files of their own, "ema" in their names
                flagged += self._write(pl_module, ema, step, tmp, tag="_ema")
            if flagged:
                (tmp / FLAG_FILE).write_text(json.dumps(flagged))
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)  # the partial export; the earlier ones are untouched
            if not (isinstance(e, OSError) or is_disk_full(e)):
                raise  # not the disk: a bug keeps its traceback
            raise self._write_error(f"the LoRA export of step {step} ({target})", target, e,
                                    f"{self._previous(target)} and this step's checkpoint was not written") from None
        self._publish(tmp, target)
        for expert, largest, files in flagged:
            self._flag(trainer, expert, largest, [target / Path(f).name for f in files])
        self.prune(newest=step)

    def _write(self, pl_module, state_dict: dict, step: int, folder: Path, tag: str = "") -> list:
        """Every file of one export into ``folder``; returns the flagged experts as (expert, max |weight|, files).
        ``tag`` goes after the adapter kind in each file's name (``_ema``: ``<model>_lora_ema_comfyui.safetensors``)."""
        meta = {"wanexp_model": pl_module.spec.name, "wanexp_step": step,
                "wanexp_boundary": pl_module.boundary_name, **pl_module.objective.export_metadata(),
                **({"wanexp_weights": tag.strip("_")} if tag else {})}
        custom = pl_module.objective.export_checkpoint
        if custom is not None:  # e.g. KD: the student as a pipeline folder
            custom(pl_module, state_dict, folder)
            return []
        flagged = []
        kind = getattr(pl_module.adapter, "kind", "lora")  # the file names say lora, lokr or loha (DoRA: lora)
        for expert, transformer in pl_module.transformers.items():
            prefix = f"transformers.{expert}."
            files = pl_module.adapter.export(state_dict, prefix, transformer, folder,
                                             f"{pl_module.spec.name}_{kind}{tag}{EXPERT_SUFFIX[expert]}",
                                             adapter_name=pl_module.objective.export,
                                             meta=dict(meta, wanexp_expert=expert))
            largest = max((float(v.detach().abs().max()) if torch.isfinite(v).all() else float("inf")
                           for k, v in state_dict.items()
                           if k.startswith(prefix) and pl_module.adapter.is_param(k) and v.numel()), default=0.0)
            if not largest <= self.flag_above:  # also catches inf/nan
                flagged.append((expert, largest, [str(f) for f in files or []]))
        return flagged

    def _previous(self, target: Path) -> str:
        previous = [f for _, f in self.exports() if f != target]
        return f"the previous export {previous[-1].name} is intact" if previous else "no earlier export was touched"

    @staticmethod
    def _write_error(what: str, target: Path, e: Exception, intact: str) -> LoraExportWriteError:
        if is_disk_full(e):
            return LoraExportWriteError(disk_full_message(what, target, intact))
        reason = getattr(e, "strerror", None) or e
        return LoraExportWriteError(f"cannot write {what} ({reason}); {intact}: make the folder writable (or set "
                                    "paths.output_dir elsewhere), then continue with resume=last")

    @staticmethod
    def _publish(tmp: Path, target: Path) -> None:
        """Put a complete export under its name; one already there (the same step written again) goes first."""
        old = target.with_name(f".{target.name}.old.tmp")
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)

    def exports(self) -> list[tuple[int, Path]]:
        """This run's complete step exports, oldest first (temporaries are hidden names; links are not ours)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir()
                 if (m := STEP_FOLDER.fullmatch(p.name)) and p.is_dir() and not p.is_symlink()]
        return sorted(found)

    def prune(self, newest: int) -> list[Path]:
        """Delete the step exports outside the retention, oldest first; returns them. Each is renamed to a temporary
        name first, so a kill in the middle leaves only whole exports under ``step_*`` names."""
        if self.keep_last < 0:
            return []
        exports = self.exports()
        recent = {s for s, _ in exports[-self.keep_last:]} | {newest}
        pruned = []
        for step, folder in exports:
            if step in recent or (self.keep_every and step % self.keep_every == 0) or (folder / FLAG_FILE).exists():
                continue
            doomed = folder.with_name(f".{folder.name}.prune.tmp")
            shutil.rmtree(doomed, ignore_errors=True)
            folder.rename(doomed)
            shutil.rmtree(doomed)
            pruned.append(folder)
        return pruned

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
        try:
            shutil.copytree(self.step_dir(step), tmp, symlinks=True,  # a KD student links the teacher's VAE etc.
                            ignore=shutil.ignore_patterns(FLAG_FILE))
        except OSError as e:  # shutil.Error too
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._write_error(f"the final LoRA files ({final})", final, e,
                                    f"the last checkpoint and {self.step_dir(step)} are intact") from None
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return sorted(final.iterdir())
