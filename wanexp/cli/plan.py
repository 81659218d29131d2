"""A pre-flight plan of a run: its data and steps, time, memory, cache, disk and GPUs, before it starts.

    python -m wanexp.cli.plan [--no-calibrate] [--budget-gib 28] [--json PATH] [the same overrides as train.py]
    torchrun --nproc_per_node=8 -m wanexp.cli.plan parallel=fsdp model.path=...

Installed as ``wanexp-plan``. The counts come from the run's own code: the datamodule reads and probes the data as
the run does, and its loader (the bucket batch sampler) gives the batches per rank for the run's world size, so the
total optimizer steps are the number the run's progress bar shows. The calibration (on by default where a GPU is
present or the run itself is on the CPU) is a short real run of the same config (``wanexp.train.run``) on a few
samples of each bucket, in a temporary folder that is removed; its batch times, validation call, checkpoint and peak
memory give the run's ETA and peak. Prints a report and writes it as JSON (default ``outputs/plan/<run_name>.json``).
Exit 0 when the run fits, 2 with one line per problem when it does not; bad overrides are one line, as train.py's.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from omegaconf import DictConfig, OmegaConf, open_dict

from wanexp.errors import ConfigError, UserError, refuse

OPTIONS = """wanexp-plan options (before or among the overrides):
  --no-calibrate       counts, cache and disk only (CPU, seconds); the default calibrates where a GPU is present
  --calibrate          calibrate also when no GPU is present (a CPU run calibrates on the CPU anyway)
  --budget-gib N       also check the peak against N GiB (e.g. 28 on a 32 GB card)
  --steps-per-bucket N optimizer steps the calibration times per bucket (default 4)
  --world-size N       count the data for N processes instead of this launch's
  --json PATH          where the JSON goes (default outputs/plan/<run_name>.json)
"""
FIT_OPTIONS = ("model.blocks_to_swap=N (block swap: N blocks kept in host memory)",
               "model.memory_budget_gib=<GiB> with model.gradient_checkpointing=true (checkpointing budget)",
               "parallel=fsdp parallel.sp_size=2 (sequence parallel: each sample's tokens over 2 GPUs)",
               "parallel=fsdp (the base weights sharded over the GPUs)")
_t_start = time.perf_counter()


# ---- options -------------------------------------------------------------------------------------------------------
def split_options(argv: list[str]) -> tuple[dict, list[str]]:
    """The plan's own options and the rest (Hydra's overrides). A bad option value is a ConfigError."""
    opts = {"calibrate": None, "budget_gib": None, "json": None, "steps_per_bucket": 4, "world_size": None}
    rest, i = [], 0
    flags = {"--budget-gib": ("budget_gib", float), "--json": ("json", str),
             "--steps-per-bucket": ("steps_per_bucket", int), "--world-size": ("world_size", int)}
    while i < len(argv):
        a = argv[i]
        name, _, value = a.partition("=")
        if a in ("--no-calibrate", "--calibrate"):
            opts["calibrate"] = a == "--calibrate"
        elif name in flags:
            key, kind = flags[name]
            if not value:
                i += 1
                value = argv[i] if i < len(argv) else ""
            try:
                opts[key] = kind(value)
            except ValueError:
                raise ConfigError(f"{name}={value!r}: must be a {'number' if kind is float else kind.__name__}; "
                                  f"see wanexp-plan --help") from None
            if key in ("steps_per_bucket", "world_size", "budget_gib") and opts[key] <= 0:
                raise ConfigError(f"{name}={value}: must be above 0")
        else:
            rest.append(a)
        i += 1
    return opts, rest


def world_of(cfg: DictConfig, override: int | None, environ=os.environ) -> int:
    """Processes of the run: --world-size, else the launcher's WORLD_SIZE, else trainer.devices x num_nodes (auto:
    the visible GPUs, or 1 on the CPU)."""
    if override:
        return int(override)
    if "WORLD_SIZE" in environ and "TORCHELASTIC_RUN_ID" in environ:
        return int(environ["WORLD_SIZE"])
    t = cfg.trainer
    devices = OmegaConf.to_container(t.devices) if OmegaConf.is_list(t.devices) else t.devices
    if isinstance(devices, list):
        n = len(devices)
    elif isinstance(devices, str) and "," in devices:
        n = len(devices.strip(",").split(","))
    elif str(devices).strip() in ("auto", "-1"):
        import torch

        n = torch.cuda.device_count() if str(t.accelerator) != "cpu" and torch.cuda.is_available() else 1
    else:
        n = int(devices)
    return max(1, n) * int(t.num_nodes)


def launched_child(environ=os.environ) -> bool:
    """A rank that Lightning started for the calibration (it reruns the command): it only joins that run."""
    return ENV_KEY in environ and "TORCHELASTIC_RUN_ID" not in environ and int(environ.get("LOCAL_RANK", "0")) > 0


ENV_KEY = "WANEXP_PLAN_CALIBRATION"


def rank() -> int:
    from wanexp.composition import launch_rank

    return launch_rank()


# ---- 1. the data ---------------------------------------------------------------------------------------------------
def lightning_epochs(max_epochs, max_steps: int) -> int:
    """Lightning's epoch limit: max_epochs, or 1000 when neither limit is set, or none (-1) with max_steps."""
    if max_epochs is None:
        return 1000 if max_steps == -1 else -1
    return int(max_epochs)


def counting_trainer(world: int, sp: int, accumulate: int, max_steps: int, max_epochs) -> SimpleNamespace:
    """What the datamodule's loader and the progress bar read of the trainer, for ``world`` processes (rank 0)."""
    return SimpleNamespace(global_rank=0, world_size=world, global_step=0, accumulate_grad_batches=accumulate,
                           max_steps=max_steps, max_epochs=lightning_epochs(max_epochs, max_steps),
                           num_training_batches=0, sp_size=sp)


