"""Sequence parallelism (Ulysses): ``parallel.sp_size=N`` splits every sample's tokens over N ranks.

The ranks form a 2-D grid (data x sequence): ranks ``[k*N, (k+1)*N)`` are sequence group k (neighbours, so the
all-to-alls stay inside a node) and see the same samples, noise and timesteps; data sharding, the effective batch,
samples/s and FLOP accounting use the data-parallel size ``world / N``.

Inside the transformer (a family's forward, e.g. models/wan22/fast.py; ModelSpec.enable_sequence_parallel sets
it up) each rank keeps ``tokens / N`` consecutive tokens after the
patch embedding: modulation, feed-forward, cross-attention (queries local, the text keys whole) and the LoRA layers
run on the local tokens only. Self-attention swaps the split: an all-to-all turns (local tokens, all heads) into (all
tokens, heads / N), attention runs per head over the whole sequence, and a second all-to-all turns it back. The
output projection's tokens are all-gathered before the unpatchify, so every rank of a group computes the same loss.

Gradients: the all-gather's backward is a reduce-scatter (sum), so each rank's parameter gradient is N x its tokens'
share; the data-parallel average over all ``world`` ranks (DDP all-reduce or FSDP reduce-scatter) then gives exactly
the mean over the ``world / N`` samples of their full gradients: the same as data parallel over ``world / N`` ranks.
The frozen base is sharded (FSDP) over the whole world, not per group.

Limits (checked with a one-line error): the heads must divide by N. A sample whose token count does not divide by N
is padded with zero tokens to the next multiple (``pad_to_ranks``); the self-attention leaves them out (its keys and
values are the real tokens only) and they are dropped after the final gather, so the result is the unpadded one's.

Here: the family-neutral pieces (the groups, shard/gather, the all-to-alls that swap tokens and heads, the checks);
a family's attention processor that uses them lives in its package (Wan2.2's: models/wan22/sequence.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from wanexp.errors import ConfigError

_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


@dataclass
class SequenceGroup:
    """This rank's place in the (data x sequence) grid."""
    group: object  # the process group of the N ranks that share one sample
    size: int
    rank: int  # within the group
    dp_rank: int
    dp_size: int


def build_group(sp_size: int) -> SequenceGroup:
    """Create the sequence groups (a collective: every rank calls it, in the same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sp_size:
        raise ConfigError(f"parallel.sp_size={sp_size} with {world} processes: the world size must be a multiple of "
                          f"sp_size; use {sp_size}*k devices or another sp_size")
    mine = None
    for k in range(world // sp_size):  # new_group is collective over the whole world: every rank makes every group
        ranks = list(range(k * sp_size, (k + 1) * sp_size))
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return SequenceGroup(mine, sp_size, rank % sp_size, rank // sp_size, world // sp_size)


def check_heads(heads: int, sp: int) -> None:
    if heads % sp:
        divisors = [d for d in range(2, heads + 1) if heads % d == 0][:6]
        raise ConfigError(f"parallel.sp_size={sp}: the model's {heads} attention heads do not divide by {sp}; "
                          f"use an sp_size that divides the head count (e.g. {', '.join(map(str, divisors))})")


def shard(x: torch.Tensor, sp: SequenceGroup, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous 1/N of ``x`` along ``dim`` (slicing: its backward fills the other parts with zeros)."""
    n = x.shape[dim] // sp.size
    return x.narrow(dim, sp.rank * n, n)


def gather(x: torch.Tensor, sp: SequenceGroup, dim: int = 1) -> torch.Tensor:
    """All N parts along ``dim``, in rank order; the backward reduce-scatters (sums) the gradient."""
    x = x.movedim(dim, 0).contiguous()
    out = funcol.wait_tensor(_gather(x, 0, sp.group))
    return out.movedim(0, dim)


def _all_to_all(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """Send x[i] (leading dim N) to rank i of the group; returns what rank i sent here at position i."""
    shape = x.shape
    out = funcol.all_to_all_single_autograd(x.contiguous().flatten(), None, None, sp.group)
    return funcol.wait_tensor(out).view(shape)


def tokens_to_heads(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """(B, S/N, H, d) local tokens, all heads -> (B, S, H/N, d) all tokens, this rank's heads."""
    b, s, h, d = x.shape
    x = x.view(b, s, sp.size, h // sp.size, d).permute(2, 0, 1, 3, 4)  # (N, B, S/N, H/N, d): part i goes to rank i
    x = _all_to_all(x, sp)  # (N, B, S/N, H/N, d): part i holds rank i's tokens of this rank's heads
    return x.permute(1, 0, 2, 3, 4).reshape(b, sp.size * s, h // sp.size, d)


def heads_to_tokens(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """The inverse of :func:`tokens_to_heads`: (B, S, H/N, d) -> (B, S/N, H, d)."""
    b, s, h, d = x.shape
    x = x.view(b, sp.size, s // sp.size, h, d).permute(1, 0, 2, 3, 4)  # part i: rank i's tokens
    x = _all_to_all(x, sp)  # part i: this rank's tokens of rank i's heads
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // sp.size, sp.size * h, d)


def pad_to_ranks(x: torch.Tensor, sp: SequenceGroup, dim: int = 1) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to a multiple of the ranks (``x`` itself when it divides)."""
    pad = -x.shape[dim] % sp.size
    if not pad:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:dim], pad, *x.shape[dim + 1:])], dim=dim)


def shard_modulation(temb: torch.Tensor, tokens: int, sp: SequenceGroup, padded: int | None = None) -> torch.Tensor:
    """Per-group modulation (B, G, ...) for ``tokens`` tokens in G equal consecutive groups -> the rows of this rank's
    tokens: (B, G', ...) for its tokens / G' equal groups. A rank's share may start or end inside a group (a latent
    frame), so groups are refined to units of gcd(tokens/G, tokens/N) tokens, each inside one group and one share.
    ``padded``: the sequence's length with the padding that makes it split (``pad_to_ranks``); the padding takes the
    last group's rows (its outputs are dropped)."""
    g = temb.shape[1]
    if g == 1:
        return temb
    padded = padded or tokens
    per_group, per_rank = tokens // g, padded // sp.size
    unit = gcd(per_group, per_rank)  # divides tokens and padded, so the padding is whole units too
    units = temb.repeat_interleave(per_group // unit, dim=1)  # (B, tokens/unit, ...): a handful of rows
    if padded > tokens:
        units = torch.cat([units, units[:, -1:].expand(-1, (padded - tokens) // unit, *units.shape[2:])], dim=1)
    return units.narrow(1, sp.rank * (per_rank // unit), per_rank // unit)
