"""S2V audio: reading a sample's audio, cutting a clip's span, wav2vec2 features per video frame, muxing into mp4.

The frame-window math is held to the reference twice: to the formula written out here from Wan2.2's
``get_audio_embed_bucket_fps`` definition, and (when the ``diffsynth`` package is importable, installed
``--no-deps``) to DiffSynth-Studio's copy of Wan2.2's audio encoder, run on the same tiny wav2vec2.
"""

from __future__ import annotations

import importlib.util
import math
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from wanexp.data.audio import audio_for_clip, find_audio, read_audio, resample
from wanexp.data.media import MediaError, write_video
from wanexp.models.s2v.audio_encoder import (
    audio_clips,
    audio_features,
    clip_count,
    frame_windows,
    layer_features,
    load_audio_encoder,
    wav2vec2_config,
    write_tiny_wav2vec2,
)


# ----------------------------------------------------------------------------- helpers
def _tone(hz: float, seconds: float, rate: int, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def _peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[np.argmax(spectrum)])


def _write_media(path: Path, channels: list[np.ndarray] | None, rate: int, codec: str,
                 video_frames: int = 0, fps: int = 16) -> Path:
    """A file written straight with PyAV (not wanexp's writer): optional grey video frames, optional audio
    channels (``codec`` at ``rate``)."""
    with av.open(str(path), mode="w") as out:
        video = sound = None
        if video_frames:
            video = out.add_stream("mpeg4", rate=fps)
            video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        if channels is not None:
            layout = {1: "mono", 2: "stereo"}[len(channels)]
            sound = out.add_stream(codec, rate=rate, layout=layout)
        if video is not None:
            grey = np.full((32, 32, 3), 128, np.uint8)
            for _ in range(video_frames):
                out.mux(video.encode(av.VideoFrame.from_ndarray(grey, format="rgb24")))
            out.mux(video.encode(None))
        if sound is not None:
            planes = np.stack(channels).astype(np.float32)
            fmt = sound.codec_context.format.name
            data = planes if fmt.endswith("p") else planes.T.reshape(1, -1)
            if fmt.startswith("s16"):
                data = np.round(data * 32767).astype(np.int16)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=fmt, layout=layout)
            frame.sample_rate, frame.pts, frame.time_base = rate, 0, Fraction(1, rate)
            out.mux(sound.encode(frame))
            out.mux(sound.encode(None))
    return path


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return load_audio_encoder(write_tiny_wav2vec2(tmp_path_factory.mktemp("wav2vec2")))


def _reference_windows(z: torch.Tensor, fps: float, frames: int, m: int) -> tuple[torch.Tensor, int]:
    """Wan2.2's ``get_audio_embed_bucket_fps`` from its definition, frame by frame (video_rate 30): the clip count
    ``int(A / (frames * 30 / fps)) + 1``, frame ``i`` at 30-per-second index ``round(i / fps * 30)`` (clamped to the
    padded span), its ``2m + 1`` neighbours ``int(30 / fps)`` apart clamped to the audio, zeros past the audio."""
    layers, count, dim = z.shape
    clips = int(count / (frames * (30 / fps))) + 1
    total = clips * frames
    span = math.ceil(total / fps * 30)
    rows = []
    for i, t in enumerate(np.linspace(0, total / fps, total, endpoint=False)):
        bi = min(int(np.round(t * 30)), span - 1)
        if bi < count:
            step = int(30 / fps)
            idx = [min(max(c, 0), count - 1) for c in range(bi - m * step, bi + (m + 1) * step, step)]
            rows.append(z[:, idx].reshape(layers, -1))
        else:
            rows.append(torch.zeros(layers, dim * (2 * m + 1)))
    return torch.stack(rows, dim=-1), clips