def bucket_key(shape) -> str:
    return "x".join(str(int(v)) for v in shape)


def data_plan(cfg: DictConfig, dm, world: int) -> dict:
    """Rows, rejects, samples and batches per bucket, steps per epoch and the run's optimizer steps for ``world``
    processes: the datamodule's own loader for rank 0 of that world, and the progress bar's total."""
    from wanexp.callbacks.progress import optimizer_steps_per_epoch, total_optimizer_steps
    from wanexp.data.datamodule import samples_per_epoch_line

    sp = int(cfg.parallel.sp_size)
    accumulate = int(cfg.trainer.accumulate_grad_batches)
    max_steps = int(cfg.trainer.max_steps if cfg.trainer.max_steps is not None else -1)
    trainer = counting_trainer(world, sp, accumulate, max_steps, cfg.trainer.max_epochs)
    dm.trainer = trainer
    try:
        loader = dm.train_dataloader()  # one line, as in the run, when the data gives no full batch
    finally:
        dm.trainer = None
    sampler = getattr(loader.batch_sampler, "batches", loader.batch_sampler)
    trainer.num_training_batches = len(loader)
    repeat = int(cfg.data.dataset_repeat)
    buckets: dict = {}
    first = first_samples(dm)
    for pos in first:
        b = buckets.setdefault(bucket_key(dm.dataset.shapes[pos]), {"clips": 0, "images": 0})
        b["images" if dm.dataset.samples[pos].kind == "image" else "clips"] += 1
    unique = len(first)
    for key, (n, fill, batches) in sampler.bucket_counts().items():  # a bucket's last step filled from itself
        b = buckets[bucket_key(key)]
        b.update(batch_per_rank=sampler.batch_sizes.get(key, sampler.batch_size), samples_per_epoch=n + fill,
                 batches_per_epoch=batches)
    total = total_optimizer_steps(trainer)
    dm.epoch_line(world // sp)  # each dataset's samples per epoch on these ranks, into its report, as the run's
    r = dm.report
    return {"rows": r.get("rows"), "rejected": r.get("rejected"), "warnings": r.get("warnings"),
            "heldout": r.get("heldout", 0), "samples": unique, "dataset_repeat": repeat,
            "datasets": r["datasets"], "per_epoch": samples_per_epoch_line(r["datasets"], r["buckets"]),
            "world_size": world, "data_parallel_size": world // sp, "sp_size": sp,
            "batch_size": int(cfg.data.batch_size),
            "token_budget": cfg.data.token_budget, "accumulate_grad_batches": accumulate,
            "effective_batch": int(cfg.data.batch_size) * (world // sp) * accumulate,
            "buckets": dict(sorted(buckets.items())), "batches_per_epoch": len(loader),
            "steps_per_epoch": optimizer_steps_per_epoch(trainer), "max_steps": max_steps,
            "max_epochs": trainer.max_epochs, "total_steps": total,
            "epochs": total / optimizer_steps_per_epoch(trainer) if total else None}


def first_samples(dm) -> list[int]:
    """The position in the training dataset of each item's first sample: a dataset's repeat and weight copy its
    items (the datamodule's ``train_items``), and the plan counts and calibrates on each item once."""
    seen: set = set()
    first = []
    for pos, item in enumerate(getattr(dm, "train_items", None) or range(len(dm.dataset))):
        if item not in seen:
            seen.add(item)
            first.append(pos)
    return first


def batches_run(data: dict, steps: int | None = None) -> int:
    """Batches each rank trains in the run's first ``steps`` optimizer steps (default: all): whole epochs, then the
    steps of the last one (x accumulation)."""
    per_epoch, steps_epoch = data["batches_per_epoch"], data["steps_per_epoch"]
    full, rest = divmod(data["total_steps"] if steps is None else steps, steps_epoch)
    return full * per_epoch + min(rest * data["accumulate_grad_batches"], per_epoch)


# ---- a resumed run -------------------------------------------------------------------------------------------------
def resume_point(cfg: DictConfig) -> dict | None:
    """Where a ``resume=`` run continues: the checkpoint the run takes (``resume_path``, as wanexp.train.run finds it)
    and the optimizer steps it had done, read as the run reads it. None: a fresh start (no resume, or resume=auto
    before the first checkpoint). The data position follows from the steps (wanexp/data/datamodule.py). A DeepSpeed
    checkpoint's step is read from its model states file, as the run reads it."""
    from wanexp.composition import read_resume_checkpoint
    from wanexp.runfolder import checkpoint_kind, resume_path

    ckpt = resume_path(cfg.resume, Path(cfg.paths.output_dir).resolve())
    if ckpt is None:
        return None
    kind = checkpoint_kind(ckpt, cfg.parallel.name)
    saved = read_resume_checkpoint(ckpt, cfg.parallel.name)
    step = saved.get("global_step")
    return {"checkpoint": str(Path(ckpt).resolve()), "kind": kind, "steps_done": None if step is None else int(step),
            "epoch": saved.get("epoch")}


def resumed_part(data: dict, point: dict) -> dict:
    """The part of the run a resume trains: from the checkpoint's optimizer steps to the run's total, and the batches
    of it (an epoch's order is fixed by (seed, epoch); the resumed loader skips the batches the steps consumed)."""
    done = point["steps_done"]
    epoch, in_epoch = divmod(done, data["steps_per_epoch"])
    total = data["total_steps"]
    return {**point, "data_epoch": epoch,
            "batches_done_in_epoch": min(in_epoch * data["accumulate_grad_batches"], data["batches_per_epoch"]),
            "remaining_steps": max(0, total - done) if total else None,
            "remaining_batches": max(0, batches_run(data) - batches_run(data, done)) if total else None}


# ---- 3. the cache --------------------------------------------------------------------------------------------------
def cache_plan(cfg: DictConfig, dm) -> dict:
    """The cache entries this run reads (the same keys as the run and the cache command): present or missing."""
    from wanexp.cli.cache import extra_prompts
    from wanexp.data.cache import CacheIndex

    if not dm.keys:
        why = "data.window=random (a new window every epoch)" if cfg.data.window == "random" else \
            "no data.cache_dir"
        return {"dir": str(dm.cache_dir) if dm.cache_dir else None, "used": False, "note": f"no cache: {why}"}
    index = CacheIndex(dm.cache_dir) if dm.cache_dir.is_dir() else None
    latents = {k for k, _ in dm.keys}
    texts = {t for _, t in dm.keys} | {dm.text_cache_key(p) for p in extra_prompts(cfg)}
    has = (lambda k: index is not None and k in index)
    missing_l = sorted(k for k in latents if not has(k))
    missing_t = sorted(k for k in texts if not has(k))
    present_bytes = 0
    if index is not None:
        shards = {index.entries[k]["shard"] for k in latents | texts if k in index}
        present_bytes = sum((dm.cache_dir / s).stat().st_size for s in shards if (dm.cache_dir / s).is_file())
    return {"dir": str(dm.cache_dir), "used": bool(dm.cached and not missing_t), "latents": len(latents),
            "texts": len(texts), "missing_latents": len(missing_l), "missing_texts": len(missing_t),
            "present_bytes": present_bytes}


# ---- 4. disk -------------------------------------------------------------------------------------------------------
def disk_plan(cfg: DictConfig, trained: tuple[int, int, int], total_steps: int, cache: dict,
              resuming: bool = False) -> dict:
    """What the run keeps at its retention (wanexp.disk.estimate at the planned steps) and the cache still to write,
    each against the free space of its filesystem. A resumed run's checkpoints and exports already in its folder are
    part of that retention: its filesystem needs only the rest."""
    from wanexp.disk import estimate, free_bytes, mount_point, written_bytes

    out = Path(cfg.paths.output_dir).resolve()
    callbacks = OmegaConf.to_container(cfg.callbacks, resolve=True)
    need = estimate(trained, callbacks, total_steps or -1)
    present = written_bytes(out) if resuming else 0
    run_bytes = max(0, need.total - written_bytes(out)) if need.known else None
    parts = [{"what": "checkpoints", "path": str(out / "checkpoints"), "count": need.checkpoints,
              "each_bytes": need.checkpoint_bytes, "bytes": need.checkpoint_bytes * (need.checkpoints or 0)},
             {"what": "LoRA exports", "path": str(out / "lora"), "count": need.exports,
              "each_bytes": need.export_bytes, "bytes": need.export_bytes * (need.exports or 0)}]
    if cache.get("estimated_bytes"):
        parts.append({"what": "cache still to write", "path": cache["dir"], "count": None,
                      "each_bytes": None, "bytes": cache["estimated_bytes"]})
    filesystems: dict = {}
    for p in parts:
        mount = str(mount_point(p["path"]))
        fs = filesystems.setdefault(mount, {"need_bytes": 0, "free_bytes": free_bytes(p["path"]), "parts": [],
                                            "retention_bytes": 0, "present_bytes": 0})
        fs["retention_bytes"] += p["bytes"]
        fs["parts"].append(p["what"])
        p["filesystem"] = mount
    if present:
        filesystems[parts[0]["filesystem"]]["present_bytes"] = present  # the run folder's checkpoints/ and lora/
    for fs in filesystems.values():
        fs["need_bytes"] = max(0, fs["retention_bytes"] - fs["present_bytes"])
    return {"parts": parts, "filesystems": filesystems, "run_bytes": run_bytes, "present_bytes": present,
            "retention_known": need.known}


# ---- 5. the GPUs ---------------------------------------------------------------------------------------------------
def comm_plan(cfg: DictConfig, world: int, grad_bytes: int) -> dict | None:
    """All-reduce bandwidth among this node's GPUs (under torchrun: the launched ranks; one process with several
    GPUs visible: a process per GPU for the run's world), peer-to-peer, for a run of several processes."""
    import torch

    from wanexp.cli import plan_comm

    if world <= 1 or not torch.cuda.is_available():
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", min(world, torch.cuda.device_count())))
    p2p = plan_comm.peer_access(min(local, torch.cuda.device_count()))
    sizes = sorted({*plan_comm.SIZES, max(4, grad_bytes)})
    if "TORCHELASTIC_RUN_ID" in os.environ:
        import datetime

        import torch.distributed as dist

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if not dist.is_initialized():  # the calibration's trainer then joins this group
            dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=int(cfg.parallel.strategy.timeout_s)
                                                                       if "timeout_s" in cfg.parallel.strategy
                                                                       else 1800))
        rows, measured_on = plan_comm.measure(sizes), dist.get_world_size()
    elif torch.cuda.device_count() > 1:
        measured_on = min(world, torch.cuda.device_count())
        rows = plan_comm.measure_spawned(measured_on, "nccl", sizes)
    else:
        return {"note": "one GPU visible: the all-reduce was not measured", "p2p": p2p}
    grad_row = min(rows, key=lambda r: abs(r["bytes"] - grad_bytes))
    return {"measured_on": measured_on, "sizes": rows, "p2p": p2p, "grad_bytes": grad_bytes,
            "grad_busbw": grad_row["busbw"],
            "grad_allreduce_s": plan_comm.allreduce_seconds(grad_bytes, grad_row["busbw"], world)}


