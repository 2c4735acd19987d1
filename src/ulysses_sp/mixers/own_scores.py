"""Head-parallel fallback for attention modules that compute their own scores (BLOOM, Falcon, MPT, GPT-Neo,
XGLM, OpenAI GPT, GPT-NeoX-Japanese, TrOCR's decoder, Doge): exact under sequence parallelism.

These modules never call transformers' ``AttentionInterface``, so the SP attention cannot run inside them.
At ``sp_size`` P each module runs instead, per forward:

1. the layer input ``[B, S_l, h]`` all-gathered over the SP group to ``[B, S, h]`` (``gather_seq``;
   backward: the input gradient reduce-scattered, summed over the ranks' heads);
2. the module's **own** forward (``torch.func.functional_call``) on rank ``r``'s heads
   ``[r*H_l, (r+1)*H_l)`` over the full sequence: its q/k/v rows and output-projection columns cut by
   ``head_cuts`` (differentiable ``index_select``: autograd puts each weight's gradient at its rows), its
   head-count attributes shrunk to ``H_l`` for the call (a width its forward reads from its input's size,
   TrOCR's decoder's, reported as ``H_l * D``: ``mixers/input_width.py``), and full-sequence keyword arguments: a
   causal mask built from the global positions (block-causal per packed document, so each document
   equals itself run alone; windowed where the model's mask is), ALiBi for the rank's heads over ``S``
   positions, rotary tables and position ids gathered, MPT's per-head bias cut to the rank's heads;
   Doge's per-kv-head key gate computed on the shard and gathered (``mixers/key_gates.py``);
3. the output projection's partial sums ``[B, S, h]`` reduce-scattered back to ``[B, S_l, h]``
   (``scatter_seq``; backward: an all-gather), its bias (and BLOOM's residual) added once, after.

Heads must divide by P (else refused naming the sizes that work); the plain Ulysses token order only
(not the ring's zigzag). At sp 1 the module runs unchanged unless the row packs documents: then the
same path (no collective) with the per-document mask, since its own mask would attend across them.

**Cost** (per rank, per such layer): the gathered ``[B, S, h]`` input, and these families' own
``[B, H/P, S, S]`` score tensor (and an ``[B, 1, S, S]`` mask): the S x S memory of the model's own
eager attention, divided by P. Refused: a KV cache at sp > 1, cross-attention (``key_value_states``:
TrOCR's ``encoder_attn``) at sp > 1, dropout in training (a dropout of partial sums is not the model's),
Falcon's ALiBi (folded into the model's mask), and keyword tensors it does not know. As in the SP
attention, the mask comes from positions alone: a padding ``attention_mask`` is not applied (right
padding is harmless under a causal mask; its labels are ``-100``). Each call counts as one run of
the SP attention for the registration's guardrail (every attention layer must run through SP).

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``H``/``H_l = H/P`` heads, ``h`` hidden.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ulysses_sp.mixers._kernels import (
    check_layout,
    model_function,
    refuse_cache,
    replace_forward,
    require_positions,
)
from ulysses_sp.mixers.classify import MIXER, code_names, has_heads, verdict
from ulysses_sp.mixers.head_cuts import (
    HeadCut,
    head_cut,
    local_attrs,
    local_params,
    returned_biases,
    sp_problem,
)
from ulysses_sp.mixers.input_width import input_width, reported_width, width_refusal
from ulysses_sp.mixers.key_gates import gate_values, gated, mixed_windows, own_registry_core, window
from ulysses_sp.parallel.comm import all_gather_seq, heads_to_seq

CACHE_ARGS = ("layer_past", "cache", "past_key_values", "past_key_value")
GATHERED = ("position_ids", "cache_position")
"""Per-token keyword tensors ``[B|1, S_l]``: gathered along the sequence."""
FLAGS = ("use_cache", "output_attentions")


def gather_seq(x: torch.Tensor, group: Any, sp_size: int) -> torch.Tensor:
    """``[B, S_l, ...] -> [B, S, ...]`` in rank order; backward: the gradient reduce-scattered (summed).

    One all-to-all of ``x`` sent to every rank (``[B, P, S_l, ...]``): the bytes of an all-gather."""
    if sp_size == 1:
        return x
    xs = x.unsqueeze(1).expand(-1, sp_size, *x.shape[1:])  # [B, P, S_l, ...]: one copy per rank
    return heads_to_seq(xs, group, head_dim=2, seq_dim=1).squeeze(1)  # [B, P, S_l, ..] -> [B, 1, S, ..]


def scatter_seq(y: torch.Tensor, group: Any, sp_size: int) -> torch.Tensor:
    """``[B, S, ...]`` partial sums -> ``[B, S_l, ...]`` summed over the group; backward: an all-gather."""
    if sp_size == 1:
        return y
    # [B, 1, S, ...] -> [B, P, S_l, ...]: every rank's partial sums of this rank's tokens, then summed
    return heads_to_seq(y.unsqueeze(1), group, head_dim=1, seq_dim=2).sum(1)


def _mask_form(module: nn.Module) -> str:
    """``masked``: the module's forward fills where its boolean mask is True (MPT); else an additive float mask
    (Doge's ``prepare_dynamic_mask`` fills too, but reads a boolean mask as True = attend: additive for it)."""
    own = inspect.unwrap(type(module).forward).__code__.co_names
    return "masked" if "masked_fill" in own and "attention_mask" in inspect.signature(type(module).forward).parameters else "additive"


def full_mask(layout: Any, batch: int, seq: int, dtype: torch.dtype, device: torch.device, form: str,
              window: int | None = None) -> torch.Tensor:  # fmt: skip
    """``[B, 1, S, S]``: causal (within ``window`` keys when set), within each packed document
    (``layout.doc_ids``), in ``form``."""
    idx = torch.arange(seq, device=device)
    allowed = (idx[None, :] <= idx[:, None])[None, None]  # [1, 1, S, S]: key <= query
    if window is not None:  # transformers' sliding_window_overlay: key > query - window
        allowed = allowed & (idx[None, :] > idx[:, None] - window)[None, None]
    if layout is not None and layout.doc_ids is not None:  # [B|1, S] -> [B|1, 1, S, S]: same document
        allowed = allowed & (layout.doc_ids[:, None, :, None] == layout.doc_ids[:, None, None, :])
    allowed = allowed.expand(batch, 1, seq, seq)
    if form == "masked":
        return ~allowed
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)


