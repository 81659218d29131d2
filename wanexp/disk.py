"""The disk a run needs, checked at its start, and a full disk during a save as one line.

A run keeps ``save_top_k`` step checkpoints plus ``last.ckpt`` and ``keep_last`` LoRA exports plus milestones and
``final``; their sizes follow from the trained parameters, which are counted here on the meta device from the
transformer configs (no weight loads) with the tensor shapes peft gives each adapter kind (``adapter_tensor_shapes``):
a checkpoint holds each trained parameter and AdamW's two fp32 moments, an export the adapter in fp32, once per file
(ComfyUI, and diffusers but for LoHa, which diffusers cannot load).
"""
from __future__ import annotations

import contextlib
import copy
import errno
import io
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from wanexp.errors import ConfigError, UserError

if TYPE_CHECKING:  # wanexp.adapters (peft, torch) is imported where an adapter is sized: a full disk's line needs neither
    from wanexp.adapters.sizing import AdapterSize

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# a full disk while caching: what it keeps and how to go on (disk_full_message's words)
CACHE_DISK_FULL = {"intact": "the entries written before it are kept", "retention": False,
                   "then": "run the same cache command again (it encodes only what is missing)"}
# Writers that do not raise OSError say it in their message: safetensors' Rust writer ("No space left on device (os
# error 28)"), torch.save's zip writer only "unexpected pos" / "file write failed" (its OSError is the __context__).
FULL_TEXT = re.compile(r"no space left on device|disk quota exceeded|os error (28|122)\b", re.IGNORECASE)
MOMENTS = 2  # AdamW: exp_avg and exp_avg_sq, fp32, one of each per trained parameter
HEADER_BYTES = 128  # a safetensors header entry per tensor (name, dtype, shape, offsets), about
CONFIG_BYTES = 1024  # the peft config a diffusers file carries in its header, about
RETENTION_KEYS = "callbacks.lora_export.keep_last / callbacks.checkpoint.save_top_k"


def write_atomic(path: Path, text: str) -> None:
    """``text`` as ``path`` (its folder made), through a temporary file of this process renamed over it: readers never
    see a partial file, and a failed write (a full disk) leaves neither a temporary file nor a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---- a full disk ---------------------------------------------------------------------------------------------------
def _chain(exc: BaseException | None):
    """``exc``, then what it wraps or was raised while handling, innermost last."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it wraps or was raised while handling) is a full disk or quota."""
    return any(isinstance(e, OSError) and e.errno in FULL_ERRNOS or FULL_TEXT.search(str(e)) for e in _chain(exc))


class DiskFullError(UserError):
    """A write found the disk full: the run stops with one line; what was written before is intact."""


@contextlib.contextmanager
def saving(what: str, path: str | Path, intact: str = "the last checkpoint is intact", **message):
    """Around a write: a full disk, in whichever form the writer raises it, becomes a DiskFullError naming ``what``,
    the mount and its free space, and what is ``intact`` (``message``: the rest of :func:`disk_full_message`'s
    words); any other error stays the writer's."""
    try:
        yield
    except Exception as e:
        if not is_disk_full(e):
            raise
        raise DiskFullError(disk_full_message(what, path, intact, **message)) from None


def stop_line(exc: BaseException, out: str | Path, intact: str = "the last checkpoint is intact",
              **message) -> str | None:
    """The one line of an error that stops a command for its user's input or disk, None for a bug: a UserError's
    message (its last line: a loader worker's carries the worker's traceback), also where a later error wraps it (a
    logger's last write on the same full disk), else a full disk met by a writer that does not say it itself (a
    logger's file, a reject list), naming the file where the error does (``out``: the command's folder; ``intact``
    and ``message``: the rest of :func:`disk_full_message`'s words)."""
    user = next((e for e in _chain(exc) if isinstance(e, UserError)), None)
    if user is not None:
        return (str(user).strip().splitlines() or [type(user).__name__])[-1]
    if not is_disk_full(exc):
        return None
    name = next((str(e.filename) for e in _chain(exc) if getattr(e, "filename", None)), None)
    return disk_full_message(name or f"a file in {out}", name or out, intact, **message)


def mount_point(path: str | Path) -> Path:
    """The mount point of the filesystem that holds ``path`` (or would hold it: its nearest existing folder)."""
    p = existing_parent(path)
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def existing_parent(path: str | Path) -> Path:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | Path) -> int:
    return shutil.disk_usage(existing_parent(path)).free


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def disk_full_message(what: str, path: str | Path, intact: str, then: str = "continue with resume=last",
                      retention: bool = True) -> str:
    """One line for a save that hit a full disk: what, where, the ways out (``retention``: a run's, which keeps
    checkpoints and exports), what is intact, and how to go on once there is room."""
    try:
        where = f"{mount_point(path)} ({human(free_bytes(path))} free)"
    except OSError:
        where = str(existing_parent(path))
    lower = f", or lower retention ({RETENTION_KEYS})" if retention else ""
    return f"disk full while saving {what}: free space on {where}{lower}; {intact}; then {then}"


# ---- what a run keeps --------------------------------------------------------------------------------------------
@dataclass
class DiskNeed:
    checkpoint_bytes: int
    checkpoints: int | None  # held at once at most; None: unknown (a run by epochs that keeps all)
    export_bytes: int
    exports: int | None

    @property
    def known(self) -> bool:
        return self.checkpoints is not None and self.exports is not None

    @property
    def total(self) -> int:
        return self.checkpoint_bytes * (self.checkpoints or 0) + self.export_bytes * (self.exports or 0)

    def parts(self) -> str:
        def part(name, n, size):
            return f"{name} {'?' if n is None else n} x {human(size)}"
        return f"{part('checkpoints', self.checkpoints, self.checkpoint_bytes)}, " \
               f"{part('LoRA exports', self.exports, self.export_bytes)}"


