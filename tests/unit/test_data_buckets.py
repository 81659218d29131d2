"""Bucket batches: a bucket whose samples do not fill its last step of world x batch is filled from that bucket, so
every sample of an epoch trains in that epoch, every rank gets the same number of batches, and what the report
says an epoch trains is what the loader yields."""
from __future__ import annotations

from collections import Counter

import pytest

from wanexp.data.datamodule import BucketBatchSampler, epoch_items, parse_datasets, samples_per_epoch_line

CLIP, STILL = (9, 64, 64), (1, 64, 64)
TOP = {"metadata": None, "root": None, "repeat": 1, "num_frames": 9, "height": 64, "width": 64, "buckets": None,
       "frame_stride": 1, "window": "first", "windows_per_clip": 1, "caption_prefix": ""}


def _mix(entries: dict, sizes: dict) -> tuple[list, list, list[int]]:
    """Training samples of datasets ``entries`` (name -> data.datasets entry) of ``sizes`` (name -> (items,
    shape)), as the datamodule builds them: (each sample's bucket, the fractional-weight pools, each one's
    dataset)."""
    parts = parse_datasets({n: dict(e, metadata=f"{n}.csv") for n, e in entries.items()}, TOP)
    item_part, shapes = [], []
    for p, part in enumerate(parts):
        n, shape = sizes[part.name]
        item_part += [p] * n
        shapes += [shape] * n
    train, pools, _ = epoch_items(item_part, shapes, [False] * len(shapes), parts)
    return [shapes[i] for i in train], pools, [item_part[i] for i in train]


def _ranks(keys, pools, owners, world: int, batch: int) -> list[BucketBatchSampler]:
    return [BucketBatchSampler(keys, batch, rank, world, seed=3, subsets=pools, owners=owners) for rank in range(world)]


