"""XLNet's relative attention (``XLNetRelativeAttention``): exact under sequence parallelism, head-parallel.

The module computes its own scores over relative position encodings ``r`` that its model builds for the
tokens it is given (``relative_positional_encoding(qlen, klen)``: on a shard, the shard's length), and its
``post_attention`` adds the residual and a LayerNorm **inside** the module. So, per forward:

1. the layer input ``h [S_l, B, h]`` (sequence first) is all-gathered to ``[S, B, h]`` (``gather_seq``;
   backward: the gradient reduce-scattered), and ``r`` is rebuilt by the owning model's own
   ``relative_positional_encoding(S, S)`` (its ``attn_type``, ``bi_data``, ``clamp_len``), ``[2S|S+1, B, h]``;
2. the module's own ``rel_attn_core`` runs on rank ``r``'s heads (q, k, v, r, o: ``[h, H, d]`` cut on the
   heads axis; ``r_w_bias``/``r_r_bias``/``r_s_bias``: ``[H, d]``; ``seg_embed``: ``[2, H, d]``) over the full
   sequence, with the model's mask for ``S`` tokens (``attn_type='uni'``: the model's ``create_mask(S, 0)``);
3. the output projection's partial sums ``[S, B, h]`` are reduce-scattered back to ``[S_l, B, h]``
   (``scatter_seq``) **before** the residual and the LayerNorm, which then run on the shard as the module's.

Refused at sp > 1, by name: the two-stream path (``target_mapping``/``perm_mask``), ``mems``,
``token_type_ids`` (a segment matrix over the shard's pairs), padding masks (``attention_mask``/
``input_mask``), ``output_attentions``, dropout in training; packed documents (bidirectional attention
over the whole row: documents cannot be kept apart, ``mixers.guard.check_document_mixing``). Heads must
divide by P. At sp 1 the module runs unchanged.

**Cost** (per rank, per layer): the gathered ``[S, B, h]`` input, ``r`` for ``S`` and the model's own
dense scores ``[B, H/P, S, S]``: the model's S x S, divided by P.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``H`` heads, ``d`` head size, ``h`` d_model.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ulysses_sp.mixers._kernels import check_layout, require_positions
from ulysses_sp.mixers.own_scores import count_sp_call, gather_seq, refuse_dropout, scatter_seq

CUT_DIM1 = ("q", "k", "v", "o", "r", "seg_embed")
CUT_DIM0 = ("r_w_bias", "r_r_bias", "r_s_bias")


def xlnet_attention(module: nn.Module) -> bool:
    """Whether ``module`` is XLNet's relative attention (by structure: its per-head parameters and core)."""
    names = {n for n, _ in module.named_parameters(recurse=False)}
    return set(CUT_DIM1 + CUT_DIM0) <= names and callable(getattr(module, "rel_attn_core", None)) \
        and callable(getattr(module, "post_attention", None))  # fmt: skip


class XlnetHandler:
    """Runs XLNet's relative attention head-parallel over the full sequence (module docstring)."""

    name = "xlnet"
    whole = True
    """Runs the module's whole forward itself: nothing inside it is claimed apart."""

    def __init__(self, positions: Any = None) -> None:
        self.positions = positions
        self.owners: dict[int, nn.Module] = {}

    def bind(self, model: nn.Module) -> None:
        """Note the XLNet model that owns each relative attention (it builds ``r`` and the mask)."""
        for sub in model.modules():
            if callable(getattr(sub, "relative_positional_encoding", None)) and hasattr(sub, "layer"):
                for layer in sub.layer:
                    self.owners[id(layer.rel_attn)] = sub

    def matches(self, module: nn.Module) -> bool:
        return xlnet_attention(module)

    def packed_refusal(self, module: nn.Module) -> str:
        """Why packed rows are refused (``mixers.guard.check_document_mixing``), at every sp size."""
        return ("its relative attention takes no per-document positions or mask (XLNet's model builds one "
                "relative encoding and mask for the whole row), so every token attends to every document of it")  # fmt: skip

    def check(self, module: nn.Module, sp_size: int) -> None:
        heads = module.q.shape[1]
        if heads % sp_size:
            fit = ", ".join(str(p) for p in range(2, 65) if heads % p == 0)
            raise ValueError(f"{type(module).__name__} runs head-parallel under sequence parallelism, but its "
                             f"{heads} attention heads do not divide by sp_size {sp_size}; use an sp_size that "
                             f"divides its heads ({fit or 'none above 1'})")  # fmt: skip

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        from ulysses_sp.mixers._kernels import replace_forward

        positions = require_positions(self.positions, type(self).__name__)
        check_layout(mesh, type(module).__name__)
        self.check(module, mesh.sp_size)
        owner = self.owners.get(id(module))
        if owner is None and mesh.sp_size > 1:
            raise ValueError(f"{type(module).__name__}: its XLNet model was not found (it builds the relative "
                             "position encodings); use mixers.apply.apply_mixers(model, mesh) on the whole model")  # fmt: skip

        def forward(original: Callable[..., Any], h: torch.Tensor, g: Any = None, attn_mask_h: Any = None,
                    attn_mask_g: Any = None, r: Any = None, seg_mat: Any = None, mems: Any = None,
                    target_mapping: Any = None, output_attentions: bool = False) -> Any:  # fmt: skip
            args = (h, g, attn_mask_h, attn_mask_g, r, seg_mat, mems, target_mapping, output_attentions)
            layout = positions.layout(h.shape[0], h.shape[1])
            if layout is not None and layout.doc_ids is not None:
                raise ValueError(f"{type(module).__name__}: packed documents cannot be kept apart in XLNet's "
                                 "bidirectional relative attention (every token attends to the whole row); "
                                 "train it unpacked (--packing none)")  # fmt: skip
            if mesh.sp_size == 1:
                return original(*args)
            _refuse(module, owner, args)
            count_sp_call()
            return _head_parallel(module, owner, mesh, h)

        return replace_forward(module, forward)


