"""DeepSeek-V4's pooled K/V (compressed sparse attention, CSA; heavily compressed attention, HCA), exact
under sequence parallelism: the model's own compressor run on ``[halo | local]`` tokens, its entries
gathered over the SP group, and CSA's indexer picking each local query's entries over all of them.

A V4 attention layer with a compressor pools its K/V along the sequence before the attention function:
every ``r`` tokens (``compress_rate``; windows from the sequence's first token) become one entry — HCA
non-overlapping windows, CSA each entry over two overlapping windows (the previous window's ``Ca`` half
and its own ``Cb`` half) — RMS-normed with the rotary of the window's first token. The entries are
appended to the layer's own keys; HCA's query ``t`` sees entries ``w < (t+1)//r``, CSA's the
``index_topk`` entries its Lightning Indexer picks (its own pooled index keys, the same windows). On a
shard the windows would start at the shard. Here each such attention module — claimed by its shape
(``compressor`` with ``compress_rate``/``kv_proj``/``gate_proj``/``position_bias``, ``sinks``,
``sliding_window``), not its name — gets a pre-hook that hands it a stand-in ``cache`` (``PooledCall``)
and the rank's ``PoolPlan`` (``attention/pooled_docs.py``: per packed document, host ints from the
forward's layout), which the module passes on to its compressor and its compressor to its indexer:

1. ``store_compression_weights`` (the model calls it with its own projections of the local tokens)
   prepends the tokens before the shard that the first window touching it reads (``r - 1`` at most;
   CSA: one window earlier too, for its ``Ca`` half, whose own entry is dropped; never before the
   document's first token) and stops the compressor;
2. the model's own compressor then runs once per document piece on this rank (no tokens of its own: the
   cache returns the piece's ``[halo | local]`` slice and its first window's position *in its document*):
   its own pooling, norm and rotary on the windows of that document that *end* on this rank, as when the
   document runs alone; ``update_compressor_states`` keeps them and stops it;
3. the pieces' entries, padded to ``ceil(S_l / r)`` (a count every rank knows), are all-gathered once
   (differentiable: a window's tokens on the previous rank get their gradient back) and each row's put in
   document order (``[B, T, D]``); the ``[B, 1, S_l, T]`` block bias is never built. Every collective runs
   once per call on every rank, however the documents fall on the ranks;
4. for CSA the indexer runs the same way once (its keys, under ``no_grad``: the model's picks carry no
   gradient), then per document on blocks of its local queries with its ``cache`` returning that
   document's keys: the model's own scores, causal mask and ``topk``, ``[B, S_l, k]`` entry indices in the
   row (``-1`` invalid).

The module then appends the gathered entries to its local keys and calls the SP attention function with
``pooled=`` this call, which attends its local queries (``attention/pooled_core.py``; packed, within their
document). Packed rows are thus exact: each document as if run alone.

Cost per rank and layer: the halo ``[B, <2r, F]`` (``F``: the compressor's ``2 D`` or ``4 D`` projected
features, the indexer's too), gathered as every rank's last ``min(S_l, 2r)`` tokens; the entries
``[B, S/r, D]`` (at 1M tokens, D 512, bf16: HCA's r 128 8 MiB, CSA's r 4 256 MiB); CSA's index keys
``[B, S/r, D_idx]`` (64 MiB, no gradient) and picks ``[B, S_l, k]`` int32 (half of the indexer's int64). Two all-gathers for the halo
(kv, gate) and one for the entries (forward; an all-reduce each in backward), three more for CSA's indexer
(no backward). Memory and FLOPs per rank shrink with ``P`` except the gathered entries (``S/r``).

Shape legend: ``B`` batch, ``S`` full sequence, ``S_l = S/P``, ``r`` compress rate, ``D`` head dim,
``k`` index_topk, ``lo`` this rank's first token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ulysses_sp.attention.indexer import IndexerHandle, call_layout, query_block
from ulysses_sp.attention.pooled_docs import Piece, PoolPlan, pool_plan
from ulysses_sp.parallel.seq_gather import all_gather_seq_grad, tokens_before

ATTENTION_ATTRS = ("compressor", "sinks", "sliding_window", "layer_idx")
COMPRESSOR_ATTRS = ("compress_rate", "kv_proj", "gate_proj", "position_bias", "kv_norm", "head_dim")


def is_pooled_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a V4-style attention with a K/V compressor this module runs under SP."""
    if not all(hasattr(module, a) for a in ATTENTION_ATTRS) or module.compressor is None:
        return False
    params = inspect.signature(type(module).forward).parameters
    return all(hasattr(module.compressor, a) for a in COMPRESSOR_ATTRS) and "cache" in params


class _Stop(Exception):
    """Raised by ``PooledCall.update_compressor_states`` once the gathered entries exist."""