# ---- 2. calibration ------------------------------------------------------------------------------------------------
def calibration_overrides(cfg: DictConfig, dm, data: dict, steps_per_bucket: int, tmp: Path) -> dict:
    """The calibration run's settings (dotted key -> value) and the subset file it reads, written into ``tmp``:
    whole batches of each bucket, ``steps_per_bucket`` optimizer steps of each, validation and the checkpoint at its
    last step. ``None`` values switch a node off."""
    from wanexp.cli.plan_calibrate import choose_subset, steps_for_batches
    from wanexp.data.datamodule import BucketBatchSampler

    accumulate, world = data["accumulate_grad_batches"], data["data_parallel_size"]
    ds = dm.dataset
    first = first_samples(dm)
    shapes = [tuple(ds.shapes[pos]) for pos in first]
    sizes = dm.bucket_batch_sizes() or {}
    per_batch = {s: sizes.get(s, dm.batch_size) * world for s in set(shapes)}
    chosen, _, copies = choose_subset(shapes, [ds.samples[pos] for pos in first], per_batch,
                                      steps_per_bucket * accumulate)
    chosen = [first[i] for i in chosen]  # positions in the dataset
    files = [f for f in training_files(dm, chosen) for _ in range(copies.get(f[1], 1))]
    held = getattr(dm, "val_dataset", None)
    v = cfg.callbacks.get("validation") if OmegaConf.is_dict(cfg.callbacks) else None
    validating = bool(OmegaConf.is_dict(v) and v.get("every_n_steps"))
    if held is not None and validating:  # val/loss reads these; they stay held out (the split hashes the path)
        n = int(v.get("loss_samples") or 0)
        files += list(dict.fromkeys(zip(dm.val_part[:n], held.samples[:n])))
    sub_shapes = [tuple(ds.shapes[i]) for i in chosen for _ in range(copies.get(ds.samples[i], 1))]
    batches = len(BucketBatchSampler(sub_shapes, dm.batch_size, 0, world, batch_sizes=sizes or None))
    steps = steps_for_batches(batches, accumulate)
    o = {**subset_data(cfg, dm, files, tmp, "subset"), "data.rejects": str(tmp / "rejects.jsonl"),
         "paths.output_dir": str(tmp / "run"), "trainer.max_steps": steps, "trainer.max_epochs": None,
         "resume": None, "overwrite": True, "logger": {}, "callbacks.progress": None}
    cb = cfg.callbacks
    if OmegaConf.is_dict(cb.get("checkpoint")):
        o["callbacks.checkpoint.every_n_train_steps"] = steps
        o["callbacks.checkpoint.dirpath"] = str(tmp / "run" / "checkpoints")
    if validating:
        o.update(validation_overrides(v, steps))
    for name in ("profile",):
        if OmegaConf.is_dict(cb.get(name)):
            o[f"callbacks.{name}.steps"] = 0
    for name in ("status", "lora_export", "validation", "profile"):
        if OmegaConf.is_dict(cb.get(name)) and "output_dir" in cb[name]:
            o[f"callbacks.{name}.output_dir"] = str(tmp / "run")
    return {"overrides": o, "steps": steps, "record": str(tmp / "timer.json"), "validating": validating,
            "files": len(set(files))}


