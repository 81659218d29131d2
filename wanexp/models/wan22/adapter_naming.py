"""Wan2.2's adapter naming: what ``adapter.targets``/``attention`` select in diffusers' Wan DiT, and the names the
original release (ComfyUI, kohya/musubi-tuner, ai-toolkit) gives the same modules.

Users name targets the original Wan way (``q,k,v,o,ffn.0,ffn.2``); diffusers' modules are ``attn1`` (self) /
``attn2`` (cross) ``.to_q/.to_k/.to_v/.to_out.0`` and ``ffn.net.0.proj`` / ``ffn.net.2``; the original release's
are ``blocks.N.self_attn.q`` ... ``blocks.N.ffn.0``.
"""
from __future__ import annotations

from wanexp.adapters.naming import AdapterNaming

FORMATS = ("ComfyUI/original Wan (diffusion_model.blocks.N.self_attn.q.lora_down/lora_up or lora_A/lora_B, "
           "optional .alpha: wanexp, ai-toolkit), kohya/musubi-tuner (lora_unet_blocks_N_self_attn_q.lora_down/"
           "lora_up/.alpha), diffusers/peft (transformer.blocks.N.attn1.to_q.lora_A/lora_B)")


def convert_lora(sd: dict) -> dict:
    """Any Wan LoRA naming -> peft's (diffusers' own Wan converter: kohya/musubi, ComfyUI/original and ai-toolkit
    keys renamed; each module's ``alpha/rank`` folded into its A and B)."""
    from diffusers.loaders.lora_pipeline import WanLoraLoaderMixin

    return WanLoraLoaderMixin.lora_state_dict(sd)


WAN_NAMING = AdapterNaming(
    blocks="blocks",
    attention={"self": "attn1", "cross": "attn2"},
    projections={"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0"},
    feedforward={"ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2"},
    original_attention={"self": "self_attn", "cross": "cross_attn"},
    formats=FORMATS,
    convert_lora=convert_lora,
)
