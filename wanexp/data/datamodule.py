"""The datamodule: metadata rows -> decoded clips -> batches of one shape (a bucket), resumable mid-epoch.

Each sample is assigned a bucket: a (frames, height, width) shape. Videos train at ``num_frames``; images are one-frame
samples in buckets of their own. With ``buckets`` (a list of [height, width] resolutions) each sample goes to the
resolution whose aspect ratio is closest to its own and is resized to cover it and center-cropped (never distorted).

The batch sampler shards over ranks itself: each optimizer step takes ``world_size x batch`` samples of one bucket and
gives each rank its own slice, so ranks draw disjoint samples and the same number of batches (no collective waits on
a rank that ran out). A bucket's last step is filled with repeats of that bucket's own samples, so every sample of an
epoch trains in it: per rank an epoch is sum over buckets of ceil(n_bucket / (world_size x batch)) batches.

Exact resume: the order of an epoch is a pure function of (seed, epoch), so the data position is two numbers, both
derived from the optimizer steps done (the trainer's global step, which every checkpoint restores) when each pass over
the loader begins: a resumed run skips the batches those steps consumed in their epoch and continues with exactly the
unseen samples, on every rank, whatever Lightning's epoch counter says and however many loader workers prefetch.
(A loader-level state such as torchdata's StatefulDataLoader counts the batch Lightning prefetches, so it resumes one
batch late.)

No stall between epochs: the train loader (``EpochLoader``) draws every epoch's batches in one iteration, each pass
(one per epoch, as Lightning asks for them) a stretch of it, so its workers prefetch the next epoch's first batches
while the last ones of this epoch train, and keep their processes and open cache files from epoch to epoch.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from wanexp.data.cache import CacheIndex, folder_identity, latent_key, padded_text, text_key
from wanexp.data.media import load_clip, load_clip_window
from wanexp.data.metadata import PROMPT_KIND, MetadataError, Reject, Sample, read_metadata_with_rejects, read_prompts
from wanexp.data.prompts import prompt_dataset, prompt_items
from wanexp.context import RunContext
from wanexp.config.rules import frame_rule_problem
from wanexp.disk import write_atomic
from wanexp.errors import ConfigError, MediaError
from wanexp.data.probe import nearest_resolution, probe_samples  # (probe assigns buckets the same way)
from wanexp.data.windows import RANDOM_START, expand, random_start

Shape = tuple[int, int, int]  # (frames, height, width) of a bucket

# what each entry of data.datasets may set (the rest comes from the data group's own keys)
PART_KEYS = ("name", "metadata", "root", "repeat", "weight", "num_frames", "height", "width", "buckets", "fps",
             "frame_stride", "window", "windows_per_clip", "caption_prefix", "caption_extension")


@dataclasses.dataclass
class Part:
    """One dataset of a run (``data.datasets``): its metadata and what its samples train with."""

    name: str
    metadata: Path
    root: str | None
    repeat: int
    num_frames: int
    height: int
    width: int
    resolutions: list | None
    frame_stride: int
    window: str
    windows_per_clip: int
    caption_prefix: str = ""
    weight: float = 1.0  # samples per epoch: items x repeat x weight (see epoch_share)
    fps: int | None = None  # the frame rate its clips are resampled to (None: their own frames)
    caption_extension: str = ".txt"  # a folder's caption files: clip.mp4 + clip<caption_extension>

    @property
    def base(self) -> Path:
        """The folder its samples' paths are taken relative to for the held-out split: root, else the metadata's."""
        return Path(self.root) if self.root else self.metadata.parent

    @property
    def share(self) -> float:
        """How many times over an epoch holds each of this dataset's items: repeat x weight (may be fractional)."""
        return self.repeat * self.weight


def _weight(value, where: str) -> float:
    """A dataset's sampling weight: a finite number >= 0 (0: listed, not trained on)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}.weight={value!r}: must be a number >= 0 (its samples per epoch are items x repeat "
                          "x weight; default 1)")
    return float(value)


def _part(entry, name: str, top: dict, frame_rule: tuple[int, int] = (1, 0)) -> Part:
    """A ``data.datasets`` entry, its missing keys taken from the data group (``top``); one line for a bad entry.
    ``frame_rule``: (m, r), the model's frame counts n keep n % m == r (EncoderInfo.frame_rule)."""
    where = f"data.datasets.{name}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: an entry is a mapping with at least `metadata`; got {entry!r}")
    unknown = sorted(set(entry) - set(PART_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]}; an entry sets {', '.join(PART_KEYS)}")
    if not entry.get("metadata"):
        raise ConfigError(f"{where}: no metadata; set {where}.metadata to its metadata file or folder")
    v = {**top, **{k: val for k, val in entry.items() if val is not None or k in ("root", "buckets")}}
    for key, low in (("repeat", 1), ("num_frames", 1), ("height", 1), ("width", 1), ("frame_stride", 1),
                     ("windows_per_clip", 0)):
        if not isinstance(v[key], int) or isinstance(v[key], bool) or v[key] < low:
            raise ConfigError(f"{where}.{key}={v[key]!r}: must be an integer >= {low}")
    problem = frame_rule_problem(v["num_frames"], frame_rule)
    if problem:
        raise ConfigError(f"{where}.num_frames={v['num_frames']}: {problem}")
    fps = v.get("fps")
    if fps is not None and (not isinstance(fps, int) or isinstance(fps, bool) or fps < 1):
        raise ConfigError(f"{where}.fps={fps!r}: must be an integer >= 1 (the frame rate its clips are resampled "
                          "to), or null for data.fps")
    if v["window"] not in ("first", "uniform", "chunks", "random"):
        raise ConfigError(f"{where}.window={v['window']!r}: one of first, uniform, chunks, random")
    caption_extension = caption_extension_setting(v.get("caption_extension", ".txt"), f"{where}.caption_extension")
    buckets = v["buckets"]
    return Part(name=str(entry.get("name") or name), metadata=Path(str(v["metadata"])), root=v["root"],
                repeat=v["repeat"], num_frames=v["num_frames"], height=v["height"], width=v["width"],
                resolutions=[tuple(r) for r in buckets] if buckets else None, frame_stride=v["frame_stride"],
                window=v["window"], windows_per_clip=v["windows_per_clip"],
                caption_prefix=str(v.get("caption_prefix") or ""), weight=_weight(v.get("weight", 1), where), fps=fps,
                caption_extension=caption_extension)


def caption_extension_setting(value, key: str) -> str:
    """A caption file extension as written (``.txt``, ``.caption``): a dot, then a name without a path separator."""
    text = value if isinstance(value, str) else ""
    if not text.startswith(".") or len(text) < 2 or "/" in text or "\\" in text:
        raise ConfigError(f"{key}={value!r}: a file extension with its dot, e.g. .txt or .caption (each clip's "
                          "caption is the file of its name with this extension)")
    return text


