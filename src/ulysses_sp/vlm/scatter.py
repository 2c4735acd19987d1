"""The per-shard merge of a LLaVA-style VLM: this rank's ``[B, S_l, Hd]`` input from its own tokens.

Without SP, a LLaVA-style model's forward (``LlavaModel``, ``GotOcr2Model``, ``Mistral3Model``,
``AyaVisionModel``, ``InternVLModel``, ``FuyuModel``: ``families.SCATTER_VLMS``) embeds all ``S`` tokens, runs
``get_image_features`` (vision tower + projector; Fuyu: one linear projection of the raw patch rows
``[N_img, T, C*p*p]``) on the batch's images, scatters the ``N_v``
feature rows into the ``[B, S, Hd]`` embeddings at the image placeholder tokens, in order
(``masked_scatter``), and calls its language model with 1-D positions. Under SP,
``scatter_forward`` replaces that forward on each rank:

1. this rank's token indices (``merge.shard_index``) cut ``input_ids [B, S]`` and
   ``position_ids [B, S]`` (packed documents restart at 0; ``None``: ``arange(S)``);
2. the text embedding runs on the ``[B, S_l]`` ids only;
3. the model's own ``get_image_features`` runs on **all** the batch's images (with the family's
   keyword arguments, ``ScatterFamily.image_kwargs``) and gives ``[N_v, Hd]`` rows in placeholder
   order; the row of each of this rank's placeholders is its rank among all the batch's
   placeholders (``merge.rows_by_rank``, from the ids alone), and only those ``[N_l, Hd]`` rows are
   scattered into the ``[B, S_l, Hd]`` embeddings;
4. the language model runs on ``S_l`` tokens with the Ulysses attention, given this shard's positions
   ``[B, S_l]``; they are also recorded as the forward's call positions on the SP attention
   (``attention.positions``), for decoders whose layers do not pass ``position_ids`` on to their
   attention (Fuyu's Persimmon): the registration's hook recorded the VLM's call, whose ``[B, S]``
   positions are the full sample's, not this shard's. The next forward's hook records anew.

A family whose own mask makes each image's tokens see each other (Gemma 3's ``token_type_ids``,
``ScatterFamily.spans_key``) gets that input consumed here, not passed to its language model: the
runs are the host layout's spans, found once per batch on the host from the full ``[B, S]`` types
(``batch.prepare_vlm_batch``) and attached to the full positions; this forward attaches the same
layout to its ``[B, S_l]`` cut, where every rank's SP attention reads it (``attention/span_mask.py``:
full and sliding layers alike). The types given without such a layout are refused (the mask would
silently be causal over the images). An image token outside the text vocabulary is embedded as id 0
before its row replaces it, as Gemma 3's forward does.

No tensor of ``[B, S, Hd]`` exists on a rank; the largest visual tensor is the batch's ``[N_v, Hd]``
features. Each rank encodes every image (the split of the tower's work over the group, ``split``,
is Qwen-specific: its tower takes patch rows and grids, not images), so the tower's compute is
repeated ``P`` times — a rank's shard touches only some images, but a LLaVA-style tower maps an
image to a family-specific number of rows (Pixtral's ``image_sizes``, tiles) that this path does
not model. Gradients reach the tower and projector through this rank's rows only (the other rows
get zero); summed over the SP group, as every gradient is, they are those of the model without SP.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``Hd`` hidden, ``N_v`` image rows of
the batch (one per placeholder), ``N_l`` this rank's, ``P`` sp size.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ulysses_sp.attention.positions import CallPositions
from ulysses_sp.attention.registration import ATTN_NAME
from ulysses_sp.parallel.doc_layout import attach_layout, layout_of
from ulysses_sp.vlm.families import VLMParts
from ulysses_sp.vlm.layout import rows_by_rank, shard_index
from ulysses_sp.vlm.merge import check_inputs


def full_positions(position_ids: torch.Tensor | None, b: int, s: int, device: Any) -> torch.Tensor:
    """``[B, S]`` text positions of the full sample (``None``: ``arange(S)``), checked."""
    if position_ids is None:
        return torch.arange(s, device=device).repeat(b, 1)
    if tuple(position_ids.shape) != (b, s):
        raise ValueError(
            f"a LLaVA-style VLM under sequence parallelism takes position_ids [B, S] = [{b}, {s}] over the full "
            f"sequence (packed documents restarting at 0), got {tuple(position_ids.shape)}"
        )
    layout = layout_of(position_ids)
    if layout is not None and layout.seq_len != s:  # the text adapter's shard: S_l of the layout's S tokens
        raise ValueError(
            f"a VLM under sequence parallelism takes the full sample on every rank, got one shard's inputs ({s} of "
            f"{layout.seq_len} tokens, as UlyssesSPDataLoaderAdapter yields them): feed it through "
            "VLMDataLoaderAdapter (or ulysses_sp.vlm.prepare_vlm_batch)"
        )
    return position_ids


def record_call_positions(positions: torch.Tensor) -> None:
    """This shard's ``[B, S_l]`` positions as the forward's call positions on the SP attention (step 4)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = ALL_ATTENTION_FUNCTIONS.get(ATTN_NAME)
    if hasattr(attention, "call"):  # registered (a plain core attention keeps no positions)
        attention.call = CallPositions(given=True, source=weakref.ref(positions))


