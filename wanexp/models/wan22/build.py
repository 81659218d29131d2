"""Build tiny random Wan2.2 models and save them in the real diffusers folder layout.

Tests and the demo load these folders through the same `WanSpec.load_*` code a real run uses. Building is
deterministic (seeded) and atomic: the folder appears complete or not at all, also when ranks race.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from wanexp.models.wan22.spec import WanSpec

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


def build_components(spec: WanSpec, device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Random-init components of ``spec``'s layout, sized by ``spec.build`` (built on ``device``, cast to ``dtype``)."""
    b = spec.build
    torch.manual_seed(int(b.get("seed", 0)))
    with torch.device(device):
        comps = _random_components(spec, b)
    for name, comp in comps.items():
        if isinstance(comp, torch.nn.Module):
            comps[name] = comp.to(dtype)
    return comps


def _random_components(spec: WanSpec, b: dict) -> dict:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    te_cfg = dict(b["text_encoder"])
    text_encoder = UMT5EncoderModel(UMT5Config(**te_cfg, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    tcfg = dict(b["transformer"])
    tcfg.update(in_channels=spec.in_channels, out_channels=spec.latent_channels, patch_size=list(spec.patch))
    tcfg.setdefault("text_dim", te_cfg["d_model"])
    vcfg = dict(spec.vae_layout, **b["vae"])
    mean, std = _latent_stats(vcfg["z_dim"])
    vae = AutoencoderKLWan(**vcfg, latents_mean=mean, latents_std=std)
    comps = {
        "text_encoder": text_encoder,
        "vae": vae,
        "transformer": WanTransformer3DModel(**tcfg),
        "scheduler": UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=spec.shift, num_train_timesteps=1000
        ),
    }
    if "low" in spec.experts:
        comps["transformer_2"] = WanTransformer3DModel(**tcfg)
    return comps


def save_pipeline_folder(spec: WanSpec, comps: dict, out: Path) -> None:
    """Save components as a diffusers pipeline folder (model_index.json + one subfolder per component)."""
    import diffusers

    tokenizer = build_tokenizer(out / "tokenizer", spec.text_len)
    kwargs = dict(comps, tokenizer=tokenizer, **spec.pipeline_extras)
    if spec.boundary_ratio is not None:
        kwargs["boundary_ratio"] = spec.boundary_ratio
    pipe = getattr(diffusers, spec.pipeline_class)(**kwargs)
    pipe.save_pretrained(out)


def _quiet_libraries() -> None:
    """Building writes through diffusers/transformers, whose dtype notes and shard progress bars say nothing here."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


def _built_from_spec(spec: WanSpec, folder: Path) -> bool:
    """Whether ``folder`` holds a model built from ``spec.build`` (its DiT config has the build's sizes)."""
    import json

    wanted = dict(spec.build.get("transformer") or {})
    for sub in ("transformer", "transformer_2"):
        cfg = folder / sub / "config.json"
        if cfg.is_file():
            have = json.loads(cfg.read_text())
            return all(have.get(k) == v for k, v in wanted.items())
    return False


def ensure_tiny_model(spec: WanSpec, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """Build ``spec.path`` from ``spec.build`` unless it already holds that model. Safe when several processes race.

    Only an absent (or empty) folder is built into, with a printed line: a path that holds anything else (a real
    model, another layout, a mistyped path to some other folder) stops with one line and is never written to."""
    from wanexp.errors import ConfigError

    target = spec.path
    if not spec.build:
        raise ValueError(f"{spec.name} has no build section; only tiny models are built")
    if (target / "model_index.json").is_file():
        if _built_from_spec(spec, target):
            return target
        raise ConfigError(f"model.path={target}: holds a model that model={spec.name} did not build (model.build "
                          f"builds a random model into an absent folder); use the model group of that folder "
                          f"(model=ti2v5b|i2v14b|t2v14b), or point model.path at an absent folder")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"model.path={target}: exists and is not a model built by model={spec.name}; model.build "
                          "writes only into an absent or empty folder: check the spelling of model.path, or pick an "
                          "absent folder")
    print(f"wanexp: building the random model {spec.name} into {target} (model.build; an absent model.path)",
          flush=True)
    _quiet_libraries()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_pipeline_folder(spec, build_components(spec, device, dtype), tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model_index.json").is_file():  # an empty folder, not a racing winner's build
                target.rmdir()
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
