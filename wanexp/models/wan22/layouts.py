"""The Wan2.2 layouts in one table: what the specs, the original-release conversion and the benchmark read.

Values of the DiT, the VAE and the original release; nothing here imports torch or diffusers.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layout:
    name: str  # the spec's layout (cache keys, convert's internal name)
    model: str  # the conf/model/<model>.yaml group, also `python -m wanexp.cli.convert --model`
    experts: tuple[str, ...]  # "dense", or the "high" and "low" noise experts
    latent_channels: int  # the VAE's latent channels (what the DiT predicts)
    in_channels: int  # the DiT's input channels
    vae_stride: tuple[int, int, int]  # pixels per latent (frames, height, width)
    per_token_timestep: bool  # TI2V: a timestep per token (a clean first frame sits at 0)
    pipeline_class: str  # the diffusers pipeline of the folder (model_index.json)
    pipeline_extras: dict = field(default_factory=dict)  # its extra arguments
    vae_layout: dict = field(default_factory=lambda: {"z_dim": 16})  # AutoencoderKLWan's architecture arguments
    # The original Wan-AI release: config.json's model_type and the VAE file it ships.
    model_type: str = ""
    vae_file: str = ""
    # Scheduler flow_shift and expert boundary written into a converted folder: the model YAML's values (training
    # reads them from the config, not from the folder; tests/unit/test_original_layout.py pins them to the YAMLs).
    shift: float = 5.0
    boundary_ratio: float | None = None
    # VACE control blocks beside the DiT's (WanVACETransformer3DModel; the release's config.json has vace_layers)
    control: bool = False


LAYOUTS = {lay.name: lay for lay in (
    Layout("ti2v", "ti2v5b", ("dense",), 48, 48, (4, 16, 16), True, "WanPipeline", {"expand_timesteps": True},
           {"z_dim": 48, "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
            "scale_factor_spatial": 16},
           model_type="ti2v", vae_file="Wan2.2_VAE.pth", shift=5.0, boundary_ratio=None),
    Layout("t2v_a14b", "t2v14b", ("high", "low"), 16, 16, (4, 8, 8), False, "WanPipeline",
           model_type="t2v", vae_file="Wan2.1_VAE.pth", shift=12.0, boundary_ratio=0.875),
    Layout("i2v_a14b", "i2v14b", ("high", "low"), 16, 36, (4, 8, 8), False, "WanImageToVideoPipeline",
           model_type="i2v", vae_file="Wan2.1_VAE.pth", shift=5.0, boundary_ratio=0.900),
    # Wan2.2-VACE-Fun-A14B (alibaba-pai): T2V-A14B's experts with control blocks, in VideoX-Fun's layout of the
    # Wan-AI release (its config.json says model_type "t2v"; copies elsewhere say "vace")
    Layout("vace_a14b", "vace14b", ("high", "low"), 16, 16, (4, 8, 8), False, "WanVACEPipeline",
           model_type="vace", vae_file="Wan2.1_VAE.pth", shift=12.0, boundary_ratio=0.875, control=True),
)}
# conf/model name (convert's --model) -> layout
MODELS = {lay.model: lay for lay in LAYOUTS.values()}
# Which diffusers subfolder holds each expert (a two-expert pipeline names the second, low-noise, one transformer_2).
EXPERT_FOLDERS = {"dense": "transformer", "high": "transformer", "low": "transformer_2"}
