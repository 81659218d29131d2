"""The train loader across epoch boundaries (wanexp.data.datamodule.EpochLoader): its workers draw the next epoch's
first batch before that epoch's pass is asked for, in the same processes, each batch loaded once; its passes follow
the data position (the optimizer steps done) through epochs, accumulation, a pass left part-way and a resume; and a
run without a checkpoint callback has none at all (Lightning's default one saves at every epoch's end)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from torch.utils.data import Dataset

from tests.conftest import compose_cfg
from wanexp.data.datamodule import BucketBatchSampler, EpochLoader, EpochTagged


class LoggedLoads(Dataset):
    """Item ``(index, epoch)`` is its index; each load appends ``pid epoch index`` to ``log`` (from any process)."""

    def __init__(self, n: int, log: Path):
        self.n, self.log = n, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, item) -> int:
        i, epoch = item if isinstance(item, tuple) else (item, 0)
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {epoch} {i}\n")
        return i


def listed(items: list) -> list:
    return list(items)


def loads(log: Path) -> list[tuple[int, int, int]]:
    return [tuple(map(int, line.split())) for line in log.read_text().splitlines()] if log.exists() else []


def test_workers_load_the_next_epochs_first_batch_before_its_pass_begins(tmp_path):
    log = tmp_path / "loads.txt"
    sampler = BucketBatchSampler([(1, 8, 8)] * 8, batch_size=2, seed=3)  # 4 batches an epoch
    loader = EpochLoader(LoggedLoads(8, log), EpochTagged(sampler), collate_fn=listed, num_workers=2, prefetch_factor=1)
    assert list(loader) == sampler._global_batches(0)
    first = sampler._global_batches(1)[0]
    deadline = time.monotonic() + 30  # (a wait for the workers, not a timing: they need milliseconds)
    while not set(first) <= {i for _, e, i in loads(log) if e == 1} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(first) <= {i for _, e, i in loads(log) if e == 1}, "epoch 1's first batch was not drawn ahead"
    sampler.set_epoch(1)  # as Lightning does before the next pass
    assert list(loader) == sampler._global_batches(1)
    seen = loads(log)
    pids = {e: {p for p, epoch, _ in seen if epoch == e} for e in (0, 1)}
    assert pids[1] <= pids[0] and len(pids[0]) == 2  # the same two worker processes
    epoch1 = sorted(i for _, e, i in seen if e == 1)
    assert epoch1 == list(range(8))  # each of epoch 1's samples loaded once: the iteration went on, not restarted


def test_passes_follow_the_optimizer_steps_through_epochs_accumulation_and_resumes():
    keys = [(1, 8, 8)] * 6 + [(5, 8, 8)] * 8  # two buckets; on 2 ranks x 2: 2 + 2 batches per rank and epoch
    steps = [0]

    def sampler(accumulate: int = 1) -> BucketBatchSampler:
        s = BucketBatchSampler(keys, 2, rank=1, world_size=2, seed=5)
        s.follow(lambda: steps[0], accumulate)
        return s

    def epoch(e: int, done: int = 0) -> list[list[int]]:
        ref = BucketBatchSampler(keys, 2, rank=1, world_size=2, seed=5)
        ref.set_epoch(e)
        return list(ref)[done:]

    def train(loader, batches: int | None = None, accumulate: int = 1) -> list[list[int]]:
        """Batches of one pass as Lightning takes them: a step every ``accumulate`` batches and at the epoch's end."""
        out = []
        for b, batch in enumerate(loader):
            out.append(batch)
            if (b + 1) % accumulate == 0 or b + 1 == len(loader):
                steps[0] += 1
            if batches is not None and len(out) == batches:
                break
        return out

    loader = EpochLoader(range(len(keys)), sampler(), collate_fn=listed)
    assert len(loader) == 4
    assert train(loader) == epoch(0) and train(loader) == epoch(1)  # one iteration goes on into the next epoch
    assert train(loader, batches=1) == epoch(2)[:1]
    assert train(loader) == epoch(2, 1)  # a pass left part-way: the next one takes the rest of its epoch
    steps[0] = 5  # the position moved (a restored checkpoint): the loader starts again from it
    assert train(loader) == epoch(1, 1) and train(loader) == epoch(2)
    steps[0] = 6  # a resumed run: a new loader continues mid-epoch, then goes on into the next epochs
    resumed = EpochLoader(range(len(keys)), sampler(), collate_fn=listed)
    assert train(resumed) == epoch(1, 2) and train(resumed) == epoch(2)
    steps[0] = 0  # accumulation over 3 batches: ceil(4 / 3) = 2 steps an epoch
    accumulating = EpochLoader(range(len(keys)), sampler(accumulate=3), collate_fn=listed)
    for e in range(3):
        assert train(accumulating, accumulate=3) == epoch(e) and steps[0] == 2 * (e + 1)


def test_a_run_without_a_checkpoint_callback_has_no_epoch_end_checkpoint(tmp_path):
    from wanexp.callbacks.checkpoint import RunCheckpoint
    from wanexp.train import build_trainer

    base = ["experiment=demo", f"paths.output_dir={tmp_path}/run", "callbacks.progress=null"]
    assert isinstance(build_trainer(compose_cfg(base), tmp_path / "run").checkpoint_callback, RunCheckpoint)
    assert build_trainer(compose_cfg([*base, "callbacks.checkpoint=null"]), tmp_path / "run").checkpoint_callback \
        is None
