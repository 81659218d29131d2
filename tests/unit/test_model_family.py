"""A new model family is one package and one model YAML (docs/extending.md, adding a model family, followed here
literally): this test writes a family that is not shaped like Wan2.2 into tmp_path and runs it as a user would,
without touching any file of the repository.

The family ``toyfamily``: a single-stream DiT whose layers (``layers.N``) attend jointly over text, signal and video
tokens (``mix.query/key/value/proj``, ``mlp.fc_in/fc_out``), a VAE of strided convolutions (a first frame alone, then
pairs of frames: 2k+1 frames per clip), a BERT text encoder with a byte-level tokenizer, and a conditioning input of
its own: a 1-D signal per clip (a ``signal`` metadata column of .npy files) whose per-frame features its encoders put
in ``cond["signal"]``, the cache stores and its DiT adds to each latent frame's tokens. One dense expert, LoRA target
aliases and a ComfyUI key map of its own, its FLOP and memory formulas and an Euler flow-matching sampler.

The flow: wanexp.cli.cache (latents, text and the signal features into the cache) -> wanexp.cli.plan --no-calibrate
-> python train.py from the cache with a checkpoint -> resume=last to a later step -> the run's LoRA files (the
diffusers file loads back into the family's DiT, the ComfyUI file has the family's original names) ->
wanexp.cli.sample --run, each command's entry called in this process.
"""
from __future__ import annotations

import csv
import json
import sys
import textwrap

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

FILES = {}
FILES["__init__.py"] = '''
"""The toy family: a single-stream DiT with a signal input (nets.py), its encoders and sampler (parts.py), its spec
(spec.py); conf/model/toy.yaml names toyfamily.spec.ToySpec."""
'''

FILES["nets.py"] = '''
"""The toy family's networks, each a diffusers-style model (from_pretrained, save_pretrained, from_config)."""
import math

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import nn
from torch.nn import functional as F


class Mix(nn.Module):
    """Joint attention over every token of the sequence (text, then video)."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.proj = (nn.Linear(width, width) for _ in range(4))

    def forward(self, h):
        b, n, d = h.shape
        q, k, v = (t(h).view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for t in (self.query, self.key, self.value))
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, h):
        return self.fc_out(F.gelu(self.fc_in(h)))


class Layer(nn.Module):
    def __init__(self, width, heads, hidden):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mix, self.mlp = Mix(width, heads), Mlp(width, hidden)

    def forward(self, h):
        h = h + self.mix(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class ToyNet(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """Latents (B, C, F, H, W), a timestep per sample (0..1000), text (B, L, text_dim) and signal features
    (B, F, signal_dim) -> the velocity (B, C, F, H, W)."""

    @register_to_config
    def __init__(self, in_channels=8, out_channels=8, width=32, heads=2, depth=2, mlp_width=64, text_dim=32,
                 signal_dim=16, patch_size=(1, 2, 2)):
        super().__init__()
        self.embed = nn.Conv3d(in_channels, width, kernel_size=tuple(patch_size), stride=tuple(patch_size))
        self.time = nn.Linear(width, width)
        self.text = nn.Linear(text_dim, width)
        self.signal = nn.Linear(signal_dim, width)
        self.layers = nn.ModuleList(Layer(width, heads, mlp_width) for _ in range(depth))
        self.norm_out = nn.LayerNorm(width)
        self.head = nn.Linear(width, out_channels * math.prod(patch_size))

    def time_embedding(self, timestep):
        half = self.config.width // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=timestep.device) / half)
        angles = timestep.float()[:, None] * freqs[None]
        return self.time(torch.cat([angles.cos(), angles.sin()], -1).to(self.time.weight.dtype))

    def forward(self, latents, timestep, text, signal):
        b, _, f, h, w = latents.shape
        pt, ph, pw = self.config.patch_size
        x = self.embed(latents)  # (B, width, F / pt, H / ph, W / pw)
        frames, rows, cols = x.shape[2:]
        x = x.flatten(3).permute(0, 2, 3, 1)  # (B, frames, rows * cols, width)
        x = x + self.signal(signal)[:, :, None]  # each latent frame's signal feature on its tokens
        x = x.reshape(b, -1, x.shape[-1]) + self.time_embedding(timestep)[:, None]
        context = self.text(text)
        hidden = torch.cat([context, x], 1)
        for layer in self.layers:
            hidden = layer(hidden)
        out = self.head(self.norm_out(hidden[:, context.shape[1]:]))
        out = out.view(b, frames, rows, cols, -1, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return out.reshape(b, -1, f, h, w)


class ToyVAE(ModelMixin, ConfigMixin):
    """Pixels (B, 3, F, H, W) in [-1, 1] <-> latents (B, C, 1 + (F - 1) / 2, H / 4, W / 4): the first frame alone,
    the others in pairs, 4 x 4 pixels per latent."""

    @register_to_config
    def __init__(self, latent_channels=8, scale=0.5):
        super().__init__()
        c = latent_channels
        self.first, self.pairs = nn.Conv3d(3, c, (1, 4, 4), (1, 4, 4)), nn.Conv3d(3, c, (2, 4, 4), (2, 4, 4))
        self.first_out = nn.ConvTranspose3d(c, 3, (1, 4, 4), (1, 4, 4))
        self.pairs_out = nn.ConvTranspose3d(c, 3, (2, 4, 4), (2, 4, 4))

    def encode(self, pixels):
        z = [self.first(pixels[:, :, :1])] + ([self.pairs(pixels[:, :, 1:])] if pixels.shape[2] > 1 else [])
        return torch.cat(z, 2) * self.config.scale

    def decode(self, z):
        z = z / self.config.scale
        x = [self.first_out(z[:, :, :1])] + ([self.pairs_out(z[:, :, 1:])] if z.shape[2] > 1 else [])
        return torch.tanh(torch.cat(x, 2))


class SignalEncoder(ModelMixin, ConfigMixin):
    """A signal value per frame (B, F) -> a feature per latent frame (B, 1 + (F - 1) / 2, dim): the first frame's
    value alone, the others in pairs, as the VAE groups the frames."""

    @register_to_config
    def __init__(self, dim=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, signal):
        first = signal[:, :1].repeat(1, 2)[:, None]
        pairs = signal[:, 1:].reshape(signal.shape[0], -1, 2)
        return self.net(torch.cat([first, pairs], 1).to(self.net[0].weight.dtype))
'''

