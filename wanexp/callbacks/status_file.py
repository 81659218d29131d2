"""Run status and throughput: DIR/status.json (rank 0, every few seconds), DIR/status.jsonl (one line per logged
step), DIR/loss.png (the loss curve: at checkpoints and validations, at most every ``PLOT_EVERY_S``, and at the run's
end; wanexp.callbacks.loss_plot) and the perf/* metrics.

status.json is rewritten atomically by rank 0 at most every ``every_s`` seconds (a clock throttle: rank 0 alone,
no collective) and at every state change. The per-rank fields (``ranks``: step, loss, samples/s, GPU memory and
utilisation, rejects) are gathered with one collective at the logged steps (every ``trainer.log_every_n_steps``
optimizer steps): a fixed step cadence, so every rank calls it at the same step.
""" 
from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler

from wanexp.callbacks import quiet  # noqa: F401  (imported before the Trainer exists: Lightning's adverts off)
from wanexp.callbacks.progress import optimizer_steps_per_epoch, total_optimizer_steps
from wanexp.context import RunContext, TakesRunContext
from wanexp.disk import DiskFullError, saving, stop_line, write_atomic

PLOT_EVERY_S = 60.0  # DIR/loss.png is redrawn at a checkpoint or a validation at most this often (and at the end)


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


RANK_FIELDS = ("step", "loss", "samples_per_s", "mem_gib", "peak_mem_gib", "gpu_util", "gpu_power_w",
               "gpu_power_limit_w", "gpu_clock_mhz", "rejected_online")


def _number(x) -> float | None:
    """A finite float, or None (JSON has no NaN)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def batch_tokens(batch: dict, spec) -> int:
    """DiT tokens of a loader batch: latent frames x latent patches, from cached latents or from the pixels."""
    patch = getattr(spec, "patch", None)
    stride = getattr(spec, "vae_stride", None)
    if patch is None:
        return 0
    if "latents" in batch:
        b, _, f, h, w = batch["latents"].shape
    elif "pixels" in batch and stride is not None:
        b, _, frames, height, width = batch["pixels"].shape
        f, h, w = (frames - 1) // stride[0] + 1, height // stride[1], width // stride[2]
    else:
        return 0
    return b * (f // patch[0]) * (h // patch[1]) * (w // patch[2])


def _power_limit_w() -> float:
    """The power limit the driver enforces on this process's GPU (W), from NVML."""
    import pynvml

    return pynvml.nvmlDeviceGetEnforcedPowerLimit(torch.cuda._get_pynvml_handler()) / 1000


# what NVML says of this process's GPU: utilisation (%), board power and its limit (W), SM clock (MHz). A card at its
# power limit lowers its clock: the same kernels take longer (docs/performance.md, the power limit).
NVML_READS = (("gpu_util", lambda: torch.cuda.utilization()), ("gpu_power_w", lambda: torch.cuda.power_draw() / 1000),
              ("gpu_power_limit_w", lambda: _power_limit_w()), ("gpu_clock_mhz", lambda: torch.cuda.clock_rate()))


