"""Loader throughput: samples/s a training process gets from raw media (decode + resize) and from the cache.

    python -m wanexp.cli.bench_loader [the same overrides as train.py] [+bench.batches=N]

Builds the run's datamodule twice (data.use_cache=false, then true; the cache must exist for the second: run
python -m wanexp.cli.cache first) and iterates its training loader like one rank does, with data.num_workers
workers. Prints one line per path and a JSON line.
"""
from __future__ import annotations

import json
import time

from omegaconf import DictConfig, open_dict


def loader_rate(cfg: DictConfig, use_cache: bool, batches: int) -> dict:
    from wanexp.composition import build, build_datamodule, prepare_model_folder

    spec = build(cfg.model)
    prepare_model_folder(spec, cfg.boundary.name)
    with open_dict(cfg):
        cfg.data.use_cache = use_cache
    dm = build_datamodule(cfg, spec)
    dm.prepare()
    dm.setup()
    if use_cache and not dm.cached:
        return {"path": "cache", "skipped": "no complete cache for these settings; run python -m wanexp.cli.cache"}
    loader = dm.train_dataloader()
    n = samples = 0
    t0 = time.perf_counter()
    while n < batches:
        for batch in loader:
            if n == 1:  # the first batch includes starting the workers
                t0, samples = time.perf_counter(), 0
            samples += len(batch["prompt"])
            n += 1
            if n >= batches:
                break
    dt = time.perf_counter() - t0
    return {"path": "cache" if use_cache else "raw media", "samples_per_s": samples / dt, "batches": n - 1,
            "workers": dm.num_workers, "batch_size": dm.batch_size}


def bench_cli(cfg: DictConfig) -> None:
    batches = int(cfg.get("bench", {}).get("batches", 50))
    results = [loader_rate(cfg, False, batches), loader_rate(cfg, True, batches)]
    for r in results:
        if "skipped" in r:
            print(f"{r['path']:>9}: skipped ({r['skipped']})")
        else:
            print(f"{r['path']:>9}: {r['samples_per_s']:8.1f} samples/s ({r['batches']} batches of {r['batch_size']}, "
                  f"{r['workers']} workers)")
    print(json.dumps(results))


def main() -> None:
    from wanexp.composition import hydra_main

    hydra_main(bench_cli)


if __name__ == "__main__":
    main()
