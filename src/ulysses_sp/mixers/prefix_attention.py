"""GIT's self-attention (``GitSelfAttention``): own scores over an image prefix, exact under sequence parallelism.

GIT (``GitForCausalLM``) is a BERT-style stack: its self-attention computes its own scores (``matmul``,
``softmax``) from an additive ``[B, 1, S, S]`` mask its model builds, and its output projection lives in
a sibling module (``GitSelfOutput.dense``, after the heads are concatenated). The model prepends the
image's ``N`` visual tokens to the text; its mask lets them attend to each other in both directions and
every text token causally to the text before it and to all ``N`` image tokens: ``key <= query or key < N``.

At ``sp_size`` P each such module runs, per forward:

1. the layer input ``[B, S_l, h]`` all-gathered over the SP group to ``[B, S, h]`` (``gather_seq``;
   backward: the gradient reduce-scattered);
2. the module's **own** forward (``functional_call``) on rank ``r``'s heads ``[r*H_l, (r+1)*H_l)``: its
   query/key/value rows cut (differentiable ``index_select``: each weight's gradient lands at its rows),
   its head counts shrunk to ``H_l`` for the call, the mask built from the global positions:
   ``key <= query or key < N`` with ``N`` the prefix length (``PREFIX_KWARG``, a host int the per-shard
   VLM forward ``vlm.prefix`` passes through the encoder), else causal within each packed document
   (text only: the positions the ``PositionTracker`` captured);
3. its ``[B, S, H_l*D]`` context turned back into this rank's tokens with every head,
   ``[B, S_l, H*D]``, by one all-to-all (``heads_to_seq``; backward: the inverse), for the sibling
   output projection to run on the shard.

Heads must divide by P (else refused naming the sizes that work); the plain Ulysses token order only. At
sp 1 the module runs unchanged unless the row packs documents or a prefix is given. **Cost** per rank and
layer: the gathered ``[B, S, h]`` input and the model's own eager ``[B, H/P, S, S]`` scores (its mask
``[B, 1, S, S]``): the S x S memory of GIT's own attention, divided by P. Refused: a cache at sp > 1,
attention dropout in training at sp > 1 (the draws of P ranks are not the model's single draw).

Matched by structure: a self-attention whose forward computes its own scores, with ``query``/``key``/``value``
projections, ``num_attention_heads``/``attention_head_size``/``all_head_size`` and an ``image_patch_tokens``
prefix length (GIT's), and no output projection of its own.

Shape legend: ``B`` batch, ``S`` global sequence (image prefix + text), ``S_l = S/P``, ``H``/``H_l = H/P``
heads, ``D`` head dim, ``h`` hidden, ``N`` image prefix tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ulysses_sp.mixers._kernels import check_layout, refuse_cache, replace_forward, require_positions
from ulysses_sp.mixers.own_scores import count_sp_call, full_mask, gather_seq, own_attention, refuse_dropout
from ulysses_sp.parallel.comm import heads_to_seq
from ulysses_sp.vlm.prefix import PREFIX_KWARG

_ATTRS = ("num_attention_heads", "attention_head_size", "all_head_size", "image_patch_tokens")


def prefix_mask(prefix: int, batch: int, seq: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[B, 1, S, S]`` additive: ``key <= query or key < prefix`` (GIT's image prefix, then causal text)."""
    idx = torch.arange(seq, device=device)
    allowed = (idx[None, :] <= idx[:, None]) | (idx[None, :] < prefix)  # [S, S]
    mask = torch.where(allowed, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)
    return mask[None, None].expand(batch, 1, seq, seq)


