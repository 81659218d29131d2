"""Wan2.2's model specs: the TI2V-5B and A14B layouts on diffusers' Wan DiT, the Wan VAE and UMT5.

The family-independent part (config arguments, folder checks, loading by class name, routing) is
wanexp.models.family.ModelSpec; the layout constants come from the table in layouts.py. Here: the Wan-specific
loading (faster forwards, regional compilation), the original-release hint, the tiny build and each layout's
conditioning (conditioning.py).
"""
from __future__ import annotations

import torch

from wanexp.models.family import ModelSpec
from wanexp.models.wan22 import conditioning, fast
from wanexp.models.wan22.adapter_naming import WAN_NAMING
from wanexp.models.wan22.layouts import EXPERT_FOLDERS, LAYOUTS


class WanSpec(ModelSpec):
    """Wan2.2's common behaviour; each subclass names its layout in LAYOUTS and sets its conditioning."""

    transformer_class = "diffusers.WanTransformer3DModel"
    sequence_parallel = True  # wanexp's forward (models/wan22/fast.py) splits the tokens
    compiles_blocks = True  # model.compile: each block compiled (prepare_transformer)
    pads_sequence = True  # wanexp's forward (models/wan22/fast.py) pads the tokens under sequence parallel
    selective_checkpointing_supported = True  # fast.KeepAttentionAndUpProjection
    vae_class = "diffusers.AutoencoderKLWan"
    text_encoder_class = "transformers.UMT5EncoderModel"
    # the diffusers pipeline of the folder, its extra arguments (from LAYOUTS), and the pipeline of an image-to-video
    # sample (I2V-A14B, and TI2V-5B given a first frame)
    pipeline_class = "WanPipeline"
    pipeline_extras: dict = {}
    image_pipeline_class = "WanImageToVideoPipeline"
    vae_layout: dict = {"z_dim": 16}  # the VAE's architecture (tiny builds, conversion): from LAYOUTS

    def __init_subclass__(cls, **kwargs):
        """A layout's constants come from LAYOUTS, the one table the conversion and the benchmark read too."""
        super().__init_subclass__(**kwargs)
        lay = LAYOUTS.get(cls.__dict__.get("layout", ""))
        if lay is not None:
            cls.latent_channels, cls.in_channels, cls.vae_stride = lay.latent_channels, lay.in_channels, lay.vae_stride
            cls.per_token_timestep = lay.per_token_timestep
            cls.pipeline_class, cls.pipeline_extras = lay.pipeline_class, dict(lay.pipeline_extras)
            cls.vae_layout = dict(lay.vae_layout)

    # ---- components given one by one: single files (ComfyUI's, Wan-AI's) or component folders (single_file.py) ----
    component_files = True

    @property
    def single_files(self) -> bool:
        """Whether any component comes from its own path (model.path a DiT file or null, or a model.*_path set);
        otherwise everything loads from the model.path folder as ModelSpec loads it."""
        return (self.path is None or self.path.is_file()
                or any(v is not None for v in self.component_paths.values()))

    def source(self, component: str):
        """Where ``component`` (``transformer``, ``transformer_2``, ``vae``, ``text_encoder``, ``tokenizer``) loads
        from: its own path, else model.path (the DiT file is the ``transformer``; a folder holds each component's
        subfolder), else None."""
        from pathlib import Path

        given = self.component_paths.get(f"{component}_path")
        if given is not None:
            return Path(given)
        if self.path is None:
            return None
        if self.path.is_file():
            return self.path if component == "transformer" else None
        return self.path / component

    def check_folder(self, experts):
        if not self.single_files:
            return super().check_folder(experts)
        from wanexp.models.wan22 import single_file

        single_file.check(self, experts)

    def load_bytes(self, experts, encoders):
        """A component's folder counts its weight files' bytes; a single file the bytes its weights take once loaded
        in the component's dtype (an fp8 file holds half of them)."""
        if not self.single_files:
            return super().load_bytes(experts, encoders)
        from wanexp.models.family import weight_files
        from wanexp.models.wan22 import single_file

        dtypes = {"vae": self.vae_dtype, "text_encoder": self.text_encoder_dtype}
        total = 0
        for comp in dict.fromkeys([self.expert_folders[e] for e in experts]
                                  + (["vae", "text_encoder"] if encoders else [])):
            src = self.source(comp)
            if src is not None and src.is_file():
                total += single_file.plan(self, comp).file.numel * dtypes.get(comp, self.dtype).itemsize
            elif src is not None and src.is_dir():
                total += sum(f.stat().st_size for f in weight_files(src))
        return total

    def _source_or_refuse(self, component: str):
        from wanexp.models.wan22 import single_file

        src = self.source(component)
        if src is None:
            raise single_file.not_set(self, component)
        return src

    def transformer_config(self, expert):
        if not self.single_files:
            return super().transformer_config(expert)
        import json

        from wanexp.models.wan22 import single_file

        component = self.expert_folders[expert]
        src = self._source_or_refuse(component)
        if src.is_file():
            return dict(single_file.plan(self, component).config)
        return json.loads((src / "config.json").read_text())

    def read_transformer(self, expert):
        if not self.single_files:
            return super().read_transformer(expert)
        from wanexp.models.wan22 import single_file

        component = self.expert_folders[expert]
        src = self._source_or_refuse(component)
        if src.is_file():
            return single_file.load_transformer(single_file.plan(self, component), self.dtype)
        return self.transformer_type().from_pretrained(src, dtype=self.dtype)

    def load_vae(self):
        if not self.single_files:
            return super().load_vae()
        from wanexp.models.family import load_class
        from wanexp.models.wan22 import single_file

        src = self._source_or_refuse("vae")
        if src.is_file():
            vae = single_file.load_vae(single_file.plan(self, "vae"), self.vae_dtype)
        else:
            vae = load_class(self.vae_class).from_pretrained(src, dtype=self.vae_dtype)
        return vae.requires_grad_(False).eval()

    def load_text_encoder(self):
        if not self.single_files:
            return super().load_text_encoder()
        import os

        from wanexp.models.family import load_class
        from wanexp.models.wan22 import single_file

        src = self._source_or_refuse("text_encoder")
        if src.is_file():
            te = single_file.load_text_encoder(single_file.plan(self, "text_encoder"), self.text_encoder_dtype)
        else:
            te = load_class(self.text_encoder_class).from_pretrained(os.fspath(src), dtype=self.text_encoder_dtype)
        return te.requires_grad_(False).eval()

    def load_tokenizer(self):
        if not self.single_files:
            return super().load_tokenizer()
        import os

        from wanexp.models.family import load_class

        return load_class(self.tokenizer_class).from_pretrained(os.fspath(self._source_or_refuse("tokenizer")))

    def encoder_source(self, component):
        return self.source(component) if self.single_files else super().encoder_source(component)

    def encoder_info(self):
        """With a component given as a file, its identity (path, size, mtime) joins the dtype in the cache keys (a
        folder's contents are read by the cache's folder_identity)."""
        info = super().encoder_info()
        if not self.single_files:
            return info
        import dataclasses
        import json

        from wanexp.data.cache import file_identity

        def keyed(dtype, component):
            src = self.source(component)
            return json.dumps([str(dtype), file_identity(src)]) if src is not None and src.is_file() else str(dtype)

        return dataclasses.replace(info, vae_dtype=keyed(self.vae_dtype, "vae"),
                                   text_dtype=keyed(self.text_encoder_dtype, "text_encoder"))

    def not_diffusers_hint(self, path):
        """The original Wan-AI release layout: the command that converts it."""
        from wanexp.models.wan22.original import convert_command, detect_layout, is_original_layout

        if not is_original_layout(path):
            return None
        layout = detect_layout(path) or self.layout
        return (f"this is the original Wan-AI release layout, not diffusers-format; convert it once with "
                f"`{convert_command(path, layout)}`, then point model.path at the converted folder")

    def prepare_transformer(self, model):
        if self.fast_modulation:
            fast.use_frame_modulation(model)
            fast.set_memory_budget(model, self.memory_budget_gib)
            model._wanexp_offload_activations = self.offload_activations
            fast.set_selective_checkpointing(model, self.selective_checkpointing)
        if self.compile:  # lazy: compiles at the first call, after the adapters are added (and FSDP2 has sharded)
            fast.compile_blocks(model, checkpoint=self.compile_checkpoint, cuda_graphs=self.cuda_graphs)
        return model

    def compute_dtype(self, transformer) -> torch.dtype:
        return transformer.patch_embedding.weight.dtype  # stays in the base dtype under FP8 and sharding

    # ---- [seam: adapters] ----------------------------------------------------------------------------------------
    adapter_naming = WAN_NAMING

    # ---- [seam: conditioning] ------------------------------------------------------------------------------------
    expert_folders = EXPERT_FOLDERS

    def route(self, sigma, loaded):
        """HIGH when shifted sigma >= boundary_ratio; a run that loaded one expert (dense, or one boundary of a
        two-expert model) sends every sample to it."""
        if len(loaded) == 1:
            return torch.zeros(sigma.shape[0], dtype=torch.long, device=sigma.device)
        high = sigma >= self.boundary_ratio
        return torch.where(high, loaded.index("high"), loaded.index("low")).long()

    def expert_for_step(self, sampler, sigma_range, seed, step):
        """The expert every rank trains at ``step`` when the experts are sharded (FSDP: a rank that ran one expert
        while another ran the other would pair their weight all-gathers -- both experts have the same shapes -- and
        mix them silently), and the sigma range its samples are then drawn from.

        One noise level is drawn from the objective's own distribution with a generator seeded by (seed, step) --
        the same on every rank, and again after a resume -- and its expert is the step's. Each rank then draws its
        samples' noise levels from that distribution truncated to the expert's part of the range, so every sample's
        noise level keeps exactly the distribution of per-sample routing; only the samples of one step share an
        expert. ``sampler``: an object with ``sample_sigmas(n, lo, hi, generator=...)`` (objectives.FlowMatching)."""
        lo, hi = sigma_range
        boundary = self.boundary_ratio
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
        s = float(sampler.sample_sigmas(1, lo, hi, generator=g)[0])
        if s >= boundary:
            return "high", (max(lo, boundary), hi)
        return "low", (lo, min(hi, boundary))

    def load_encoders(self):
        """The Wan VAE, UMT5 and its tokenizer (wanexp.models.wan22.encoders.WanEncoders)."""
        from wanexp.models.wan22.encoders import WanEncoders

        return WanEncoders(self.load_vae(), self.load_text_encoder(), self.load_tokenizer(), self.text_len,
                           self.needs_image_latent)

    def enable_sequence_parallel(self, transformer, sp, gradient_free=False):
        from wanexp.models.wan22 import sequence

        sequence.enable(transformer, sp, gradient_free)

    def set_sequence_parallel(self, transformer, active):
        from wanexp.models.wan22 import sequence

        sequence.set_active(transformer, active)

    # ---- [seam: shapes, memory, FLOPs] ---------------------------------------------------------------------------

    def step_flops(self, config, latent_shape, text_len, checkpointing):
        from wanexp.models.wan22.flops import transformer_step_flops

        return transformer_step_flops(config, latent_shape, text_len, checkpointing)

    def memory_formula(self):
        from wanexp.models.wan22.memory import WanMemory

        return WanMemory()


    # ---- [seam: generation, bench, conversion] -------------------------------------------------------------------
    converters = {"original": "wanexp.models.wan22.original.convert_original"}  # the Wan-AI release layout
    cfg_parallel = "text"  # diffusers' Wan pipelines: cond then uncond, only the text embeddings differ

    def load_pipeline(self, device, dtype, image):
        from wanexp.models.wan22.pipeline import WanPipelineRunner, pipeline_class

        if self.single_files:
            from wanexp.errors import ConfigError

            raise ConfigError(f"model.path={self.path}: wanexp-sample loads a diffusers-format folder; its weights "
                              "given as single files are used by training and its validation samples only")
        name = self.image_pipeline_class if image else self.pipeline_class
        pipe = pipeline_class(name).from_pretrained(self.path, dtype=dtype).to(device)
        pipe.set_progress_bar_config(disable=True)
        return WanPipelineRunner(pipe)

    def make_pipeline(self, transformers, vae, scheduler, image):
        from wanexp.models.wan22.pipeline import WanPipelineRunner, build_pipeline

        return WanPipelineRunner(build_pipeline(self, transformers, vae, None, None, scheduler, image))

    def load_scheduler(self):
        """The folder's scheduler; without a diffusers folder, the one a converted folder ships (UniPC flow matching
        at model.shift)."""
        from wanexp.models.wan22.pipeline import flow_scheduler, load_scheduler

        if self.path is None or not (self.path / "model_index.json").is_file():
            return flow_scheduler(self.shift)
        return load_scheduler(self.path)

    def load_transformer_sharded(self, expert, device, mesh):
        if self.single_files:
            from wanexp.errors import ConfigError

            raise ConfigError(f"model.path={self.path}: --shard reads diffusers-format folders; weights given as "
                              "single files load whole")
        return super().load_transformer_sharded(expert, device, mesh)

    def encode_prompts(self, prompts, device, encoders=None):
        from wanexp.models.wan22.encoders import encode_prompts

        return encode_prompts(self, prompts, device, encoders)

    @classmethod
    def plain_loop(cls):
        from wanexp.models.wan22 import plain_loop

        return plain_loop

    def write_random_model(self, folder, device="cpu", dtype=torch.float32) -> None:
        from wanexp.models.wan22.build import build_components, save_pipeline_folder

        save_pipeline_folder(self, build_components(self, device, dtype), folder)


class TI2VSpec(WanSpec):
    """TI2V-5B: dense, 48-channel latents from the Wan2.2 VAE, per-token timesteps, optional image frame 0."""

    layout = "ti2v"
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
    needs_image_latent = True

    def model_inputs(self, x_t, x0, sigma, cond):
        return conditioning.i2v_inputs(x_t, sigma, cond["image_latent"], self.vae_stride[0])