class PooledCall:
    """One call of a pooled attention layer: the ``cache`` its compressor and indexer see, and what the SP
    attention reads (``lo``, ``group``, ``positions``, ``picks``, the documents' ``doc_first``/``entry_first``)."""

    def __init__(self, rate: int, overlap: bool, lo: int, s_local: int, group: Any, positions: torch.Tensor,
                 plan: PoolPlan | None = None) -> None:  # fmt: skip
        self.rate, self.overlap, self.lo, self.s_local, self.group = rate, overlap, lo, s_local, group
        self.positions = positions
        """``[B|1, S_l]`` the local queries' position ids (each document's own, packed)."""
        self.plan = plan
        self.doc_first = None if plan is None else plan.doc_first
        self.entry_first = None if plan is None else plan.entry_first
        self.picks: torch.Tensor | None = None
        """CSA: ``[B, S_l, k]`` each local query's picked entries (in its row, ``-1`` invalid); HCA: ``None``."""
        self.index_keys: torch.Tensor | None = None
        self._ext: tuple[torch.Tensor, torch.Tensor] | None = None
        self._piece: tuple[slice, Piece] | None = None
        self._out: torch.Tensor | None = None
        self.layers = _EveryLayer(self)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """The sliding-window cache update the module calls: nothing held, the local keys as they are."""
        return key_states, value_states

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        """The first call: ``[halo | local]`` kept (one gather), the compressor stopped. Then per piece:
        ``(kv, gate, first window's position in its document)`` of the piece's whole windows."""
        if self.index_keys is not None:  # the indexer's scoring runs: no pooling, its keys come whole
            return kv[:, :0], gate[:, :0], 0
        plan = self.plan
        if self._piece is None:  # [B, S_l, F] -> [B, halo + S_l, F]: the tokens before the shard it pools
            self._ext = tuple(torch.cat([tokens_before(t, self.lo - plan.halo, plan.width, self.group), t], dim=1)
                              for t in (kv, gate))  # fmt: skip
            raise _Stop
        rows, piece = self._piece
        base = self.lo - plan.halo
        kv, gate = (t[rows, piece.start - base : piece.end - base] for t in self._ext)
        return kv, gate, piece.first

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        """CSA's previous-call ``Ca`` half: none (a piece brings its previous window itself, or is alone)."""
        return None, None

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """One piece's entries ``[b, n, D]`` kept (CSA: less a window lending only its ``Ca`` half); stop."""
        if self.index_keys is not None:
            return self.index_keys
        self._out = compressed[:, 1:] if self._piece[1].drop else compressed
        raise _Stop

    def pool(self, forward: Callable[..., Any], module: nn.Module, hidden: torch.Tensor, q_residual: torch.Tensor,
             position_ids: torch.Tensor, layer_idx: int) -> torch.Tensor:  # fmt: skip
        """``[B, T, D]``: every row's entries in document order, by the model's own ``forward`` (a compressor
        or an indexer with ``head_dim``) once on the local tokens and once per document piece (no tokens: its
        ``[halo | local]`` slice comes from the cache), padded to ``plan.most`` and gathered once."""
        plan, self._piece, self._ext = self.plan, None, None
        _run_to_stop(forward, hidden, q_residual, position_ids, self, layer_idx)
        parts = []
        for group in plan.groups:
            got = []
            for piece in group.pieces:  # no collective in here: each rank runs its own number of pieces
                self._piece = (group.rows, piece)
                _run_to_stop(forward, hidden[group.rows, :0], q_residual[group.rows, :0], position_ids[:, :0], self,
                             layer_idx)  # fmt: skip
                got.append(self._out)
            rows = hidden[group.rows].shape[0]
            pad = self._ext[0].new_zeros((rows, plan.most - sum(x.shape[1] for x in got), module.head_dim))
            parts.append(torch.cat([*got, pad.to(got[0].dtype if got else pad.dtype)], dim=1))  # [b, most, D]
        # [B, most, D]; every gather's backward (an all-reduce) must run on every rank, also where no piece
        # read the halo: the empty slices link it (a zero, no NaN), and zeros join as a leaf
        mine = torch.cat(parts) + sum(t[:, :0].sum() for t in self._ext)
        if torch.is_grad_enabled() and not mine.requires_grad:
            mine.requires_grad_()
        self._piece = self._ext = self._out = None
        gathered = all_gather_seq_grad(mine, self.group, dim=1)  # [B, P most, D]
        if plan.slots.shape[0] == 1:
            return gathered.index_select(1, plan.slots[0])
        return gathered.gather(1, plan.slots[..., None].expand(-1, -1, gathered.shape[-1]))  # [B, T, D]


class _EveryLayer:
    """``cache.layers[i]``: the call itself, for any layer index."""

    def __init__(self, call: PooledCall) -> None:
        self.call = call

    def __getitem__(self, index: int) -> PooledCall:
        return self.call