def parse_datasets(datasets, top: dict, frame_rule: tuple[int, int] = (1, 0)) -> list[Part]:
    """``data.datasets`` (a list, or a mapping name -> entry) as Parts; names must differ (rejects files, counts)."""
    if isinstance(datasets, dict):
        parts = [_part(entry, str(name), top, frame_rule) for name, entry in datasets.items()]
    elif isinstance(datasets, (list, tuple)):
        parts = [_part(entry, str(i), top, frame_rule) for i, entry in enumerate(datasets)]
    else:
        raise ConfigError(f"data.datasets={datasets!r}: a list of datasets or a mapping name -> dataset")
    if not parts:
        raise ConfigError("data.datasets is empty; list at least one dataset, or set it to null (data.metadata)")
    names = [p.name for p in parts]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(f"data.datasets: two datasets are named {dup}; give each its own name")
    if not any(p.weight > 0 for p in parts):
        raise ConfigError("data.datasets: every weight is 0, so an epoch holds no sample; give at least one dataset "
                          "a weight > 0")
    return parts


def epoch_items(item_part: list[int], shapes: list[Shape], held: list[bool], parts: list[Part]
                ) -> tuple[list[int], list[tuple[list[int], int]], list[int]]:
    """The training samples of an epoch: dataset p gives (its items) x repeat x weight of them.

    The whole part of repeat x weight is that many copies of the dataset's items. The fraction is one more copy of
    which each epoch keeps round(fraction x items), a new draw per (seed, epoch) (the batch sampler's ``subsets``),
    so every item trains equally often over epochs. The kept count is split over the dataset's buckets by largest
    remainder and fixed per bucket: every epoch has the same batches (resume, steps per epoch, the progress bar).
    Returns (each training sample's item, the pools a draw keeps part of: (positions in the first list, how many
    kept), each dataset's samples per epoch).
    """
    train: list[int] = []
    pools: list[tuple[list[int], int]] = []
    counts: list[int] = []
    for p, part in enumerate(parts):
        idx = [i for i in range(len(item_part)) if not held[i] and item_part[i] == p]
        full = math.floor(part.share + 1e-9)  # (0.1 x 30 is 3.0000000000000004)
        train += idx * full  # weight 1: the items, repeat times over
        keep = _largest_remainder(max(0.0, part.share - full), [shapes[i] for i in idx])
        total = sum(keep.values())
        if total:
            positions: dict[Shape, list[int]] = {}
            for i in idx:
                positions.setdefault(shapes[i], []).append(len(train))
                train.append(i)
            pools += [(positions[shape], keep[shape]) for shape in sorted(positions)]
        counts.append(len(idx) * full + total)
    return train, pools, counts


def samples_per_epoch_line(datasets: dict, buckets: dict | None = None) -> str:
    """``clips 121 (120 x1 + 1 to fill), stills 200 (100 x4 x weight 0.5)``: each dataset's samples per epoch (a
    report's ``datasets``) and where they come from; with a report's ``buckets``, each bucket that repeats samples
    to fill its last step: ``; filled: 9x704x1280 120 + 1``."""
    def one(name: str, d: dict) -> str:
        weight, fill = d.get("weight", 1), d.get("fill", 0)
        return (f"{name} {d['samples']} ({d['items']} x{d['repeat']}{'' if weight == 1 else f' x weight {weight:g}'}"
                f"{f' + {fill} to fill' if fill else ''})")
    filled = [f"{key} {b['samples']} + {b['fill']}" for key, b in (buckets or {}).items() if b["fill"]]
    parts = [", ".join(one(n, d) for n, d in datasets.items()), f"filled: {', '.join(filled)}" if filled else ""]
    return "; ".join(part for part in parts if part)


def _largest_remainder(fraction: float, shapes: list[Shape]) -> dict[Shape, int]:
    """round(fraction x len(shapes)) samples split over the buckets in proportion to their sizes."""
    sizes: dict[Shape, int] = {}
    for shape in shapes:
        sizes[shape] = sizes.get(shape, 0) + 1
    return _apportion({shape: fraction * n for shape, n in sizes.items()}, math.floor(fraction * len(shapes) + 0.5))


def _apportion(exact: dict, total: int) -> dict:
    """``total`` split into whole counts near ``exact`` (key -> share): each share's whole part, then one more for the
    largest remainders (ties: the smaller key)."""
    keep = {key: math.floor(x) for key, x in exact.items()}
    for key in sorted(exact, key=lambda k: (keep[k] - exact[k], k))[:max(0, total - sum(keep.values()))]:
        keep[key] += 1
    return keep


def crop_share(src_w: int, src_h: int, height: int, width: int) -> float:
    """The share of a ``src_w x src_h`` picture that resizing to cover ``height x width`` (aspect kept) and a center
    crop cut away (``media.resize_crop``): 1 - the narrower aspect ratio over the wider one."""
    src, dst = src_w / src_h, width / height
    return 1 - min(src, dst) / max(src, dst)


