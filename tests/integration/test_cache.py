"""The latent/text cache: encoded once, read back bit for bit, keyed so a change invalidates exactly what it affects,
resumable after a kill, split over ranks; a run whose samples are all cached never loads the encoders."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, compose_cfg
from tests.integration.conftest import tiny_run
from wanexp.cli.cache import build_cache
from wanexp.data.cache import CacheIndex
from wanexp.models.tiny import ensure_tiny_model
from wanexp.composition import build
from wanexp.models.wan22.encoders import encode_text, encode_video


def _cfg(shared_dir, cache_dir, *extra):
    return compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models",
                        f"paths.data_dir={shared_dir}/data", f"data.cache_dir={cache_dir}", *extra])


def _datamodule(cfg):
    spec = build(cfg.model)
    ensure_tiny_model(spec)
    dm = build(cfg.data, _partial_=True, seed=0)(encoders=spec.encoder_info())
    dm.prepare()
    dm.setup()
    return spec, dm


def test_cache_round_trips_and_training_reads_it_without_encoders(shared_dir, tmp_path):
    cache = tmp_path / "cache"
    stats = build_cache(_cfg(shared_dir, cache))
    assert stats["written"] == 20 and stats["rejected"] == 0  # 10 clips/images + 10 prompts
    spec, dm = _datamodule(_cfg(shared_dir, cache))
    assert dm.cached and len(dm.dataset) == 10
    index = CacheIndex(cache)
    encoders = spec.load_encoders()
    for i in range(len(dm.dataset)):
        cached = dm.dataset[i]
        sample, (frames, h, w) = dm.dataset.samples[i], dm.dataset.shapes[i]
        from wanexp.data.media import load_clip

        pixels = load_clip(sample, frames, h, w, dm.frame_stride)[None]
        assert torch.equal(cached["latents"], encode_video(encoders.vae, pixels)[0])  # bit for bit
        online = encode_text(encoders.tokenizer, encoders.text_encoder, [sample.prompt], spec.text_len)[0]
        assert torch.equal(cached["text"], online)  # trimmed on disk, zero-padded back exactly
    from wanexp.models.wan22.encoders import tokenize

    for i in range(len(dm.dataset)):  # only each prompt's real tokens are stored
        stored = index.load(dm.keys[i][1])["text"]
        real = int(tokenize(encoders.tokenizer, [dm.dataset.samples[i].prompt], spec.text_len).attention_mask.sum())
        assert stored.shape[0] == real and stored.abs().sum(-1).min() > 0
    r = tiny_run(shared_dir, tmp_path / "run", ["model=tiny", f"data.cache_dir={cache}", "trainer.max_steps=2"])
    assert r["module"].encoders is None and r["global_step"] == 2
    status = json.loads((Path(r["output_dir"]) / "status.json").read_text())
    assert status["data"]["cache"]["used"] is True


def test_a_change_invalidates_exactly_the_entries_it_affects(shared_dir, tmp_path):
    cache = tmp_path / "cache"
    data = tmp_path / "data"
    base = [f"paths.data_dir={data}"]
    build_cache(_cfg(shared_dir, cache, *base))  # generates its own copy of the clips (its caption changes below)

    def missing(*extra):
        return _datamodule(_cfg(shared_dir, cache, *base, *extra))[1].report["cache"]["missing_entries"]

    assert missing() == 0
    assert missing("data.height=96") == 10  # every latent, no text
    assert missing("data.frame_stride=2") == 8  # the 8 videos; an image has one frame at any stride
    assert missing("data.fps=12") == 8  # the videos, resampled to another rate; an image is one frame at any rate
    assert missing("model.text_len=32") == 10  # every text, no latent
    assert missing("data.cache_dtype=bf16") == 10  # every latent, no text
    meta = data / "synthetic" / "metadata.csv"
    rows = meta.read_text().splitlines()
    rows[1] = rows[1].rsplit(",", 1)[0] + ",a new caption for one clip"
    meta.write_text("\n".join(rows) + "\n")
    assert missing() == 1  # that prompt's text only


def test_an_interrupted_cache_resumes_where_it_stopped(shared_dir, tmp_path, monkeypatch, capsys):
    """A run killed mid-write leaves, at worst: shards indexed up to some entry, the next shard on disk with its
    index line cut short, a half-written temporary shard, and nothing of what waited for the writer thread. That
    state is made in-process (the writer's index append dies half-way through the 14th entry's line: every text,
    encoded first, and 3 latents are in), then the cache command resumes it."""
    import wanexp.data.cache as cache_mod
    from wanexp.cli.cache import cache_cli

    cache = tmp_path / "cache"
    cfg = _cfg(shared_dir, cache, "data.cache_shard_size=1", "data.num_workers=1")
    append, calls = cache_mod._append_lines, []

    def dies_on_the_14th(path, lines):
        calls.append(lines)
        if len(calls) < 14:
            return append(path, lines)
        with open(path, "a") as f:
            f.write(lines[0][: len(lines[0]) // 2])  # the line cut short, no newline
        raise RuntimeError("killed while appending to the index")

    monkeypatch.setattr(cache_mod, "_append_lines", dies_on_the_14th)
    with pytest.raises(RuntimeError, match="killed"):
        build_cache(cfg)
    monkeypatch.setattr(cache_mod, "_append_lines", append)
    index = cache / "index-r000.jsonl"
    assert not index.read_text().endswith("\n") and len(CacheIndex(cache)) == 13  # 10 texts, 3 latents
    # the failed write stopped the writer: no shard after the 14th was saved (as after a kill)
    assert len(list(cache.glob("*.safetensors"))) == 14
    (cache / ".latent-r000-00009.safetensors.1.tmp").write_bytes(b"half a shard")  # a save the kill cut short
    cache_cli(cfg)
    out = capsys.readouterr().out
    assert "wrote 7 entries" in out and "13 already cached" in out
    assert re.search(r"cache rank 0: [\d.]+ samples/s, \dm\d\ds in all; the VAE alone [\d.]+ samples/s", out)
    lines = index.read_text().splitlines()
    assert lines[13] == calls[13][0][: len(calls[13][0]) // 2]  # the cut line, kept on its own
    keys = [json.loads(line)["key"] for i, line in enumerate(lines) if i != 13]  # the cut line stays apart
    assert len(keys) == len(set(keys)) == 20 and len(CacheIndex(cache)) == 20  # nothing encoded twice
    assert not list(cache.glob(".*.tmp"))
    # each latent line names its clip (the keys are hashes): the file and the window's first frame
    latent = [e for e in CacheIndex(cache).entries.values() if e["kind"] == "latent"]
    assert latent and all(Path(e["media"]).is_file() and isinstance(e["start"], int) for e in latent)


def test_the_summary_counts_the_rows_the_reader_and_the_probe_rejected(shared_dir, tmp_path, capsys):
    """3 files the probe drops and a row without a caption: the cache says 4 of 6 rows rejected, as a run does."""
    from wanexp.cli.cache import cache_cli
    from wanexp.data.synthetic import make_demo_dataset

    meta = make_demo_dataset(tmp_path / "data", num_videos=2, num_images=0, num_frames=9, height=64, width=64)
    (meta.parent / "zero.mp4").write_bytes(b"")
    (meta.parent / "noise.mp4").write_bytes(bytes(range(256)) * 8)
    with open(meta, "a") as f:
        f.write("zero.mp4,empty\nnoise.mp4,random bytes\nmissing.mp4,gone\nvideos/clip_000.mp4,\n")
    cfg = _cfg(shared_dir, tmp_path / "cache", f"data.metadata={meta}", "data.generate=null",
               "data.max_reject_fraction=0.9")
    cache_cli(cfg)
    out = capsys.readouterr().out
    assert f"4 of 6 rows rejected (reasons in {tmp_path / 'cache'}/rejects*.jsonl)" in out, out
    reasons = [json.loads(line)["reason"] for line in (tmp_path / "cache" / "rejects.jsonl").read_text().splitlines()]
    assert len(reasons) == 4 and "file not found" in reasons
    assert build_cache(cfg)["rejected"] == 4  # and again once all is cached


def test_the_overlapped_cache_writes_the_bytes_of_the_sequential_one(shared_dir, tmp_path, capsys):
    """Loader workers decoding ahead, the writer thread saving shards (several waiting: 3 entries a shard) write
    the files the parts run one after another write, byte for byte; rank 0 prints its rate and ETA as it goes."""
    seq, ovl = tmp_path / "sequential", tmp_path / "overlapped"
    build_cache(_cfg(shared_dir, seq, "data.cache_shard_size=3"), overlap=False)
    capsys.readouterr()
    stats = build_cache(_cfg(shared_dir, ovl, "data.cache_shard_size=3", "data.num_workers=1"), progress_every_s=0)
    files = sorted(p.name for p in seq.iterdir())
    assert files == sorted(p.name for p in ovl.iterdir()) and len(files) == 10  # 4+4 shards, index, rejects
    assert all((seq / f).read_bytes() == (ovl / f).read_bytes() for f in files)
    progress = re.findall(r"wanexp: cache r0: (\d+)/10 samples, ([\d.]+) samples/s, ETA (\d+)m(\d\d)s, text 10/10",
                          capsys.readouterr().out)
    assert [int(p[0]) for p in progress][:10] == list(range(1, 11)) and all(float(p[1]) > 0 for p in progress)
    assert stats["samples_per_s"] > 0 and stats["vae_samples_per_s"] >= stats["samples_per_s"]


@pytest.mark.slow
def test_ranks_split_the_cache_under_torchrun(shared_dir, tmp_path):
    cache = tmp_path / "cache"
    _datamodule(_cfg(shared_dir, cache))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29547", "-m",
           "wanexp.cli.cache", "experiment=demo", f"paths.tiny_model_dir={shared_dir}/models",
           f"paths.data_dir={shared_dir}/data", f"data.cache_dir={cache}", f"paths.output_dir={tmp_path}/out"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-2000:]
    per_rank = [len((cache / f"index-r00{r}.jsonl").read_text().splitlines()) for r in (0, 1)]
    assert per_rank == [10, 10] and len(CacheIndex(cache)) == 20


def test_loader_benchmark_reports_both_paths(shared_dir, tmp_path):
    from wanexp.cli.bench_loader import loader_rate

    cache = tmp_path / "cache"
    raw = loader_rate(_cfg(shared_dir, cache), False, 4)
    assert raw["path"] == "raw media" and raw["samples_per_s"] > 0
    assert "skipped" in loader_rate(_cfg(shared_dir, cache), True, 4)  # nothing cached yet
    build_cache(_cfg(shared_dir, cache))
    cached = loader_rate(_cfg(shared_dir, cache), True, 4)
    assert cached["path"] == "cache" and cached["samples_per_s"] > 0


def test_bf16_cache_stores_the_fp32_latents_rounded(shared_dir, tmp_path):
    one = "data.max_samples=1"  # the sample compared below; each cached sample is a VAE encode
    build_cache(_cfg(shared_dir, tmp_path / "fp32", one))
    build_cache(_cfg(shared_dir, tmp_path / "bf16", one, "data.cache_dtype=bf16"))
    _, full = _datamodule(_cfg(shared_dir, tmp_path / "fp32", one))
    _, half = _datamodule(_cfg(shared_dir, tmp_path / "bf16", one, "data.cache_dtype=bf16"))
    a, b = full.dataset[0], half.dataset[0]
    assert b["latents"].dtype == torch.bfloat16 and torch.equal(b["latents"], a["latents"].to(torch.bfloat16))
    assert torch.equal(a["text"], b["text"])