def save_steps(max_steps: int, every: int | None) -> list[int] | None:
    """Optimizer steps at which a checkpoint (and its LoRA export) is written: every N and the last; None: unknown."""
    if max_steps <= 0:
        return None
    steps = list(range(every, max_steps + 1, every)) if every else []
    return steps if steps and steps[-1] == max_steps else [*steps, max_steps]


def held_checkpoints(steps: list[int] | None, save_top_k: int | None) -> int | None:
    """Checkpoints on disk at once at most: the kept ones plus the one being written before the oldest goes (whose
    ``last.ckpt`` is a link); callbacks.checkpoint=null (``save_top_k`` None): the one at the end."""
    if save_top_k is None:
        return 1
    if save_top_k < 0:
        return None if steps is None else len(steps)
    return save_top_k + 1 if steps is None else min(save_top_k + 1, len(steps))


def held_exports(steps: list[int] | None, keep_last: int, keep_every: int | None) -> int | None:
    """Step exports kept at the end (the newest ``keep_last`` and every milestone) plus ``final``; while a run goes,
    the export just written before the oldest is pruned takes ``final``'s place."""
    if steps is None:
        return None if keep_last < 0 or keep_every else keep_last + 1
    kept = set(steps if keep_last < 0 else steps[-max(1, keep_last):])
    kept |= {s for s in steps if keep_every and s % keep_every == 0}
    return len(kept) + 1


def trained_parameters(spec, adapter, objective, boundary: str, transformers: dict) -> tuple[int, int, int]:
    """(parameters a checkpoint holds, bytes per parameter there without the moments, bytes of one export) for this
    run, counted on ``transformers`` (ModelSpec.meta_transformers: built on the meta device from the
    transformer configs, no adapters yet): nothing is loaded."""
    import torch

    from wanexp.adapters.sizing import adapter_size

    with torch.device("meta"):
        sizes = [adapter_size(t, adapter) for t in transformers.values()]
        with contextlib.redirect_stdout(io.StringIO()):  # e.g. KD's student: its own line prints when it is built
            students = copy.deepcopy(objective).build_trainable(transformers, spec)
    student = [p for m in students.values() for p in m.parameters() if p.requires_grad]
    n_student = sum(p.numel() for p in student)
    in_checkpoint = sum(s.parameters for s in sizes) * len(objective.adapters) + n_student
    size = max([p.element_size() for p in student] + [4])  # adapter parameters are fp32 (lora.add_lora)
    if objective.export_checkpoint is not None:  # a student folder, counted in fp32
        return in_checkpoint, size, n_student * 4
    return in_checkpoint, size, sum(export_bytes(s, getattr(adapter, "kind", "lora")) for s in sizes)


def export_bytes(size: AdapterSize, kind: str) -> int:
    """One export of one adapter: the ComfyUI file (every tensor in fp32 and the alphas; DoRA's dora_scale is its
    magnitude's size) and, but for LoHa, the diffusers file (peft's tensors and its config), each with its header."""
    comfy = 4 * (size.parameters + size.alphas) + HEADER_BYTES * (size.tensors + size.alphas)
    if kind == "loha":
        return comfy
    return comfy + 4 * size.parameters + HEADER_BYTES * size.tensors + CONFIG_BYTES


def estimate(trained: tuple[int, int, int], callbacks: dict, max_steps: int) -> DiskNeed:
    """What a run holds on disk at most at its retention (``trained``: :func:`trained_parameters`; ``callbacks``: the
    composed callbacks group, resolved)."""
    ckpt, export = callbacks.get("checkpoint"), callbacks.get("lora_export")
    in_checkpoint, size, exported = trained
    steps = save_steps(max_steps, ckpt.get("every_n_train_steps") if ckpt else None)
    return DiskNeed(
        checkpoint_bytes=in_checkpoint * (size + 4 * MOMENTS),
        checkpoints=held_checkpoints(steps, ckpt.get("save_top_k") if ckpt else None),
        export_bytes=exported if export else 0,
        exports=held_exports(steps, int(export.get("keep_last", -1)), export.get("keep_every")) if export else 0)


def written_bytes(out: Path) -> int:
    """Bytes of the checkpoints and LoRA exports already in the run folder (a resumed run): part of what it keeps or
    prunes. Links (``last.ckpt``, a KD student's VAE) are not counted."""
    total = 0
    for sub in ("checkpoints", "lora"):
        for root, _, names in os.walk(out / sub):
            for name in names:
                st = os.lstat(os.path.join(root, name))
                total += st.st_size if not os.path.islink(os.path.join(root, name)) else 0
    return total


def check_disk(out: Path, need: DiskNeed) -> None:
    """Print what the run keeps on disk against the free space of ``out``'s filesystem; refuse (nothing written)
    when it cannot hold it."""
    out = Path(out)
    free, done = free_bytes(out), written_bytes(out)
    more = max(0, need.total - done)
    already = f"; {human(done)} of it already written" if done else ""
    if not need.known:  # a run by epochs that keeps every checkpoint or export: its length is not known yet
        print(f"wanexp: disk: {need.parts()} (trainer.max_steps=-1: the count is not known), {human(free)} free on "
              f"{mount_point(out)}", flush=True)
        return
    if more > free:
        raise ConfigError(f"paths.output_dir={out}: needs ~{human(more)} ({need.parts()}{already}), "
                          f"{human(free)} free; free space or set {RETENTION_KEYS} lower")
    print(f"wanexp: disk: ~{human(need.total)} at the retention set ({need.parts()}{already}), {human(free)} free on "
          f"{mount_point(out)}", flush=True)