def _diffsynth_wav2vec():
    """DiffSynth-Studio's ``diffsynth/models/wav2vec.py``, loaded from the installed package's files (the package's
    own __init__ needs its full dependency set; this module needs only numpy and torch), found in the folders of
    WANEXP_S2V_REFERENCE (``make test`` installs it there) or on the path."""
    import os
    import sys

    folders = [p for p in os.environ.get("WANEXP_S2V_REFERENCE", "").split(os.pathsep) if p]
    # by its file, not find_spec: the DiT's reference test may have put an empty "diffsynth" package in sys.modules
    path = next((Path(p) / "diffsynth" / "models" / "wav2vec.py" for p in [*folders, *sys.path]
                 if p and (Path(p) / "diffsynth" / "models" / "wav2vec.py").is_file()), None)
    if path is None:
        pytest.skip("diffsynth not importable: pip install --no-deps --target REF/diffsynth diffsynth==2.1.12, then "
                    "WANEXP_S2V_REFERENCE=REF/diffsynth")
    module_spec = importlib.util.spec_from_file_location("diffsynth_wav2vec_reference", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- reading audio
def test_reads_the_audio_stream_of_a_video(tmp_path):
    tone = _tone(440, 2.0, 44100)
    clip = _write_media(tmp_path / "talk.mp4", [tone, tone], 44100, "aac", video_frames=32)
    samples, rate = read_audio(clip)
    assert rate == 16000 and samples.dtype == np.float32 and samples.ndim == 1
    assert len(samples) == 32000  # the stream's stated 2 s, the AAC decoder's padding of its last frame dropped
    assert abs(_peak_hz(samples, rate) - 440) < 1.0
    assert abs(float(np.sqrt(np.mean(samples[4000:-4000] ** 2))) - 0.5 / math.sqrt(2)) < 0.02


def test_reads_a_same_name_wav_beside_the_clip_and_averages_its_channels(tmp_path):
    clip = _write_media(tmp_path / "talk.mp4", None, 0, "", video_frames=8)
    tone = _tone(300, 1.0, 22050)
    _write_media(tmp_path / "talk.wav", [tone, np.zeros_like(tone)], 22050, "pcm_s16le")
    source = find_audio(clip)
    assert source == str(tmp_path / "talk.wav")
    samples, rate = read_audio(source)
    assert len(samples) == 16000 and abs(_peak_hz(samples, rate) - 300) < 1.0
    # left = tone, right = silence: the mono mix is their mean, half the tone's amplitude (as librosa's to_mono)
    assert abs(float(np.abs(samples[1000:-1000]).max()) - 0.25) < 0.01


def test_an_explicit_audio_path_wins_over_a_side_file_and_the_stream(tmp_path):
    clip = _write_media(tmp_path / "talk.mp4", [_tone(440, 1.0, 16000)], 16000, "aac", video_frames=16)
    _write_media(tmp_path / "talk.wav", [_tone(300, 1.0, 16000)], 16000, "pcm_s16le")
    other = _write_media(tmp_path / "voice.flac", [_tone(600, 1.0, 16000)], 16000, "flac")
    assert find_audio(clip, other) == str(other)
    assert abs(_peak_hz(read_audio(find_audio(clip, other))[0], 16000) - 600) < 1.0
    assert find_audio(clip) == str(tmp_path / "talk.wav")
    (tmp_path / "talk.wav").unlink()
    assert find_audio(clip) == str(clip)
    with pytest.raises(MediaError, match=r"voice\.mp3: audio file not found \(the audio_path of .*talk\.mp4\)"):
        find_audio(clip, tmp_path / "voice.mp3")


def test_a_clip_without_audio_is_refused_in_one_line_naming_it(tmp_path):
    clip = _write_media(tmp_path / "silent.mp4", None, 0, "", video_frames=8)
    with pytest.raises(MediaError) as err:
        find_audio(clip)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{clip}: no audio stream and no silent.wav")
    with pytest.raises(MediaError, match=r"silent\.mp4: no audio stream$"):
        read_audio(clip)


def test_resample_keeps_the_tone_and_the_length():
    out = resample(_tone(1000, 1.5, 48000), 48000, 16000)
    assert len(out) == 24000 and abs(_peak_hz(out, 16000) - 1000) < 1.0
    reference = _tone(1000, 1.5, 16000)
    assert float(np.abs(out[100:-100] - reference[100:-100]).max()) < 1e-3  # no delay, no gain change


def test_audio_for_clip_cuts_exactly_the_clips_span():
    samples = np.arange(48000, dtype=np.float32)  # 3 s at 16 kHz, sample value = its index
    seg = audio_for_clip(samples, 16000, start_s=0.5, frames=17, fps=16)
    assert len(seg) == 17000 and seg[0] == 8000 and seg[-1] == 24999
    np.testing.assert_array_equal(seg, np.arange(8000, 25000, dtype=np.float32))
    # at 24 fps, 10 frames from frame 12: 0.5 s .. 0.9167 s
    seg = audio_for_clip(samples, 16000, start_s=12 / 24, frames=10, fps=24)
    np.testing.assert_array_equal(seg, np.arange(8000, 8000 + round(10 * 16000 / 24), dtype=np.float32))
    tail = audio_for_clip(samples, 16000, start_s=2.5, frames=16, fps=16)  # 1 s asked, 0.5 s left
    assert len(tail) == 16000
    np.testing.assert_array_equal(tail[:8000], samples[40000:])
    assert not tail[8000:].any()


# ----------------------------------------------------------------------------- wav2vec2 features
def test_features_have_the_dits_shape_per_layer_and_frame(encoder):
    samples = _tone(220, 80 / 16, 16000)  # one S2V clip: 80 frames at 16 fps
    z = layer_features(encoder, samples)
    t50 = (80000 - 400) // 320 + 1  # the conv stack's frames (kernel 400 samples, stride 320 overall)
    assert z.shape == (3, int(t50 / 50 * 30), 32) and z.dtype == torch.float32  # layers + 1 hidden states
    feats = audio_features(encoder, samples, 16000, fps=16, frames=80)
    assert feats.shape == (3, 32, 80)
    assert feats.abs().sum(dim=(0, 1)).gt(0).all()  # the exact span covers every frame: none zero-filled


def test_frame_windows_follow_the_references_formula(encoder):
    z = layer_features(encoder, np.random.default_rng(0).standard_normal(16000 * 3 + 77).astype(np.float32))
    # (15, 45): the 90 frames at 30/s fill exactly one clip, and the rule still opens a second, all zeros
    for fps, frames, m in [(16, 80, 0), (16, 12, 1), (15, 17, 2), (25, 33, 0), (8, 5, 1), (15, 45, 0)]:
        got, clips = frame_windows(z, fps, frames, m)
        want, want_clips = _reference_windows(z, fps, frames, m)
        assert clips == want_clips and got.shape == (3, 32 * (2 * m + 1), clips * frames)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    zero = frame_windows(z, 16, 80)[0].abs().sum(dim=(0, 1)) == 0  # 3 s in one 5 s clip: frames past 3 s are zeros
    assert zero.tolist() == [round(i / 16 * 30) >= z.shape[1] for i in range(80)] and 0 < int(zero.sum()) < 80


def test_features_match_diffsynths_wan_s2v_audio_encoder(encoder):
    ref = _diffsynth_wav2vec()
    this = ref.WanS2VAudioEncoder.__new__(ref.WanS2VAudioEncoder)  # its __init__ builds the real-size model
    torch.nn.Module.__init__(this)
    this.model, this.video_rate = encoder.model, 30
    samples = np.random.default_rng(1).standard_normal(16000 * 4 + 321).astype(np.float32)
    z_ref = this.extract_audio_feat(samples, 16000, encoder.extractor, return_all_layers=True)
    z = layer_features(encoder, samples)
    torch.testing.assert_close(z, z_ref, rtol=0, atol=0)
    for fps, frames, m in [(16, 80, 0), (16, 48, 0), (15, 17, 2)]:
        want, want_clips = this.get_audio_embed_bucket_fps(z_ref, fps=fps, batch_frames=frames,
                                                                             m=m)
        got, clips = frame_windows(z, fps, frames, m)
        assert clips == want_clips
        torch.testing.assert_close(got, want.permute(1, 2, 0), rtol=0, atol=0)
    per_clip = this.get_audio_feats_per_inference(samples, 16000, encoder.extractor, fps=16,
                                                                      batch_frames=48)
    clips = audio_clips(encoder, samples, 16000, fps=16, frames=48)
    assert len(per_clip) == clips.shape[0] == 2
    for r, want in enumerate(per_clip):
        torch.testing.assert_close(clips[r], want[0], rtol=0, atol=0)


def test_long_audio_splits_into_the_references_clip_count(encoder):
    rng = np.random.default_rng(2)
    for seconds in (0.7, 3.0, 5.02, 10.0):
        samples = rng.standard_normal(round(seconds * 16000)).astype(np.float32)
        clips = audio_clips(encoder, samples, 16000, fps=16, frames=16)
        assert clips.shape == (clip_count(len(samples), fps=16, frames=16), 3, 32, 16)
        windows, n = frame_windows(layer_features(encoder, samples), 16, 16)
        assert n == clips.shape[0]
        torch.testing.assert_close(clips[-1], windows[..., -16:], rtol=0, atol=0)
        torch.testing.assert_close(audio_features(encoder, samples, 16000, 16, 16), clips[0], rtol=0, atol=0)
    # the real model's rule: 10 s -> 499 wav2vec2 frames -> 299 at 30/s -> 2 clips of 80 frames at 16 fps (150 each)
    assert clip_count(160000, fps=16, frames=80) == 2
    assert clip_count(44100 * 10, fps=16, frames=80, rate=44100) == 2
    assert clip_count(16000 * 15, fps=16, frames=80) == 3  # 449 frames at 30/s: 2.99 clips
    assert clip_count(160080, fps=16, frames=80) == 3  # 500 -> 300 frames: exactly 2 clips, a third opened


def test_the_tiny_folder_is_laid_out_like_the_real_one(tmp_path):
    from transformers import Wav2Vec2Processor

    folder = write_tiny_wav2vec2(tmp_path / "wav2vec2-large-xlsr-53-english")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "vocab.json"} <= names
    processor = Wav2Vec2Processor.from_pretrained(str(folder))  # how the references read the folder
    assert processor.feature_extractor.do_normalize and processor.feature_extractor.sampling_rate == 16000
    assert processor.tokenizer.convert_tokens_to_ids("A") == 7 and len(processor.tokenizer) == 33