def dit_tokens(shape: Shape, vae_stride: tuple[int, int, int], patch: tuple[int, int, int]) -> int:
    """DiT tokens of one sample of this (frames, height, width): latent frames x patches of the latent grid."""
    frames, height, width = shape
    latent_frames = (frames - 1) // vae_stride[0] + 1
    return (latent_frames // patch[0]) * (height // vae_stride[1] // patch[1]) * (width // vae_stride[2] // patch[2])


def check_sequence_split(shapes, vae_stride: tuple[int, int, int], patch: tuple[int, int, int], sp: int) -> None:
    """Under sequence parallel (``parallel.sp_size``) every bucket's token count must split into ``sp`` equal parts:
    checked when the data is set up, before any weight loads, rather than at the first batch of that bucket."""
    for shape in sorted(set(shapes)):
        n = dit_tokens(shape, vae_stride, patch)
        if n % sp:
            f, h, w = shape
            raise MetadataError(f"parallel.sp_size={sp}: the bucket {f}x{h}x{w} (frames x height x width) gives {n} DiT "
                                f"tokens, which do not split into {sp} equal parts; use another data.height/width/"
                                "num_frames (or data.buckets) or another sp_size")


def bucket_shapes(samples: list[Sample], num_frames: int, height: int, width: int,
                  resolutions: list[tuple[int, int]] | None = None,
                  sizes: list[tuple[int, int] | None] | None = None) -> list[Shape]:
    """Each sample's bucket. ``sizes``: the media's (width, height) where known (needed for aspect buckets)."""
    shapes = []
    for i, s in enumerate(samples):
        frames = 1 if s.kind == "image" else num_frames
        h, w = height, width
        if resolutions and sizes is not None and sizes[i] is not None:
            h, w = nearest_resolution(*sizes[i], resolutions)
        shapes.append((frames, h, w))
    return shapes


def caption_dropped(seed: int, epoch: int, index: int, p: float) -> bool:
    """Whether caption dropout gives this sample the empty prompt in this epoch (probability ``p``): a pure function
    of (seed, epoch, index), so a resumed run drops exactly the captions an uninterrupted one drops, with no RNG
    state to carry, on any rank and with any number of loader workers."""
    if p <= 0:
        return False
    digest = hashlib.sha256(f"caption-dropout:{seed}:{epoch}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < p


def load_media(sample: Sample, frames: int, height: int, width: int, stride: int = 1, start: int = 0,
               fps: int | None = None, load_input: Callable | None = None) -> dict:
    """A sample's clip ``{"pixels": (3, F, H, W) in [-1, 1]}`` and each of its sample inputs under its column's name,
    read by the family's ``load_input`` (ModelSpec.load_sample_input) for this clip's window (its frames, first frame
    and stride), rate and size."""
    pixels, start, stride = load_clip_window(sample, frames, height, width, stride, start=start, fps=fps)
    item = {"pixels": pixels}  # its inputs follow the window the clip holds (a short clip's is fitted)
    for name, path in sample.inputs:
        item[name] = load_input(name, path, frames, fps, size=(height, width), start=start, stride=stride)
    return item


class ClipDataset(Dataset):
    """Decodes one sample at its bucket's shape into ``{"pixels": (3, F, H, W) in [-1, 1], "prompt", "index"}``.

    ``starts``: each sample's first frame (``RANDOM_START``: a window drawn per epoch, then indexes are
    ``(index, epoch)`` pairs and ``available`` holds each clip's frame count). ``caption_dropout``: the share of
    samples per epoch trained with the empty prompt (indexes are ``(index, epoch)`` pairs too). ``frame_stride``: one
    for all samples, or each sample's (several datasets); ``fps``: the frame rate each sample's clip is resampled to
    (None: its own frames), one for all or each sample's.
    """

    def __init__(self, samples: list[Sample], shapes: list[Shape], frame_stride: int | list[int] = 1,
                 starts: list[int] | None = None, available: list[int] | None = None, seed: int = 0,
                 caption_dropout: float = 0.0, fps: int | None | list[int | None] = None,
                 load_input: Callable | None = None):
        self.samples, self.shapes, self.frame_stride, self.fps = samples, shapes, frame_stride, fps
        self.load_input = load_input  # ModelSpec.load_sample_input (the samples' inputs; None: they have none)
        self.starts = starts or [0] * len(samples)
        self.available, self.seed, self.caption_dropout = available, seed, caption_dropout
        self.same_shape: dict[Shape, list[int]] = {}
        for i, shape in enumerate(shapes):
            self.same_shape.setdefault(shape, []).append(i)

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, i: int, epoch: int) -> dict:
        s = self.samples[i]
        frames, height, width = self.shapes[i]
        start = self.starts[i]
        stride = self.frame_stride if isinstance(self.frame_stride, int) else self.frame_stride[i]
        fps = self.fps[i] if isinstance(self.fps, list) else self.fps
        if start == RANDOM_START:
            start = random_start(self.available[i], frames, stride, self.seed, epoch, i)
        item = load_media(s, frames, height, width, stride, start, fps, self.load_input)
        prompt = "" if caption_dropped(self.seed, epoch, i, self.caption_dropout) else s.prompt
        return dict(item, prompt=prompt, index=i)

    def __getitem__(self, i) -> dict:
        """A sample that fails to decode now (it passed the pre-flight check) is replaced by the next one of its
        bucket, so the batch keeps its shape; the failure travels with the batch (``rejected``) to be logged."""
        i, epoch = i if isinstance(i, tuple) else (i, 0)
        try:
            return dict(self._load(i, epoch), rejected=[])
        except MediaError as e:
            rejected = [(self.samples[i].path, _reason(e, self.samples[i].path))]
        group = self.same_shape[self.shapes[i]]
        at = group.index(i)
        for k in range(1, min(len(group), 8)):
            j = group[(at + k) % len(group)]
            try:
                return dict(self._load(j, epoch), rejected=rejected)
            except MediaError as e:
                rejected.append((self.samples[j].path, _reason(e, self.samples[j].path)))
        raise MediaError(f"{rejected[0][0]}: {rejected[0][1]}, and the next {len(rejected) - 1} samples of its "
                         "bucket failed too; check the data (data.probe=true finds such files before training)")


class CachedDataset(Dataset):
    """Reads one sample's latents and text embeddings from the cache (``wanexp.data.cache``). With
    ``caption_dropout`` indexes are ``(index, epoch)`` pairs and a dropped caption reads ``empty_key``'s entry (the
    empty prompt's embedding)."""

    def __init__(self, samples: list[Sample], shapes: list[Shape], keys: list[tuple[str, str]], index: CacheIndex,
                 text_len: int, caption_dropout: float = 0.0, empty_key: str | None = None, seed: int = 0):
        self.samples, self.shapes, self.keys, self.index, self.text_len = samples, shapes, keys, index, text_len
        self.caption_dropout, self.empty_key, self.seed = caption_dropout, empty_key, seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i) -> dict:
        i, epoch = i if isinstance(i, tuple) else (i, 0)
        lkey, tkey = self.keys[i]
        prompt = self.samples[i].prompt
        if caption_dropped(self.seed, epoch, i, self.caption_dropout):
            tkey, prompt = self.empty_key, ""
        item = self.index.load(lkey)
        text = padded_text(self.index.load(tkey)["text"], self.text_len)
        return dict(item, text=text, prompt=prompt, index=i)


class _Epoch:
    """The epoch counter of a batch sampler. Lightning calls ``set_epoch`` on ``batch_sampler.sampler`` at the
    start of every epoch (and again after a resume), as it does for torch's BatchSampler(sampler)."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def _reason(error: Exception, path: str) -> str:
    """A decoding error's one line, without the path it starts with."""
    return str(error).strip().splitlines()[-1].removeprefix(f"{path}: ")


