"""Sequence parallelism for xLSTM's mLSTM layer (transformers' ``xLSTMLayer``, xLSTM-7B).

The layer: ``q, k`` (``Dk`` per head), ``v`` and the output gate from linear projections, the input and
forget gate pre-activations ``i, f`` (one per head, soft-capped) — every token alone; then its backend
``mlstm_backend(q, k, v [B, H, S, D*], i, f [B, H, S])``, the mLSTM recurrence (a matrix memory
``C [Dk, Dv]``, a normalizer ``n [Dk]`` and a stabilizer ``m`` per head), the one part that mixes
tokens; then a layer norm per head, the output gate and ``out_proj`` — every token alone again. No
convolution, no token shift: heads never meet along the sequence, so a head split is exact:

1. ONE packed all-to-all turns ``q, k, v, i, f`` ``[B, H, S_l, ...] -> [B, H_l, S, ...]``;
2. the model's own backend (its ``forward``: the mode the config picks, the kernels it holds) runs over
   the full sequence for the rank's heads from a zero state, once per packed document (global
   boundaries from the position ids, at sp 1 as at sp > 1: each document sees what it would alone);
3. one all-to-all returns ``h`` ``[B, H_l, S, Dv] -> [B, H, S_l, Dv]``; the per-head norm, gate and
   projection run on the local tokens. The backend holds no parameter: nothing to slice.

Which kernel runs: transformers' own code always uses the chunkwise form
(``mlstm_chunkwise_native_autograd``; ``config.chunkwise_kernel`` only matters with the external
``xlstm`` package, whose layer this handler does not claim: it stays refused). ``mode="inference"`` (the
default) runs whole chunks of ``chunk_size`` chunkwise and the remainder (< ``chunk_size`` tokens) with
the step recurrence; ``"train"`` needs every document's length divisible by ``chunk_size`` (refused by
name otherwise, as the model alone raises for such a sequence); ``"train_with_padding"`` pads each
document. Never an ``S x S`` matrix: per rank and layer the chunkwise form keeps ``[c, c]`` blocks per chunk
and head (``S c H_l``) and a state ``[Dk, Dv]`` per chunk and head (``S/c H_l Dk Dv``).

Cost per local token and layer (elements handed to the all-to-alls): ``2 H Dk + H Dv + 2 H`` in, ``H Dv``
out. A recurrent state (``use_cache=True``, or an eval forward longer than ``config.max_inference_chunksize``,
which the model runs chunk by chunk through a cache): the model's own path at sp 1 for one document per
row, refused at sp > 1 and for packed rows. Matched by structure (an ``mlstm_backend`` child without
parameters whose ``forward`` takes ``query, key, value, igate, fgate`` and initial states, ``multihead_norm``,
``out_proj``, ``config.num_heads``), never by model name.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``H`` heads, ``H_l = H/P``, ``Dk``/``Dv``
query-key/value head dims, ``c`` chunk size, ``P`` sp size.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ulysses_sp.mixers._kernels import check_layout, replace_forward, require_positions
from ulysses_sp.mixers.documents import per_document, segments
from ulysses_sp.mixers.linear_attn import _Sharded
from ulysses_sp.parallel.comm import heads_to_seq, seq_to_heads_packed

BACKEND_ARGS = ("query", "key", "value", "igate", "fgate", "c_initial", "n_initial", "m_initial")
"""The parameters of the backend's ``forward`` the handler relies on (transformers' ``xLSTMBackend``)."""


def heads(module: nn.Module) -> int:
    """The mLSTM layer's heads ``H``."""
    return module.config.num_heads


