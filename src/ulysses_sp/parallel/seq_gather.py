"""Differentiable gathers of small sequence pieces over the SP group: a halo of the tokens before a shard
that may span several ranks, and every rank's variable-length run of rows.

DeepSeek-V4's compressed attention (``attention/pooled_kv.py``, ``pooled_core.py``) pools K/V in windows
aligned to the full sequence and attends its local queries to a sliding window of the layer's own keys:
a rank needs the few tokens before its shard that a window straddling its edge reads (``tokens_before``),
and every rank's pooled entries, which are few (``S/rate``) but differ in number between ranks
(``all_gather_ragged``). Both go through one all-gather of equal pieces (``all_gather_seq_grad``), built
on ``parallel/comm.py``'s primitives: forward every rank's piece in rank order, backward the gradient
summed over the group and this rank's piece of it (so a token one rank reads as its halo gets the reader's
gradient back). The index lists are host ints computed from shapes: no device value is read.

Shape legend: ``B`` batch, ``S_l`` tokens per rank, ``F`` features, ``P`` sp size, ``m`` the tail each
rank contributes to a halo, ``n`` rows per rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.parallel.comm import all_gather_seq, all_reduce_sum


class _AllGatherSeq(torch.autograd.Function):
    """Forward: every rank's ``x`` concatenated along ``dim`` in rank order. Backward: the incoming
    gradient summed over the group (every rank used the whole), this rank's piece of it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.size = group, dim, x.shape[dim]
        return all_gather_seq(x.contiguous(), group, dim=dim)  # [.., n, ..] -> [.., P*n, ..]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        total = all_reduce_sum(grad.contiguous(), ctx.group)  # [.., P*n, ..] summed over the readers
        return total.narrow(ctx.dim, dist.get_rank(ctx.group) * ctx.size, ctx.size), None, None


def all_gather_seq_grad(x: torch.Tensor, group: dist.ProcessGroup | None, *, dim: int = 1) -> torch.Tensor:
    """``[.., n, ..] -> [.., P*n, ..]`` along ``dim``, differentiable (``None`` group or one rank: ``x``)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllGatherSeq.apply(x, group, dim)


def all_gather_ragged(x: torch.Tensor, counts: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[B, n_r, F] -> [B, sum(counts), F]``: every rank's rows in rank order, rank ``j`` holding
    ``counts[j]`` (host ints, the same list on every rank; padded to the largest for the gather)."""
    if group is None or dist.get_world_size(group) == 1 or max(counts) == 0:
        return x
    rank, most = dist.get_rank(group), max(counts)
    if x.shape[1] != counts[rank]:
        raise ValueError(f"rank {rank} holds {x.shape[1]} rows where the layout gives it {counts[rank]}")
    padded = torch.cat([x, x.new_zeros((x.shape[0], most - x.shape[1], *x.shape[2:]))], dim=1)
    gathered = all_gather_seq_grad(padded, group, dim=1)  # [B, P*most, F]
    keep = [j * most + i for j, c in enumerate(counts) for i in range(c)]
    return gathered.index_select(1, torch.tensor(keep, dtype=torch.long, device=x.device))


def tokens_before(x: torch.Tensor, first: int, width: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[B, S_l, ...] -> [B, lo - first, ...]``: the full sequence's tokens ``[first, lo)`` (``lo`` this
    rank's first token), from the ranks before it; differentiable.

    ``width``: the most tokens any rank of the group takes (the same on every rank: every rank joins the
    gather, rank 0 too). Each rank contributes its last ``m = min(S_l, width)`` tokens, so a halo longer than
    a shard reads whole shards of several ranks."""
    s_l = x.shape[1]
    if group is None or dist.get_world_size(group) == 1 or width == 0:
        return x[:, :0]
    lo, m = dist.get_rank(group) * s_l, min(s_l, width)
    if not 0 <= lo - first <= width:
        raise ValueError(f"a halo of {lo - first} tokens before token {lo}, more than the width {width} gathered")
    tails = all_gather_seq_grad(x[:, s_l - m :], group, dim=1)  # [B, P*m, ...]: rank i's [(i+1)S_l - m, (i+1)S_l)
    keep = [(g // s_l) * m + g - (g // s_l + 1) * s_l + m for g in range(first, lo)]
    return tails.index_select(1, torch.tensor(keep, dtype=torch.long, device=x.device))
