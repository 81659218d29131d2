"""The block-average codec (model.build.vae_weights=block_average): a Wan2.2 VAE whose latent of a video is its colour
averaged over 16 x 16-pixel blocks and each frame, and whose decoding paints those means back, frame by frame."""
from __future__ import annotations

import pytest
import torch

from wanexp.models.wan22.block_codec import LATENT_STD, block_average_latents, block_average_vae
from wanexp.models.wan22.layouts import LAYOUTS


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    config = dict(LAYOUTS["ti2v"].vae_layout, base_dim=8, decoder_base_dim=8, num_res_blocks=1)
    return block_average_vae(**config).eval()


def _frames(num: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """uint8 (F, H, W, 3) frames of random colours, one per 16 x 16 block and frame."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (num, h // 16, w // 16, 3), generator=g, dtype=torch.uint8)
    return blocks.repeat_interleave(16, 1).repeat_interleave(16, 2)


@torch.no_grad()
def test_the_codec_encodes_block_means_and_decodes_them_back_frame_by_frame(vae):
    frames = _frames(9, 32, 48)
    pixels = frames.float().div(127.5).sub(1).permute(3, 0, 1, 2)[None]
    latent = vae.encode(pixels).latent_dist.mode()[0]
    assert latent.shape == (48, 3, 2, 3) and vae.config.latents_std == [LATENT_STD] * 48
    assert torch.allclose(latent, block_average_latents(frames), atol=1e-4)
    # the layout: channel 12 j + 4 c + f holds colour c of frame f of the latent frame's four (frame 0 alone at f=3)
    assert latent[4 * 0 + 3, 0] == pytest.approx(pixels[0, 0, 0, ::16, ::16], abs=1e-4)
    assert latent[12 + 4 * 2 + 1, 2] == pytest.approx(pixels[0, 2, 6, ::16, ::16], abs=1e-4)
    assert torch.allclose(vae.decode(latent[None]).sample[0], pixels, atol=1e-4)
    # frames that are not flat per block come back as their block means
    smooth = torch.rand(1, 3, 5, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    means = torch.nn.functional.avg_pool3d(smooth, (1, 16, 16)).repeat_interleave(16, 3).repeat_interleave(16, 4)
    assert torch.allclose(vae.decode(vae.encode(smooth).latent_dist.mode()).sample, means, atol=1e-4)


@torch.no_grad()
def test_what_a_generated_latent_holds_in_the_first_frames_unused_slots_is_ignored(vae):
    latent = block_average_latents(_frames(5, 32, 32))[None]
    noisy = latent.clone()
    unused = torch.tensor([(i % 12) % 4 != 3 for i in range(48)])
    noisy[:, unused, 0] += torch.randn_like(noisy[:, unused, 0])
    assert torch.allclose(vae.decode(noisy).sample[:, :, 0], vae.decode(latent).sample[:, :, 0], atol=1e-4)


def test_another_layout_is_refused():
    from diffusers import AutoencoderKLWan

    from wanexp.models.wan22.block_codec import set_block_average_weights

    with pytest.raises(ValueError, match="Wan2.2 \\(TI2V\\) VAE layout"):  # the Wan2.1 VAE
        set_block_average_weights(AutoencoderKLWan(base_dim=8, z_dim=16, num_res_blocks=1))


def test_an_unknown_vae_weights_is_one_line():
    from tests.conftest import compose_cfg
    from wanexp.composition import build
    from wanexp.errors import ConfigError
    from wanexp.models.wan22.build import build_components

    spec = build(compose_cfg(["experiment=demo", "+model.build.vae_weights=pixel"]).model)
    with pytest.raises(ConfigError, match="model.build.vae_weights='pixel': one of random \\(the default\\), "
                                          "block_average"):
        build_components(spec)
