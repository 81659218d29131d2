"""The Animate DiT's adapter naming: its 40 blocks are Wan's (diffusers' WanTransformerBlock), so the LoRA targets,
the attention kinds and the external names are Wan2.2's (``wanexp.models.wan22.adapter_naming``): ``adapter.targets``
``q,k,v,o,ffn.0,ffn.2`` over the self and cross attention of ``blocks.N`` (diffusers' ``blocks.N.attn1.to_q`` ...;
ComfyUI's and the Wan-AI release's ``diffusion_model.blocks.N.self_attn.q`` ..., the names ComfyUI's WanAnimate
model has for the same blocks).

Not targeted: the face adapter blocks (``face_adapter.K``, the original ``face_adapter.fuser_blocks.K`` with its
key and value in one ``linear1_kv``), the motion and face encoders, the pose embedding and the image cross-attention's
added key/value projections (``add_k_proj``, the original ``k_img``) stay frozen, as in DiffSynth-Studio's
Wan2.2-Animate-14B LoRA recipe (``--lora_target_modules q,k,v,o,ffn.0,ffn.2``).
"""
from __future__ import annotations

from wanexp.adapters.naming import AdapterNaming
from wanexp.models.wan22.adapter_naming import WAN_NAMING, convert_lora

FORMATS = ("ComfyUI/original Wan Animate (diffusion_model.blocks.N.self_attn.q.lora_down/lora_up, optional .alpha), "
           "kohya/musubi-tuner (lora_unet_blocks_N_self_attn_q...), diffusers/peft "
           "(transformer.blocks.N.attn1.to_q.lora_A/lora_B)")

ANIMATE_NAMING = AdapterNaming(blocks=WAN_NAMING.blocks, attention=WAN_NAMING.attention,
                               projections=WAN_NAMING.projections, feedforward=WAN_NAMING.feedforward,
                               original_attention=WAN_NAMING.original_attention, formats=FORMATS,
                               convert_lora=convert_lora)
