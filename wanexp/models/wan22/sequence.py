"""Wan2.2's Ulysses self-attention (see wanexp/models/sequence.py for the scheme): a processor on every block's
self-attention that swaps the token split for a head split around the attention, with diffusers' Wan projections."""
from __future__ import annotations

import torch

from wanexp.models.sequence import SequenceGroup, check_heads, heads_to_tokens, tokens_to_heads


class UlyssesAttnProcessor:
    """Self-attention of a ``WanAttention`` over sequence-split tokens (see the module doc); the projections, norms,
    rotary embedding and output layers are the module's own (peft's LoRA layers included). ``active`` is set by the
    transformer's forward: off (gradient-free forwards: validation, a teacher) it is diffusers' processor. ``tokens``
    (set by a forward that pads its sequence to a multiple of the ranks): the real tokens, the first ``tokens`` of the
    gathered sequence; the padding is left out of the attention and its output rows are zeros."""

    def __init__(self, base, sp: SequenceGroup):
        self.base, self.sp, self.active, self.tokens = base, sp, False, None
        self._attention_backend = getattr(base, "_attention_backend", None)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if not self.active or encoder_hidden_states is not None:
            return self.base(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)  # over all heads of a token: local
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        if rotary_emb is not None:  # this rank's tokens' rows of the tables
            query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        query, key, value = (tokens_to_heads(x, self.sp) for x in (query, key, value))
        padded = query.shape[1]
        if self.tokens is not None and self.tokens < padded:
            query, key, value = (x[:, :self.tokens] for x in (query, key, value))
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend)
        if out.shape[1] < padded:
            out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, padded - out.shape[1]))
        out = heads_to_tokens(out, self.sp).flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


def rotate(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on (B, S, H, d) (the same operations as diffusers' WanAttnProcessor)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def enable(transformer, sp: SequenceGroup, gradient_free: bool = False, heads: int | None = None) -> None:
    """Set Ulysses self-attention on every block's ``attn1`` (a diffusers ``WanAttention``) of a loaded transformer
    whose forward splits the tokens (Wan2.2's: models/wan22/fast.py; S2V's own); ``gradient_free``: forwards without
    gradients split their tokens too (generation on several ranks); ``heads``: the attention heads (default: the
    config's ``num_attention_heads``)."""
    check_heads(heads or transformer.config.num_attention_heads, sp.size)
    transformer._wanexp_sp = sp
    transformer._wanexp_sp_gradient_free = gradient_free
    for block in transformer.blocks:
        block.attn1.set_processor(UlyssesAttnProcessor(block.attn1.processor, sp))


def set_tokens(transformer, tokens: int | None) -> None:
    """The real tokens of a padded, sequence-split sequence (None: no padding): the self-attention leaves the rest
    out."""
    for block in transformer.blocks:
        proc = block.attn1.processor
        if isinstance(proc, UlyssesAttnProcessor):
            proc.tokens = tokens


def set_active(transformer, active: bool) -> None:
    for block in transformer.blocks:
        proc = block.attn1.processor
        if isinstance(proc, UlyssesAttnProcessor):
            proc.active = active
