"""Encode a data set once: VAE latents (posterior mode, normalised) and UMT5 text embeddings into the cache.

    python -m wanexp.cli.cache [the same overrides as train.py]
    torchrun --nproc_per_node=8 -m wanexp.cli.cache data=mbc_full model.path=...   # ranks split the entries

Every rank encodes every world_size-th missing entry and writes its own shards (wanexp/data/cache.py has the format
and what each key covers). Entries already in the cache are skipped, so an interrupted cache resumes where it
stopped. Samples that cannot be read are listed in <cache_dir>/rejects.jsonl. Training then reads the cache when it
holds every sample of the run, and never loads the VAE or the text encoder.
"""
from __future__ import annotations

import os
import sys
import time

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset

from wanexp.data.cache import CacheIndex, CacheWriter
from wanexp.data.media import load_clip
from wanexp.errors import ConfigError, MediaError, UserError
from wanexp.models.encode import encode_image_condition, encode_text, encode_video, tokenize


class _Clips(Dataset):
    """Decodes the clips to encode; a clip that fails to decode comes back as its error (listed, then skipped)."""

    def __init__(self, todo):
        self.todo = todo  # (key, sample, shape, first frame, frame stride)

    def __len__(self) -> int:
        return len(self.todo)

    def __getitem__(self, i):
        key, sample, (frames, height, width), start, stride = self.todo[i]
        try:
            return key, sample, load_clip(sample, frames, height, width, stride, start=start)
        except (MediaError, OSError, ValueError) as e:
            return key, sample, str(e).strip().splitlines()[-1]


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


def build_cache(cfg: DictConfig) -> dict:
    """Fill ``data.cache_dir`` for this config. Returns counts (written, skipped, rejected, bytes)."""
    from omegaconf import open_dict

    from wanexp.config import check_config
    from wanexp.train import build, build_datamodule, prepare_model_folder

    check_config(cfg)
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
    strides = dm.item_stride or [dm.frame_stride] * len(samples)  # each dataset's own (data.datasets)
    keys = dm.cache_keys(samples, shapes, starts, strides)
    index = CacheIndex(dm.cache_dir)
    latents, texts = {}, {}
    for sample, shape, start, stride, (lkey, tkey) in zip(samples, shapes, starts, strides, keys):
        if lkey is not None and lkey not in index:  # None: a prompt alone (no media)
            latents.setdefault(lkey, (lkey, sample, shape, start, stride))
        if tkey not in index:
            texts.setdefault(tkey, (tkey, sample.prompt))
    wanted = {k for pair in keys for k in pair if k is not None}
    dropout = [""] if dm.caption_dropout > 0 else []  # a dropped caption trains on the empty prompt's embedding
    for prompt in [*extra_prompts(cfg), *dropout]:  # validation's, negative prompts: training never loads UMT5
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
    stats = {"written": 0, "skipped": skipped, "rejected": 0, "bytes": 0, "rank": rank, "world": world}
    if total == 0:
        return stats
    encoders = spec.load_encoders().to(device)
    from tqdm import tqdm

    bar = tqdm(total=total, desc=f"cache r{rank}", unit="entry", disable=rank != 0, dynamic_ncols=True)
    rejects = []
    t0 = time.perf_counter()
    shard = int(cfg.data.cache_shard_size)
    text_writer = CacheWriter(dm.cache_dir, "text", rank, shard)
    for i in range(0, len(todo_texts), 32):
        chunk = todo_texts[i:i + 32]
        prompts = [p for _, p in chunk]
        emb = encode_text(encoders.tokenizer, encoders.text_encoder, prompts, encoders.text_len)
        lengths = tokenize(encoders.tokenizer, prompts, encoders.text_len).attention_mask.sum(1).tolist()
        for (key, _), e, n in zip(chunk, emb, lengths):
            text_writer.add(key, {"text": e[:n]})
        bar.update(len(chunk))
    text_writer.close()
    latent_writer = CacheWriter(dm.cache_dir, "latent", rank, shard)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dm.cache_dtype]
    loader = DataLoader(_Clips(todo_latents), batch_size=None, num_workers=dm.num_workers)
    for key, sample, pixels in loader:
        if isinstance(pixels, str):
            rejects.append((sample.path, pixels))
        else:
            pixels = pixels[None].to(device)
            tensors = {"latents": encode_video(encoders.vae, pixels)[0]}
            if encoders.image_latent:
                tensors["image_latent"] = encode_image_condition(encoders.vae, pixels[:, :, 0], pixels.shape[2])[0]
            latent_writer.add(key, {k: v.to(dtype) for k, v in tensors.items()})
        bar.update(1)
    latent_writer.close()
    bar.close()
    if rejects:
        import json

        with open(os.path.join(dm.cache_dir, f"rejects-r{rank:03d}-encode.jsonl"), "a") as f:
            for path, reason in rejects:
                f.write(json.dumps({"kind": "reject", "source": path, "path": path, "reason": reason}) + "\n")
    stats.update(written=text_writer.written + latent_writer.written, rejected=len(rejects),
                 bytes=text_writer.written_bytes + latent_writer.written_bytes,
                 latent_bytes=latent_writer.written_bytes, latents=latent_writer.written, texts=text_writer.written,
                 seconds=time.perf_counter() - t0,
                 peak_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None)
    return stats


def cache_cli(cfg: DictConfig) -> None:
    try:
        s = build_cache(cfg)
    except UserError as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        print(f"wanexp: error: {lines[-1]}", file=sys.stderr, flush=True)
        sys.exit(2)
    per = ""
    if s.get("latents"):
        per = (f"; per sample {s['latent_bytes'] / s['latents'] / 2**20:.2f} MiB latents + "
               f"{(s['bytes'] - s['latent_bytes']) / max(1, s['texts']) / 2**20:.2f} MiB text")
    peak = f"; peak GPU memory {s['peak_gib']:.1f} GiB" if s.get("peak_gib") is not None else ""
    print(f"wanexp: cache rank {s['rank']}/{s['world']}: wrote {s['written']} entries "
          f"({s['bytes'] / 2**20:.1f} MiB{per}), {s['skipped']} already cached, {s['rejected']} rejected{peak} "
          f"-> {cfg.data.cache_dir}", flush=True)


def main() -> None:
    from wanexp.train import main as hydra_main

    hydra_main(cache_cli)


if __name__ == "__main__":
    main()
