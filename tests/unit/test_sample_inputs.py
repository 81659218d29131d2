"""A family's own per-sample inputs and conditioning (ModelSpec.sample_inputs, Encoders.encode_media's cond) go
through the data path and the cache without shared code naming them: a fake family that declares a ``signal``
column of .npy files (a 1-D signal per sample) and whose encoders add ``signal_features`` to cond."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from wanexp.cli.cache import Progress, _encode_latents
from wanexp.data.cache import CacheIndex, CacheWriter, latent_key
from wanexp.data.datamodule import CachedDataset, ClipDataset, collate
from wanexp.data.metadata import read_metadata_with_rejects
from wanexp.models.encoders import Encoders, cached_batch


def load_signal(name: str, path: str, num_frames: int, fps: int | None, size=None, start: int = 0,
                stride: int = 1) -> torch.Tensor:
    """The fake family's load_sample_input: one value per frame of the clip's window."""
    return torch.from_numpy(np.load(path))[start:start + (num_frames - 1) * stride + 1:stride].float()


class SignalEncoders(Encoders):
    """Latents = the pixels' mean per frame; cond["signal_features"] = twice the signal."""

    def encode_media(self, batch):
        return batch["pixels"].mean(1, keepdim=True), {"signal_features": 2 * batch["signal"]}


def _data(tmp_path):
    Image.new("RGB", (16, 16), (200, 10, 10)).save(tmp_path / "a.png")
    Image.new("RGB", (16, 16), (10, 200, 10)).save(tmp_path / "b.png")
    np.save(tmp_path / "a.npy", np.arange(4, dtype=np.float32))
    (tmp_path / "m.csv").write_text("video,prompt,signal\na.png,red,a.npy\nb.png,green,\n")
    return read_metadata_with_rejects(tmp_path / "m.csv", inputs=("signal",))


def test_a_row_needs_the_familys_inputs_and_the_item_carries_them(tmp_path):
    samples, rejects = _data(tmp_path)
    assert [s.inputs for s in samples] == [(("signal", str(tmp_path / "a.npy")),)]  # resolved like the media
    assert len(rejects) == 1 and rejects[0].path.endswith("b.png") and rejects[0].reason.startswith("no signal")
    item = ClipDataset(samples, [(1, 16, 16)], load_input=load_signal)[0]
    assert torch.equal(item["signal"], torch.tensor([0.0]))
    batch = collate([item, item])
    assert batch["signal"].shape == (2, 1) and batch["pixels"].shape == (2, 3, 1, 16, 16)


def test_the_latent_key_covers_each_input_file(tmp_path):
    samples, _ = _data(tmp_path)
    (_, path), = samples[0].inputs
    key = latent_key("vae", samples[0].path, (1, 16, 16), 1, 0, False, None, inputs=[path])
    assert key != latent_key("vae", samples[0].path, (1, 16, 16), 1, 0, False, None)
    np.save(path, np.arange(5, dtype=np.float32))  # another signal: another size, another key
    assert key != latent_key("vae", samples[0].path, (1, 16, 16), 1, 0, False, None, inputs=[path])


def test_the_cache_stores_every_cond_tensor_and_gives_it_back(tmp_path):
    samples, _ = _data(tmp_path)
    item = ClipDataset(samples, [(1, 16, 16)], load_input=load_signal)[0]
    writer = CacheWriter(tmp_path / "cache", "latent")
    media = {k: item[k] for k in ("pixels", "signal")}
    rejects = _encode_latents(SignalEncoders(), iter([("k", samples[0], 0, media)]), writer, "fp32", "cpu",
                              Progress(1, 0, 0, 1e9))
    writer.close()
    index = CacheIndex(tmp_path / "cache")
    assert not rejects and sorted(index.load("k")) == ["latents", "signal_features"]
    text = CacheWriter(tmp_path / "cache", "text")
    text.add("t", {"text": torch.ones(2, 3)})
    text.close()
    cached = CachedDataset(samples, [(1, 16, 16)], [("k", "t")], CacheIndex(tmp_path / "cache"), text_len=4)[0]
    encoded = cached_batch(collate([cached]))
    assert list(encoded.cond) == ["signal_features"]
    assert torch.equal(encoded.cond["signal_features"], 2 * item["signal"][None])
    assert encoded.text.shape == (1, 4, 3)


def test_the_latent_keys_cover_the_familys_other_media_encoders(tmp_path):
    """A family's extra media encoder (EncoderInfo.media_encoders: e.g. the signal's) is part of every latent key:
    new weights there re-encode the latents' conditioning instead of reading stale entries."""
    from types import SimpleNamespace

    from wanexp.data.datamodule import MediaDataModule

    samples, _ = _data(tmp_path)
    for name in ("vae", "signal_encoder"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    info = dict(vae=str(tmp_path / "vae"), vae_dtype="fp32", layout="toy", cond_id=False, media_encoders=())
    dm = SimpleNamespace(cache_dtype="fp32", frame_stride=1, fps=None, text_cache_key=lambda p: "t",
                         encoders=SimpleNamespace(**info))
    keys = lambda: MediaDataModule.cache_keys(dm, samples, [(1, 16, 16)], [0])  # noqa: E731
    alone = keys()
    dm.encoders.media_encoders = (str(tmp_path / "signal_encoder"),)
    with_signal = keys()
    (tmp_path / "signal_encoder" / "config.json").write_text('{"dim": 8}')  # other weights of the signal encoder
    assert len({alone[0][0], with_signal[0][0], keys()[0][0]}) == 3