class EpochTagged(Sampler[list[tuple[int, int]]]):
    """Yields the batches of a batch sampler as ``(index, epoch)`` pairs (for windows drawn per epoch)."""

    def __init__(self, batches: "BucketBatchSampler"):
        self.batches = batches
        self.sampler = batches.sampler  # where Lightning sets the epoch

    @staticmethod
    def tag(epoch: int, batch: list[int]) -> list[tuple[int, int]]:
        return [(i, epoch) for i in batch]

    def __iter__(self):
        for epoch, batch in self.batches.epoch_batches():
            yield self.tag(epoch, batch)

    def __len__(self) -> int:
        return len(self.batches)


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of one bucket, sharded over ranks; the order is a pure function of (seed, epoch).

    Each optimizer step takes world x batch samples of one bucket. A bucket whose samples do not fill its last step
    is filled with repeats of its own samples (the first of the epoch's shuffled order), so every sample of the epoch
    trains in it and every rank gets the same number of whole batches. ``owners``: each index's dataset; the fill of
    a bucket that several datasets share is split over them in proportion to their samples in it, so each dataset
    trains the same count every epoch (``trained``).
    ``batch_sizes`` maps a bucket to its per-rank batch size (token-budget batching), else ``batch_size`` for all.
    ``subsets``: (indexes of one bucket, how many of them an epoch keeps) for fractional dataset weights
    (``epoch_items``): which ones is drawn per (seed, epoch), the same on every rank; how many is fixed.
    """

    def __init__(self, keys: list, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, batch_sizes: dict | None = None,
                 subsets: list[tuple[list[int], int]] | None = None, owners: list[int] | None = None):
        self.keys, self.batch_size, self.rank, self.world = keys, batch_size, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.batch_sizes = batch_sizes or {}
        self.subsets = subsets or []
        self.owners = owners or [0] * len(keys)
        self.sampler = _Epoch()
        self.steps_done: Callable[[], int] | None = None  # the data position (see ``follow``)
        self.accumulate = 1
        self._counts: dict | None = None  # bucket_counts, counted on first use

    def follow(self, steps_done: Callable[[], int], accumulate: int) -> None:
        """Take the data position from the optimizer steps done (the trainer's global step), read as each pass over
        the loader begins: Lightning steps every ``accumulate`` batches and at the end of each epoch, so an epoch of
        N batches is ceil(N / accumulate) steps, and ``steps_done`` gives (epoch, batches of it already trained).
        Neither Lightning's epoch counter (``set_epoch``; after a resume from an epoch's last step it can be one
        behind) nor the moment it is set matters: a loader with workers draws its first batches when the pass is
        created, before Lightning sets the epoch."""
        self.steps_done, self.accumulate = steps_done, max(1, int(accumulate))

    def position(self) -> tuple[int, int]:
        """(epoch, batches of it already trained) where the next pass begins."""
        if self.steps_done is None:
            return self.sampler.epoch, 0
        epoch, step_in_epoch = divmod(self.steps_done(), math.ceil(len(self) / self.accumulate))
        return epoch, step_in_epoch * self.accumulate

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def _left_out(self, epoch: int) -> set[int]:
        """The indexes this epoch leaves out of ``subsets`` (a draw of its own: the order's RNG is untouched)."""
        out: set[int] = set()
        if self.subsets:
            rng = random.Random(f"dataset-weight:{self.seed}:{epoch}")
            for pool, keep in self.subsets:
                out.update(pool)
                out.difference_update(rng.sample(pool, keep))
        return out

    def _groups(self, epoch: int = 0) -> dict:
        """Each bucket's indexes in this epoch (their count is the same in every epoch)."""
        groups: dict = {}
        left_out = self._left_out(epoch)
        for i, k in enumerate(self.keys):
            if i not in left_out:
                groups.setdefault(k, []).append(i)
        return groups

    def _per_step(self, key) -> int:
        return self.batch_sizes.get(key, self.batch_size) * self.world

    def _fill_shares(self, key, idx: list[int]) -> dict[int, int]:
        """How many repeats of each dataset's samples fill this bucket's last step (none when it is whole)."""
        counts = Counter(self.owners[i] for i in idx)
        short = -len(idx) % self._per_step(key)
        return _apportion({o: short * n / len(idx) for o, n in counts.items()}, short) if short else {}

    def _global_batches(self, epoch: int) -> list[list[int]]:
        rng = random.Random(self.seed + epoch)
        steps = []
        for key, idx in sorted(self._groups(epoch).items()):
            per_step = self._per_step(key)
            if self.shuffle:
                rng.shuffle(idx)
            fill = []
            for owner, k in sorted(self._fill_shares(key, idx).items()):
                own = [i for i in idx if self.owners[i] == owner]
                fill += [own[j % len(own)] for j in range(k)]
            idx += fill
            steps += [idx[s:s + per_step] for s in range(0, len(idx), per_step)]
        if self.shuffle:
            rng.shuffle(steps)
        return steps

    def bucket_counts(self) -> dict:
        """Each bucket's (samples an epoch holds, repeats that fill its last step, batches per rank): the same in
        every epoch, so counted once (``len`` is asked for every pass and every data position)."""
        if self._counts is None:
            self._counts = {}
            for key, idx in self._groups().items():
                fill = sum(self._fill_shares(key, idx).values())
                self._counts[key] = (len(idx), fill, (len(idx) + fill) // self._per_step(key))
        return dict(self._counts)

    def trained(self) -> dict[int, tuple[int, int]]:
        """Each dataset's (``owners``) samples per epoch, all ranks, and how many of them are repeats that fill a
        bucket's last step: (samples, fill)."""
        samples: Counter = Counter()
        fill: Counter = Counter()
        for key, idx in self._groups().items():
            samples.update(self.owners[i] for i in idx)
            fill.update(self._fill_shares(key, idx))
        return {o: (n + fill[o], fill[o]) for o, n in sorted(samples.items())}

    def epoch_batches(self):
        """This rank's batches from the current position to its epoch's end, each with its epoch: ``(epoch, batch)``."""
        epoch, done = self.position()
        yield from self._rank_batches(epoch, done)

    def batches_from(self, epoch: int, done: int):
        """This rank's batches of every epoch from batch ``done`` of ``epoch`` on, endlessly: ``(epoch, batch)``."""
        while True:
            yield from self._rank_batches(epoch, done)
            epoch, done = epoch + 1, 0

    def _rank_batches(self, epoch: int, done: int):
        for step in self._global_batches(epoch)[done:]:
            b = len(step) // self.world
            yield epoch, step[self.rank * b:(self.rank + 1) * b]

    def __iter__(self):
        for _, batch in self.epoch_batches():
            yield batch

    def __len__(self) -> int:
        return sum(batches for _, _, batches in self.bucket_counts().values())


class _Onward:
    """What an EpochLoader's one iteration draws: this rank's batches of every epoch, from the data position read when
    the iteration starts (``start``) on; tagged ``(index, epoch)`` where the batch sampler is an EpochTagged."""

    def __init__(self, batch_sampler: "BucketBatchSampler | EpochTagged"):
        self.tagged = isinstance(batch_sampler, EpochTagged)
        self.batches: BucketBatchSampler = batch_sampler.batches if self.tagged else batch_sampler
        self.start: tuple[int, int] | None = None

    def __iter__(self):
        self.start = self.batches.position()
        return self._draw(*self.start)

    def _draw(self, epoch: int, done: int):
        for e, batch in self.batches.batches_from(epoch, done):
            yield EpochTagged.tag(e, batch) if self.tagged else batch

    def __len__(self) -> int:  # the loader's length: one epoch's batches on this rank
        return len(self.batches)


class EpochLoader(DataLoader):
    """The train loader: a DataLoader whose passes (one per epoch, as Lightning asks for them) are consecutive stretches
    of one iteration over every epoch's batches.

    A DataLoader hands its workers the indexes of an epoch only when that epoch's pass begins: with persistent workers
    they sit idle from the last batch of an epoch until the next pass is asked for, then every step of the next epoch's
    first ones waits for its batch. Here the workers go on drawing the next epoch's first batches (``prefetch_factor``
    per worker) while the last ones of this epoch train, in the same processes, with their cache files open.

    A pass begins where the data position says (BucketBatchSampler.position: from the optimizer steps done, or the
    epoch Lightning set): the one iteration goes on when it stands there (its previous pass went to the epoch's end,
    or nothing of the current pass was taken), and starts again from the position otherwise (a resumed run, a pass
    left part-way, workers shut down by Lightning's teardown). Each pass ends at its epoch's last batch.
    ``batch_sampler`` stays the one-epoch sampler (``list(loader.batch_sampler)`` is an epoch); the loader draws
    through torch's ``_index_sampler``, which this class overrides. Its workers are persistent (a restart keeps the
    processes; Lightning's teardown finds and stops them).
    """

    def __init__(self, dataset, batch_sampler: "BucketBatchSampler | EpochTagged", **kwargs):
        kwargs["persistent_workers"] = kwargs.get("num_workers", 0) > 0
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self._onward = _Onward(batch_sampler)
        self._live = None  # the iteration over every epoch (torch's loader iterator)
        self._at: tuple[int, int] | None = None  # (epoch, batches of it) the live iteration gives next

    @property
    def _index_sampler(self):
        return self._onward

    def __iter__(self):
        stale = self._live is None or (self.num_workers > 0 and self._iterator is not self._live)
        if stale or self._at != self._onward.batches.position():
            self._live = super().__iter__()  # persistent workers: the same processes, restarted at the position
            self._at = self._onward.start
        return self._pass()

    def _pass(self):
        epoch, per_epoch = self._at[0], len(self)
        while self._at[0] == epoch:
            batch = next(self._live)
            done = self._at[1] + 1
            self._at = (epoch, done) if done < per_epoch else (epoch + 1, 0)
            yield batch


def heldout_rows(paths: list[str], fraction: float) -> list[bool]:
    """Which rows are held out of training: those whose media path hashes below ``fraction`` (every window of a clip
    goes the same way), so the split depends on the file only, never on the row order, the seed or the world size.
    A fraction > 0 holds out at least one file (the lowest hash)."""
    import hashlib

    if fraction <= 0 or not paths:
        return [False] * len(paths)
    h = {p: int(hashlib.sha1(os.fspath(p).encode()).hexdigest()[:12], 16) / 16**12 for p in set(paths)}
    cut = fraction if any(v < fraction for v in h.values()) else min(h.values()) + 1e-12
    return [h[p] < cut for p in paths]


def collate(items: list[dict]) -> dict:
    """Loader items -> a batch: every tensor stacked (pixels or cached latents and text, the family's sample inputs
    and cached conditioning), the prompts and indexes listed."""
    batch = {k: torch.stack([it[k] for it in items]) for k, v in items[0].items()
             if isinstance(v, torch.Tensor) and k != "index"}
    return dict(batch, prompt=[it["prompt"] for it in items], index=torch.tensor([it["index"] for it in items]),
                rejected=[r for it in items for r in it.get("rejected", ())])


class MediaDataModule(L.LightningDataModule):
    _held_rejects: list[tuple[Path, list[str]]] | None = None  # hold_rejects(): (file, lines) not yet written

    def __init__(self, *, name: str, metadata: str, root: str | None, num_frames: int, height: int, width: int,
                 frame_stride: int, window: str, windows_per_clip: int, batch_size: int, token_budget: int | None, num_workers: int, max_samples: int | None, dataset_repeat: int,
                 buckets: list | None, probe: bool, max_reject_fraction: float, rejects: str | None,
                 cache_dir: str | None, use_cache: bool, cache_shard_size: int, cache_dtype: str,
                 generate: dict | None, seed: int, val_fraction: float = 0.0, caption_dropout: float = 0.0,
                 datasets: list | dict | None = None, fps: int | None = None, encoders: object | None = None,
                 context: RunContext | None = None, caption_extension: str = ".txt"):
        """The arguments are the ``data`` group (config.schema.DataConfig), the run's seed, ``encoders``: what
        identifies the model's VAE and text encoder for cache keys, its latent grid and its native frame rate, which
        clips are resampled to unless ``fps`` says otherwise
        (``ModelSpec.encoder_info()``: an EncoderInfo, read by attribute; None: no cache, clips at their own rate), and
        the run ``context`` (wanexp/context.py; its ``sp_size``: every bucket's tokens must split into that many parts,
        and the ranks of a sequence-parallel group share batches; None: one process)."""
        super().__init__()
        self.name, self.metadata, self.root = name, Path(metadata), root
        self.num_frames, self.height, self.width, self.frame_stride = num_frames, height, width, frame_stride
        self.fps = fps if fps is not None else getattr(encoders, "fps", None)  # the rate clips are resampled to
        self.batch_size, self.num_workers, self.max_samples = batch_size, num_workers, max_samples
        self.dataset_repeat = dataset_repeat
        self.caption_extension = caption_extension_setting(caption_extension, "data.caption_extension")
        self.caption_dropout = float(caption_dropout)  # share of samples per epoch trained with the empty prompt
        self.window, self.windows_per_clip = window, windows_per_clip
        self.token_budget = token_budget
        self.resolutions = [tuple(r) for r in buckets] if buckets else None
        self.probe, self.max_reject_fraction = probe, max_reject_fraction
        self.rejects_path = Path(rejects) if rejects else None
        self.generate, self.seed = generate, seed
        self.run_context = context or RunContext()
        self.cache_dir, self.use_cache, self.encoders = (Path(cache_dir) if cache_dir else None), use_cache, encoders
        self.cache_shard_size, self.cache_dtype = cache_shard_size, cache_dtype
        self.cached = False  # every sample's latents and text are in the cache: training never runs the encoders
        self.prompts_only = False  # data.metadata holds prompts alone, no media (wanexp/data/prompts.py)
        self._text_id: str | None = None  # the text encoder + tokenizer part of a text cache key (computed once)
        self.keys: list[tuple[str, str]] = []
        self.report: dict = {}  # rows, rejected, warnings: for the run's log and status.json
        self.dataset: ClipDataset | None = None
        self.steps_done = 0  # optimizer steps the restored checkpoint had done (0: a fresh run; for the record: the
        # loader takes its position from the trainer's restored global step)
        self.val_fraction = float(val_fraction)  # share of the media files held out of training (validation loss)
        self.val_dataset: ClipDataset | CachedDataset | None = None  # the held-out samples (never trained on)
        self.parts = self._parts(datasets)  # the datasets of the run: data.datasets, else the group's own keys
        self.several = datasets is not None
        self.item_part: list[int] = []  # each item's dataset (an index into parts), set by items()
        self.item_stride: list[int] = []  # each item's frame stride
        self.item_fps: list[int | None] = []  # the frame rate each item's clip is resampled to
        self.dataset_part: list[int] = []  # each training sample's dataset (repeats included), set by setup()
        self.val_part: list[int] = []  # each held-out sample's dataset, set by setup()
        self.epoch_pools: list[tuple[list[int], int]] = []  # fractional weights: part of each pool trains per epoch
        self.sampler: BucketBatchSampler | None = None  # the last train loader's (the progress bar reads it)
        self._seen: tuple | None = None  # samples_seen's (epoch, cumulative counts per batch and dataset)

    def _parts(self, datasets) -> list[Part]:
        from omegaconf import OmegaConf

        if datasets is not None and OmegaConf.is_config(datasets):
            datasets = OmegaConf.to_container(datasets, resolve=True)
        top = {"metadata": None, "root": self.root, "repeat": self.dataset_repeat, "num_frames": self.num_frames,
               "height": self.height, "width": self.width, "buckets": self.resolutions, "fps": self.fps,
               "frame_stride": self.frame_stride, "window": self.window, "windows_per_clip": self.windows_per_clip,
               "caption_prefix": "", "caption_extension": self.caption_extension}
        rule = tuple(getattr(self.encoders, "frame_rule", (1, 0)))
        if datasets is None:  # the single-dataset keys: one dataset
            return [_part(dict(top, metadata=str(self.metadata)), self.name, top, rule)]
        return parse_datasets(datasets, top, rule)

    def prepare(self) -> None:
        """Generate the synthetic clips if this data group asks for them (idempotent, safe across ranks)."""
        if self.generate and not self.metadata.is_file():
            from wanexp.data.synthetic import METADATA_NAME, make_demo_dataset

            if self.metadata.name != METADATA_NAME:  # a file of the user's (e.g. prompts), not the generated list
                raise ConfigError(f"data.metadata={self.metadata}: file not found (data.generate lists the clips it "
                                  f"generates in a {METADATA_NAME}, never in this file); point data.metadata at an "
                                  "existing file and set data.generate=null to train on it")
            make_demo_dataset(self.metadata.parent, **dict(self.generate))

    def samples(self) -> tuple[list[Sample], list[tuple[int, int] | None], list[int | None]]:
        """The usable rows, their media's (width, height) and frame counts (None where not probed).

        Rows that cannot train (bad caption, missing, empty, corrupt or truncated media, too few frames, unreadable
        image) are left out and written with their reason to ``rejects`` (JSON lines); past
        ``max_reject_fraction`` of the rows the run stops with one line, before any weights load.
        """
        samples, rejects = read_metadata_with_rejects(self.metadata, self.root,
                                                      tuple(getattr(self.encoders, "sample_inputs", ())),
                                                      dict(getattr(self.encoders, "input_fallbacks", ())),
                                                      self.caption_extension)
        if self.max_samples:
            samples = samples[: self.max_samples]
        sizes: list[tuple[int, int] | None] = [None] * len(samples)
        frames: list[int | None] = [None] * len(samples)
        warnings = []
        if self.probe:
            good, bad, warnings = probe_samples(samples, self.num_frames, self.frame_stride, self.height, self.width,
                                                workers=max(1, self.num_workers), resolutions=self.resolutions,
                                                fps=self.fps)
            samples, rejects = [r.sample for r in good], rejects + bad
            sizes, frames = [(r.width, r.height) for r in good], [r.frames for r in good]
            check = getattr(self.encoders, "check_sample_input", None)  # the family's check of its inputs' files
            if check is not None:
                reasons = [next((r for name, p in s.inputs if (r := check(name, p))), None) for s in samples]
                rejects += [Reject(source=s.path, path=s.path, reason=r) for s, r in zip(samples, reasons) if r]
                samples, sizes, frames = ([x for x, r in zip(xs, reasons) if not r] for xs in (samples, sizes, frames))
        warnings += self._long_captions(samples)
        total = len(samples) + len(rejects)
        self.report = {"rows": total, "rejected": len(rejects), "warnings": len(warnings),
                       "long_captions": sum(w.reason.startswith("caption is ") for w in warnings),
                       "rejects_file": str(self.rejects_path) if self.rejects_path else None}
        self._write_rejects(rejects, warnings)
        if rejects and (not samples or len(rejects) / total > self.max_reject_fraction):
            self.write_held_rejects()  # the refusal's own report: its line names the file
            first = rejects[0]
            hint = ("fix the paths in the metadata file or set data.root to the folder they are relative to"
                    if first.reason == "file not found" else
                    "fix or remove those rows, or raise data.max_reject_fraction")
            raise MetadataError(
                f"{self.metadata}: {len(rejects)} of {total} samples rejected, more than data.max_reject_fraction="
                f"{self.max_reject_fraction} (first: {first.path or first.source}: {first.reason}; all in "
                f"{self.rejects_path or 'data.rejects'}); {hint}")
        return samples, sizes, frames

    def items(self) -> tuple[list[Sample], list[Shape], list[int], list[int | None]]:
        """Training samples of every dataset: (sample, bucket shape, first frame, frames available), one per frame
        window (``item_part``, ``item_stride``: each one's dataset and frame stride). Each dataset is read, probed
        and windowed with its own settings and lists its rejects in its own file; ``report["datasets"]`` counts
        each one's rows, rejects and samples."""
        if not self.several:  # the single-dataset keys
            out = self._part_items()
            self.item_part, self.item_stride = [0] * len(out[0]), [self.frame_stride] * len(out[0])
            self.item_fps = [self.fps] * len(out[0])
            counts = {k: self.report.get(k) for k in ("rows", "rejected", "cropped", "other_orientation")}
            self.report["datasets"] = {self.name: dict(self._part_report(0, out[0]), **counts)}
            return out
        out: tuple[list, list, list, list] = ([], [], [], [])
        self.item_part, self.item_stride, self.item_fps, reports, notes = [], [], [], {}, []
        for p, part in enumerate(self.parts):
            child = self._child(part)
            samples, shapes, starts, available = child._part_items()
            if child.prompts_only:
                raise MetadataError(f"data.datasets.{part.name}: {part.metadata} holds prompts alone (no media); "
                                    "a prompts file trains alone: set data.metadata to it and data.datasets=null")
            if part.caption_prefix:
                samples = [dataclasses.replace(s, prompt=part.caption_prefix + s.prompt) for s in samples]
            for lst, values in zip(out, (samples, shapes, starts, available)):
                lst += values
            self.item_part += [p] * len(samples)
            self.item_stride += [part.frame_stride] * len(samples)
            self.item_fps += [part.fps] * len(samples)
            notes += [f"{part.name}: {note}" for note in child.report.pop("notes", ())]
            reports[part.name] = dict(child.report, **self._part_report(p, samples))
        self.report = {"rows": sum(r["rows"] for r in reports.values()),
                       "rejected": sum(r["rejected"] for r in reports.values()),
                       "warnings": sum(r["warnings"] for r in reports.values()),
                       "long_captions": sum(r["long_captions"] for r in reports.values()),
                       "cropped": sum(r.get("cropped") or 0 for r in reports.values()),
                       "rejects_file": str(self.rejects_path.parent) if self.rejects_path else None,
                       "notes": notes, "datasets": reports}
        return out

    def _part_report(self, p: int, items: list) -> dict:
        part = self.parts[p]
        return {"metadata": str(part.metadata), "items": len(items), "repeat": part.repeat}

    def _child(self, part: Part) -> "MediaDataModule":
        """This datamodule with one dataset's settings, to read, probe and window that dataset (rejects: in
        ``rejects-<name>.jsonl`` beside data.rejects)."""
        child = copy.copy(self)
        child.metadata, child.root, child.num_frames = part.metadata, part.root, part.num_frames
        child.height, child.width, child.resolutions = part.height, part.width, part.resolutions
        child.frame_stride, child.window, child.windows_per_clip = part.frame_stride, part.window, part.windows_per_clip
        child.fps, child.caption_extension = part.fps, part.caption_extension
        if self.rejects_path is not None:
            r = self.rejects_path
            child.rejects_path = r.with_name(f"{r.stem}-{part.name}{r.suffix}")
        child.report, child.prompts_only = {}, False
        return child

    def _part_items(self) -> tuple[list[Sample], list[Shape], list[int], list[int | None]]:
        """One dataset's items (this datamodule's metadata and settings)."""
        found = read_prompts(self.metadata)
        if found is not None:  # prompts alone (DMD): nothing to probe, window or bucket by aspect
            return prompt_items(self, *found)
        samples, sizes, frames = self.samples()
        out: tuple[list, list, list, list] = ([], [], [], [])
        shapes = bucket_shapes(samples, self.num_frames, self.height, self.width, self.resolutions, sizes)
        self.report.update(self._crops(sizes, shapes))
        for sample, shape, available in zip(samples, shapes, frames):
            starts = [0] if self.window == "first" else [
                start for _, start in expand([sample], [available], self.num_frames, self.frame_stride, self.window,
                                             self.windows_per_clip)]
            for start in starts:
                for lst, value in zip(out, (sample, shape, start, available)):
                    lst.append(value)
        return out

    def _crops(self, sizes: list[tuple[int, int] | None], shapes: list[Shape]) -> dict:
        """Of the probed media (``sizes``: (width, height), None where not probed), how many are cropped by more than
        a third of their picture into their shape (``cropped``) and how many are of the other orientation than their
        shape, portrait in a landscape shape or the reverse (``other_orientation``); ``notes``: one line for the log
        when any is."""
        measured = [(size, shape[1:]) for size, shape in zip(sizes, shapes) if size is not None]
        if not measured:
            return {"cropped": None, "other_orientation": None, "notes": []}
        cropped = sum(crop_share(w, h, height, width) > 1 / 3 for (w, h), (height, width) in measured)
        other = sum((w - h) * (width - height) < 0 for (w, h), (height, width) in measured)
        out = {"cropped": cropped, "other_orientation": other, "notes": []}
        if cropped or other:
            into, fix = ((f"{self.height}x{self.width} (height x width)", "data.buckets trains each at the resolution "
                          "nearest its aspect ratio") if not self.resolutions else
                         ("their buckets", "add buckets nearer their aspect ratios to data.buckets"))
            out["notes"] = [f"of {len(measured)} samples cropped into {into}, {other} have the other orientation "
                            f"(portrait in a landscape shape or the reverse) and {cropped} lose more than a third of "
                            f"their picture; {fix}"]
        return out

    def _long_captions(self, samples: list[Sample]) -> list[Reject]:
        """Captions longer than the text length (they train truncated): one warning each."""
        if not self.encoders or not samples:
            return []
        from transformers import AutoTokenizer

        from wanexp.text import clean_prompt

        tokenizer = AutoTokenizer.from_pretrained(self.encoders.tokenizer)
        limit = self.encoders.text_len
        ids = tokenizer([clean_prompt(s.prompt) for s in samples], add_special_tokens=True, verbose=False).input_ids
        return [Reject(s.path, s.path, f"caption is {len(t)} tokens, truncated to {limit} (model.text_len)")
                for s, t in zip(samples, ids) if len(t) > limit]

    def _write_rejects(self, rejects: list[Reject], warnings: list) -> None:
        if self.rejects_path is None:
            return
        lines = [json.dumps({"kind": kind, "source": r.source, "path": r.path, "reason": r.reason}) + "\n"
                 for kind, items in (("reject", rejects), ("warning", warnings)) for r in items]
        if self._held_rejects is not None:
            self._held_rejects.append((self.rejects_path, lines))
        else:
            write_atomic(self.rejects_path, "".join(lines))

    def hold_rejects(self) -> None:
        """Keep the reject lists in memory until :meth:`write_held_rejects`: a run writes nothing into its folder
        before every check has passed (a refusal by the data check itself writes them: its line names the file)."""
        self._held_rejects = []

    def write_held_rejects(self) -> None:
        for path, lines in self._held_rejects or []:
            write_atomic(path, "".join(lines))
        if self._held_rejects:
            self._held_rejects.clear()  # shared with the per-dataset copies (_child)

    def setup(self, stage: str | None = None) -> None:
        if self.dataset is not None:
            return
        samples, shapes, starts, available = self.items()
        if self.prompts_only:
            if self.caption_dropout > 0:
                raise MetadataError(f"data.caption_dropout={self.caption_dropout}: {self.metadata} holds prompts "
                                    "alone (no media), whose prompts are what a distillation samples from; set "
                                    "data.caption_dropout=0")
            self.dataset, self.cached = prompt_dataset(self, samples, shapes)
            return
        bases = [p.base for p in self.parts]  # the split is the same
        held = heldout_rows([os.path.relpath(s.path, bases[p]) for s, p in zip(samples, self.item_part)],
                            self.val_fraction)  # wherever the data is
        val = [i for i in range(len(samples)) if held[i]]
        # each dataset's samples, repeat x weight times over (one dataset: the samples, repeated)
        train, self.epoch_pools, counts = epoch_items(self.item_part, shapes, held, self.parts)
        self.train_items = train  # each training sample's item (repeats and weights share items; wanexp-plan counts)
        strides, rates = self.item_stride, self.item_fps
        val_items = [[lst[i] for i in val] for lst in (samples, shapes, starts, available, strides, rates)]
        samples, shapes, starts, available, strides, rates = (
            [lst[i] for i in train] for lst in (samples, shapes, starts, available, strides, rates))
        self.dataset_part = [self.item_part[i] for i in train]
        self.val_part = [self.item_part[i] for i in val]  # each held-out sample's dataset
        self.report["heldout"] = len(val)
        for part, count in zip(self.parts, counts):  # samples per epoch, repeat and weight included
            self.report["datasets"][part.name].update(samples=count, weight=part.weight)
        cacheable = self.encoders and self.cache_dir and all(p.window != "random" for p in self.parts)  # random
        self.keys = self.cache_keys(samples, shapes, starts, strides, rates) if cacheable else []  # windows change
        index = CacheIndex(self.cache_dir) if self.keys and self.use_cache else None
        empty_key = self.text_cache_key("") if self.keys and self.caption_dropout > 0 else None
        needed = {k for pair in self.keys for k in pair} | ({empty_key} if empty_key else set())
        missing = sum(1 for k in needed if index is None or k not in index)
        self.cached = index is not None and missing == 0
        self.report["cache"] = {"dir": str(self.cache_dir) if self.cache_dir else None, "used": self.cached,
                                "missing_entries": missing if self.keys else None}
        p = self.caption_dropout
        if self.cached:
            self.dataset = CachedDataset(samples, shapes, self.keys, index, self.encoders.text_len, p, empty_key,
                                         self.seed)
        else:
            self.dataset = ClipDataset(samples, shapes, strides, starts, available, self.seed, p, fps=rates,
                                       load_input=self.load_input)
        if val:
            vs, vsh, vst, vav, vstr, vfps = val_items
            vkeys = self.cache_keys(vs, vsh, vst, vstr, vfps) if cacheable else []
            if self.cached and all(k in index for pair in vkeys for k in pair):
                self.val_dataset = CachedDataset(vs, vsh, vkeys, index, self.encoders.text_len)
            else:  # fixed windows (a random window is drawn for epoch 0: the same every time)
                self.val_dataset = ClipDataset(vs, vsh, vstr, vst, vav, self.seed, fps=vfps,
                                               load_input=self.load_input)
        sp = self.run_context.sp_size
        if sp > 1 and self.encoders and not getattr(self.encoders, "pads_sequence", False):
            check_sequence_split(self.dataset.shapes, self.encoders.vae_stride, self.encoders.patch, sp)

    def val_batches(self, limit: int | None = None):
        """The held-out samples as loader batches of one sample each, in a fixed order (the first ``limit``)."""
        if self.val_dataset is None:
            return
        for i in range(len(self.val_dataset) if limit is None else min(limit, len(self.val_dataset))):
            yield collate([self.val_dataset[i]])

    def first_frames(self, n: int, height: int, width: int) -> list[torch.Tensor]:
        """The first frames (3, height, width) in [-1, 1] of the first ``n`` held-out samples (else training
        samples), for image-to-video validation; fewer when there are fewer samples."""
        ds = self.val_dataset if self.val_dataset is not None else self.dataset
        frames = []
        for s in ds.samples[:n]:
            frames.append(load_clip(s, 1, height, width)[:, 0])
        return frames

    def held_out_inputs(self, n: int) -> list[dict]:
        """The family's sample inputs ({column: path}, ModelSpec.sample_inputs) of the samples ``first_frames`` takes
        (the first ``n`` held-out samples, else training samples), for validation videos conditioned as training is."""
        ds = self.val_dataset if self.val_dataset is not None else self.dataset
        return [dict(s.inputs) for s in ds.samples[:n]]

    def cache_keys(self, samples: list[Sample], shapes: list[Shape], starts: list[int],
                   strides: list[int] | None = None, rates: list[int | None] | None = None) -> list[tuple[str, str]]:
        """(latent key, text key) of each sample (see wanexp.data.cache for what a key covers); ``strides``, ``rates``:
        each sample's frame stride and the frame rate its clip is resampled to (default data.frame_stride, data.fps;
        an image's are 1 and None at any setting)."""
        e = self.encoders
        vae_id = folder_identity(e.vae, [e.vae_dtype, e.layout, self.cache_dtype])
        for folder in getattr(e, "media_encoders", ()):  # a family's other media encoders: their weights too
            vae_id += "+" + folder_identity(folder)
        strides = strides or [self.frame_stride] * len(samples)
        rates = rates or [self.fps] * len(samples)
        return [(None if s.kind == PROMPT_KIND else  # a prompt alone has text only
                 latent_key(vae_id, s.path, shape, stride if shape[0] > 1 else 1, start, e.cond_id,
                            fps if shape[0] > 1 else None, inputs=[path for _, path in s.inputs]),
                 self.text_cache_key(s.prompt))
                for s, shape, start, stride, fps in zip(samples, shapes, starts, strides, rates)]

    @property
    def load_input(self) -> Callable | None:
        """The family's reader of its sample inputs (ModelSpec.load_sample_input; None: it has none)."""
        return getattr(self.encoders, "load_sample_input", None)

    def text_cache_key(self, prompt: str) -> str:
        """The cache key of a prompt's text embedding (training captions and validation prompts alike)."""
        e = self.encoders
        if self._text_id is None:
            self._text_id = folder_identity(e.text_encoder, e.text_dtype) + "+" + folder_identity(e.tokenizer)
        return text_key(self._text_id, e.text_len, prompt)

    def cached_text(self, prompt: str) -> torch.Tensor | None:
        """A prompt's embedding (text_len, D) from the cache, zero-padded as the DiT sees it; None if not cached."""
        if not self.encoders or self.cache_dir is None or not self.cache_dir.is_dir():
            return None
        key, index = self.text_cache_key(prompt), CacheIndex(self.cache_dir)
        if key not in index:
            return None
        return padded_text(index.load(key)["text"], self.encoders.text_len)

    def bucket_batch_sizes(self) -> dict | None:
        """With ``token_budget``: each bucket's per-device batch, budget // (DiT tokens of one sample), at least 1."""
        if not self.token_budget:
            return None
        if not self.encoders:
            raise MetadataError("data.token_budget needs the model's latent grid; build the datamodule through run()")
        (st, sh, sw), (pt, ph, pw) = self.encoders.vae_stride, self.encoders.patch
        return {shape: max(1, self.token_budget // dit_tokens(shape, (st, sh, sw), (pt, ph, pw)))
                for shape in set(self.dataset.shapes)}

    def _sampler(self, rank: int, world: int) -> BucketBatchSampler:
        return BucketBatchSampler(self.dataset.shapes, self.batch_size, rank, world, seed=self.seed,
                                  batch_sizes=self.bucket_batch_sizes(), subsets=self.epoch_pools,
                                  owners=self.dataset_part)

    def epoch_line(self, world: int) -> str:
        """What an epoch trains on ``world`` data-parallel ranks, each bucket's last step filled with repeats of its
        own samples (BucketBatchSampler), into the report (status.json): each dataset's ``samples`` (fill included)
        and ``fill``, and ``buckets``: each bucket's ``samples``, ``fill`` and ``batches`` per rank. Returns the start
        line's text (``samples_per_epoch_line``), empty for one dataset that repeats nothing."""
        sampler = self._sampler(0, world)
        self.report["buckets"] = {"x".join(map(str, key)): {"samples": n, "fill": fill, "batches": batches}
                                  for key, (n, fill, batches) in sorted(sampler.bucket_counts().items())}
        datasets = self.report.get("datasets") or {}
        trained = sampler.trained()
        for p, part in enumerate(self.parts):
            if part.name in datasets:
                datasets[part.name]["samples"], datasets[part.name]["fill"] = trained.get(p, (0, 0))
        if len(datasets) < 2 and not any(b["fill"] for b in self.report["buckets"].values()):
            return ""
        return samples_per_epoch_line(datasets, self.report["buckets"])

    def samples_seen(self, steps: int) -> dict[str, tuple[int, int]]:
        """Each dataset's (samples trained so far in the epoch of optimizer step ``steps``, samples that epoch trains),
        all ranks together, counted from the loader's own order (a function of seed and epoch): nothing is read from
        the device. Empty for one dataset, before a train loader exists and before the first step."""
        s = self.sampler
        if s is None or len(self.parts) < 2 or steps <= 0:
            return {}
        epoch, k = divmod(steps - 1, math.ceil(len(s) / s.accumulate))
        if self._seen is None or self._seen[0] != epoch:  # cumulative counts after each batch of the epoch
            import numpy as np

            rows = np.zeros((len(s) + 1, len(self.parts)), dtype=np.int64)
            for b, step in enumerate(s._global_batches(epoch)):
                np.add.at(rows[b + 1], [self.dataset_part[i] for i in step], 1)
            self._seen = (epoch, rows.cumsum(axis=0))
        rows = self._seen[1]
        done = rows[min((k + 1) * s.accumulate, len(rows) - 1)]
        return {p.name: (int(done[j]), int(rows[-1][j])) for j, p in enumerate(self.parts) if rows[-1][j]}

    def state_dict(self) -> dict:
        """Saved in every checkpoint: the data position is the optimizer steps done (see the module docstring)."""
        return {"steps_done": self.trainer.global_step if self.trainer is not None else 0}

    def load_state_dict(self, state: dict) -> None:
        self.steps_done = int(state.get("steps_done", 0))

    def train_dataloader(self) -> DataLoader:
        # data-parallel rank and size: the ranks of one sequence-parallel group (parallel.sp_size) share batches
        rank, world = self.run_context.dp_rank(self.trainer), self.run_context.dp_size(self.trainer)
        sampler = self._sampler(rank, world)
        if len(sampler) == 0:
            raise MetadataError(f"data={self.name}: the epoch holds no sample to train (data.val_fraction holds out "
                                "every media file, or the datasets' weights keep none); lower data.val_fraction or "
                                "raise a weight")
        self.epoch_line(world)  # what an epoch trains on these ranks, in the report (status.json)
        self.sampler = sampler
        if self.trainer is not None:  # the position is the trainer's step: a restored checkpoint's, then each pass's
            sampler.follow(lambda: self.trainer.global_step, self.trainer.accumulate_grad_batches)
        if any(p.window == "random" for p in self.parts) or self.caption_dropout > 0:  # drawn per (index, epoch)
            sampler = EpochTagged(sampler)
        # Its own generator: the loader's worker base seed is drawn from it, not from the global RNG, whose state a
        # checkpoint restores (so a resumed run draws the same noise and timesteps as an uninterrupted one).
        return EpochLoader(self.dataset, batch_sampler=sampler, collate_fn=collate, num_workers=self.num_workers,
                           pin_memory=torch.cuda.is_available(), generator=torch.Generator().manual_seed(self.seed))
