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
``sliding_window``), not its name — gets a pre-hook that hands it a stand-in ``cache`` (``PooledCall``),
which the module passes on to its compressor and its compressor to its indexer:

1. ``store_compression_weights`` (the model calls it with its own projections of the local tokens)
   prepends the tokens from the start of the first window touching the shard (``r - 1`` at most; CSA:
   one window earlier too, for its ``Ca`` half, whose own entry is dropped) and returns that window's
   global start, at which the model's own pooling, norm and rotary then run: the entries of every window
   that *ends* on this rank, as without SP;
2. ``update_compressor_states`` all-gathers them over the SP group (``[B, S//r, D]``, differentiable: a
   window's tokens on the previous rank get their gradient back) and stops the compressor there (its
   ``[B, 1, S_l, S//r]`` block bias is never built);
3. for CSA the indexer runs the same way once (its keys, under ``no_grad``: the model's picks carry no
   gradient), then on blocks of local queries with its ``cache`` returning all the keys: the model's own
   scores, causal mask and ``topk``, ``[B, S_l, k]`` global entry indices (``-1`` invalid).

The module then appends the gathered entries to its local keys and calls the SP attention function with
``pooled=`` this call, which attends its local queries (``attention/pooled_core.py``). Packed documents:
the model's own pooling mixes documents (windows from the row's first token), so rows of several
documents are refused at every sp size (``mixers.guard.check_document_mixing``, and here at run time).

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
from ulysses_sp.parallel.seq_gather import all_gather_ragged, tokens_before

ATTENTION_ATTRS = ("compressor", "sinks", "sliding_window", "layer_idx")
COMPRESSOR_ATTRS = ("compress_rate", "kv_proj", "gate_proj", "position_bias", "kv_norm", "head_dim")
PACKED_REASON = (
    "its compressor pools K/V in windows from the row's first token and its entries carry no document, so "
    "a window and the entries a query sees span the documents of a packed row (the model's own forward mixes "
    "them too)"
)


def is_pooled_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a V4-style attention with a K/V compressor this module runs under SP."""
    if not all(hasattr(module, a) for a in ATTENTION_ATTRS) or module.compressor is None:
        return False
    params = inspect.signature(type(module).forward).parameters
    return all(hasattr(module.compressor, a) for a in COMPRESSOR_ATTRS) and "cache" in params


class _Stop(Exception):
    """Raised by ``PooledCall.update_compressor_states`` once the gathered entries exist."""


def windows_per_rank(rate: int, s_local: int, size: int) -> list[int]:
    """Pooled entries each rank emits: the windows ``[w r, (w+1) r)`` that end on it (host ints)."""
    return [((j + 1) * s_local) // rate - (j * s_local) // rate for j in range(size)]


class PooledCall:
    """One call of a pooled attention layer: the ``cache`` its compressor and indexer see, and what the SP
    attention reads (``lo``, ``group``, ``positions``, ``picks``)."""

    def __init__(self, rate: int, overlap: bool, lo: int, s_local: int, group: Any, positions: torch.Tensor) -> None:
        self.rate, self.overlap, self.lo, self.s_local, self.group = rate, overlap, lo, s_local, group
        self.positions = positions
        """``[B|1, S_l]`` the local queries' full-sequence position ids."""
        self.picks: torch.Tensor | None = None
        """CSA: ``[B, S_l, k]`` each local query's picked entries (global, ``-1`` invalid); HCA: ``None``."""
        self.stored: torch.Tensor | None = None
        self.index_keys: torch.Tensor | None = None
        self.layers = _EveryLayer(self)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """The sliding-window cache update the module calls: nothing held, the local keys as they are."""
        return key_states, value_states

    def _start(self, lo: int) -> int:
        """The first token pooled with a rank starting at ``lo``: its first window's (CSA: one earlier)."""
        start = (lo // self.rate) * self.rate
        return start - self.rate if self.overlap and start >= self.rate else start

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        """``(kv, gate, first window's position)`` of ``[halo | local]``, cut to whole windows."""
        if self.index_keys is not None:  # the indexer's scoring runs: no pooling, its keys come whole
            return kv[:, :0], gate[:, :0], 0
        size = 1 if self.group is None else torch.distributed.get_world_size(self.group)
        width = max(j * self.s_local - self._start(j * self.s_local) for j in range(size))
        start = self._start(self.lo)
        # [B, S_l, F] -> [B, lo - start + S_l, F]: the straddling window's tokens from the ranks before
        kv, gate = (torch.cat([tokens_before(t, start, width, self.group), t], dim=1) for t in (kv, gate))
        usable = (kv.shape[1] // self.rate) * self.rate
        return kv[:, :usable], gate[:, :usable], start

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int):
        """CSA's previous-call ``Ca`` half: none (the halo brought the previous window itself)."""
        return None, None

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """Gather every rank's entries ``[B, n_r, D] -> [B, S//r, D]`` and stop the compressor."""
        if self.index_keys is not None:
            return self.index_keys
        if self.overlap and self._start(self.lo) < (self.lo // self.rate) * self.rate and compressed.shape[1]:
            compressed = compressed[:, 1:]  # the window before the shard's: only its Ca half was wanted
        size = 1 if self.group is None else torch.distributed.get_world_size(self.group)
        self.stored = all_gather_ragged(compressed, windows_per_rank(self.rate, self.s_local, size), self.group)
        raise _Stop


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
    """``[B, S_l, k]`` the CSA indexer's picks for the local queries over the whole sequence's entries."""
    call.index_keys = None
    _run_to_stop(indexer, hidden, q_residual, position_ids, call, layer_idx)  # its keys [B, S//r, D_idx]
    keys, (b, s_l) = call.stored, hidden.shape[:2]
    call.index_keys = keys
    out = torch.full((b, s_l, min(indexer.index_topk, keys.shape[1])), -1, dtype=torch.int32, device=hidden.device)  # S/r < 2^31
    block = query_block(b, indexer.num_heads, max(1, keys.shape[1]), s_l)  # no entries yet: one block
    for a in range(0, s_l, block):  # [B, bq, H_idx, S//r] scores at a time -> [B, bq, k]
        e = min(a + block, s_l)
        pos = position_ids[:, a:e]
        out[:, a:e] = indexer(hidden[:, a:e], q_residual[:, a:e], pos, call, layer_idx)
    call.index_keys = None
    return out


def pooled_compressor_forward(forward: Callable[..., Any], compressor: nn.Module) -> Callable[..., Any]:
    """``compressor``'s forward that, given a ``PooledCall`` as its cache, returns the whole sequence's
    entries ``[B, 1, S//r, D]`` and no block bias (CSA: the picks left on the call)."""

    def pooled(hidden_states, q_residual, position_ids, cache=None, layer_idx=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if not isinstance(cache, PooledCall):
            return forward(hidden_states, q_residual, position_ids, cache, layer_idx)
        _run_to_stop(forward, hidden_states, q_residual, position_ids, cache, layer_idx)
        entries = cache.stored  # [B, S//r, D] with its gradient
        indexer = getattr(compressor, "indexer", None)
        if indexer is not None:
            cache.picks = indexer_picks(indexer, cache, hidden_states, q_residual, position_ids, layer_idx)
        return entries.unsqueeze(1), None  # [B, 1, S//r, D]

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
        if seq.doc_ids is not None:
            raise ValueError(f"layer {module.layer_idx}: packed documents in {type(module).__name__}: {PACKED_REASON}. "
                             "Train it with one sample per row (--packing none)")  # fmt: skip
        compressor = module.compressor
        call = PooledCall(compressor.compress_rate, hasattr(compressor, "indexer"), lo, s_l, group,
                          seq.positions[:, lo : lo + s_l])  # fmt: skip
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
