"""Attention over a prompt-prefixed row with a per-pair segment/position bias (CPM-Ant): exact under sequence
parallelism, head-parallel over the whole row.

CPM-Ant's model (``CpmAntModel``) prepends ``prompt_length`` prompt tokens to the tokens it is given and builds,
from them, once per forward: a **mask** ``[B, L, L]`` (``_prepare_attention_mask``: every token sees every
token, both directions; a row's ``length`` non-zero ids are its last tokens, the ones before them left padding)
and a **bias** ``[B, H, L, L]`` (its ``position_bias`` module: a learned table indexed by relative-position
buckets within a segment, by segment pair across segments; segment 2 for a non-zero id, 0 for the prompt and a
zero id). Its attention (``CpmAntAttention(hidden_q, hidden_kv, attention_mask, position_bias)``, keys and values
from ``hidden_kv``, the same normalised states) computes its own scores from them. On a shard every one of those
covers the shard alone: each rank prepends its own prompt and counts, numbers and segments its own tokens.
So, under sequence parallelism (``P`` ranks, rank ``r`` holding tokens ``[r*S_l, (r+1)*S_l)`` of the row):

1. **the model** (claimed by structure: ``prompt_length``, ``_prepare_attention_mask`` and a ``position_bias``
   module with a ``relative_attention_bias`` table) runs its own forward with, for that call only, its mask
   method and its bias module given the whole row — the shard's per-token ids, spans, contexts and segments
   all-gathered behind the (same) prompt, ``length`` summed over the group, the shard's positions offset by
   ``r*S_l`` — so its own code builds the row's mask ``[B, L, L]`` and the bias of rank ``r``'s heads
   ``[B, H_l, L, L]`` (its table's columns cut by ``index_select``: each gradient lands at its column), once per
   forward as without SP (``L = prompt_length + S``);
2. **each attention layer** runs its own forward (``functional_call``) on rank ``r``'s heads (``head_cuts``:
   ``project_q/k/v`` rows, ``attention_out`` columns, ``num_heads`` shrunk) over ``[prompt | gathered tokens]``
   ``[B, L, h]`` (``gather_seq``; backward: the gradient reduce-scattered) with that mask and bias;
3. its output projection's partial sums: the tokens' reduce-scattered back to ``[B, S_l, h]`` (``scatter_seq``);
   the prompt's summed over the group (gathered and summed in rank order: the same values on every rank).

The prompt rows are the same on every rank (the same ids, segments and sums); each rank holds a copy and its
share of their gradient (its heads' part and its loss's part), so the group's sum of every gradient is the
model's. The model drops the prompt rows at its end: the logits are the shard's ``[B, S_l, V]``.

Packed rows are refused at every sp size (the model reads no positions: it attends over the whole row in both
directions and gives a row one prompt, whose states after the first layer depend on every document of the
row, so no document can equal itself run alone). A length padded to divide by ``P`` is not the model's row
either (the adapter's pad ids are zeros, which this model reads as left padding, and every token attends to
them): give it lengths that divide. Refused too: a KV cache at sp > 1, cross-attention (``hidden_kv`` not the
queries' states), ``output_attentions`` at sp > 1, dropout in training; heads must divide by P.

**Cost** (per rank, per layer): the gathered ``[B, L, h]`` input and the module's own ``[B, H/P, L, L]``
scores; per forward the row's ``[B, L, L]`` mask and ``[B, H/P, L, L]`` bias (the model's own S x S
tensors, the bias divided by P), three small gathers of per-token ids.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``pl`` prompt length, ``L = pl + S``,
``H``/``H_l = H/P`` heads, ``h`` hidden.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ulysses_sp.mixers._kernels import check_layout, refuse_cache, replace_forward, require_positions
from ulysses_sp.mixers.head_cuts import head_cut, local_attrs, local_params, sp_problem
from ulysses_sp.mixers.own_scores import count_sp_call, gather_seq, own_attention, refuse_dropout, scatter_seq
from ulysses_sp.parallel.comm import all_gather_seq, all_reduce_sum

ATTENTION_ARGS = ("hidden_q", "hidden_kv", "attention_mask", "position_bias")
"""The attention forward's leading arguments: queries' states, keys' and values' states, mask, pair bias."""
PACKED = ("its model reads no positions: it attends over the whole row in both directions and gives the row one "
          "prompt, whose states after the first layer depend on every document of the row")  # fmt: skip


def row_owner(module: nn.Module) -> bool:
    """Whether ``module`` is a model that prefixes a prompt and builds the row's mask and pair bias itself."""
    bias = getattr(module, "position_bias", None)
    return (isinstance(getattr(module, "prompt_length", None), int) and isinstance(bias, nn.Module)
            and callable(getattr(type(module), "_prepare_attention_mask", None))
            and isinstance(getattr(bias, "relative_attention_bias", None), nn.Parameter))  # fmt: skip