FILES["parts.py"] = '''
"""The toy family's frozen encoders (what training and the cache run) and its sampler."""
import torch

from wanexp.errors import ConfigError
from wanexp.models.encoders import Encoders
from wanexp.models.pipeline import OneExpertPipeline
from wanexp.text import clean_prompt


class ToyEncoders(Encoders):
    """The toy VAE, the text encoder and the signal encoder: cond["signal"] holds each sample's signal features."""

    def __init__(self, vae, text_encoder, tokenizer, signal_encoder, text_len):
        super().__init__()
        self.vae, self.text_encoder, self.signal_encoder = vae, text_encoder, signal_encoder
        self.tokenizer, self.text_len = tokenizer, text_len

    @torch.no_grad()
    def encode_media(self, batch):
        x0 = self.vae.encode(batch["pixels"].to(self.vae.dtype)).float()
        return x0, {"signal": self.signal_encoder(batch["signal"]).float()}

    @torch.no_grad()
    def encode_prompts(self, prompts):
        toks = self.tokenizer([clean_prompt(p) for p in prompts], padding="max_length", max_length=self.text_len,
                              truncation=True, return_tensors="pt")
        mask = toks.attention_mask.to(self.text_encoder.device)
        hidden = self.text_encoder(input_ids=toks.input_ids.to(mask.device), attention_mask=mask).last_hidden_state
        return hidden * mask[..., None].to(hidden.dtype)  # zeros past each prompt's tokens

    @torch.no_grad()
    def decode(self, x0):
        return self.vae.decode(x0.to(self.vae.dtype)).float().clamp(-1, 1)


class ToyPipeline(OneExpertPipeline):
    """Euler steps of flow matching over the DiT with classifier-free guidance, decoded by the VAE. A sample has no
    recorded signal: it is conditioned on zero signal features."""

    def __init__(self, spec, transformers, vae, scheduler, encoders=None):
        self.spec, self.experts, self.vae, self.scheduler = spec, dict(transformers), vae, scheduler
        self.encoders = encoders  # for prompts given as text (wanexp-sample); validation gives their embeddings

    @torch.no_grad()
    def generate(self, prompt, seed, shape, steps, guidance, negative, device, record, image=None, embeds=None,
                 inputs=None):
        spec, transformer = self.spec, self.experts["dense"]
        st, sh, sw = spec.vae_stride
        grid = ((shape["frames"] - 1) // st + 1, shape["height"] // sh, shape["width"] // sw)
        x = torch.randn(1, spec.latent_channels, *grid, generator=torch.Generator().manual_seed(seed)).to(device)
        text = torch.stack(embeds) if embeds is not None else self.encoders.encode_prompts([prompt, negative])
        signal = torch.zeros(2, grid[0], transformer.config.signal_dim, device=device)
        self.scheduler.set_timesteps(steps, device=device)
        record.clear()
        for t in self.scheduler.timesteps:
            record.append(float(t))
            v = spec.transformer_call(transformer, x.repeat(2, 1, 1, 1, 1), t.expand(2), text.to(device),
                                      {"signal": signal})
            x = self.scheduler.step(v[1:] + guidance * (v[:1] - v[1:]), t, x).prev_sample
        video = self.vae.decode(x.to(self.vae.dtype)).float().clamp(-1, 1)[0].permute(1, 2, 3, 0)  # (F, H, W, 3)
        return x.float().cpu(), ((video + 1) / 2).cpu(), list(record)

    def use_student(self, timesteps, shift=0.0):
        if timesteps is not None:
            raise ConfigError("the toy family samples no distilled adapter")
'''

