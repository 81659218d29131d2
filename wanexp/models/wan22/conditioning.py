"""Model inputs for each Wan2.2 layout, as pure tensor functions.

Latents are (B, C, F, H, W) on the latent grid. The DiT patchifies H and W by 2, so one token covers a 2x2 latent
patch of one latent frame.
"""
from __future__ import annotations

import torch


def ti2v_inputs(
    x_t: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor, first_frame: torch.Tensor, patch: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TI2V-5B: per-token timesteps; image-conditioned samples get the clean latent frame 0 at timestep 0.

    ``first_frame`` is a bool tensor (B,). Returns (hidden_states, timestep (B, seq_len), loss_mask (B,1,F,1,1)).
    """
    b, _, f, h, w = x0.shape
    cond = torch.zeros(b, 1, f, 1, 1, device=x0.device, dtype=torch.bool)
    cond[:, :, 0] = first_frame.view(b, 1, 1, 1).to(x0.device, non_blocking=True)  # B host bools: no sync
    hidden = torch.where(cond, x0, x_t)
    pt, ph, pw = patch
    noisy = (~cond).expand(b, 1, f, h, w)[:, 0, ::pt, ::ph, ::pw].to(torch.float32)
    timestep = (noisy * (1000.0 * sigma.float()).view(b, 1, 1, 1)).flatten(1)
    return hidden, timestep, ~cond


def i2v_mask_channels(b: int, f: int, h: int, w: int, vae_stride_t: int, device, dtype,
                      last_frame: bool = False) -> torch.Tensor:
    """I2V-A14B mask: 1 on latent frame 0 (the given image), 0 elsewhere, as ``vae_stride_t`` channels;
    ``last_frame`` (first-last-frame conditioning): 1 on the last pixel frame too, i.e. on the last mask channel of the
    last latent frame, as Wan2.1's FLF2V and diffusers' ``last_image`` build it.

    The pixel mask's frame 0 is repeated ``vae_stride_t`` times so the pixel frames fold evenly into latent frames.
    """
    pixel_frames = (f - 1) * vae_stride_t + 1
    m = torch.zeros(b, pixel_frames, h, w, device=device, dtype=dtype)
    m[:, 0] = 1
    if last_frame:
        m[:, -1] = 1
    m = torch.cat([m[:, :1].repeat(1, vae_stride_t - 1, 1, 1), m], dim=1)  # (B, F*stride, h, w)
    return m.view(b, f, vae_stride_t, h, w).transpose(1, 2)  # (B, stride, F, h, w)


def i2v_inputs(x_t: torch.Tensor, sigma: torch.Tensor, image_latent: torch.Tensor, vae_stride_t: int = 4,
               last_frame: bool = False):
    """I2V-A14B: concat(noisy 16ch, mask 4ch, image condition 16ch); scalar timestep per sample. ``last_frame``:
    the condition carries the last frame too (first-last-frame), and the mask marks it."""
    b, _, f, h, w = x_t.shape
    mask = i2v_mask_channels(b, f, h, w, vae_stride_t, x_t.device, x_t.dtype, last_frame)
    hidden = torch.cat([x_t, mask, image_latent.to(x_t.dtype)], dim=1)
    return hidden, 1000.0 * sigma.float(), None


def t2v_inputs(x_t: torch.Tensor, sigma: torch.Tensor):
    """T2V-A14B: the noisy latents as they are; scalar timestep per sample."""
    return x_t, 1000.0 * sigma.float(), None
