"""The S2V DiT's adapter naming: Wan's self/cross attention and feed-forward aliases, plus the audio
cross-attention of the injected blocks (``adapter.attention`` kind ``audio``).

Module names (:class:`~wanexp.models.s2v.transformer.WanS2VTransformer`): ``blocks.N.attn1`` (self),
``blocks.N.attn2`` (cross), ``blocks.N.audio_injector.attn`` (audio; only the injected blocks have one), each with
``to_q, to_k, to_v, to_out.0``, and ``blocks.N.ffn.net.0.proj`` / ``ffn.net.2``. Original names (ComfyUI's Wan S2V
state dict, DiffSynth-Studio's, the Wan-AI release; :func:`wanexp.models.s2v.original.original_name`):
``blocks.N.self_attn.q`` ... ``blocks.N.ffn.0``, and the audio cross-attention outside the blocks,
``audio_injector.injector.K.q`` for the K-th injected block. The injector index is that of the released model's
``audio_inject_layers`` (a model injecting into a prefix of that list, as the tiny build does, has the same names).
"""
from __future__ import annotations

import re

from wanexp.adapters.naming import AdapterNaming
from wanexp.models.s2v.original import RELEASED_CONFIG, original_name

INJECTED = tuple(RELEASED_CONFIG["audio_inject_layers"])  # block of injector K: INJECTED[K]
AUDIO_ATTENTION = "audio_injector.attn"
_AUDIO_ORIGINAL = re.compile(r"^audio_injector\.injector\.(\d+)\.(q|k|v|o)$")

FORMATS = ("ComfyUI/original Wan S2V (diffusion_model.blocks.N.self_attn.q, diffusion_model.audio_injector."
           "injector.K.q ... .lora_down/lora_up, optional .alpha), diffusers/peft "
           "(transformer.blocks.N.attn1.to_q, transformer.blocks.N.audio_injector.attn.to_q ... .lora_A/lora_B)")


class S2VNaming(AdapterNaming):
    """Wan's naming with the ``audio`` attention kind, whose original names live outside the blocks."""

    def to_original(self, module: str) -> str:
        self.module_re.match(module) or super().to_original(module)  # one message for a non-adapter module
        return original_name(module, INJECTED)

    def from_original(self, name: str) -> str:
        m = _AUDIO_ORIGINAL.match(name)
        if m is None:
            return super().from_original(name)
        k = int(m.group(1))
        if k >= len(INJECTED):
            raise ValueError(f"no module for the original adapter name {name!r}")
        return f"{self.blocks}.{INJECTED[k]}.{AUDIO_ATTENTION}.{self.projections[m.group(2)]}"


S2V_NAMING = S2VNaming(
    blocks="blocks",
    attention={"self": "attn1", "cross": "attn2", "audio": AUDIO_ATTENTION},
    projections={"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0"},
    feedforward={"ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2"},
    original_attention={"self": "self_attn", "cross": "cross_attn", "audio": "audio_injector"},
    formats=FORMATS,
)
