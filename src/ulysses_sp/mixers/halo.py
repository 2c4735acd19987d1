"""The causal halo: the last ``K-1`` positions of the previous SP rank's shard, for a short causal
convolution of kernel ``K`` run on the local tokens.

Rank ``r`` holds tokens ``[r*S_l, (r+1)*S_l)``; a causal convolution of kernel ``K`` at its first
positions reads the ``K-1`` tokens before the shard, which rank ``r-1`` holds. ``halo_from_previous``
fetches them (zeros on rank 0, where the model's own left zero-padding applies) in one exchange that
sends ``K-1`` positions to the next rank only (``parallel.comm.exchange_bytes``: uneven splits, no
padding, nothing sent to the other ranks). Its backward returns the halo's gradient to its owner,
where it is added to the gradient of that rank's last positions.

Shape legend: ``B`` batch, ``C`` channels, ``S_l = S/P``, ``W = K-1`` the halo width.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.parallel.comm import exchange_bytes


def _shift(t: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """Send ``t`` to the group rank ``sp_rank + step`` and return what ``sp_rank - step`` sent
    (zeros where that rank does not exist). One ``all_to_all`` with a single non-empty split."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    dst, src = r + step, r - step
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    pieces = [[t] if k == dst else [] for k in range(p)]
    raw = exchange_bytes(pieces, [nbytes if k == src else 0 for k in range(p)], group, t.device)
    if not 0 <= src < p:
        return torch.zeros_like(t)
    # [nbytes] uint8 -> t's dtype and shape, on t's device
    return raw.to(t.device).view(t.dtype).view(t.shape)


class _HaloFromPrevious(torch.autograd.Function):
    """Forward: the previous rank's last ``W`` positions (zeros on rank 0). Backward: the halo's
    gradient back to the previous rank, added to the gradient of its last ``W`` positions."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, width: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.width, ctx.group, ctx.shape = width, group, x.shape
        return _shift(x[..., -width:], group, +1)  # [B, C, S_l] -> [B, C, W] of rank r-1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        back = _shift(grad, ctx.group, -1)  # [B, C, W]: the gradient of my tail, from rank r+1
        full = grad.new_zeros(ctx.shape)
        full[..., -ctx.width :] = back  # [B, C, S_l]: nonzero only on the last W positions
        return full, None, None


def halo_from_previous(x: torch.Tensor, width: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, C, S_l] -> [B, C, W]``: positions ``[r*S_l - W, r*S_l)`` of the full sequence (zeros on
    SP rank 0). Differentiable. Raises ``ValueError`` when ``S_l < W`` (the halo would span ranks)."""
    if x.shape[-1] < width:
        raise ValueError(
            f"the local shard has {x.shape[-1]} tokens, fewer than the {width} a causal convolution of "
            f"kernel {width + 1} reads before it: use a longer sequence or a smaller sp_size"
        )
    return _HaloFromPrevious.apply(x, width, group)
