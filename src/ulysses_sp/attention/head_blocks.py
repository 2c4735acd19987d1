"""The whole attention block one head group at a time (UPipe's scheme), forward and backward.

``attention/head_chunks.py`` groups heads at the attention *function*: by the time it runs, the
layer's q/k/v projections (``[B, S_l, H*D]`` and ``[B, S_l, Hkv*D]``), the rotary's outputs and, in
backward, their gradients exist for every head. Here the attention *module* runs once per head group
with its own projection weights cut to the group's heads: ``q_proj``/``k_proj``/``v_proj`` rows (and
their biases), ``o_proj`` columns, per-head ``sinks``; what is shared by every head (``q_norm``/``k_norm``
over ``head_dim``, LoRA's ``A`` of q/k/v and ``B`` of o) passes whole. The module's own forward
(``torch.func.functional_call``: its norms, rotary, scaling and the attention interface, which
exchanges and attends the group's heads) returns the group's partial ``o_proj`` output; the partial
outputs sum to the layer's, ``o_proj``'s bias added once (group 0). So one group's q/k/v, exchange
buffers, core and gradients are alive, in forward and in backward, and never every head's.

**Which heads a group holds**: with ``P`` Ulysses ranks and ``N`` groups, rank ``r``'s attention heads
(``[r*H_l, (r+1)*H_l)``) are cut into ``N`` groups of ``H_c = H_l/N``; group ``g``'s block computes, on
every rank's local tokens, query heads ``r*H_l + g*H_c + i`` for every ``r`` (in rank order, so the
all-to-all hands rank ``r`` its own ``H_c``) and the kv heads those use, one set per rank (a kv head
two ranks' queries share is computed once for each: the exchange then needs no replication).

**Backward** (``_HeadBlocks``): forward runs every group without autograd and saves the block's input
and the parameters; backward runs each group's block again under autograd and takes the gradients of
its partial output (the layer's output gradient, the same for every group): the input gradient summed
over groups in the input's dtype, the weight gradients written into full-size buffers at the group's
rows/columns (summed where groups share a parameter). Activation checkpointing recomputes the layer
anyway, so the extra cost is one more attention block forward per layer.

**Overlap** (the attention's ``head_chunk_overlap``, at ``P > 1`` without a ring or sinks): the forward
runs the groups pipelined (``attention/block_overlap.py``): the next group's q/k/v exchange in flight
during this group's core; two groups' exchanges alive. The backward stays one group at a time.

Modules this cannot cut (a fused qkv projection, a gated q projection, a norm over every head's
width, MLA's latent projections) keep the function-level head groups; so do KV-cache calls,
Ulysses-Offload and attention dropout in training (random per call, so a recomputed group would not
match its forward). ``head_block_layout`` says which and why.

Shape legend: ``B`` batch, ``S_l`` local tokens, ``h`` hidden size, ``H``/``Hkv`` query/kv heads,
``D`` head dim, ``P`` Ulysses size, ``N`` head groups, ``H_c = H/(P*N)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call

from ulysses_sp.attention.block_overlap import Deferred, pipelined
from ulysses_sp.attention.group_proj import BlockGrads, GroupProj

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""The projections a group cuts (``nn.Linear`` each; ``attention/group_proj.py`` stands in for them)."""
ROWS_Q, ROWS_KV, COLS_Q, HEADS_Q, WHOLE, FIRST = "rows_q", "rows_kv", "cols_q", "heads_q", "whole", "first"
"""How a parameter is cut per group: query-head rows, kv-head rows, query-head columns, one entry per
query head (sinks), not at all, or only in group 0 (``o_proj``'s bias: added once)."""


@dataclass(frozen=True)
class BlockLayout:
    """How one attention module's parameters are cut into head groups."""

    names: tuple[str, ...]
    """The module's parameter names, in the order the autograd function receives them."""
    cuts: tuple[str, ...]
    """Per name: ``ROWS_Q``/``ROWS_KV``/``COLS_Q``/``HEADS_Q``/``WHOLE``/``FIRST``."""
    head_dim: int
    heads: int
    kv_heads: int


