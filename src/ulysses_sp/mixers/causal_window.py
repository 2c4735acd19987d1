"""Sequence parallelism for modules that read a short causal window of earlier tokens and nothing else:
the short convolutions inside attention projections (Inkling's and Inkling-2's ``*ShortConvolution`` on
keys, values and the residual stream; Inkling-2's dynamic one) and ZAYA's convolutional q/k projection.

Such a module's output at token ``t`` depends on tokens ``t-W .. t`` only (its reach ``W``: ``K-1`` for one
causal convolution of kernel ``K``, the sum of ``k-1`` for a chain of unpadded ones). So the module's own
``forward`` runs unchanged on ``[halo | local]``: the ``W`` tokens before the shard come from the previous
SP rank (``halo.halo_from_previous``, one exchange of ``W`` positions to the next rank; its backward
returns their gradient to their owner), and the halo's own outputs are dropped. Every per-token tensor
argument (``[B, S_l, ...]``: the hidden states, a dynamic convolution's input, a padding mask) travels
with it. Rank 0's halo (zeros) runs as a piece of its own: its tokens then start with the model's own
padding, as the sequence does (and every rank's halo is in the graph: the halo's backward is a collective).

Packed documents: the window is cut at every global document start (``documents.window_cuts``) and
the module runs once per piece, so a document's first tokens see the model's own start-of-sequence
padding (zeros; ZAYA's delayed value half from a zero token), never the previous document. No
weights are sliced and nothing else is exchanged: ``W * C`` values per row and layer.

Matched by structure, never by model name; the reach comes from the module's own sizes:

- one child, a depthwise ``Conv1d`` padded ``K-1`` (a causal convolution), and code that calls
  ``causal_conv1d_fn``: reach ``K-1`` (Inkling's, Inkling-2's static convolutions);
- no convolution module, a ``static_weight [K, C]`` and ``conv_kernel_size = K``, code that unfolds a
  left-padded window: reach ``K-1`` (Inkling-2's dynamic convolution);
- ``Conv1d`` children all unpadded, their ``k-1`` summing to the module's ``conv_kernel_size`` (the left
  padding its code applies): reach that sum, at least 1 (ZAYA's CCA projection also delays half of each
  value head by one token).

Each must take ``hidden_states`` first and a ``cache`` (generation: the model's own path at sp 1,
refused at sp > 1), and its code must call no other sequence operation.

Shape legend: ``B`` batch, ``S_l`` the local shard, ``W`` the reach, ``C`` channels.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ulysses_sp.mixers._kernels import check_layout, refuse_cache, refuse_local_boundaries, replace_forward
from ulysses_sp.mixers.classify import code_names
from ulysses_sp.mixers.documents import per_window_document, window_cuts
from ulysses_sp.mixers.halo import halo_from_previous

OTHER_SEQUENCE_OPS = ("cumsum", "cumprod", "logcumsumexp", "cummax", "roll", "scaled_dot_product_attention",
                      "ALL_ATTENTION_FUNCTIONS", "tril", "triu")  # fmt: skip
"""Code names that would mean the module mixes tokens beyond its causal window."""


def reach(module: nn.Module) -> int | None:
    """How many tokens before ``t`` the module's output at ``t`` reads (see the module docstring), or ``None``
    when ``module`` has none of the shapes this handler knows."""
    params = inspect.signature(type(module).forward).parameters
    if list(params)[1:2] != ["hidden_states"] or "cache" not in params:
        return None
    names = code_names(type(module))
    if any(op in names for op in OTHER_SEQUENCE_OPS):
        return None
    children = list(module.children())
    convs = [c for c in children if isinstance(c, nn.Conv1d)]
    if len(children) == 1 and convs and "causal_conv1d_fn" in names:
        (conv,) = convs
        k = conv.kernel_size[0]
        if conv.groups == conv.in_channels == conv.out_channels and conv.padding == (k - 1,):
            return k - 1
        return None
    size = getattr(module, "conv_kernel_size", None)
    if not isinstance(size, int):
        return None
    static = getattr(module, "static_weight", None)
    if not convs and isinstance(static, nn.Parameter) and static.dim() == 2 and static.shape[0] == size:
        return size - 1 if {"unfold", "pad"} <= names else None
    if convs and all(c.padding == (0,) and c.stride == (1,) and c.dilation == (1,) for c in convs):
        if sum(c.kernel_size[0] - 1 for c in convs) == size and "pad" in names:
            return max(size, 1)
    return None


class CausalWindowHandler:
    """Runs a causal-window module on ``[halo | local]`` per packed document (see the module docstring)."""

    name = "causal_window"

    def __init__(self, positions: Any = None) -> None:
        self.positions = positions
        """Where the forward's position ids come from (``apply_mixers`` binds a ``PositionTracker``);
        ``None``: every row one document."""

    def matches(self, module: nn.Module) -> bool:
        return reach(module) is not None

    def check(self, module: nn.Module, sp_size: int) -> None:
        del module, sp_size  # any sp size: nothing is sliced; a shard shorter than the reach fails at the halo

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        check_layout(mesh, type(module).__name__)
        width, positions = reach(module), self.positions
        what = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
        signature = inspect.signature(module.forward)

        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            cache = bound.arguments.get("cache")
            if cache is not None and mesh.sp_size == 1:  # generation: the model's own cached path
                return original(*args, **kwargs)
            refuse_cache(cache, mesh.sp_size, what)
            refuse_local_boundaries(bound.arguments.get("kwargs", {}), what)
            return _windowed(original, bound, width, mesh, positions)

        return replace_forward(module, forward)


def _windowed(original: Callable[..., Any], bound: inspect.BoundArguments, width: int, mesh: Any,
              positions: Any) -> Any:  # fmt: skip
    """The module's outputs at the local tokens (``[B, S_l, ...]`` each), computed on ``[halo | local]``."""
    hidden = bound.arguments["hidden_states"]  # [B, S_l, C]
    b, s_local = hidden.shape[:2]
    layout = positions.layout(s_local, b) if positions is not None else None  # a collective on the first call
    names = [n for n, v in bound.arguments.items()
             if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == (b, s_local)]  # fmt: skip
    local = [bound.arguments[n] for n in names]
    lo, w = mesh.sp_rank * s_local, 0
    if mesh.sp_size > 1:
        # [B, S_l, ...] -> [B, ..., S_l] -> the previous rank's last W: [B, ..., W] -> [B, W, ...]
        halos = [halo_from_previous(t.movedim(1, -1), width, mesh.sp_group).movedim(-1, 1) for t in local]
        local, w = [torch.cat([h, t], dim=1) for h, t in zip(halos, local)], width  # [B, W+S_l, ...]
    cuts = window_cuts(layout, lo - w, lo + s_local)
    if mesh.sp_rank == 0 and w:  # the zeros before the sequence run alone (and in the graph: the halo's
        cuts = [[w]] if cuts is None else [sorted({w, *row}) for row in cuts]  # backward is a collective)

    def run(*pieces: torch.Tensor) -> Any:
        bound.arguments.update(zip(names, pieces))
        bound.arguments["cache"] = None
        return original(*bound.args, **bound.kwargs)

    out = per_window_document(run, local, cuts, dim=1)
    if isinstance(out, torch.Tensor):
        return out[:, w:]  # [B, W+S_l, ...] -> [B, S_l, ...]: the halo's own outputs dropped
    return tuple(o[:, w:] for o in out)


HANDLER = CausalWindowHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
