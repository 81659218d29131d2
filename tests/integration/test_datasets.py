"""Several datasets in one run (data.datasets): each read, probed and windowed with its own settings, its own
rejects file and repeat; every batch holds one bucket; the per-dataset sample counts per epoch are reported."""
from __future__ import annotations

import csv
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import tiny_run
from wanexp.data.datamodule import parse_datasets
from wanexp.errors import ConfigError


def test_two_datasets_of_different_shapes_and_repeats_train_in_one_run(shared_dir, tmp_path, capsys):
    """Shapes, repeats and a fractional weight; the progress bar shows each dataset's samples of the epoch."""
    from wanexp.data.synthetic import make_demo_dataset

    # a's clips are 2:1, cropped into its 64x64 (half of each picture): the start says so once, for a only
    a = make_demo_dataset(tmp_path / "a", num_videos=4, num_images=0, num_frames=9, height=64, width=128)
    b = make_demo_dataset(tmp_path / "b", num_videos=3, num_images=0, num_frames=9, height=64, width=96)
    datasets = (f"data.datasets={{a:{{metadata:'{a}',weight:1.5}},b:{{metadata:'{b}',repeat:2,num_frames:5,"
                f"frame_stride:2,height:64,width:96,caption_prefix:'style b, '}}}}")
    # a: 4 clips x 1.5 = 6 samples at 9x64x64 = 3 batches of 2 (each clip once, 2 of them twice, drawn per epoch);
    # b: 3 clips x 2 = 6 samples at 5x64x96 = 3 batches: 6 per epoch
    r = tiny_run(shared_dir, tmp_path / "run", ["model=tiny", datasets, "data.use_cache=false", "trainer.max_steps=12",
                                                "+callbacks.recorder._target_=tests.helpers.BatchRecorder",
                                                "+callbacks.bar._target_=wanexp.callbacks.progress.StepProgressBar"])
    start = capsys.readouterr().out  # the run's start lines
    dm = r["trainer"].datamodule
    batches = next(c for c in r["trainer"].callbacks if type(c).__name__ == "BatchRecorder").batches
    assert len(batches) == 12 and r["trainer"].num_training_batches == 6
    names = [p.name for p in dm.parts]
    for epoch in (batches[:6], batches[6:]):
        assert Counter(names[dm.dataset_part[i]] for batch in epoch for i in batch) == {"a": 6, "b": 6}
        a_clips = Counter(dm.dataset.samples[i].path for batch in epoch for i in batch if dm.dataset_part[i] == 0)
        assert sorted(a_clips.values()) == [1, 1, 2, 2]
        for batch in epoch:  # one dataset's bucket per batch, at that dataset's shape
            assert len({dm.dataset.shapes[i] for i in batch}) == 1
    assert batches[:6] != batches[6:]  # a new order each epoch
    bar = next(c for c in r["trainer"].callbacks if type(c).__name__ == "StepProgressBar")
    assert bar.train_progress_bar.postfix.endswith("a=6/6, b=6/6")  # the last step: the whole epoch seen
    # resumed from step 8 (mid-epoch 1): the same last 4 batches, the same LoRA bit for bit
    ckpt = Path(r["output_dir"]) / "checkpoints" / "step_000008.ckpt"
    resumed = tiny_run(shared_dir, tmp_path / "resumed", ["model=tiny", datasets, "data.use_cache=false",
                                                          "trainer.max_steps=12", f"resume={ckpt}",
                                                          "+callbacks.recorder._target_=tests.helpers.BatchRecorder"])
    assert next(c for c in resumed["trainer"].callbacks if type(c).__name__ == "BatchRecorder").batches == batches[8:]
    trained = {n: p for n, p in r["module"].named_parameters() if p.requires_grad}
    assert all(torch.equal(p, trained[n]) for n, p in resumed["module"].named_parameters() if p.requires_grad)
    shapes = {names[p]: dm.dataset.shapes[i] for i, p in enumerate(dm.dataset_part)}
    assert shapes == {"a": (9, 64, 64), "b": (5, 64, 96)}
    b_prompts = [s.prompt for s, p in zip(dm.dataset.samples, dm.dataset_part) if names[p] == "b"]
    assert all(p.startswith("style b, ") for p in b_prompts) and len(b_prompts) == 6
    assert dm.dataset.frame_stride == [1] * 8 + [2] * 6  # a: its clips, then the copy an epoch draws 2 of
    status = json.loads((Path(r["output_dir"]) / "status.json").read_text())
    per = status["data"]["datasets"]
    assert {n: (per[n]["samples"], per[n]["repeat"], per[n]["weight"], per[n]["rows"]) for n in per} == \
        {"a": (6, 1, 1.5, 4), "b": (6, 2, 1, 3)}
    out = Path(r["output_dir"])
    assert (out / "rejects-a.jsonl").is_file() and (out / "rejects-b.jsonl").is_file()  # each its own
    logged = next(x for x in csv.DictReader(open(out / "logs" / "version_0" / "metrics.csv")) if x["data/a/samples"])
    assert (float(logged["data/a/samples"]), float(logged["data/b/samples"])) == (6, 6)  # W&B gets the same metrics
    assert status["data"]["buckets"] == {"9x64x64": {"samples": 6, "fill": 0, "batches": 3},
                                         "5x64x96": {"samples": 6, "fill": 0, "batches": 3}}
    assert (per["a"]["cropped"], per["b"]["cropped"]) == (4, 0)
    assert "wanexp: data: samples per epoch: a 6 (4 x1 x weight 1.5), b 6 (3 x2)\n" in start
    assert start.count("wanexp: data: a: of 4 samples cropped into 64x64 (height x width), 0 have the other "
                       "orientation (portrait in a landscape shape or the reverse) and 4 lose more than a third") == 1
    assert "wanexp: data: b:" not in start


