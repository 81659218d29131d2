"""The Wan2.2-S2V-14B diffusion transformer (speech-to-video) as a diffusers-style module.

It computes the function of the original ``WanModel_S2V`` (Wan2.2 ``wan/modules/s2v/model_s2v.py``) in the released
configuration: FramePack motion frames, audio AdaLN, a zero timestep for the reference and motion tokens. The main
blocks are diffusers' ``WanTransformerBlock`` (``attn1``/``attn2`` with ``to_q, to_k, to_v, to_out.0``, ``norm_q``,
``norm_k``; ``ffn.net.0.proj``/``ffn.net.2``; ``scale_shift_table``) with a forward that modulates two segments of
the sequence separately, and carry the audio cross-attention of the original's audio injector in the blocks it is
injected into (``blocks.N.audio_injector``), so per-block machinery (checkpointing, block swap, FP8 storage, FSDP)
covers it. Key names of the original release: :mod:`wanexp.models.s2v.original`.

One forward's token sequence (every sample of a batch has the same shapes)::

    [ noisy video (F*h*w) | reference image (h_r*w_r) | motion frames (FramePack: h*w + h*w/4 + 4*h*w/16, on the
                                                          patch grid h = H/2, w = W/2; none when dropped) ]

The noisy tokens are modulated by the timestep, the others by the embedding of timestep 0 (``zero_timestep``).
Rotary positions: noisy frames 0..F-1, the reference at frame 30, the motion frames at negative frames (the most
recent latent at -1, two at -3 packed 2x, sixteen at -19..-4 packed 4x), their rows and columns spread over the patch
grid as in the original. A learned embedding per segment (``trainable_cond_mask``: 0 noisy, 1 reference, 2 motion)
is added to the tokens. The audio cross-attention of an injected block lets each noisy latent frame's tokens attend
to that frame's audio tokens only (``num_audio_token`` + 1 per frame). Only the noisy tokens reach the output head.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import AdaLayerNorm, FP32LayerNorm
from diffusers.models.transformers.transformer_wan import (
    WanAttention,
    WanAttnProcessor,
    WanTimeTextImageEmbedding,
    WanTransformerBlock,
)
from torch import nn

REF_FRAME = 30  # rotary frame position of the reference image's tokens
ZIP_FRAME_BUCKETS = (1, 2, 16)  # FramePack: latent frames kept at 1x, packed 2x, packed 4x (nearest first)
MASK_NOISY, MASK_REF, MASK_MOTION = 0, 1, 2  # rows of trainable_cond_mask


# ---- audio ------------------------------------------------------------------------------------------------------
class CausalConv1d(nn.Module):
    """A 1-D convolution over time, left-padded (replicating the first step) so step t sees only steps <= t."""

    def __init__(self, chan_in: int, chan_out: int, kernel_size: int = 3, stride: int = 1):
        super().__init__()
        self.pad = kernel_size - 1
        self.conv = nn.Conv1d(chan_in, chan_out, kernel_size, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.pad, 0), mode="replicate"))


class AudioTokenEncoder(nn.Module):
    """(B, T, audio_dim) audio features -> per latent frame ``num_token`` local tokens + 1 learned padding token, and
    (with ``need_global``) one global token; two stride-2 causal convolutions take T to ceil(T / 4)."""

    def __init__(self, in_dim: int, hidden_dim: int, num_token: int, need_global: bool):
        super().__init__()
        self.num_token = num_token
        self.need_global = need_global
        self.conv1_local = CausalConv1d(in_dim, hidden_dim // 4 * num_token, 3)
        if need_global:
            self.conv1_global = CausalConv1d(in_dim, hidden_dim // 4, 3)
        self.norm1 = nn.LayerNorm(hidden_dim // 4, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden_dim // 2, elementwise_affine=False, eps=1e-6)
        self.norm3 = nn.LayerNorm(hidden_dim, elementwise_affine=False, eps=1e-6)
        self.conv2 = CausalConv1d(hidden_dim // 4, hidden_dim // 2, 3, stride=2)
        self.conv3 = CausalConv1d(hidden_dim // 2, hidden_dim, 3, stride=2)
        if need_global:
            self.final_linear = nn.Linear(hidden_dim, hidden_dim)
        self.padding_tokens = nn.Parameter(torch.zeros(1, 1, 1, hidden_dim))

    def _downsample(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, C/4) after the first convolution -> (N, T', C): the shared norm/act/conv stack."""
        x = F.silu(self.norm1(x)).transpose(1, 2)
        x = F.silu(self.norm2(self.conv2(x).transpose(1, 2))).transpose(1, 2)
        return F.silu(self.norm3(self.conv3(x).transpose(1, 2)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        b = x.shape[0]
        x = x.transpose(1, 2)  # (B, audio_dim, T)
        local = self.conv1_local(x)  # (B, num_token * C/4, T)
        local = local.unflatten(1, (self.num_token, -1)).flatten(0, 1).transpose(1, 2)  # (B*n, T, C/4)
        local = self._downsample(local)  # (B*n, T', C)
        local = local.unflatten(0, (b, self.num_token)).transpose(1, 2)  # (B, T', n, C)
        pad = self.padding_tokens.expand(b, local.shape[1], 1, -1).to(local.dtype)
        local = torch.cat([local, pad], dim=2)
        if not self.need_global:
            return local, None
        glob = self._downsample(self.conv1_global(x).transpose(1, 2))  # (B, T', C)
        return local, self.final_linear(glob)


class CausalAudioEncoder(nn.Module):
    """wav2vec2 hidden states of every layer (B, audio_layers, audio_dim, T) -> a learned softmax-free weighting
    (SiLU of the weights, normalised by their sum) over layers, then :class:`AudioTokenEncoder`."""

    def __init__(self, audio_dim: int, audio_layers: int, out_dim: int, num_token: int, need_global: bool):
        super().__init__()
        self.encoder = AudioTokenEncoder(audio_dim, out_dim, num_token, need_global)
        self.weights = nn.Parameter(torch.full((1, audio_layers, 1, 1), 0.01))

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        weights = F.silu(self.weights)
        mixed = ((features * weights) / weights.sum(dim=1, keepdim=True)).sum(dim=1)  # (B, audio_dim, T)
        return self.encoder(mixed.transpose(1, 2))


class AudioInjector(nn.Module):
    """The audio cross-attention added after a main block: per noisy latent frame, its tokens (AdaLN-modulated by the
    frame's global audio token, or plainly layer-normed without AdaLN) attend to the frame's audio tokens."""

    def __init__(self, dim: int, num_heads: int, enable_adain: bool):
        super().__init__()
        self.attn = WanAttention(dim=dim, heads=num_heads, dim_head=dim // num_heads, eps=1e-6,
                                 cross_attention_dim_head=dim // num_heads, processor=WanAttnProcessor())
        if enable_adain:
            self.adain = AdaLayerNorm(dim, output_dim=dim * 2, norm_elementwise_affine=False, norm_eps=1e-5,
                                      chunk_dim=1)
        else:
            self.adain = None
            self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, hidden_states: torch.Tensor, noisy_tokens: int, audio_tokens: torch.Tensor,
                audio_global: torch.Tensor | None, offset: int = 0) -> torch.Tensor:
        """``audio_tokens`` (B*F, tokens per frame, D), ``audio_global`` (B*F, D); the noisy tokens are F frames of
        equal size. ``hidden_states`` (B, L, D) holds the sequence's tokens from position ``offset`` on (a rank's
        share under sequence parallel; 0: all), of which the first ``noisy_tokens`` are noisy (clipped to [0, L]).
        A share that starts or ends inside a frame is padded to whole frames with zero queries, which attend on their
        own and are dropped: every token's result is the one it has in the whole sequence."""
        b, length, d = hidden_states.shape
        n = min(max(0, noisy_tokens), length)
        if n == 0:
            return hidden_states
        frames = audio_tokens.shape[0] // b
        per_frame = (noisy_tokens + offset) // frames
        f0, f1 = offset // per_frame, -(-(offset + n) // per_frame)
        lead = offset - f0 * per_frame
        noisy = F.pad(hidden_states[:, :n], (0, 0, lead, (f1 - f0) * per_frame - lead - n))
        noisy = noisy.reshape(b * (f1 - f0), per_frame, d)
        tokens = audio_tokens.unflatten(0, (b, frames))[:, f0:f1].flatten(0, 1)
        if self.adain is not None:
            query = self.adain(noisy, temb=audio_global.unflatten(0, (b, frames))[:, f0:f1].flatten(0, 1))
        else:
            query = self.norm(noisy)
        out = self.attn(query, tokens).reshape(b, (f1 - f0) * per_frame, d)[:, lead:lead + n]
        return torch.cat([hidden_states[:, :n] + out, hidden_states[:, n:]], dim=1)


# ---- blocks -----------------------------------------------------------------------------------------------------
class WanS2VBlock(WanTransformerBlock):
    """diffusers' WanTransformerBlock with two modulation rows (tokens before ``noisy_tokens``: row 0, the rest: row
    1) and, in the injected blocks, the audio cross-attention after it (``audio_injector``)."""

    def __init__(self, dim: int, ffn_dim: int, num_heads: int, eps: float, audio: bool, enable_adain: bool):
        super().__init__(dim, ffn_dim, num_heads, qk_norm="rms_norm_across_heads", cross_attn_norm=True, eps=eps)
        self.audio_injector = AudioInjector(dim, num_heads, enable_adain) if audio else None

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                rotary_emb: tuple[torch.Tensor, torch.Tensor], noisy_tokens: int,
                audio_tokens: torch.Tensor | None = None, audio_global: torch.Tensor | None = None,
                offset: int = 0) -> torch.Tensor:
        """``temb`` (B, 2, 6, D): the projected time embedding of the noisy tokens (row 0) and of the reference and
        motion tokens (row 1); ``noisy_tokens``: where row 1 starts in this (possibly sequence-split) sequence, whose
        first token is the whole sequence's token ``offset``."""
        n = min(max(0, noisy_tokens), hidden_states.shape[1])
        mod = self.scale_shift_table.unsqueeze(0) + temb.float()  # (1, 1, 6, D) + (B, 2, 6, D)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = mod.unbind(2)  # (B, 2, D) each

        def per_segment(x: torch.Tensor, fn) -> torch.Tensor:
            return torch.cat([fn(x[:, :n], slice(0, 1)), fn(x[:, n:], slice(1, 2))], dim=1)

        def modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
            return per_segment(x, lambda part, r: part * (1 + scale[:, r]) + shift[:, r])

        def gate(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            return per_segment(x, lambda part, r: part * g[:, r])

        # 1. self-attention
        norm = modulate(self.norm1(hidden_states.float()), scale_msa, shift_msa).type_as(hidden_states)
        attn_output = self.attn1(norm, None, None, rotary_emb)
        hidden_states = (hidden_states.float() + gate(attn_output, gate_msa)).type_as(hidden_states)
        # 2. cross-attention
        norm = self.norm2(hidden_states.float()).type_as(hidden_states)
        hidden_states = hidden_states + self.attn2(norm, encoder_hidden_states, None, None)
        # 3. feed-forward
        norm = modulate(self.norm3(hidden_states.float()), c_scale_msa, c_shift_msa).type_as(hidden_states)
        ff_output = self.ffn(norm)
        hidden_states = (hidden_states.float() + gate(ff_output.float(), c_gate_msa)).type_as(hidden_states)
        # 4. audio
        if self.audio_injector is not None and audio_tokens is not None:
            hidden_states = self.audio_injector(hidden_states, noisy_tokens, audio_tokens, audio_global, offset)
        return hidden_states


def _set_valid_tokens(model: nn.Module, tokens: int) -> None:
    """The real tokens of a padded, sequence-split sequence: the self-attention leaves the padding out."""
    for block in model.blocks:
        block.attn1.processor.tokens = tokens


# ---- motion frames ------------------------------------------------------------------------------------------------
class FramePackMotioner(nn.Module):
    """The previous clip's latents as tokens: the last latent frame at full resolution, the two before it packed 2x
    (in time and space), the sixteen before those packed 4x. Fewer than 19 latent frames are zero-padded in front."""

    def __init__(self, in_channels: int, dim: int, drop_mode: str):
        super().__init__()
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.proj_2x = nn.Conv3d(in_channels, dim, kernel_size=(2, 4, 4), stride=(2, 4, 4))
        self.proj_4x = nn.Conv3d(in_channels, dim, kernel_size=(4, 8, 8), stride=(4, 8, 8))
        self.drop_mode = drop_mode

    def forward(self, motion_latents: torch.Tensor, add_last_motion: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, C, T_m, H, W) -> tokens (B, n, D) and their rotary positions (n, 3).

        ``add_last_motion``: 2 uses all three parts; 1 leaves out the most recent frame, 0 also the 2x part: zeroed
        latents in ``drop_mode="padd"`` (the released model), no tokens in ``"drop"``."""
        b, c, t, h, w = motion_latents.shape
        total = sum(ZIP_FRAME_BUCKETS)
        padded = motion_latents.new_zeros(b, c, total, h, w)
        keep = min(total, t)
        if keep > 0:
            padded[:, :, -keep:] = motion_latents[:, :, -keep:]
        drop = add_last_motion < 2 and self.drop_mode == "drop"
        if add_last_motion < 2 and not drop:
            padded[:, :, -sum(ZIP_FRAME_BUCKETS[:len(ZIP_FRAME_BUCKETS) - add_last_motion - 1]):] = 0
        lat_4x, lat_2x, lat_post = padded.split(list(ZIP_FRAME_BUCKETS[::-1]), dim=2)
        post = self.proj(lat_post).flatten(2).transpose(1, 2)
        x2 = self.proj_2x(lat_2x).flatten(2).transpose(1, 2)
        x4 = self.proj_4x(lat_4x).flatten(2).transpose(1, 2)
        parts, grids = [], []
        if not drop:  # the most recent frame: rotary frame -1
            parts.append(post)
            grids.append(((-1, 0, 0), (0, h // 2, w // 2), (1, h // 2, w // 2)))
        if not (add_last_motion < 1 and self.drop_mode == "drop"):  # two frames at -3, packed 2x
            parts.append(x2)
            grids.append(((-3, 0, 0), (-2, h // 4, w // 4), (2, h // 2, w // 2)))
        parts.append(x4)  # sixteen frames at -19..-4, packed 4x
        grids.append(((-19, 0, 0), (-15, h // 8, w // 8), (16, h // 2, w // 2)))
        positions = torch.cat([grid_positions(*g) for g in grids])
        return torch.cat(parts, dim=1), positions


# ---- rotary embedding ---------------------------------------------------------------------------------------------
def grid_positions(start, end, span) -> torch.Tensor:
    """Rotary (frame, row, column) positions of a token grid of (end - start) cells, spread evenly over ``span``
    positions from ``start`` (rounded toward zero); a negative start frame counts backwards (frames -start, ...)."""
    (f0, h0, w0), (f1, h1, w1), (tf, th, tw) = start, end, span
    nf, nh, nw = f1 - f0, h1 - h0, w1 - w0
    if f0 >= 0:
        fs = np.linspace(f0, tf + f0 - 1, nf).astype(int)
    else:
        fs = -np.linspace(-f0, -tf - f0 + 1, nf).astype(int)
    hs = np.linspace(h0, th + h0 - 1, nh).astype(int)
    ws = np.linspace(w0, tw + w0 - 1, nw).astype(int)
    grid = np.stack(np.meshgrid(fs, hs, ws, indexing="ij"), axis=-1).reshape(-1, 3)
    return torch.from_numpy(grid.astype(np.int64))


def rotary_tables(positions: torch.Tensor, head_dim: int, device, theta: float = 10000.0):
    """(S, 3) integer positions -> diffusers' (cos, sin) tables, each (1, S, 1, head_dim) float32, with Wan's split
    of a head into frame / row / column frequencies (angles in float64 as in the original)."""
    half = head_dim // 2
    sizes = (half - 2 * (half // 3), half // 3, half // 3)
    angles = []
    for axis, n in enumerate(sizes):
        inv = 1.0 / torch.pow(theta, torch.arange(0, 2 * n, 2, dtype=torch.float64, device=device) / (2 * n))
        angles.append(positions[:, axis].to(device=device, dtype=torch.float64)[:, None] * inv[None])
    angle = torch.cat(angles, dim=1).repeat_interleave(2, dim=1)  # (S, head_dim)
    return angle.cos().float()[None, :, None], angle.sin().float()[None, :, None]


def sinusoidal_embedding(dim: int, t: torch.Tensor) -> torch.Tensor:
    """Wan's timestep embedding (cos | sin), computed in float64, returned in float32."""
    half = dim // 2
    t = t.to(torch.float64)
    sinusoid = torch.outer(t, torch.pow(10000, -torch.arange(half, dtype=torch.float64, device=t.device) / half))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1).float()


# ---- the model ----------------------------------------------------------------------------------------------------
class WanS2VTransformer(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """The S2V DiT; config names follow the original config.json (see the module doc for the sequence it builds).

    ``forward(hidden_states, timestep, encoder_hidden_states, ref_latents, audio_features, motion_latents=None,
    pose_latents=None, add_last_motion=2)`` returns the velocity of the noisy frames, (B, out_dim, F, H, W).
    """

    _supports_gradient_checkpointing = True
    _no_split_modules = ["WanS2VBlock"]

    @register_to_config
    def __init__(self, dim: int = 5120, ffn_dim: int = 13824, num_heads: int = 40, num_layers: int = 40,
                 in_dim: int = 16, out_dim: int = 16, text_dim: int = 4096, freq_dim: int = 256, eps: float = 1e-6,
                 patch_size: tuple[int, int, int] = (1, 2, 2), cond_dim: int = 16, audio_dim: int = 1024,
                 audio_layers: int = 25, num_audio_token: int = 4, enable_adain: bool = True,
                 audio_inject_layers: tuple[int, ...] = (0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39),
                 zero_timestep: bool = True, add_last_motion: bool = True, framepack_drop_mode: str = "padd",
                 motion_frames: int = 73):
        super().__init__()
        head_dim = dim // num_heads
        if dim % num_heads or head_dim % 2:
            raise ValueError(f"dim={dim} must be num_heads={num_heads} times an even head size")
        bad = [i for i in audio_inject_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"audio_inject_layers {bad} are not blocks of a {num_layers}-block model")
        if framepack_drop_mode not in ("padd", "drop"):
            raise ValueError(f"framepack_drop_mode={framepack_drop_mode!r}: 'padd' or 'drop'")
        self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=patch_size, stride=patch_size)
        self.condition_embedder = WanTimeTextImageEmbedding(dim, time_freq_dim=freq_dim, time_proj_dim=dim * 6,
                                                            text_embed_dim=text_dim)
        inject = set(audio_inject_layers)
        self.blocks = nn.ModuleList([WanS2VBlock(dim, ffn_dim, num_heads, eps, i in inject, enable_adain)
                                     for i in range(num_layers)])
        self.norm_out = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, out_dim * math.prod(patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.cond_encoder = nn.Conv3d(cond_dim, dim, kernel_size=patch_size, stride=patch_size) if cond_dim else None
        self.causal_audio_encoder = CausalAudioEncoder(audio_dim, audio_layers, dim, num_audio_token, enable_adain)
        self.trainable_cond_mask = nn.Embedding(3, dim)
        self.frame_packer = FramePackMotioner(in_dim, dim, framepack_drop_mode)
        self.gradient_checkpointing = False

    def _sequence_split(self):
        """The sequence group this forward splits its tokens over (wanexp.models.sequence): set by
        ``S2VSpec.enable_sequence_parallel``; training forwards split, and gradient-free ones when the transformer
        generates on several ranks. None: the whole sequence here."""
        group = getattr(self, "_wanexp_sp", None)
        if group is None:
            return None
        from wanexp.models.wan22.sequence import set_active

        split = torch.is_grad_enabled() or getattr(self, "_wanexp_sp_gradient_free", False)
        set_active(self, split)
        return group if split else None

    @property
    def lat_motion_frames(self) -> int:
        """Latent frames of the ``motion_frames`` pixel frames before a clip (73 -> 19)."""
        return (self.config.motion_frames + 3) // 4

    def encode_audio(self, audio_features: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, audio_layers, audio_dim, 4*F) -> per latent frame tokens (B*F, num_audio_token + 1, D) and global
        tokens (B*F, D) or None. The features are first extended in front by ``motion_frames`` copies of their first
        step, encoded, and the ``lat_motion_frames`` leading latent frames are dropped (as the original does)."""
        enc = self.causal_audio_encoder
        feats = audio_features.to(enc.weights.dtype)
        feats = torch.cat([feats[..., :1].expand(*feats.shape[:-1], self.config.motion_frames), feats], dim=-1)
        local, glob = enc(feats)
        local = local[:, self.lat_motion_frames:]
        if local.shape[1] != frames:
            raise ValueError(f"audio_features: {audio_features.shape[-1]} steps encode to {local.shape[1]} latent "
                             f"frames, the noisy latents have {frames}: pass 4 audio steps per latent frame")
        local = local.flatten(0, 1)
        if glob is not None:
            glob = glob[:, self.lat_motion_frames:].flatten(0, 1)
        return local, glob

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                ref_latents: torch.Tensor, audio_features: torch.Tensor, motion_latents: torch.Tensor | None = None,
                pose_latents: torch.Tensor | None = None, add_last_motion: int = 2) -> torch.Tensor:
        """Velocity of the noisy frames.

        hidden_states: (B, in_dim, F, H, W) noisy latents (the clip to generate).
        timestep: (B,) in [0, 1000] (1000 * sigma).
        encoder_hidden_states: (B, L_text, text_dim) UMT5 states (512 rows, zero-padded past the prompt).
        ref_latents: (B, in_dim, 1, H_r, W_r) normalised VAE latent of the reference image.
        audio_features: (B, audio_layers, audio_dim, 4 * F) wav2vec2 hidden states of every layer, one step per
            video frame of the clip (zeros for the unconditional pass of CFG).
        motion_latents: (B, in_dim, T_m, H, W) latents of the frames before the clip (the original encodes the 73
            previous frames: T_m = 19; zeros before the first clip); None: no motion tokens (the original's
            ``drop_motion_frames=True``).
        pose_latents: (B, cond_dim, F, H, W) latents of a pose video; None: no pose (the original's zeros).
        add_last_motion: FramePack parts used (2: all; see :class:`FramePackMotioner`), times ``add_last_motion``.
        """
        cfg = self.config
        b, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = cfg.patch_size
        audio_tokens, audio_global = self.encode_audio(audio_features, frames // p_t)

        x = self.patch_embedding(hidden_states)
        if self.cond_encoder is not None:
            if pose_latents is not None:
                x = x + self.cond_encoder(pose_latents)
            else:  # the convolution of zeros
                x = x + self.cond_encoder.bias.view(1, -1, 1, 1, 1)
        grid = x.shape[2:]
        x = x.flatten(2).transpose(1, 2)
        noisy_tokens = x.shape[1]
        ref = self.patch_embedding(ref_latents)
        ref_grid = ref.shape[2:]
        ref = ref.flatten(2).transpose(1, 2)
        mask = self.trainable_cond_mask.weight.to(x.dtype)
        parts = [x + mask[MASK_NOISY], ref + mask[MASK_REF]]
        positions = [grid_positions((0, 0, 0), tuple(grid), tuple(grid)),
                     grid_positions((REF_FRAME, 0, 0), (REF_FRAME + 1, *ref_grid[1:]), (1, *ref_grid[1:]))]
        if motion_latents is not None:
            mot, mot_positions = self.frame_packer(motion_latents.to(x.dtype), add_last_motion * cfg.add_last_motion)
            parts.append(mot + mask[MASK_MOTION])
            positions.append(mot_positions)
        x = torch.cat(parts, dim=1)
        rotary_emb = rotary_tables(torch.cat(positions), cfg.dim // cfg.num_heads, x.device)

        # time: the noisy tokens' timestep, and 0 for the reference and motion tokens (computed in one batch)
        emb = self.condition_embedder
        t = torch.cat([timestep.reshape(b), timestep.new_zeros(1)]) if cfg.zero_timestep else timestep.reshape(b)
        temb = emb.time_embedder(sinusoidal_embedding(cfg.freq_dim, t).to(emb.time_embedder.linear_1.weight.dtype))
        tproj = emb.time_proj(emb.act_fn(temb)).unflatten(1, (6, cfg.dim)).float()
        if cfg.zero_timestep:
            mod = torch.stack([tproj[:b], tproj[b:].expand(b, -1, -1)], dim=1)
        else:
            mod = tproj.unsqueeze(1).expand(-1, 2, -1, -1)
        temb = temb[:b].float()
        context = emb.text_embedder(encoder_hidden_states)

        sp = self._sequence_split()
        total, offset = x.shape[1], 0
        if sp is not None:  # this rank's share of the tokens, the sequence padded to a multiple of the ranks
            from wanexp.models import sequence

            pad = -total % sp.size
            x = sequence.shard(F.pad(x, (0, 0, 0, pad)), sp)
            rotary_emb = tuple(sequence.shard(F.pad(r, (0, 0, 0, 0, 0, pad)), sp) for r in rotary_emb)
            offset = sp.rank * x.shape[1]
            _set_valid_tokens(self, total)

        ckpt = None
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            ckpt = self._gradient_checkpointing_func
            if getattr(self, "_wanexp_offload_activations", False):
                from wanexp.models.wan22.fast import offloaded_checkpoint as ckpt
        for block in self.blocks:
            args = (x, context, mod, rotary_emb, noisy_tokens - offset, audio_tokens, audio_global, offset)
            x = ckpt(block, *args) if ckpt is not None else block(*args)

        if sp is not None:
            x = sequence.gather(x, sp)
        x = x[:, :noisy_tokens]
        shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x)
        f, h, w = grid
        x = x.reshape(b, f, h, w, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(b, -1, f * p_t, h * p_h, w * p_w)
