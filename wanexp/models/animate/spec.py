"""Wan2.2-Animate-14B as a model family (``model=animate14b``, ``model=tiny_animate``): LoRA training and sampling
on the Wan-AI/Wan2.2-Animate-14B-Diffusers folder, loaded as it is downloaded::

    Wan2.2-Animate-14B-Diffusers/
      model_index.json
      transformer/      WanAnimateTransformer3DModel (the 14B DiT, the pose embedding, the motion/face encoders and
                        the face adapter)
      vae/              the Wan2.1 VAE          text_encoder/, tokenizer/    UMT5-XXL
      image_encoder/    the CLIP vision tower   image_processor/             its CLIPImageProcessor
      scheduler/

A training sample is a clip of ``4k + 1`` frames (the reference's segment is 77) with two more videos of the same
frames, named by metadata columns: ``pose_video`` (the rendered pose skeleton, at the clip's size) and ``face_video``
(the face crop, resized to the face encoder's size, 512 for the released model); ``model.animate_mode=replacement``
adds ``background_video`` (the clip with the person removed) and ``mask_video`` (white where the person is). Wan2.2's
``wan/modules/animate/preprocess`` makes all four from a clip. The clip's first frame is the reference image. It
trains as the first segment of a generation (no previous frames): the encoders (encoders.py) build what
diffusers' WanAnimatePipeline gives the DiT for that segment, and the flow-matching loss covers the clip's latents,
not the reference slot before them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from wanexp.errors import ConfigError
from wanexp.models.family import EncoderInfo, ModelSpec
from wanexp.models.animate.adapter_naming import ANIMATE_NAMING
from wanexp.models.animate.media import video_size

MODES = ("animation", "replacement")
CONTROL = {"pose_video": "the clip's pose video (Wan2.2 preprocessing's src_pose.mp4), frame for frame",
           "face_video": "the clip's face video (Wan2.2 preprocessing's src_face.mp4), frame for frame"}
REPLACEMENT = {"background_video": "the clip without its person (src_bg.mp4), frame for frame",
               "mask_video": "the person's mask, white where the character is generated (src_mask.mp4)"}
PREPROCESS = "Wan2.2's wan/modules/animate/preprocess (preprocess_data.py) makes them from each clip"
MISSING_COLUMNS = ("Wan2.2-Animate trains from each clip's pose and face videos, but no row of data.metadata={} names "
                   "them: add the columns pose_video and face_video (replacement mode: also background_video and "
                   "mask_video), paths to videos of the clip's own frames; " + PREPROCESS)


class AnimateSpec(ModelSpec):
    """The Animate DiT (one dense expert) over Wan2.1-VAE latents, UMT5 text, CLIP image features, pose latents and
    face pixels."""

    layout = "animate"
    reference_image = True  # --image: the character to animate
    modes = MODES
    latent_channels = 16
    in_channels = 36  # the noisy latents, then the reference condition's 4 mask and 16 latent channels
    vae_stride = (4, 8, 8)
    patch = (1, 2, 2)
    extra_latent_frames = 1  # the reference slot before the clip's latents
    transformer_class = "diffusers.WanAnimateTransformer3DModel"
    vae_class = "diffusers.AutoencoderKLWan"
    text_encoder_class = "transformers.UMT5EncoderModel"

    # ---- [seam: adapters] ----------------------------------------------------------------------------------------
    adapter_naming = ANIMATE_NAMING

    # ---- [seam: conditioning] ------------------------------------------------------------------------------------
    encoder_folders = ("vae", "text_encoder", "tokenizer", "image_encoder")
    sample_inputs = dict(CONTROL)  # model.animate_mode=replacement adds REPLACEMENT's (per instance)
    sampling_needs_inputs = True  # a sample follows its pose and face videos: there is no default motion

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.animate_mode = self.animate_mode or MODES[0]  # null: animation
        if self.animate_mode not in MODES:
            raise ConfigError(f"model.animate_mode={self.animate_mode}: model={self.name} takes one of "
                              f"{', '.join(MODES)}")
        if self.animate_mode == "replacement":
            self.sample_inputs = {**CONTROL, **REPLACEMENT}

    # ---- the folder --------------------------------------------------------------------------------------------
    @classmethod
    def is_release_folder(cls, path) -> bool:
        """A folder whose transformer is the Animate DiT (its config names the class): wanexp-sample --model-path
        tells it from I2V-A14B's, whose DiT has the same channels."""
        try:
            config = json.loads((Path(path) / "transformer" / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(config, dict) and config.get("_class_name") == cls.transformer_class.rpartition(".")[2]

    @classmethod
    def wanexp_forward(cls, fast_modulation: bool) -> bool:
        return False  # diffusers' WanAnimateTransformer3DModel forward

    def not_diffusers_hint(self, path: Path) -> str | None:
        """The original Wan2.2-Animate-14B release (Wan's own layout: its CLIP and VAE as .pth files, the relighting
        LoRA, the preprocessing checkpoints): the diffusers download to use instead (the same weights)."""
        path = Path(path)
        if not (any(path.glob("models_clip_*.pth")) or (path / "relighting_lora.ckpt").is_file()
                or (path / "process_checkpoint").is_dir()):
            return None
        return ("this is the original Wan2.2-Animate-14B release (Wan's own layout), which wanexp does not convert; "
                "download Wan-AI/Wan2.2-Animate-14B-Diffusers (the same weights in diffusers' layout) and point "
                "model.path at it (this folder's process_checkpoint/ stays the preprocessing's --ckpt_path)")

    def check_folder(self, experts: list[str]) -> None:
        super().check_folder(experts)
        if not (self.path / "image_processor" / "preprocessor_config.json").is_file():
            raise ConfigError(f"model.path={self.path}: component 'image_processor/' is missing or has no "
                              "preprocessor_config.json (the Wan2.2-Animate-14B-Diffusers download has it)")

    def face_size(self) -> int:
        """The face encoder's input size (the transformer config's ``motion_encoder_size``; nothing loads)."""
        if getattr(self, "_face_size", None) is None:
            self._face_size = int(self.transformer_config("dense").get("motion_encoder_size", 512))
        return self._face_size

    def encoder_info(self) -> EncoderInfo:
        """The cache keys cover the CLIP tower's and its processor's folders and the mode (the segment's condition
        differs between modes)."""
        info = super().encoder_info()
        return EncoderInfo(**{**info.__dict__, "cond_id": {"animate": self.animate_mode},
                              "media_encoders": (*info.media_encoders, str(self.path / "image_processor"))})

    def load_image_encoder(self):
        """The CLIP vision tower (in ``model.text_encoder_dtype``) and its image processor."""
        from wanexp.models.animate.pipeline import pipeline_type

        pipeline_type()  # binds the CLIP image processor's name (wanexp.models.wan22.pipeline.pipeline_class)
        from transformers import CLIPImageProcessor, CLIPVisionModel

        encoder = CLIPVisionModel.from_pretrained(str(self.path / "image_encoder"), dtype=self.text_encoder_dtype)
        return encoder.requires_grad_(False).eval(), CLIPImageProcessor.from_pretrained(
            str(self.path / "image_processor"))

    def load_encoders(self):
        from wanexp.models.animate.encoders import AnimateEncoders

        image_encoder, processor = self.load_image_encoder()
        return AnimateEncoders(self.load_vae(), self.load_text_encoder(), self.load_tokenizer(), image_encoder,
                               processor, self.text_len, self.face_size(), self.animate_mode == "replacement")

    def load_sample_input(self, name: str, path: str, num_frames: int, fps: int | None, size=None, start: int = 0,
                          stride: int = 1) -> torch.Tensor:
        """The clip's window of a control video at ``fps``, exactly its frames (frame for frame with the clip), as
        (3, F, h, w) in [-1, 1]: the face video at the face encoder's size, the others at their own size (the
        encoders fit them to the clip's ``size`` as the clip was fitted)."""
        from wanexp.data.media import load_clip

        if name == "face_video":
            return load_clip(path, num_frames, self.face_size(), self.face_size(), stride, start=start,
                             fps=fps or self.fps, exact=True)
        width, height = video_size(path)
        return load_clip(path, num_frames, height, width, stride, start=start, fps=fps or self.fps, exact=True)

    def check_sample_input(self, name: str, path: str) -> str | None:
        """A control file that is missing or has no video stream: the reason."""
        try:
            video_size(path)
        except ConfigError as e:
            return f"{name}: {e}"
        return None

    def model_inputs(self, x_t, x0, sigma, cond):
        """The noisy latents (the reference slot first) with the reference condition's channels, 1000 * sigma per
        sample; the loss mask drops the reference slot (frame 0), which the segment does not generate."""
        hidden = torch.cat([x_t, cond["reference_latents"].to(x_t.dtype)], dim=1)
        mask = torch.ones(x0.shape[0], 1, x0.shape[2], 1, 1, dtype=torch.bool, device=x0.device)
        mask[:, :, 0] = False
        return hidden, 1000.0 * sigma.float(), mask

    def transformer_call(self, transformer, hidden, timestep, text, cond):
        """The image features, the pose latents and the face pixels by name, as WanAnimatePipeline passes them."""
        return transformer(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text,
                           encoder_hidden_states_image=cond["image_embeds"].to(hidden.dtype),
                           pose_hidden_states=cond["pose_latents"].to(hidden.dtype),
                           face_pixel_values=cond["face_pixels"].to(hidden.dtype), return_dict=False)[0]

    def prepare_transformer(self, model):
        """With ``model.gradient_checkpointing``, the face adapter blocks are checkpointed too (diffusers checkpoints
        the DiT blocks only; the 8 face adapter calls between them would keep their activations, about 1.5 GiB
        each at 480x832x77)."""
        if self.gradient_checkpointing:
            for block in model.face_adapter:
                block.forward = _checkpointed(block.forward)
        return model

    def compute_dtype(self, transformer) -> torch.dtype:
        return transformer.patch_embedding.weight.dtype

    @classmethod
    def check_groups(cls, data: dict, adapter: dict | None) -> None:
        """A metadata file whose rows name no pose/face video at all is one line saying what to provide."""
        for part in _metadata_parts(data):
            problem = missing_columns(part, data.get("root"))
            if problem:
                raise ConfigError(problem)

    # ---- [seam: shapes, memory, FLOPs] ---------------------------------------------------------------------------
    def step_flops(self, config, latent_shape, text_len, checkpointing):
        """Wan's formula over the DiT's tokens (``latent_shape`` counts the reference slot); the face adapter and
        the motion encoder are left out."""
        from wanexp.models.wan22.flops import transformer_step_flops

        return transformer_step_flops(config, latent_shape, text_len, checkpointing)

    def memory_formula(self):
        from wanexp.models.animate.memory import AnimateMemory

        return AnimateMemory()

    # ---- [seam: generation] ----------------------------------------------------------------------------------
    def load_scheduler(self):
        from wanexp.models.wan22.pipeline import load_scheduler

        return load_scheduler(self.path)

    def load_pipeline(self, device, dtype, image):
        from wanexp.models.animate.pipeline import AnimatePipeline, load_animate_pipeline

        return AnimatePipeline(self, load_animate_pipeline(self, device, dtype))

    def make_pipeline(self, transformers, vae, scheduler, image):
        from wanexp.models.animate.pipeline import AnimatePipeline, build_animate_pipeline

        return AnimatePipeline(self, build_animate_pipeline(self, transformers["dense"], vae, scheduler))

    def encode_prompts(self, prompts, device, encoders=None):
        from wanexp.models.wan22.encoders import encode_prompts

        return encode_prompts(self, prompts, device, encoders)

    # ---- the tiny random build -------------------------------------------------------------------------------
    def write_random_model(self, folder, device="cpu", dtype=torch.float32) -> None:
        from wanexp.models.animate.build import write_tiny_build

        write_tiny_build(self, Path(folder), device, dtype)


def _checkpointed(forward):
    """``forward`` recomputed in the backward instead of keeping its activations (when gradients are on)."""
    from torch.utils.checkpoint import checkpoint

    def run(hidden_states, encoder_hidden_states=None, attention_mask=None):
        if torch.is_grad_enabled():
            return checkpoint(forward, hidden_states, encoder_hidden_states, attention_mask, use_reentrant=False)
        return forward(hidden_states, encoder_hidden_states, attention_mask)

    return run


def _metadata_parts(data: dict) -> list[dict]:
    """The data group's metadata sources: its own ``metadata`` and each of ``datasets``' (a list or a name ->
    part mapping)."""
    parts = data.get("datasets") or []
    parts = list(parts.values()) if isinstance(parts, dict) else list(parts)
    return [{"metadata": data.get("metadata"), "root": data.get("root")}] + [p for p in parts if isinstance(p, dict)]


def missing_columns(part: dict, root: str | None) -> str | None:
    """The one-line refusal for a metadata source whose every row lacks a pose or face video, or None (a file not
    there yet, or a bad one, is the data group's to report)."""
    from wanexp.data.metadata import read_metadata_with_rejects
    from wanexp.errors import MetadataError

    metadata = part.get("metadata")
    if not metadata or not Path(str(metadata)).exists():
        return None
    try:
        samples, rejects = read_metadata_with_rejects(metadata, part.get("root") or root, tuple(CONTROL))
    except MetadataError:
        return None  # the data group reports a bad file itself
    if samples or not rejects or not all(r.reason.startswith(tuple(f"no {c}" for c in CONTROL)) for r in rejects):
        return None
    return MISSING_COLUMNS.format(metadata)
