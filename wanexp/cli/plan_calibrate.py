"""The calibration run of ``wanexp-plan``: a short real run of the user's config on a few samples of each bucket.

It is the user's run (``wanexp.train.run``: the same strategy, precision, model settings, cache or online encoding,
callbacks) with the data cut to whole batches of every bucket, one optimizer-step count that covers each bucket
``steps_per_bucket`` times, validation and a checkpoint (with its LoRA export) at its last step, and everything written
into a temporary folder. ``PlanTimer``, the first callback, times each batch by its bucket and the memory it peaked at.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

ENV = "WANEXP_PLAN_CALIBRATION"  # the calibration's overrides, for the ranks Lightning starts (they rerun the command)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() and torch.cuda.is_initialized() \
        else None


class PlanTimer(Callback):
    """Times of the calibration run, written as JSON by rank 0 into ``record`` at its end (or when it fails):
    ``setup_s`` (trainer built -> first step: weights, compile set-up), one row per batch (bucket, start, seconds from
    its start to the next batch's start, or to its end when a validation call came between, peak GiB), the first and
    the last validation call's seconds, and ``end_s`` (last batch's end -> train end: validation and the checkpoint
    with its LoRA export, which the run does at its last step)."""

    def __init__(self, record: str):
        self.record = Path(record)
        self.built = time.perf_counter()  # the datamodule is set up before the trainer (train._fit)
        self.rows: list[dict] = []
        self.times: dict = {}

    def _shape(self, trainer, batch) -> list[int] | None:
        ds = getattr(trainer.datamodule, "dataset", None)
        if ds is None or "index" not in batch:
            return None
        return list(ds.shapes[int(batch["index"][0])])

    def on_train_start(self, trainer, pl_module) -> None:
        _sync()
        self.times["setup_s"] = time.perf_counter() - self.built

    @staticmethod
    def _validations(trainer) -> list[dict]:
        return [r for c in trainer.callbacks if type(c).__name__ == "Validation" for r in getattr(c, "results", [])]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _sync()
        now = time.perf_counter()
        validated = len(self._validations(trainer))
        if self.rows and self.rows[-1].get("next") is None:
            # a validation call after the previous batch: that batch ends at its own end
            self.rows[-1]["next"] = now if validated == self.times.get("validations", 0) else self.rows[-1]["end"]
        self.times["validations"] = validated
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.rows.append({"shape": self._shape(trainer, batch), "start": now, "next": None})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _sync()  # the first callback: validation and the checkpoint of this step come after this
        row = self.rows[-1]
        row["end"] = time.perf_counter()
        row["peak_gib"] = _peak_gib()
        row["step"] = trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        _sync()
        end = self.times["train_end"] = time.perf_counter()
        last = self.rows[-1] if self.rows else None
        self.times["end_s"] = end - last["end"] if last else 0.0
        self.times["end_peak_gib"] = _peak_gib()  # since the last batch began: validation's peak
        calls = self._validations(trainer)
        # the first call also loads what later calls reuse (the VAE, the prompts' embeddings)
        self.times["validation_first_s"] = calls[0].get("seconds") if calls else 0.0
        # with a call at the start, the second is the first after training steps (compiled blocks compile once more)
        self.times["validation_second_s"] = calls[1].get("seconds") if len(calls) > 2 else None
        self.times["validation_s"] = calls[-1].get("seconds") if calls else 0.0  # the call at the last step
        self._write(trainer, failed=None)

    def on_exception(self, trainer, pl_module, exception) -> None:
        last = self.rows[-1] if self.rows else None
        self._write(trainer, failed={"shape": last["shape"] if last else None, "error": type(exception).__name__,
                                     "message": (str(exception).strip().splitlines() or [""])[0][:300]})

    def _write(self, trainer, failed) -> None:
        peaks = [r["peak_gib"] for r in self.rows if r.get("peak_gib") is not None]
        peak = max(peaks + [self.times.get("end_peak_gib") or 0.0]) if peaks else None
        if trainer.world_size > 1 and peak is not None and torch.distributed.is_initialized():
            t = torch.tensor([peak], device=torch.device("cuda", torch.cuda.current_device()))
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)  # the fullest rank
            self.times["peak_gib_all_ranks"] = float(t.item())
        if trainer.global_rank != 0:
            return
        self.record.parent.mkdir(parents=True, exist_ok=True)
        self.record.write_text(json.dumps({**self.times, "rows": self.rows, "failed": failed,
                                           "world_size": trainer.world_size}))


def bucket_times(rows: list[dict]) -> dict:
    """Per bucket ("FxHxW"): batches timed, the first batch's seconds, the steady seconds (the fastest batch after the
    first; the first when it is the only one), ``once_s`` (what the bucket's batches took beyond ``batches`` x steady:
    compilation, paid once per run) and the peak GiB. A batch's seconds run from its start to the next batch's start
    (loader, step, callbacks); the last batch's to its own end.

    Compiled blocks compile again, once, for each new kind of call: a bucket's first batch, its first batch with the
    first frame as condition (a per-frame time embedding). Such a batch takes tens of seconds where the others take a
    fraction of one, and it may be any batch of a few; so the steady time is the fastest batch after the first (a
    median of three would take a recompile as the run's pace), and every second above it is counted once."""
    out: dict = {}
    for r in rows:
        if r.get("shape") is None:
            continue
        seconds = (r["next"] if r.get("next") is not None else r.get("end", r["start"])) - r["start"]
        b = out.setdefault("x".join(map(str, r["shape"])), {"times": [], "peaks": []})
        b["times"].append(seconds)
        if r.get("peak_gib") is not None:
            b["peaks"].append(r["peak_gib"])
    result = {}
    for key, b in out.items():
        t = b["times"]
        steady = min(t[1:] or t[:1])
        result[key] = {"batches": len(t), "first_s": t[0], "steady_s": steady,
                       "once_s": max(0.0, sum(t) - len(t) * steady),
                       "peak_gib": max(b["peaks"]) if b["peaks"] else None}
    return result


def choose_subset(shapes: list, keys: list, per_batch: dict, needed_batches: int) -> tuple[list[int], dict, dict]:
    """Indexes of the items to calibrate on: for each bucket, whole batches (``per_batch[bucket]`` samples across
    ranks each) up to ``needed_batches``, in data order. ``keys`` groups items of one file (its windows go
    together). A bucket with fewer items than one batch (the run's batches of it are its items' repeats and weight
    copies, or a last batch filled from the bucket) takes them all, each file ``copies[key]`` times over, for
    ``needed_batches`` batches. Returns (indexes, batches per bucket, copies per file key where above 1)."""
    chosen: list[int] = []
    batches: dict = {}
    copies: dict = {}
    by_bucket: dict = {}
    for i, s in enumerate(shapes):
        by_bucket.setdefault(tuple(s), []).append(i)
    for shape, idx in sorted(by_bucket.items()):
        per = per_batch[shape]
        if len(idx) < per:
            times = math.ceil(needed_batches * per / len(idx))
            copies.update({keys[i]: times for i in idx})
            chosen += idx
            batches[shape] = len(idx) * times // per
            continue
        n = min(needed_batches, len(idx) // per) * per
        files: list = []
        take: list[int] = []
        for i in idx:
            if len(take) >= n and keys[i] not in files:
                break
            if keys[i] not in files:
                files.append(keys[i])
            take.append(i)
        chosen += take
        batches[shape] = len(take) // per
    return sorted(chosen), batches, copies


def steps_for_batches(batches: int, accumulate: int) -> int:
    """Optimizer steps of one epoch of ``batches`` batches per rank (Lightning also steps at an epoch's end)."""
    return math.ceil(batches / max(1, accumulate))
