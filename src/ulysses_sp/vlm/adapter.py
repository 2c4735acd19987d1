"""The SP data adapter for VLM batches: every rank of the group gets every batch whole.

``UlyssesSPDataLoaderAdapter`` (``data.adapter``) sends each rank only its ``S/P`` tokens of the
group's batches. A VLM batch cannot be cut before the model (``batch``'s docstring), so
``VLMDataLoaderAdapter`` keeps the adapter's round (each of the ``P`` ranks loads one batch; the
group works through the ``P`` batches one by one) but exchanges whole batches — token ids, pixels,
grids: one ``all_gather_object`` per round — and yields ``prepare_vlm_batch``'s inputs: the whole
sample and this rank's ``shift_labels [B, S_l]``, a Qwen batch's host layout attached to its ``input_ids``
(``layout.vlm_layout``: the merge and the tower read no device value); ``last_real_tokens`` counts each batch's real
tokens as the text adapter does (``data.adapter.real_tokens``). A bad batch on any rank raises on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ulysses_sp.data.adapter import _LAYOUT, REAL_TOKENS, UlyssesSPDataLoaderAdapter, real_tokens
from ulysses_sp.parallel.comm import all_gather_object, raise_if_any_rank_failed
from ulysses_sp.parallel.doc_layout import layout_of
from ulysses_sp.vlm.batch import prepare_vlm_batch
from ulysses_sp.vlm.families import vlm_parts
from ulysses_sp.vlm.layout import vlm_layout
from ulysses_sp.vlm.split import check_split


def vlm_round(
    adapter: UlyssesSPDataLoaderAdapter, it: Iterator[Any], model: Any
) -> list[dict[str, Any]] | None:
    """One round of ``adapter`` over VLM batches: this rank's inputs for each rank's batch (rank
    order), or ``None`` when every loader is exhausted."""
    batch, error = next(it, None), None

    def prepare(b: dict[str, Any]) -> dict[str, Any]:
        out = prepare_vlm_batch(model, b, sp_rank=adapter.sp_rank, sp_size=adapter.sp_world_size,
                                ring_size=adapter.ring_size, pad_token_id=adapter.pad_token_id)  # fmt: skip
        parts = vlm_parts(model)
        if parts.scatter is None and not parts.prefix:  # Qwen: the merge's and the tower's values as host values (vlm.layout)
            out[_LAYOUT] = vlm_layout(model.config, out, sp_rank=adapter.sp_rank, sp_size=adapter.sp_world_size,
                                      ring_size=adapter.ring_size or 1)  # fmt: skip
        else:  # Gemma 3's spans: re-attached after the move to the device
            layout = layout_of(out["position_ids"])
            if layout is not None:
                out[_LAYOUT] = layout
        return {**out, REAL_TOKENS: real_tokens(b)}  # the adapter's round pops both (last_real_tokens)

    if batch is not None:
        try:
            batch = {k: v.cpu() if hasattr(v, "cpu") else v for k, v in dict(batch).items()}
            if getattr(adapter, "require_split", False):  # VLMDataLoaderAdapter(require_split=True)
                check_split(batch, adapter.sp_world_size)
            prepare(batch)  # every check before the exchange
        except (ValueError, TypeError) as e:
            error = str(e)
    if adapter.sp_group is None:
        if error is not None:
            raise ValueError(error)
        return None if batch is None else [prepare(batch)]
    raise_if_any_rank_failed(error, adapter.sp_group)
    batches = all_gather_object(batch, adapter.sp_group)
    if all(b is None for b in batches):
        return None
    done = [r for r, b in enumerate(batches) if b is None]
    if done:
        raise ValueError(f"the SP group's loaders have different lengths: rank(s) {done} of the group ran out of "
                         "batches while the others had one; give every SP rank the same number of batches")  # fmt: skip
    return [prepare(b) for b in batches]


class VLMDataLoaderAdapter(UlyssesSPDataLoaderAdapter):
    """``UlyssesSPDataLoaderAdapter`` for a VLM (module docstring); ``model`` computes the positions;
    ``require_split``: every batch's frames must split over the group (``split.check_split``)."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any, *,
                 model: Any, pad_token_id: int = 0, ring_size: int | None = None,
                 require_split: bool = False) -> None:  # fmt: skip
        super().__init__(
            dl, sp_rank, sp_group, sp_world_size, device, pad_token_id=pad_token_id, ring_size=ring_size
        )
        self.model = model
        self.require_split = require_split
        """Refuse (on every rank of the group) a batch whose frames cannot be split over the group
        (``split.check_split``: ``--split-images on``)."""

    def _refill(self, it: Iterator[Any]) -> list[dict[str, Any]] | None:
        return vlm_round(self, it, self.model)
