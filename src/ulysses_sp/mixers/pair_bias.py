"""Attention with a learned relative-position bias over token pairs (Inkling, Inkling-2, Inkling-2 Loop):
exact under sequence parallelism, head-parallel and per document.

These modules call transformers' attention interface, but pass it a ``position_bias [B, H, S_q, S_k]``
they build themselves from the tokens they are given: ``bias[b, h, q, k] = (r_q @ proj)[q - k]`` for
``0 <= q - k < rel_extent`` (``r_q``: per-token relative states), Inkling's log scaling of queries and
bias from the query's position (``arange`` of the tokens given), Inkling-2's ``relative_distance``
``[S_q, S_k]`` from the model, and short convolutions over keys and values inside their projections.
On a shard all of that covers the shard alone; the SP attention exchanges q, k and v, not a bias per pair.
So, per forward, as the head-parallel fallback of ``mixers/own_scores.py`` does:

1. every per-token input (``hidden_states``; Inkling-2's ``key_hidden_states``/``value_hidden_states``;
   a padding ``conv_mask``) is all-gathered ``[B, S_l, ...] -> [B, S, ...]`` (``gather_seq``; backward:
   the gradient reduce-scattered) and the ``position_ids`` ``[B|1, S_l] -> [B|1, S]``;
2. the module's **own** forward (``functional_call``) runs on rank ``r``'s heads (``pair_bias_cuts``:
   q/k/v/relative/sink/gate rows, the convolutions' channels, the output projection's columns, head
   counts shrunk) over **each document** of the full sequence — so its own ``arange`` positions, its
   convolutions' zero start and its bias are each document's, exactly as the document run alone (one
   document per row without packing) — with a causal mask of the document (windowed by the module's
   ``sliding_window``), Inkling-2's ``relative_distance`` of the document, and the attention interface
   it dispatches to its own eager attention (``plain_core``), not the SP attention;
3. the output projection's partial sums ``[B, S, h]`` reduce-scattered back to ``[B, S_l, h]``
   (``scatter_seq``), its bias added once, after.

The convolutions inside run within the module's own forward here, so no other handler claims them
(``whole``: ``mixers.base.check_mixers`` skips what is inside). At sp 1 a packed row takes the same path
(no collective, no cut); an unpacked one runs the module unchanged.

**Cost** (per rank, per such layer): the gathered ``[B, S, h]`` inputs (three for Inkling-2's full
attention) and the model's own dense bias and scores, ``[B, H/P, L, L]`` per document of length ``L``
(at most ``S``): the S x S memory of the model's own materialised bias, divided by P. Heads must divide
by P (else refused naming the sizes that work); the plain Ulysses token order only. Refused: a KV cache
at sp > 1, dropout in training, keyword tensors it does not know.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``L`` one document, ``H``/``H_l = H/P``
heads, ``h`` hidden.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ulysses_sp.mixers._kernels import check_layout, refuse_cache, replace_forward, require_positions
from ulysses_sp.mixers.classify import ATTENTION, code_constants, verdict
from ulysses_sp.mixers.documents import segments
from ulysses_sp.mixers.head_cuts import sp_problem
from ulysses_sp.mixers.own_scores import count_sp_call, full_mask, gather_seq, refuse_dropout, scatter_seq
from ulysses_sp.mixers.pair_bias_cuts import (
    PairCut,
    bias_child,
    local_attrs,
    local_params,
    pair_cut,
)
from ulysses_sp.parallel.comm import all_gather_seq

PAIR_BIAS = "position_bias"


def pair_bias_attention(module: nn.Module) -> bool:
    """Whether ``module`` is attention through the interface that passes it a bias over token pairs it
    builds itself from a child with ``rel_extent`` and ``proj`` (by structure and code)."""
    return (verdict(module).kind == ATTENTION and PAIR_BIAS in code_constants(type(module))
            and bias_child(module) is not None)  # fmt: skip


class PairBiasHandler:
    """Runs pair-bias attention head-parallel over each document of the full sequence (module docstring)."""

    name = "pair_bias"
    whole = True
    """Runs the module's whole forward itself: the mixers inside it are not claimed apart."""

    def __init__(self, positions: Any = None) -> None:
        self.positions = positions

    def matches(self, module: nn.Module) -> bool:
        return pair_bias_attention(module) and not isinstance(pair_cut(module), str)

    def check(self, module: nn.Module, sp_size: int) -> None:
        cut = pair_cut(module)
        problem = cut if isinstance(cut, str) else sp_problem(cut, sp_size)
        if problem:
            fit = ", ".join(str(p) for p in range(2, 65) if not isinstance(cut, str) and sp_problem(cut, p) is None)
            raise ValueError(f"{type(module).__name__} runs head-parallel under sequence parallelism, but {problem}; "
                             f"use an sp_size that divides its heads ({fit or 'none above 1'})")  # fmt: skip

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        positions = require_positions(self.positions, type(self).__name__)
        check_layout(mesh, type(module).__name__)
        self.check(module, mesh.sp_size)
        cut = pair_cut(module)
        assert not isinstance(cut, str)
        signature = inspect.signature(type(module).forward)

        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(module, *args, **kwargs)
            bound.apply_defaults()
            call = dict(bound.arguments)
            call.pop(next(iter(signature.parameters)))  # self
            call.update(call.pop(next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), ""), {}))
            cache = call.get("cache", call.get("past_key_values"))
            if mesh.sp_size == 1 and cache is not None:  # generation: the module's own cached path
                return original(*args, **kwargs)
            refuse_cache(cache, mesh.sp_size, type(module).__name__)
            x = call[next(iter(call))]
            layout = positions.layout(x.shape[1], x.shape[0])
            if mesh.sp_size == 1 and (layout is None or layout.doc_ids is None):
                return original(*args, **kwargs)  # one document per row: the module's own positions are right
            count_sp_call()
            return _head_parallel(module, cut, mesh, layout, call)

        return replace_forward(module, forward)


