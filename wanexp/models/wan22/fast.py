"""Faster forwards for a loaded diffusers ``WanTransformer3DModel`` that compute the same function.

**Modulation per latent frame** (``model.fast_modulation``). With a per-token timestep (TI2V-5B: shape (B, tokens)),
diffusers embeds the timestep of every token and each block builds its shift/scale/gate tensors per token: 6 x dim
fp32 values per token per block, kept alive for the backward (about 12 GiB and a lot of elementwise traffic for 5B at
4,400 tokens). But a TI2V timestep is constant over each latent frame (0 on a clean first frame, 1000*sigma
elsewhere): the embedding and the modulation are computed here once per (sample, latent frame) and broadcast over the
frame's tokens. Every element goes through the same operations as in diffusers' forward, only the tensors that repeat
are not materialised. A timestep that is not constant per frame fails an on-device assert (no host sync).

The forwards are set on the instance (``module.forward``); no module is replaced or renamed, so peft's LoRA layers,
state-dict names, checkpoints and LoRA export are unchanged, and FSDP2's per-block sharding sees the same blocks.

**Regional compilation** (``model.compile``): ``torch.compile`` of each ``WanTransformerBlock`` in place
(``nn.Module.compile``: the names stay), the blocks sharing one compiled graph. A checkpointed block (activation
checkpointing) is called through one more compiled function that holds the checkpoint itself, so its recompute runs
inside the compiled backward (:func:`checkpoint_function`); under FSDP2 and sequence parallel the eager checkpoint
wraps the compiled block instead. Under FSDP2 the blocks are compiled before ``fully_shard``, the order torchtitan
uses.
"""
from __future__ import annotations

