"""Model specifications: everything that differs between Wan2.2 layouts lives here.

A spec knows its local folder layout, which components a run needs, how to load them, how a sample's noise level
picks an expert, and how to build the DiT input (conditioning, timestep shape, loss mask). The LightningModule only
calls these methods and never branches on the model name.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from wanexp.config.schema import DTYPES
from wanexp.errors import ConfigError
from wanexp.models.wan22 import conditioning, fast

# Which diffusers subfolder holds each expert.
EXPERT_FOLDERS = {"dense": "transformer", "high": "transformer", "low": "transformer_2"}


class WanSpec:
    """Common behaviour; subclasses set the layout constants and the conditioning."""

    layout: str = ""
    latent_channels: int = 16
    in_channels: int = 16
    vae_stride: tuple[int, int, int] = (4, 8, 8)
    patch: tuple[int, int, int] = (1, 2, 2)
    pipeline_class: str = "WanPipeline"
    needs_image_latent: bool = False
    # Building tiny random models (models/wan22/build.py): the VAE's layout and extra pipeline arguments.
    vae_layout: dict = {"z_dim": 16}
    pipeline_extras: dict = {}

    def __init__(
        self,
        *,
        name: str,
        path: str,
        dtype: str,
        vae_dtype: str,
        text_encoder_dtype: str,
        experts: list[str],
        boundary_ratio: float | None,
        shift: float,
        hw_multiple: int,
        text_len: int,
        gradient_checkpointing: bool,
        attention_backend: str | None,
        first_frame_cond: float,
        build: dict | None,
        fast_modulation: bool,
        compile: bool,
        memory_budget_gib: float | None,
        fp8: bool = False,
        compile_checkpoint: bool = True,
    ) -> None:
        """The arguments are the ``model`` group (conf/model/*.yaml, typed by config.schema.ModelConfig)."""
        self.name = name
        self.path = Path(path)
        self.dtype, self.vae_dtype, self.text_encoder_dtype = (
            getattr(torch, DTYPES[d]) for d in (dtype, vae_dtype, text_encoder_dtype))
        self.experts = list(experts)
        self.boundary_ratio = boundary_ratio
        self.shift = shift
        self.hw_multiple = hw_multiple
        self.text_len = text_len
        self.gradient_checkpointing = gradient_checkpointing
        self.attention_backend = attention_backend
        self.first_frame_cond = first_frame_cond
        self.build = build
        self.fast_modulation = fast_modulation  # time embedding + block modulation per latent frame (fast.py)
        self.compile = compile  # torch.compile each transformer block (regional compilation)
        self.compile_checkpoint = compile_checkpoint  # the checkpoint inside the compiled graph (fast.py)
        self.memory_budget_gib = memory_budget_gib  # checkpoint only the blocks this budget needs (fast.py)
        self.fp8 = fp8  # frozen block linears in FP8 after the adapters are added (models/fp8.py)
        if memory_budget_gib is not None and not (gradient_checkpointing and fast_modulation):
            raise ConfigError(f"model.memory_budget_gib={memory_budget_gib:g} picks which blocks to checkpoint: it "
                              "needs model.gradient_checkpointing=true and model.fast_modulation=true")
        if attention_backend is not None:
            check_attention_backend(attention_backend)
        if first_frame_cond and not self.draws_first_frame:
            raise ConfigError(f"model.first_frame_cond={first_frame_cond}: model={name} has no optional first-frame "
                              "conditioning (only the TI2V-5B layout has); set it to 0")

    # ---- which experts a run trains -------------------------------------------------------------------------
    def trained_experts(self, boundary: str) -> list[str]:
        if self.experts == ["dense"]:
            return ["dense"]
        return {"full": ["high", "low"], "high": ["high"], "low": ["low"]}[boundary]

    # ---- the local folder -----------------------------------------------------------------------------------
    def required_folders(self, experts: list[str]) -> list[str]:
        return [EXPERT_FOLDERS[e] for e in experts] + ["vae", "text_encoder", "tokenizer"]

    def load_bytes(self, experts: list[str], encoders: bool) -> int:
        """Bytes of the weight files one rank reads for these experts (and the VAE and text encoder)."""
        folders = [EXPERT_FOLDERS[e] for e in experts] + (["vae", "text_encoder"] if encoders else [])
        return sum(f.stat().st_size for sub in folders for f in (self.path / sub).glob("*")
                   if f.suffix in (".safetensors", ".bin", ".pth") and f.is_file())

    def check_folder(self, experts: list[str]) -> None:
        """Raise ConfigError naming the first missing piece of the local diffusers-format folder."""
        p = self.path
        hint = f"point model.path at a local diffusers-format Wan2.2 {self.name} folder"
        if not p.is_dir():
            raise ConfigError(f"model.path={p}: folder not found; {hint}")
        if not (p / "model_index.json").is_file():
            from wanexp.models.wan22.original import convert_command, detect_layout, is_original_layout

            if is_original_layout(p):
                layout = detect_layout(p) or self.layout
                raise ConfigError(f"model.path={p}: this is the original Wan-AI release layout, not diffusers-format; "
                                  f"convert it once with `{convert_command(p, layout)}`, "
                                  "then point model.path at the converted folder")
            raise ConfigError(f"model.path={p}: no model_index.json, so this is not a diffusers-format folder; {hint}")
        for sub in self.required_folders(experts):
            d = p / sub
            marker = "tokenizer_config.json" if sub == "tokenizer" else "config.json"
            if not (d / marker).is_file():
                raise ConfigError(
                    f"model.path={p}: component '{sub}/' is missing or has no {marker} "
                    f"(model={self.name} with experts {experts} needs {', '.join(self.required_folders(experts))})"
                )
        if "transformer" in [EXPERT_FOLDERS[e] for e in experts]:
            cfg = json.loads((p / "transformer" / "config.json").read_text())
            if cfg.get("in_channels") != self.in_channels:
                raise ConfigError(
                    f"model.path={p}: transformer has in_channels={cfg.get('in_channels')} but model={self.name} "
                    f"expects {self.in_channels}; pick the model group that matches this folder"
                )

    def transformer_config(self, expert: str) -> dict:
        """The diffusers config.json of an expert's transformer (read from the folder; nothing loads)."""
        return json.loads((self.path / EXPERT_FOLDERS[expert] / "config.json").read_text())

    # ---- loading --------------------------------------------------------------------------------------------
    def load_transformer(self, expert: str):
        from diffusers import WanTransformer3DModel

        model = WanTransformer3DModel.from_pretrained(self.path, subfolder=EXPERT_FOLDERS[expert], dtype=self.dtype)
        model.requires_grad_(False)
        if self.attention_backend:
            model.set_attention_backend(self.attention_backend)
        if self.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        if self.fast_modulation:
            fast.use_frame_modulation(model)
            fast.set_memory_budget(model, self.memory_budget_gib)
        if self.compile:  # lazy: compiles at the first call, after the adapters are added (and FSDP2 has sharded)
            fast.compile_blocks(model, checkpoint=self.compile_checkpoint)
        return model

    def load_vae(self):
        from diffusers import AutoencoderKLWan

        vae = AutoencoderKLWan.from_pretrained(self.path, subfolder="vae", dtype=self.vae_dtype)
        return vae.requires_grad_(False).eval()

    def load_text_encoder(self):
        from transformers import UMT5EncoderModel

        te = UMT5EncoderModel.from_pretrained(os.fspath(self.path / "text_encoder"), dtype=self.text_encoder_dtype)
        return te.requires_grad_(False).eval()

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.fspath(self.path / "tokenizer"))

    def encoder_info(self) -> dict:
        """What identifies this model's encoders for cache keys (plain data: folders, dtypes, text length)."""
        return {"vae": str(self.path / "vae"), "vae_dtype": str(self.vae_dtype), "layout": self.layout,
                "text_encoder": str(self.path / "text_encoder"), "text_dtype": str(self.text_encoder_dtype),
                "tokenizer": str(self.path / "tokenizer"), "text_len": self.text_len,
                "image_latent": self.needs_image_latent, "vae_stride": list(self.vae_stride), "patch": list(self.patch)}

    def load_encoders(self):
        """The frozen VAE + UMT5 text encoder + tokenizer as one module (see wanexp.models.encode.Encoders)."""
        from wanexp.models.encode import Encoders

        return Encoders(self.load_vae(), self.load_text_encoder(), self.load_tokenizer(), self.text_len,
                        self.needs_image_latent)

    # ---- the DiT input ----------------------------------------------------------------------------------------
    draws_first_frame: bool = False  # TI2V: a fraction of samples keep a clean latent frame 0 (image-to-video)

    def sample_condition(self, cond: dict, batch_size: int, generator: torch.Generator | None = None) -> dict:
        """Random per-sample conditioning choices of a training step (none unless the layout has some)."""
        return cond

    def model_inputs(self, x_t, x0, sigma, cond: dict):
        """Return (hidden_states, timestep, loss_mask or None) for the DiT."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, path={str(self.path)!r})"


class TI2VSpec(WanSpec):
    """TI2V-5B: dense, 48-channel latents from the Wan2.2 VAE, per-token timesteps, optional image frame 0."""

    layout = "ti2v"
    latent_channels = 48
    in_channels = 48
    vae_stride = (4, 16, 16)
    vae_layout = {"z_dim": 48, "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
                  "scale_factor_spatial": 16}
    pipeline_extras = {"expand_timesteps": True}
    draws_first_frame = True

    def sample_condition(self, cond, batch_size, generator=None):
        """Train image-to-video on ``first_frame_cond`` of the multi-frame samples (clean latent frame 0)."""
        draw = torch.rand(batch_size, generator=generator)
        return dict(cond, first_frame=draw < float(self.first_frame_cond))

    def model_inputs(self, x_t, x0, sigma, cond):
        first = cond.get("first_frame")
        if first is None or x0.shape[2] == 1:  # a one-frame sample (image) has no frame after the first
            first = torch.zeros(x0.shape[0], dtype=torch.bool, device=x0.device)
        hidden, timestep, mask = conditioning.ti2v_inputs(x_t, x0, sigma, first, self.patch)
        return hidden, timestep, mask


class T2VA14BSpec(WanSpec):
    """T2V-A14B: high/low-noise experts, Wan2.1 VAE (16 channels, 8x spatial), scalar timestep."""

    layout = "t2v_a14b"

    def model_inputs(self, x_t, x0, sigma, cond):
        return conditioning.t2v_inputs(x_t, sigma)


class I2VA14BSpec(WanSpec):
    """I2V-A14B: high/low-noise experts; input = noisy 16 + mask 4 + image condition 16 channels."""

    layout = "i2v_a14b"
    in_channels = 36
    pipeline_class = "WanImageToVideoPipeline"
    needs_image_latent = True

    def model_inputs(self, x_t, x0, sigma, cond):
        return conditioning.i2v_inputs(x_t, sigma, cond["image_latent"], self.vae_stride[0])


def route(sigma: torch.Tensor, loaded: list[str], boundary_ratio: float | None) -> torch.Tensor:
    """Each sample's expert as an index into ``loaded``: HIGH when shifted sigma >= boundary_ratio.

    A run that loaded one expert (dense, or one boundary of A14B) sends every sample to it.
    """
    if len(loaded) == 1:
        return torch.zeros(sigma.shape[0], dtype=torch.long, device=sigma.device)
    high = sigma >= boundary_ratio
    return torch.where(high, loaded.index("high"), loaded.index("low")).long()


def check_attention_backend(name: str) -> None:
    """model.attention_backend must be one of diffusers' installed backends (no *_hub kernel downloads)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    names = [a.value for a in AttentionBackendName]
    if name not in names:
        raise ConfigError(f"model.attention_backend={name}: allowed values are null (default), "
                          + ", ".join(n for n in names if not n.endswith("_hub")))
    if name.endswith("_hub"):
        raise ConfigError(f"model.attention_backend={name}: *_hub backends download kernels from a hub; use the "
                          "installed equivalent (e.g. flash, _flash_3, native)")
