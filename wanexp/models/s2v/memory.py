"""The S2V DiT's memory formula (the protocol wanexp.memory_plan reads through ``S2VSpec.memory_formula()``): Wan2.2's
(wanexp.models.wan22.memory) on the S2V config's names, plus the audio cross-attention of the injected blocks, with
the eager recompute (S2V's blocks are not compiled) and every block checkpointed. A training sample's tokens are its
generated frames' and the reference's: ``(F - 1) / 4 + 1`` latent frames' worth for F frames, what the planner's
token count gives for the family's 4k + 1 frames."""
from __future__ import annotations

import functools

from wanexp.models.wan22.memory import WanMemory


def wan_names(config: dict) -> dict:
    """A full S2V config (:func:`full_config`) under the names Wan2.2's formula reads."""
    return {**config, "num_attention_heads": config["num_heads"],
            "attention_head_dim": config["dim"] // config["num_heads"], "in_channels": config["in_dim"],
            "out_channels": config["out_dim"]}


def full_config(config: dict) -> dict:
    """The config with WanS2VTransformer's defaults for the keys it leaves out."""
    import inspect

    from wanexp.models.s2v.transformer import WanS2VTransformer

    params = inspect.signature(WanS2VTransformer.__init__).parameters.values()
    return {**{p.name: p.default for p in params if p.default is not inspect.Parameter.empty}, **config}


def _extra_parameters(config: dict) -> int:
    """Parameters outside Wan2.2's blocks and embeddings: the audio encoder, the motion-frame packer, the pose
    encoder and the segment embeddings."""
    d = config["dim"]
    patch = config["patch_size"][0] * config["patch_size"][1] * config["patch_size"][2]
    pose = (config["cond_dim"] * patch + 1) * d if config["cond_dim"] else 0
    return _module_parameters(d, config["audio_dim"], config["audio_layers"], config["num_audio_token"],
                              bool(config["enable_adain"]), config["in_dim"], config["framepack_drop_mode"]) + pose


@functools.lru_cache(maxsize=8)
def _module_parameters(dim: int, audio_dim: int, audio_layers: int, num_audio_token: int, enable_adain: bool,
                       in_dim: int, drop_mode: str) -> int:
    """The audio encoder's, the motion-frame packer's and the segment embeddings' parameters, counted on the meta
    device once per shape (the planner asks for every block count it tries)."""
    import torch

    from wanexp.models.s2v.transformer import CausalAudioEncoder, FramePackMotioner

    with torch.device("meta"):
        parts = [CausalAudioEncoder(audio_dim, audio_layers, dim, num_audio_token, enable_adain),
                 FramePackMotioner(in_dim, dim, drop_mode), torch.nn.Embedding(3, dim)]
    return sum(p.numel() for m in parts for p in m.parameters())


class S2VMemory(WanMemory):
    def weights_gib(self, config: dict, weight_bytes: float, other_bytes: float, resident_blocks: int) -> float:
        """Wan2.2's blocks and embeddings, and per resident block its share of the audio cross-attention (q, k, v, o
        and the AdaLN projection of the injected blocks, spread over the blocks as block swap moves them)."""
        config = full_config(config)
        d, layers = config["dim"], int(config["num_layers"])
        injected = len(config["audio_inject_layers"])
        audio = injected * (4 * d * d + (2 * d * d if config.get("enable_adain", True) else 0)) / layers
        return (super().weights_gib(wan_names(config), weight_bytes, other_bytes, resident_blocks)
                + resident_blocks * audio * weight_bytes / 2**30 + _extra_parameters(config) * other_bytes / 2**30)

    def activations_gib(self, config: dict, tokens: int, checkpointing: bool, offloading: bool,
                        compiled: bool) -> float:
        return super().activations_gib(wan_names(full_config(config)), tokens, checkpointing, offloading, False)

    def compiled(self, compile: bool) -> bool:
        return False
