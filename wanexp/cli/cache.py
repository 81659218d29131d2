"""Encode a data set once: the family's latents, conditioning and text embeddings into the cache.

    python -m wanexp.cli.cache [the same overrides as train.py]
    torchrun --nproc_per_node=8 -m wanexp.cli.cache data=mbc_full model.path=...   # ranks split the entries

Every rank encodes every world_size-th missing entry and writes its own shards (wanexp/data/cache.py has the format
and what each key covers). Entries already in the cache are skipped, so an interrupted cache resumes where it
stopped. Samples that cannot be read are listed in <cache_dir>/rejects.jsonl. Training then reads the cache when it
holds every sample of the run, and never loads the VAE or the text encoder.

The parts overlap so that the cache runs at the VAE's speed: data.num_workers loader processes decode and resize the
clips ahead (from before the text encoder starts), the main thread runs the text encoder and then the VAE on the GPU,
and a writer thread saves each shard while the next is encoded. Rank 0 prints samples/s and the ETA as it goes; the
final line gives the VAE's own rate and what the main thread waited for (decoding, writes).
"""
from __future__ import annotations

import os
import time

from typing import TYPE_CHECKING

from omegaconf import DictConfig

from wanexp.errors import ConfigError, MediaError, refuse

if TYPE_CHECKING:  # torch, the encoders and the cache's writers are imported where they are used: --help and a bad
    # override answer before torch is imported
    from wanexp.data.cache import CacheWriter, ShardQueue


class _Clips:
    """Decodes the clips to encode (a map-style dataset for the DataLoader); a clip that fails to decode comes back as
    its error (listed, then skipped)."""

    def __init__(self, todo, load_input=None):
        from wanexp.data.datamodule import load_media  # av and numpy: imported once the command has something to decode

        self.todo = todo  # (key, sample, shape, first frame, frame stride, frame rate)
        self.load_media = load_media
        self.load_input = load_input  # the family's reader of its sample inputs (ModelSpec.load_sample_input)

    def __len__(self) -> int:
        return len(self.todo)

    def __getitem__(self, i):
        key, sample, (frames, height, width), start, stride, fps = self.todo[i]
        try:
            return key, sample, start, self.load_media(sample, frames, height, width, stride, start, fps,
                                                       self.load_input)
        except (MediaError, OSError, ValueError) as e:
            return key, sample, start, str(e).strip().splitlines()[-1]


PROGRESS_EVERY_S = 30.0  # seconds between rank 0's progress lines
TEXT_BATCH = 32  # prompts per text-encoder call


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s"


class Progress:
    """Rank 0's progress lines: samples (clips and images: decoded, VAE-encoded, handed to the writer) per second since
    the first one was asked for, and the ETA of the rest; and where the main thread's time went (waiting for a
    decoded clip, in the VAE, in the text encoder) for the final line."""

    def __init__(self, samples: int, texts: int, rank: int, every_s: float, clock=time.perf_counter):
        self.samples, self.texts, self.rank, self.every_s, self.clock = samples, texts, rank, every_s, clock
        self.done = self.texts_done = 0
        self.start = self.last = clock()
        self.samples_start: float | None = None
        self.wait_decode_s = self.vae_s = self.text_s = self.wait_write_s = 0.0

    def rate(self) -> float | None:
        if not self.done or self.samples_start is None:
            return None
        return self.done / max(self.clock() - self.samples_start, 1e-9)

    def line(self) -> str:
        parts = [f"wanexp: cache r{self.rank}: {self.done}/{self.samples} samples"]
        rate = self.rate()
        if rate:
            parts.append(f"{rate:.2f} samples/s, ETA {_duration((self.samples - self.done) / rate)}")
        if self.texts:
            text_rate = self.texts_done / self.text_s if self.texts_done < self.texts and self.text_s else None
            rate_part = f" ({text_rate:.0f} prompts/s)" if text_rate else ""
            parts.append(f"text {self.texts_done}/{self.texts}{rate_part}")
        return ", ".join(parts)

    def tick(self, force: bool = False) -> None:
        now = self.clock()
        if self.rank == 0 and (force or now - self.last >= self.every_s):
            self.last = now
            print(self.line(), flush=True)

    def finish(self) -> None:
        self.tick(force=True)

    def summary(self) -> dict:
        wall = self.clock() - self.samples_start if self.samples_start is not None and self.done else None
        return {"seconds": self.clock() - self.start, "samples_per_s": self.done / wall if wall else None,
                "vae_samples_per_s": self.done / self.vae_s if self.vae_s and self.done else None,
                "vae_s": self.vae_s, "text_s": self.text_s, "wait_decode_s": self.wait_decode_s,
                "wait_write_s": self.wait_write_s}