def _head_parallel(module: nn.Module, cut: PairCut, mesh: Any, layout: Any, call: dict) -> Any:
    """The module's own forward on this rank's heads over each document (module docstring, 1-3)."""
    what, p, group = type(module).__name__, mesh.sp_size, mesh.sp_group
    refuse_dropout(module, what)
    x_name = next(iter(call))
    x = call[x_name]  # [B, S_l, h]
    b, s_l = x.shape[:2]
    seq = s_l * p
    tokens, fixed = {}, {}
    for name, value in call.items():
        if name in ("attention_mask", "relative_distance", "cache", "past_key_values"):
            continue  # rebuilt per document / none
        if name == "position_ids" and isinstance(value, torch.Tensor):  # [B|1, S_l] -> [B|1, S]
            if layout is None:  # none given to the model: its own arange on the shard; the sequence's instead
                tokens[name] = torch.arange(seq, device=x.device)[None]
            else:
                tokens[name] = all_gather_seq(value, group, dim=-1) if p > 1 else value
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (b, s_l):
            if not value.is_floating_point():  # a padding conv_mask: multiplied in, so as a float
                value = value.to(x.dtype)
            tokens[name] = gather_seq(value, group, p)  # [B, S_l, ...] -> [B, S, ...]
        elif isinstance(value, torch.Tensor) or (isinstance(value, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in value)):
            raise ValueError(f"{what}: its keyword argument {name!r} is a tensor the pair-bias handler does not "
                             "know how to extend to the full sequence; train this model with sp_size 1")  # fmt: skip
        else:
            fixed[name] = False if name in ("use_cache", "output_attentions") else value
    window = getattr(module, "sliding_window", None)
    takes_distance = "relative_distance" in call
    params = local_params(module, cut, p, mesh.sp_rank) if p > 1 else {}
    attrs = local_attrs(module, cut, p) if p > 1 else {}
    saved = {key: getattr(*key) for key in attrs}
    wrapped = vars(module).pop("forward")  # the module's own forward inside (this wrapper is the instance's)
    try:
        for (m, a), v in attrs.items():
            setattr(m, a, v)
        with plain_core(module):
            rows = []
            for row, docs in segments(layout, b, seq):
                parts = []
                for start, end in docs:
                    n = end - start
                    kwargs = dict(fixed)
                    for name, t in tokens.items():  # [B|1, S, ...] -> [B_row, L, ...]
                        t = t[row] if t.shape[0] == b else t
                        kwargs[name] = t[:, start:end]
                    rb = kwargs[x_name].shape[0]
                    kwargs["attention_mask"] = full_mask(None, rb, n, x.dtype, x.device, "additive", window)  # [B_row, 1, L, L]
                    if takes_distance:  # [L, L]: query minus key position within the document
                        idx = torch.arange(n, device=x.device)
                        kwargs["relative_distance"] = idx[:, None] - idx[None, :]
                    res = functional_call(module, params, (), kwargs, strict=False, tie_weights=False)
                    parts.append(res[0] if isinstance(res, (tuple, list)) else res)  # [B_row, L, h] partial sums
                rows.append(torch.cat(parts, dim=1))
            full = torch.cat(rows, dim=0)  # [B, S, h]
    finally:
        module.forward = wrapped
        for (m, a), v in saved.items():
            setattr(m, a, v)
    out = scatter_seq(full, group, p) if p > 1 else full  # [B, S, h] partial sums -> [B, S_l, h]
    bias_name = cut.out_weight[: -len("weight")] + "bias"
    bias = dict(module.named_parameters()).get(bias_name)
    if p > 1 and bias is not None:
        out = out + bias
    return out, None


@contextlib.contextmanager
def plain_core(module: nn.Module) -> Iterator[None]:
    """While inside, ``module`` (naming the SP attention) sees a copy of its config naming ``eager``: its own
    forward over the full sequence then calls its modeling file's eager attention (the reference, which
    applies every term it passes: the pair bias, Inkling-2's sinks, which ``sdpa`` would drop), not the SP
    attention's exchange. Its bias is dense already: eager's ``[B, H_l, L, L]`` scores are the same size."""
    from ulysses_sp.attention.registration import ATTN_NAME

    config = getattr(module, "config", None)
    if getattr(config, "_attn_implementation", None) != ATTN_NAME:
        yield
        return
    local = copy.copy(config)
    local._attn_implementation = "eager"
    module.config = local
    try:
        yield
    finally:
        module.config = config


HANDLER = PairBiasHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
