"""Doge's dynamic mask under the head-parallel fallback: its key gate, its window and its own registry.

Doge's attention (``DogeAttention``) adds a learned bias per kv head and key to its scores: ``dt =
exp(A * softplus(dt_proj(v)))`` of every token's values ``v [B, S, Hkv * D]``, then (past
``keep_window_size`` keys) keeps each query's top-k keys by that bias, in its own
``prepare_dynamic_mask`` over the model's causal (or sliding-window) mask. ``mixers/own_scores.py`` runs
the module's own forward on rank ``r``'s heads over the full sequence, which keeps all of that — the
top-k over the same rows — with three things this module supplies:

- **the key gate** (``dt_proj``): each kv head's gate reads *every* kv head's values, which a rank
  running its own kv heads does not have. It is per token, so it runs on the shard with the full
  weights, ``[B, S_l, h] -> [B, S_l, Hkv]``, is gathered to ``[B, S, Hkv]`` (``gather_seq``; its
  backward sums the ranks' gradients) and cut to the rank's kv heads; while the module runs, its
  ``dt_proj`` returns that (``v_proj`` then runs twice on each token: once for the gate over all kv
  heads here, once for the rank's heads inside). ``A`` ``[Hkv]`` is cut by kv head (``head_cuts``).
- **the window**: with ``config.sliding_window`` set the model masks with
  ``create_sliding_window_causal_mask`` (``q - k < window``), so the full-sequence mask does too.
- **the registry**: Doge dispatches its core attention through an ``AttentionInterface`` of its own,
  which never sees the SP attention registered in transformers' (and raises ``KeyError`` for its name);
  while the module runs, its ``config`` is a copy naming the SP attention's core (``sdpa`` or ``eager``:
  cores that take Doge's dense additive mask) — at sp 1 too, where the SP attention is registered.

**Cost** on top of the fallback's: the gate's ``[B, S, Hkv]`` all-gather (``Hkv`` values a token) and one
``v_proj`` over the shard. Doge's own mask is ``[B, H, S, S]`` (and its top-k's ``[B, Hkv, S, S]``
selections): the model's, built by every rank for its ``H/P`` heads.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``Hkv`` kv heads, ``D`` head dim,
``h`` hidden, ``P`` sp size.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ulysses_sp.mixers._kernels import model_function
from ulysses_sp.mixers.head_cuts import HeadCut, kv_heads_of

MASK_CORES = ("sdpa", "eager")
"""Core attentions that take a dense additive ``[B, H, S, S]`` mask, as Doge's is."""


def gate_values(module: nn.Module, cut: HeadCut, x: torch.Tensor, gather: Any, sp_size: int,
                sp_rank: int) -> torch.Tensor | None:  # fmt: skip
    """``[B, S, Hkv_l]``: the key gate of rank ``sp_rank``'s kv heads over the full sequence, from the
    shard ``x [B, S_l, h]`` (``None``: the module has no key gate, or ``sp_size`` 1 runs it whole).
    ``gather``: ``[B, S_l, ...] -> [B, S, ...]`` over the SP group (backward: summed)."""
    if cut.kv_gate is None or sp_size == 1:
        return None
    values = getattr(module, cut.qkv[2])(x)  # [B, S_l, h] -> [B, S_l, Hkv * D]: every kv head's values
    gate = getattr(module, cut.kv_gate)(values)  # [B, S_l, Hkv]
    full = gather(gate)  # [B, S_l, Hkv] -> [B, S, Hkv]
    kv = torch.tensor(kv_heads_of(cut, sp_size, sp_rank), device=x.device)
    return full.index_select(-1, kv)  # [B, S, Hkv] -> [B, S, Hkv_l]


@contextlib.contextmanager
def gated(module: nn.Module, cut: HeadCut, gate: torch.Tensor | None) -> Iterator[None]:
    """While inside, the module's key gate returns ``gate`` (whatever it is given: the rank's values alone)."""
    if gate is None:
        yield
        return
    proj = getattr(module, cut.kv_gate)
    had = "forward" in vars(proj)
    prev = vars(proj).get("forward")
    proj.forward = lambda *_args, **_kwargs: gate
    try:
        yield
    finally:
        if had:
            proj.forward = prev
        else:
            del proj.forward


def window(module: nn.Module) -> int | None:
    """The sliding window the model's mask applies (``config.sliding_window`` where its modeling file
    builds the mask with ``create_sliding_window_causal_mask``), else ``None``."""
    size = getattr(getattr(module, "config", None), "sliding_window", None)
    if isinstance(size, int) and model_function(module, "create_sliding_window_causal_mask") is not None:
        return size
    return None


def mixed_windows(module: nn.Module) -> bool:
    """Whether the config windows some layers and not others (``layer_types``): not read per layer here."""
    types = getattr(getattr(module, "config", None), "layer_types", None) or ()
    return window(module) is not None and len(set(types)) > 1


@contextlib.contextmanager
def own_registry_core(module: nn.Module) -> Iterator[None]:
    """While inside, a module that dispatches through a registry of its own (``ALL_ATTENTION_FUNCTIONS``
    in its modeling file, not transformers' instance) and names an implementation that registry lacks
    (the SP attention) sees a copy of its config naming the SP attention's core (``MASK_CORES``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ulysses_sp.attention.registration import ATTN_NAME

    registry = getattr(sys.modules.get(type(module).__module__), "ALL_ATTENTION_FUNCTIONS", None)  # the modeling file's
    config = getattr(module, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if registry is None or registry is ALL_ATTENTION_FUNCTIONS or impl != ATTN_NAME or impl in registry:
        yield
        return
    core = getattr(ALL_ATTENTION_FUNCTIONS.get(ATTN_NAME), "core", "sdpa")
    local = copy.copy(config)
    local._attn_implementation = core if core in MASK_CORES else "sdpa"
    module.config = local
    try:
        yield
    finally:
        module.config = config
