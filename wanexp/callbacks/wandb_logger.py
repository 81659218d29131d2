"""Weights & Biases: Lightning's WandbLogger, with the environment respected and the LoRA files as artifacts.

- ``project``, ``entity``, ``group``, ``name``, ``tags``, ``mode``: a null (or empty) value leaves it to W&B, which reads
  ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_RUN_GROUP``, ``WANDB_NAME``, ``WANDB_TAGS``, ``WANDB_MODE``; the
  project falls back to ``wanexp``. ``WANDB_MODE=offline`` writes the run under ``DIR/wandb/`` (``wandb sync`` later).
- Rank 0 only (Lightning's logger gives the other ranks a no-op experiment).
- ``log_lora``: every LoRA export (``DIR/lora/step_N/``, written with each checkpoint) is logged as a version of the
  artifact ``<run name>-lora`` of type ``lora`` (aliases ``latest`` and ``step-N``); Lightning ``.ckpt`` files are
  never uploaded.
- ``resume_from`` (the run's ``resume``): a resumed run continues the W&B run this folder started (its id is kept in
  ``DIR/wandb/wanexp-run-id``); a fresh run starts a new one.
- ``log_videos``: the validation callback's mp4s as ``wandb.Video`` (``val/video/*``, the base model's ``val/base/*``).
- A missing login is one line (exit 2) naming the fixes, before any weight loads.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from wanexp.errors import UserError


class WandbLoginError(UserError):
    """W&B could not start the run (no API key, no network) in online mode."""


def artifact_name(run_name: str) -> str:
    """W&B artifact names allow letters, digits, ``-``, ``_`` and ``.``."""
    return re.sub(r"[^\w.-]+", "-", run_name).strip("-") + "-lora"


class RunWandbLogger(WandbLogger):
    def __init__(self, save_dir: str, project: str | None = None, entity: str | None = None, group: str | None = None,
                 name: str | None = None, tags: list[str] | None = None, mode: str | None = None,
                 log_lora: bool = True, resume_from: str | None = None, **kwargs):
        self.run_folder = Path(save_dir)
        self.log_lora = log_lora
        self._id_file = self.run_folder / "wandb" / "wanexp-run-id"
        run_id = None
        if resume_from is not None and self._id_file.is_file():
            run_id = self._id_file.read_text().strip() or None
        init = {k: v for k, v in dict(entity=entity, group=group, tags=list(tags) if tags else None, mode=mode).items()
                if v is not None}  # left out: W&B reads its WANDB_* variable
        super().__init__(name=name, save_dir=str(self.run_folder), project=project or os.environ.get("WANDB_PROJECT")
                         or "wanexp", id=run_id, log_model=False, **init, **kwargs)
        self._wandb_init.pop("anonymous", None)  # deprecated in W&B: passing it (even None) prints a warning
        self._lora_logged: set[str] = set()

    @property
    def experiment(self):
        started = self._experiment is not None
        if not started and rank_zero_only.rank == 0:  # wandb.init(dir=...) needs it; made when the run starts
            (self.run_folder / "wandb").mkdir(parents=True, exist_ok=True)
        try:
            run = super().experiment
        except UserError:
            raise
        except Exception as e:  # wandb.errors.UsageError / CommError: no API key, no network
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise WandbLoginError(
                f"logger=wandb: W&B could not start the run ({first}); log in (wandb login, or WANDB_API_KEY), or run "
                "offline: WANDB_MODE=offline (or logger.wandb.mode=offline) writes DIR/wandb/, then wandb sync it"
            ) from None
        if not started and rank_zero_only.rank == 0 and getattr(run, "id", None):
            self._id_file.write_text(str(run.id))
        return run

    def after_save_checkpoint(self, checkpoint_callback) -> None:
        """After each checkpoint: its LoRA files (LoraExport wrote them while the checkpoint was built)."""
        if self.log_lora:
            self.log_lora_exports()

    @rank_zero_only
    def log_lora_exports(self) -> None:
        """Each LoRA export folder not logged yet, oldest first, as the next version of ``<run>-lora``."""
        import wandb

        root = self.run_folder / "lora"
        for folder in sorted(root.glob("step_*")):
            files = sorted(f for f in folder.glob("*.safetensors") if not f.name.startswith("."))
            if str(folder) in self._lora_logged or not files:
                continue
            step = int(re.sub(r"\D", "", folder.name) or 0)
            art = wandb.Artifact(artifact_name(self._name or self.experiment.name or "run"), type="lora",
                                 metadata={"step": step, "files": [f.name for f in files]})
            for f in files:
                art.add_file(str(f), name=f.name)
            self.experiment.log_artifact(art, aliases=["latest", f"step-{step}"])
            self._lora_logged.add(str(folder))

    @rank_zero_only
    def log_videos(self, videos: dict[str, tuple[str, str]], step: int, fps: int = 16) -> None:
        """Validation videos: ``key -> (mp4 file, caption)``, logged as ``wandb.Video`` at ``step``."""
        import wandb

        self.experiment.log({**{k: wandb.Video(f, caption=c, fps=fps, format="mp4") for k, (f, c) in videos.items()},
                             "trainer/global_step": step})

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._experiment is not None and self.log_lora:
            self.log_lora_exports()