class OwnScoresHandler:
    """Claims attention modules that compute their own scores and split by head (module docstring)."""

    name = "own_scores"

    def __init__(self, positions: Any = None) -> None:
        self.positions = positions

    def matches(self, module: nn.Module) -> bool:
        return own_attention(module) and refusal(module) is None

    def check(self, module: nn.Module, sp_size: int) -> None:
        cut = head_cut(module)
        problem = cut if isinstance(cut, str) else sp_problem(cut, sp_size)
        if problem:
            sizes = [p for p in range(2, 65) if not isinstance(cut, str) and sp_problem(cut, p) is None]
            fit = ", ".join(map(str, sizes[:8])) or "none above 1"
            raise ValueError(f"{type(module).__name__} runs head-parallel under sequence parallelism, but {problem}; "
                             f"use an sp_size that divides its heads ({fit})")  # fmt: skip

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        positions = require_positions(self.positions, type(self).__name__)
        check_layout(mesh, type(module).__name__)
        self.check(module, mesh.sp_size)
        cut = head_cut(module)
        assert not isinstance(cut, str)
        signature = inspect.signature(type(module).forward)
        form = _mask_form(module)

        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(module, *args, **kwargs)
            bound.apply_defaults()
            call = dict(bound.arguments)
            call.pop(next(iter(signature.parameters)))  # self
            extra = call.pop(next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), ""), {})
            call.update(extra)
            x_name = next(iter(call))
            x = call[x_name]
            cache = next((call[k] for k in CACHE_ARGS if call.get(k) is not None), None)
            with own_registry_core(module):  # Doge: its own registry lacks the SP attention
                if mesh.sp_size == 1 and cache is not None:  # generation: the module's own cached path
                    return original(*args, **kwargs)
                refuse_cache(cache, mesh.sp_size, type(module).__name__)
                layout = positions.layout(x.shape[1], x.shape[0])
                if mesh.sp_size == 1 and (layout is None or layout.doc_ids is None):
                    return original(*args, **kwargs)  # one document per row: the module's own mask is right
                count_sp_call()
                return _head_parallel(module, cut, mesh, layout, x_name, call, form)

        return replace_forward(module, forward)