def _run_to_stop(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except _Stop:
        return
    name = type(getattr(fn, "__self__", fn)).__name__
    raise ValueError(f"{name} never handed its pooled entries to its cache: not the DeepSeek-V4 compressor this "
                     "version shards; train it with sp_size 1")  # fmt: skip


@torch.no_grad()
def indexer_picks(indexer: nn.Module, call: PooledCall, hidden: torch.Tensor, q_residual: torch.Tensor,
                  position_ids: torch.Tensor, layer_idx: int) -> torch.Tensor:  # fmt: skip
    """``[B, S_l, k]`` the CSA indexer's picks for the local queries, each among its document's entries (its
    row's entry indices, ``-1`` none): the model's own scores, causal mask and ``topk`` per document."""
    call.index_keys = None
    keys, (b, s_l) = call.pool(indexer, indexer, hidden, q_residual, position_ids, layer_idx), hidden.shape[:2]
    out = torch.full((b, s_l, min(indexer.index_topk, keys.shape[1])), -1, dtype=torch.int32, device=hidden.device)  # S/r < 2^31
    for group in call.plan.groups:
        for span in group.spans:  # each document alone: its keys [b, n, D_idx], its queries
            if span.e1 == span.e0:
                continue  # no entry (the model alone: topk of none)
            call.index_keys = keys[group.rows, span.e0 : span.e1]
            q0, q1 = span.q0 - call.lo, span.q1 - call.lo
            block = query_block(b, indexer.num_heads, span.e1 - span.e0, q1 - q0)
            for a in range(q0, q1, block):  # [b, bq, H_idx, n] scores at a time -> [b, bq, min(k, n)]
                e, rows = min(a + block, q1), group.rows
                pos = position_ids[:, a:e] if position_ids.shape[0] == 1 else position_ids[rows, a:e]
                picks = indexer(hidden[rows, a:e], q_residual[rows, a:e], pos, call, layer_idx)
                out[rows, a:e, : picks.shape[-1]] = torch.where(picks >= 0, picks + span.e0, -1).to(out.dtype)
    call.index_keys = None
    return out


def pooled_compressor_forward(forward: Callable[..., Any], compressor: nn.Module) -> Callable[..., Any]:
    """``compressor``'s forward that, given a ``PooledCall`` as its cache, returns every row's
    entries ``[B, 1, T, D]`` and no block bias (CSA: the picks left on the call)."""

    def pooled(hidden_states, q_residual, position_ids, cache=None, layer_idx=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if not isinstance(cache, PooledCall):
            return forward(hidden_states, q_residual, position_ids, cache, layer_idx)
        entries = cache.pool(forward, compressor, hidden_states, q_residual, position_ids, layer_idx)  # [B, T, D]
        indexer = getattr(compressor, "indexer", None)
        if indexer is not None:
            cache.picks = indexer_picks(indexer, cache, hidden_states, q_residual, position_ids, layer_idx)
        return entries.unsqueeze(1), None  # [B, 1, T, D]

    return pooled


def _pre_hook(attention: Any):
    """The attention module's pre-hook: a ``PooledCall`` as its ``cache`` and as the ``pooled`` keyword."""

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        if kwargs.get("cache", kwargs.get("past_key_values")) is not None:
            raise ValueError(f"{type(module).__name__} was called with a cache; its sequence-parallel pooled "
                             "attention runs whole sequences only: pass use_cache=False")  # fmt: skip
        hidden = args[0] if args else kwargs["hidden_states"]
        position_ids = args[2] if len(args) > 2 else kwargs.get("position_ids")
        (b, s_l), device = hidden.shape[:2], hidden.device
        seq, lo, group = call_layout(attention, module, position_ids, s_l, b, device)
        rate, overlap = module.compressor.compress_rate, hasattr(module.compressor, "indexer")
        size = 1 if group is None else torch.distributed.get_world_size(group)

        def plan() -> PoolPlan:  # once per forward and kind: host ints (read back only without the adapter's)
            lengths = [[seq.seq_len]] if seq.doc_ids is None else seq.doc_lengths()
            return pool_plan(lengths, b, rate, overlap, lo, s_l, size, device)

        plan = attention._per_forward(seq, ("pooled", rate, overlap, lo, s_l, b), plan)
        call = PooledCall(rate, overlap, lo, s_l, group, seq.positions[:, lo : lo + s_l], plan)
        kwargs.pop("past_key_values", None)
        kwargs["cache"], kwargs["pooled"] = call, call
        return args, kwargs

    return hook


def install_pooled_attention(model: nn.Module, attention: Any, handle: IndexerHandle | None = None) -> IndexerHandle | None:
    """Wrap the compressor of every pooled attention module of ``model`` and give the module its pre-hook;
    adds to ``handle`` (``remove()`` undoes both); ``None`` when the model has none."""
    handle = handle if handle is not None else IndexerHandle()
    for module in model.modules():
        if is_pooled_attention(module):
            module.compressor.forward = pooled_compressor_forward(module.compressor.forward, module.compressor)
            handle.wrapped.append(module.compressor)
            handle.hooks.append(module.register_forward_pre_hook(_pre_hook(attention), with_kwargs=True))
    return handle if handle.wrapped else None