import functools
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, L, D) -> (B, G, L/G, D): tokens are frame-major, so group g holds frame g's tokens."""
    b, l, d = x.shape
    return x.view(b, groups, l // groups, d)


def stream_dtypes(hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(compute, residual): the dtype of the attention and feed-forward inputs and that of the residual stream.

    Under fp16 compute (the text states, which the blocks' matmuls read, are fp16) the residual stream is fp32, as in
    Wan2.2's own block (``x = x + y * e`` in fp32): a trained DiT's residual values pass fp16's largest, 65504.
    Otherwise both are the stream's own dtype (bf16, fp32), as in diffusers' block."""
    if encoder_hidden_states.dtype == torch.float16:
        return torch.float16, torch.float32
    return hidden_states.dtype, hidden_states.dtype


def block_forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                  rotary_emb) -> torch.Tensor:
    """A WanTransformerBlock forward whose modulation ``temb`` is (B, G, 6, D): one row per group of L/G consecutive
    tokens (G = latent frames, or 1 for a scalar timestep; diffusers' (B, 6, D) is taken as G = 1). With G = L this is
    diffusers' per-token forward; the elementwise operations are the same in the same order. Under fp16 the residual
    stream it takes and returns is fp32 (:func:`stream_dtypes`); in bf16 and fp32 every operation is diffusers'."""
    if temb.ndim == 3:
        temb = temb.unsqueeze(1)
    b, l, d = hidden_states.shape
    g = temb.shape[1]
    compute, residual = stream_dtypes(hidden_states, encoder_hidden_states)
    hidden_states = hidden_states.to(residual)
    # (1, 1, 6, D) + (B, G, 6, D) -> six (B, G, 1, D) views
    mod = (self.scale_shift_table.unsqueeze(0) + temb.float()).unsqueeze(2)
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = mod.unbind(3)

    def modulate(norm: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return (_grouped(norm, g) * (1 + scale) + shift).view(b, l, d)

    def gated_add(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (_grouped(x, g) + _grouped(y, g) * gate).view(b, l, d)

    # 1. self-attention
    norm_hidden_states = modulate(self.norm1(hidden_states.float()), scale_msa, shift_msa).to(compute)
    attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)
    hidden_states = gated_add(hidden_states.float(), attn_output, gate_msa).to(residual)
    # 2. cross-attention
    norm_hidden_states = self.norm2(hidden_states.float()).to(compute)
    attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    hidden_states = hidden_states + attn_output
    # 3. feed-forward
    norm_hidden_states = modulate(self.norm3(hidden_states.float()), c_scale_msa, c_shift_msa).to(compute)
    ff_output = self.ffn(norm_hidden_states)
    return gated_add(hidden_states.float(), ff_output.float(), c_gate_msa).to(residual)


def frame_timesteps(timestep: torch.Tensor, frames: int) -> torch.Tensor:
    """(B, L) per-token timesteps, constant over each of ``frames`` frame-major groups -> (B, frames).

    Checked on the device (``torch._assert_async``: no host sync); a per-token timestep that varies inside a frame
    is not what this path computes."""
    b, l = timestep.shape
    per_frame = timestep.view(b, frames, l // frames)
    first = per_frame[:, :, 0]
    torch._assert_async(torch.all(per_frame == first.unsqueeze(-1)),
                        "fast_modulation: the per-token timestep varies inside a latent frame")
    return first


def transformer_forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                        encoder_hidden_states_image: torch.Tensor | None = None, return_dict: bool = True,
                        attention_kwargs: dict | None = None, control_hidden_states: torch.Tensor | None = None,
                        control_hidden_states_scale: torch.Tensor | None = None):
    """WanTransformer3DModel's forward with the time embedding computed per latent frame (see the module doc); a
    WanVACETransformer3DModel's too, given its ``control_hidden_states`` (:class:`ControlBranch`)."""
    if attention_kwargs is not None:  # a LoRA scale through attention_kwargs: the stock path handles it
        control = {} if control_hidden_states is None else {
            "control_hidden_states": control_hidden_states, "control_hidden_states_scale": control_hidden_states_scale}
        return type(self).forward(self, hidden_states, timestep, encoder_hidden_states,
                                  encoder_hidden_states_image=encoder_hidden_states_image, return_dict=return_dict,
                                  attention_kwargs=attention_kwargs, **control)
    if getattr(self, "_wanexp_cuda_graphs", False) and not torch.is_grad_enabled():
        torch.compiler.cudagraph_mark_step_begin()  # each sampling forward replays the graphs from the first block
    b, _, f, h, w = hidden_states.shape
    pt, ph, pw = self.config.patch_size
    frames, ph_, pw_ = f // pt, h // ph, w // pw
    rotary_emb = self.rope(hidden_states)
    hidden_states = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
    # sequence parallel (models/sequence.py): training forwards keep this rank's share of the tokens, and so does
    # every forward of a transformer that generates on several ranks (``_wanexp_sp_gradient_free``)
    split = torch.is_grad_enabled() or getattr(self, "_wanexp_sp_gradient_free", False)
    sp = getattr(self, "_wanexp_sp", None) if split else None
    if getattr(self, "_wanexp_sp", None) is not None:
        from wanexp.models import sequence
        from wanexp.models.wan22 import sequence as wan_sequence

        wan_sequence.set_active(self, sp is not None)
    tokens = padded = hidden_states.shape[1]
    if sp is not None:  # this rank's share, the sequence padded to a multiple of the ranks (the attention skips it)
        sequence.check_heads(self.config.num_attention_heads, sp.size)
        hidden_states = sequence.pad_to_ranks(hidden_states, sp)
        padded = hidden_states.shape[1]
        wan_sequence.set_tokens(self, tokens if padded > tokens else None)
        hidden_states = sequence.shard(hidden_states, sp)
        rotary_emb = tuple(sequence.shard(sequence.pad_to_ranks(r, sp), sp) for r in rotary_emb)

    if timestep.ndim == 2:  # per token (TI2V): one embedding per (sample, latent frame)
        t = frame_timesteps(timestep, frames).flatten()
        groups = frames
    else:  # per sample
        t, groups = timestep, None
    temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = self.condition_embedder(
        t, encoder_hidden_states, encoder_hidden_states_image, timestep_seq_len=groups)
    if groups is None:
        temb, timestep_proj = temb.unsqueeze(1), timestep_proj.unsqueeze(1)
    timestep_proj = timestep_proj.unflatten(2, (6, -1))  # (B, G, 6, D)
    if sp is not None:  # the modulation rows of this rank's tokens
        temb, timestep_proj = (sequence.shard_modulation(x, tokens, sp, padded) for x in (temb, timestep_proj))
    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states], dim=1)
    branch = None
    if control_hidden_states is not None:
        if sp is not None:
            raise RuntimeError("a VACE control branch under sequence parallel: not supported")
        branch = ControlBranch(self, hidden_states, encoder_hidden_states, control_hidden_states,
                               control_hidden_states_scale, timestep_proj, rotary_emb)

    if torch.is_grad_enabled() and self.gradient_checkpointing:
        n_ckpt, n_selective = block_plan(self, hidden_states.shape[0] * hidden_states.shape[1])
        keep_outputs(self, n_selective)
        ckpt = checkpoint_function(self, sp is not None)
        if getattr(self, "_wanexp_offload_activations", False):
            ckpt = offloaded_checkpoint
        for i, block in enumerate(self.blocks):
            if i < n_ckpt:
                hidden_states = ckpt(block, hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)
            else:
                hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)
            if branch is not None:
                hidden_states = branch.after(i, hidden_states)
    else:
        for i, block in enumerate(self.blocks):
            hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)
            if branch is not None:
                hidden_states = branch.after(i, hidden_states)

    # output norm and projection: (1, 1, 2, D) + (B, G, 1, D) -> (B, G, 1, D) each
    shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).unsqueeze(2).unbind(3)
    g = temb.shape[1]
    bl, d = hidden_states.shape[:2], hidden_states.shape[2]
    norm = _grouped(self.norm_out(hidden_states.float()), g)
    compute = stream_dtypes(hidden_states, encoder_hidden_states)[0]  # fp16 from the fp32 residual stream of fp16
    hidden_states = (norm * (1 + scale) + shift).view(*bl, d).to(compute)
    hidden_states = self.proj_out(hidden_states)
    if sp is not None:
        hidden_states = sequence.gather(hidden_states, sp)[:, :tokens]
    hidden_states = hidden_states.reshape(b, frames, ph_, pw_, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    output = hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)
    if not return_dict:
        return (output,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=output)