def training_files(dm, positions: list[int]) -> list[tuple[int, object]]:
    """(dataset index, sample) of the training samples at ``positions``, each file once, in that order."""
    parts = dm.dataset_part or [0] * len(dm.dataset)  # (prompts alone: one dataset)
    return list(dict.fromkeys((parts[i], dm.dataset.samples[i]) for i in positions))


def subset_data(cfg: DictConfig, dm, files: list[tuple[int, object]], tmp: Path, stem: str) -> dict:
    """The data group's settings (dotted key -> value) that read only ``files`` ((dataset index, sample) pairs of
    the run's datamodule) with each dataset's own settings: one JSON-lines file per dataset in ``tmp``
    (``<stem>-<dataset>.jsonl``) of the samples as the run's datamodule read them (absolute paths, prompts with
    their dataset's caption prefix), each file once (repeat and weight 1). Each dataset keeps the folder the run
    takes its paths relative to (``Part.base``): the held-out split hashes the path from there."""
    entries: dict = {}
    for p, part in enumerate(dm.parts):
        samples = [s for q, s in files if q == p]
        if not samples:
            continue
        path = tmp / f"{stem}-{p}.jsonl"
        path.write_text("".join(json.dumps({"file_path": s.path, "text": s.prompt, "type": s.kind}) + "\n"
                                for s in samples))
        entries[p] = {"metadata": str(path), "root": str(part.base.resolve()), "repeat": 1, "weight": 1,
                      "caption_prefix": ""}
    o = {"data.max_samples": None, "data.dataset_repeat": 1, "data.generate": None}
    if not dm.several:  # the single-dataset keys
        return {**o, "data.metadata": entries[0]["metadata"], "data.root": entries[0]["root"]}
    given = OmegaConf.to_container(cfg.data.datasets, resolve=True)
    given = list(given.values()) if isinstance(given, dict) else given  # in the order of dm.parts
    return {**o, "data.datasets": {dm.parts[p].name: {**given[p], **e} for p, e in entries.items()}}


