"""A disk that fills up, for runs in the test's process: while ``full``, every write into a file under ``root`` fails
as a full filesystem fails it, in each writer's own form: Python's files (status.json, status.jsonl, the loggers'
CSV, torch.save's checkpoint stream) raise ``OSError`` ENOSPC at the write; safetensors' writer (the LoRA exports,
the cache's shards) raises its ``SafetensorError ... No space left on device (os error 28)``; PyAV's muxer (the
validation videos) an ``OSError`` ENOSPC naming its file. Files are still created, empty (a full disk has inodes
left): what a writer leaves unless it cleans up. ``FullDisk(root).install(monkeypatch)``; set ``full`` to fill the
disk (as another process would) and clear it to free space again; ``names`` (a glob of file names) narrows which
writes fail (the disk has room for small files only, say)."""
from __future__ import annotations

import builtins
import errno
import fnmatch
import io
import os
from pathlib import Path

ENOSPC = os.strerror(errno.ENOSPC)


class FullDisk:
    def __init__(self, root: str | os.PathLike, full: bool = False, names: str = "*"):
        self.root = os.path.abspath(root)
        self.full, self.names = full, names
        self.failed: list[str] = []  # the files a write failed on, in order

    def blocks(self, path) -> bool:
        """Whether a write to ``path`` fails now."""
        if not self.full or isinstance(path, int):
            return False
        p = os.path.abspath(os.fspath(path))
        if p.startswith(self.root + os.sep) and fnmatch.fnmatch(os.path.basename(p), self.names):
            self.failed.append(p)
            return True
        return False

    def install(self, monkeypatch) -> "FullDisk":
        import av
        import safetensors.torch
        from safetensors import SafetensorError

        import wanexp.data.cache
        import wanexp.adapters.export

        real_open, real_save, real_av_open = builtins.open, safetensors.torch.save_file, av.open
        disk = self

        def open_(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            return _Filling(f, file, disk) if any(c in mode for c in "wax+") else f

        def save_file(tensors, filename, metadata=None):
            if disk.blocks(filename):
                real_open(filename, "wb").close()
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            return real_save(tensors, filename, metadata=metadata)

        def av_open(file, mode="r", *args, **kwargs):
            if "w" in str(mode) and disk.blocks(file):
                real_open(file, "wb").close()
                raise OSError(errno.ENOSPC, ENOSPC, str(file))
            return real_av_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)  # pathlib's write_text/open
        for module in (safetensors.torch, wanexp.adapters.export, wanexp.data.cache):
            monkeypatch.setattr(module, "save_file", save_file)
        monkeypatch.setattr(av, "open", av_open)
        return self


class _Filling:
    """A file opened for writing whose writes fail while the disk is full (checked at each write: a file opened
    before the disk filled fails then too)."""

    def __init__(self, f, path, disk: FullDisk):
        self._f, self._path, self._disk = f, path, disk

    def _check(self) -> None:
        if self._disk.blocks(self._path):
            raise OSError(errno.ENOSPC, ENOSPC)  # a write's error names no file

    def write(self, data):
        self._check()
        return self._f.write(data)

    def writelines(self, lines):
        self._check()
        return self._f.writelines(lines)

    def flush(self):
        self._check()
        return self._f.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def temporaries(folder: Path) -> list[str]:
    """The temporary files and folders of writes under ``folder`` (every writer of a run names them ``*.tmp*``)."""
    return sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if ".tmp" in p.name)