def _epoch(sampler: BucketBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


CASES = {  # name: (datasets, sizes, world, batch, samples each dataset trains per epoch, fill included)
    "clips 7 + stills 5 x3, 2 ranks x batch 2": ({"clips": {}, "stills": {"repeat": 3}},
                                                 {"clips": (7, CLIP), "stills": (5, STILL)}, 2, 2,
                                                 {"clips": 8, "stills": 16}),
    "stills 5 at weight 0.5, 2 ranks x batch 2": ({"clips": {}, "stills": {"weight": 0.5}},
                                                  {"clips": (8, CLIP), "stills": (5, STILL)}, 2, 2,
                                                  {"clips": 8, "stills": 4}),
    "clips 40 + stills 5, 4 ranks x batch 2": ({"clips": {}, "stills": {}}, {"clips": (40, CLIP), "stills": (5, STILL)},
                                               4, 2, {"clips": 40, "stills": 8}),
}


@pytest.mark.parametrize("case", CASES)
def test_every_sample_of_an_epoch_trains_in_it_on_equal_ranks_in_one_bucket_batches(case):
    entries, sizes, world, batch, trained = CASES[case]
    keys, pools, owners = _mix(entries, sizes)
    names = list(entries)
    ranks = _ranks(keys, pools, owners, world, batch)
    for epoch in range(3):
        per_rank = [_epoch(r, epoch) for r in ranks]
        assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(ranks[0])  # equal-length ranks
        batches = [b for rank in per_rank for b in rank]
        assert all(len(b) == batch and len({keys[i] for i in b}) == 1 for b in batches)  # whole, one bucket each
        seen = Counter(i for b in batches for i in b)
        left_out = ranks[0]._left_out(epoch)  # a fractional weight's draw: the part of the pool this epoch skips
        assert set(seen) == set(range(len(keys))) - left_out  # every sample of the epoch, none dropped
        assert {n: sum(c for i, c in seen.items() if names[owners[i]] == n) for n in names} == trained
        fills = Counter(seen) - Counter(set(seen))  # the repeats
        assert ranks[0].trained() == {p: (trained[n], sum(c for i, c in fills.items() if owners[i] == p))
                                      for p, n in enumerate(names)}  # what the report says


def test_a_fill_is_drawn_from_the_seed_and_epoch_and_resume_continues_it_exactly():
    keys, pools, owners = _mix({"clips": {}, "stills": {"repeat": 3}}, {"clips": (7, CLIP), "stills": (5, STILL)})
    one = BucketBatchSampler(keys, 4, seed=3, owners=owners)  # one rank, batch 4: the two ranks' steps
    ranks = _ranks(keys, pools, owners, 2, 2)
    repeated = []
    for epoch in range(4):
        full = _epoch(one, epoch)
        assert [r0 + r1 for r0, r1 in zip(*(_epoch(r, epoch) for r in ranks))] == full  # each rank its slice
        repeated.append(frozenset(i for i, c in Counter(i for b in full for i in b).items() if c > 1))
        assert _epoch(one, epoch) == full  # a function of (seed, epoch)
    assert len(set(repeated)) > 1  # which samples fill is drawn anew each epoch
    for steps in (2, 6, 9):  # mid-epoch 0, its end (6 steps), mid-epoch 1
        resumed = BucketBatchSampler(keys, 4, seed=3, owners=owners)
        resumed.follow(lambda: steps, 1)
        assert list(resumed) == _epoch(one, steps // 6)[steps % 6:]


def test_the_fill_of_a_shared_bucket_is_split_over_its_datasets_the_same_each_epoch():
    """Two datasets of one shape: each gives the fill in proportion to its samples, so each one's count per epoch
    (status.json, the start line) is fixed."""
    keys, pools, owners = _mix({"a": {}, "b": {}}, {"a": (5, CLIP), "b": (4, CLIP)})  # 9 of one bucket, steps of 4
    sampler = BucketBatchSampler(keys, 2, 0, 2, seed=0, owners=owners)
    assert sampler.trained() == {0: (7, 2), 1: (5, 1)}  # 3 to fill: 5/9 and 4/9 of 3 -> 2 + 1
    for epoch in range(3):
        steps = sampler._global_batches(epoch)
        assert Counter(owners[i] for s in steps for i in s) == {0: 7, 1: 5}


def test_the_start_line_says_what_an_epoch_trains_fill_included():
    datasets = {"clips": {"items": 7, "repeat": 1, "samples": 8, "fill": 1},
                "stills": {"items": 5, "repeat": 3, "samples": 16, "fill": 1, "weight": 1.0}}
    assert samples_per_epoch_line(datasets) == "clips 8 (7 x1 + 1 to fill), stills 16 (5 x3 + 1 to fill)"
    assert samples_per_epoch_line({"a": {"items": 4, "repeat": 1, "samples": 6, "weight": 1.5}}) == \
        "a 6 (4 x1 x weight 1.5)"


def test_crop_share_is_what_cover_and_center_crop_cut_away():
    from wanexp.data.datamodule import crop_share

    assert crop_share(1280, 704, 704, 1280) == 0
    assert crop_share(720, 1280, 704, 1280) == pytest.approx(1 - (720 / 1280) / (1280 / 704))  # 9:16 into 16:9: 69 %
    assert crop_share(1280, 720, 1280, 704) == pytest.approx(crop_share(720, 1280, 704, 1280))  # the reverse
    assert crop_share(960, 720, 720, 1280) == pytest.approx(0.25)  # 4:3 into 16:9


def _mixed_aspects(tmp_path, *extra):
    """2 landscape clips, 2 portrait ones and a panorama, trained at 64x96 (height x width) unless ``extra`` says."""
    from tests.conftest import compose_cfg
    from wanexp.data.synthetic import make_demo_dataset
    from wanexp.composition import build, build_datamodule, prepare_model_folder

    rows = ["video,prompt"]
    for name, n, (h, w) in (("land", 2, (64, 96)), ("port", 2, (96, 64)), ("pano", 1, (32, 128))):
        meta = make_demo_dataset(tmp_path / name, num_videos=n, num_images=0, num_frames=9, height=h, width=w)
        rows += [f"{name}/{line}" for line in meta.read_text().splitlines()[1:]]
    (tmp_path / "meta.csv").write_text("\n".join(rows) + "\n")
    cfg = compose_cfg(["experiment=demo", f"data.metadata={tmp_path}/meta.csv", "data.generate=null",
                       "data.cache_dir=null", "data.height=64", "data.width=96", f"paths.output_dir={tmp_path}/run",
                       *extra])
    spec = build(cfg.model)
    prepare_model_folder(spec, cfg.boundary.name)  # the datamodule reads the model's tokenizer
    dm = build_datamodule(cfg, spec)
    dm.setup()
    return dm


def test_media_cropped_into_a_shape_of_another_aspect_are_counted_and_noted_once(tmp_path):
    dm = _mixed_aspects(tmp_path)
    d = dm.report["datasets"]["synthetic"]
    assert (d["cropped"], d["other_orientation"]) == (3, 2)  # the portraits and the panorama; the portraits
    assert dm.report["notes"] == [
        "of 5 samples cropped into 64x96 (height x width), 2 have the other orientation (portrait in a landscape shape "
        "or the reverse) and 3 lose more than a third of their picture; data.buckets trains each at the resolution "
        "nearest its aspect ratio"]
    dm = _mixed_aspects(tmp_path, "data.buckets=[[64,96],[96,64],[32,128]]")  # each at its own aspect: no crop
    assert (dm.report["datasets"]["synthetic"]["cropped"], dm.report["notes"]) == (0, [])
    meta = tmp_path / "meta.csv"
    dm = _mixed_aspects(tmp_path, f"data.datasets={{a:{{metadata:'{meta}'}},b:{{metadata:'{meta}',height:96,"
                                  "width:64}}")  # one note a dataset, named
    assert [n.split(",")[0] for n in dm.report["notes"]] == ["a: of 5 samples cropped into 64x96 (height x width)",
                                                             "b: of 5 samples cropped into 96x64 (height x width)"]
    b = dm.report["datasets"]["b"]  # portrait: the landscape clips and the panorama are cropped, all of them across
    assert (b["cropped"], b["other_orientation"], dm.report["cropped"]) == (3, 3, 6)
