"""A model family shaped unlike Wan2.2 fits in one package and one model YAML, both written by this test into
tmp_path (docs/extending.md, "Adding a model family", is what it follows): its own DiT (layers ``layers.N.mix.query``
... ``layers.N.mlp.fc_out``, a block list not named ``blocks``), its own VAE (frames 2k+1), a T5 text encoder, an
extra conditioning encoder of its own (a 1-D signal per clip, a ``signal`` metadata column of .npy files, encoded per
latent frame), one expert. It goes through what a user runs: the cache (which stores the signal's features), the
plan, training from the cache with a checkpoint, the resume, the exported files (under the family's names) and
sampling, without a file of the repository changed."""
from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from safetensors import safe_open

from tests.conftest import compose_cfg

FAMILY = """'''A toy family shaped unlike Wan2.2: a DiT of its own whose layers are ``layers.N.mix.{query,key,value,proj}`` and
``layers.N.mlp.{fc_in,fc_out}``, a VAE of its own (8x spatial, 2x temporal: frames 2k+1), a T5 text encoder, and a
1-D signal (each clip's ``signal`` column, a .npy file) encoded per latent frame by a signal encoder of its own,
which the cache stores and the DiT adds to its tokens. One expert.'''
import json
from contextlib import contextmanager

import numpy as np
import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import nn
from transformers import T5Config, T5EncoderModel

from wanexp.adapters.naming import AdapterNaming
from wanexp.models.encoders import Encoders
from wanexp.models.family import ModelSpec
from wanexp.models.pipeline import Pipeline

SIGNAL_PER_FRAME = 4  # signal samples per video frame the loader resamples each file to


class Mix(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, ctx):
        b, n, d = x.shape
        kv = torch.cat([x, ctx], dim=1)
        q, k, v = (t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)
                   for t in (self.query(x), self.key(kv), self.value(kv)))
        out = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc_out(nn.functional.gelu(self.fc_in(x)))


class Layer(nn.Module):
    def __init__(self, dim, heads, mlp_dim):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mix, self.mlp = Mix(dim, heads), MLP(dim, mlp_dim)

    def forward(self, x, ctx):
        x = x + self.mix(self.norm1(x), ctx)
        return x + self.mlp(self.norm2(x))


class ToyDiT(ModelMixin, ConfigMixin, PeftAdapterMixin):
    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, in_channels=4, num_layers=2, dim=32, heads=2, mlp_dim=64, text_dim=32, signal_dim=8,
                 patch=(1, 2, 2)):
        super().__init__()
        self.embed = nn.Conv3d(in_channels, dim, kernel_size=patch, stride=patch)
        self.time, self.text_proj, self.signal_proj = nn.Linear(1, dim), nn.Linear(text_dim, dim), nn.Linear(
            signal_dim, dim)
        self.layers = nn.ModuleList(Layer(dim, heads, mlp_dim) for _ in range(num_layers))
        self.out = nn.Linear(dim, in_channels * patch[0] * patch[1] * patch[2])

    def forward(self, hidden_states, timestep, encoder_hidden_states, signal, return_dict=True):
        b, c, f, h, w = hidden_states.shape
        pt, ph, pw = self.config.patch
        x = self.embed(hidden_states)  # (B, D, F', H', W')
        x = x + self.signal_proj(signal).transpose(1, 2)[..., None, None].to(x.dtype)  # one feature per latent frame
        x = x.flatten(2).transpose(1, 2)
        x = x + self.time(timestep.float().view(b, 1, 1) / 1000.0).to(x.dtype)
        ctx = self.text_proj(encoder_hidden_states)
        for layer in self.layers:
            x = layer(x, ctx)
        out = self.out(x).view(b, f // pt, h // ph, w // pw, c, pt, ph, pw)
        return (out.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, c, f, h, w),)


class ToyVAE(ModelMixin, ConfigMixin):
    '''Pixels (B, 3, F, H, W) -> latents (B, C, (F-1)/2+1, H/4, W/4): every other frame, 4x4 patches.'''

    @register_to_config
    def __init__(self, latent_channels=4):
        super().__init__()
        self.down = nn.Conv3d(3, latent_channels, kernel_size=(1, 4, 4), stride=(1, 4, 4))
        self.up = nn.ConvTranspose3d(latent_channels, 3, kernel_size=(1, 4, 4), stride=(1, 4, 4))

    def encode(self, pixels):
        return self.down(pixels[:, :, ::2])

    def decode(self, z):
        return torch.tanh(self.up(z)).repeat_interleave(2, dim=2)[:, :, :-1]


class SignalEncoder(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, per_frame=SIGNAL_PER_FRAME, dim=8):
        super().__init__()
        self.proj = nn.Linear(per_frame, dim)

    def forward(self, signal):  # (B, F * per_frame) -> (B, latent frames, dim)
        b = signal.shape[0]
        return self.proj(signal.view(b, -1, self.config.per_frame)[:, ::2])


class ToyEncoders(Encoders):
    def __init__(self, vae, text_encoder, tokenizer, signal_encoder, text_len):
        super().__init__()
        self.vae, self.text_encoder, self.signal_encoder = vae, text_encoder, signal_encoder
        self.tokenizer, self.text_len = tokenizer, text_len

    @torch.no_grad()
    def encode_media(self, batch):
        x0 = self.vae.encode(batch["pixels"].to(self.vae.dtype)).float()
        return x0, {"signal": self.signal_encoder(batch["signal"].float())}

    @torch.no_grad()
    def encode_prompts(self, prompts):
        toks = self.tokenizer(list(prompts), padding="max_length", max_length=self.text_len, truncation=True,
                              return_tensors="pt")
        ids, mask = toks.input_ids.to(self.vae.device), toks.attention_mask.to(self.vae.device)
        hidden = self.text_encoder(ids, attention_mask=mask).last_hidden_state
        return hidden * mask.unsqueeze(-1).to(hidden.dtype)

    @torch.no_grad()
    def decode(self, x0):
        return self.vae.decode(x0)


class ToyPipeline(Pipeline):
    '''Euler steps of the flow-matching ODE from noise, the signal all zeros (a prompt alone), decoded.'''

    def __init__(self, spec, transformers, encoders):
        self.spec, self.experts, self.encoders = spec, dict(transformers), encoders
        self.record = None

    @contextmanager
    def recorded_timesteps(self):
        self.record = []
        try:
            yield self.record
        finally:
            self.record = None

    @contextmanager
    def routed(self, routing):
        yield self

    def load_adapter(self, path, adapter_name, expert):
        from wanexp.adapters import load_adapter_file  # the one read/check/copy path, under the family's names

        load_adapter_file(self.experts[expert], path, self.spec.adapter_naming, adapter_name, what=f"--lora {path}")
        return "wanexp.adapters"

    def adapters_on(self, on):
        for t in self.experts.values():
            (t.enable_adapters if on else t.disable_adapters)()

    def use_student(self, timesteps, shift=0.0):
        self.timesteps = timesteps

    @torch.no_grad()
    def generate(self, prompt, seed, shape, steps, guidance, negative, device, record, image=None, embeds=None):
        record.clear()
        s, t = self.spec, next(iter(self.experts.values()))
        (ft, fh, fw) = s.vae_stride
        latent = (1, s.latent_channels, (shape["frames"] - 1) // ft + 1, shape["height"] // fh, shape["width"] // fw)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(latent, generator=g).to(device)
        text = embeds[0][None].to(device) if embeds is not None else self.encoders.encode_prompts([prompt]).to(device)
        signal = torch.zeros(1, latent[2], t.config.signal_dim, device=device)
        sigmas = torch.linspace(1.0, 0.0, steps + 1)
        for a, b in zip(sigmas[:-1], sigmas[1:]):
            timestep = torch.full((1,), 1000.0 * float(a), device=device)
            record.append(float(timestep[0]))
            v = s.transformer_call(t, x, timestep, text, {"signal": signal})
            x = x + (float(b) - float(a)) * v
        video = self.encoders.decode(x.to(self.encoders.vae.dtype))
        return x.float().cpu(), ((video[0].permute(1, 2, 3, 0).float() + 1) / 2).clamp(0, 1).cpu(), list(record)


class ToySpec(ModelSpec):
    layout = "toy"
    latent_channels = in_channels = 4
    vae_stride = (2, 4, 4)
    patch = (1, 2, 2)
    transformer_class = "toyfam.ToyDiT"
    vae_class = "toyfam.ToyVAE"
    text_encoder_class = "transformers.T5EncoderModel"
    encoder_folders = ("vae", "text_encoder", "tokenizer", "signal_encoder")
    sample_inputs = {"signal": "a .npy file of the clip's 1-D signal, any length (resampled to its frames)"}
    adapter_naming = AdapterNaming(
        blocks="layers", attention={"self": "mix"}, projections={"q": "query", "k": "key", "v": "value", "o": "proj"},
        feedforward={"ffn.0": "mlp.fc_in", "ffn.2": "mlp.fc_out"}, original_attention={"self": "attn"},
        formats="ComfyUI (diffusion_model.layers.N.attn.q.lora_down/lora_up), peft (transformer.layers.N.mix.query.lora_A)")

    def blocks(self, transformer):
        return transformer.layers

    def model_inputs(self, x_t, x0, sigma, cond):
        return x_t, 1000.0 * sigma.float(), None

    def transformer_call(self, transformer, hidden, timestep, text, cond):
        return transformer(hidden, timestep, text, cond["signal"].to(hidden.dtype), return_dict=False)[0]

    def load_sample_input(self, name, path, num_frames, fps):
        signal = np.load(path).astype("float32")
        at = np.linspace(0, len(signal) - 1, num_frames * SIGNAL_PER_FRAME)
        return torch.from_numpy(np.interp(at, np.arange(len(signal)), signal).astype("float32"))

    def load_encoders(self):
        from transformers import AutoTokenizer

        return ToyEncoders(self.load_vae(), self.load_text_encoder(), AutoTokenizer.from_pretrained(
            str(self.path / "tokenizer")), SignalEncoder.from_pretrained(str(self.path / "signal_encoder")),
            self.text_len)

    def step_flops(self, config, latent_shape, text_len, checkpointing):
        b, _, f, h, w = latent_shape
        tokens = f * (h // 2) * (w // 2)
        d, m = config["dim"], config["mlp_dim"]
        forward = config["num_layers"] * 2 * tokens * (4 * d * d + 2 * d * m)
        return b * forward * (4 if checkpointing else 3)

    def load_scheduler(self):
        return None

    def make_pipeline(self, transformers, vae, scheduler, image):
        return ToyPipeline(self, transformers, self.load_encoders().to(next(iter(transformers.values())).device))

    def load_pipeline(self, device, dtype, image):
        return ToyPipeline(self, {"dense": self.load_transformer("dense").to(device)}, self.load_encoders().to(device))

    def encode_prompts(self, prompts, device, encoders=None):
        encoders = encoders if encoders is not None else self.load_encoders().to(device)
        return {p: e.cpu() for p, e in zip(prompts, encoders.encode_prompts(list(prompts)))}

    def write_random_model(self, folder, device="cpu", dtype=torch.float32):
        from wanexp.models.wan22.build import build_tokenizer  # a byte-level tokenizer, no download

        torch.manual_seed(int(self.build["seed"]))
        te = T5EncoderModel(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=260,
                                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
        comps = {"transformer": ToyDiT(**self.build["transformer"]), "vae": ToyVAE(latent_channels=4),
                 "text_encoder": te, "signal_encoder": SignalEncoder()}
        for name, module in comps.items():
            module.to(dtype).save_pretrained(folder / name)
        build_tokenizer(folder / "tokenizer", self.text_len)
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "ToyPipeline"}))
"""

