"""Wan2.2-S2V-14B as a model family (``model=s2v14b``, ``model=tiny_s2v``): speech-to-video LoRA training and
sampling on the original Wan-AI release folder, loaded as it is downloaded::

    Wan2.2-S2V-14B/
      config.json, diffusion_pytorch_model-0000N-of-0000M.safetensors + index    the DiT (loaded directly)
      Wan2.1_VAE.pth                  the VAE (read with torch.load, renamed to diffusers' AutoencoderKLWan)
      models_t5_umt5-xxl-enc-bf16.pth the UMT5 encoder (renamed to transformers' UMT5EncoderModel)
      google/umt5-xxl/                its tokenizer
      wav2vec2-large-xlsr-53-english/ the audio encoder

The VAE and the text encoder may instead be diffusers/transformers folders ``vae/`` and ``text_encoder/`` (what a
conversion of those two files writes; the tiny random build writes them so). A training sample is a clip of ``4k + 1``
frames with its audio (an ``audio`` or ``audio_path`` column, else a same-name .wav/.mp3/.flac beside the clip, else
the clip's own audio stream; a clip with none is rejected with the reason). Its first frame is the reference image and
the ``4k`` frames after it are generated, as the first clip of a generation is (Wan2.2's 80 frames after the
reference: ``data.num_frames=81``); it trains as VideoX-Fun's S2V training trains a clip without previous frames: no
motion frames (the DiT's ``drop_motion_frames``), the loss on the ``k`` generated latent frames only,
``model.audio_dropout`` of the samples with zeroed audio (the unconditional branch of audio CFG).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from wanexp.config.rules import missing_model_folder
from wanexp.errors import ConfigError
from wanexp.models.family import (EncoderInfo, ModelSpec, require_frame_stride_one, safetensors_problem,
                                   unreadable_weights)
from wanexp.models.s2v.adapter_naming import S2V_NAMING
from wanexp.models.s2v.audio_encoder import FOLDER as AUDIO_FOLDER

VAE_FILE = "Wan2.1_VAE.pth"
VAE_LAYOUT = "t2v_a14b"  # the Wan2.2 layout whose VAE (Wan2.1's) S2V shares: wanexp.models.wan22.original reads it


class S2VSpec(ModelSpec):
    """The S2V DiT (one dense expert) over Wan2.1-VAE latents, UMT5 text and wav2vec2 audio features."""

    layout = "s2v"
    reference_image = True  # --image: the reference frame (mid-grey without one)
    latent_channels = in_channels = 16
    vae_stride = (4, 8, 8)
    patch = (1, 2, 2)
    draws_audio_dropout = True
    default_audio_dropout = 0.1  # VideoX-Fun's S2V training: 10 % of the samples with zeroed audio features
    transformer_class = "wanexp.models.s2v.transformer.WanS2VTransformer"
    vae_class = "diffusers.AutoencoderKLWan"
    text_encoder_class = "transformers.UMT5EncoderModel"

    # ---- [seam: adapters] ----------------------------------------------------------------------------------------
    # adapter.attention (null: all of self, cross, audio): audio is the injected blocks' audio cross-attention
    adapter_naming = S2V_NAMING

    # ---- [seam: conditioning] ------------------------------------------------------------------------------------
    expert_folders = {"dense": "."}  # the DiT's config.json and shards sit at the release folder's top
    encoder_folders = (AUDIO_FOLDER,)
    sample_inputs = {"audio": "the clip's audio (a video or audio file FFmpeg reads)"}
    sample_input_fallbacks = {"audio": ("audio_path",)}  # absent: a same-name audio file, else the clip's own audio

    # ---- the release folder ----------------------------------------------------------------------------------
    def _component(self, file: str, folder: str) -> Path | None:
        """The original file of a component if present, else its converted folder if present, else None."""
        for p in (self.path / file, self.path / folder):
            if p.is_file() or (p / "config.json").is_file():
                return p
        return None

    def _dit_files(self) -> list[Path]:
        from wanexp.models.wan22.original import _weight_files

        return _weight_files(self.path)

    def check_folder(self, experts: list[str]) -> None:
        """One line naming the first missing piece of the release folder, before anything loads."""
        from wanexp.models.s2v.original import read_config
        from wanexp.models.wan22.original import T5_FILE, TOKENIZER_DIR

        p = self.path
        if not p.is_dir():
            raise ConfigError(missing_model_folder(p, self.name))
        read_config(p)
        files = self._dit_files()
        for what, file, folder in (("the VAE", VAE_FILE, "vae"), ("the UMT5 text encoder", T5_FILE, "text_encoder")):
            if self._component(file, folder) is None:
                raise ConfigError(f"model.path={p}: no {file} ({what}); the Wan2.2-S2V-14B download has it "
                                  "(re-download it, or copy it there)")
        tok = p / TOKENIZER_DIR
        if not any((tok / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json", "spiece.model")):
            raise ConfigError(f"model.path={p}: no tokenizer folder {TOKENIZER_DIR}/; copy google/umt5-xxl/ from the "
                              "Wan2.2-S2V-14B download")
        if not (p / AUDIO_FOLDER / "config.json").is_file():
            raise ConfigError(f"model.path={p}: no {AUDIO_FOLDER}/ (the wav2vec2 audio encoder); the Wan2.2-S2V-14B "
                              "download has it")
        for f in files:
            problem = safetensors_problem(f)
            if problem:
                raise unreadable_weights(p, "the S2V transformer", f"{f.name}: {problem}")

    def load_bytes(self, experts: list[str], encoders: bool) -> int:
        from wanexp.models.wan22.original import T5_FILE

        files = list(self._dit_files())
        if encoders:
            for comp in (self._component(VAE_FILE, "vae"), self._component(T5_FILE, "text_encoder"),
                         self.path / AUDIO_FOLDER):
                if comp is not None:
                    files += [comp] if comp.is_file() else [f for f in comp.rglob("*") if f.is_file()]
        return sum(f.stat().st_size for f in files)

    def transformer_config(self, expert: str) -> dict:
        """WanS2VTransformer's config (from config.json and the shards' headers; nothing loads)."""
        from wanexp.models.s2v.original import _shapes, module_config, read_config

        shapes = {k: s for k, (s, _) in _shapes(self._dit_files()).items()}
        config = module_config(read_config(self.path), shapes, self.path / "config.json")
        return dict(config, num_attention_heads=config["num_heads"])  # the key sequence-parallel checks read

    def meta_transformers(self, boundary: str) -> dict:
        from wanexp.models.s2v.transformer import WanS2VTransformer

        config = {k: v for k, v in self.transformer_config("dense").items() if k != "num_attention_heads"}
        with torch.device("meta"):
            return {"dense": WanS2VTransformer(**config).requires_grad_(False)}

    def load_transformer(self, expert: str):
        from wanexp.models.s2v.original import load_s2v_transformer

        model = load_s2v_transformer(self.path, self.dtype).requires_grad_(False)
        self.set_attention_backend(model)
        if self.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        return self.prepare_transformer(model)

    @classmethod
    def wanexp_forward(cls, fast_modulation: bool) -> bool:
        return True  # the S2V DiT's forward is wanexp's own (models/s2v/transformer.py)

    def prepare_transformer(self, model):
        """Offloaded activations (``model.offload_activations``): the checkpointed blocks' inputs in host memory."""
        model._wanexp_offload_activations = self.offload_activations
        return model

    def compute_dtype(self, transformer) -> torch.dtype:
        return transformer.patch_embedding.weight.dtype

    def enable_sequence_parallel(self, transformer, sp, gradient_free=False):
        """Ulysses over the whole sequence (noisy, reference and motion tokens), padded to a multiple of the ranks
        (the padding is left out of the attention): any token count splits; the heads must divide."""
        from wanexp.models.wan22 import sequence

        sequence.enable(transformer, sp, gradient_free, heads=transformer.config.num_heads)

    def set_sequence_parallel(self, transformer, active):
        from wanexp.models.wan22 import sequence

        sequence.set_active(transformer, active)

    sequence_parallel = True
    pads_sequence = True  # sequence parallel pads the tokens: only the heads must divide

    def memory_formula(self):
        from wanexp.models.s2v.memory import S2VMemory

        return S2VMemory()

    def load_vae(self):
        from diffusers import AutoencoderKLWan

        from wanexp.models.wan22.original import convert_vae

        source = self._component(VAE_FILE, "vae")
        vae = convert_vae(source, VAE_LAYOUT) if source.is_file() else AutoencoderKLWan.from_pretrained(source)
        return vae.to(self.vae_dtype).requires_grad_(False).eval()

    def load_text_encoder(self):
        from transformers import UMT5EncoderModel

        from wanexp.models.wan22.original import T5_FILE, convert_text_encoder

        source = self._component(T5_FILE, "text_encoder")
        te = convert_text_encoder(source) if source.is_file() else UMT5EncoderModel.from_pretrained(os.fspath(source))
        return te.to(self.text_encoder_dtype).requires_grad_(False).eval()

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        from wanexp.models.wan22.original import TOKENIZER_DIR

        return AutoTokenizer.from_pretrained(os.fspath(self.path / TOKENIZER_DIR))

    def load_audio_encoder(self):
        from wanexp.models.s2v.audio_encoder import load_audio_encoder

        return load_audio_encoder(self.path / AUDIO_FOLDER)

    def encoder_info(self) -> EncoderInfo:
        """The cache keys cover the VAE file (or folder), the text encoder's and the wav2vec2 folder."""
        from wanexp.data.cache import file_identity
        from wanexp.models.wan22.original import T5_FILE, TOKENIZER_DIR

        def identity(p: Path | None):  # a file's (a folder's is folder_identity's, from the path)
            return file_identity(p) if p is not None and p.is_file() else None

        vae, te = self._component(VAE_FILE, "vae"), self._component(T5_FILE, "text_encoder")
        info = super().encoder_info()
        return EncoderInfo(**{**info.__dict__, "vae": str(vae), "text_encoder": str(te),
                              "text_dtype": json.dumps([str(self.text_encoder_dtype), identity(te)]),
                              "tokenizer": str(self.path / TOKENIZER_DIR),
                              "cond_id": {"s2v": ["ref_latents", "audio"], "vae_file": identity(vae)}})

    def load_encoders(self):
        from wanexp.models.s2v.encoders import S2VEncoders

        return S2VEncoders(self.load_vae(), self.load_text_encoder(), self.load_tokenizer(),
                           self.load_audio_encoder(), self.text_len)

    def load_sample_input(self, name: str, path: str, num_frames: int, fps: int | None, size=None, start: int = 0,
                          stride: int = 1) -> torch.Tensor:
        """The 16 kHz samples under the clip's window (``round(num_frames * 16000 / fps)`` from its first frame's
        time, ``start / fps``; zeros past the audio's end): of an audio file, or for a video of a same-name audio file
        beside it, else of its own audio stream. The window keeps every frame (``stride`` 1: check_groups)."""
        from wanexp.data.audio import audio_for_clip, find_audio, read_audio

        if stride != 1:
            raise ValueError(f"an S2V clip keeps every frame of its window, got stride {stride}")
        rate_fps = fps or self.fps
        samples, rate = read_audio(find_audio(path))
        return torch.from_numpy(audio_for_clip(samples, rate, start / rate_fps, num_frames, rate_fps))

    def check_sample_input(self, name: str, path: str) -> str | None:
        """A sample without audio (no audio file, no same-name one beside a clip, no audio stream): the reason."""
        from wanexp.data.audio import find_audio
        from wanexp.errors import MediaError

        try:
            find_audio(path)
        except MediaError as e:
            return str(e).removeprefix(f"{path}: ")
        return None

    def sample_condition(self, cond: dict, batch_size: int, generator: torch.Generator | None = None) -> dict:
        """``model.audio_dropout`` of the samples get zero audio features (the negative branch of audio CFG)."""
        if not self.audio_dropout or "audio" not in cond:
            return cond
        keep = torch.rand(batch_size, generator=generator) >= float(self.audio_dropout)
        audio = cond["audio"]
        return dict(cond, audio=audio * keep.to(audio.device, audio.dtype).view(-1, *[1] * (audio.dim() - 1)))

    def model_inputs(self, x_t, x0, sigma, cond):
        """The noisy clip and 1000 * sigma; x0 holds the generated frames only (the reference latent is in
        ``cond``), so every element of the velocity counts: no mask."""
        return x_t, 1000.0 * sigma.float(), None

    def transformer_call(self, transformer, hidden, timestep, text, cond):
        """The reference latent, the audio features and the motion latents (None: none, as a first clip) by name."""
        motion = cond.get("motion_latents")
        return transformer(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text,
                           ref_latents=cond["ref_latents"].to(hidden.dtype),
                           audio_features=cond["audio"].to(hidden.dtype),
                           motion_latents=None if motion is None else motion.to(hidden.dtype))

    @classmethod
    def check_groups(cls, data: dict, adapter: dict | None) -> None:
        """A clip's audio is read from its window's first frame at data.fps, one feature per frame: stride 1."""
        require_frame_stride_one(data, "S2V clips keep every frame (their audio features are one per frame)")

    # ---- [seam: generation] ----------------------------------------------------------------------------------
    def load_scheduler(self):
        from wanexp.models.s2v.pipeline import make_scheduler

        return make_scheduler(self.shift)

    def load_pipeline(self, device, dtype, image):
        from wanexp.models.s2v.pipeline import S2VPipeline

        encoders = self.load_encoders().to(device)
        transformer = self.load_transformer("dense").to(device, dtype).eval()
        return S2VPipeline(self, {"dense": transformer}, encoders.vae, self.load_scheduler(), encoders)

    cfg_parallel = "pairs"  # the unconditional call also zeroes the audio: S2VPipeline splits its own pairs

    @classmethod
    def is_release_folder(cls, path) -> bool:
        """A top-level config.json that names the S2V DiT (its model_type or class); what else it lacks is said
        when the folder is checked."""
        from wanexp.models.s2v.original import CLASS_NAME, MODEL_TYPE

        try:
            config = json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(config, dict) and (config.get("model_type") == MODEL_TYPE
                                             or config.get("_class_name") == CLASS_NAME)

    def load_transformer_sharded(self, expert, device, mesh):
        """The DiT sharded as it loads, each rank reading its rows of the release's shards by their original
        names."""
        from wanexp.models.sharded import load_sharded

        return load_sharded(self, expert, device, mesh, source=_release_source)

    def make_pipeline(self, transformers, vae, scheduler, image):
        from wanexp.models.s2v.pipeline import S2VPipeline

        return S2VPipeline(self, transformers, vae, scheduler)

    def encode_prompts(self, prompts, device, encoders=None):
        from wanexp.models.wan22.encoders import encode_prompts

        return encode_prompts(self, prompts, device, encoders)

    # ---- the tiny random build -------------------------------------------------------------------------------
    def write_random_model(self, folder, device="cpu", dtype=torch.float32) -> None:
        """The release layout at ``model.build``'s sizes (tiny, or the real sizes: ``transformer: real``): the DiT's
        config.json + shards, ``vae/`` and ``text_encoder/`` folders (the converted form), the tokenizer, the
        wav2vec2 and a ``model_index.json`` naming the build (what wanexp.models.tiny recognises a finished build
        by)."""
        from wanexp.models.s2v.build import write_tiny_build

        write_tiny_build(self, Path(folder), device, dtype)



def _release_source(spec, expert):
    """The DiT built without weights and where each parameter is in the release's shards (original names)."""
    from wanexp.models.s2v.original import _shapes, module_key_map

    model = spec.meta_transformers("full")[expert]
    where = {k: f for k, (_, f) in _shapes(spec._dit_files()).items()}
    return model, {name: (where[key], key) for key, name in module_key_map(model).items() if key in where}, spec.path