def local_positions(positions: torch.Tensor, idx: torch.Tensor, spans: bool, key: str | None) -> torch.Tensor:
    """``[B, S] -> [B, S_l]``: this rank's positions, carrying the full positions' host layout (if any: the
    bidirectional spans travel in it). ``spans``: the ``key`` input was given, so the layout must hold spans."""
    layout = layout_of(positions)
    local = positions.index_select(1, idx.to(positions.device))
    if spans and (layout is None or layout.spans is None):
        raise ValueError(
            f"the model was given {key}: its own mask makes each image's tokens attend to each other, and under "
            "sequence parallelism those spans travel as host values with the full position_ids. Build the rank's "
            "inputs with ulysses_sp.vlm.prepare_vlm_batch (it finds them on the host), or attach "
            f"host_layout(position_ids, spans=bidirectional_spans({key})) (ulysses_sp.parallel.doc_layout."
            "attach_layout) to the full position_ids"
        )
    return local if layout is None else attach_layout(local, layout)


def image_rows(parts: VLMParts, pixel_values: torch.Tensor, dtype: torch.dtype, kwargs: dict[str, Any]) -> torch.Tensor:
    """``[N_v, Hd]`` the batch's image features in placeholder order, as the model's forward makes them."""
    assert parts.scatter is not None
    if parts.scatter.cast_pixels:
        pixel_values = pixel_values.to(dtype)
    out = parts.inner.get_image_features(pixel_values=pixel_values, **kwargs, return_dict=True)
    pooled = getattr(out, parts.scatter.features)  # [N_img, T, Hd] (Fuyu's [N_v, Hd] too), or a list of [T_i, Hd]
    if isinstance(pooled, (list, tuple)):
        return torch.cat(list(pooled), dim=0)
    return pooled.reshape(-1, pooled.shape[-1])  # [N_img, T, Hd] -> [N_v, Hd]: masked_scatter's order


def scatter_forward(parts: VLMParts, *, sp_rank: int, sp_size: int, ring_size: int) -> Any:
    """The replacement of ``parts.inner.forward`` for a LLaVA-style family (module docstring)."""
    inner, family = parts.inner, parts.scatter
    assert family is not None
    token = int(inner.config.image_token_id)

    def forward(input_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                attention_mask: Any = None, position_ids: torch.Tensor | None = None, cache: Any = None,
                inputs_embeds: Any = None, use_cache: bool | None = None, mm_encoder_outputs: Any = None,
                **kwargs: Any) -> Any:  # fmt: skip
        check_inputs(input_ids, attention_mask, inputs_embeds, mm_encoder_outputs)
        image_kwargs = {k: kwargs.pop(k) for k in family.image_kwargs if k in kwargs}
        types = kwargs.pop(family.spans_key, None) if family.spans_key else None  # [B, S]: in the layout's spans
        b, s = input_ids.shape
        positions = full_positions(position_ids, b, s, input_ids.device)
        idx = shard_index(s, sp_rank, sp_size, ring_size, input_ids.device)
        local_pos = local_positions(positions, idx, types is not None, family.spans_key)  # [B, S] -> [B, S_l]
        embed = inner.get_input_embeddings()
        ids = input_ids.index_select(1, idx)  # [B, S] -> [B, S_l]
        if token >= getattr(embed, "num_embeddings", token + 1):  # out of the vocabulary: id 0 (its row replaces it)
            ids = ids.masked_fill(ids == token, 0)
        embeds = embed(ids)  # [B, S_l] -> [B, S_l, Hd]
        full = input_ids == token  # [B, S]: the placeholders of the whole batch
        if pixel_values is not None:
            rows = image_rows(parts, pixel_values, embeds.dtype, image_kwargs)  # [N_v, Hd]
            if rows.shape[0] != int(full.sum()):
                raise ValueError(
                    f"the batch has {int(full.sum())} image placeholder tokens (id {token}) but its "
                    f"{pixel_values.shape[0]} image(s) make {rows.shape[0]} feature rows: the text must hold one "
                    "placeholder per row, in image order (build samples with the model's processor)"
                )
            mine = rows_by_rank(full, [idx])[0]  # [N_l] rows of this shard's placeholders among all
            local = full.index_select(1, idx)  # [B, S] -> [B, S_l]
            embeds = embeds.masked_scatter(local[..., None], rows.index_select(0, mine).to(embeds.device, embeds.dtype))
        record_call_positions(local_pos)
        outputs = parts.language_model(
            input_ids=None,
            position_ids=local_pos,
            attention_mask=None,
            cache=cache,
            inputs_embeds=embeds,
            use_cache=use_cache,
            **kwargs,
        )
        from transformers.modeling_outputs import MultimodalBaseModelOutputWithPast

        return MultimodalBaseModelOutputWithPast(**outputs)

    return forward