def segment_attention(module: nn.Module) -> bool:
    """Whether ``module`` is attention computing its own scores from (queries' states, keys' states, mask, pair
    bias) whose heads split (by structure)."""
    params = tuple(inspect.signature(type(module).forward).parameters)[1:5]
    return params == ATTENTION_ARGS and own_attention(module) and not isinstance(head_cut(module), str)


class SegmentBiasHandler:
    """Claims the model that builds the row's mask and bias, and its attention layers (module docstring)."""

    name = "segment_bias"

    def __init__(self, positions: Any = None) -> None:
        self.positions = positions

    def matches(self, module: nn.Module) -> bool:
        return row_owner(module) or segment_attention(module)

    def check(self, module: nn.Module, sp_size: int) -> None:
        heads = module.position_bias.relative_attention_bias.shape[1] if row_owner(module) else None
        cut = head_cut(module) if heads is None else None
        problem = sp_problem(cut, sp_size) if cut is not None else (
            f"its {heads} attention heads do not divide by sp_size {sp_size}" if heads % sp_size else None)  # fmt: skip
        if problem:
            n = heads if heads is not None else cut.heads
            fit = ", ".join(str(p) for p in range(2, 65) if n % p == 0)
            raise ValueError(f"{type(module).__name__} runs head-parallel under sequence parallelism, but {problem}; "
                             f"use an sp_size that divides its heads ({fit or 'none above 1'})")  # fmt: skip

    def packed_refusal(self, module: nn.Module) -> str | None:
        """Why packed documents cannot be kept apart in ``module`` (``None``: they can)."""
        return PACKED if segment_attention(module) else None

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        positions = require_positions(self.positions, type(self).__name__)
        check_layout(mesh, type(module).__name__)
        self.check(module, mesh.sp_size)
        if row_owner(module):
            return replace_forward(module, lambda original, *a, **kw: _owner_forward(module, mesh, original, a, kw))
        return _wrap_attention(module, mesh, positions)


