"""Sequence parallelism for Mamba-2 mixers (Nemotron-H, Falcon-H1, Granite-4 hybrid, Bamba).

The mixer (transformers' torch path): ``gate, xBC, dt = in_proj(h)``; a depthwise causal conv over
the ``xBC`` channels (``[x | B | C]`` sections) with an activation; the chunked SSM scan of ``x``
with ``dt``, ``A = -exp(A_log)``, ``B``, ``C``, ``D``, ``dt_bias`` per head (``B``/``C`` per group of
heads); a gated RMS norm with ``gate``; ``out_proj``. Heads do not interact until the norm, so:

1. ``in_proj`` (with Falcon-H1's ``ssm_in_multiplier`` and ``mup_vector``) on the local tokens;
2. one all-to-all of ``x [B, S_l, H, Dh]``, ``B``/``C [B, S_l, G|P, N]`` and ``dt [B, S_l, H]``
   to ``[B, S, H_l, ...]`` / ``[B, S, G_l, N]``; when ``G < P`` every destination gets the one
   group its heads use (replicated before the exchange: the minimum bytes);
3. the model's ``causal_conv1d_fn`` over the full sequence, conv weight/bias sliced to the local
   ``x``, ``B`` and ``C`` channels (three sections), then the model's ``mamba2_chunk_scan`` with
   ``A_log``, ``D``, ``dt_bias`` sliced to the local heads — slices inside forward, so autograd
   returns full-parameter gradients; both once per packed document (``documents.per_document``);
4. one all-to-all back ``[B, S, H_l, Dh] -> [B, S_l, H, Dh]``; norm(y, gate) and ``out_proj`` on
   the local tokens (the norm's groups may span ranks' heads, so it runs after the exchange).

Two exchanges per layer. Matched by structure (the Mamba-2 parameter set and sizes, and the
modeling file's ``causal_conv1d_fn`` and ``mamba2_chunk_scan``), never by model name.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``H`` SSM heads, ``H_l = H/P``,
``Dh`` head dim, ``I = H * Dh``, ``G`` B/C groups, ``G_l`` groups per rank, ``N`` state size,
``P`` sp size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ulysses_sp.mixers._kernels import (
    ForwardHandler,
    index_of,
    model_function,
)
from ulysses_sp.mixers.documents import PositionTracker, per_document, segments
from ulysses_sp.parallel.comm import heads_to_seq, seq_to_heads_packed

_SIZES = (
    "num_heads",
    "head_dim",
    "n_groups",
    "ssm_state_size",
    "intermediate_size",
    "conv_dim",
    "chunk_size",
)


class Mamba2Handler(ForwardHandler):
    """Shards a Mamba-2 mixer over the SP group by heads (see the module docstring)."""

    name = "mamba2"

    def matches(self, module: nn.Module) -> bool:
        if not all(isinstance(getattr(module, a, None), int) for a in _SIZES):
            return False
        conv, in_proj = getattr(module, "conv1d", None), getattr(module, "in_proj", None)
        h, g, n, i = module.num_heads, module.n_groups, module.ssm_state_size, module.intermediate_size
        return (
            isinstance(conv, nn.Conv1d)
            and conv.groups == conv.in_channels == module.conv_dim == i + 2 * g * n
            and isinstance(in_proj, nn.Linear)
            and in_proj.out_features == i + module.conv_dim + h
            and i == h * module.head_dim
            and all(isinstance(getattr(module, p, None), nn.Parameter) for p in ("A_log", "dt_bias", "D"))
            and isinstance(getattr(module, "out_proj", None), nn.Linear)
            and hasattr(module, "norm")
            and hasattr(module, "time_step_limit")
            and model_function(module, "causal_conv1d_fn") is not None
            and model_function(module, "apply_mask_to_padding_states") is not None
            and model_function(module, "mamba2_chunk_scan") is not None
        )

    def check(self, module: nn.Module, sp_size: int) -> None:
        h, g = module.num_heads, module.n_groups
        what = f"{type(module).__name__} ({h} heads, {g} B/C groups)"
        if h % sp_size:
            raise ValueError(
                f"{what}: the heads are not divisible by sp_size {sp_size}; choose an sp_size that divides {h}"
            )
        if g % sp_size and sp_size % g:
            raise ValueError(
                f"{what}: sp_size {sp_size} neither divides the groups nor is a multiple of them, so "
                f"a rank's heads would straddle groups; choose an sp_size that divides {g} or is a multiple of it"
            )

    def sharded(self, module: nn.Module, mesh: Any, positions: PositionTracker, hidden: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        return _sharded_forward(module, mesh, positions, hidden, mask)


def _local_groups(g: int, p: int, rank: int) -> tuple[int, int, torch.Tensor | None]:
    """``(first group, G_l, send index)``: this rank's groups and, when ``G < P``, the group each
    destination rank ``j`` needs (``j * G // P``), replicated before the exchange."""
    if g % p == 0:
        return rank * (g // p), g // p, None
    return rank * g // p, 1, torch.tensor([j * g // p for j in range(p)])


def _sharded_forward(
    module: nn.Module, mesh: Any, positions: PositionTracker, hidden: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """The mixer's forward, head-sharded: ``[B, S_l, D] -> [B, S_l, D]``."""
    b, s_local, _ = hidden.shape
    p, rank, group = mesh.sp_size, mesh.sp_rank, mesh.sp_group
    h, dh, g, n, i = (
        module.num_heads,
        module.head_dim,
        module.n_groups,
        module.ssm_state_size,
        module.intermediate_size,
    )
    h_l, i_l = h // p, i // p
    g0, g_l, replicate = _local_groups(g, p, rank)
    layout = positions.layout(s_local, b)  # before the exchange: a collective on the first layer
    dtype = hidden.dtype
    pad_mask = model_function(module, "apply_mask_to_padding_states")
    hidden = pad_mask(hidden, mask)
    multiplier = getattr(module, "ssm_in_multiplier", None)
    if multiplier is not None:  # Falcon-H1's muP input multiplier
        hidden = hidden * multiplier
    projected = module.in_proj(hidden)
    mup = getattr(module, "mup_vector", None)
    if mup is not None:  # Falcon-H1's per-channel [z | x | B | C | dt] multipliers
        projected = projected * mup
    gate, xbc, dt = projected.split([i, module.conv_dim, h], dim=-1)
    x, bm, cm = xbc.split([i, g * n, g * n], dim=-1)
    x = x.view(b, s_local, h, dh)
    bm, cm = bm.view(b, s_local, g, n), cm.view(b, s_local, g, n)
    if replicate is not None:  # [B, S_l, G, N] -> [B, S_l, P, N]: destination j's group at j
        bm, cm = bm.index_select(2, replicate.to(bm.device)), cm.index_select(2, replicate.to(cm.device))
    # one all-to-all: [B, S_l, H, Dh] -> [B, S, H_l, Dh], [B, S_l, G|P, N] -> [B, S, G_l, N], [B, S_l, H] -> [B, S, H_l]
    x, bm, cm, dt = seq_to_heads_packed((x, bm, cm, dt), group)
    s = x.shape[1]
    # the conv's local channels: x of the local heads, then B and C of the local groups
    channels = index_of([(rank * i_l, i_l), (i + g0 * n, g_l * n), (i + g * n + g0 * n, g_l * n)], x.device)
    weight = module.conv1d.weight.squeeze(1).index_select(0, channels)  # [C_l, K]
    bias = None if module.conv1d.bias is None else module.conv1d.bias.index_select(0, channels)
    xbc = torch.cat([x.reshape(b, s, i_l), bm.reshape(b, s, g_l * n), cm.reshape(b, s, g_l * n)], dim=-1)
    spans = segments(layout, b, s)
    conv_fn = model_function(module, "causal_conv1d_fn")
    # [B, S, C_l] -> [B, C_l, S] (the kernel's layout) -> [B, S, C_l], per document
    xbc = per_document(lambda t: conv_fn(t, weight, bias, activation=module.activation),
                       [xbc.transpose(1, 2)], spans, seq_dim=2).transpose(1, 2)  # fmt: skip
    if mask is not None and p == 1:  # the model masks padding again after the conv
        xbc = pad_mask(xbc, mask)
    # Under SP no second mask: padding is right padding (the SP data path refuses any other), whose
    # conv outputs only feed later pad positions; and a mask is None on ranks without padding, so a
    # gather here would be a collective that only some ranks enter.
    x, bm, cm = xbc.split([i_l, g_l * n, g_l * n], dim=-1)
    heads = slice(rank * h_l, (rank + 1) * h_l)
    a = -torch.exp(module.A_log.float())[heads]
    scan_fn = model_function(module, "mamba2_chunk_scan")

    def scan(xs, dts, bs, cs):
        return scan_fn(xs, dts, a, bs, cs, chunk_size=module.chunk_size, D=module.D[heads], z=None,
                       dt_bias=module.dt_bias[heads], dt_softplus=True, dt_limit=module.time_step_limit)  # fmt: skip

    parts = (x.reshape(b, s, h_l, dh), dt, bm.reshape(b, s, g_l, n), cm.reshape(b, s, g_l, n))
    y = per_document(scan, parts, spans, seq_dim=1)  # [B, S, H_l, Dh]
    y = heads_to_seq(y, group, head_dim=2, seq_dim=1).reshape(
        b, s_local, i
    )  # -> [B, S_l, H, Dh] -> [B, S_l, I]
    if getattr(module, "mamba_rms_norm", True):
        y = module.norm(y, gate)
    else:  # Falcon-H1 without the gated norm
        y = y * nn.functional.silu(gate)
    return module.out_proj(y.to(dtype))


HANDLER = Mamba2Handler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