def own_attention(module: nn.Module) -> bool:
    """Whether ``module`` is attention that computes its own scores (the guard's verdict, by its code)."""
    if verdict(module).kind != MIXER or not has_heads(module):  # no heads: not attention (Doge's MoE router)
        return False
    names = code_names(type(module))
    scores = names & {"softmax", "scaled_dot_product_attention", "ALL_ATTENTION_FUNCTIONS"}
    return bool(scores) and not names & {"cumsum", "conv1d", "causal_conv1d_fn"}  # not a scan or a convolution


def refusal(module: nn.Module) -> str | None:
    """Why the head-parallel fallback cannot run ``module`` at any sp size (``None``: it can), by structure."""
    params = list(inspect.signature(type(module).forward).parameters)[1:]
    if {"mems", "target_mapping", "seg_mat"} & set(params):
        return ("it is two-stream attention over relative position encodings, a segment matrix and memory "
                "(mems) that its model builds for the tokens it is given; mixers/xlnet.py runs it head-parallel, "
                "with its model's encodings for the full sequence (apply_mixers)")  # fmt: skip
    if len(params) > 1 and params[1].startswith("hidden"):
        return (f"its keys and values come from a second input ({params[1]}) with a per-pair position bias its "
                "model builds for the tokens it is given")  # fmt: skip
    if "attention_mask" not in params:
        return "it takes no attention_mask to hold it to the full sequence's causal order"
    if getattr(getattr(module, "config", None), "alibi", False) and "alibi" in params:
        return "its ALiBi bias is folded into the model's attention mask (Falcon with alibi)"
    if mixed_windows(module):
        return "its model windows some layers' masks and not others' (config.layer_types), which it does not read per layer"
    if (width := width_refusal(module)) is not None:
        return width
    cut = head_cut(module)
    return cut if isinstance(cut, str) else None


