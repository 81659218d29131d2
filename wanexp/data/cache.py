"""The latent/text cache: the family's latents, conditioning and prompt embeddings, encoded once, read by training.

(``python -m wanexp.cli.cache`` writes it.)

Format (readable without wanexp: safetensors + JSON lines)::

    <cache_dir>/latent-r<rank>-<n>.safetensors   tensors "<key>.latents" (C, F, H, W) + "<key>.<name>" for every
                                                 conditioning tensor the family's encoders give (its cond)
    <cache_dir>/text-r<rank>-<n>.safetensors     tensors "<key>.text" (L, D): the prompt's real tokens only
    <cache_dir>/index-r<rank>.jsonl              one line per entry: {"key", "kind", "shard", "tensors", ...}
    <cache_dir>/rejects.jsonl                    samples the cache command could not use, with the reason

Each rank writes its own shards and index, so ranks (and nodes, on shared storage) never write the same file, and a
reader takes the union of the index files. A shard is written under a temporary name and renamed, then its entries
are appended to the index: an interrupted cache loses at most the shards not yet indexed (the one in progress and
those waiting for the writer thread, ShardQueue), and a rerun encodes exactly the entries no index lists. An index
line cut short by a kill is skipped when read, and the next append starts on a new line.

Keys: a latent entry is keyed by the VAE and the family's other media encoders (config, weight files, dtype), what
the encoders store besides the latents (EncoderInfo.cond_id), the media file (path, size, mtime) and each of the
sample's input files (the family's sample_inputs), the bucket shape (frames, height, width), the frame rate the clip
is resampled to, the frame stride and the window start; a text entry by the text encoder, the tokenizer, the text
length and the prompt. A change of any of these invalidates exactly the entries it affects (a new prompt re-encodes
that prompt's text, not its video; a new resolution or frame rate re-encodes latents, not text).
Text is stored at its real length; the reader pads zeros back to the text length, which is exactly what online
encoding feeds the DiT (zeros after each prompt's length).
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import stat
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from wanexp.disk import CACHE_DISK_FULL, saving

INDEX_GLOB = "index-r*.jsonl"


def _digest(parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def file_identity(path: str | os.PathLike) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def latent_key(vae_id: str, media: str, shape: tuple[int, int, int], stride: int, start: int,
               cond_id: object, fps: int | None = None, inputs: list[str] = ()) -> str:
    """``cond_id``: what the encoders store besides the latents (EncoderInfo.cond_id); ``fps``: the rate the clip is
    resampled to (None: its own frames; an image's is None at any rate); ``inputs``: the sample's input files (a
    sample without any keeps the key it had without them)."""
    parts = ["latent", vae_id, file_identity(media), list(shape), stride, start, cond_id, fps]
    return _digest(parts + [[file_identity(p) for p in inputs]] if inputs else parts)


def text_key(text_id: str, text_len: int, prompt: str) -> str:
    return _digest(["text", text_id, text_len, prompt])


def folder_identity(folder: str | os.PathLike, extra: object = None) -> str:
    """An id of a model component folder: its JSON configs' content and its other files' names, sizes, mtimes."""
    parts = [extra]
    for f in sorted(Path(folder).rglob("*")):
        if f.is_file():
            parts.append([f.name, f.read_text() if f.suffix == ".json" else list(file_identity(f))[1:]])
    return _digest(parts)


def _entry(line: str) -> dict | None:
    """An index line's entry; None for a blank line or one a killed run cut short (its entry is encoded again)."""
    if not line.strip():
        return None
    try:
        entry = json.loads(line)
    except json.JSONDecodeError:
        return None
    return entry if isinstance(entry, dict) and {"key", "shard"} <= entry.keys() else None


def _append_lines(path: Path, lines: list[str]) -> None:
    """Appends whole lines and syncs them; a file a killed run left without its last newline gets one first, so that
    the cut line stays apart from these."""
    with open(path, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        torn = False
        if size:
            f.seek(size - 1)
            torn = f.read(1) != b"\n"
        f.write((("\n" if torn else "") + "\n".join(lines) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


class ShardQueue:
    """One background thread that writes the shards handed to it, in order, at most ``depth`` waiting: the encoder
    goes on while a shard is saved, and waits (``wait_s``) only when the disk is slower than it. A failed write is
    raised in the caller at its next ``submit`` or at ``close``; nothing handed over after it is written."""

    def __init__(self, depth: int = 2):
        self._jobs: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.wait_s = 0.0
        self._thread = threading.Thread(target=self._run, name="wanexp-cache-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self.error is None:
                try:
                    job()
                except BaseException as e:  # raised in the caller's thread
                    self.error = e

    def submit(self, job: Callable[[], None]) -> None:
        if self.error is not None:
            raise self.error
        t0 = time.perf_counter()
        self._jobs.put(job)
        self.wait_s += time.perf_counter() - t0

    def close(self, raise_error: bool = True) -> None:
        """Writes what was handed over, then stops the thread (``raise_error=False``: while another error unwinds)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        if self.error is not None and raise_error:
            raise self.error


class CacheIndex:
    """The entries of a cache folder (union of every rank's index) and lazy, per-process access to their tensors."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.entries: dict[str, dict] = {}
        for index in sorted(self.root.glob(INDEX_GLOB)):
            for line in index.read_text().splitlines():
                entry = _entry(line)
                if entry is not None and (self.root / entry["shard"]).is_file():
                    self.entries[entry["key"]] = entry
        self._open: dict[str, object] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def load(self, key: str) -> dict[str, torch.Tensor]:
        entry = self.entries[key]
        shard = entry["shard"]
        if shard not in self._open:
            self._open[shard] = safe_open(str(self.root / shard), "pt")
        handle = self._open[shard]
        return {name: handle.get_tensor(f"{key}.{name}") for name in entry["tensors"]}

    def __getstate__(self):  # DataLoader workers open their own handles
        return {"root": self.root, "entries": self.entries, "_open": {}}


class CacheWriter:
    """Appends entries of one kind for one rank; every ``shard_entries`` entries become one shard (atomic). With
    ``writer`` (a ShardQueue) the shards are saved on its thread, in the same order and bytes as without."""

    def __init__(self, root: str | os.PathLike, kind: str, rank: int = 0, shard_entries: int = 64,
                 writer: ShardQueue | None = None):
        self.root, self.kind, self.rank, self.shard_entries = Path(root), kind, rank, shard_entries
        self.writer = writer
        self.root.mkdir(parents=True, exist_ok=True)
        self.pending: list[tuple[str, dict[str, torch.Tensor], dict]] = []
        self.written_bytes = 0
        self.written = 0
        for leftover in self.root.glob(f".{kind}-r{rank:03d}-*.tmp"):  # a shard a killed run did not finish
            leftover.unlink(missing_ok=True)
        existing = sorted(self.root.glob(f"{kind}-r{rank:03d}-*.safetensors"))
        self.next_shard = 1 + max((int(p.stem.rsplit("-", 1)[1]) for p in existing), default=-1)

    def add(self, key: str, tensors: dict[str, torch.Tensor], **meta) -> None:
        self.pending.append((key, {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, meta))
        if len(self.pending) >= self.shard_entries:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"{self.kind}-r{self.rank:03d}-{self.next_shard:05d}.safetensors"
        self.next_shard += 1  # numbered here, in the caller's order, whichever thread saves it
        entries, self.pending = self.pending, []
        if self.writer is None:
            self._save(name, entries)
        else:
            self.writer.submit(lambda: self._save(name, entries))

    def _save(self, name: str, entries: list) -> None:
        tensors = {f"{key}.{n}": t for key, ts, _ in entries for n, t in ts.items()}
        tmp = self.root / f".{name}.{os.getpid()}.tmp"
        with saving(f"the cache shard {self.root / name}", self.root, **CACHE_DISK_FULL):
            try:
                # one metadata key: safetensors writes several in a varying order, and a shard's bytes would then
                # differ from run to run (the kind is in the shard's name and in the index)
                save_file(tensors, str(tmp), metadata={"format": "pt"})
                # safetensors creates its file 0600; a shard is as readable as the cache folder the umask made
                os.chmod(tmp, stat.S_IMODE(self.root.stat().st_mode) & 0o666)
                os.replace(tmp, self.root / name)
            finally:
                tmp.unlink(missing_ok=True)  # a failed save (a full disk) leaves no temporary shard
            _append_lines(self.root / f"index-r{self.rank:03d}.jsonl",
                          [json.dumps({"key": key, "kind": self.kind, "shard": name, "tensors": sorted(ts), **meta})
                           for key, ts, meta in entries])
        self.written_bytes += (self.root / name).stat().st_size
        self.written += len(entries)

    def close(self) -> None:
        """Hands the last, partial shard over (the writer's close() waits for it)."""
        self.flush()


def padded_text(text: torch.Tensor, text_len: int) -> torch.Tensor:
    """A cached embedding (its real tokens only) zero-padded to the text length, as online encoding feeds the DiT."""
    padded = text.new_zeros((text_len, text.shape[-1]))
    padded[: text.shape[0]] = text
    return padded
