"""The S2V audio features: wav2vec2-large-xlsr-53 hidden states of every layer, per video frame.

What Wan2.2-S2V computes before its DiT, step by step:

1. 16 kHz mono samples, normalised to zero mean and unit variance (the folder's ``preprocessor_config.json``).
2. wav2vec2 (the ``Wav2Vec2ForCTC`` checkpoint in ``wav2vec2-large-xlsr-53-english/``, eval mode): the hidden
   states of every layer, ``num_hidden_layers + 1`` of them (25 for the real model: the input of each transformer
   layer and the final layer-normed output), ``T`` frames at 50 per second (a conv stack of stride 320).
3. Linear interpolation (``align_corners=True``) of the ``T`` frames to ``int(T / 50 * 30)`` frames at 30 per
   second (:data:`VIDEO_RATE`, whatever the video's own rate): ``(layers, A, dim)``.
4. Per video frame at ``fps`` (16 for S2V), one window: video frame ``i`` takes the 30-per-second frame
   ``round(i / fps * 30)`` and its ``m`` neighbours on each side, ``int(30 / fps)`` apart, clamped to the audio;
   a frame past the audio's end gets zeros. The frames are counted in whole clips of ``frames`` (80 for S2V),
   ``int(A / (frames * 30 / fps)) + 1`` clips: long audio is split into that many clips, the last zero-filled.
   The DiT's ``audio_input`` for clip ``r`` is ``(B, layers, dim * (2m + 1), frames)``, frames
   ``r * frames .. (r + 1) * frames`` (``m = 0`` for S2V: ``(B, 25, 1024, 80)``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from wanexp.errors import ConfigError, MediaError

__all__ = [
    "FOLDER",
    "SAMPLE_RATE",
    "VIDEO_RATE",
    "WAV2VEC2_RATE",
    "AudioEncoder",
    "audio_clips",
    "audio_features",
    "clip_count",
    "frame_windows",
    "layer_features",
    "load_audio_encoder",
    "wav2vec2_config",
    "write_tiny_wav2vec2",
    "write_wav2vec2",
]

FOLDER = "wav2vec2-large-xlsr-53-english"
"""The audio encoder's folder inside the original ``Wan2.2-S2V-14B/`` layout."""

WAV2VEC2_RATE = 50
"""wav2vec2 frames per second of 16 kHz audio (its conv stack's total stride is 320 samples)."""

VIDEO_RATE = 30
"""The rate the wav2vec2 frames are interpolated to before they are taken per video frame."""

SAMPLE_RATE = 16000
"""The audio rate wav2vec2 reads (its ``preprocessor_config.json``); ``wanexp.data.audio`` reads audio at it."""

# config.json of the real wav2vec2-large-xlsr-53-english (a Wav2Vec2ForCTC fine-tuned for English CTC).
_REAL_CONFIG = {
    "activation_dropout": 0.05, "apply_spec_augment": True, "architectures": ["Wav2Vec2ForCTC"],
    "attention_dropout": 0.1, "bos_token_id": 1, "conv_bias": True, "conv_dim": [512] * 7,
    "conv_kernel": [10, 3, 3, 3, 3, 2, 2], "conv_stride": [5, 2, 2, 2, 2, 2, 2], "ctc_loss_reduction": "mean",
    "ctc_zero_infinity": True, "do_stable_layer_norm": True, "eos_token_id": 2, "feat_extract_activation": "gelu",
    "feat_extract_dropout": 0.0, "feat_extract_norm": "layer", "feat_proj_dropout": 0.05, "final_dropout": 0.0,
    "hidden_act": "gelu", "hidden_dropout": 0.05, "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 4096, "layer_norm_eps": 1e-05, "layerdrop": 0.05, "mask_channel_length": 10,
    "mask_channel_min_space": 1, "mask_channel_other": 0.0, "mask_channel_prob": 0.0,
    "mask_channel_selection": "static", "mask_feature_length": 10, "mask_feature_prob": 0.0, "mask_time_length": 10,
    "mask_time_min_space": 1, "mask_time_other": 0.0, "mask_time_prob": 0.05, "mask_time_selection": "static",
    "model_type": "wav2vec2", "num_attention_heads": 16, "num_conv_pos_embedding_groups": 16,
    "num_conv_pos_embeddings": 128, "num_feat_extract_layers": 7, "num_hidden_layers": 24, "pad_token_id": 0,
    "vocab_size": 33,
}
# The tiny test model: the real layout (conv kernels and strides, stable layer norm) at toy widths.
_TINY = {"conv_dim": [16] * 7, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
         "num_hidden_layers": 2, "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2}

# preprocessor_config.json of the real folder: the feature extractor that normalises the samples.
_PREPROCESSOR = {"do_normalize": True, "feature_extractor_type": "Wav2Vec2FeatureExtractor", "feature_size": 1,
                 "padding_side": "right", "padding_value": 0.0, "processor_class": "Wav2Vec2Processor",
                 "return_attention_mask": True, "sampling_rate": SAMPLE_RATE}
# The CTC vocabulary (vocab.json, special_tokens_map.json): unused for features, kept so the folder is complete.
_VOCAB = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4, "'": 5, "-": 6,
          **{chr(ord("A") + i): 7 + i for i in range(26)}}
_SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


def wav2vec2_config(size: str = "real"):
    """The ``Wav2Vec2Config`` of the real wav2vec2-large-xlsr-53-english (``size="real"``: 24 layers, width 1024)
    or of the tiny test model of the same layout (``"tiny"``: 2 layers, width 32)."""
    from transformers import Wav2Vec2Config

    if size not in ("real", "tiny"):
        raise ValueError(f"size must be 'real' or 'tiny', got {size!r}")
    return Wav2Vec2Config(**{**_REAL_CONFIG, **(_TINY if size == "tiny" else {})})


def write_wav2vec2(folder: str | os.PathLike[str], size: str = "real", seed: int = 0) -> Path:
    """Write a randomly initialised wav2vec2 folder laid out like the real one: ``config.json`` and
    ``model.safetensors`` (a ``Wav2Vec2ForCTC``, float32), ``preprocessor_config.json``, ``vocab.json``,
    ``special_tokens_map.json``. ``size="real"`` is the full 315M-parameter model (1.3 GB)."""
    from transformers import Wav2Vec2ForCTC

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Wav2Vec2ForCTC(wav2vec2_config(size))
    model.save_pretrained(out)
    for name, content in (("preprocessor_config.json", _PREPROCESSOR), ("vocab.json", _VOCAB),
                          ("special_tokens_map.json", _SPECIAL_TOKENS)):
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    return out


def write_tiny_wav2vec2(folder: str | os.PathLike[str], seed: int = 0) -> Path:
    """:func:`write_wav2vec2` of the tiny model: the real folder's files and layout, 2 layers of width 32."""
    return write_wav2vec2(folder, "tiny", seed)


@dataclass(frozen=True)
class AudioEncoder:
    """A loaded wav2vec2 (the CTC checkpoint; its head is never run) and the feature extractor that normalises
    its input."""

    model: torch.nn.Module
    extractor: object

    @property
    def layers(self) -> int:
        """Hidden states per run: the input of each transformer layer and the final output."""
        return self.model.config.num_hidden_layers + 1

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    @property
    def sample_rate(self) -> int:
        return int(self.extractor.sampling_rate)


