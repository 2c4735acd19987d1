"""Sequence parallelism for Griffin's recurrent block (RecurrentGemma's ``RecurrentGemmaRecurrentBlock``).

The block: ``y = act(linear_y(h))``; ``x = linear_x(h)`` (``W`` channels); a depthwise causal
``Conv1d`` of kernel ``K`` over ``x``; the RG-LRU: per-head block-diagonal input and recurrence gates
and the normalization (on every token alone), then ``_rnn_scan``, a linear recurrence per channel
``s_t = a_t * s_{t-1} + x_t`` whose ``a_t`` is zeroed where the position id is 0 (the model resets
the state at every document start itself); ``linear_out(x * y)``. Two parts mix tokens:

1. the **convolution** reads the ``K-1`` positions before the shard: they come from the previous
   rank (``halo``), and the convolution restarts at every global document start (without SP the
   model's own convolution runs across a packed row's boundaries; here each document sees what it
   would see alone, at sp 1 as at sp > 1: ``linear_attn._Sharded._window_docs``);
2. the **scan** is per channel: ONE packed all-to-all turns ``x`` and ``a`` (the reset folded in,
   as the model's first line does) ``[B, S_l, W] -> [B, S, W_l]``, the model's own ``_rnn_scan``
   runs over the full sequence for the rank's channels from a zero state, one all-to-all returns
   ``[B, S, W_l] -> [B, S_l, W]``. Every weight stays whole and acts on the local tokens.

Cost per local token and layer (elements handed to the all-to-alls): ``2 W`` in, ``W`` out, plus a
halo of ``(K-1) W`` per row. The scan's Python loop runs ``S`` steps over ``W/P`` channels.

A cache (``use_cache=True``: the block keeps conv and recurrent states for generation): the model's
own path at sp 1, refused at sp > 1. Matched by structure (``linear_x``, ``linear_y``, ``linear_out``,
a depthwise ``conv_1d`` padded ``K-1``, an ``rg_lru`` child with a per-channel ``recurrent_param``
and a ``_rnn_scan``), never by model name.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``W`` the recurrence width
(``lru_width``), ``W_l = W/P``, ``K`` conv kernel, ``P`` sp size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ulysses_sp.mixers._kernels import check_layout, refuse_cache, replace_forward, require_positions
from ulysses_sp.mixers.documents import per_window_document
from ulysses_sp.mixers.halo import halo_from_previous
from ulysses_sp.mixers.linear_attn import _Sharded
from ulysses_sp.parallel.comm import heads_to_seq, seq_to_heads_packed


class RgLruHandler:
    """Shards Griffin's recurrent block over the SP group by channels (see the module docstring)."""

    name = "rg_lru"

    def __init__(self, positions: Any = None) -> None:
        self.positions = positions
        """Where the forward's position ids come from (``apply_mixers`` binds a ``PositionTracker``)."""

    def matches(self, module: nn.Module) -> bool:
        conv, lru = getattr(module, "conv_1d", None), getattr(module, "rg_lru", None)
        linears = [getattr(module, n, None) for n in ("linear_x", "linear_y", "linear_out")]
        if not (isinstance(conv, nn.Conv1d) and isinstance(lru, nn.Module) and all(isinstance(x, nn.Linear) for x in linears)):
            return False
        width = conv.in_channels
        param = getattr(lru, "recurrent_param", None)
        return (
            conv.groups == width == conv.out_channels
            and conv.padding == (conv.kernel_size[0] - 1,)
            and linears[0].out_features == width
            and isinstance(param, nn.Parameter)
            and tuple(param.shape) == (width,)
            and callable(getattr(lru, "_rnn_scan", None))
        )

    def check(self, module: nn.Module, sp_size: int) -> None:
        width = module.conv_1d.in_channels
        if width % sp_size:
            raise ValueError(
                f"{type(module).__name__} (RG-LRU, {width} channels): the channels are not divisible by sp_size "
                f"{sp_size} (its recurrence is sharded by channel); use an sp_size that divides {width}"
            )

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        tracker = require_positions(self.positions, type(self).__name__)
        what = type(module).__name__
        check_layout(mesh, what)
        self.check(module, mesh.sp_size)
        active: list[_Sharded | None] = [None]  # set while this block's sharded forward runs

        def block(original: Callable[..., Any], input_states: torch.Tensor, position_ids: torch.Tensor,
                  attention_mask: Any = None, use_cache: bool = True, **kwargs: Any) -> Any:  # fmt: skip
            if use_cache and mesh.sp_size == 1:  # generation: the model's own cached path
                return original(input_states, position_ids, attention_mask, use_cache, **kwargs)
            refuse_cache(True if use_cache else None, mesh.sp_size, what)
            b, s_local, _ = input_states.shape
            layout = tracker.layout(s_local, b)  # a collective on a forward's first call
            prev, active[0] = active[0], _Sharded(mesh.sp_group, mesh.sp_size, mesh.sp_rank, layout)
            try:
                return original(input_states, position_ids, attention_mask, False, **kwargs)
            finally:
                active[0] = prev

        def conv(original: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
            state = active[0]
            width = module.conv_1d.kernel_size[0] - 1
            if state is None or width == 0:
                return original(x)
            # [B, W, S_l] -> [B, W, K-1]: the previous rank's last positions (zeros on rank 0 / at sp 1)
            halo = halo_from_previous(x, width, state.group) if state.sp_size > 1 else x.new_zeros(*x.shape[:2], width)
            ext = torch.cat([halo, x], dim=-1)  # [B, W, K-1+S_l]
            out = per_window_document(lambda part: original(part)[..., : part.shape[-1]], (ext,),
                                      state._window_docs(x.shape[-1], width), dim=-1)  # fmt: skip
            return out[..., width:]  # [B, W, S_l]: the halo's own outputs dropped (the model slices [:S_l])

        lru = module.rg_lru
        scan_original = lru._rnn_scan

        def scan(hidden_states: torch.Tensor, recurrent_gate: torch.Tensor, reset: torch.Tensor,
                 recurrent_states: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:  # fmt: skip
            state = active[0]
            if state is None:
                return scan_original(hidden_states, recurrent_gate, reset, recurrent_states, **kwargs)
            gate = recurrent_gate * ~reset  # the model's own first step: no carry into a document start
            x, a = hidden_states, gate
            if state.sp_size > 1:  # one all-to-all: [B, S_l, W] -> [B, S, W_l] for x and a
                x, a = seq_to_heads_packed((x, a), state.group)
            keep = torch.zeros(*x.shape[:2], 1, dtype=torch.bool, device=x.device)  # [B, S, 1]: reset already in a
            out, _ = scan_original(x, a, keep, None, **kwargs)  # [B, S, W_l], from a zero state
            if state.sp_size > 1:
                out = heads_to_seq(out, state.group, head_dim=2, seq_dim=1)  # [B, S, W_l] -> [B, S_l, W]
            return out, None

        undos = [replace_forward(module, block), replace_forward(module.conv_1d, conv)]
        lru._rnn_scan = scan  # an instance attribute over the class's method

        def undo() -> None:
            vars(lru).pop("_rnn_scan", None)
            for u in reversed(undos):
                u()

        return undo


HANDLER = RgLruHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
