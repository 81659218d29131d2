"""First-last-frame conditioning (model=tiny_flf2v, wanexp/models/wan22/flf2v.py) against the references: the DiT
input a training sample gets is the one diffusers' WanImageToVideoPipeline builds for ``last_image``; a sample's last
frame is its row's ``last_image`` or else its clip's own; the cache keeps first-frame and first-last-frame latents
apart."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import compose_cfg
from wanexp.composition import build
from wanexp.models.tiny import ensure_tiny_model
from wanexp.models.wan22.encoders import encode_image_condition

F, H, W = 9, 32, 48  # 9 frames: 3 latent frames, the last one holding pixel frames 5..8


@pytest.fixture(scope="module")
def spec(shared_dir):
    s = build(compose_cfg(["model=tiny_flf2v", f"paths.tiny_model_dir={shared_dir}/models"]).model)
    ensure_tiny_model(s)
    return s


@pytest.fixture(scope="module")
def vae(spec):
    return spec.load_vae()


def _frames(seed: int, n: int = 1) -> torch.Tensor:
    return torch.rand(n, 3, H, W, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _pil(frame: torch.Tensor) -> Image.Image:
    return Image.fromarray(((frame.permute(1, 2, 0) + 1) * 127.5).round().to(torch.uint8).numpy())


def test_the_dit_input_is_diffusers_last_image_condition(spec, vae):
    """The 20 conditioning channels (mask 4 + image condition 16) of a training sample are exactly the ``y`` diffusers'
    I2V pipeline concatenates for image=first, last_image=last (its prepare_latents, same VAE)."""
    from wanexp.models.wan22.flf2v import FLF2VA14BSpec

    first, last = _frames(0), _frames(1)
    # the pipeline preprocesses PIL images; training crops its frames to [-1, 1] floats: feed both the same pixels
    first_px, last_px = (torch.from_numpy(np.array(_pil(x[0]))).permute(2, 0, 1)[None].float() / 127.5 - 1
                         for x in (first, last))
    pipe = spec.make_pipeline({"high": spec.load_transformer("high"), "low": spec.load_transformer("low")}, vae,
                              spec.load_scheduler(), image=True).pipe
    _, y = pipe.prepare_latents(first_px, 1, 16, H, W, F, torch.float32, torch.device("cpu"),
                                torch.Generator().manual_seed(0), None, last_px)
    cond = encode_image_condition(vae, first_px, F, last_px)
    x_t = torch.randn(1, 16, 3, H // 8, W // 8)
    hidden, timestep, mask = spec.model_inputs(x_t, None, torch.tensor([0.5]), {"image_latent": cond})
    assert isinstance(spec, FLF2VA14BSpec) and mask is None and float(timestep) == 500.0
    assert torch.equal(hidden[:, :16], x_t)
    torch.testing.assert_close(hidden[:, 16:], y, rtol=0, atol=1e-6)
    # the mask: 1 on latent frame 0 (4 channels), on the last pixel frame only (the last channel of the last latent
    # frame), 0 between
    m = hidden[0, 16:20, :, 0, 0]
    assert m.tolist() == [[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 1]]
    # the causal VAE: the last frame shows in the last latent frame alone (the first-frame condition elsewhere)
    only_first = encode_image_condition(vae, first_px, F)
    assert torch.equal(cond[:, :, :2], only_first[:, :, :2])
    assert (cond[:, :, 2] - only_first[:, :, 2]).abs().max() > 1e-3  # (a random tiny VAE: small latents)


def test_a_samples_last_frame_is_its_rows_image_else_its_clips_own(spec, vae):
    """``last_image`` as loaded (image + given flag) for a row that names one, zeros for one that does not: the
    condition then ends on that image, or on the clip's own last frame."""
    from wanexp.models.wan22.flf2v import FirstLastEncoders

    pixels = torch.rand(2, 3, F, H, W, generator=torch.Generator().manual_seed(2)) * 2 - 1
    image = _frames(3)[0]
    loaded = torch.stack([torch.cat([image, torch.ones(1, H, W)]), torch.zeros(4, H, W)])
    enc = FirstLastEncoders(vae, None, None, 8)
    _, cond = enc.encode_media({"pixels": pixels, "last_image": loaded})
    expected = encode_image_condition(vae, pixels[:, :, 0], F, torch.stack([image, pixels[1, :, -1]]))
    torch.testing.assert_close(cond["image_latent"], expected, rtol=0, atol=0)
    _, own = enc.encode_media({"pixels": pixels})  # no column in the data at all: the clips' own last frames
    torch.testing.assert_close(own["image_latent"][1], expected[1], rtol=0, atol=0)


def test_the_last_image_column_loads_cropped_and_is_checked(spec, tmp_path):
    from wanexp.data.datamodule import ClipDataset, collate
    from wanexp.data.media import load_clip
    from wanexp.data.metadata import read_metadata_with_rejects
    from wanexp.generation import first_frame_image

    for name, seed in (("a.png", 0), ("b.png", 1)):
        first_frame_image(torch.rand(3, 40, 120, generator=torch.Generator().manual_seed(seed)) * 2 - 1).save(
            tmp_path / name)
    (tmp_path / "m.csv").write_text("video,prompt,last_image\na.png,a,b.png\nb.png,b,\n")
    samples, rejects = read_metadata_with_rejects(tmp_path / "m.csv", inputs=tuple(spec.sample_inputs),
                                                  fallbacks=spec.sample_input_fallbacks)
    assert not rejects and [s.inputs for s in samples] == [(("last_image", str(tmp_path / "b.png")),),
                                                           (("last_image", str(tmp_path / "b.png")),)]
    ds = ClipDataset(samples, [(1, H, W)] * 2, load_input=spec.load_sample_input)
    batch = collate([ds[0], ds[1]])
    assert batch["last_image"].shape == (2, 4, H, W)
    assert torch.equal(batch["last_image"][0, :3], load_clip(tmp_path / "b.png", 1, H, W)[:, 0])  # cropped as clips
    assert batch["last_image"][0, 3].eq(1).all()
    # a row's own clip (what a row without the column names) gives no image
    assert spec.load_sample_input("last_image", str(tmp_path / "clip.mp4"), F, 16, size=(H, W)).eq(0).all()
    assert spec.check_sample_input("last_image", str(tmp_path / "clip.mp4")) is None
    assert spec.check_sample_input("last_image", str(tmp_path / "b.png")) is None
    assert spec.check_sample_input("last_image", str(tmp_path / "gone.png")) == \
        f"last_image {tmp_path / 'gone.png'}: file not found"
    (tmp_path / "bad.png").write_text("not a png")
    assert spec.check_sample_input("last_image", str(tmp_path / "bad.png")).startswith(
        f"last_image {tmp_path / 'bad.png'}: cannot read image")


def test_first_frame_and_first_last_frame_latents_never_share_a_cache_key(spec, shared_dir):
    from wanexp.data.cache import latent_key

    i2v = build(compose_cfg(["model=tiny_i2v14b", f"paths.tiny_model_dir={shared_dir}/models"]).model)
    assert i2v.path == spec.path  # the very same weights
    ours, theirs = spec.encoder_info(), i2v.encoder_info()
    assert ours.cond_id != theirs.cond_id and ours.sample_inputs == ("last_image",) and theirs.sample_inputs == ()
    args = ("vae", str(spec.path / "model_index.json"), (F, H, W), 1, 0)
    assert latent_key(*args, ours.cond_id) != latent_key(*args, theirs.cond_id)