def validation_overrides(validation: DictConfig, steps: int) -> dict:
    """The calibration's validation calls, in the run's order: at the start (the base model, before any training
    step) when the run validates at its start, then mid-way and at the last step; else mid-way and at the last step.
    The first call loads what later calls reuse (the VAE, the prompts' embeddings). With compiled blocks each kind of
    call compiles once, in the order the run meets them: sampling first, then training, then sampling again (a
    sampling call after training steps compiles once more), so the first call after training is timed on its own and
    the last call is the steady one."""
    at_start = bool(validation.get("at_start", True))
    return {"callbacks.validation.every_n_steps": max(1, steps // 2), "callbacks.validation.at_start": at_start}


def apply_overrides(cfg: DictConfig, calib: dict) -> DictConfig:
    """A copy of the run's config with the calibration's settings, PlanTimer as the first callback."""
    c = cfg.copy()
    with open_dict(c):
        for key, value in calib["overrides"].items():
            OmegaConf.update(c, key, value, merge=False, force_add=True)
        timer = {"_target_": "wanexp.cli.plan_calibrate.PlanTimer", "record": calib["record"]}
        rest = OmegaConf.to_container(c.callbacks, resolve=False)
        c.callbacks = {"plan_timer": timer, **rest}
    return c


def run_calibration(cfg: DictConfig, calib: dict) -> dict:
    """The calibration run itself (every rank): ``wanexp.train.run`` on the calibration config. Out of memory in a
    bucket is a result (which bucket), not an error."""
    import torch

    from wanexp.train import run  # the user's run itself: its one use of the training entry

    c = apply_overrides(cfg, calib)
    os.environ[ENV_KEY] = json.dumps(calib)  # the ranks Lightning starts rerun the command: they read it here
    t0 = time.perf_counter()
    oom = None
    try:
        run(c)
    except torch.OutOfMemoryError as e:
        oom = (str(e).strip().splitlines() or [""])[0][:300]
    done = time.perf_counter()
    record = Path(calib["record"])
    got = json.loads(record.read_text()) if record.is_file() else {}
    got.update(wall_s=done - t0, oom=oom)
    if got.get("train_end"):  # the final LoRA export and the run's end, after training
        got["teardown_s"] = done - got["train_end"]
    return got


def calibration_child(cfg: DictConfig) -> None:
    """A rank Lightning started: join the calibration run with rank 0's settings, nothing else."""
    run_calibration(cfg, json.loads(os.environ[ENV_KEY]))


# ---- the ETA and the fit -------------------------------------------------------------------------------------------
def eta(data: dict, calib: dict, cfg: DictConfig, setup: dict, done: int = 0) -> dict:
    """Seconds of the run from optimizer step ``done`` (a resume's checkpoint; 0: a fresh run) to its end: start-up
    (imports, data, weights), training (each bucket's batches at its steady time, plus each bucket's one-off seconds
    once: compilation), validation calls at their cadence and checkpoints (with their LoRA exports) at theirs after
    ``done``, and the end (final export)."""
    from wanexp.cli.plan_calibrate import bucket_times
    from wanexp.disk import save_steps

    times = bucket_times(calib.get("rows", []))
    total = data["total_steps"]
    n_batches = max(0, batches_run(data) - batches_run(data, done))
    weights = {k: b.get("batches_per_epoch", 0) for k, b in data["buckets"].items()}
    timed = {k: w for k, w in weights.items() if k in times and w}
    if not timed:
        return {"buckets": times, "total_s": None}
    mean = sum(times[k]["steady_s"] * w for k, w in timed.items()) / sum(timed.values())
    warm = sum(times[k]["once_s"] for k in timed) if n_batches else 0.0  # compilation, once per bucket and kind
    train_s = n_batches * mean + warm
    v = cfg.callbacks.get("validation") if OmegaConf.is_dict(cfg.callbacks) else None
    every = int(v.get("every_n_steps") or 0) if OmegaConf.is_dict(v) else 0
    # at_start on a fresh run only; then every N steps after ``done`` and one at the last step
    calls = (int(bool(v.get("at_start", True)) and done == 0) + math.ceil(total / every) - done // every) \
        if every and total > done else 0
    ck = cfg.callbacks.get("checkpoint") if OmegaConf.is_dict(cfg.callbacks) else None
    saves = len([s for s in save_steps(total, ck.get("every_n_train_steps") if OmegaConf.is_dict(ck) else None) or []
                 if s > done]) if total else 0
    val_s = calib.get("validation_s") or 0.0
    first_s = calib.get("validation_first_s") or val_s
    second_s = calib.get("validation_second_s") or val_s  # the first call after training steps: compiles once more
    ckpt_s = max(0.0, (calib.get("end_s") or 0.0) - val_s)
    parts = {"imports_s": setup["imports_s"], "data_s": setup["data_s"], "weights_s": calib.get("setup_s") or 0.0,
             "train_s": train_s, "validation_s": first_s + min(1, calls - 1) * second_s + max(0, calls - 2) * val_s
             if calls else 0.0,
             "checkpoint_s": saves * ckpt_s,
             "end_s": calib.get("teardown_s") or 0.0}
    return {"buckets": times, "mean_batch_s": mean, "from_step": done, "batches": n_batches, "validation_calls": calls,
            "validation_call_s": val_s, "validation_first_s": first_s, "validation_second_s": second_s,
            "checkpoints": saves, "checkpoint_s": ckpt_s,
            "parts": parts,
            "total_s": sum(parts.values())}


def fit_problems(calib: dict, eta_: dict, card_gib: float | None, budget: float | None) -> list[str]:
    """One line per bucket (or validation) whose peak does not fit the card or the budget, with the options."""
    problems = []
    options = "; ".join(FIT_OPTIONS)
    failed = calib.get("failed") or {}
    if calib.get("oom") or failed.get("error") == "OutOfMemoryError":
        shape = failed.get("shape")
        where = f"bucket {bucket_key(shape)}" if shape else "the calibration"
        problems.append(f"{where} runs out of GPU memory on this card; try {options}")
    limits = [(n, lim) for n, lim in (("the card's", card_gib), ("--budget-gib", budget)) if lim]
    for key, b in eta_.get("buckets", {}).items():
        for name, lim in limits:
            if b.get("peak_gib") and b["peak_gib"] > lim:
                problems.append(f"bucket {key} peaks at {b['peak_gib']:.1f} GiB, above {name} {lim:.1f} GiB; "
                                f"try {options}")
    end_peak = calib.get("end_peak_gib")
    for name, lim in limits:
        if end_peak and end_peak > lim:
            problems.append(f"validation and the checkpoint peak at {end_peak:.1f} GiB, above {name} {lim:.1f} "
                            "GiB; try callbacks.validation.shapes with a smaller shape or fewer "
                            "callbacks.validation.prompts")
    return problems


# ---- the report ----------------------------------------------------------------------------------------------------
def _gib(n) -> str:
    from wanexp.disk import human

    return "-" if n is None else human(n)


def _hms(s) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def report(plan: dict) -> str:
    d, lines = plan["data"], [f"wanexp plan: {plan['run_name']}  ({plan['device']})", ""]
    lines += [f"data      {d['rows']} rows, {d['rejected']} rejected, {d['warnings']} warnings, {d['heldout']} held "
              f"out; {d['samples']} samples; per epoch: {d['per_epoch']}",
              f"          {d['world_size']} process(es) ({d['data_parallel_size']} data-parallel), batch "
              f"{d['batch_size']} per device x {d['accumulate_grad_batches']} accumulation = effective "
              f"{d['effective_batch']}",
              f"          {d['batches_per_epoch']} batches per rank per epoch = {d['steps_per_epoch']} optimizer "
              f"steps per epoch; total {d['total_steps']} steps"
              + (f" ({d['epochs']:.2f} epochs)" if d.get("epochs") else "")]
    rs = d.get("resume")
    if rs and rs.get("steps_done") is None:
        lines.append(f"resume    from {rs['checkpoint']}: its step is not read: the whole run is counted")
    elif rs:
        lines.append(f"resume    from {rs['checkpoint']} at step {rs['steps_done']} (epoch {rs['data_epoch']}, "
                     f"{rs['batches_done_in_epoch']} batches of it done): {rs['remaining_steps']} steps "
                     f"({rs['remaining_batches']} batches) to go")
    lines.append(f"          {len(d['buckets'])} buckets:")
    for key, b in d["buckets"].items():
        lines.append(f"  bucket {key:<14} {b['clips']} clips, {b['images']} images, {b.get('samples_per_epoch', 0)} "
                     f"samples per epoch, batch {b.get('batch_per_rank')} per rank, {b.get('batches_per_epoch', 0)} "
                     "batches per epoch")
    c = plan["cache"]
    if c.get("note"):
        lines.append(f"cache     {c['note']}")
    else:
        lines.append(f"cache     {c['dir']}: {c['latents'] - c['missing_latents']} of {c['latents']} latents, "
                     f"{c['texts'] - c['missing_texts']} of {c['texts']} texts present ({_gib(c['present_bytes'])})")
        if c.get("per_entry_s") is not None:
            lines.append(f"          missing: ~{c['per_entry_s']:.2f} s per sample on this hardware, "
                         f"~{_hms(c['estimated_s'])} and ~{_gib(c['estimated_bytes'])} to write")
    cal = plan.get("calibration")
    if cal is None:
        lines.append("time      not calibrated (--no-calibrate, or no GPU): no ETA or peak memory")
    else:
        e = plan["eta"]
        for key in d["buckets"]:
            b = e.get("buckets", {}).get(key)
            if b is None:
                lines.append(f"  bucket {key:<14} not timed: {untimed(cal)}")
                continue
            lines.append(f"  bucket {key:<14} {b['steady_s']:.3f} s per batch (once {b.get('once_s', 0.0):.1f} s: "
                         f"compilation), peak "
                         + ("-" if b["peak_gib"] is None else f"{b['peak_gib']:.2f} GiB"))
        if e.get("total_s") is not None:
            p = e["parts"]
            startup = p["imports_s"] + p["data_s"] + p["weights_s"]
            rest = f" of the steps after {e['from_step']}" if e.get("from_step") else ""
            lines.append(f"time      ETA{rest} {_hms(e['total_s'])}: start-up {_hms(startup)}, training "
                         f"{_hms(p['train_s'])}, validation {e['validation_calls']} calls "
                         f"(first {e['validation_first_s']:.1f} s, next {e['validation_second_s']:.1f} s, "
                         f"then {e['validation_call_s']:.1f} s each), "
                         f"checkpoints {e['checkpoints']} x {e['checkpoint_s']:.1f} s")
    m = plan["memory"]
    lines += memory_estimate_lines(m)
    if m.get("peak_gib") is not None:
        lines.append(f"memory    peak {m['peak_gib']:.2f} GiB (validation and checkpoint "
                     f"{m.get('end_peak_gib') or 0:.2f} GiB); card {m.get('card_gib') or '-'} GiB"
                     + (f", budget {m['budget_gib']} GiB" if m.get("budget_gib") else ""))
    elif m.get("not_checked"):
        lines.append(f"memory    not checked: {m['not_checked']}")
    for mount, fs in plan["disk"]["filesystems"].items():
        held = f"; {_gib(fs['retention_bytes'])} at retention, {_gib(fs['present_bytes'])} of it already there" \
            if fs.get("present_bytes") else ""
        lines.append(f"disk      {mount}: needs {_gib(fs['need_bytes'])} ({', '.join(fs['parts'])}{held}), "
                     f"{_gib(fs['free_bytes'])} free")
    comm = plan.get("comm")
    if comm and comm.get("sizes"):
        bw = ", ".join(f"{r['bytes'] / 2**20:.0f} MiB {r['busbw'] / 1e9:.1f} GB/s" for r in comm["sizes"])
        lines.append(f"gpus      all-reduce bus bandwidth on {comm['measured_on']} GPUs: {bw}; peer-to-peer "
                     f"{'used' if comm['p2p']['used'] else 'not used'}")
        if comm.get("share") is not None:
            lines.append(f"          gradient all-reduce {_gib(comm['grad_bytes'])} "
                         f"~{comm['grad_allreduce_s'] * 1e3:.1f}"
                         f" ms = {100 * comm['share']:.1f} % of an optimizer step (upper bound: DDP overlaps it)")
        for tip in comm.get("advice", []):
            lines.append(f"          try {tip}")
    elif comm:
        lines.append(f"gpus      {comm.get('note')}")
    lines += ["", verdict(plan)] + [f"  {p}" for p in plan["problems"]]
    return "\n".join(lines)


def memory_estimate_lines(memory: dict) -> list[str]:
    """The pre-flight's memory estimate (wanexp.memory_plan, from the family's formula): the least GiB per GPU at the
    run's block swap, or the one line saying the family gives none."""
    e = memory.get("estimate")
    if e:
        swapped = f", {e['blocks_to_swap']} of {e['blocks']} blocks swapped" if e["blocks_to_swap"] else ""
        return [f"memory    estimate {e['need_gib']:.1f} GiB per GPU at least ({e['weights_gib']:.1f} of weights"
                f"{swapped}, {e['activations_gib']:.1f} of activations and adapter state at {e['tokens']} tokens)"]
    return [f"memory    no estimate: {memory['no_estimate']}"] if memory.get("no_estimate") else []


def untimed(calibration: dict) -> str:
    """Why the calibration timed no batch of a bucket: it stopped before (out of memory, an error), or it ran none."""
    failed = calibration.get("failed") or {}
    if calibration.get("oom") or failed:
        where = f" in bucket {bucket_key(failed['shape'])}" if failed.get("shape") else ""
        return f"the calibration stopped{where} ({failed.get('error') or 'OutOfMemoryError'})"
    return "the calibration trained no batch of it"


def verdict(plan: dict) -> str:
    """The report's last line: whether the run fits, and what was not checked."""
    if plan["problems"]:
        return "does not fit:"
    m = plan["memory"]
    if not m.get("not_checked"):
        return "fits"
    what = f"the memory budget (--budget-gib {m['budget_gib']:g})" if m.get("budget_gib") else "GPU memory"
    return f"fits the disk; {what} was not checked: {m['not_checked']}"


def memory_not_checked(calibrate: bool | None, calibrated: bool, on_cpu: bool, peak_gib: float | None) -> str | None:
    """Why the plan has no peak memory (so neither the card nor --budget-gib was checked); None when it has one.
    ``calibrate``: the --calibrate / --no-calibrate option (None: neither)."""
    if peak_gib is not None:
        return None
    if not calibrated:
        return "--no-calibrate (the peak comes from the calibration)" if calibrate is False else \
            "no GPU here (the peak is measured on a GPU, by the calibration)"
    if on_cpu:
        return "the calibration ran on the CPU (the peak is GPU memory, measured on a GPU)"
    return "the calibration measured no peak (it trained no batch)"


# ---- the command ---------------------------------------------------------------------------------------------------
def plan_dir(cfg: DictConfig) -> Path:
    return Path(cfg.paths.root_dir) / "outputs" / "plan"


def make_plan(cfg: DictConfig, opts: dict) -> dict:
    """Every part of the plan (every rank of a torchrun takes part in the bandwidth and the calibration)."""
    from wanexp.composition import preflight

    pre = preflight(cfg, verbose=False)  # the run's own checks, before anything is measured
    spec = pre.spec
    import torch

    world = world_of(cfg, opts["world_size"])
    on_cpu = str(cfg.trainer.accelerator) == "cpu" or not torch.cuda.is_available()
    calibrate = opts["calibrate"] if opts["calibrate"] is not None else \
        (torch.cuda.is_available() or str(cfg.trainer.accelerator) == "cpu")
    if calibrate and opts["world_size"] and opts["world_size"] != world_of(cfg, None):
        raise ConfigError(f"--world-size={opts['world_size']} differs from this launch's processes: calibration "
                          "times this launch; add --no-calibrate to count for another world size")
    imports_s = _process_age()
    point = resume_point(cfg)  # a resume the run would refuse (no checkpoint, not a checkpoint) is refused here
    tmp = Path(tempfile.mkdtemp(prefix="wanexp-plan-"))
    try:
        with open_dict(cfg):
            cfg.data.rejects = str(tmp / "rejects.jsonl")
        t0 = time.perf_counter()
        dm = datamodule(cfg, spec)
        dm.prepare()
        dm.setup("fit")
        data_s = time.perf_counter() - t0
        data = data_plan(cfg, dm, world)
        if point is not None:
            data["resume"] = resumed_part(data, point) if point["steps_done"] is not None else point
        done = (point or {}).get("steps_done") or 0
        cache = cache_plan(cfg, dm)
        if calibrate and cache.get("missing_latents"):
            cache.update(measure_cache(cfg, dm, tmp / "cache"))
            scale_cache_estimate(cache)
        grad_bytes = pre.trained[0] * 4  # fp32 LoRA gradients (adapters.kinds.add_lora)
        disk = disk_plan(cfg, pre.trained, data["total_steps"], cache, resuming=point is not None)
        comm = comm_plan(cfg, world, grad_bytes) if calibrate else None
        calib, eta_ = None, {}
        if calibrate:
            settings = calibration_overrides(cfg, dm, data, opts["steps_per_bucket"], tmp)
            calib = run_calibration(cfg, settings)
            calib["steps"], calib["files"] = settings["steps"], settings["files"]
            eta_ = eta(data, calib, cfg, {"imports_s": imports_s, "data_s": data_s}, done)
        if rank() != 0:
            return {}
        card = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30 \
            if torch.cuda.is_available() and not on_cpu else None
        peaks = [b["peak_gib"] for b in eta_.get("buckets", {}).values() if b.get("peak_gib") is not None]
        end_peak = (calib or {}).get("end_peak_gib")
        memory = {"peak_gib": max(peaks + [end_peak or 0.0]) if peaks else None, "end_peak_gib": end_peak,
                  "peak_all_ranks_gib": (calib or {}).get("peak_gib_all_ranks"), "card_gib": card and round(card, 1),
                  "budget_gib": opts["budget_gib"], "estimate": pre.memory,
                  "no_estimate": None if pre.memory else f"model={cfg.model.name}'s family gives no memory formula"}
        memory["not_checked"] = memory_not_checked(opts["calibrate"], calib is not None, on_cpu, memory["peak_gib"])
        if comm and comm.get("sizes") and eta_.get("mean_batch_s"):
            from wanexp.cli import plan_comm

            step_s = eta_["mean_batch_s"] * data["accumulate_grad_batches"]
            comm["share"] = plan_comm.allreduce_share(grad_bytes, comm["grad_busbw"], world, step_s,
                                                      measured_with_it=(calib or {}).get("world_size", 1) > 1)
            comm["advice"] = plan_comm.advice(comm["share"], comm.get("p2p"))
        problems = fit_problems(calib or {}, eta_, card, opts["budget_gib"]) if calib else []
        for mount, fs in disk["filesystems"].items():
            if fs["need_bytes"] > fs["free_bytes"]:
                problems.append(f"disk {mount}: needs {_gib(fs['need_bytes'])} ({', '.join(fs['parts'])}), "
                                f"{_gib(fs['free_bytes'])} free; free space or lower callbacks.lora_export.keep_last "
                                "/ callbacks.checkpoint.save_top_k")
        rejects = tmp / "rejects.jsonl"
        return {"run_name": cfg.run_name, "device": _device(on_cpu), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "overrides": list(cfg.get("overrides") or []), "data": data, "cache": cache, "disk": disk,
                "comm": comm, "calibration": _calibration_summary(calib), "eta": eta_, "memory": memory,
                "problems": problems,
                "rejects": [json.loads(x) for x in rejects.read_text().splitlines()] if rejects.is_file() else []}
    finally:
        if rank() == 0 or "TORCHELASTIC_RUN_ID" in os.environ:
            shutil.rmtree(tmp, ignore_errors=True)


def datamodule(cfg: DictConfig, spec):
    """The run's datamodule, built as the run builds it (with the run context)."""
    from wanexp.composition import build_datamodule
    from wanexp.context import RunContext

    return build_datamodule(cfg, spec, RunContext.from_config(cfg))


def measure_cache(cfg: DictConfig, dm, folder: Path, samples: int = 2) -> dict:
    """The cache command on a few of the run's samples into a scratch folder: seconds and bytes per sample, scaled
    to the missing entries."""
    from wanexp.cli.cache import build_cache

    files = training_files(dm, range(len(dm.dataset)))[:samples]
    c = cfg.copy()
    with open_dict(c):
        for key, value in subset_data(cfg, dm, files, folder.parent, "cache_subset").items():
            OmegaConf.update(c, key, value, merge=False)
        c.data.cache_dir = str(folder)
        c.callbacks.validation = None  # its prompts would be timed as samples
    s = build_cache(c)
    n = max(1, s.get("latents") or 0)
    per_s = (s.get("seconds") or 0.0) / n
    per_latent = (s.get("latent_bytes") or 0) / n
    per_text = ((s.get("bytes") or 0) - (s.get("latent_bytes") or 0)) / max(1, s.get("texts") or 0)
    return {"per_entry_s": per_s, "per_latent_bytes": per_latent, "per_text_bytes": per_text,
            "measured_on": len(files)}


def scale_cache_estimate(cache: dict) -> None:
    """The missing entries' time and size at the measured per-sample numbers."""
    cache["estimated_s"] = cache["per_entry_s"] * cache["missing_latents"]
    cache["estimated_bytes"] = int(cache["per_latent_bytes"] * cache["missing_latents"] +
                                   cache["per_text_bytes"] * cache["missing_texts"])


def _calibration_summary(calib: dict | None) -> dict | None:
    if calib is None:
        return None
    return {k: v for k, v in calib.items() if k != "rows"} | {"batches_timed": len(calib.get("rows", []))}


def _device(on_cpu: bool) -> str:
    import torch

    if on_cpu:
        return "CPU"
    n = torch.cuda.device_count()
    return f"{n} x {torch.cuda.get_device_name(0)}"


def _process_age() -> float:
    """Seconds since this process started (interpreter, imports): the run pays the same before its first line."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start)
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _t_start


def write_json(plan: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(plan, indent=2, default=str))
    os.replace(tmp, path)
    return path


def plan_cli(cfg: DictConfig, opts: dict) -> None:
    try:
        if launched_child():
            calibration_child(cfg)
            return
        plan = make_plan(cfg, opts)
    except UserError as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        refuse(lines[-1])
    if not plan:
        return
    path = Path(opts["json"]) if opts["json"] else plan_dir(cfg) / f"{str(cfg.run_name).replace('/', '_')}.json"
    print(report(plan), flush=True)
    print(f"wanexp: plan written to {write_json(plan, path.resolve())}", flush=True)
    if plan["problems"]:
        for p in plan["problems"][:-1]:
            print(f"wanexp: error: {p}", file=sys.stderr, flush=True)
        refuse(plan["problems"][-1])  # the last also in torchrun's error file


def main() -> None:
    from wanexp.composition import hydra_main

    if {"--help", "-h"} & set(sys.argv[1:]):
        print(OPTIONS, flush=True)
    try:
        opts, rest = split_options(sys.argv[1:])
    except ConfigError as e:
        refuse(str(e))
    sys.argv[1:] = rest
    hydra_main(lambda cfg: plan_cli(cfg, opts))


if __name__ == "__main__":
    main()