class ControlBranch:
    """A WanVACETransformer3DModel's control branch, diffusers' function in another order: diffusers runs every
    ``vace_blocks`` block first and keeps each one's hint until its base block; here control block k runs right after
    base block ``vace_layers[k]`` (it reads the base blocks' first input and the previous control block's output,
    never the running hidden states, so the order changes nothing) and its hint, times its scale, is added at once:
    one hint alive at a time. Checkpointed when the base blocks are, its control tokens in host memory under
    ``model.offload_activations`` (:func:`offloaded_checkpoint`). One modulation row per sample (a scalar timestep:
    the A14B layouts VACE exists for)."""

    def __init__(self, model: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 control: torch.Tensor, scale: torch.Tensor | None, timestep_proj: torch.Tensor, rotary_emb):
        if timestep_proj.shape[1] != 1:
            raise RuntimeError("a VACE control branch with per-token timesteps: not supported")
        self.model, self.hidden, self.text, self.temb, self.rotary = (model, hidden_states, encoder_hidden_states,
                                                                      timestep_proj[:, 0], rotary_emb)
        control = model.vace_patch_embedding(control.to(hidden_states.dtype)).flatten(2).transpose(1, 2)
        pad = control.new_zeros(control.shape[0], hidden_states.shape[1] - control.shape[1], control.shape[2])
        self.control = torch.cat([control, pad], dim=1)
        layers = sorted(model.config.vace_layers)  # diffusers hands hint k to the k-th vace layer in block order
        self.scale = self.control.new_ones(len(layers)) if scale is None else scale
        self.at = {layer: k for k, layer in enumerate(layers)}
        self.checkpointed = torch.is_grad_enabled() and model.gradient_checkpointing
        self.offload = self.checkpointed and getattr(model, "_wanexp_offload_activations", False)

    def after(self, i: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """The hidden states after base block ``i``, with control block k's hint where ``i`` is its layer."""
        k = self.at.get(i)
        if k is None:
            return hidden_states
        block = self.model.vace_blocks[k]
        if self.offload:
            def run(control, hidden, text, temb, rotary):
                return block(hidden, text, control, temb, rotary)

            hint, self.control = offloaded_checkpoint(run, self.control, self.hidden, self.text, self.temb,
                                                      self.rotary)
        elif self.checkpointed:
            hint, self.control = self.model._gradient_checkpointing_func(block, self.hidden, self.text, self.control,
                                                                         self.temb, self.rotary)
        else:
            hint, self.control = block(self.hidden, self.text, self.control, self.temb, self.rotary)
        return hidden_states + hint * self.scale[k]


# ---- activation checkpointing within a memory budget --------------------------------------------------------------
# Activations a WanTransformerBlock keeps for its backward (LoRA training, bf16 autocast, per-frame modulation), per
# token and per unit of (dim + ffn_dim): measured on one H100 for TI2V-5B at 4,400 tokens (no ckpt 31.2 GiB, every
# block checkpointed 12.1 GiB: 0.637 GiB per block; dim 3072 + ffn 14336).
ACTIVATION_BYTES = 0.637 * 2**30 / (4400 * (3072 + 14336))


def block_activation_gib(config, tokens: int) -> float:
    """Estimated activation memory one block keeps for its backward, for ``tokens`` tokens in the batch."""
    return ACTIVATION_BYTES * tokens * (config.num_attention_heads * config.attention_head_dim + config.ffn_dim) / 2**30


def blocks_to_checkpoint(num_layers: int, per_block_gib: float, budget_gib: float, used_gib: float,
                         input_gib: float = 0.0) -> int:
    """How many blocks (the first ones) to checkpoint so the step stays inside ``budget_gib``.

    ``used_gib`` is held already (weights, optimizer states); every block keeps at least its input (``input_gib``, a
    bf16 tokens x dim tensor); the backward of a checkpointed block recomputes its activations (one block) and needs
    about half a block more of temporaries; 10% of the budget stays free. Calibrated on one H100 (TI2V-5B, every block
    checkpointed): 4,400 tokens 12.1 GiB peak, 27,280 tokens 21.4 GiB."""
    free = budget_gib * 0.9 - used_gib - num_layers * input_gib - 1.5 * per_block_gib
    keep = int(max(0.0, free) // per_block_gib) if per_block_gib > 0 else num_layers
    return max(0, num_layers - min(keep, num_layers))


def plan_blocks(num_layers: int, per_block_gib: float, kept_gib: float, budget_gib: float, used_gib: float,
                input_gib: float = 0.0, selective: bool | None = False) -> tuple[int, int]:
    """How many blocks (the first ones) to checkpoint, and how many of those (the first ones) checkpoint selectively
    (keeping ``kept_gib`` each: their attention output and FFN up-projection, :class:`KeepAttentionAndUpProjection`),
    so the step stays inside ``budget_gib`` (:func:`blocks_to_checkpoint`'s accounting).

    ``selective`` True: every checkpointed block is selective; False: none is. None: the budget chooses. The room goes
    first to selective blocks, then turns selective blocks into blocks not checkpointed at all: per GiB, a selective
    block saves the most time (the 5B at 4,400 tokens on one H200: 54 ms per step for 4.3 GiB, every block selective,
    against 83 ms for 18.8 GiB with no block checkpointed; benchmarks/ti2v5b_h200_2026-11-28.md)."""
    if selective:
        n = blocks_to_checkpoint(num_layers, per_block_gib - kept_gib, budget_gib, used_gib + num_layers * kept_gib,
                                 input_gib)
        return n, n
    if selective is False or kept_gib <= 0 or kept_gib >= per_block_gib:
        return blocks_to_checkpoint(num_layers, per_block_gib, budget_gib, used_gib, input_gib), 0
    free = budget_gib * 0.9 - used_gib - num_layers * input_gib - 1.5 * per_block_gib
    chosen = min(num_layers, int(max(0.0, free) // kept_gib))
    if chosen < num_layers:
        return num_layers, chosen
    free -= num_layers * kept_gib
    unchecked = min(num_layers, int(max(0.0, free) // (per_block_gib - kept_gib)))
    return num_layers - unchecked, num_layers - unchecked


def set_memory_budget(transformer: nn.Module, budget_gib: float | None) -> None:
    """Checkpoint only as many blocks as the budget needs (decided per token count, at its first training forward,
    from the memory the process holds then); None: every block (diffusers' behaviour)."""
    transformer._wanexp_budget_gib = budget_gib
    transformer._wanexp_ckpt_for_tokens = {}


def block_plan(transformer: nn.Module, tokens: int) -> tuple[int, int]:
    """(blocks checkpointed, of them selective) for a training forward of ``tokens`` tokens: every block, selective
    as ``model.selective_checkpointing`` says, without a budget; else :func:`plan_blocks`, once per token count."""
    budget = getattr(transformer, "_wanexp_budget_gib", None)
    layers = len(transformer.blocks)
    selective = getattr(transformer, "_wanexp_selective", False)
    if getattr(transformer, "_wanexp_offload_activations", False):
        selective = False  # the offloaded checkpoint keeps nothing on the GPU
    if budget is None:
        return layers, layers if selective else 0
    cache = transformer._wanexp_ckpt_for_tokens
    if tokens not in cache:
        used = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        # optimizer states and gradients of the trainable parameters may not exist yet at the first step
        trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad) * 4 * 3 / 2**30
        per_block = block_activation_gib(transformer.config, tokens)
        dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        cache[tokens] = plan_blocks(layers, per_block, kept_gib(transformer, tokens), budget, used + trainable,
                                    tokens * dim * 2 / 2**30, selective)
        n, sel = cache[tokens]
        print(f"wanexp: model.memory_budget_gib={budget:g}: {tokens} tokens per step, checkpointing {n} of {layers} "
              f"blocks ({sel} of them selectively; about {per_block:.2f} GiB of activations per block kept, "
              f"{used + trainable:.1f} GiB held)", flush=True)
    return cache[tokens]


def checkpointed_blocks(transformer: nn.Module, tokens: int) -> int:
    """How many blocks (the first ones) a training forward of ``tokens`` tokens checkpoints (:func:`block_plan`)."""
    return block_plan(transformer, tokens)[0]


def use_frame_modulation(transformer: nn.Module) -> nn.Module:
    """Set the per-frame modulation forwards on a loaded WanTransformer3DModel and its blocks (in place)."""
    transformer.forward = types.MethodType(transformer_forward, transformer)
    for block in transformer.blocks:
        block.forward = types.MethodType(block_forward, block)
    return transformer


def compile_supported() -> tuple[bool, str]:
    """Whether this machine compiles blocks: a GPU of compute capability >= 8.0 (Triton's), or no GPU at all."""
    from wanexp.gpu_check import gpu_capability_below

    gpu = gpu_capability_below((8, 0))
    return (False, f"{gpu} is below Triton's 8.0") if gpu else (True, "")


def checkpointed_call(block: nn.Module, *args):
    """One block under activation checkpointing (non-reentrant), the function compiled by :func:`compile_blocks`;
    selective where :func:`set_selective_checkpointing` gave the block a policy."""
    policy = getattr(block, "_wanexp_keep", None)
    if policy is None:
        return torch_checkpoint(block, *args, use_reentrant=False)
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return torch_checkpoint(block, *args, use_reentrant=False,
                            context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


# ---- selective activation checkpointing (model.selective_checkpointing) -------------------------------------------
# The attention kernels whose outputs (and log-sum-exp) a selectively checkpointed block keeps for its self-attention:
# the recompute skips it, the costliest part of a block to run again at long sequences (the cross-attention's 512
# text keys are cheap to run again).
ATTENTION_OPS = tuple(getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name))
# the frozen linear: bf16 with its bias (addmm), or the FP8 base's scaled GEMM (models/fp8.py: its bias is added
# after, recomputed); the LoRA's bias-free products (mm) are recomputed (rank-wide: cheap)
MATMUL_OPS = (torch.ops.aten.addmm.default, torch.ops.aten._scaled_mm.default)


def gemm_width(op, args) -> int:
    """The output width of a frozen GEMM of :data:`MATMUL_OPS` from its arguments: addmm(bias, x, w^T) or
    _scaled_mm(x, w^T, ...)."""
    return args[2].shape[-1] if op is torch.ops.aten.addmm.default else args[1].shape[-1]


class KeepAttentionAndUpProjection:
    """The save policy of a selectively checkpointed block (``torch.utils.checkpoint``'s ``context_fn``): keep the
    outputs of the self-attention kernel (queries and keys of one length) and of the FFN's up-projection (the frozen
    GEMM whose output is ``ffn_dim`` wide, ``ffn.0``, bf16 or the FP8 base's), recompute everything else (norms,
    modulation, projections, cross-attention, LoRA products, GELU). Per block and token that keeps dim + ffn_dim bf16
    values (plus the attention's log-sum-exp) besides the block's input."""

    def __init__(self, ffn_dim: int):
        self.ffn_dim = ffn_dim

    def __call__(self, ctx, op, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        if op in ATTENTION_OPS and args[1].shape[-2] == args[0].shape[-2]:
            return CheckpointPolicy.MUST_SAVE
        if op in MATMUL_OPS and gemm_width(op, args) == self.ffn_dim:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def set_selective_checkpointing(transformer: nn.Module, on: bool | None) -> None:
    """``model.selective_checkpointing``: True, every checkpointed block keeps what
    :class:`KeepAttentionAndUpProjection` keeps; False, none (every checkpointed block recomputes all but its input);
    None, the blocks ``model.memory_budget_gib`` has room for (:func:`plan_blocks`; none without a budget). The
    blocks' policies are set at each training forward (:func:`keep_outputs`)."""
    transformer._wanexp_selective = on
    transformer._wanexp_keep_policy = KeepAttentionAndUpProjection(transformer.config.ffn_dim)
    keep_outputs(transformer, len(transformer.blocks) if on else 0)


def keep_outputs(transformer: nn.Module, n: int) -> None:
    """The first ``n`` blocks checkpoint selectively (their save policy), the others fully."""
    policy = getattr(transformer, "_wanexp_keep_policy", None)
    for i, block in enumerate(transformer.blocks):
        block._wanexp_keep = policy if i < n else None


def kept_bytes_per_token(heads: int, head_dim: int, ffn_dim: int) -> int:
    """What a selectively checkpointed block keeps per token besides its input: the attention output (bf16), its
    log-sum-exp (fp32 per head) and the FFN's up-projection (bf16)."""
    return 2 * heads * head_dim + 4 * heads + 2 * ffn_dim


def kept_gib(transformer: nn.Module, tokens: int) -> float:
    """What a selectively checkpointed block of ``transformer`` keeps for its backward besides its input (0 where
    ``model.selective_checkpointing=false``)."""
    if getattr(transformer, "_wanexp_selective", False) is False:
        return 0.0
    c = transformer.config
    return tokens * kept_bytes_per_token(c.num_attention_heads, c.attention_head_dim, c.ffn_dim) / 2**30


def eager_checkpoint(transformer: nn.Module):
    """The eager checkpoint of a block (around the compiled block, or of an eager one): diffusers'
    ``_gradient_checkpointing_func``, or under selective checkpointing the same non-reentrant checkpoint with the
    blocks' save policy (:func:`checkpointed_call`)."""
    if all(getattr(block, "_wanexp_keep", None) is None for block in transformer.blocks):
        return transformer._gradient_checkpointing_func
    return checkpointed_call


def to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied into pinned host memory, the copy in autograd's graph (its gradient flows back to ``x``); a CPU
    tensor as it is. The device-to-host copy is queued on the current stream, not waited for: only the same stream's
    host-to-device copy in the recompute reads it, and the source's memory is reused only by later work on that
    stream."""
    if x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)


def offloaded_checkpoint(block: nn.Module, hidden_states: torch.Tensor, *args):
    """One block under activation checkpointing whose input hidden states wait in pinned host memory for the backward
    (``model.offload_activations``): at 480x832x81 the A14B's 40 block inputs are 12.5 GiB of GPU memory otherwise.

    Non-reentrant checkpointing keeps the inputs its recompute needs referenced from the recompute's closure, so its
    input is the host copy (:func:`to_host`): the forward runs the block on the GPU tensor it was given (and drops it),
    the recompute on the host copy copied back. The other inputs (text states, modulation, rotary tables) are one
    tensor shared by every block and stay. One copy out and one back per block and step: at 32,760 tokens 335 MB each
    way against about 0.3 s of compute per A14B block. Non-reentrant, so that DDP with ``find_unused_parameters`` (two
    A14B experts, DMD) sees the blocks' parameters in the forward's graph: reentrant checkpointing leaves them out of
    it (DDP marks them unused), then its inner backward marks them ready a second time, and DDP stops."""
    device, host = hidden_states.device, to_host(hidden_states)
    on_gpu = [hidden_states]  # the forward's input, dropped once read; the recompute finds the list empty
    del hidden_states

    def run(host: torch.Tensor, *rest):
        h = on_gpu.pop() if on_gpu else host.to(device, non_blocking=True)
        return block(h, *rest)

    return torch_checkpoint(run, host, *args, use_reentrant=False)


def checkpoint_function(transformer: nn.Module, sequence_parallel: bool):
    """How a checkpointed block is called: the compiled :func:`checkpointed_call` where :func:`compile_blocks` made
    one, else diffusers' ``_gradient_checkpointing_func`` (eager ``torch.utils.checkpoint`` around the block).

    Compiled with the checkpoint, the block's forward saves only its inputs and its compiled backward recomputes the
    rest: none of eager checkpointing's per-tensor Python hooks, its second forward call or the recomputed-tensor
    check run on the host (a 5B step's host time is close to its GPU time: 23 % less host time per step, measured on
    the CPU with the 5B's 30 blocks at tiny widths, 152 -> 117 ms). The same function, rounded in other places: fused
    chains stay in fp32 (on the H100 the 5B's output is closer to the fp32 function than eager bf16's; README,
    Performance). Not under FSDP2 (its hooks gather the block's parameters around the call) or sequence parallel
    (collectives inside the block): there the block is called as before."""
    compiled = getattr(transformer, "_wanexp_compiled_checkpoint", None)
    if compiled is None or sequence_parallel:
        return eager_checkpoint(transformer)
    from torch.distributed.fsdp import FSDPModule

    if isinstance(transformer.blocks[0], FSDPModule):
        return eager_checkpoint(transformer)
    return compiled


RECOMPILE_LIMIT = 64  # compiled entries per block code object (compile_blocks)


def compile_blocks(transformer: nn.Module, checkpoint: bool = True, cuda_graphs: bool = False,
                   **kwargs) -> nn.Module:
    """``torch.compile`` each transformer block in place (regional compilation; parameter names unchanged), and a
    checkpointed block call with its checkpoint inside the compiled graph (:func:`checkpoint_function`; ``checkpoint``
    false: the eager checkpoint around the compiled block, ``model.compile_checkpoint=false``).

    ``cuda_graphs`` (``model.cuda_graphs``): compiled in reduce-overhead mode, each compiled forward and backward is
    recorded once as a CUDA graph and replayed, so the host issues one graph launch instead of the block's kernels.
    The blocks share one compiled function; inductor's CUDA graph trees record one graph per call in a step's order
    (block k's parameters are its recording's fixed inputs) and one set per input shape. A training step begins a new
    replay (``DiffusionModule.training_step``); each gradient-free forward begins one itself
    (:func:`transformer_forward`).

    Where blocks cannot be compiled (see :func:`compile_supported`) it says so once and leaves them eager."""
    ok, why = compile_supported()
    if not ok:
        print(f"wanexp: model.compile=true skipped: {why}; the blocks run eagerly", flush=True)
        return transformer
    # No DDPOptimizer: it splits a graph compiled inside DDP's forward at gradient-bucket boundaries, and with
    # activation checkpointing (torch 2.11, CUDA) the recompute outside DDP's forward then saved other tensors than
    # the forward: `CheckpointError: Recomputed values ... have different metadata` in the first backward of every
    # DDP run, one GPU included. Each block is its own graph already, so there is nothing for it to split.
    torch._dynamo.config.optimize_ddp = False
    # Every block shares one compiled code object, so each distinct call gets its own entry: grad on/off, an input
    # that requires grad or not (the first block's does not), the active adapter (DMD switches between generator,
    # critic and none), and a static then a dynamic shape when buckets differ. DMD's product of these passed dynamo's
    # default limit of 8 on the tiny model, after which a call runs eagerly (slower, silently after one warning).
    # Each entry compiles once; the count is bounded by the run's configuration, not by its length.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if cuda_graphs:
        kwargs["mode"] = "reduce-overhead"
        transformer._wanexp_cuda_graphs = True
    for block in transformer.blocks:
        block.compile(**kwargs)
    if checkpoint:  # one graph for every block (dynamo guards on the block's class, its parameters are inputs)
        transformer._wanexp_compiled_checkpoint = torch.compile(checkpointed_call, **kwargs)
    return transformer