def load_audio_encoder(folder: str | os.PathLike[str], device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> AudioEncoder:
    """Load a local wav2vec2 folder (``wav2vec2-large-xlsr-53-english/``; never the hub) in eval mode on
    ``device`` in ``dtype`` (the references run it in float32). A missing folder or file: a one-line ConfigError."""
    from transformers import Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC

    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(f"{path}: wav2vec2 folder not found; the original Wan2.2-S2V-14B layout has it as {FOLDER}/")
    missing = [n for n in ("config.json", "preprocessor_config.json") if not (path / n).is_file()]
    if not any(path.glob("*.safetensors")) and not (path / "pytorch_model.bin").is_file():
        missing.append("model.safetensors")
    if missing:
        raise ConfigError(f"{path}: not a complete wav2vec2 folder (missing {', '.join(missing)})")
    extractor = Wav2Vec2FeatureExtractor.from_pretrained(os.fspath(path), local_files_only=True)
    model = Wav2Vec2ForCTC.from_pretrained(os.fspath(path), local_files_only=True, dtype=dtype)
    return AudioEncoder(model.to(device).eval().requires_grad_(False), extractor)


def _conv_frames(num_samples: int, kernels, strides) -> int:
    """wav2vec2 frames for ``num_samples`` samples: each conv layer keeps ``(n - kernel) // stride + 1``."""
    n = num_samples
    for kernel, stride in zip(kernels, strides):
        n = (n - kernel) // stride + 1 if n >= kernel else 0
    return n


def _resampled_count(frames_50: int) -> int:
    """30-per-second frames from ``frames_50`` wav2vec2 frames (the reference's ``int(T / 50 * 30)``)."""
    return int(frames_50 / float(WAV2VEC2_RATE) * VIDEO_RATE)


def _clips(count: int, fps: float, frames: int) -> int:
    """Clips of ``frames`` video frames at ``fps`` that ``count`` 30-per-second frames are split into."""
    return int(count / (frames * (VIDEO_RATE / fps))) + 1


def clip_count(num_samples: int, fps: float, frames: int, rate: int = SAMPLE_RATE, config=None) -> int:
    """How many clips of ``frames`` frames at ``fps`` an audio of ``num_samples`` samples at ``rate`` gives
    (:func:`audio_clips`' first dimension), without running wav2vec2. ``config``: the wav2vec2 config (its conv
    kernels and strides), the real one by default."""
    config = config or wav2vec2_config("real")
    samples_16k = math.ceil(num_samples * SAMPLE_RATE / rate)
    count = _resampled_count(_conv_frames(samples_16k, config.conv_kernel, config.conv_stride))
    return _clips(count, fps, frames)


def layer_features(encoder: AudioEncoder, samples: np.ndarray, rate: int = SAMPLE_RATE) -> torch.Tensor:
    """float32 ``(layers, A, dim)``: every wav2vec2 hidden state of mono ``samples`` at the encoder's rate (16 kHz;
    ``wanexp.data.audio`` reads and resamples to it), interpolated from 50 to 30 frames per second,
    ``A = int(T / 50 * 30)`` (steps 1-3 of the module's text)."""
    if rate != encoder.sample_rate:
        raise ValueError(f"samples must be at the audio encoder's {encoder.sample_rate} Hz, got {rate} Hz "
                         "(wanexp.data.audio.resample)")
    samples = np.asarray(samples, dtype=np.float32)
    cfg = encoder.model.config
    frames_50 = _conv_frames(len(samples), cfg.conv_kernel, cfg.conv_stride)
    count = _resampled_count(frames_50)
    if count < 1:
        raise MediaError(f"audio of {len(samples)} samples ({len(samples) / encoder.sample_rate:.3f} s) is too short "
                         "for wav2vec2 features; it needs at least 0.05 s")
    values = encoder.extractor(samples, sampling_rate=encoder.sample_rate, return_tensors="pt").input_values
    param = next(encoder.model.parameters())
    with torch.inference_mode():
        hidden = encoder.model.wav2vec2(values.to(param.device, param.dtype), output_hidden_states=True).hidden_states
    feats = torch.cat(hidden).float()  # (layers, T, dim)
    feats = F.interpolate(feats.transpose(1, 2), size=count, mode="linear", align_corners=True)
    return feats.transpose(1, 2)


def frame_windows(features: torch.Tensor, fps: float, frames: int, m: int = 0) -> tuple[torch.Tensor, int]:
    """The window of every video frame (step 4 of the module's text): ``(layers, dim * (2m + 1), clips * frames)``
    and ``clips``. ``features``: ``(layers, A, dim)`` from :func:`layer_features`."""
    layers, count, dim = features.shape
    clips = _clips(count, fps, frames)
    total = clips * frames
    padded = math.ceil(total / fps * VIDEO_RATE)  # the audio frames the clips span
    times = np.linspace(0, total / fps, total, endpoint=False)
    index = np.clip(np.round(times * VIDEO_RATE).astype(int), 0, padded - 1)
    stride = int(VIDEO_RATE / fps)
    window = np.clip(index[:, None] + stride * np.arange(-m, m + 1), 0, count - 1)  # (total, 2m + 1)
    out = features[:, torch.from_numpy(window).to(features.device)].flatten(2)  # (layers, total, (2m + 1) * dim)
    out[:, torch.from_numpy(index >= count).to(features.device)] = 0
    return out.permute(0, 2, 1).contiguous(), clips


def audio_clips(encoder: AudioEncoder, samples: np.ndarray, rate: int, fps: float, frames: int,
                m: int = 0) -> torch.Tensor:
    """float32 ``(clips, layers, dim * (2m + 1), frames)``: a whole audio split into the clips generation makes,
    clip ``r`` the DiT's ``audio_input`` for video frames ``r * frames .. (r + 1) * frames`` (``clip_count`` of
    them; frames past the audio's end are zeros)."""
    windows, clips = frame_windows(layer_features(encoder, samples, rate), fps, frames, m)
    return windows.unflatten(-1, (clips, frames)).permute(2, 0, 1, 3).contiguous()


def audio_features(encoder: AudioEncoder, samples: np.ndarray, rate: int, fps: float, frames: int,
                   m: int = 0) -> torch.Tensor:
    """float32 ``(layers, dim * (2m + 1), frames)``, ``(25, 1024, frames)`` for the real model: the DiT's
    ``audio_input`` (batch dimension left out) for a clip of ``frames`` frames at ``fps`` whose audio is
    ``samples`` (the clip's own span, :func:`wanexp.data.audio.audio_for_clip`): the first of :func:`audio_clips`."""
    windows, _ = frame_windows(layer_features(encoder, samples, rate), fps, frames, m)
    return windows[..., :frames].contiguous()