FILES["spec.py"] = '''
"""The toy family's spec: what wanexp asks a family for (wanexp.models.family.ModelSpec)."""
import json
import math

import numpy as np
import torch

from wanexp.adapters.naming import AdapterNaming
from wanexp.models.family import ModelSpec

SIGNAL_RATE = 100  # values per second in a signal file


class ToyMemory:
    """The memory formula wanexp.memory_plan reads: a layer's weights and one step's activations, from the config."""

    def block_count(self, config):
        return int(config["depth"])

    def weights_gib(self, config, weight_bytes, other_bytes, resident_blocks):
        w, m = config["width"], config["mlp_width"]
        per_block = 4 * w * w + 2 * w * m
        other = (config["in_channels"] + config["out_channels"] + 1) * w * 4 + (config["text_dim"] + w) * w
        return (resident_blocks * per_block * weight_bytes + other * other_bytes) / 2**30

    def activations_gib(self, config, tokens, checkpointing, offloading, compiled):
        kept = 1 if checkpointing else int(config["depth"])
        return kept * tokens * (8 * config["width"] + 2 * config["mlp_width"]) * 4 / 2**30

    def compiled(self, compile):
        return False


class ToySpec(ModelSpec):
    layout = "toy"
    latent_channels = in_channels = 8
    vae_stride = (2, 4, 4)
    patch = (1, 2, 2)
    transformer_class = "toyfamily.nets.ToyNet"
    vae_class = "toyfamily.nets.ToyVAE"
    text_encoder_class = "transformers.BertModel"

    # ---- adapters: the LoRA aliases users write and the original names of a ComfyUI file ----
    adapter_naming = AdapterNaming(
        blocks="layers", attention={"joint": "mix"}, original_attention={"joint": "attn"},
        projections={"wq": "query", "wk": "key", "wv": "value", "wo": "proj"},
        feedforward={"w1": "mlp.fc_in", "w2": "mlp.fc_out"},
        formats="ComfyUI (diffusion_model.layers.N.attn.wq.lora_down/lora_up), diffusers/peft "
                "(transformer.layers.N.mix.query.lora_A/lora_B)")

    # ---- conditioning: one more encoder folder and one more input per sample ----
    encoder_folders = ("vae", "text_encoder", "tokenizer", "signal_encoder")
    sample_inputs = {"signal": "a .npy file of the clip's signal, 100 values per second"}

    def load_sample_input(self, name, path, num_frames, fps, size=None, start=0, stride=1):
        """The signal's value at the time of each frame of the clip's window."""
        values = np.load(path)
        at = np.round((start + stride * np.arange(num_frames)) / (fps or self.fps) * SIGNAL_RATE).astype(int)
        return torch.from_numpy(values[np.minimum(at, len(values) - 1)]).float()

    def load_encoders(self):
        from toyfamily.nets import SignalEncoder
        from toyfamily.parts import ToyEncoders

        signal = SignalEncoder.from_pretrained(self.path, subfolder="signal_encoder", dtype=self.vae_dtype)
        return ToyEncoders(self.load_vae(), self.load_text_encoder(), self.load_tokenizer(),
                           signal.requires_grad_(False).eval(), self.text_len)

    def model_inputs(self, x_t, x0, sigma, cond):
        return x_t, 1000.0 * sigma.float(), None

    def transformer_call(self, transformer, hidden, timestep, text, cond):
        return transformer(hidden, timestep, text, cond["signal"].to(hidden.dtype))

    def blocks(self, transformer):
        return transformer.layers

    # ---- memory, FLOPs (its frame rule, 2k+1, is model.frame_rule in its YAML) ----
    def step_flops(self, config, latent_shape, text_len, checkpointing):
        """Linears and attention of every layer over text + video tokens, forward and input gradients (LoRA)."""
        b, _, f, h, w = latent_shape
        n = text_len + math.prod(s // p for s, p in zip((f, h, w), config["patch_size"]))
        width, m = config["width"], config["mlp_width"]
        forward = config["depth"] * (2 * n * (4 * width * width + 2 * width * m) + 4 * n * n * width)
        return b * forward * (3 if checkpointing else 2)

    def memory_formula(self):
        return ToyMemory()

    # ---- generation ----
    def load_scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_pretrained(self.path, subfolder="scheduler")

    def load_pipeline(self, device, dtype, image):
        from toyfamily.parts import ToyPipeline

        encoders = self.load_encoders().to(device)
        return ToyPipeline(self, {"dense": self.load_transformer("dense").to(device, dtype)}, encoders.vae,
                           self.load_scheduler(), encoders)

    def make_pipeline(self, transformers, vae, scheduler, image):
        from toyfamily.parts import ToyPipeline

        return ToyPipeline(self, transformers, vae, scheduler)

    def encode_prompts(self, prompts, device, encoders=None):
        encoders = encoders if encoders is not None else self.load_encoders().to(device)
        return dict(zip(prompts, encoders.encode_prompts(list(prompts)).cpu()))

    # ---- the tiny random build ----
    def write_random_model(self, folder, device="cpu", dtype=torch.float32):
        from diffusers import FlowMatchEulerDiscreteScheduler
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

        from toyfamily.nets import SignalEncoder, ToyNet, ToyVAE

        b = self.build
        torch.manual_seed(int(b["seed"]))
        special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
        vocab = {t: i for i, t in enumerate(special + sorted(set(pre_tokenizers.ByteLevel.alphabet())))}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
        PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                sep_token="[SEP]", model_max_length=self.text_len).save_pretrained(folder / "tokenizer")
        te = b["text_encoder"]
        comps = {"text_encoder": BertModel(BertConfig(vocab_size=len(vocab), max_position_embeddings=self.text_len,
                                                      **te)),
                 "transformer": ToyNet(**b["transformer"], in_channels=self.in_channels,
                                       out_channels=self.latent_channels, text_dim=te["hidden_size"],
                                       signal_dim=b["signal_dim"], patch_size=self.patch),
                 "vae": ToyVAE(latent_channels=self.latent_channels), "signal_encoder": SignalEncoder(b["signal_dim"])}
        for name, module in comps.items():
            module.to(dtype).save_pretrained(folder / name)
        FlowMatchEulerDiscreteScheduler(shift=self.shift).save_pretrained(folder / "scheduler")
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "ToyPipeline"}))
'''