def _encode_texts(encoders, todo: list, writer: CacheWriter, progress: Progress) -> None:
    from wanexp.models.encoders import text_rows

    for i in range(0, len(todo), TEXT_BATCH):
        t0 = progress.clock()
        chunk = todo[i:i + TEXT_BATCH]
        emb = encoders.encode_prompts([p for _, p in chunk])
        for (key, _), e in zip(chunk, emb):
            writer.add(key, {"text": e[:text_rows(e)]})  # the reader pads the zeros back
        progress.text_s += progress.clock() - t0
        progress.texts_done += len(chunk)
        progress.tick()


def _encode_latents(encoders, clips, writer: CacheWriter, cache_dtype: str, device, progress: Progress) -> list:
    """Encodes the decoded clips (and their sample inputs) in loader order: the latents and every conditioning tensor
    the family's encoders give (``<key>.<name>``); returns the clips that could not be decoded (path, reason)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cache_dtype]
    rejects = []
    progress.samples_start = progress.clock()
    while True:
        t0 = progress.clock()
        item = next(clips, None)
        t1 = progress.clock()
        progress.wait_decode_s += t1 - t0
        if item is None:
            return rejects
        key, sample, start, media = item
        if isinstance(media, str):
            rejects.append((sample.path, media))
        else:
            batch = {name: t[None].to(device, non_blocking=True) for name, t in media.items()}
            x0, cond = encoders.encode_media(batch)
            tensors = {"latents": x0[0], **{name: t[0] for name, t in cond.items()}}
            tensors = {k: v.to(dtype).cpu() for k, v in tensors.items()}  # waits for the VAE: its time is the VAE's
            progress.vae_s += progress.clock() - t1
            writer.add(key, tensors, media=sample.path, start=start)  # the index says which clip (keys are hashes)
        progress.done += 1
        progress.tick()


def _keep_what_is_done(writer: ShardQueue | None, *writers: CacheWriter) -> None:
    """After a failure or Ctrl-C (not a kill) the entries encoded so far are complete: they are saved, best effort (a
    write that failed leaves them to the rerun), and the writer thread stops."""
    if writer is None or writer.error is None:
        for w in writers:
            try:
                w.flush()
            except Exception:
                break
    if writer is not None:
        writer.close(raise_error=False)


def _rank() -> tuple[int, int, int]:
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def extra_prompts(cfg: DictConfig) -> list[str]:
    """Prompts a run encodes besides its captions: validation's prompts and negative prompt (when it samples
    videos) and the objective's negative prompt (objectives with CFG)."""
    from omegaconf import OmegaConf

    v = OmegaConf.select(cfg, "callbacks.validation", default=None)
    found = []
    if OmegaConf.is_dict(v) and v.get("every_n_steps") and v.get("prompts"):
        found += [*v.prompts, v.negative_prompt]
    negative = OmegaConf.select(cfg, "objective.negative_prompt", default=None)
    if negative is not None:
        found.append(negative)
    return list(dict.fromkeys(str(p) for p in found))


