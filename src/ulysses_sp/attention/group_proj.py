"""One head group's projections inside the attention block (``attention/head_blocks.py``).

While a group's block runs, the module's ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (plain
``nn.Linear``) are stood in for by ``GroupProj``: the group's rows (q/k/v) or columns (o) of the full
weight, and what a whole-layer linear would leave behind is never made:

- **forward** (no autograd): q/k/v ``x W_g^T + b_g``; ``o_proj`` adds ``a W_{o,g}^T`` into the block's
  output in place (``addmm_``; the bias in group 0 only) and returns a placeholder of the output's shape
  that holds no memory (a one-element tensor expanded); overlapped (``attention/block_overlap.py``) the
  attention output is still on its way: ``o_proj`` checks its input is a reshape of the buffer the attention
  handed out and records the ``addmm_`` for when the output has landed;
- **backward** (the group run again under autograd, its placeholder output back-propagated with the
  layer's output gradient): ``o_proj``'s backward gives the group's attention-output gradient; q/k/v's
  add their input gradient into the block's input gradient in place (``addmm_``: no ``[B, S_l, h]``
  temporary per projection) and every weight/bias gradient into full-size buffers at the group's
  rows/columns.

``BlockGrads`` holds those accumulators for one block backward.

Shape legend: ``B`` batch, ``S_l`` local tokens, ``h`` hidden size, ``n_g`` the group's output features
(its heads times ``D``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class BlockGrads:
    """Gradient accumulators of one block backward: the input's and the parameters' (by name)."""

    dx: torch.Tensor | None
    """``[B, S_l, h]``: the block input's gradient (``None``: not wanted)."""
    params: dict[str, torch.Tensor | None] = field(default_factory=dict)
    """Full-size gradient buffers of the projections' ``weight``/``bias`` (``None``: not wanted)."""

    def add_rows(self, name: str, index: torch.Tensor, grad: torch.Tensor, dim: int = 0) -> None:
        buf = self.params.get(name)
        if buf is not None:
            buf.index_add_(dim, index, grad.to(buf.dtype))


class _InProj(torch.autograd.Function):
    """``y = x W[rows]^T + b[rows]``; backward: ``dx += dy W[rows]`` in place, ``dW[rows] += dy^T x``."""

    @staticmethod
    def forward(ctx, x, weight, bias, rows, grads: BlockGrads, name: str):
        w = weight.index_select(0, rows)  # [n_g, h]
        ctx.save_for_backward(x, w, rows)
        ctx.grads, ctx.name, ctx.has_bias = grads, name, bias is not None
        return F.linear(x, w, None if bias is None else bias.index_select(0, rows))  # [B, S_l, n_g]

    @staticmethod
    def backward(ctx, dy):
        x, w, rows = ctx.saved_tensors
        grads, dy2 = ctx.grads, dy.reshape(-1, dy.shape[-1])  # [B*S_l, n_g]
        if grads.dx is not None:  # [B*S_l, n_g] @ [n_g, h] added into [B*S_l, h]
            grads.dx.view(-1, grads.dx.shape[-1]).addmm_(dy2, w.to(dy2.dtype))
        if grads.params.get(ctx.name + ".weight") is not None:
            grads.add_rows(ctx.name + ".weight", rows, dy2.t() @ x.reshape(-1, x.shape[-1]))
        if ctx.has_bias:
            grads.add_rows(ctx.name + ".bias", rows, dy2.sum(0))
        return None, None, None, None, None, None