def _owner_forward(owner: nn.Module, mesh: Any, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The model's own forward; at sp > 1 with its mask method and bias module answering for the whole row."""
    if mesh.sp_size == 1:
        return original(*args, **kwargs)
    with _whole_row(owner, mesh):
        return original(*args, **kwargs)


@contextlib.contextmanager
def _whole_row(owner: nn.Module, mesh: Any) -> Iterator[None]:
    """While inside: ``owner._prepare_attention_mask`` builds the row's ``[B, L, L]`` mask and
    ``owner.position_bias`` the row's ``[B, H_l, L, L]`` bias of this rank's heads (module docstring, 1)."""
    p, group, rank, pl = mesh.sp_size, mesh.sp_group, mesh.sp_rank, owner.prompt_length
    bias_module = owner.position_bias
    mask_method = type(owner)._prepare_attention_mask.__get__(owner)

    def row(*ts: torch.Tensor) -> list[torch.Tensor]:  # [B, pl + S_l] each -> [B, L]: the prompt, then the tokens
        toks = all_gather_seq(torch.stack([t[:, pl:] for t in ts]).contiguous(), group, dim=-1)  # [n, B, S]
        return [torch.cat([t[:, :pl], g.to(t.dtype)], dim=1) for t, g in zip(ts, toks)]

    def mask(input_ids: torch.Tensor, span: torch.Tensor, context: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        ids, span, context = row(input_ids, span, context)
        return mask_method(ids, span, context, all_reduce_sum(length, group))  # length: the row's non-zero ids

    def bias(key_pos: torch.Tensor, query_pos: torch.Tensor, key_segment: torch.Tensor,
             query_segment: torch.Tensor) -> torch.Tensor:  # fmt: skip
        s_l = key_pos.shape[1] - pl
        key_pos, query_pos, key_segment, query_segment = row(key_pos, query_pos, key_segment, query_segment)
        shift = torch.arange(p, device=key_pos.device).repeat_interleave(s_l) * s_l  # rank r's tokens: + r*S_l
        shift = torch.cat([shift.new_zeros(pl), shift]).to(key_pos.dtype)  # [L]
        table = bias_module.relative_attention_bias  # [buckets, H] -> [buckets, H_l]: this rank's heads
        h_l = table.shape[1] // p
        cols = torch.arange(rank * h_l, (rank + 1) * h_l, device=table.device)
        inner = vars(bias_module).pop("forward")  # the module's own forward inside functional_call
        try:
            return functional_call(bias_module, {"relative_attention_bias": table.index_select(1, cols)},
                                   (key_pos + shift, query_pos + shift, key_segment, query_segment))  # fmt: skip
        finally:
            bias_module.forward = inner

    for obj, name in ((owner, "_prepare_attention_mask"), (bias_module, "forward")):
        if name in vars(obj):
            raise ValueError(f"{type(obj).__name__}.{name} is already replaced (sharded twice?)")
    owner._prepare_attention_mask = mask
    bias_module.forward = bias
    try:
        yield
    finally:
        del owner._prepare_attention_mask
        vars(bias_module).pop("forward", None)


def _wrap_attention(module: nn.Module, mesh: Any, positions: Any) -> Callable[[], None]:
    what, p = type(module).__name__, mesh.sp_size
    cut = head_cut(module)
    assert not isinstance(cut, str)

    def forward(original: Callable[..., Any], hidden_q: torch.Tensor, hidden_kv: torch.Tensor,
                attention_mask: torch.Tensor, position_bias: torch.Tensor, output_attentions: bool | None = False,
                cache: Any = None, use_cache: bool | None = None, **kwargs: Any) -> Any:  # fmt: skip
        def own() -> Any:
            return original(hidden_q, hidden_kv, attention_mask, position_bias, output_attentions, cache, use_cache, **kwargs)

        if p == 1 and cache is not None:  # generation: the module's own cached path
            return own()
        refuse_cache(cache, p, what)
        pos = positions.current()  # [B|1, S_l]: packed rows restart at 0
        layout = positions.layout(pos.shape[-1], hidden_q.shape[0]) if pos is not None else None
        if layout is not None and layout.doc_ids is not None:
            raise ValueError(f"{what}: packed documents cannot be kept apart: {PACKED}; train it with one sample "
                             "per row (--packing none)")  # fmt: skip
        if p == 1:
            return own()
        if hidden_kv is not hidden_q:
            raise ValueError(f"{what}: keys and values from other states than the queries' (cross-attention) are "
                             "not sequence-parallel; use sp_size 1")  # fmt: skip
        if output_attentions:
            raise ValueError(f"{what}: output_attentions is not available under sequence parallelism (each rank "
                             "holds a share of the heads); pass output_attentions=False")  # fmt: skip
        refuse_dropout(module, what)
        count_sp_call()
        return _head_parallel(module, cut, mesh, hidden_q, attention_mask, position_bias), None

    return replace_forward(module, forward)


def _head_parallel(module: nn.Module, cut: Any, mesh: Any, x: torch.Tensor, mask: torch.Tensor,
                   bias: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The module's own forward on this rank's heads over the whole row (module docstring, 2-3)."""
    p, group, what = mesh.sp_size, mesh.sp_group, type(module).__name__
    b, n, h_l = x.shape[0], x.shape[1], cut.heads // p
    seq = mask.shape[-1]  # L = pl + S, the row the model built its mask for
    s_l = (seq - n) // (p - 1)
    pl = n - s_l
    if s_l <= 0 or pl < 0 or pl + p * s_l != seq or tuple(bias.shape) != (b, h_l, seq, seq):
        raise ValueError(f"{what}: its mask {tuple(mask.shape)} and bias {tuple(bias.shape)} do not cover the whole "
                         f"row of {p} shards of {n} states (prompt included) for {h_l} heads per rank: the model that "
                         "builds them must run under the segment_bias handler too (apply_mixers on the whole model)")  # fmt: skip
    full = torch.cat([x[:, :pl], gather_seq(x[:, pl:], group, p)], dim=1)  # [B, pl + S_l, h] -> [B, L, h]
    params = local_params(module, cut, p, mesh.sp_rank)
    attrs = local_attrs(module, cut, p)
    saved = {key: getattr(*key) for key in attrs}
    wrapped = vars(module).pop("forward")  # the module's own forward inside (this wrapper is the instance's)
    try:
        for (m, a), v in attrs.items():
            setattr(m, a, v)
        res = functional_call(module, params, (full, full, mask, bias), {"output_attentions": False},
                              strict=False, tie_weights=False)  # fmt: skip
    finally:
        module.forward = wrapped
        for (m, a), v in saved.items():
            setattr(m, a, v)
    out = res[0] if isinstance(res, (tuple, list)) else res  # [B, L, h] partial sums of this rank's heads
    tokens = scatter_seq(out[:, pl:].contiguous(), group, p)  # [B, S, h] -> [B, S_l, h], summed over the group
    if pl:  # [B, pl, h] -> [B, P*pl, h] in rank order -> summed: the same prompt rows on every rank
        prompt = gather_seq(out[:, :pl].contiguous(), group, p).unflatten(1, (p, pl)).sum(1)
        tokens = torch.cat([prompt, tokens], dim=1)
    bias_out = getattr(module, cut.out).bias
    return tokens + bias_out if bias_out is not None else tokens


HANDLER = SegmentBiasHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
