"""The run folder's lifecycle: its lock, which checkpoint a resume takes, and what a start clears or cleans up.

The lock (``DIR/.lock``, rank 0) is an OS file lock plus a record of its holder (pid, host, start, heartbeat) that a
thread refreshes every few seconds. A second run on a live folder, or ``overwrite=true`` of one, stops with one line
naming the live run. A stale lock is taken over with a warning: one whose holder on this host is dead (the OS lock
went with the process), or, on a filesystem where the OS lock does not reach other hosts or is not supported, one
from another host whose heartbeat is older than ``guard.lock_stale_s``.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from wanexp.errors import ConfigError

CHECKPOINTS = "checkpoints"


class RunLock:
    def __init__(self, out: Path, stale_s: float):
        self.path = Path(out) / ".lock"
        self.stale_s = float(stale_s)
        self.file = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.info = {"pid": os.getpid(), "host": socket.gethostname(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self._created: list[Path] = []  # what acquire() created (a refused run removes it again: see discard)
        self.started = False  # set once the run writes its config: from then on its folder is kept

    def acquire(self) -> None:
        import fcntl

        folders = [p for p in (self.path.parent, *self.path.parent.parents) if not p.exists()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._created = [self.path, *folders] if not self.path.exists() else folders  # innermost first
            f = open(self.path, "a+")
        except OSError as e:
            why = "a file, not a folder" if self.path.parent.is_file() else f"cannot write there ({e.strerror or e})"
            raise ConfigError(f"paths.output_dir={self.path.parent}: {why}; pick a writable folder (paths.output_dir "
                              "or paths.root_dir)") from None
        try:
            os_lock = self._os_lock(f, fcntl.LOCK_EX)
            holder = self._holder(f)
            if holder and self._live(holder, os_lock):
                raise self._live_error(holder)
        except BaseException:
            f.close()
            raise
        if holder is None:  # an unreadable record nobody is rewriting (a holder killed mid-write): stale
            print(f"wanexp: warning: taking over the stale lock of {self.path.parent}: its record is unreadable "
                  "(a holder killed while writing it)", flush=True)
            holder = {}
        if holder:  # the last holder did not release: dead, or alive where the OS lock cannot see it
            age = time.time() - holder.get("heartbeat", 0)
            same_host = holder.get("host") == self.info["host"]
            why = "its process is gone" if same_host else f"no heartbeat for {age:.0f} s (guard.lock_stale_s={self.stale_s:g})"
            print(f"wanexp: warning: taking over the stale lock of {self.path.parent} (pid {holder.get('pid')} on "
                  f"{holder.get('host')}, started {holder.get('started')}): {why}", flush=True)
        self.file = f
        self._beat()
        self._thread = threading.Thread(target=self._heartbeat, name="wanexp-lock-heartbeat", daemon=True)
        self._thread.start()

    def check_free(self) -> None:
        """Refuse (one line) a folder a live run holds, reading its lock only: nothing is created or written. A run
        calls it before its checks read the folder, and takes the lock (:meth:`acquire`) once they all passed."""
        import fcntl

        try:
            f = open(self.path)  # read-only: an absent lock stays absent
        except OSError:  # no lock yet (or one that cannot be read: acquire() says why)
            return
        with f:  # closing it drops the shared OS lock
            os_lock = self._os_lock(f, fcntl.LOCK_SH)
            holder = self._holder(f)
            if holder and self._live(holder, os_lock):
                raise self._live_error(holder)

    def _os_lock(self, f, kind: int) -> bool:
        """Take the OS lock of ``kind`` on the open lock file without waiting: False where the filesystem has none
        (the heartbeat decides alone); one line naming the holder when a live run holds it."""
        import fcntl

        try:
            fcntl.flock(f, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._live_error(self._holder(f) or {}) from None
        except OSError as e:  # e.g. a shared filesystem mounted without lock support
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            return False
        return True

    def _live(self, holder: dict, os_lock: bool) -> bool:
        """Whether the holder a record names still runs, its OS lock being free (or absent): on this host, its pid
        alive where no OS lock could tell; on another host, a heartbeat within ``stale_s``."""
        if holder.get("host") == self.info["host"]:
            return not os_lock and _pid_alive(holder.get("pid"))
        return time.time() - holder.get("heartbeat", 0) < self.stale_s

    def release(self, discard: bool = False) -> None:
        """Unlock; ``discard``: the run was refused before it started, so what acquire() created (the .lock file,
        the run folder and its parents, each only where empty) is removed again: a refused run leaves nothing."""
        self._release()
        if discard:
            for p in self._created:  # the .lock first, then the folders from the innermost
                try:
                    p.rmdir() if p.is_dir() else p.unlink()
                except OSError:  # not empty (someone wrote there meanwhile), or already gone: keep it
                    pass

    def _release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.file is not None:
            try:
                self.file.seek(0)
                self.file.truncate()  # released: the next run finds no holder to take over from
            except OSError:
                pass
            self.file.close()
            self.file = None

    def _beat(self) -> None:
        self.file.seek(0)
        self.file.truncate()
        self.file.write(json.dumps(dict(self.info, heartbeat=time.time())))
        self.file.flush()

    def _heartbeat(self) -> None:
        interval = max(0.05, min(30.0, self.stale_s / 4))
        while not self._stop.wait(interval):
            try:
                self._beat()
            except (OSError, ValueError):  # a full disk or a closed file: the next beat tries again
                pass

    @staticmethod
    def _holder(f, tries: int = 5) -> dict | None:
        """The holder's record: {} when there is none, None when it stays unreadable. A live holder rewrites it
        whole within microseconds (its heartbeat), so a record caught mid-write reads whole a moment later."""
        for attempt in range(tries):
            f.seek(0)
            text = f.read().strip()
            try:
                holder = json.loads(text) if text else {}
                return holder if isinstance(holder, dict) else None
            except json.JSONDecodeError:
                if attempt + 1 < tries:
                    time.sleep(0.05)
        return None

    def _live_error(self, holder: dict) -> ConfigError:
        return ConfigError(f"paths.output_dir={self.path.parent} is in use by a live run (pid {holder.get('pid', '?')} "
                           f"on {holder.get('host', '?')}, started {holder.get('started', '?')}); wait for it to end, "
                           "stop it, or give this run another run_name")


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def resume_path(resume: str | None, out: Path) -> str | None:
    """``resume=last``: the newest complete checkpoint of the run; ``resume=auto``: the same, or a fresh start when
    the run has none (a requeued job's first start).

    Every checkpoint under its final name is complete (written under a temporary name, then renamed), so the newest
    is the one written last: ``last.ckpt`` links it, unless a kill came between a save and the link's update."""
    if resume is None:
        return None
    if resume in ("last", "auto"):
        folder = Path(out) / CHECKPOINTS
        files = [p for p in folder.glob("*.ckpt") if p.is_file()]  # a dangling link is not a checkpoint
        if files:
            newest = max(files, key=lambda p: (p.resolve().stat().st_mtime_ns, p.name != "last.ckpt", p.name))
            last = folder / "last.ckpt"
            if last.is_file() and last.resolve() == newest.resolve():
                return str(last)
            return str(newest)
        if resume == "auto":
            return None
        raise ConfigError(f"resume=last: {out} holds no checkpoint yet; start it fresh (resume=null), or pass "
                          "resume=/path/to/file.ckpt")
    return str(resume)


def clear_run_folder(out: Path) -> None:
    """overwrite=true: remove what an earlier run of this folder wrote (rank 0 only, under the lock)."""
    for sub in (CHECKPOINTS, "lora", "logs"):
        shutil.rmtree(Path(out) / sub, ignore_errors=True)
    (Path(out) / "status.json").unlink(missing_ok=True)


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Temporary files of writes a killed process never finished (a SIGKILL runs no cleanup). Called under the lock,
    so no live process of this run is writing them."""
    out = Path(out)
    # lora/**/ covers lora/.final.tmp (a folder) and the LoRA files' temporaries of each step folder
    found = [*out.glob(f"{CHECKPOINTS}/.*.tmp"), *out.glob("lora/**/.*.tmp"), *out.glob(".*.tmp")]
    for p in found:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return found


DEEPSPEED_POINTER = "wanexp-deepspeed-checkpoint"  # the format of parallel=deepspeed's .ckpt files (parallel/zero.py)


def checkpoint_kind(path, parallel: str) -> str:
    """What a ``resume=`` file is, checked by its bytes before anything loads: ``"torch"`` (a Lightning checkpoint:
    torch.save's zip with its ``data.pkl``) or ``"deepspeed"`` (parallel=deepspeed's pointer file or folder).
    Anything else (the run's config.yaml, a LoRA file, an empty or truncated file) is one line naming the file and
    what to pass."""
    import zipfile

    p = Path(path)
    fix = "pass a .ckpt file of the run's checkpoints/ folder, or resume=last (resume=auto)"
    if p.is_dir():
        if parallel == "deepspeed":
            return "deepspeed"
        raise ConfigError(f"resume={p}: is a folder, not a checkpoint file; {fix}")
    size = p.stat().st_size
    if size == 0:
        raise ConfigError(f"resume={p}: the file is empty (0 bytes; a copy or save that did not finish); {fix}")
    with open(p, "rb") as f:
        head = f.read(4096)
    if DEEPSPEED_POINTER.encode() in head:
        if parallel != "deepspeed":
            raise ConfigError(f"resume={p}: a checkpoint written under parallel=deepspeed; resume it with "
                              "parallel=deepspeed (a checkpoint resumes under the parallel setting that wrote it)")
        return "deepspeed"
    entries = []
    if zipfile.is_zipfile(p):
        try:
            with zipfile.ZipFile(p) as z:
                entries = z.namelist()
        except (zipfile.BadZipFile, OSError):
            entries = []
    if any(e.endswith("/data.pkl") or e == "data.pkl" for e in entries):
        return "torch"
    if p.name.endswith(".safetensors"):
        what = "a safetensors file (a LoRA export, not a training checkpoint; to start a new run from a LoRA pass " \
               "adapter.init_from=FILE)"
    elif head.lstrip()[:1] in (b"{", b"#") or p.suffix in (".yaml", ".yml", ".json", ".txt"):
        what = "a text file, not a checkpoint"
    elif entries or head[:2] == b"PK":
        what = "a zip file without a checkpoint's data.pkl (truncated, or not written by torch.save)"
    else:
        what = f"not a Lightning checkpoint ({size} bytes that are not torch.save's zip; truncated or another format)"
    raise ConfigError(f"resume={p}: {what}; {fix}")
