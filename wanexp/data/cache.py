"""The latent/text cache: VAE latents and UMT5 embeddings, encoded once (``python -m wanexp.cli.cache``), read by training.

Format (readable without wanexp: safetensors + JSON lines)::

    <cache_dir>/latent-r<rank>-<n>.safetensors   tensors "<key>.latents" (C, F, H, W) [+ "<key>.image_latent" for I2V]
    <cache_dir>/text-r<rank>-<n>.safetensors     tensors "<key>.text" (L, D): the prompt's real tokens only
    <cache_dir>/index-r<rank>.jsonl              one line per entry: {"key", "kind", "shard", "tensors", ...}
    <cache_dir>/rejects.jsonl                    samples the cache command could not use, with the reason

Each rank writes its own shards and index, so ranks (and nodes, on shared storage) never write the same file, and a
reader takes the union of the index files. A shard is written under a temporary name and renamed, then its entries
are appended to the index: an interrupted cache loses at most the shard in progress, and a rerun encodes exactly the
entries no index lists.

Keys: a latent entry is keyed by the VAE (its config, weight files and dtype), the media file (path, size, mtime),
the bucket shape (frames, height, width), the frame stride and the window start; a text entry by the text encoder,
the tokenizer, the text length and the prompt. A change of any of these invalidates exactly the entries it affects
(a new prompt re-encodes that prompt's text, not its video; a new resolution re-encodes latents, not text).
Text is stored at its real length; the reader pads zeros back to the text length, which is exactly what online
encoding feeds the DiT (zeros after each prompt's length).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_GLOB = "index-r*.jsonl"


def _digest(parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def file_identity(path: str | os.PathLike) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def latent_key(vae_id: str, media: str, shape: tuple[int, int, int], stride: int, start: int,
               image_latent: bool) -> str:
    return _digest(["latent", vae_id, file_identity(media), list(shape), stride, start, image_latent])


def text_key(text_id: str, text_len: int, prompt: str) -> str:
    return _digest(["text", text_id, text_len, prompt])


def folder_identity(folder: str | os.PathLike, extra: object = None) -> str:
    """An id of a model component folder: its JSON configs' content and its other files' names, sizes, mtimes."""
    parts = [extra]
    for f in sorted(Path(folder).rglob("*")):
        if f.is_file():
            parts.append([f.name, f.read_text() if f.suffix == ".json" else list(file_identity(f))[1:]])
    return _digest(parts)


class CacheIndex:
    """The entries of a cache folder (union of every rank's index) and lazy, per-process access to their tensors."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.entries: dict[str, dict] = {}
        for index in sorted(self.root.glob(INDEX_GLOB)):
            for line in index.read_text().splitlines():
                if line.strip():
                    entry = json.loads(line)
                    if (self.root / entry["shard"]).is_file():
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
    """Appends entries of one kind for one rank; every ``shard_entries`` entries become one shard (atomic)."""

    def __init__(self, root: str | os.PathLike, kind: str, rank: int = 0, shard_entries: int = 64):
        self.root, self.kind, self.rank, self.shard_entries = Path(root), kind, rank, shard_entries
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
        self.next_shard += 1
        tensors = {f"{key}.{n}": t for key, ts, _ in self.pending for n, t in ts.items()}
        tmp = self.root / f".{name}.{os.getpid()}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt", "wanexp_cache": self.kind})
        # safetensors creates its file 0600; a shard is as readable as the cache folder the umask made (shared caches)
        os.chmod(tmp, stat.S_IMODE(self.root.stat().st_mode) & 0o666)
        os.replace(tmp, self.root / name)
        lines = [json.dumps({"key": key, "kind": self.kind, "shard": name, "tensors": sorted(ts), **meta})
                 for key, ts, meta in self.pending]
        with open(self.root / f"index-r{self.rank:03d}.jsonl", "a") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.written_bytes += (self.root / name).stat().st_size
        self.written += len(self.pending)
        self.pending = []

    def close(self) -> None:
        self.flush()


def padded_text(text: torch.Tensor, text_len: int) -> torch.Tensor:
    """A cached embedding (its real tokens only) zero-padded to the text length, as online encoding feeds the DiT."""
    padded = text.new_zeros((text_len, text.shape[-1]))
    padded[: text.shape[0]] = text
    return padded