def build_cache(cfg: DictConfig, overlap: bool = True, progress_every_s: float = PROGRESS_EVERY_S) -> dict:
    """Fill ``data.cache_dir`` for this config. Returns counts (written, skipped, rows, rejected: the rows the reader
    and the probe left out plus the samples that failed to encode, bytes) and times.

    ``overlap``: the loader's workers decode and resize clips ahead (from before the text encoder starts), the VAE
    encodes on the main thread and a writer thread saves the shards (ShardQueue); False runs each part in turn (the
    same files, byte for byte). Rank 0 prints its rate and ETA every ``progress_every_s`` seconds."""
    from omegaconf import open_dict

    from wanexp.config import check_config
    from wanexp.composition import build, build_datamodule, prepare_model_folder

    check_config(cfg, model_folder=True)
    import torch
    from torch.utils.data import DataLoader

    from wanexp.data.cache import CacheIndex, CacheWriter, ShardQueue

    spec = build(cfg.model)
    prepare_model_folder(spec, cfg.boundary.name)
    if not cfg.data.cache_dir:
        raise ConfigError("data.cache_dir is null: set it to the folder the cache goes in")
    if cfg.data.window == "random":
        raise ConfigError("data.window=random draws a new window every epoch, which no cache can hold; cache "
                          "data.window=uniform or chunks (several fixed windows per clip), or train online")
    with open_dict(cfg):
        cfg.data.rejects = os.path.join(str(cfg.data.cache_dir), "rejects.jsonl")
    dm = build_datamodule(cfg, spec)
    dm.prepare()
    random_windows = [p.name for p in dm.parts if p.window == "random"]
    if dm.several and random_windows:
        raise ConfigError(f"data.datasets.{random_windows[0]}.window=random draws a new window every epoch, which no "
                          "cache can hold; cache window=uniform or chunks, or train online")
    samples, shapes, starts, _ = dm.items()
    strides, rates = dm.item_stride, dm.item_fps  # each item's dataset's own (data.datasets)
    keys = dm.cache_keys(samples, shapes, starts, strides, rates)
    index = CacheIndex(dm.cache_dir)
    latents, texts = {}, {}
    for sample, shape, start, stride, fps, (lkey, tkey) in zip(samples, shapes, starts, strides, rates, keys):
        if lkey is not None and lkey not in index:  # None: a prompt alone (no media)
            latents.setdefault(lkey, (lkey, sample, shape, start, stride, fps))
        if tkey not in index:
            texts.setdefault(tkey, (tkey, sample.prompt))
    wanted = {k for pair in keys for k in pair if k is not None}
    dropout = [""] if dm.caption_dropout > 0 else []  # a dropped caption trains on the empty prompt's embedding
    for prompt in [*extra_prompts(cfg), *dropout]:  # validation's, negative prompts: training never loads the text encoder
        tkey = dm.text_cache_key(prompt)
        wanted.add(tkey)
        if tkey not in index:
            texts.setdefault(tkey, (tkey, prompt))
    rank, world, local = _rank()
    todo_latents = sorted(latents.values(), key=lambda t: t[0])[rank::world]
    todo_texts = sorted(texts.values())[rank::world]
    skipped = len(wanted) - len(latents) - len(texts)
    device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats()
    total = len(todo_latents) + len(todo_texts)
    # rejected: the rows the metadata reader and the probe left out (dm.report, as a run counts them), then the
    # samples that fail to decode while encoding
    stats = {"written": 0, "skipped": skipped, "rows": dm.report.get("rows", 0),
             "rejected": dm.report.get("rejected", 0), "bytes": 0, "rank": rank, "world": world}
    if total == 0:
        return stats
    encoders = spec.load_encoders().to(device)
    progress = Progress(len(todo_latents), len(todo_texts), rank, progress_every_s)
    shard = int(cfg.data.cache_shard_size)
    writer = ShardQueue() if overlap else None
    text_writer = CacheWriter(dm.cache_dir, "text", rank, shard, writer)
    latent_writer = CacheWriter(dm.cache_dir, "latent", rank, shard, writer)
    pin = overlap and device.type == "cuda"  # pinned pixels: their copy to the GPU does not stall the encoder
    loader = DataLoader(_Clips(todo_latents, dm.load_input), batch_size=None, num_workers=dm.num_workers, pin_memory=pin)
    try:
        # the loader's workers start decoding clips now, while the text encoder runs
        clips = iter(loader) if overlap else None
        _encode_texts(encoders, todo_texts, text_writer, progress)
        text_writer.close()
        clips = clips if clips is not None else iter(loader)
        rejects = _encode_latents(encoders, clips, latent_writer, dm.cache_dtype, device, progress)
        latent_writer.close()
        if writer is not None:
            writer.close()
    except BaseException:
        _keep_what_is_done(writer, text_writer, latent_writer)
        raise
    progress.wait_write_s = writer.wait_s if writer is not None else 0.0
    progress.finish()
    if rejects:
        import json

        with open(os.path.join(dm.cache_dir, f"rejects-r{rank:03d}-encode.jsonl"), "a") as f:
            for path, reason in rejects:
                f.write(json.dumps({"kind": "reject", "source": path, "path": path, "reason": reason}) + "\n")
    stats.update(written=text_writer.written + latent_writer.written, rejected=stats["rejected"] + len(rejects),
                 bytes=text_writer.written_bytes + latent_writer.written_bytes,
                 latent_bytes=latent_writer.written_bytes, latents=latent_writer.written, texts=text_writer.written,
                 **progress.summary(),
                 peak_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None)
    return stats