class PrefixAttentionHandler:
    """Claims GIT's self-attention and runs it head-parallel over the full sequence (module docstring)."""

    name = "prefix_attention"

    def __init__(self, positions: Any = None) -> None:
        self.positions = positions

    def matches(self, module: nn.Module) -> bool:
        if not all(isinstance(getattr(module, n, None), int) for n in _ATTRS):
            return False
        projections = all(isinstance(getattr(module, n, None), nn.Linear) for n in ("query", "key", "value"))
        own_out = any(hasattr(module, n) for n in ("dense", "out_proj", "o_proj", "output"))
        return projections and not own_out and own_attention(module)

    def check(self, module: nn.Module, sp_size: int) -> None:
        heads = module.num_attention_heads
        if heads % sp_size:
            fit = ", ".join(str(p) for p in range(2, heads + 1) if heads % p == 0) or "none above 1"
            raise ValueError(f"{type(module).__name__} runs head-parallel under sequence parallelism, but its "
                             f"{heads} heads do not divide by sp_size {sp_size}; use an sp_size that divides them ({fit})")  # fmt: skip

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        positions = require_positions(self.positions, type(self).__name__)
        check_layout(mesh, type(module).__name__)
        self.check(module, mesh.sp_size)

        def forward(original: Callable[..., Any], hidden_states: torch.Tensor, attention_mask: Any = None,
                    cache: Any = None, **kwargs: Any) -> Any:  # fmt: skip
            prefix = kwargs.pop(PREFIX_KWARG, None)
            if mesh.sp_size == 1 and cache is not None:  # generation: the model's own cached path
                return original(hidden_states, attention_mask, cache, **kwargs)
            refuse_cache(cache, mesh.sp_size, type(module).__name__)
            b, seq = hidden_states.shape[0], hidden_states.shape[1] * mesh.sp_size
            if prefix is not None:  # the per-shard VLM forward: image prefix, one document a row
                mask = prefix_mask(prefix, b, seq, hidden_states.dtype, hidden_states.device)
            else:  # text only: causal within each packed document, from the global positions
                layout = positions.layout(hidden_states.shape[1], b)
                if mesh.sp_size == 1 and (layout is None or layout.doc_ids is None):
                    return original(hidden_states, attention_mask, cache, **kwargs)
                mask = full_mask(layout, b, seq, hidden_states.dtype, hidden_states.device, "additive")
            count_sp_call()
            return _head_parallel(module, mesh, hidden_states, mask, kwargs)

        return replace_forward(module, forward)


def _head_parallel(module: nn.Module, mesh: Any, x: torch.Tensor, mask: torch.Tensor, kwargs: dict) -> Any:
    """The module's own forward on this rank's heads over the full sequence (module docstring, 1-3)."""
    p, rank, group = mesh.sp_size, mesh.sp_rank, mesh.sp_group
    if p > 1:
        refuse_dropout(module, type(module).__name__)
    full = gather_seq(x, group, p)  # [B, S_l, h] -> [B, S, h]
    h_l, d = module.num_attention_heads // p, module.attention_head_size
    rows = torch.arange(rank * h_l * d, (rank + 1) * h_l * d, device=x.device)  # this rank's heads' q/k/v rows
    params = {f"{n}.{w}": getattr(getattr(module, n), w).index_select(0, rows)
              for n in ("query", "key", "value") for w in ("weight", "bias") if getattr(getattr(module, n), w) is not None}  # fmt: skip
    saved = {a: getattr(module, a) for a in ("num_attention_heads", "all_head_size")}
    wrapped = vars(module).pop("forward")  # the module's own forward inside (this wrapper is the instance's)
    try:
        module.num_attention_heads, module.all_head_size = h_l, h_l * d
        res = functional_call(module, params if p > 1 else {}, (full, mask, None), kwargs, strict=False,
                              tie_weights=False)  # fmt: skip
    finally:
        module.forward = wrapped
        for a, v in saved.items():
            setattr(module, a, v)
    context = res[0] if isinstance(res, (tuple, list)) else res  # [B, S, H_l*D]
    if p > 1:
        b, seq = context.shape[:2]
        # [B, S, H_l, D] -> [B, S_l, H, D]: this rank's tokens with every head
        context = heads_to_seq(context.view(b, seq, h_l, d).contiguous(), group, head_dim=2, seq_dim=1)
        context = context.reshape(b, seq // p, h_l * p * d)
    return (context, None) if isinstance(res, (tuple, list)) else context


HANDLER = PrefixAttentionHandler()
