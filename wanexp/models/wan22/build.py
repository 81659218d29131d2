"""Tiny random Wan2.2 models in the real diffusers folder layout (WanSpec.write_random_model).

Tests and the demo load these folders through the same ``load_*`` code a real run uses; wanexp.models.tiny writes
them atomically. Building is deterministic (seeded by ``model.build.seed``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from wanexp.errors import ConfigError
from wanexp.models.family import ModelSpec

SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]


def build_tokenizer(save_dir: Path, max_length: int):
    """An offline byte-level tokenizer with T5's special tokens (pad=0, eos=1, unk=2); appends </s> like T5."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(set(pre_tokenizers.ByteLevel.alphabet()))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=max_length
    )
    fast.save_pretrained(save_dir)
    return fast


def _latent_stats(z: int) -> tuple[list[float], list[float]]:
    g = torch.Generator().manual_seed(1234)
    mean = (torch.rand(z, generator=g, device="cpu") * 0.4 - 0.2).tolist()
    std = (torch.rand(z, generator=g, device="cpu") * 0.5 + 0.75).tolist()
    return mean, std


def build_components(spec: ModelSpec, device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Random-init components of ``spec``'s layout, sized by ``spec.build`` (built on ``device``, cast to ``dtype``)."""
    b = spec.build
    torch.manual_seed(int(b.get("seed", 0)))
    with torch.device(device):
        comps = _random_components(spec, b)
    if b.get("pretrain"):  # a base that draws something, for a LoRA to change (wanexp.models.wan22.pretrain)
        import tempfile

        from wanexp.models.wan22.pretrain import pretrain_on_squares

        with tempfile.TemporaryDirectory() as tmp:  # the captions' tokenizer, as the build writes it
            tokenizer = build_tokenizer(Path(tmp), spec.text_len)
        pretrain_on_squares(spec, comps, b["pretrain"], tokenizer)
    for name, comp in comps.items():
        if isinstance(comp, torch.nn.Module):
            comps[name] = comp.to(dtype)
    return comps


def _random_components(spec: ModelSpec, b: dict) -> dict:
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    from wanexp.models.wan22.pipeline import flow_scheduler

    te_cfg = dict(b["text_encoder"])
    text_encoder = UMT5EncoderModel(UMT5Config(**te_cfg, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    tcfg = dict(b["transformer"])
    tcfg.update(in_channels=spec.in_channels, out_channels=spec.latent_channels, patch_size=list(spec.patch))
    tcfg.setdefault("text_dim", te_cfg["d_model"])
    vcfg = dict(spec.vae_layout, **b["vae"])
    if b.get("vae_weights") not in (None, "random", "block_average"):
        raise ConfigError(f"model.build.vae_weights={b['vae_weights']!r}: one of random (the default), block_average")
    if b.get("vae_weights") == "block_average":  # a readable codec (block_codec.py) instead of random weights
        from wanexp.models.wan22.block_codec import block_average_vae

        vae = block_average_vae(**vcfg)
    else:
        mean, std = _latent_stats(vcfg["z_dim"])
        vae = AutoencoderKLWan(**vcfg, latents_mean=mean, latents_std=std)
    dit = spec.transformer_type()  # the spec's DiT class (WanTransformer3DModel, or a variant's)
    comps = {
        "text_encoder": text_encoder,
        "vae": vae,
        "transformer": dit(**tcfg),
        "scheduler": flow_scheduler(spec.shift),
    }
    if "low" in b.get("experts", spec.experts):  # model.build.experts: the experts written (default: the model's)
        comps["transformer_2"] = dit(**tcfg)
    return comps


def save_pipeline_folder(spec: ModelSpec, comps: dict, out: Path) -> None:
    """Save components as a diffusers pipeline folder (model_index.json + one subfolder per component)."""
    import diffusers

    tokenizer = build_tokenizer(out / "tokenizer", spec.text_len)
    kwargs = dict(comps, tokenizer=tokenizer, **spec.pipeline_extras)
    if spec.boundary_ratio is not None:
        kwargs["boundary_ratio"] = spec.boundary_ratio
    pipe = getattr(diffusers, spec.pipeline_class)(**kwargs)
    pipe.save_pretrained(out)