def cache_cli(cfg: DictConfig) -> None:
    from wanexp.disk import CACHE_DISK_FULL, stop_line

    try:
        s = build_cache(cfg)
    except Exception as e:
        # bad input or a full disk: one line; a bug: raised
        line = stop_line(e, cfg.data.cache_dir, **CACHE_DISK_FULL)
        if line is None:
            raise
        refuse(line)
    per = ""
    if s.get("latents"):
        per = (f"; per sample {s['latent_bytes'] / s['latents'] / 2**20:.2f} MiB latents + "
               f"{(s['bytes'] - s['latent_bytes']) / max(1, s['texts']) / 2**20:.2f} MiB text")
    peak = f"; peak GPU memory {s['peak_gib']:.1f} GiB" if s.get("peak_gib") is not None else ""
    rejected = f"{s['rejected']} of {s['rows']} rows rejected" + (
        f" (reasons in {cfg.data.cache_dir}/rejects*.jsonl)" if s["rejected"] else "")
    print(f"wanexp: cache rank {s['rank']}/{s['world']}: wrote {s['written']} entries "
          f"({s['bytes'] / 2**20:.1f} MiB{per}), {s['skipped']} already cached, {rejected}{peak} "
          f"-> {cfg.data.cache_dir}", flush=True)
    if s.get("samples_per_s"):
        print(f"wanexp: cache rank {s['rank']}: {rate_line(s)}", flush=True)


def rate_line(s: dict) -> str:
    """The final rate: samples/s against the VAE's own (its encode time alone), and what the main thread waited
    for: a decode wait means more data.num_workers; a write wait, a disk slower than the VAE."""
    vae = s.get("vae_samples_per_s")
    share = f" ({100 * s['samples_per_s'] / vae:.0f} % of it)" if vae else ""
    return (f"{s['samples_per_s']:.2f} samples/s, {_duration(s['seconds'])} in all; the VAE alone "
            f"{vae or float('nan'):.2f} samples/s{share}; waited {s['wait_decode_s']:.1f} s for decoded clips, "
            f"{s['wait_write_s']:.1f} s for shard writes; text encoder {s['text_s']:.1f} s")


def main() -> None:
    from wanexp.composition import hydra_main

    hydra_main(cache_cli)


if __name__ == "__main__":
    main()
