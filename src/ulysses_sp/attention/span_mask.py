"""Bidirectional spans in the full-sequence mask: image tokens that see each other (Gemma 3 and kin).

Gemma 3 lets the tokens of one image attend to each other in both directions: a maximal run of
``token_type_ids == 1`` is one block, and transformers composes its masks as (``masking_utils``,
``gemma3.create_masks_for_vision_model``)

- full-attention layers: ``(causal | same span) & same document``
- sliding layers: ``(causal | same span) & k > q - window & same document`` — the window bounds how far
  *back* a query sees; the later tokens of its own span stay visible whatever the window.

Under sequence parallelism the spans travel as host ints with the batch's layout
(``parallel/doc_layout.py``: ``HostLayout.spans``, found once per step on the host by
``bidirectional_spans``; no host read in a layer) and become a ``[B, S]`` span id per token
(``SeqLayout.span_ids``, ``-1`` outside spans: ``O(S)``). The cores that honour it: eager (its dense mask,
``masks.mask_for``), flex (a ``mask_mod``) and sdpa through the **blockwise core** (``SpanStructure``
below: a key block after the query block is computed only where a span reaches into both, with the
span rule in its block mask; no ``S x S`` tensor). Refused with the reason (``check_span_core``): flash
(its kernels take no mask), ring attention (its ring steps skip the key chunks after the queries) and
chunked attention.

Shape legend: ``B`` batch, ``S`` full sequence, ``bq``/``bk`` query/key block lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ulysses_sp.attention.blockwise import AttnStructure
from ulysses_sp.parallel.doc_layout import layout_of

SPAN_MODELS = ("gemma3", "shieldgemma2")
"""``config.model_type``s whose own mask makes ``token_type_ids == 1`` runs bidirectional (image blocks)."""


@dataclass(frozen=True)
class SpanStructure(AttnStructure):
    """``AttnStructure`` (documents, window) with bidirectional spans ORed into its causal part."""

    span_ids: torch.Tensor | None = None
    """``[B|1, S]`` span index per token, ``-1`` outside spans."""
    spans: tuple[tuple[tuple[int, int], ...], ...] = field(default=(), repr=False)
    """Per row: its ``[start, end)`` spans as host ints (block skipping: no sync)."""

    @classmethod
    def of(cls, base: AttnStructure, span_ids: torch.Tensor, spans: tuple) -> SpanStructure:
        """``base`` with the spans of ``span_ids`` (host ``spans``: the same spans as ints)."""
        return cls(base.doc_ids, base.window, base.doc_starts, span_ids, tuple(map(tuple, spans)))

    def _span_reaches(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Whether in some row one span holds a query of ``[q0, q1)`` and a key of ``[k0, k1)``."""
        return any(a < min(q1, k1) and b > max(q0, k0) for row in self.spans for a, b in row)

    def block_kind(self, q0: int, q1: int, k0: int, k1: int) -> str:
        kind = super().block_kind(q0, q1, k0, k1)
        # keys all after the queries: empty for causal alone (window and documents only cut keys before)
        if kind == "empty" and k0 >= q1 and self._span_reaches(q0, q1, k0, k1):
            return "partial"
        return kind

    def block_mask(self, q0: int, q1: int, k0: int, k1: int, device: torch.device) -> torch.Tensor:
        """``[B|1, 1, 1, bq, bk]``: ``(causal | same span) & window & same document``."""
        qi = torch.arange(q0, q1, device=device)[:, None]
        ki = torch.arange(k0, k1, device=device)[None, :]
        sq, sk = self.span_ids[:, q0:q1, None], self.span_ids[:, None, k0:k1]  # [B|1, bq, 1], [B|1, 1, bk]
        allowed = (ki <= qi)[None] | ((sq == sk) & (sq >= 0))  # [B|1, bq, bk]
        if self.window is not None:
            allowed = allowed & (qi - ki < self.window)
        if self.doc_ids is not None:
            allowed = allowed & (self.doc_ids[:, q0:q1, None] == self.doc_ids[:, None, k0:k1])
        return allowed[:, None, None]  # [B|1, 1, 1, bq, bk]


def check_span_core(core: str, *, ring_size: int = 1) -> None:
    """Raise ``ValueError`` naming the alternative when ``core`` (or the ring) cannot honour the spans."""
    if ring_size > 1:
        raise ValueError(
            f"bidirectional spans (image tokens attending to each other, token_type_ids) with ring attention "
            f"(ring_size {ring_size}): its ring steps skip every key chunk after the queries. Use "
            "ring_size 1 (Ulysses alone) with core 'sdpa' (the blockwise core honours the spans) or 'eager'"
        )
    if core.startswith("flash"):
        raise ValueError(
            f"bidirectional spans (image tokens attending to each other, token_type_ids) with core {core!r}: "
            "flash kernels take no mask (transformers' Gemma 3 refuses flash for the same reason). Use core "
            "'sdpa' (the blockwise core honours the spans), 'flex_attention' or 'eager'"
        )


def check_spans_shipped(module: torch.nn.Module, position_ids: Any) -> None:
    """Raise ``ValueError`` unless ``position_ids`` carry a host layout with spans (``module`` was given
    ``token_type_ids``, which its own mask turns into bidirectional image blocks): else the SP mask, built
    from positions alone, would silently be causal over the images."""
    layout = layout_of(position_ids)
    if layout is None or layout.spans is None:
        raise ValueError(
            f"{type(module).__name__} was given token_type_ids: its image tokens attend to each other "
            "bidirectionally, and the SP attention needs those spans with the batch's host layout. Use "
            "UlyssesSPDataLoaderAdapter(..., bidirectional_spans_key='token_type_ids'), or attach "
            "host_layout(full_position_ids, spans=bidirectional_spans(token_type_ids)) to each rank's "
            "position_ids shard (ulysses_sp.parallel.doc_layout.attach_layout); for the vision-language model, "
            "build each rank's inputs with ulysses_sp.vlm.prepare_vlm_batch (or VLMDataLoaderAdapter)"
        )


def span_structure(base: AttnStructure, span_ids: torch.Tensor | None, spans: tuple | None) -> AttnStructure:
    """``base`` as it is without spans, else a ``SpanStructure``."""
    return base if span_ids is None or spans is None else SpanStructure.of(base, span_ids, spans)