MODEL_YAML = """
defaults:
  - /schema/model@_here_
  - _self_
_target_: toyfam.ToySpec
name: toy
path: ${paths.tiny_model_dir}/${model.name}
dtype: fp32
vae_dtype: fp32
text_encoder_dtype: fp32
experts: [dense]
boundary_ratio: null
shift: 3.0
hw_multiple: 16
frame_rule: [2, 1]
text_len: 16
fps: 24
gradient_checkpointing: false
attention_backend: null
first_frame_cond: 0.0
build:
  seed: 0
  transformer: {num_layers: 2, dim: 32, heads: 2, mlp_dim: 64, text_dim: 32, signal_dim: 8}
fast_modulation: false
compile: false
memory_budget_gib: null
"""
FRAMES, SIZE = 5, 32


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The family's package on sys.path, its YAML in a config folder of its own, and a data folder of clips, each
    with its signal; returns the overrides of a run on them."""
    import sys

    from wanexp.data.synthetic import make_demo_dataset

    root = tmp_path_factory.mktemp("toy_family")
    (root / "pkg" / "toyfam").mkdir(parents=True)
    (root / "pkg" / "toyfam" / "__init__.py").write_text(textwrap.dedent(FAMILY))
    (root / "conf" / "model").mkdir(parents=True)
    (root / "conf" / "model" / "toy.yaml").write_text(MODEL_YAML)
    sys.path.insert(0, str(root / "pkg"))
    meta = make_demo_dataset(root / "data", num_videos=4, num_images=0, num_frames=9, height=SIZE, width=SIZE)
    rows = [line.split(",", 1) for line in meta.read_text().splitlines()[1:]]
    g = np.random.default_rng(0)
    for i, (video, _) in enumerate(rows):
        np.save(root / "data" / f"signal{i}.npy", g.standard_normal(50 + 10 * i).astype("float32"))
    (root / "data" / "meta.csv").write_text("video,prompt,signal\n" + "".join(
        f"{video},{prompt},signal{i}.npy\n" for i, (video, prompt) in enumerate(rows)))
    yield root, [
        f"hydra.searchpath=[file://{root / 'conf'}]", "experiment=demo", "model=toy",
        f"paths.tiny_model_dir={root}/models", f"data.metadata={root}/data/meta.csv", "data.generate=null",
        f"data.num_frames={FRAMES}", f"data.height={SIZE}", f"data.width={SIZE}", "data.batch_size=2",
        "data.val_fraction=0", f"paths.cache_dir={root}/cache", "adapter.attention=[self]", "adapter.rank=4",
        "adapter.alpha=2", "optim.lr=1e-2", "optim.warmup_steps=0", "optim.scheduler=constant",
        "callbacks.validation.every_n_steps=0",
        "callbacks.checkpoint.every_n_train_steps=2", "trainer.log_every_n_steps=1", "callbacks.progress=null"]
    sys.path.remove(str(root / "pkg"))


@pytest.fixture(scope="module")
def cached(toy):
    from wanexp.cli.cache import build_cache

    root, overrides = toy
    stats = build_cache(compose_cfg([*overrides, f"paths.output_dir={root}/c"]))
    return stats


@pytest.fixture(scope="module")
def trained(toy, cached):
    """Two steps from the cache with a checkpoint, then the resume of that run to step 4."""
    from wanexp.train import run

    root, overrides = toy
    out = root / "run"
    first = run(compose_cfg([*overrides, f"paths.output_dir={out}", "trainer.max_steps=2"]))
    resumed = run(compose_cfg([*overrides, f"paths.output_dir={out}", "trainer.max_steps=4", "resume=last"]))
    return first, resumed, out


def test_the_cache_stores_the_familys_own_conditioning(toy, cached):
    from wanexp.data.cache import CacheIndex

    root, _ = toy
    index = CacheIndex(next((root / "cache").rglob("index-r*.jsonl")).parent)  # the data set's cache folder
    latents = [index.load(e["key"]) for e in index.entries.values() if e["kind"] == "latent"]
    assert cached["latents"] == len(latents) == 4
    for entry in latents:  # the VAE's 2x temporal, 4x spatial latents and the signal per latent frame
        assert sorted(entry) == ["latents", "signal"]
        assert tuple(entry["latents"].shape) == (4, 3, SIZE // 4, SIZE // 4) and tuple(entry["signal"].shape) == (3, 8)


def test_the_plan_of_a_run_on_the_family(toy, cached):
    from wanexp.cli import plan

    root, overrides = toy
    p = plan.make_plan(compose_cfg([*overrides, f"paths.output_dir={root}/p"]),
                       {**plan.split_options([])[0], "calibrate": False})
    assert p["data"]["samples"] == 4 and not p["problems"], p
    c = p["cache"]  # the cache's keys are the run's, the signal's file among them: every entry found
    assert (c["used"], c["latents"], c["missing_latents"], c["missing_texts"]) == (True, 4, 0, 0), c


def test_train_resume_and_export_under_the_familys_names(toy, trained):
    first, resumed, out = trained
    assert type(first["module"].spec).__name__ == "ToySpec" and first["global_step"] == 2
    assert resumed["global_step"] == 4
    module = resumed["module"]
    assert type(module.transformers["dense"]).__name__ == "ToyDiT" and module.encoders is None  # from the cache
    files = {f.name: f for f in (out / "lora" / "final").glob("*.safetensors")}
    assert set(files) == {"toy_lora_comfyui.safetensors", "toy_lora_diffusers.safetensors"}
    with safe_open(str(files["toy_lora_diffusers.safetensors"]), "pt") as f:
        peft_keys = set(f.keys())
    with safe_open(str(files["toy_lora_comfyui.safetensors"]), "pt") as f:
        comfy_keys = set(f.keys())
    modules = {f"layers.{i}.{m}" for i in range(2) for m in ("mix.query", "mix.key", "mix.value", "mix.proj",
                                                              "mlp.fc_in", "mlp.fc_out")}
    assert {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in peft_keys} == modules
    original = {f"diffusion_model.layers.{i}.{m}" for i in range(2) for m in ("attn.q", "attn.k", "attn.v", "attn.o",
                                                                              "ffn.0", "ffn.2")}
    assert {k.rsplit(".", 2)[0] if ".lora_" in k else k.rsplit(".", 1)[0] for k in comfy_keys} == original


def test_sampling_the_trained_run(toy, trained, tmp_path):
    from wanexp.cli import sample

    _, _, out = trained
    res = sample.main(["--run", str(out), "--prompt", "a red ball", "--steps", "3", "--device", "cpu",
                       "--out", str(tmp_path / "samples")])
    (entry,) = res["samples"]
    assert (tmp_path / "samples" / "p0_s0.mp4").is_file() and len(entry["timesteps"]) == 3
    assert entry["experts"] == [["dense", True]] * 3  # the trained adapter on at every step
    assert json.loads((tmp_path / "samples" / "metrics.json").read_text())["loras"][0].endswith(
        "toy_lora_diffusers.safetensors")
