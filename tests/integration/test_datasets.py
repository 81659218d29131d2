"""Several datasets in one run (data.datasets): each read, probed and windowed with its own settings, its own
rejects file and repeat; every batch holds one bucket; the per-dataset sample counts per epoch are reported."""
from __future__ import annotations

import csv
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.conftest import tiny_run
from wanexp.data.datamodule import parse_datasets
from wanexp.errors import ConfigError


def test_two_datasets_of_different_shapes_and_repeats_train_in_one_run(shared_dir, tmp_path, capsys):
    from wanexp.data.synthetic import make_demo_dataset

    a = make_demo_dataset(tmp_path / "a", num_videos=4, num_images=0, num_frames=9, height=64, width=64)
    b = make_demo_dataset(tmp_path / "b", num_videos=3, num_images=0, num_frames=9, height=64, width=96)
    datasets = (f"data.datasets={{a:{{metadata:'{a}'}},b:{{metadata:'{b}',repeat:2,num_frames:5,frame_stride:2,"
                f"height:64,width:96,caption_prefix:'style b, '}}}}")
    # a: 4 samples at 9x64x64 = 2 batches of 2; b: 3 clips x 2 = 6 samples at 5x64x96 = 3 batches: 5 per epoch
    r = tiny_run(shared_dir, tmp_path / "run", ["model=tiny", datasets, "data.use_cache=false", "trainer.max_steps=10",
                                                "+callbacks.recorder._target_=tests.helpers.BatchRecorder"])
    dm = r["trainer"].datamodule
    batches = next(c for c in r["trainer"].callbacks if type(c).__name__ == "BatchRecorder").batches
    assert len(batches) == 10 and r["trainer"].num_training_batches == 5
    names = [p.name for p in dm.parts]
    for epoch in (batches[:5], batches[5:]):
        assert Counter(names[dm.dataset_part[i]] for batch in epoch for i in batch) == {"a": 4, "b": 6}
        for batch in epoch:  # one dataset's bucket per batch, at that dataset's shape
            assert len({dm.dataset.shapes[i] for i in batch}) == 1
    assert batches[:5] != batches[5:]  # a new order each epoch
    shapes = {names[p]: dm.dataset.shapes[i] for i, p in enumerate(dm.dataset_part)}
    assert shapes == {"a": (9, 64, 64), "b": (5, 64, 96)}
    b_prompts = [s.prompt for s, p in zip(dm.dataset.samples, dm.dataset_part) if names[p] == "b"]
    assert all(p.startswith("style b, ") for p in b_prompts) and len(b_prompts) == 6
    assert dm.dataset.frame_stride == [1] * 4 + [2] * 6
    status = json.loads((Path(r["output_dir"]) / "status.json").read_text())
    per = status["data"]["datasets"]
    assert {n: (per[n]["samples"], per[n]["repeat"], per[n]["rows"]) for n in per} == {"a": (4, 1, 4), "b": (6, 2, 3)}
    out = Path(r["output_dir"])
    assert (out / "rejects-a.jsonl").is_file() and (out / "rejects-b.jsonl").is_file()  # each its own
    logged = next(x for x in csv.DictReader(open(out / "logs" / "version_0" / "metrics.csv")) if x["data/a/samples"])
    assert (float(logged["data/a/samples"]), float(logged["data/b/samples"])) == (4, 6)  # W&B gets the same metrics
    assert "wanexp: data: samples per epoch: a 4 (4 x1), b 6 (3 x2)" in capsys.readouterr().out


TOP = {"metadata": None, "root": None, "repeat": 1, "num_frames": 9, "height": 64, "width": 64, "buckets": None,
       "frame_stride": 1, "window": "first", "windows_per_clip": 1, "caption_prefix": ""}


@pytest.mark.parametrize("datasets, says", [
    ([{"repeat": 2}], "data.datasets.0: no metadata; set data.datasets.0.metadata"),
    ({"x": {"metadata": "m.csv", "repaet": 2}}, "data.datasets.x: unknown key repaet"),
    ({"x": {"metadata": "m.csv", "num_frames": 8}}, "data.datasets.x.num_frames=8: must be 4k+1"),
    ({"x": {"metadata": "m.csv", "repeat": 0}}, "data.datasets.x.repeat=0: must be an integer >= 1"),
    ([{"metadata": "a.csv", "name": "s"}, {"metadata": "b.csv", "name": "s"}], "two datasets are named s"),
    ([], "data.datasets is empty"),
])
def test_a_bad_datasets_entry_is_one_line_naming_it(datasets, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        parse_datasets(datasets, TOP)


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


def test_a_bad_entry_stops_the_run_before_anything_is_written(shared_dir, tmp_path):
    with pytest.raises(ConfigError, match=re.escape("data.datasets.0: unknown key reapeat")):
        tiny_run(shared_dir, tmp_path / "run", ["model=tiny", "data.datasets=[{metadata:x.csv,reapeat:2}]"])
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
