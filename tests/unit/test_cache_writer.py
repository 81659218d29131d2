"""The cache's writer thread, its index appends after a kill, and the cache command's progress line."""
from __future__ import annotations

import threading

import pytest
import torch

from wanexp.cli.cache import Progress, rate_line
from wanexp.data.cache import CacheIndex, CacheWriter, ShardQueue, _append_lines


def _jobs(done: list, release: threading.Event, failing: int | None = None):
    def job(i):
        def run():
            release.wait(5)
            if i == failing:
                raise OSError("No space left on device")
            done.append(i)
        return run
    return job


def test_the_writer_thread_saves_in_order_with_at_most_depth_waiting():
    q, done, release = ShardQueue(depth=1), [], threading.Event()
    job = _jobs(done, release)
    threading.Timer(0.3, release.set).start()
    for i in range(4):  # job 0 runs and job 1 waits until the timer: the later submits wait for the thread
        q.submit(job(i))
    assert q.wait_s >= 0.2
    q.close()
    assert done == [0, 1, 2, 3]


def test_a_failed_write_is_raised_and_nothing_handed_over_after_it_is_written():
    q, done, release = ShardQueue(depth=4), [], threading.Event()
    job = _jobs(done, release, failing=1)
    for i in range(4):  # all handed over while job 0 runs
        q.submit(job(i))
    release.set()
    with pytest.raises(OSError, match="No space"):
        q.close()
    assert done == [0]  # 2 and 3 came after the failed 1: skipped, as a kill would have lost them
    with pytest.raises(OSError, match="No space"):
        q.submit(job(4))


def test_a_line_a_kill_cut_short_is_skipped_and_the_next_append_starts_a_new_line(tmp_path):
    w = CacheWriter(tmp_path, "text", shard_entries=1)
    w.add("a", {"text": torch.ones(2)})
    index = tmp_path / "index-r000.jsonl"
    with open(index, "a") as f:
        f.write('{"key": "b", "kind": "text", "sha')  # killed mid-append
    assert set(CacheIndex(tmp_path).entries) == {"a"}
    w.add("c", {"text": torch.zeros(2)})
    assert set(CacheIndex(tmp_path).entries) == {"a", "c"}
    assert index.read_text().splitlines()[1] == '{"key": "b", "kind": "text", "sha'
    _append_lines(index, ["{}"])  # an append to a file that ends in a newline adds no blank line
    assert index.read_text().endswith('"]}\n{}\n')


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_progress_prints_rate_and_eta_every_interval_on_rank_0(capsys):
    clock = Clock()
    p = Progress(samples=100, texts=8, rank=0, every_s=30, clock=clock)
    p.texts_done, p.text_s = 4, 0.1
    assert p.line() == "wanexp: cache r0: 0/100 samples, text 4/8 (40 prompts/s)"  # the text encoder runs first
    clock.t += 50  # the text encoder's time: not in the samples' rate
    p.texts_done = 8
    p.tick()
    assert capsys.readouterr().out == "wanexp: cache r0: 0/100 samples, text 8/8\n"
    p.samples_start = clock.t
    clock.t += 20
    p.done = 40
    p.tick()  # 20 s since the last line: nothing yet
    assert capsys.readouterr().out == ""
    clock.t += 10
    p.done = 60
    p.tick()
    assert capsys.readouterr().out == "wanexp: cache r0: 60/100 samples, 2.00 samples/s, ETA 0m20s, text 8/8\n"
    q = Progress(samples=100, texts=0, rank=1, every_s=0, clock=clock)
    q.tick(force=True)
    assert capsys.readouterr().out == ""  # one rank prints
    p.vae_s, p.wait_decode_s = 27.0, 1.5
    s = p.summary()
    assert s["samples_per_s"] == pytest.approx(2.0) and s["vae_samples_per_s"] == pytest.approx(60 / 27)
    assert rate_line(s).startswith("2.00 samples/s, 1m20s in all; the VAE alone 2.22 samples/s (90 % of it); "
                                   "waited 1.5 s")


def test_the_gpu_case_reads_the_cache_s_rate_line(tmp_path):
    """cache_speed_5b judges the final line the cache command prints (rate_line): samples/s within 10 % of the VAE's."""
    from tests.gpu import registry, run

    case = registry.CASES[registry.CACHE_SPEED]
    ctx = registry.Ctx(tmp_path / "w", tmp_path / "o")
    logs = ctx.work / "logs" / case.name
    logs.mkdir(parents=True)
    for phase, (rate, vae) in {"cache_fp32": (1.85, 1.92), "cache_bf16": (3.0, 3.7), "cache_fp16": (3.1, 3.2)}.items():
        s = {"samples_per_s": rate, "vae_samples_per_s": vae, "seconds": 26.0, "wait_decode_s": 0.4,
             "wait_write_s": 0.0, "text_s": 2.0}
        (logs / f"{phase}.log").write_text(f"wanexp: cache rank 0/1: wrote 96 entries\nwanexp: cache rank 0: "
                                           f"{rate_line(s)}\n")
    (logs / "compare.log").write_text("compare_caches: bf16 rel_err 1.400e-02 worst_clip 2.000e-02 not_finite 0 "
                                      "clips 48\ncompare_caches: fp16 rel_err 9.000e-04 worst_clip 1.000e-03 "
                                      "not_finite 0 clips 48\n")
    result = run.judge(case, ctx, {p.name: {"ok": True, "rc": 0} for p in case.phases}, ["NVIDIA H100 80GB HBM3"])
    m = result["metrics"]
    assert m["cache_fp32"] == {"samples_per_s": 1.85, "vae_samples_per_s": 1.92, "share_pct": 96}
    assert m["cache_bf16"]["share_pct"] == 81 and m["cache_bf16"]["rel_err"] == 1.4e-2
    assert m["cache_fp16"]["rel_err"] == 9e-4 and m["cache_fp16"]["not_finite"] == 0
    assert result["verdict"] == "FAIL" and [c["key"] for c in result["checks"] if c["status"] == "fail"] == [
        "metrics.cache_bf16.share_pct"]
