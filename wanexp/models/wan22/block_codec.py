"""A Wan2.2 VAE (``AutoencoderKLWan``, the TI2V layout) whose weights are set by hand so that it is a transparent
codec: the latent of a video is its colour averaged over each 16 x 16-pixel block and each frame, and decoding paints
those averages back as flat blocks. A tiny model with this VAE (``model.build.vae_weights: block_average``) generates
videos a person can read, so its training shows what it learned (the demo's coloured squares); a random VAE decodes
any latent to noise.

How: every residual branch of the encoder and decoder is switched off (its last convolution zero), so the signal
takes the layout's parameter-free shortcuts (``AvgDown3D``: 2 x 2 block means, time steps moved into channels;
``DupUp3D``: the inverse duplication). The few layers that are left set the channel routing: the input convolutions
(the colours), the convolutions of the decoder's two temporal up-samplings (the frame order, which their shortcuts
alone would repeat), and the output convolutions. The output heads' RMS norm and SiLU are made linear: a large
constant channel, added by a residual branch's bias, fixes the norm's denominator, and each value travels with its
negative, since ``silu(v) - silu(-v) = v`` exactly.

The latent (48 channels): channel ``12 j + 4 c + f`` (replica j = 0..3, colour c = R, G, B, frame f = 0..3 of the
latent frame's four) holds the mean of colour c in [-1, 1]; the first latent frame, which holds the clip's frame 0
alone, has it at f = 3 and zeros at f < 3. The decoder averages the four replicas.
"""
from __future__ import annotations

import torch

__all__ = ["LATENT_STD", "block_average_latents", "block_average_vae", "set_block_average_weights"]

_CONSTANT = 1.0e3  # the norm heads' constant channel: its size against the content's (|v| <= 1, 32 values) sets the
                   # relative error, about 32 / (2 * 1e6) = 1.6e-5
_REPLICAS = 4
# The latents' normalisation (the VAE's latents_std; latents_mean 0): the model sees twice the colour means, so a
# denoising error shows at half its size in the decoded frames (a tiny DiT's leftover noise stays faint).
LATENT_STD = 0.5


BLOCK = 16  # pixels per latent cell, each way (the TI2V VAE's spatial stride)


