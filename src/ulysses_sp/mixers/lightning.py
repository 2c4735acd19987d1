"""Sequence parallelism for MiniMax's lightning attention (``MiniMaxLightningAttention``, the
``linear_attention`` layers of MiniMax-Text-01).

Lightning attention is linear attention with a fixed decay per head (``slope_rate``): the model's
forward runs ``act(qkv_proj(h))`` on every token alone, then a block-chunked recurrence per head
(``block_size`` tokens a block: an intra-block ``[blk, blk]`` product under ``diagonal_decay`` and an
inter-block state ``K^T V`` ``[D, D]`` carried across blocks with ``exp(-slope * blk)``), then an
RMSNorm over all heads together, a sigmoid gate from the layer input, and ``out_proj``. Only the
recurrence mixes tokens, and its heads are independent. So, per forward:

1. ``act(qkv_proj(h))`` on the local tokens (the padding mask applied as the model does), viewed per
   head ``[B, S_l, H, 3D]`` (the model's own ``[q | k | v]`` per head), ONE all-to-all
   ``[B, S_l, H, 3D] -> [B, S, H_l, 3D]``;
2. the model's **own** forward runs the recurrence over the full sequence for the rank's heads: it is
   one function, so it is called on a stand-in for the module (``_LocalHeads``): ``num_attention_heads``
   ``H_l``, the decay buffers cut to the rank's heads, the projection already done (``qkv_proj`` and
   ``act_fn`` the identity), and its tail made the identity (``norm``, ``out_proj``; the gate
   ``sigmoid(+inf) = 1``, exactly); once per packed document (each document from a zero state, its own
   block grid: what it computes alone);
3. one all-to-all ``[B, S, H_l, D] -> [B, S_l, H, D]``, then the tail on the local tokens, as the
   model's last lines do: ``out_proj(sigmoid(output_gate(h)) * norm(o))`` (the norm spans all heads,
   so it waits for the return exchange).

Every weight stays whole and acts on local tokens: full gradients with no slicing. Cost per local
token and layer: ``3 H D`` elements in, ``H D`` out. Memory per rank: the model's own per-block
tensors for ``H_l`` heads (``[B, H_l, blk, blk]`` scores, ``[B, H_l, D, D]`` states): no ``S x S``.
A cache (``use_cache=True``: generation) runs the model's own path at sp 1 and is refused at sp > 1.
Matched by structure (``qkv_proj`` of ``3 H D`` rows, ``output_gate``, ``out_proj``, ``norm``, the
``slope_rate``/``query_decay``/``key_decay``/``diagonal_decay`` buffers per head), never by name.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``H`` heads, ``H_l = H/P``, ``D``
head dim, ``blk`` the block size, ``P`` sp size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ulysses_sp.mixers._kernels import ForwardHandler, local_span, model_function
from ulysses_sp.mixers.documents import per_document, segments
from ulysses_sp.parallel.comm import heads_to_seq, seq_to_heads_packed

DECAYS = {"slope_rate": 0, "query_decay": 0, "key_decay": 0, "diagonal_decay": 1}
"""The per-head buffers the recurrence reads, and their head dim: ``[H, 1, 1]``, ``[H, blk, 1]`` twice,
``[1, H, blk, blk]``."""
PAD_MASK = "apply_mask_to_padding_states"


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _open_gate(x: torch.Tensor) -> torch.Tensor:
    """A 0-dim ``+inf``: the forward's ``sigmoid(gate) * o`` becomes ``1.0 * o`` (exact, no gradient)."""
    return x.new_full((), float("inf"))


class _LocalHeads:
    """The module as its own forward sees it, for heads ``[start, start + n)`` with the projections
    done and the tail left out (see the module docstring); every other attribute is the module's."""

    def __init__(self, module: nn.Module, start: int, n: int) -> None:
        self._module = module
        self.num_attention_heads = n
        for name, dim in DECAYS.items():
            setattr(self, name, getattr(module, name).narrow(dim, start, n))
        self.qkv_proj = self.act_fn = self.norm = self.out_proj = _identity
        self.output_gate = _open_gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class LightningAttentionHandler(ForwardHandler):
    """Shards MiniMax's lightning attention over the SP group by heads (see the module docstring)."""

    name = "lightning_attention"

    def matches(self, module: nn.Module) -> bool:
        h, d, blk = (getattr(module, a, None) for a in ("num_attention_heads", "head_dim", "block_size"))
        if not all(isinstance(x, int) and x > 0 for x in (h, d, blk)):
            return False
        linears = [getattr(module, a, None) for a in ("qkv_proj", "output_gate", "out_proj")]
        shapes = {"slope_rate": (h, 1, 1), "query_decay": (h, blk, 1), "key_decay": (h, blk, 1),
                  "diagonal_decay": (1, h, blk, blk)}  # fmt: skip
        return (
            all(isinstance(x, nn.Linear) for x in linears)
            and linears[0].out_features == 3 * h * d
            and linears[2].in_features == h * d
            and isinstance(getattr(module, "norm", None), nn.Module)
            and callable(getattr(module, "act_fn", None))
            and all(tuple(getattr(getattr(module, n, None), "shape", ())) == s for n, s in shapes.items())
            and model_function(module, PAD_MASK) is not None
        )

    def check(self, module: nn.Module, sp_size: int) -> None:
        h = module.num_attention_heads
        if h % sp_size:
            raise ValueError(
                f"{type(module).__name__} (lightning attention, {h} heads): the heads are not divisible by "
                f"sp_size {sp_size} (its recurrence is sharded by head); use an sp_size that divides {h}"
            )

    def sharded(self, module: nn.Module, mesh: Any, positions: Any, hidden: torch.Tensor,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, None]:  # fmt: skip
        """``[B, S_l, hidden] -> ([B, S_l, hidden], None)``: the module's output, as its forward returns it
        (the final recurrent state, kept only for a cache, is not returned)."""
        b, s_local, _ = hidden.shape
        h, d = module.num_attention_heads, module.head_dim
        qkv = module.act_fn(module.qkv_proj(hidden))  # [B, S_l, 3 H D]: the forward's first lines
        qkv = model_function(module, PAD_MASK)(qkv, mask).view(b, s_local, h, 3 * d)  # [B, S_l, H, 3D]
        if mesh.sp_size > 1:  # [B, S_l, H, 3D] -> [B, S, H_l, 3D]
            (qkv,) = seq_to_heads_packed((qkv,), mesh.sp_group)
        start, n = local_span(h, mesh.sp_size, mesh.sp_rank)
        heads, own = _LocalHeads(module, start, n), type(module).forward

        def run(part: torch.Tensor) -> torch.Tensor:  # [B, S_doc, H_l, 3D] -> [B, S_doc, H_l D]
            return own(heads, part.flatten(2), None, None)[0]

        layout = positions.layout(s_local, b)  # a collective on a forward's first call
        out = per_document(run, [qkv], segments(layout, b, qkv.shape[1]), seq_dim=1)  # [B, S, H_l D]
        out = out.view(b, -1, n, d)  # [B, S, H_l, D]
        if mesh.sp_size > 1:  # [B, S, H_l, D] -> [B, S_l, H, D]
            out = heads_to_seq(out, mesh.sp_group, head_dim=2, seq_dim=1)
        out = module.norm(out.reshape(b, s_local, h * d))  # the forward's tail, on local tokens
        out = torch.sigmoid(module.output_gate(hidden)) * out
        return module.out_proj(out), None


HANDLER = LightningAttentionHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
