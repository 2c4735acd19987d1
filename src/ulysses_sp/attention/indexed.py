"""Attention over each query's picked keys (DeepSeek Sparse Attention) in the blockwise core.

A DSA layer hands the attention function ``indices [B, S_l, topk]``: for each local query the global
indices of the keys its indexer picked (``attention/indexer.py`` makes them the no-SP model's picks).
After the Ulysses all-to-all a rank holds every query of its heads, so it needs every query's picks:
``gather_indices`` all-gathers them over the SP group, ``[B, S, topk]`` int32 — the one tensor here that
does not shrink with ``P`` (``4 S topk`` bytes per row: at 1M tokens and topk 2048, 8 GiB per rank for
the layer that runs). The core saves it through ``save_for_backward`` (``IndexedStructure.saved``), so
activation checkpointing drops it between a layer's forward and its backward; without checkpointing
every layer's picks stay until its backward.

``IndexedStructure`` is the blockwise core's structure (causal, packed documents) with the picks on top:
a key counts only if it is picked **and** visible (the model's indexer may pick masked keys when fewer
than ``topk`` are visible; its eager/sdpa path drops them with the causal mask, so does this). Each
partial ``[bq, bk]`` block builds its mask from the block's queries' picks (``[B, bq, topk]`` int64 and a
``[B, bq, bk + 1]`` bool, never ``S x S``: 16 MiB + 1 MiB per row at blocks of 1024 and topk 2048, at any
``S``); blocks the structure masks entirely are still skipped.
The FLOPs are the blockwise core's (the causal half of ``S x S``), not ``S x topk``: exact, not faster.

Shape legend: ``B`` batch, ``S`` full sequence, ``S_l = S/P``, ``bq``/``bk`` query/key block lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ulysses_sp.attention.blockwise import AttnStructure
from ulysses_sp.parallel.comm import all_gather_seq


def gather_indices(indices: torch.Tensor | None, group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """``[B, S_l, topk] -> [B, S, topk]``: every query's picked keys (``None`` group: as they are)."""
    if indices is None or group is None:
        return indices
    return all_gather_seq(indices, group, dim=1)


@dataclass(frozen=True)
class IndexedStructure(AttnStructure):
    """``AttnStructure`` restricted to each query's picked keys."""

    indices: torch.Tensor | None = None
    """``[B, S, topk]`` global key indices per query (int)."""

    @classmethod
    def of(cls, base: AttnStructure, indices: torch.Tensor) -> IndexedStructure:
        """``base`` (documents, window) with the picks ``indices [B, S, topk]`` on top."""
        return cls(base.doc_ids, base.window, base.doc_starts, indices)

    def saved(self) -> tuple[tuple[torch.Tensor, ...], AttnStructure]:
        """The picks go through ``save_for_backward`` (checkpointing drops them), not the saved structure."""
        return (self.indices,), IndexedStructure(self.doc_ids, self.window, self.doc_starts)  # picks: None

    def restored(self, tensors: list[torch.Tensor]) -> IndexedStructure:
        return IndexedStructure.of(self, tensors[0])

    def block_kind(self, q0: int, q1: int, k0: int, k1: int) -> str:
        """The structure's ``"empty"``, else ``"partial"`` (which keys are picked is not known on the host)."""
        kind = super().block_kind(q0, q1, k0, k1)
        return "empty" if kind == "empty" else "partial"

    def block_mask(self, q0: int, q1: int, k0: int, k1: int, device: torch.device) -> torch.Tensor:
        """``[B, 1, 1, bq, bk]`` boolean: visible and picked."""
        picks = self.indices[:, q0:q1].to(device=device, dtype=torch.long) - k0  # [B, bq, topk]
        width = k1 - k0
        picks = torch.where((picks >= 0) & (picks < width), picks, width)  # others -> a spare column
        picked = torch.zeros((*picks.shape[:2], width + 1), dtype=torch.bool, device=device)
        picked.scatter_(-1, picks, True)  # [B, bq, bk + 1]
        return super().block_mask(q0, q1, k0, k1, device) & picked[:, None, None, :, :width]
