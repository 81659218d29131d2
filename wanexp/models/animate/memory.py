"""The Animate DiT's memory formula: Wan2.2's (its blocks are Wan's, wanexp.models.wan22.memory) plus what the
Animate DiT has besides: the image cross-attention's added key/value projections in every block (swapped with it),
and, always on the device, the face adapter blocks, the motion and face encoders, the CLIP image embedding and the
pose patch embedding (for the released model: 2.1 B of its 17.3 B parameters outside Wan's formula, 0.84 B of them
the face adapter). The activations are Wan's at the DiT's token count (the reference slot's latent frame counted:
AnimateSpec.extra_latent_frames) plus the face adapter's: checkpointed (AnimateSpec checkpoints it with the blocks),
each face block keeps its bf16 input; otherwise its input, the normed input, q, the normed q and the attention
output (FACE_KEPT)."""
from __future__ import annotations

from functools import lru_cache

from wanexp.models.wan22.memory import WanMemory, base_gib

FACE_KEPT = 5  # bf16 (tokens x width) tensors a face block keeps for its backward without checkpointing


@lru_cache(maxsize=8)
def _motion_encoder_params(size: int, style_dim: int, motion_dim: int, out_dim: int, channels: str | None) -> int:
    """The motion encoder's parameter count (built without memory on the meta device)."""
    import json

    import torch
    from diffusers.models.transformers.transformer_wan_animate import WanAnimateMotionEncoder

    with torch.device("meta"):
        encoder = WanAnimateMotionEncoder(size=size, style_dim=style_dim, motion_dim=motion_dim, out_dim=out_dim,
                                          channels=None if channels is None else json.loads(channels))
    return sum(p.numel() for p in encoder.parameters())


def extra_params(config: dict) -> tuple[int, int]:
    """(parameters per block, parameters outside the blocks) of an Animate DiT config beyond Wan's formula."""
    import json

    d = config["num_attention_heads"] * config["attention_head_dim"]
    per_block = 2 * d * int(config.get("added_kv_proj_dim") or 0)
    face_blocks = config["num_layers"] // config.get("inject_face_latents_blocks", 5)
    hidden, heads = config.get("face_encoder_hidden_dim", 1024), config.get("face_encoder_num_heads", 4)
    motion_out = config.get("motion_encoder_dim", 512)
    image = int(config.get("image_dim") or 0)
    channels = config.get("motion_encoder_channel_sizes")
    other = (face_blocks * 4 * d * d  # the face adapter's q, k, v and output projections
             + motion_out * hidden * heads * 3 + 2 * hidden * hidden * 3 + hidden * d  # the face encoder
             + _motion_encoder_params(config.get("motion_encoder_size", 512), config.get("motion_style_dim", 512),
                                      config.get("motion_dim", 20), motion_out,
                                      None if channels is None else json.dumps(channels, sort_keys=True))
             + image * image + image * d  # the image embedding
             + config.get("latent_channels", 16) * d * 4)  # the pose patch embedding (1 x 2 x 2 patches)
    return per_block, other


class AnimateMemory(WanMemory):
    """Wan's formula with the Animate DiT's own weights added (the protocol wanexp.memory_plan reads)."""

    def weights_gib(self, config: dict, weight_bytes: float, other_bytes: float, resident_blocks: int) -> float:
        per_block, other = extra_params(config)
        extra = (resident_blocks * per_block * weight_bytes + other * other_bytes) / 2**30
        return base_gib(config, weight_bytes, other_bytes, resident_blocks) + extra

    def activations_gib(self, config: dict, tokens: int, checkpointing: bool, offloading: bool,
                        compiled: bool, selective: bool = False) -> float:
        face_blocks = config["num_layers"] // config.get("inject_face_latents_blocks", 5)
        d = config["num_attention_heads"] * config["attention_head_dim"]
        face = face_blocks * (1 if checkpointing else FACE_KEPT) * tokens * d * 2 / 2**30
        return super().activations_gib(config, tokens, checkpointing, offloading, compiled, selective) + face