def test_the_real_size_config_gives_the_dits_audio_input():
    from transformers import Wav2Vec2ForCTC

    config = wav2vec2_config("real")
    with torch.device("meta"):
        model = Wav2Vec2ForCTC(config)
    # the S2V DiT's causal audio encoder weights 25 layers of width 1024 (its num_layers and audio_dim)
    assert config.num_hidden_layers + 1 == 25 and config.hidden_size == 1024 and config.do_stable_layer_norm
    assert 315_000_000 < sum(p.numel() for p in model.parameters()) < 316_000_000
    assert model.lm_head.out_features == 33


# ----------------------------------------------------------------------------- muxing
def test_write_video_muxes_the_audio_cut_to_the_video(tmp_path):
    frames = np.zeros((33, 32, 48, 3), np.uint8)
    tone = _tone(440, 3.0, 16000)  # longer than the 33 / 16 s of video
    out = tmp_path / "out.mp4"
    write_video(out, frames, fps=16, audio=(tone, 16000))
    with av.open(str(out)) as container:
        video, sound = container.streams.video[0], container.streams.audio[0]
        assert sound.codec_context.name == "aac" and sound.rate == 16000
        assert abs(float(video.duration * video.time_base) - 33 / 16) < 1e-6
        assert abs(float(sound.duration * sound.time_base) - 33 / 16) < 0.01
    samples, rate = read_audio(out)
    assert abs(len(samples) - 33000) <= 16 and abs(_peak_hz(samples, rate) - 440) < 1.0
    plain = tmp_path / "plain.mp4"
    write_video(plain, frames, fps=16)
    with av.open(str(plain)) as container:
        assert len(container.streams.audio) == 0 and len(container.streams.video) == 1


def test_a_missing_or_incomplete_folder_and_too_short_audio_are_refused_in_one_line(tmp_path, encoder):
    from wanexp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"nowhere: wav2vec2 folder not found; .* wav2vec2-large-xlsr-53-english/$"):
        load_audio_encoder(tmp_path / "nowhere")
    folder = write_tiny_wav2vec2(tmp_path / "w2v")
    (folder / "model.safetensors").unlink()
    (folder / "preprocessor_config.json").unlink()
    with pytest.raises(ConfigError, match=r"w2v: not a complete wav2vec2 folder \(missing "
                                          r"preprocessor_config\.json, model\.safetensors\)$"):
        load_audio_encoder(folder)
    with pytest.raises(MediaError, match=r"^audio of 600 samples \(0\.037 s\) is too short for wav2vec2 features"):
        layer_features(encoder, np.zeros(600, np.float32))
    assert layer_features(encoder, np.zeros(720, np.float32)).shape[1] == 1  # 2 wav2vec2 frames -> 1 at 30/s
    with pytest.raises(ValueError, match=r"at the audio encoder's 16000 Hz, got 44100 Hz"):
        audio_features(encoder, np.zeros(44100, np.float32), 44100, fps=16, frames=16)