class MlstmHandler:
    """Shards xLSTM's mLSTM layer over the SP group by heads (see the module docstring)."""

    name = "mlstm"

    def __init__(self, positions: Any = None) -> None:
        self.positions = positions
        """Where the forward's position ids come from (``apply_mixers`` binds a ``PositionTracker``)."""

    def matches(self, module: nn.Module) -> bool:
        backend = getattr(module, "mlstm_backend", None)
        if not isinstance(backend, nn.Module) or next(backend.parameters(), None) is not None:
            return False
        if not isinstance(getattr(getattr(module, "config", None), "num_heads", None), int):
            return False
        try:
            params = inspect.signature(type(backend).forward).parameters
        except (TypeError, ValueError):
            return False
        return (
            all(n in params for n in BACKEND_ARGS)
            and isinstance(getattr(module, "multihead_norm", None), nn.Module)
            and isinstance(getattr(module, "out_proj", None), nn.Linear)
        )

    def check(self, module: nn.Module, sp_size: int) -> None:
        h = heads(module)
        if h % sp_size:
            raise ValueError(
                f"{type(module).__name__} (mLSTM, {h} heads): the heads are not divisible by sp_size {sp_size} "
                f"(its recurrence is sharded by head); use an sp_size that divides {h}"
            )

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        tracker = require_positions(self.positions, type(self).__name__)
        what = type(module).__name__
        check_layout(mesh, what)
        self.check(module, mesh.sp_size)
        backend = module.mlstm_backend
        active: list[_Sharded | None] = [None]  # set while this layer's sharded forward runs

        def layer(original: Callable[..., Any], x: torch.Tensor, state: Any = None) -> Any:
            b, s_local, _ = x.shape  # [B, S_l, hidden]
            if state is not None:  # refused at sp > 1 before any collective; at sp 1 the layout is local
                _refuse_state(what, mesh.sp_size, tracker.layout(s_local, b) if mesh.sp_size == 1 else None,
                              module.config.max_inference_chunksize)  # fmt: skip
                return original(x, state)  # sp 1, one document per row: the model's own cached path
            layout = tracker.layout(s_local, b)  # a collective on a forward's first call
            prev, active[0] = active[0], _Sharded(mesh.sp_group, mesh.sp_size, mesh.sp_rank, layout)
            try:
                return original(x, None)
            finally:
                active[0] = prev

        def run_backend(original: Callable[..., Any], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        igate: torch.Tensor, fgate: torch.Tensor, c_initial: Any = None, n_initial: Any = None,
                        m_initial: Any = None, return_last_states: bool | None = None, mode: str | None = None) -> Any:  # fmt: skip
            sharded = active[0]
            if sharded is None or c_initial is not None:  # outside the layer's sharded forward: untouched
                return original(query, key, value, igate, fgate, c_initial, n_initial, m_initial,
                                return_last_states, mode)  # fmt: skip
            mode = mode or backend.config.mode
            chunk = backend.config.chunk_size
            xs = (query, key, value, igate, fgate)  # [B, H, S_l, Dk|Dv] and [B, H, S_l]
            if sharded.sp_size > 1:  # one all-to-all: [B, H, S_l, ...] -> [B, H_l, S, ...] for all five
                xs = seq_to_heads_packed(xs, sharded.group, seq_dim=2, head_dim=1)

            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
                if "train" in mode and "with_padding" not in backend.config.mode and q.shape[2] % chunk:
                    raise ValueError(
                        f"{what}: config.mode 'train' runs the chunkwise kernel, which needs every sequence (each "
                        f"packed document) to be a multiple of chunk_size {chunk}; got one of {q.shape[2]} tokens. "
                        "Use mode='train_with_padding' (pads each document) or 'inference'"
                    )
                out = original(q, k, v, i, f, None, None, None, False, mode)  # from a zero state
                return out[0] if isinstance(out, tuple) else out  # [B, H_l, S_doc, Dv]

            full = xs[0].shape[2]
            h = per_document(run, xs, segments(sharded.layout, query.shape[0], full), seq_dim=2)
            if sharded.sp_size > 1:
                h = heads_to_seq(h, sharded.group, head_dim=1, seq_dim=2)  # [B, H_l, S, Dv] -> [B, H, S_l, Dv]
            return h, None  # no state: the layer's caller keeps it only in a cache, which runs unsharded

        undos = [replace_forward(module, layer), replace_forward(backend, run_backend)]

        def undo() -> None:
            for u in reversed(undos):
                u()

        return undo


def _refuse_state(what: str, sp_size: int, layout: Any, chunk_limit: Any) -> None:
    """A recurrent state carries one rank's tokens into its next call: not sequence-parallel, and it
    crosses every document boundary of a packed row."""
    if sp_size == 1 and (layout is None or layout.doc_ids is None):
        return
    why = "under sequence parallelism" if sp_size > 1 else "with packed documents (position ids restarting at 0)"
    raise ValueError(
        f"{what}: a cache (use_cache=True: generation) is not supported {why}; pass use_cache=False (an eval "
        f"forward longer than config.max_inference_chunksize = {chunk_limit} tokens runs chunk by chunk through a "
        "cache too: keep it at least the tokens per rank)"
    )


HANDLER = MlstmHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
