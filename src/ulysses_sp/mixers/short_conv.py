"""Sequence parallelism for gated short causal convolutions (LFM2's ``Lfm2ShortConv`` and its kin).

The mixer: ``B, C, x = in_proj(h)``; ``y = C * conv(B * x)``; ``out_proj(y)``, where ``conv`` is a
depthwise causal ``Conv1d`` (kernel ``K`` = 3-4) run by the modeling file's ``causal_conv1d_fn``.
Only the convolution mixes tokens, and it is per channel, so channels play the role of heads:

1. ``in_proj`` and the gate ``B * x`` on the local tokens: ``[B, S_l, Hd]``;
2. one all-to-all ``[B, S_l, Hd] -> [B, S, Hd_l]`` (every rank the full sequence of its channels);
3. the model's ``causal_conv1d_fn`` over the full sequence with the conv weight and bias sliced to
   the local channels inside forward (autograd returns the full-parameter gradient), once per
   packed document (``documents.per_document``: no leak across a boundary);
4. one all-to-all back ``[B, Hd_l, S] -> [B, Hd, S_l]``; ``C * y`` and ``out_proj`` locally.

Two exchanges per layer, ``B * S_l * Hd * (P-1)/P`` elements each way per rank. Matched by
structure (a depthwise ``conv``, ``in_proj`` to ``3 x`` its channels, ``out_proj``, and a
``causal_conv1d_fn`` in the modeling file), never by model name.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``Hd`` conv channels (the
hidden size), ``Hd_l = Hd/P``, ``P`` sp size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ulysses_sp.mixers._kernels import (
    ForwardHandler,
    local_span,
    model_function,
)
from ulysses_sp.mixers.documents import PositionTracker, per_document, segments
from ulysses_sp.parallel.comm import heads_to_seq, seq_to_heads_packed


class ShortConvHandler(ForwardHandler):
    """Shards a gated short causal convolution over the SP group (see the module docstring)."""

    name = "short_conv"

    def matches(self, module: nn.Module) -> bool:
        conv, in_proj = getattr(module, "conv", None), getattr(module, "in_proj", None)
        return (
            isinstance(conv, nn.Conv1d)
            and conv.groups == conv.in_channels == conv.out_channels
            and conv.padding == (conv.kernel_size[0] - 1,)
            and isinstance(in_proj, nn.Linear)
            and in_proj.out_features == 3 * conv.in_channels
            and isinstance(getattr(module, "out_proj", None), nn.Linear)
            and model_function(module, "causal_conv1d_fn") is not None
            and model_function(module, "apply_mask_to_padding_states") is not None
        )

    def check(self, module: nn.Module, sp_size: int) -> None:
        channels = module.conv.in_channels
        if channels % sp_size:
            raise ValueError(
                f"{type(module).__name__}: {channels} convolution channels are not divisible by "
                f"sp_size {sp_size}; choose an sp_size that divides {channels}"
            )

    def sharded(self, module: nn.Module, mesh: Any, positions: PositionTracker, hidden: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        return _sharded_forward(module, mesh, positions, hidden, mask)


def _sharded_forward(
    module: nn.Module, mesh: Any, positions: PositionTracker, hidden: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """The mixer's forward, head(channel)-sharded: ``[B, S_l, D] -> [B, S_l, D]``."""
    b, s_local, _ = hidden.shape
    layout = positions.layout(s_local, b)  # before the exchange: a collective on the first layer
    hidden = model_function(module, "apply_mask_to_padding_states")(hidden, mask)  # local, per token
    gate_b, gate_c, x = module.in_proj(hidden).chunk(3, dim=-1)  # [B, S_l, Hd] each
    (bx,) = seq_to_heads_packed((gate_b * x,), mesh.sp_group)  # [B, S_l, Hd] -> [B, S, Hd_l]
    start, n = local_span(module.conv.in_channels, mesh.sp_size, mesh.sp_rank)
    weight = module.conv.weight.squeeze(1).narrow(0, start, n)  # [Hd_l, K]: this rank's channels
    bias = None if module.conv.bias is None else module.conv.bias.narrow(0, start, n)
    conv_fn = model_function(module, "causal_conv1d_fn")
    spans = segments(layout, b, bx.shape[1])
    # [B, S, Hd_l] -> [B, Hd_l, S]: the kernel's channel-first layout, per document
    y = per_document(lambda t: conv_fn(t, weight, bias), [bx.transpose(1, 2)], spans, seq_dim=2)
    y = heads_to_seq(y, mesh.sp_group, head_dim=1, seq_dim=2)  # [B, Hd_l, S] -> [B, Hd, S_l]
    y = gate_c * y.transpose(1, 2)  # [B, S_l, Hd]
    return module.out_proj(y.contiguous())


HANDLER = ShortConvHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