MODEL_YAML = '''
defaults:
  - /schema/model@_here_
  - _self_
_target_: toyfamily.spec.ToySpec
name: toy
path: ${paths.tiny_model_dir}/${model.name}
dtype: fp32
vae_dtype: fp32
text_encoder_dtype: fp32
experts: [dense]
boundary_ratio: null
shift: 3.0
hw_multiple: 16
frame_rule: [2, 1]      # frame counts 2k+1: the VAE's first frame alone, then pairs
text_len: 64
fps: 16
gradient_checkpointing: false
attention_backend: null
first_frame_cond: 0.0
fast_modulation: false
compile: false
memory_budget_gib: null
build:
  seed: 0
  signal_dim: 16
  transformer: {width: 32, heads: 2, depth: 2, mlp_width: 64}
  text_encoder: {hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, intermediate_size: 64}
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The family's package on sys.path, its YAML in a config folder of its own, and clips with a signal each: a
    metadata file with a ``signal`` column naming .npy files next to the clips."""
    from wanexp.data.synthetic import make_demo_dataset

    pkg = tmp_path / "pkg" / "toyfamily"
    pkg.mkdir(parents=True)
    for name, text in FILES.items():
        (pkg / name).write_text(textwrap.dedent(text).lstrip())
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "toy.yaml").write_text(MODEL_YAML)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    data = make_demo_dataset(tmp_path / "data", num_videos=4, num_images=2, num_frames=9, height=48, width=48,
                             fps=16).parent  # the model's rate (model.fps)
    rows = list(csv.DictReader((data / "metadata.csv").open()))
    for i, row in enumerate(rows):
        np.save(data / f"signal_{i}.npy", np.sin(np.arange(200) * (i + 1) / 20).astype(np.float32))
        row["signal"] = f"signal_{i}.npy"
    with (data / "signals.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["video", "prompt", "signal"])
        writer.writeheader()
        writer.writerows(rows)
    yield tmp_path
    for name in [m for m in sys.modules if m == "toyfamily" or m.startswith("toyfamily.")]:
        del sys.modules[name]


def _overrides(root, *extra) -> list[str]:
    """The family's config folder and model group, the signals' metadata, its own LoRA target aliases."""
    return [f"hydra.searchpath=[file://{root}/conf]", "experiment=demo", "model=toy",
            f"paths.tiny_model_dir={root}/models", f"paths.output_dir={root}/run", f"data.cache_dir={root}/cache",
            f"data.metadata={root}/data/signals.csv", "data.generate=null", "data.num_frames=7", "data.height=32",
            "data.width=32", "adapter.targets=[wq,wk,wv,wo,w1,w2]", "adapter.attention=[joint]", "adapter.rank=4",
            "adapter.alpha=2", "optim.lr=1e-2", "optim.warmup_steps=0", "optim.scheduler=constant",
            "trainer.log_every_n_steps=1", "callbacks.progress=null", "callbacks.checkpoint.every_n_train_steps=2",
            *extra]


def _command(monkeypatch, capsys, main, argv: list[str]) -> str:
    """A command's entry run in this process as ``argv`` would run it; what it printed."""
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.delenv("HYDRA_FULL_ERROR")  # the entry sets it for Hydra; unset again after the test
    monkeypatch.setattr(sys, "argv", argv)
    capsys.readouterr()
    main()
    out = capsys.readouterr()
    return out.out + out.err


def _lora(checkpoint) -> dict:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    return state["global_step"], {k: v for k, v in state["state_dict"].items() if ".lora_" in k}


def test_a_family_of_its_own_caches_plans_trains_resumes_exports_and_samples(toy, monkeypatch, capsys):
    from hydra.utils import instantiate

    from tests.conftest import compose_cfg
    from wanexp.cli import cache, plan, sample
    from wanexp.data.cache import CacheIndex
    from wanexp.data.media import load_clip
    from wanexp.train import main as train

    root, run = toy, toy / "run"
    # 1. the cache: latents, text and the family's signal features (<key>.signal), each as its encoders give it
    out = _command(monkeypatch, capsys, cache.main, ["wanexp-cache", *_overrides(root)])
    assert "wrote 12 entries" in out  # 6 clips and images, 6 prompts
    index = CacheIndex(root / "cache")
    latents = {e["media"]: e["key"] for e in index.entries.values() if e["kind"] == "latent"}
    assert len(latents) == 6 and all(sorted(index.entries[k]["tensors"]) == ["latents", "signal"]
                                     for k in latents.values())
    spec = instantiate(compose_cfg(_overrides(root)).model, _convert_="all")  # the spec every command builds
    encoders = spec.load_encoders()
    for row in csv.DictReader((root / "data" / "signals.csv").open()):
        stored = index.load(latents[str(root / "data" / row["video"])])
        frames = 1 if row["video"].endswith(".png") else 7
        signal = spec.load_sample_input("signal", str(root / "data" / row["signal"]), frames, 16)
        assert stored["latents"].shape == (8, 1 + (frames - 1) // 2, 8, 8)
        assert torch.equal(stored["signal"], encoders.signal_encoder(signal[None])[0])

    # 2. the plan, on the CPU without calibrating: the run's steps, every sample from the cache; 7 frames are the
    # family's 2k+1 (not 4k+1), and a count off its rule is one line
    with pytest.raises(SystemExit) as refused:
        _command(monkeypatch, capsys, plan.main, ["wanexp-plan", *_overrides(root, "data.num_frames=6")])
    assert refused.value.code == 2 and "data.num_frames=6: must be 2k+1" in capsys.readouterr().err
    report = root / "plan.json"
    _command(monkeypatch, capsys, plan.main, ["wanexp-plan", "--no-calibrate", "--json", str(report),
                                              *_overrides(root, "trainer.max_steps=2")])
    p = json.loads(report.read_text())
    assert p["data"]["samples"] == 6 and p["data"]["total_steps"] == 2 and p["problems"] == []
    assert p["data"]["buckets"]["7x32x32"]["clips"] == 4 and p["data"]["buckets"]["1x32x32"]["images"] == 2
    assert p["cache"]["used"] is True and p["cache"]["missing_latents"] == 0

    # 3. train from the cache to a checkpoint; the family's memory formula sizes block swap (2 layers, none needed)
    out = _command(monkeypatch, capsys, train, ["train.py", *_overrides(root, "trainer.max_steps=2",
                                                                        "model.blocks_to_swap=auto")])
    assert "training from the cache" in out and "model.blocks_to_swap=auto: 0 of 2 blocks swapped" in out
    step, first = _lora(run / "checkpoints" / "last.ckpt")
    modules = {k.split(".lora_")[0].removeprefix("transformers.dense.") for k in first}
    assert step == 2 and modules == {f"layers.{i}.{m}" for i in (0, 1) for m in
                                     ("mix.query", "mix.key", "mix.value", "mix.proj", "mlp.fc_in", "mlp.fc_out")}

    # 4. resume to a later step: the history goes on from step 2; at the end a validation video through the
    # family's pipeline around the run's DiT (its prompt is not in the cache: the family encodes it)
    validation = ["callbacks.validation.every_n_steps=4", "callbacks.validation.steps=2",
                  "callbacks.validation.prompts=[a red ball]", "callbacks.validation.at_start=false",
                  "callbacks.validation.first_frame=false"]
    out = _command(monkeypatch, capsys, train, ["train.py", *_overrides(root, "trainer.max_steps=4", "resume=last",
                                                                        "model.blocks_to_swap=auto", *validation)])
    step, last = _lora(run / "checkpoints" / "last.ckpt")
    history = [json.loads(x)["step"] for x in (run / "status.jsonl").read_text().splitlines()]
    assert step == 4 and history == [1, 2, 3, 4]
    assert all(not torch.equal(first[k], last[k]) for k in first if ".lora_B." in k)  # steps 3-4 trained on
    assert "validation: encoding 2 prompt(s) with the text encoder from model.path" in out  # and the negative
    assert load_clip(run / "validation" / "step_000004" / "p0_s0.mp4", 7, 32, 32).shape == (3, 7, 32, 32)

    # 5. the LoRA files: ComfyUI's keys are the family's original names; the diffusers file loads back as trained
    final = run / "lora" / "final"
    comfy = load_file(final / "toy_lora_comfyui.safetensors")
    originals = {k.removeprefix("diffusion_model.").rsplit(".", 2)[0] if not k.endswith(".alpha")
                 else k.removeprefix("diffusion_model.").removesuffix(".alpha") for k in comfy}
    assert originals == {f"layers.{i}.{m}" for i in (0, 1) for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo",
                                                                      "w1", "w2")}
    from toyfamily.nets import ToyNet

    net = ToyNet.from_pretrained(root / "models" / "toy", subfolder="transformer")
    net.load_lora_adapter(str(final), weight_name="toy_lora_diffusers.safetensors", prefix="transformer",
                          adapter_name="back")  # its header's lora_adapter_metadata: the run's rank and alpha
    loaded = {k: v for k, v in net.state_dict().items() if ".lora_" in k}
    assert len(loaded) == len(last) == 24
    for key, value in loaded.items():
        assert torch.equal(value, last["transformers.dense." + key.replace(".back.", ".default.")]), key
    assert net.peft_config["back"].lora_alpha == 2 and net.peft_config["back"].r == 4

    # 6. a video from the run: the family's sampler with the run's LoRA on at every step
    res = sample.main(["--run", str(run), "--prompt", "a red ball rolls", "--steps", "3", "--guidance", "2",
                       "--device", "cpu"])
    (entry,) = res["samples"]
    assert res["loras"] == [str(final / "toy_lora_diffusers.safetensors")] and len(entry["timesteps"]) == 3
    assert entry["experts"] == [["dense", True]] * 3
    assert load_clip(entry["file"], 7, 32, 32).shape == (3, 7, 32, 32)