class _OutProj(torch.autograd.Function):
    """The group's ``o_proj`` in backward: a placeholder forward; ``da = dy W[:, cols]``,
    ``dW[:, cols] += dy^T a``, the bias gradient (group 0)."""

    @staticmethod
    def forward(ctx, a, weight, cols, first: bool, grads: BlockGrads, name: str):
        w = weight.index_select(1, cols)  # [h, n_g]
        ctx.save_for_backward(a, w, cols)
        ctx.first, ctx.grads, ctx.name = first, grads, name
        return a.new_zeros(1).expand(*a.shape[:-1], w.shape[0])  # [B, S_l, h], no memory

    @staticmethod
    def backward(ctx, dy):
        a, w, cols = ctx.saved_tensors
        grads, dy2 = ctx.grads, dy.reshape(-1, dy.shape[-1])  # [B*S_l, h]
        if grads.params.get(ctx.name + ".weight") is not None:
            grads.add_rows(ctx.name + ".weight", cols, dy2.t() @ a.reshape(-1, a.shape[-1]), dim=1)
        if ctx.first and grads.params.get(ctx.name + ".bias") is not None:
            grads.params[ctx.name + ".bias"].add_(dy2.sum(0).to(grads.params[ctx.name + ".bias"].dtype))
        da = (dy2 @ w.to(dy2.dtype)).view(*a.shape)  # [B*S_l, h] @ [h, n_g] -> [B, S_l, n_g]
        return da, None, None, None, None, None


class GroupProj(torch.nn.Module):
    """Stands in for one projection ``nn.Linear`` while a head group's block runs (see the module doc).

    ``index``: the group's rows (q/k/v) or columns (o) of the weight; ``out``: ``o_proj``'s forward
    accumulator (``None`` for q/k/v); ``grads``: the backward's accumulators (``None`` in forward);
    ``first``: group 0 (``o_proj``'s bias is added once).
    """

    def __init__(self, linear: torch.nn.Linear, name: str, index: torch.Tensor, *, out: torch.Tensor | None,
                 grads: BlockGrads | None, first: bool, defer: Any = None) -> None:  # fmt: skip
        super().__init__()
        self.linear, self.name, self.index, self.out, self.grads, self.first = linear, name, index, out, grads, first
        self.defer = defer
        """``o_proj`` under overlap: the group's ``block_overlap.Deferred`` (its attention output arrives later)."""
        self.placeholder: torch.Tensor | None = None
        """``o_proj``'s returned placeholder: the module must return it unchanged (checked)."""

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        w, b = self.linear.weight, self.linear.bias
        is_out = self.name == "o_proj"
        if self.grads is not None:  # backward: the graph back-propagates into the accumulators
            w, b = w.detach(), None if b is None else b.detach()
            if is_out:
                self.placeholder = _OutProj.apply(t, w, self.index, self.first, self.grads, self.name)
                return self.placeholder
            return _InProj.apply(t, w, b, self.index, self.grads, self.name)
        if not is_out:  # [B, S_l, h] -> [B, S_l, n_g]
            return F.linear(t, w.index_select(0, self.index), None if b is None else b.index_select(0, self.index))
        self.placeholder = t.new_zeros(1).expand(*t.shape[:-1], w.shape[0])
        if self.defer is not None and self.defer.buffer is not None:  # the attention output is still on its way
            if not _views(t, self.defer.buffer):
                raise ValueError("head_chunk_overlap: the attention module changes its attention output before "
                                 "o_proj, so o_proj cannot wait for it; turn head_chunk_overlap off")  # fmt: skip
            self.defer.then = lambda: self._accumulate(t)
        else:
            self._accumulate(t)
        return self.placeholder

    def _accumulate(self, t: torch.Tensor) -> None:
        w, b = self.linear.weight, self.linear.bias
        acc = self.out.view(-1, self.out.shape[-1])  # [B*S_l, n_g] @ [n_g, h] added into [B*S_l, h]
        acc.addmm_(t.reshape(-1, t.shape[-1]), w.index_select(1, self.index).t())
        if self.first and b is not None:
            self.out.add_(b)


def _views(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``t`` is ``buffer``'s memory, whole and in its order (a reshape of it); storages compared
    by identity (a fake tensor's ``data_ptr`` is 0)."""
    same = t.untyped_storage()._cdata == buffer.untyped_storage()._cdata
    return same and t.storage_offset() == buffer.storage_offset() and t.numel() == buffer.numel() and t.is_contiguous()
