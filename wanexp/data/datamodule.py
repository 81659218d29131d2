"""The datamodule: metadata rows -> decoded clips -> batches of equal shape.

Videos and images are batched separately (an image is a one-frame clip), so every batch has one shape. The batch
sampler shards across ranks itself: each rank gets the same number of batches, and an epoch is
sum over kinds of floor(n_kind / (world_size * batch_size)) batches per rank.
"""
from __future__ import annotations

import random
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from wanexp.data.media import load_clip
from wanexp.data.metadata import MetadataError, Sample, missing_files, read_metadata


class ClipDataset(Dataset):
    """Decodes one metadata row into ``{"pixels": (3, F, H, W) in [-1, 1], "prompt": str}``."""

    def __init__(self, samples: list[Sample], num_frames: int, height: int, width: int, frame_stride: int = 1):
        self.samples = samples
        self.num_frames, self.height, self.width, self.frame_stride = num_frames, height, width, frame_stride

    def __len__(self) -> int:
        return len(self.samples)

    def shape_key(self, i: int) -> str:
        return self.samples[i].kind

    def __getitem__(self, i: int) -> dict:
        s = self.samples[i]
        pixels = load_clip(s, self.num_frames, self.height, self.width, self.frame_stride)
        return {"pixels": pixels, "prompt": s.prompt, "index": i}


class ShapeBatchSampler(Sampler[list[int]]):
    """Batches of one shape key (video / image), sharded over ranks, reshuffled each epoch with a shared seed."""

    def __init__(self, keys: list[str], batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True):
        self.keys, self.batch_size, self.rank, self.world = keys, batch_size, rank, world_size
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _global_batches(self) -> list[list[int]]:
        rng = random.Random(self.seed + self.epoch)
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(self.keys):
            groups.setdefault(k, []).append(i)
        per_step = self.batch_size * self.world
        steps = []
        for key in sorted(groups):
            idx = groups[key]
            if self.shuffle:
                rng.shuffle(idx)
            n = len(idx) // per_step
            steps += [idx[s * per_step:(s + 1) * per_step] for s in range(n)]
        if self.shuffle:
            rng.shuffle(steps)
        return steps

    def __iter__(self):
        for step in self._global_batches():
            yield step[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]

    def __len__(self) -> int:
        counts: dict[str, int] = {}
        for k in self.keys:
            counts[k] = counts.get(k, 0) + 1
        return sum(c // (self.batch_size * self.world) for c in counts.values())


def collate(items: list[dict]) -> dict:
    return {
        "pixels": torch.stack([it["pixels"] for it in items]),
        "prompt": [it["prompt"] for it in items],
        "index": torch.tensor([it["index"] for it in items]),
    }


class WanDataModule(L.LightningDataModule):
    def __init__(self, *, name: str, metadata: str, root: str | None, num_frames: int, height: int, width: int,
                 frame_stride: int, batch_size: int, num_workers: int, max_samples: int | None, generate: dict | None,
                 seed: int):
        """The arguments are the ``data`` group (config.schema.DataConfig) and the run's seed."""
        super().__init__()
        self.name, self.metadata, self.root = name, Path(metadata), root
        self.num_frames, self.height, self.width, self.frame_stride = num_frames, height, width, frame_stride
        self.batch_size, self.num_workers, self.max_samples = batch_size, num_workers, max_samples
        self.generate, self.seed = generate, seed
        self.dataset: ClipDataset | None = None

    def prepare(self) -> None:
        """Generate the synthetic clips if this data group asks for them (idempotent, safe across ranks)."""
        if self.generate and not self.metadata.is_file():
            from wanexp.data.synthetic import make_demo_dataset

            make_demo_dataset(self.metadata.parent, **dict(self.generate))

    def samples(self) -> list[Sample]:
        """The metadata rows this run uses; every media file must exist (checked before any weights load)."""
        samples = read_metadata(self.metadata, self.root)
        samples = samples[: self.max_samples] if self.max_samples else samples
        missing = missing_files(samples)
        if missing:
            raise MetadataError(
                f"{self.metadata}: {len(missing)} of {len(samples)} media files are missing (first: {missing[0]}); "
                "fix the paths in the metadata file or set data.root to the folder they are relative to"
            )
        return samples

    def setup(self, stage: str | None = None) -> None:
        if self.dataset is None:
            self.dataset = ClipDataset(self.samples(), self.num_frames, self.height, self.width, self.frame_stride)

    def train_dataloader(self) -> DataLoader:
        rank, world = 0, 1
        if self.trainer is not None:
            rank, world = self.trainer.global_rank, self.trainer.world_size
        keys = [self.dataset.shape_key(i) for i in range(len(self.dataset))]
        sampler = ShapeBatchSampler(keys, self.batch_size, rank, world, seed=self.seed)
        if len(sampler) == 0:
            raise ValueError(
                f"data={self.name}: {len(keys)} samples give no full batch of {self.batch_size} per rank on "
                f"{world} ranks; lower data.batch_size or add samples"
            )
        return DataLoader(self.dataset, batch_sampler=sampler, collate_fn=collate, num_workers=self.num_workers,
                          pin_memory=torch.cuda.is_available(), persistent_workers=self.num_workers > 0)
