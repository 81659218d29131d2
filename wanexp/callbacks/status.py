"""Run status and throughput: DIR/status.json (rank 0) and perf/* metrics."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler

from wanexp.callbacks.progress import optimizer_steps_per_epoch


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def replicas_in_sync(trainer, pl_module) -> bool | None:
    """Data-parallel replicas must hold identical trainable weights; a collective (every rank calls it).

    None when there is nothing to compare (one process, or sharded parameters that differ by design).
    """
    params = [p for p in pl_module.parameters() if p.requires_grad]
    if trainer.world_size == 1 or not params or any(hasattr(p, "full_tensor") for p in params):
        return None
    checksum = torch.stack([p.detach().double().sum() for p in params]).sum().reshape(1)
    gathered = trainer.strategy.all_gather(checksum)
    return bool(torch.allclose(gathered.min(), gathered.max(), rtol=0, atol=1e-9))


class LoaderWait(Profiler):
    """Times only what the training loop spends in ``next()`` on the train loader (Lightning's
    ``train_dataloader_next`` action): the time a step waits for data. The trainer's profiler unless one is set."""

    def __init__(self):
        super().__init__()
        self.seconds = 0.0
        self._t0: float | None = None

    def start(self, action_name: str) -> None:
        if action_name.endswith("train_dataloader_next"):
            self._t0 = time.perf_counter()

    def stop(self, action_name: str) -> None:
        if action_name.endswith("train_dataloader_next") and self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def summary(self) -> str:
        return ""


class RunStatus(Callback):
    """Writes state (running/finished/failed), step, epoch, steps per epoch, loss and samples/s to status.json."""

    def __init__(self, output_dir: str, run_name: str):
        self.path = Path(output_dir) / "status.json"
        self.run_name = run_name
        self.t_last: float | None = None
        self.samples = 0
        self.flops = 0.0  # model FLOPs since the last optimizer step, from each training_step's output
        self.seen = self.rejected = 0  # samples this rank trained on / replaced because they failed to decode

        self.state: dict = {}

    def _write(self, trainer, **extra) -> None:
        if trainer.global_rank != 0:
            return
        self.state.update(extra, run_name=self.run_name, step=trainer.global_step, epoch=trainer.current_epoch,
                          max_steps=trainer.max_steps, world_size=trainer.world_size, updated=time.time())
        write_json_atomic(self.path, self.state)

    def on_train_start(self, trainer, pl_module) -> None:
        self.t_last = time.perf_counter()
        opt = trainer.optimizers[0] if trainer.optimizers else None
        import socket

        self._write(trainer, state="running", host=socket.gethostname(), pid=os.getpid(),
                    steps_per_epoch=optimizer_steps_per_epoch(trainer),
                    batches_per_epoch=trainer.num_training_batches,
                    accumulate_grad_batches=trainer.accumulate_grad_batches,
                    data=getattr(trainer.datamodule, "report", None),
                    optimizer=None if opt is None else {"name": type(opt).__name__, "lr": opt.param_groups[0]["lr"],
                                                        "fused": bool(opt.defaults.get("fused"))})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bs = len(batch["prompt"]) if "prompt" in batch else int(next(iter(batch.values())).shape[0])
        self.samples += bs * trainer.world_size
        self.seen += bs
        if batch.get("rejected"):
            self._reject_online(trainer, batch["rejected"])
        if isinstance(outputs, dict):
            self.flops += float(outputs.get("flops", 0.0))
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        now = time.perf_counter()
        dt, self.t_last = now - self.t_last, now
        sps = self.samples / dt if dt > 0 else 0.0
        self.samples = 0
        metrics = {"perf/samples_per_s": sps, "perf/step_time_s": dt,
                   "perf/tflops": self.flops / dt / 1e12 if dt > 0 else 0.0}
        self.flops = 0.0
        if isinstance(trainer.profiler, LoaderWait):
            metrics["perf/loader_wait_frac"] = trainer.profiler.take() / dt if dt > 0 else 0.0
        if torch.cuda.is_available():
            metrics["perf/peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        loss = trainer.callback_metrics.get("train/loss")
        every = max(1, trainer.log_every_n_steps)
        if trainer.global_step % every == 0:
            self._write(trainer, loss=None if loss is None else float(loss), samples_per_s=sps,
                        skipped_steps=getattr(pl_module, "skipped_steps", 0))

    def _reject_online(self, trainer, rejected: list) -> None:
        """Samples that failed to decode during training (each replaced in its batch): listed per rank; past the
        data's max_reject_fraction of what this rank has seen, the run stops with one line."""
        from wanexp.errors import MetadataError

        self.rejected += len(rejected)
        with open(self.path.with_name(f"rejects-online-r{trainer.global_rank:03d}.jsonl"), "a") as f:
            for path, reason in rejected:
                f.write(json.dumps({"kind": "reject", "source": path, "path": path, "reason": reason,
                                    "step": trainer.global_step}) + "\n")
        limit = getattr(trainer.datamodule, "max_reject_fraction", 1.0)
        if self.rejected / max(1, self.seen + self.rejected) > limit:
            raise MetadataError(f"{self.rejected} samples failed to decode during training, more than "
                                f"data.max_reject_fraction={limit} of the {self.seen + self.rejected} drawn (first: "
                                f"{rejected[0][0]}: {rejected[0][1]}); see {self.path.parent}/rejects-online-*.jsonl")
        self._write(trainer, rejected_online=self.rejected)

    def on_train_end(self, trainer, pl_module) -> None:
        loss = trainer.callback_metrics.get("train/loss")
        self._write(trainer, state="finished", loss=None if loss is None else float(loss),
                    skipped_steps=getattr(pl_module, "skipped_steps", 0),
                    replicas_in_sync=replicas_in_sync(trainer, pl_module))

    def lora_flagged(self, trainer, entry: dict) -> None:
        """Called by LoraExport for an export whose weights look diverged."""
        self._write(trainer, lora_flagged=self.state.get("lora_flagged", []) + [entry])

    def interrupted(self, trainer, signal_name: str, checkpoint: str | None) -> None:
        """Called by the Preemption callback after it saved: the run stops on a signal and can be resumed."""
        self._write(trainer, state="interrupted", signal=signal_name, checkpoint=checkpoint)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.state.get("state") == "interrupted":
            return
        self._write(trainer, state="failed", error=f"{type(exception).__name__}: {exception}")