def _head_parallel(module: nn.Module, cut: HeadCut, mesh: Any, layout: Any, x_name: str, call: dict, form: str) -> Any:
    """The module's own forward on this rank's heads over the full sequence (module docstring, 1-3)."""
    what, p, group = type(module).__name__, mesh.sp_size, mesh.sp_group
    refuse_dropout(module, what)
    if call.get("key_value_states") is not None and p > 1:
        raise ValueError(f"{what}: cross-attention to encoder states (key_value_states) is not run under "
                         "sequence parallelism; train the decoder alone (no encoder_hidden_states) or use sp_size 1")  # fmt: skip
    x = call[x_name]  # [B, S_l, h]
    b, seq = x.shape[0], x.shape[1] * p
    full = gather_seq(x, group, p)  # [B, S_l, h] -> [B, S, h]
    kwargs = {x_name: full}
    # TrOCR: the width its forward reads from its input's size is the rank's heads' H_l * D
    width = cut.heads // p * cut.head_dim if p > 1 and input_width(type(module)) else None
    residual = None
    for name, value in call.items():
        if name == x_name:
            continue
        if name == "attention_mask":
            value = full_mask(layout, b, seq, x.dtype, x.device, form, window(module))  # [B, 1, S, S]
        elif name == "residual" and isinstance(value, torch.Tensor):  # BLOOM adds it inside: once, after
            residual, value = value, torch.zeros_like(full)
        elif name == "alibi" and value is not None:
            value = _alibi(module, cut, b, seq, p, mesh.sp_rank, x.dtype, x.device)
        elif name == "position_bias" and isinstance(value, torch.Tensor):  # MPT: [H, 1, L] -> [H_l, 1, L]
            h_l = cut.heads // p
            value = value[mesh.sp_rank * h_l : (mesh.sp_rank + 1) * h_l]
        elif name == "position_embeddings" and value is not None:  # rotary (cos, sin) [B|1, S_l, D] per token
            value = tuple(all_gather_seq(t, group, dim=-2) if p > 1 else t for t in value)
        elif name in GATHERED and isinstance(value, torch.Tensor):
            value = all_gather_seq(value, group, dim=-1) if p > 1 else value
        elif name in FLAGS:
            value = False
        elif isinstance(value, torch.Tensor) or (isinstance(value, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in value)):
            raise ValueError(f"{what}: its keyword argument {name!r} is a tensor the head-parallel fallback does not "
                             "know how to extend to the full sequence; train this model with sp_size 1")  # fmt: skip
        kwargs[name] = value
    params = local_params(module, cut, p, mesh.sp_rank) if p > 1 else {}
    attrs = local_attrs(module, cut, p) if p > 1 else {}
    saved = {(m, a): getattr(m, a) for m, a in attrs}
    gate = gate_values(module, cut, x, lambda t: gather_seq(t, group, p), p, mesh.sp_rank)  # [B, S, Hkv_l] | None
    wrapped = vars(module).pop("forward")  # the module's own forward inside (this wrapper is the instance's)
    try:
        for (m, a), v in attrs.items():
            setattr(m, a, v)
        with gated(module, cut, gate), reported_width(full, width):
            res = functional_call(module, params, (), kwargs, strict=False, tie_weights=False)
    finally:
        module.forward = wrapped
        for (m, a), v in saved.items():
            setattr(m, a, v)
    first = res[0] if isinstance(res, (tuple, list)) else res
    rest = list(res[1:]) if isinstance(res, (tuple, list)) else []
    for name in returned_biases(module, cut) if p > 1 else ():
        if not any(t is getattr(module, name) for t in rest):  # added inside: P times in the partial sums
            raise ValueError(f"{what} adds its parameter {name} inside its heads' output, so it cannot run "
                             "head-parallel; train it with sp_size 1")  # fmt: skip
    if p > 1:
        out = scatter_seq(first, group, p)  # [B, S, h] partial sums -> [B, S_l, h]
        bias = getattr(module, cut.out).bias
        out = out + bias if bias is not None else out
    else:
        out = first
    if residual is not None:
        out = out + residual
    if not isinstance(res, (tuple, list)):
        return out
    rest = [None if isinstance(t, torch.Tensor) and t.dim() == 4 else t for t in rest]  # this rank's weights: dropped
    return type(res)([out, *rest]) if isinstance(res, list) else (out, *rest)


def _alibi(module: nn.Module, cut: HeadCut, b: int, seq: int, p: int, rank: int, dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:  # fmt: skip
    """BLOOM's ALiBi for this rank's heads over the full sequence: ``[B*H_l, 1, S]`` (the model's
    ``build_alibi_tensor`` of an all-ones mask: slope times the key's index, as without SP)."""
    build = model_function(module, "build_alibi_tensor")
    if build is None:
        raise ValueError(f"{type(module).__name__} takes an alibi tensor, but its modeling file has no "
                         "build_alibi_tensor to build it over the full sequence; train it with sp_size 1")  # fmt: skip
    alibi = build(torch.ones(b, seq, device=device, dtype=torch.long), cut.heads, dtype)  # [B*H, 1, S]
    h_l = cut.heads // p
    return alibi.view(b, cut.heads, 1, seq)[:, rank * h_l : (rank + 1) * h_l].reshape(b * h_l, 1, seq)


def count_sp_call() -> None:
    """Count this layer as one run through sequence parallelism for the registration's guardrail
    (which checks after every SP forward that every attention layer did)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ulysses_sp.attention.registration import ATTN_NAME

    attention = ALL_ATTENTION_FUNCTIONS.get(ATTN_NAME)
    if hasattr(attention, "calls"):
        attention.calls += 1


def refuse_dropout(module: nn.Module, what: str) -> None:
    """Dropout in training: a draw per rank on partial sums is not the model's dropout."""
    if not module.training:
        return
    rates = [m.p for m in module.modules() if isinstance(m, nn.Dropout)]
    rates += [v for k, v in vars(module).items() if "dropout" in k and isinstance(v, float)]
    if any(r > 0 for r in rates):
        raise ValueError(f"{what}: dropout in training ({max(rates)}) is not exact when its heads run apart "
                         "under sequence parallelism; set the model's attention/hidden dropout to 0")  # fmt: skip


HANDLER = OwnScoresHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
