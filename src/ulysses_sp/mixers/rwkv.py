"""Sequence parallelism for RWKV (v4) blocks: ``RwkvSelfAttention`` (time mixing) and ``RwkvFeedForward``
(channel mixing).

Both mix tokens in one way each module knows by name: ``time_shift``, a ``ZeroPad2d((0, 0, 1, -1))``
that hands every token its predecessor's features (a causal shift by one). The time-mixing module
also runs the WKV recurrence ``rwkv_linear_attention(time_decay, time_first, key, value)``: a state
``(num, den, max)`` per channel, ``key``/``value`` ``[B, S_l, D]``. Everything else (the token-shift
mixes, the key/value/receptance projections, the output) acts on every token alone.

1. the **shift** reads one position before the shard: the previous rank's last token (``halo`` of
   width 1; zeros on rank 0), and zeros at every document start (position id 0), where a document
   run alone gets the padding's zero;
2. the **WKV** recurrence is per channel: ONE packed all-to-all turns ``key``, ``value``
   ``[B, S_l, D] -> [B, S, D_l]``, the model's own function runs over the full sequence for the
   rank's channels (``time_decay``, ``time_first`` sliced to them inside forward: full-parameter
   gradients) once per packed document, one all-to-all returns ``[B, S_l, D]``.

Cost per local token and time-mixing layer: ``2 D`` elements in, ``D`` out; a halo of ``D`` per row
for each of the two shifts. The state for generation (``state``/``use_cache``): the model's own
path at sp 1, refused at sp > 1. The CUDA kernel is used when the model would use it (it runs
inside the dispatched call). Matched by structure (``time_shift`` padding one token at the front,
``time_mix_*`` vectors, per-channel ``time_decay``/``time_first`` and the modeling file's
``rwkv_linear_attention``), never by model name.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``D`` hidden size (channels),
``D_l = D/P``, ``P`` sp size.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ulysses_sp.mixers._kernels import (
    check_layout,
    local_span,
    refuse_cache,
    replace_forward,
    require_positions,
)
from ulysses_sp.mixers.documents import per_document, segments
from ulysses_sp.mixers.halo import halo_from_previous
from ulysses_sp.mixers.linear_attn import _ACTIVE, _install, _Sharded
from ulysses_sp.parallel.comm import heads_to_seq, seq_to_heads_packed

WKV_FN = "rwkv_linear_attention"


class _Wkv(_Sharded):
    """``_Sharded`` with RWKV's WKV recurrence: channel shards for ``key`` and ``value``."""

    local_positions: torch.Tensor | None = None
    """The shard's position ids ``[B|1, S_l]`` (document starts for the shift), or ``None``."""

    def scan(self, original: Callable[..., Any], signature: inspect.Signature, args: tuple, kwargs: dict):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("state") is not None or bound.arguments.get("return_state"):
            raise ValueError("a recurrent state (generation with a cache) is not sequence-parallel")
        key, value = bound.arguments["key"], bound.arguments["value"]  # [B, S_l, D]
        start, n = local_span(key.shape[-1], self.sp_size, self.sp_rank)
        decay, first = (bound.arguments[k].narrow(0, start, n) for k in ("time_decay", "time_first"))  # [D_l]
        if self.sp_size > 1:  # one all-to-all: [B, S_l, D] -> [B, S, D_l] for key and value
            key, value = seq_to_heads_packed((key, value), self.group)

        def run(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return original(decay, first, k, v, state=None, return_state=False)[0]  # [B, S_doc, D_l]

        out = per_document(run, [key, value], segments(self.layout, key.shape[0], key.shape[1]), seq_dim=1)
        if self.sp_size > 1:
            out = heads_to_seq(out, self.group, head_dim=2, seq_dim=1)  # [B, S, D_l] -> [B, S_l, D]
        return out, None

    def shift(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S_l, D] -> [B, S_l, D]``: each token's predecessor in the global sequence (zero at a
        document start and before the sequence)."""
        if self.sp_size > 1:  # [B, S_l, D] -> [B, 1, D]: the previous rank's last token (zeros on rank 0)
            prev = halo_from_previous(x.transpose(1, 2), 1, self.group).transpose(1, 2)
        else:
            prev = x.new_zeros(x.shape[0], 1, x.shape[2])
        out = torch.cat([prev, x[:, :-1]], dim=1)
        if self.local_positions is not None:  # [B|1, S_l]: no carry into a document start
            out = out * (self.local_positions != 0)[..., None].to(out.dtype)
        return out


class RwkvHandler:
    """Shards RWKV's time- and channel-mixing modules over the SP group (see the module docstring)."""

    name = "rwkv"

    def __init__(self, positions: Any = None) -> None:
        self.positions = positions
        """Where the forward's position ids come from (``apply_mixers`` binds a ``PositionTracker``)."""

    def matches(self, module: nn.Module) -> bool:
        shift = getattr(module, "time_shift", None)
        if not (isinstance(shift, nn.ZeroPad2d) and tuple(shift.padding) == (0, 0, 1, -1)):
            return False
        if not isinstance(getattr(module, "time_mix_key", None), nn.Parameter):
            return False
        if not hasattr(module, "time_decay"):  # channel mixing: the shift alone
            return isinstance(getattr(module, "time_mix_receptance", None), nn.Parameter)
        key, decay = getattr(module, "key", None), module.time_decay
        modeling = sys.modules.get(type(module).__module__)
        return (
            isinstance(key, nn.Linear)
            and isinstance(decay, nn.Parameter)
            and tuple(decay.shape) == (key.out_features,)
            and tuple(getattr(module, "time_first", torch.empty(0)).shape) == (key.out_features,)
            and callable(getattr(modeling, WKV_FN, None))
        )

    def check(self, module: nn.Module, sp_size: int) -> None:
        d = module.time_decay.shape[0] if hasattr(module, "time_decay") else sp_size
        if d % sp_size:
            raise ValueError(
                f"{type(module).__name__} (RWKV, {d} channels): the channels are not divisible by sp_size {sp_size} "
                f"(its WKV recurrence is sharded by channel); use an sp_size that divides {d}"
            )

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        tracker = require_positions(self.positions, type(self).__name__)
        what = f"{type(module).__name__} (layer {getattr(module, 'layer_id', '?')})"
        check_layout(mesh, what)
        self.check(module, mesh.sp_size)
        active: list[_Wkv | None] = [None]

        def forward(original: Callable[..., Any], hidden: torch.Tensor, state: Any = None, **kwargs: Any) -> Any:
            if (state is not None or kwargs.get("use_cache")) and mesh.sp_size == 1:
                return original(hidden, state, **kwargs)  # generation: the model's own state
            refuse_cache(state if state is not None else kwargs.get("use_cache") or None, mesh.sp_size, what)
            b, s_local, _ = hidden.shape
            sharded = _Wkv(mesh.sp_group, mesh.sp_size, mesh.sp_rank, tracker.layout(s_local, b))
            sharded.local_positions = tracker.current()
            prev, active[0] = active[0], sharded
            token = _ACTIVE.set(sharded)
            try:
                return original(hidden, None, **kwargs)
            finally:
                _ACTIVE.reset(token)
                active[0] = prev

        def shift(original: Callable[..., Any], x: torch.Tensor) -> torch.Tensor:
            return original(x) if active[0] is None else active[0].shift(x)

        undos = [replace_forward(module, forward), replace_forward(module.time_shift, shift)]
        if hasattr(module, "time_decay"):
            undos.append(_install(sys.modules[type(module).__module__], WKV_FN, "scan"))

        def undo() -> None:
            for u in reversed(undos):
                u()

        return undo


HANDLER = RwkvHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