def _refuse(module: nn.Module, owner: nn.Module, args: tuple) -> None:
    """Name what sp > 1 does not run (module docstring)."""
    h, g, mask_h, _, _, seg_mat, mems, target_mapping, output_attentions = args
    what = type(module).__name__
    named = {
        "the two-stream path (target_mapping / perm_mask)": g is not None or target_mapping is not None,
        "memory (mems)": mems is not None and mems.dim() > 1,
        "token_type_ids (a segment matrix over the shard's token pairs)": seg_mat is not None,
        "output_attentions": bool(output_attentions),
        "a padding or permutation mask (attention_mask / input_mask / perm_mask)": mask_h is not None
        and not (owner.attn_type == "uni" and mask_h.shape[2] == 1),
    }
    for name, given in named.items():
        if given:
            raise ValueError(f"{what}: {name} is not supported under sequence parallelism (it is built per "
                             "shard, not for the full sequence); train this model with sp_size 1 for it")  # fmt: skip
    refuse_dropout(module, what)
    if owner.training and getattr(owner.dropout, "p", 0) > 0:
        raise ValueError(f"{what}: dropout of the relative position encodings in training is drawn per rank; "
                         "set config.dropout = 0 or train with sp_size 1")  # fmt: skip


def _head_parallel(module: nn.Module, owner: nn.Module, mesh: Any, h: torch.Tensor) -> Any:
    """The module's own core on this rank's heads over the full sequence (module docstring, 1-3)."""
    p, group, rank = mesh.sp_size, mesh.sp_group, mesh.sp_rank
    s_l, b = h.shape[:2]
    seq = s_l * p
    full = gather_seq(h.transpose(0, 1), group, p).transpose(0, 1)  # [S_l, B, h] -> [S, B, h]
    r = owner.relative_positional_encoding(seq, seq, bsz=b, device=h.device)  # [2S|S+1, B, h]
    mask = None
    if owner.attn_type == "uni":  # the model's causal mask for S tokens, minus the diagonal (its non_tgt_mask)
        causal = owner.create_mask(seq, 0)[:, :, None, None]
        eye = torch.eye(seq, device=h.device, dtype=causal.dtype)[:, :, None, None]
        mask = ((causal - eye) > 0).to(owner.dtype)
    n = module.q.shape[1] // p
    heads = slice(rank * n, (rank + 1) * n)
    w = {a: getattr(module, a)[:, heads] for a in CUT_DIM1}
    local = types.SimpleNamespace(**{a: getattr(module, a)[heads] for a in CUT_DIM0}, seg_embed=w["seg_embed"],
                                  scale=module.scale, dropout=module.dropout, rel_shift_bnij=module.rel_shift_bnij)  # fmt: skip
    q_head = torch.einsum("ibh,hnd->ibnd", full, w["q"])
    k_head = torch.einsum("ibh,hnd->ibnd", full, w["k"])
    v_head = torch.einsum("ibh,hnd->ibnd", full, w["v"])
    r_head = torch.einsum("ibh,hnd->ibnd", r.type(module.r.dtype), w["r"])
    vec = type(module).rel_attn_core(local, q_head, k_head, v_head, r_head, seg_mat=None, attn_mask=mask)  # [S, B, H_l, d]
    part = torch.einsum("ibnd,hnd->ibh", vec, w["o"])  # [S, B, h] partial sums over this rank's heads
    out = scatter_seq(part.transpose(0, 1), group, p).transpose(0, 1)  # -> [S_l, B, h], summed
    out = module.dropout(out) + h
    return module.layer_norm(out), None


HANDLER = XlnetHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