def block_average_latents(frames) -> torch.Tensor:
    """The codec's latent of uint8 frames (F, H, W, 3) (F = 4k + 1; H, W multiples of 16), computed directly:
    (48, k + 1, H / 16, W / 16) fp32, what ``vae.encode(...).latent_dist.mode()`` of the codec gives (to float
    rounding) without running the VAE."""
    x = torch.as_tensor(frames).float().div(127.5).sub(1.0)  # (F, H, W, 3) in [-1, 1]
    f, h, w, _ = x.shape
    if (f - 1) % 4 or h % BLOCK or w % BLOCK:
        raise ValueError(f"frames of shape {tuple(x.shape)}: need 4k + 1 frames and a height and width that divide "
                         f"by {BLOCK}")
    means = x.view(f, h // BLOCK, BLOCK, w // BLOCK, BLOCK, 3).mean(dim=(2, 4)).permute(3, 0, 1, 2)  # (3, F, h, w)
    slots = torch.zeros(3, 4, (f - 1) // 4 + 1, h // BLOCK, w // BLOCK)  # (colour, frame of four, latent frame)
    slots[:, 3, 0] = means[:, 0]  # the first latent frame: frame 0 alone, in the last slot
    slots[:, :, 1:] = means[:, 1:].reshape(3, -1, 4, h // BLOCK, w // BLOCK).transpose(1, 2)
    return slots.reshape(12, *slots.shape[2:]).repeat(_REPLICAS, 1, 1, 1)


def _centre_tap(conv) -> tuple[int, ...]:
    """Index of the kernel tap that reads the current frame at the same position (causal in time)."""
    k = conv.weight.shape[2:]
    return (k[0] - 1, *(s // 2 for s in k[1:])) if len(k) == 3 else tuple(s // 2 for s in k)


def _set_map(conv, matrix: torch.Tensor) -> None:
    """Make ``conv`` the per-position channel map ``matrix`` (out, in): the current frame's centre tap only."""
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[(slice(None), slice(None), *_centre_tap(conv))] = matrix.to(conv.weight.dtype)
        if conv.bias is not None:
            conv.bias.zero_()


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"set_block_average_weights: {what}; it needs the Wan2.2 (TI2V) VAE layout: is_residual, "
                         "patch_size 2, dim_mult [1, 2, 4, 4], temperal_downsample [False, True, True], z_dim 48")


def block_average_vae(**config):
    """An AutoencoderKLWan of ``config`` (the layout's ``vae_layout`` and the build's sizes) with the codec's weights
    and its latents_mean (0) and latents_std (:data:`LATENT_STD`)."""
    from diffusers import AutoencoderKLWan

    z = config["z_dim"]
    return set_block_average_weights(AutoencoderKLWan(**config, latents_mean=[0.0] * z, latents_std=[LATENT_STD] * z))


@torch.no_grad()
def set_block_average_weights(vae):
    """Set every weight of ``vae`` (an AutoencoderKLWan of the Wan2.2 TI2V layout, any ``base_dim >= 8``,
    ``decoder_base_dim >= 8`` and ``num_res_blocks``) so that it is the block-average codec of the module docstring.
    Its latents_mean/std are config values, set when it is made (:func:`block_average_vae`). Returns ``vae``."""
    cfg = vae.config
    _expect(cfg.is_residual and cfg.patch_size == 2 and list(cfg.dim_mult) == [1, 2, 4, 4]
            and list(cfg.temperal_downsample) == [False, True, True] and cfg.z_dim == 48, "another VAE layout")
    enc, dec = vae.encoder, vae.decoder
    _expect(enc.dim >= 8 and dec.dim >= 8, "base_dim and decoder_base_dim must be at least 8")
    for p in vae.parameters():
        p.zero_()
    eye = torch.eye

    # ---- encoder: patchified pixels (12 = colour * 4 + patch position) -> conv_in channels k: +R +G +B -R -G -B
    e0 = enc.dim
    m = torch.zeros(e0, 12)
    for c in range(3):
        m[c, 4 * c:4 * c + 4] = 0.25
        m[c + 3, 4 * c:4 * c + 4] = -0.25
    _set_map(enc.conv_in, m)
    # the down blocks' shortcuts: 2x2 means; the two temporal ones put frame pairs into channels, so after them
    # conv_in channel k's frame f = 2b + a of each four is at channel 4k + 2a + b (blocks 1 and 2 double the count)
    # of width 4 * e0; the last block (no resampling) adds its identity branch to its identity shortcut: 2x
    top = enc.norm_out.gamma.shape[0]
    _expect(top == 4 * e0, "encoder widths other than base_dim * [1, 1, 2, 4, 4]")
    const = 4 * 6  # the first channel of conv_in channel 6 (unused): the norm's constant
    enc.mid_block.resnets[-1].conv2.bias[const] = _CONSTANT
    gamma = torch.full((top,), _CONSTANT / (2 * top ** 0.5))
    gamma[const] = 0.0
    enc.norm_out.gamma.copy_(gamma.view_as(enc.norm_out.gamma))
    m = torch.zeros(2 * cfg.z_dim, top)  # the means, then the log-variances (zero: the cache takes the mode)
    for j in range(_REPLICAS):
        for c in range(3):
            for a in range(2):
                for b in range(2):
                    z = 12 * j + 4 * c + 2 * b + a
                    m[z, 4 * c + 2 * a + b] = 1.0
                    m[z, 4 * (c + 3) + 2 * a + b] = -1.0
    _set_map(enc.conv_out, m)
    _set_map(vae.quant_conv, eye(2 * cfg.z_dim))
    _set_map(vae.post_quant_conv, eye(cfg.z_dim))

    # ---- decoder: latent -> x[4p + f] (p: +R +G +B -R -G -B, f: frame of four), the replicas averaged
    d0 = dec.conv_in.weight.shape[0]
    last = dec.norm_out.gamma.shape[0]
    _expect(d0 == 4 * dec.dim and last == dec.dim and len(dec.up_blocks) == 4,
            "decoder widths other than decoder_base_dim * [4, 4, 4, 2, 1]")
    m = torch.zeros(d0, cfg.z_dim)
    for j in range(_REPLICAS):
        for c in range(3):
            for f in range(4):
                m[4 * c + f, 12 * j + 4 * c + f] = 1.0 / _REPLICAS
                m[4 * (c + 3) + f, 12 * j + 4 * c + f] = -1.0 / _REPLICAS
    _set_map(dec.conv_in, m)
    # Up blocks 0 and 1 double the frames; their shortcuts repeat each channel in both new frames, so their branches
    # put the frames in order: block 0 splits x[4p + f] (f = 2s + t) into frame s as u[2p + t], block 1 splits that
    # into frame t as w[2p + h] (h = 0, 1: the rows block 2's shortcut spreads channels 2p and 2p + 1 over).
    n = d0

    def split(first: dict, rest, wanted) -> tuple[torch.Tensor, torch.Tensor]:
        """(temporal conv, spatial conv) of a frame-doubling block whose frame s must be ``wanted[s] @ x``.

        Frame s is x + C T_s x (C: the spatial conv's centre tap, T_s the temporal conv's half for frame s), so
        T_s = C^-1 (wanted[s] - I). On the first latent frame the temporal conv is skipped: one frame x + C x, of
        which the shortcut keeps the second copy. ``first``: column j -> what x + C x must hold for the input
        channel j that carries the first frame; ``rest``: C's column for the other channels (keeping C
        invertible)."""
        c = torch.stack([first[j] - eye(n)[j] if j in first else rest(j) for j in range(n)], dim=1)
        return torch.cat([torch.linalg.solve(c, w - eye(n)) for w in wanted]), c

    def frames(pairs) -> list[torch.Tensor]:
        out = []
        for s in range(2):
            d = torch.zeros(n, n)
            for dst, src in pairs(s):
                d[dst, src] = 1.0
            out.append(d)
        return out

    # block 0: u_s[2p + t] = x[4p + 2s + t]; the first latent frame holds frame 0 at f = 3 -> u[2p + 1], and
    # whatever a generated latent holds at f < 3 there is dropped (x + C x = 0 on those channels)
    t0, c0 = split({4 * p + 3: eye(n)[2 * p + 1] for p in range(8)}, lambda j: -eye(n)[j],
                   frames(lambda s: [(2 * p + t, 4 * p + 2 * s + t) for p in range(8) for t in range(2)]))
    # block 1: w_t[2p + h] = u[2p + t]; the first frame is at u[2p + 1] -> w[2p] and w[2p + 1]
    t1, c1 = split({2 * p + 1: eye(n)[2 * p] + eye(n)[2 * p + 1] for p in range(8)}, lambda j: eye(n)[j ^ 1],
                   frames(lambda t: [(2 * p + h, 2 * p + t) for p in range(8) for h in range(2)]))
    for block, (tc, sc) in zip(dec.up_blocks[:2], ((t0, c0), (t1, c1))):
        _set_map(block.upsampler.time_conv, tc)
        _set_map(block.upsampler.resample[1], sc)
    # block 2: its shortcut alone (v[p] at row h from w[2p + h]); block 3 (no shortcut): its first residual
    # block's shortcut conv passes v[p], its last one's branch adds the norm's constant
    dconst = 7  # p = 7: unused
    _set_map(dec.up_blocks[3].resnets[0].conv_shortcut, eye(last, 2 * dec.dim))
    dec.up_blocks[3].resnets[-1].conv2.bias[dconst] = _CONSTANT
    gamma = torch.full((last,), _CONSTANT / last ** 0.5)
    gamma[dconst] = 0.0
    dec.norm_out.gamma.copy_(gamma.view_as(dec.norm_out.gamma))
    m = torch.zeros(12, last)
    for c in range(3):
        m[4 * c:4 * c + 4, c] = 1.0
        m[4 * c:4 * c + 4, c + 3] = -1.0
    _set_map(dec.conv_out, m)
    return vae