def head_block_layout(module: torch.nn.Module) -> BlockLayout | str:
    """The cut of ``module``'s parameters, or why it cannot be cut (a string naming the parameter)."""
    projs = [getattr(module, n, None) for n in PROJS]
    d = getattr(module, "head_dim", None)
    if not all(isinstance(p, torch.nn.Linear) for p in projs) or not isinstance(d, int):
        return (f"{type(module).__name__} has no q_proj/k_proj/v_proj/o_proj linear layers and head_dim "
                "(adapters such as LoRA wrap them: the function-level head groups run instead)")  # fmt: skip
    rows = {n: getattr(module, n).out_features for n in ("q_proj", "k_proj", "v_proj")}
    o_in = module.o_proj.in_features
    if rows["q_proj"] % d or rows["k_proj"] % d or rows["k_proj"] != rows["v_proj"]:
        return f"{type(module).__name__}'s q/k/v projections are not whole heads of head_dim {d}"
    if o_in != rows["q_proj"]:  # e.g. a gated q projection ([q, gate] per head)
        return f"{type(module).__name__}'s q_proj gives {rows['q_proj']} features and o_proj takes {o_in}"
    h, hkv = rows["q_proj"] // d, rows["k_proj"] // d
    names, cuts = [], []
    for name, p in module.named_parameters():
        cut = _cut(name, p, h, d)
        if cut is None:
            return f"{type(module).__name__}'s parameter {name} {tuple(p.shape)} is not per head or shared by all heads"
        names.append(name)
        cuts.append(cut)
    return BlockLayout(tuple(names), tuple(cuts), d, h, hkv)


def _cut(name: str, p: torch.Tensor, h: int, d: int) -> str | None:
    top, _, rest = name.partition(".")
    if top in ("q_proj", "k_proj", "v_proj"):  # nn.Linear: weight [n, h], bias [n]
        return ROWS_Q if top == "q_proj" else ROWS_KV
    if top == "o_proj":
        return FIRST if rest == "bias" else COLS_Q
    if top == "sinks":
        return HEADS_Q if p.dim() == 1 and p.shape[0] == h else None
    if top in ("q_norm", "k_norm"):
        return WHOLE if p.dim() == 1 and p.shape[0] == d else None
    return None


