"""Collectives for sequence parallelism: differentiable all-to-all, gathers, and error agreement.

All communication of the sequence-parallel path lives here; every function takes its process
group explicitly. Where it sits in the step (DESIGN.md): the all-to-all runs twice per attention
layer (q/k/v in, output out), the gather of position ids once per forward, the loss reduction once
per micro-step.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P`` local sequence, ``H`` heads,
``H_l = H/P``, ``D`` head dim, ``P`` sp size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Split ``x`` into ``P`` chunks along ``scatter_dim``, send chunk ``j`` to rank ``j``, and
    concatenate what arrives along ``gather_dim`` in rank order."""
    p = dist.get_world_size(group)
    if p == 1:
        return x
    scatter_dim %= x.dim()
    gather_dim %= x.dim()
    n = x.shape[scatter_dim]
    if n % p:
        raise ValueError(f"dim {scatter_dim} of shape {tuple(x.shape)} is not divisible by sp_size {p}")
    # [..., n, ...] -> [P, ..., n/P, ...]: chunk j (for rank j) first, contiguous for the collective.
    send = x.unflatten(scatter_dim, (p, n // p)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # [P(src), ..., g, ...] -> [..., P*g, ...]: the source rank's block goes before its elements.
    recv = recv.movedim(0, gather_dim)
    return recv.flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    """All-to-all scattering ``scatter_dim`` and gathering ``gather_dim`` forward; the inverse
    all-to-all (gather_dim scattered, scatter_dim gathered) backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup):
        ctx.dims = (scatter_dim, gather_dim)
        ctx.group = group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, H, S_l, D] -> [B, H_l, S, D]``: every rank gets the full sequence for its heads.

    Differentiable; the backward is ``heads_to_seq`` of the gradient.
    """
    # [B, H, S_l, D] -> [B, H/P, P*S_l, D]
    return _AllToAll.apply(x, 1, 2, group)


def heads_to_seq(
    x: torch.Tensor, group: dist.ProcessGroup, *, head_dim: int = 1, seq_dim: int = 2
) -> torch.Tensor:
    """``[B, H_l, S, D] -> [B, H, S_l, D]`` (or any layout, naming the two dims): the inverse of
    ``seq_to_heads``. Differentiable."""
    # [.., H_l, .., S, ..] -> [.., H, .., S_l, ..]
    return _AllToAll.apply(x, seq_dim, head_dim, group)


def all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup, *, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (not differentiable).

    Used for small per-token metadata such as position ids: ``[B, S_l] -> [B, S]``.
    """
    p = dist.get_world_size(group)
    if p == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum of a detached tensor over ``group`` (a new tensor; the input is not modified)."""
    out = x.detach().clone()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` in rank order (for small metadata: lengths, shapes, error messages)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def raise_if_any_rank_failed(
    error: str | None, group: dist.ProcessGroup | None = None, exc_type: type[Exception] = ValueError
) -> None:
    """Collective error agreement: if any rank passes a message, **every** rank raises.

    A check that only some ranks can fail (their own batch, their own shard) must go through this
    before the next collective, or the healthy ranks would block in it until the timeout. The
    raised message names the failing ranks and their messages.
    """
    if not dist.is_initialized():
        if error is not None:
            raise exc_type(error)
        return
    errors = all_gather_object(error, group)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        if len({e for _, e in bad}) == 1:
            ranks = ", ".join(str(r) for r, _ in bad)
            raise exc_type(f"{bad[0][1]} (on rank(s) {ranks} of the group)")
        raise exc_type("; ".join(f"rank {r}: {e}" for r, e in bad))
