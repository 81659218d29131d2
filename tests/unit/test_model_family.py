"""A new model family is a package and a model YAML, nothing else: this test writes both into tmp_path (a tiny DiT
of its own class, its ModelSpec subclass, a conf/model YAML found through hydra.searchpath), trains it a few steps on
the CPU in-process and exports its LoRA, without touching any file of the repository (docs/extending.md)."""
from __future__ import annotations

import textwrap

import pytest
from safetensors.torch import load_file

from tests.integration.conftest import tiny_run

FAMILY = '''
"""A toy family: a DiT of its own (diffusers' attention names, so the LoRA targets and exports apply), the
Wan2.1 VAE and UMT5 as encoders, a scalar timestep."""
import json

import torch
from diffusers import AutoencoderKLWan
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import nn
from transformers import UMT5Config, UMT5EncoderModel

from wanexp.models.family import ModelSpec


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])

    def forward(self, x, ctx):
        b, n, d = x.shape
        q, k, v = (t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)
                   for t in (self.to_q(x), self.to_k(ctx), self.to_v(ctx)))
        out = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        return self.to_out[0](out)


class GeluProj(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x):
        return nn.functional.gelu(self.proj(x))


class Block(nn.Module):
    def __init__(self, dim, heads, ffn_dim):
        super().__init__()
        self.attn1, self.attn2 = Attention(dim, heads), Attention(dim, heads)
        self.ffn = nn.Module()
        self.ffn.net = nn.Sequential(GeluProj(dim, ffn_dim), nn.Identity(), nn.Linear(ffn_dim, dim))

    def forward(self, x, ctx):
        x = x + self.attn1(x, x)
        x = x + self.attn2(x, ctx)
        return x + self.ffn.net(x)


class ToyDiT(ModelMixin, ConfigMixin, PeftAdapterMixin):
    @register_to_config
    def __init__(self, in_channels=16, out_channels=16, num_layers=2, num_attention_heads=2, attention_head_dim=8,
                 ffn_dim=32, text_dim=32, patch_size=(1, 2, 2)):
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        self.patch_embedding = nn.Conv3d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.time_embedding = nn.Linear(1, dim)
        self.text_embedding = nn.Linear(text_dim, dim)
        self.blocks = nn.ModuleList(Block(dim, num_attention_heads, ffn_dim) for _ in range(num_layers))
        self.proj_out = nn.Linear(dim, out_channels * patch_size[0] * patch_size[1] * patch_size[2])

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=True):
        b, _, f, h, w = hidden_states.shape
        pt, ph, pw = self.config.patch_size
        x = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2)
        x = x + self.time_embedding(timestep.float().view(b, 1, 1) / 1000.0).to(x.dtype)
        ctx = self.text_embedding(encoder_hidden_states)
        for block in self.blocks:
            x = block(x, ctx)
        out = self.proj_out(x).view(b, f // pt, h // ph, w // pw, -1, pt, ph, pw)
        out = out.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, -1, f, h, w)
        return (out,)


class ToySpec(ModelSpec):
    layout = "toy"
    transformer_class = "toyfamily.ToyDiT"
    vae_class = "diffusers.AutoencoderKLWan"
    text_encoder_class = "transformers.UMT5EncoderModel"

    def model_inputs(self, x_t, x0, sigma, cond):
        return x_t, 1000.0 * sigma.float(), None

    def load_encoders(self):
        from wanexp.models.wan22.encoders import WanEncoders  # the Wan VAE and UMT5 as they are

        return WanEncoders(self.load_vae(), self.load_text_encoder(), self.load_tokenizer(), self.text_len)

    def write_random_model(self, folder, device="cpu", dtype=torch.float32):
        from wanexp.models.wan22.build import build_tokenizer  # a byte-level tokenizer with T5's special tokens

        b = self.build
        torch.manual_seed(int(b["seed"]))
        te = UMT5EncoderModel(UMT5Config(**b["text_encoder"], pad_token_id=0, eos_token_id=1,
                                         decoder_start_token_id=0))
        comps = {"transformer": ToyDiT(**b["transformer"], text_dim=b["text_encoder"]["d_model"]),
                 "vae": AutoencoderKLWan(z_dim=16, **b["vae"]), "text_encoder": te}
        for name, module in comps.items():
            module.to(dtype).save_pretrained(folder / name)
        build_tokenizer(folder / "tokenizer", self.text_len)
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "ToyPipeline"}))
'''

MODEL_YAML = '''
defaults:
  - /schema/model@_here_
  - _self_
_target_: toyfamily.ToySpec
name: toy
path: ${paths.tiny_model_dir}/${model.name}
dtype: fp32
vae_dtype: fp32
text_encoder_dtype: fp32
experts: [dense]
boundary_ratio: null
shift: 5.0
hw_multiple: 16
text_len: 16
fps: 16
gradient_checkpointing: false
attention_backend: null
first_frame_cond: 0.0
build:
  seed: 0
  transformer: {num_attention_heads: 2, attention_head_dim: 8, ffn_dim: 32, num_layers: 2}
  vae: {base_dim: 8, num_res_blocks: 1}
  text_encoder: {d_model: 32, d_ff: 64, num_layers: 1, num_heads: 2, d_kv: 16, vocab_size: 260}
fast_modulation: false
compile: false
memory_budget_gib: null
'''


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """The family's package on sys.path and its YAML in a config folder of its own; returns that folder."""
    (tmp_path / "pkg" / "toyfamily").mkdir(parents=True)
    (tmp_path / "pkg" / "toyfamily" / "__init__.py").write_text(textwrap.dedent(FAMILY))
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "toy.yaml").write_text(MODEL_YAML)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    return tmp_path / "conf"


def test_a_new_family_trains_and_exports_its_lora(toy_family, shared_dir, tmp_path):
    r = tiny_run(shared_dir, tmp_path / "run", [f"hydra.searchpath=[file://{toy_family}]", "model=toy",
                                                f"paths.tiny_model_dir={tmp_path}/models", "trainer.max_steps=2",
                                                "data.batch_size=1",
                                                "data.num_frames=5", "data.height=32", "data.width=32"])
    module = r["module"]
    assert type(module.spec).__name__ == "ToySpec" and type(module.transformers["dense"]).__name__ == "ToyDiT"
    assert module.global_step == 2
    files = sorted((tmp_path / "run" / "lora" / "final").glob("*.safetensors"))
    assert len(files) >= 2 and all(f.name.startswith("toy_lora") for f in files)  # ComfyUI + diffusers files
    exported = load_file(next(f for f in files if f.name == "toy_lora_diffusers.safetensors"))
    ups = [v for k, v in exported.items() if "lora_B" in k]
    assert {"attn1.to_q", "attn2.to_v", "ffn.net.2"} <= {k.split(".blocks.")[1].split(".", 1)[1].rsplit(".lora", 1)[0]
                                                         for k in exported}
    assert ups and all(v.abs().max() > 0 for v in ups)  # trained: every B moved from its zero init