@pytest.fixture(scope="module")
def weighted(tmp_path_factory):
    """Three datasets set up (no model): a 4 clips weight 2, b 3 clips repeat 2, c 4 clips (another shape) weight
    0.5; batch 2."""
    from hydra.utils import instantiate

    from tests.conftest import compose_cfg
    from wanexp.data.synthetic import make_demo_dataset

    root = tmp_path_factory.mktemp("weighted")
    meta = {name: make_demo_dataset(root / name, num_videos=n, num_images=0, num_frames=9, height=h, width=w)
            for name, n, h, w in (("a", 4, 64, 64), ("b", 3, 64, 96), ("c", 4, 96, 64))}
    cfg = compose_cfg(["experiment=demo", f"paths.output_dir={root}/run", "data.use_cache=false",
                       f"data.datasets={{a:{{metadata:'{meta['a']}',weight:2}},b:{{metadata:'{meta['b']}',repeat:2,"
                       f"width:96}},c:{{metadata:'{meta['c']}',weight:0.5,height:96}}}}"])
    dm = instantiate(cfg.data, seed=0, _convert_="all")
    dm.setup("fit")
    return dm


def _epoch(sampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_weights_set_each_datasets_samples_per_epoch_and_a_fraction_is_drawn_anew(weighted):
    """weight 2 vs repeat 2 vs weight 0.5: 8 + 6 + 2 samples every epoch, one bucket per batch; c's 2 are a new draw
    each epoch, so over epochs all of its clips train."""
    dm = weighted
    assert {n: d["samples"] for n, d in dm.report["datasets"].items()} == {"a": 8, "b": 6, "c": 2}
    sampler = dm.train_dataloader().batch_sampler
    assert len(sampler) == 8  # 4 + 3 + 1 batches of 2
    drawn = []
    for epoch in range(4):
        batches = _epoch(sampler, epoch)
        assert Counter("abc"[dm.dataset_part[i]] for b in batches for i in b) == {"a": 8, "b": 6, "c": 2}
        assert all(len({dm.dataset.shapes[i] for i in b}) == 1 for b in batches)
        drawn.append(frozenset(dm.dataset.samples[i].path for b in batches for i in b if dm.dataset_part[i] == 2))
    assert len(set(drawn)) > 1 and len(frozenset().union(*drawn)) == 4
    assert _epoch(sampler, 3) == _epoch(sampler, 3)  # a function of (seed, epoch)


def test_weighted_epochs_split_over_ranks_and_resume_exactly(weighted):
    """Two ranks (batch 1 each) draw disjoint halves of the one-process steps; a sampler that follows a restored step
    count yields exactly the rest of that epoch."""
    from wanexp.data.datamodule import BucketBatchSampler

    dm = weighted
    shapes, pools = dm.dataset.shapes, dm.epoch_pools
    one = BucketBatchSampler(shapes, 2, seed=0, subsets=pools)
    ranks = [BucketBatchSampler(shapes, 1, rank, 2, seed=0, subsets=pools) for rank in (0, 1)]
    for epoch in (0, 1):
        full = _epoch(one, epoch)
        assert [r0 + r1 for r0, r1 in zip(*(_epoch(r, epoch) for r in ranks))] == full
    for steps in (3, 8, 11):  # mid-epoch 0, its end, mid-epoch 1
        resumed = BucketBatchSampler(shapes, 2, seed=0, subsets=pools)
        resumed.follow(lambda: steps, 1)
        assert list(resumed) == _epoch(one, steps // 8)[steps % 8:]


def test_the_report_says_what_an_epoch_trains_on_the_ranks_fill_included(weighted):
    """4 ranks x batch 2 (steps of 8): a's 8 samples make one step, b's 6 and c's 2 are filled to 8 with repeats from
    their own buckets; the loader the run builds puts that in the report (status.json) and the start line."""
    from types import SimpleNamespace

    dm = weighted
    dm.trainer = SimpleNamespace(global_rank=0, world_size=4, global_step=0, accumulate_grad_batches=1)
    try:
        loader = dm.train_dataloader()
    finally:
        dm.trainer = None
    assert len(loader) == 3
    assert {n: (d["samples"], d["fill"]) for n, d in dm.report["datasets"].items()} == \
        {"a": (8, 0), "b": (8, 2), "c": (8, 6)}
    assert dm.report["buckets"] == {"9x64x64": {"samples": 8, "fill": 0, "batches": 1},
                                    "9x64x96": {"samples": 6, "fill": 2, "batches": 1},
                                    "9x96x64": {"samples": 2, "fill": 6, "batches": 1}}
    assert dm.epoch_line(4) == ("a 8 (4 x1 x weight 2), b 8 (3 x2 + 2 to fill), c 8 (4 x1 x weight 0.5 + 6 to fill); "
                                "filled: 9x64x96 6 + 2, 9x96x64 2 + 6")
    assert dm.epoch_line(1).startswith("a 8 (4 x1 x weight 2), b 6 (3 x2), c 2 (4 x1 x weight 0.5)")  # one rank


def test_the_progress_bar_shows_each_datasets_samples_of_the_epoch(weighted):
    """The bar's postfix after optimizer step k: each dataset's samples in the epoch's first k batches (all ranks)
    of those the epoch trains, from the loader's order; a new epoch starts from 0."""
    from types import SimpleNamespace

    from wanexp.callbacks.progress import dataset_postfix

    dm = weighted
    sampler = dm.train_dataloader().batch_sampler
    for step in (1, 3, 8, 9, 12):
        epoch, k = divmod(step - 1, 8)
        seen = Counter("abc"[dm.dataset_part[i]] for b in _epoch(sampler, epoch)[:k + 1] for i in b)
        shown = dataset_postfix(SimpleNamespace(datamodule=dm, global_step=step))
        assert shown == {n: f"{seen[n]}/{total}" for n, total in (("a", 8), ("b", 6), ("c", 2))}
    assert dataset_postfix(SimpleNamespace(datamodule=dm, global_step=0)) == {}
    assert dataset_postfix(SimpleNamespace(datamodule=None, global_step=5)) == {}


TOP = {"metadata": None, "root": None, "repeat": 1, "num_frames": 9, "height": 64, "width": 64, "buckets": None,
       "frame_stride": 1, "window": "first", "windows_per_clip": 1, "caption_prefix": ""}


@pytest.mark.parametrize("datasets, says", [
    ([{"repeat": 2}], "data.datasets.0: no metadata; set data.datasets.0.metadata"),
    ({"x": {"metadata": "m.csv", "repaet": 2}}, "data.datasets.x: unknown key repaet"),
    ({"x": {"metadata": "m.csv", "num_frames": 8}}, "data.datasets.x.num_frames=8: must be 4k+1"),
    ({"x": {"metadata": "m.csv", "repeat": 0}}, "data.datasets.x.repeat=0: must be an integer >= 1"),
    ([{"metadata": "a.csv", "name": "s"}, {"metadata": "b.csv", "name": "s"}], "two datasets are named s"),
    ([], "data.datasets is empty"),
    ({"x": {"metadata": "m.csv", "weight": -1}}, "data.datasets.x.weight=-1: must be a number >= 0"),
    ({"x": {"metadata": "m.csv", "weight": "2x"}}, "data.datasets.x.weight='2x': must be a number >= 0"),
    ({"x": {"metadata": "m.csv", "weight": float("nan")}}, "data.datasets.x.weight=nan: must be a number >= 0"),
    ({"x": {"metadata": "m.csv", "weight": True}}, "data.datasets.x.weight=True: must be a number >= 0"),
    ([{"metadata": "a.csv", "weight": 0}, {"metadata": "b.csv", "weight": 0.0}], "data.datasets: every weight is 0"),
])
def test_a_bad_datasets_entry_is_one_line_naming_it(datasets, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        parse_datasets(datasets, TOP, frame_rule=(4, 1))  # Wan's frame rule


def test_the_cache_encodes_each_dataset_at_its_shape_and_a_run_trains_from_it(shared_dir, tmp_path):
    from tests.conftest import compose_cfg
    from wanexp.cli.cache import build_cache
    from wanexp.data.metadata import read_metadata_with_rejects
    from wanexp.data.synthetic import make_demo_dataset

    a = make_demo_dataset(tmp_path / "a", num_videos=2, num_images=0, num_frames=9, height=64, width=64)
    b = make_demo_dataset(tmp_path / "b", num_videos=2, num_images=0, num_frames=9, height=64, width=96)
    common = [f"data.datasets=[{{metadata:'{a}'}},{{metadata:'{b}',num_frames:5,frame_stride:2,width:96,repeat:2}}]",
              f"data.cache_dir={tmp_path / 'cache'}"]
    stats = build_cache(compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models",
                                     f"paths.data_dir={shared_dir}/data", *common]))
    prompts = {s.prompt for meta in (a, b) for s in read_metadata_with_rejects(meta, None)[0]}
    assert stats["latents"] == 4 and stats["texts"] == len(prompts)  # each clip once, at its dataset's shape
    r = tiny_run(shared_dir, tmp_path / "run", ["model=tiny", *common, "trainer.max_steps=2"])
    assert r["module"].encoders is None and r["global_step"] == 2  # every entry of both datasets was cached
    assert sorted(set(r["trainer"].datamodule.dataset.shapes)) == [(5, 64, 96), (9, 64, 64)]


@pytest.mark.parametrize("entry, says", [("{metadata:x.csv,reapeat:2}", "data.datasets.0: unknown key reapeat"),
                                         ("{metadata:x.csv,weight:-0.5}", "data.datasets.0.weight=-0.5: must be")])
def test_a_bad_entry_stops_the_run_before_anything_is_written(shared_dir, tmp_path, entry, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        tiny_run(shared_dir, tmp_path / "run", ["model=tiny", f"data.datasets=[{entry}]"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("entry, says", [
    ("{metadata:a.csv,width:100}", "data.datasets.0.width=100: model=tiny needs a multiple of 32 (e.g. 96 or 128)"),
    ("{metadata:a.csv,buckets:[[64,64],[64,80]]}", "data.datasets.0.buckets[1]=[64, 80]: height and width must be"),
    ("{metadata:a.csv,window:chunks} data.probe=false", "data.datasets.0.window=chunks with data.probe=false"),
])
def test_a_datasets_shape_the_model_cannot_take_is_one_line(entry, says):
    from tests.conftest import compose_cfg
    from wanexp.config import check_config

    with pytest.raises(ConfigError, match=re.escape(says)):
        entry, *extra = entry.split()
        check_config(compose_cfg(["experiment=demo", f"data.datasets=[{entry}]", *extra]))