def group_heads(heads: int, kv_heads: int, ulysses: int, groups: int, g: int) -> tuple[list[int], list[int]]:
    """Group ``g``'s query heads and kv heads (one kv set per rank, in rank order): see the module doc."""
    h_l, hc, ratio = heads // ulysses, heads // ulysses // groups, heads // kv_heads
    q, kv = [], []
    for r in range(ulysses):
        mine = [r * h_l + g * hc + i for i in range(hc)]
        q += mine
        kv += sorted({i // ratio for i in mine})
    return q, kv


def _indices(layout: BlockLayout, ulysses: int, groups: int, g: int, device) -> dict[str, torch.Tensor]:
    """Group ``g``'s indices per cut: its query heads' rows (``[H*D]`` projections), kv heads' rows
    (``[Hkv*D]``) and query heads (``[H]`` sinks)."""
    q, kv = group_heads(layout.heads, layout.kv_heads, ulysses, groups, g)
    d = layout.head_dim
    rows = lambda heads: torch.tensor([i * d + j for i in heads for j in range(d)], device=device)  # noqa: E731
    return {ROWS_Q: rows(q), COLS_Q: rows(q), ROWS_KV: rows(kv), HEADS_Q: torch.tensor(q, device=device)}


CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")
"""Keyword arguments carrying a KV cache (a call that updates one runs the module whole)."""

Run = Callable[..., torch.Tensor]
"""``run(g, index, x [B, S_l, h], others, grads, out, dout=None, defer=None)``: group ``g``'s block (``index``:
its ``_indices``) with ``others`` (the parameters that are not projections) in place of the module's; in forward
``out`` accumulates (``defer``: overlapped, the exchange posted and ``o_proj`` recorded), in backward ``grads``
(the group's output back-propagated with ``dout`` inside the call)."""


class _HeadBlocks(torch.autograd.Function):
    """Forward: every group's block without autograd, ``o_proj`` adding into the output; saves the
    block input and the parameters. Backward: per group, the block again under autograd, its
    placeholder output back-propagated with the output gradient into in-place accumulators."""

    @staticmethod
    def forward(ctx, run: Run, layout: BlockLayout, ulysses: int, groups: int, overlap: bool, x: torch.Tensor,
                *params):  # fmt: skip
        out = x.new_zeros(x.shape)  # [B, S_l, h]

        def call(g: int, defer: Deferred | None = None) -> None:
            index = _indices(layout, ulysses, groups, g, x.device)
            run(g, index, x, _others(layout, params, index, None), None, out, defer=defer)

        if overlap:  # the next group's exchange posted before this group's core (attention/block_overlap.py)
            pipelined(call, groups)
        else:
            for g in range(groups):
                call(g)
        ctx.run, ctx.layout, ctx.ulysses, ctx.groups = run, layout, ulysses, groups
        ctx.save_for_backward(x, *params)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, *params = ctx.saved_tensors
        layout, wants = ctx.layout, ctx.needs_input_grad[6:]
        proj = [n.partition(".")[0] in PROJS for n in layout.names]
        grads = BlockGrads(torch.zeros_like(x) if ctx.needs_input_grad[5] else None,
                           {n: torch.zeros_like(p) if w else None
                            for n, p, w, j in zip(layout.names, params, wants, proj) if j})  # fmt: skip
        other = {n: torch.zeros_like(p) if w else None for n, p, w, j in zip(layout.names, params, wants, proj) if not j}
        for g in range(ctx.groups):
            index = _indices(layout, ctx.ulysses, ctx.groups, g, x.device)
            leaves = _others(layout, params, index, other)
            with torch.enable_grad():  # back-propagated inside the group's call (``run``'s ``dout``)
                ctx.run(g, index, x.detach().requires_grad_(), leaves, grads, None, dout)
            for n, cut in zip(layout.names, layout.cuts):
                if other.get(n) is not None and leaves[n].grad is not None:
                    _add_grad(other[n], leaves[n].grad, cut, index)
        dparams = [grads.params[n] if j else other[n] for n, j in zip(layout.names, proj)]
        return (None, None, None, None, None, grads.dx, *dparams)


def _others(layout: BlockLayout, params, index: dict[str, torch.Tensor], want: dict | None) -> dict[str, torch.Tensor]:
    """The parameters that are not projections, for group ``g``: sinks cut to its heads, norms whole; in
    backward (``want``: the gradient buffers) detached leaves that take gradients where wanted."""
    out = {}
    for name, p, cut in zip(layout.names, params, layout.cuts):
        if name.partition(".")[0] in PROJS:
            continue
        t = p.index_select(0, index[cut]) if cut == HEADS_Q else p
        if want is not None:
            t = t.detach().requires_grad_(want[name] is not None)
        out[name] = t
    return out


def _add_grad(into: torch.Tensor, grad: torch.Tensor, cut: str, index: dict[str, torch.Tensor]) -> None:
    """A group's gradient of a non-projection parameter into its full buffer (sinks at its heads)."""
    if cut == HEADS_Q:
        into.index_add_(0, index[cut], grad)
    else:
        into.add_(grad)


@dataclass
class HeadBlockHandle:
    """The attention modules ``install_head_blocks`` swapped; ``remove()`` restores their ``forward``."""

    modules: list[torch.nn.Module]
    skipped: dict[str, str]
    """Attention modules left to the function-level head groups: qualified name -> why."""
    calls: int = 0
    """Grouped block calls (every layer's forward and its checkpoint recompute)."""

    def describe(self, groups: int) -> str:
        """One line for a run's summary: which attention modules run per head group, and how."""
        text = f"  head groups {groups}: the whole attention block per group in {len(self.modules)} attention modules"
        reasons = sorted(set(self.skipped.values()))
        if reasons:
            text += f"; exchange and core per group in {len(self.skipped)} ({reasons[0]}{' ...' if len(reasons) > 1 else ''})"
        return text

    def remove(self) -> None:
        for m in self.modules:
            m.__dict__.pop("forward", None)
        self.modules = []


def install_head_blocks(model: torch.nn.Module, attention: Any) -> HeadBlockHandle:
    """Run every decoder attention module of ``model`` one head group at a time (the whole block).

    ``attention`` is the registered ``UlyssesSPAttentionHF``: its ``head_chunks`` (``N``), its Ulysses
    size (``P``, 1 without SP) and its ``in_head_block`` flag (set while a group's block runs, so the
    function-level head groups stand aside). Modules whose parameters cannot be cut per head
    (``head_block_layout``), whose heads do not split into ``P*N`` groups, or that are not decoder
    attention (no ``layer_idx``) are left as they are and named in the handle's ``skipped``.
    """
    from ulysses_sp.attention.head_chunks import _problem

    handle = HeadBlockHandle([], {})
    p = attention.ulysses_size if attention.sp_size > 1 else 1
    for qualname, module in model.named_modules():
        if not hasattr(module, "layer_idx") or not hasattr(module, "o_proj"):
            continue
        layout = head_block_layout(module)
        problem = layout if isinstance(layout, str) else _problem(layout.heads, layout.kv_heads, attention.head_chunks, p)
        if problem:
            handle.skipped[qualname] = problem
            continue
        module.forward = _grouped_forward(module, layout, attention, handle, p)
        handle.modules.append(module)
    return handle


def _grouped_forward(module: torch.nn.Module, layout: BlockLayout, attention: Any, handle: HeadBlockHandle, p: int):
    orig = type(module).forward.__get__(module)
    backprop: list[Any] = [None, None]  # while a group runs in backward: its o_proj stand-in, the output gradient

    def group_call(*args: Any, **kwargs: Any):
        """One group's module forward (inside ``functional_call``, its parameters in place); in backward
        also its back-propagation, in the same scope (a norm that recomputes in its own backward,
        ``memory.norms``, reads its module's weight then: the group's, not the module's)."""
        res = orig(*args, **kwargs)
        out = res[0] if isinstance(res, tuple) else res
        if out is not backprop[0].placeholder:
            raise ValueError(f"head_chunks: {type(module).__name__} changes o_proj's output before returning it, "
                             "so its attention block cannot run one head group at a time; use head_chunks 1")  # fmt: skip
        if backprop[1] is not None:
            torch.autograd.backward(out, backprop[1])
        return res

    def forward(*args: Any, **kwargs: Any):
        if backprop[0] is not None:
            return group_call(*args, **kwargs)
        named = "hidden_states" in kwargs
        others = (args, {k: v for k, v in kwargs.items() if k != "hidden_states"}) if named else (args[1:], kwargs)
        extra = [t for t in torch.utils._pytree.tree_leaves(others) if isinstance(t, torch.Tensor)]
        if (attention.in_head_block or any(kwargs.get(k) is not None for k in CACHE_KWARGS)
                or any(t.requires_grad for t in extra)
                or (module.training and float(getattr(module, "attention_dropout", 0.0) or 0.0) > 0)):  # fmt: skip
            return orig(*args, **kwargs)
        x = kwargs.pop("hidden_states") if named else args[0]
        rest = args if named else args[1:]

        def run(g: int, index: dict[str, torch.Tensor], x_: torch.Tensor, params: dict, grads: BlockGrads | None,
                out: torch.Tensor | None, dout: torch.Tensor | None = None, defer: Deferred | None = None):  # fmt: skip
            swapped = {n: GroupProj(getattr(module, n), n, index[COLS_Q if n == "o_proj" else ROWS_Q if n == "q_proj"
                                    else ROWS_KV], out=out, grads=grads, first=g == 0, defer=defer) for n in PROJS}  # fmt: skip
            saved = {n: module._modules[n] for n in PROJS}
            prev, attention.in_head_block, attention.block_overlap = attention.in_head_block, True, defer
            backprop[:] = [swapped["o_proj"], dout]
            try:
                module._modules.update(swapped)
                call_args, call_kwargs = (rest, {**kwargs, "hidden_states": x_}) if named else ((x_, *rest), kwargs)
                res = functional_call(module, params, call_args, call_kwargs, strict=False, tie_weights=False)
            finally:
                module._modules.update(saved)
                attention.in_head_block, attention.block_overlap = prev, None
                backprop[:] = [None, None]
            return res[0] if isinstance(res, tuple) else res

        handle.calls += 1
        named_params = dict(module.named_parameters())
        overlap = attention.head_chunk_overlap and p > 1 and attention.ring_size == 1 and HEADS_Q not in layout.cuts
        return _HeadBlocks.apply(run, layout, p, attention.head_chunks, overlap, x,
                                 *(named_params[n] for n in layout.names)), None  # fmt: skip

    return forward