def _gpu() -> dict:
    """This process's GPU memory (GiB) and, where NVML is available, its utilisation, power, power limit and SM
    clock (:data:`NVML_READS`); empty on CPU."""
    if not torch.cuda.is_available():
        return {}
    out = {"mem_gib": torch.cuda.memory_allocated() / 2**30, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
    for key, read in NVML_READS:
        try:
            out[key] = float(read())
        except Exception:  # no pynvml / NVML, or this reading unsupported on the card: not reported
            pass
    return out


def time_before(previous: dict) -> float:
    """Seconds the run trained in its earlier sessions, from the status.json the last of them left (0 for none)."""
    if previous.get("elapsed_total_s") is not None:
        return float(previous["elapsed_total_s"])
    return float(previous.get("elapsed_before_s") or 0.0) + float(previous.get("elapsed_s") or 0.0)


def dataset_metrics(report: dict) -> dict:
    """Each dataset's rows, rejects and samples per epoch (repeats included), as logged metrics (W&B, CSV)."""
    out = {}
    for name, d in (report.get("datasets") or {}).items():
        for key in ("rows", "rejected", "samples"):
            if d.get(key) is not None:
                out[f"data/{name}/{key}"] = float(d[key])
    return out


class RunStatus(TakesRunContext, Callback):
    """status.json: state (running/finished/failed/interrupted), step of total, ETA, loss, lr, throughput, memory,
    the last checkpoint, rejects and per-rank fields; also logs perf/* (samples/s, tokens/s, TFLOP/s, % of peak,
    memory, loader wait; the averages since the last logged step) and ``train/grad_norm`` (before clipping) at logged
    steps; between them it reads nothing from the device (no host sync in the step).

    ``every_s``: status.json is rewritten at most this often (rank 0). ``peak_tflops``: the accelerator's peak for
    ``perf/pct_of_peak`` (null: not logged; never on CPU).
    """

    def __init__(self, output_dir: str, run_name: str, every_s: float = 5.0, peak_tflops: float | None = None):
        self.path = Path(output_dir) / "status.json"
        self.history = Path(output_dir) / "status.jsonl"
        self.run_name = run_name
        self.every_s = float(every_s)
        self.peak_tflops = peak_tflops
        self.t_last: float | None = None
        self.samples = self.tokens = 0
        self.flops = 0.0  # model FLOPs since the last optimizer step, from each training_step's output
        self.seen = self.rejected = 0  # samples this rank trained on / replaced because they failed to decode
        self._others_rejected = 0  # the other ranks' online rejects, as of the last gather
        self._step = 0  # global step at the last optimizer step seen
        self._recent: deque = deque(maxlen=50)  # (seconds, samples, tokens) of the last optimizer steps
        self._t_written = 0.0
        self._perf: dict = {}
        self._window = [0.0, 0, 0, 0.0]  # seconds, samples, tokens, FLOPs since the last log step
        self._window_start = 0  # global step at the last log step
        self._loss_read: float | None = None  # the loss and skipped steps as last read from the device
        self._skipped_read = 0
        self._lr: float | None = None  # the learning rate the last optimizer step used (warm-up included)
        self.state: dict = {}
        self._plotted = 0.0  # when DIR/loss.png was last written (monotonic); None: plotting is off for this run

    # ---- writing ---------------------------------------------------------------------------------------------
    def _write(self, trainer, **extra) -> None:
        if trainer.global_rank != 0:
            return
        self.state.update(extra, run_name=self.run_name, step=trainer.global_step, epoch=trainer.current_epoch,
                          max_steps=trainer.max_steps, world_size=trainer.world_size, updated=time.time())
        self._t_written = time.monotonic()
        with saving(f"the run status ({self.path})", self.path):  # a full disk: the run stops with one line
            write_atomic(self.path, json.dumps(self.state, indent=2, default=str))

    def _append(self, path: Path, entries: list[dict]) -> None:
        """JSON lines appended to ``path`` (status.jsonl, the online rejects)."""
        with saving(f"the run status ({path})", path), open(path, "a") as f:
            f.write("".join(json.dumps(e) + "\n" for e in entries))

    def _progress(self, trainer, read_device: bool = True) -> dict:
        """Step of total, ETA (from the last steps' pace), throughput, loss, the lr of the last step, memory,
        checkpoint, rejects, elapsed time (the session's and the run's); the loss is read from the device only when
        ``read_device`` (logged steps, the end), else the last value read."""
        total = total_optimizer_steps(trainer)
        seconds = sum(r[0] for r in self._recent)
        per_step = seconds / len(self._recent) if self._recent else None
        if read_device:
            self._loss_read = _number(trainer.callback_metrics.get("train/loss"))
        loss = self._loss_read
        ckpt = trainer.checkpoint_callback
        last = getattr(ckpt, "_last_checkpoint_saved", "") or getattr(ckpt, "last_model_path", "") or None
        out = {"total_steps": total or None,
               "eta_s": _number(per_step * max(0, total - trainer.global_step)) if per_step and total else None,
               "step_time_s": _number(per_step),
               "samples_per_s": _number(sum(r[1] for r in self._recent) / seconds) if seconds else None,
               "tokens_per_s": _number(sum(r[2] for r in self._recent) / seconds) if seconds else None,
               "loss": _number(loss), "lr": self._lr,
               "last_checkpoint": last, "rejected_online": self.rejected + self._others_rejected,
               **self._elapsed()}
        for k in ("tflops", "pct_of_peak", "loader_wait_frac"):
            if k in self._perf:
                out[k] = _number(self._perf[k])
        out.update({k: _number(v) for k, v in _gpu().items()})
        return out

    def _elapsed(self) -> dict:
        """This session's seconds since training started, and the run's over all its sessions."""
        session = time.time() - self.state.get("started", time.time())
        return {"elapsed_s": session, "elapsed_total_s": self.state.get("elapsed_before_s", 0.0) + session}

    def _plot_loss(self, trainer, final: bool = False) -> None:
        """DIR/loss.png (wanexp.callbacks.loss_plot), rank 0: at the end of the run (``final``), else at most every
        ``PLOT_EVERY_S``. Never stops the run: without matplotlib, or on any failure, one line and no more plots."""
        if trainer.global_rank != 0 or self._plotted is None:
            return
        if not final and self._plotted and time.monotonic() - self._plotted < PLOT_EVERY_S:
            return
        from wanexp.callbacks.loss_plot import pyplot, write_loss_plot

        try:
            if pyplot() is None:
                print("wanexp: no loss plot (DIR/loss.png): matplotlib is not installed (pip install matplotlib)",
                      flush=True)
                self._plotted = None
                return
            write_loss_plot(self.path.parent, title=f"{self.run_name}: loss")
            self._plotted = time.monotonic()
        except Exception as e:  # a plot is never worth a run
            print(f"wanexp: the loss plot {self.path.parent / 'loss.png'} was not written ({type(e).__name__}: {e}); "
                  "training goes on", flush=True)
            self._plotted = None

    # ---- hooks -----------------------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self.t_last = None  # set at the session's first training batch (on_train_batch_start)
        self._step = self._window_start = trainer.global_step
        opt = trainer.optimizers[0] if trainer.optimizers else None
        import socket

        before = 0.0
        if trainer.global_rank == 0:
            self._trim_history(trainer.global_step)
            if trainer.global_step > 0 and self.path.exists():  # a resumed run: its earlier sessions' time
                try:
                    before = time_before(json.loads(self.path.read_text()))
                except (OSError, ValueError, TypeError):
                    before = 0.0
        self._write(trainer, state="running", host=socket.gethostname(), pid=os.getpid(), started=time.time(),
                    elapsed_before_s=before,
                    steps_per_epoch=optimizer_steps_per_epoch(trainer), total_steps=total_optimizer_steps(trainer),
                    start_step=trainer.global_step,
                    batches_per_epoch=trainer.num_training_batches,
                    accumulate_grad_batches=trainer.accumulate_grad_batches,
                    data=getattr(trainer.datamodule, "report", None),
                    optimizer=None if opt is None else {"name": type(opt).__name__,
                                                        "base_lr": opt.param_groups[0].get("initial_lr",
                                                                                           opt.param_groups[0]["lr"]),
                                                        "fused": bool(opt.defaults.get("fused"))})
        report = getattr(trainer.datamodule, "report", None) or {}
        if "rejected" in report and trainer.global_rank == 0:
            for lg in trainer.loggers:  # once: rows rejected before training (reasons in DIR/rejects.jsonl)
                lg.log_metrics({"data/rejected": float(report["rejected"]), "data/rows": float(report["rows"]),
                                **dataset_metrics(report)}, step=trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """The step time, the ETA and the first perf/* window count from the session's first training batch: the
        step-0 validation, which runs before it (the base model's videos; minutes on A14B), is no step; later
        validations recur at their cadence and stay in the pace. (The progress bar counts the same way.)"""
        if self.t_last is None:
            self.t_last = time.perf_counter()
            if isinstance(trainer.profiler, LoaderWait):
                trainer.profiler.take()  # the wait for this batch came before the window: not in its loader wait

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """``train/grad_norm`` (total L2 norm of the trainable gradients, before clipping) at logged steps only:
        a sharded model needs a collective for it, and the cadence is the same on every rank. Also the learning
        rate this step uses (status.json's ``lr``): once the step is taken the schedule has moved to the next one's."""
        if len(trainer.optimizers) <= 1 or optimizer is trainer.optimizers[0]:  # several (DMD): the first's
            self._lr = _number(optimizer.param_groups[0]["lr"])
        if (trainer.global_step + 1) % max(1, trainer.log_every_n_steps):
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:  # DeepSpeed keeps its gradients to itself
            return
        sharded = any(hasattr(g, "to_local") for g in grads)
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        squares = torch.stack(torch._foreach_norm(local)).float().pow(2).sum()
        if sharded and trainer.world_size > 1:
            squares = trainer.strategy.reduce(squares, reduce_op="sum")
        pl_module.log("train/grad_norm", squares.sqrt(), on_step=True, on_epoch=False, rank_zero_only=True,
                      batch_size=1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bs = len(batch["prompt"]) if "prompt" in batch else int(next(iter(batch.values())).shape[0])
        sp = self.run_context.sp_size  # a sequence group of sp ranks shares each sample
        self.samples += bs * trainer.world_size // sp
        self.tokens += batch_tokens(batch, getattr(pl_module, "spec", None)) * trainer.world_size // sp
        self.seen += bs
        if batch.get("rejected"):
            self._reject_online(trainer, batch["rejected"])
        if isinstance(outputs, dict):  # a sample's FLOPs; under sequence parallel each rank computes 1/sp of them
            self.flops = self.flops + outputs.get("flops", 0.0) / sp
        if trainer.global_step == self._step:
            return  # accumulating: no optimizer step yet
        self._step = trainer.global_step
        now = time.perf_counter()
        dt, self.t_last = now - self.t_last, now
        self._recent.append((dt, self.samples, self.tokens))
        window = self._window
        for i, v in enumerate((dt, self.samples, self.tokens, self.flops)):
            window[i] += v
        self.samples = self.tokens = 0
        self.flops = 0.0
        # Logged at log steps only, as the window's averages since the last one: ``self.log`` of a number is a blocking
        # host-to-device copy on a GPU, and without a sync per step the host's per-step times are not the GPU's (over
        # a window that ends in the log step's sync they are).
        if RunContext.logs_this_step(trainer):
            self._log_window(trainer, pl_module)
        logged_step = trainer.global_step % max(1, trainer.log_every_n_steps) == 0
        ranks = self._gather(trainer) if logged_step else None  # a collective: the same steps on every rank
        if trainer.global_rank != 0:
            return
        if logged_step:
            pl_module.log("data/rejected_online", float(self.rejected + self._others_rejected), on_step=True,
                          on_epoch=False, rank_zero_only=True, batch_size=1)
        if ranks is not None or time.monotonic() - self._t_written >= self.every_s:
            progress = self._progress(trainer, read_device=logged_step)
            extra = {"ranks": ranks} if ranks is not None else {}
            self._write(trainer, **progress, **extra, skipped_steps=self._skipped(pl_module, logged_step))
            if logged_step:
                self._append_history(trainer, progress)

    def _log_window(self, trainer, pl_module) -> None:
        seconds, samples, tokens, flops = self._window
        self._window = [0.0, 0, 0, 0.0]
        steps = trainer.global_step - self._window_start
        self._window_start = trainer.global_step
        if seconds <= 0 or steps <= 0:
            return
        metrics = {"perf/samples_per_s": samples / seconds, "perf/tokens_per_s": tokens / seconds,
                   "perf/step_time_s": seconds / steps}
        if flops > 0:  # a family without a FLOP formula (ModelSpec.step_flops None) counts none: no TFLOP/s
            metrics["perf/tflops"] = flops / seconds / 1e12  # per device
            if self.peak_tflops and torch.cuda.is_available():
                metrics["perf/pct_of_peak"] = 100.0 * metrics["perf/tflops"] / float(self.peak_tflops)
        if isinstance(trainer.profiler, LoaderWait):
            metrics["perf/loader_wait_frac"] = trainer.profiler.take() / seconds
        if torch.cuda.is_available():
            metrics["perf/peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            metrics["perf/mem_gib"] = torch.cuda.memory_allocated() / 2**30
        self._perf = {k.split("/", 1)[1]: v for k, v in metrics.items()}
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    def _skipped(self, pl_module, read_device: bool) -> int:
        """Skipped steps (a device counter): read at logged steps, the last value read in between."""
        if read_device:
            self._skipped_read = getattr(pl_module, "skipped_steps", 0)
        return self._skipped_read

    def _gather(self, trainer) -> list[dict] | None:
        """Per-rank fields, gathered to every rank (one all_gather of a few numbers)."""
        loss = trainer.callback_metrics.get("train/loss")
        recent = list(self._recent)[-max(1, trainer.log_every_n_steps):]
        seconds = sum(r[0] for r in recent)
        own = {"step": trainer.global_step, "loss": loss,
               "samples_per_s": sum(r[1] for r in recent) / trainer.world_size / seconds if seconds else None,
               **_gpu(), "rejected_online": self.rejected}
        row = torch.tensor([float("nan") if own.get(k) is None else float(own[k]) for k in RANK_FIELDS],
                           dtype=torch.float64, device=trainer.strategy.root_device)
        rows = trainer.strategy.all_gather(row).reshape(-1, len(RANK_FIELDS)) if trainer.world_size > 1 else row[None]
        out = []
        for rank, values in enumerate(rows.cpu().tolist()):
            entry = {"rank": rank, **{k: _number(v) for k, v in zip(RANK_FIELDS, values)}}
            entry["step"] = int(entry["step"]) if entry["step"] is not None else None
            entry["rejected_online"] = int(entry["rejected_online"] or 0)
            out.append(entry)
        self._others_rejected = sum(e["rejected_online"] for e in out) - self.rejected
        return out

    def _append_history(self, trainer, progress: dict) -> None:
        line = {"step": trainer.global_step, "time": time.time(), "loss": progress.get("loss"),
                "lr": progress.get("lr"), "samples_per_s": progress.get("samples_per_s")}
        val = trainer.callback_metrics.get("val/loss")
        if val is not None:
            line["val_loss"] = _number(val)
        self._append(self.history, [line])

    def validated(self, trainer, metrics: dict) -> None:
        """Called by the Validation callback (rank 0) with its ``val/*`` numbers: one status.jsonl line for the step
        (the sweep summary merges it with the step's training line) and ``val_loss``/``validation`` in status.json."""
        if trainer.global_rank != 0:
            return
        vals = {k.split("/", 1)[1]: _number(v) for k, v in metrics.items()}
        line = {"step": trainer.global_step, "time": time.time(), "val": vals}
        if "loss" in vals:
            line["val_loss"] = vals["loss"]
        self.history.parent.mkdir(parents=True, exist_ok=True)
        self._append(self.history, [line])
        extra = {"val_loss": vals["loss"]} if "loss" in vals else {}
        self._write(trainer, **extra, validation={"step": trainer.global_step, **vals})
        self._plot_loss(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._plot_loss(trainer)

    def _trim_history(self, step: int) -> None:
        """A fresh run starts an empty history; a resumed one drops the lines after its checkpoint's step."""
        if not self.history.exists():
            return
        keep = []
        for raw in self.history.read_text().splitlines():
            try:
                if json.loads(raw)["step"] <= step and step > 0:
                    keep.append(raw)
            except (ValueError, KeyError, TypeError):
                continue
        with saving(f"the run status ({self.history})", self.history):
            write_atomic(self.history, "".join(line + "\n" for line in keep))

    def _reject_online(self, trainer, rejected: list) -> None:
        """Samples that failed to decode during training (each replaced in its batch): listed per rank; past the
        data's max_reject_fraction of what this rank has seen, the run stops with one line."""
        from wanexp.errors import MetadataError

        self.rejected += len(rejected)
        self._append(self.path.with_name(f"rejects-online-r{trainer.global_rank:03d}.jsonl"),
                     [{"kind": "reject", "source": path, "path": path, "reason": reason, "step": trainer.global_step}
                      for path, reason in rejected])
        limit = getattr(trainer.datamodule, "max_reject_fraction", 1.0)
        if self.rejected / max(1, self.seen + self.rejected) > limit:
            raise MetadataError(f"{self.rejected} samples failed to decode during training, more than "
                                f"data.max_reject_fraction={limit} of the {self.seen + self.rejected} drawn (first: "
                                f"{rejected[0][0]}: {rejected[0][1]}); see {self.path.parent}/rejects-online-*.jsonl")
        self._write(trainer, rejected_online=self.rejected + self._others_rejected)

    def on_train_end(self, trainer, pl_module) -> None:
        in_sync = replicas_in_sync(trainer, pl_module)  # a collective: before rank 0 alone goes on
        if trainer.global_rank != 0:
            return
        self._write(trainer, state="finished", **{**self._progress(trainer), "eta_s": 0},
                    skipped_steps=getattr(pl_module, "skipped_steps", 0), replicas_in_sync=in_sync)
        self._plot_loss(trainer, final=True)

    def lora_flagged(self, trainer, entry: dict) -> None:
        """Called by LoraExport for an export whose weights look diverged."""
        self._write(trainer, lora_flagged=self.state.get("lora_flagged", []) + [entry])

    def interrupted(self, trainer, signal_name: str, checkpoint: str | None) -> None:
        """Called by the Preemption callback after it saved: the run stops on a signal and can be resumed."""
        self._write(trainer, state="interrupted", signal=signal_name, checkpoint=checkpoint, last_checkpoint=checkpoint)
        self._plot_loss(trainer, final=True)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.state.get("state") == "interrupted":
            return
        why = stop_line(exception, self.path.parent) or f"{type(exception).__name__}: {exception}"
        try:
            self._write(trainer, state="failed", error=why)
        except DiskFullError:  # the disk is still full: status.json keeps its last state (the run's line says why)
            pass
        self._plot_loss(trainer, final=True)
