"""The per-shard merge of a LLaVA-style VLM: this rank's ``[B, S_l, Hd]`` input from its own tokens.

Without SP, a LLaVA-style model's forward (``LlavaModel``, ``GotOcr2Model``, ``Mistral3Model``,
``AyaVisionModel``, ``InternVLModel``: ``families.SCATTER_VLMS``) embeds all ``S`` tokens, runs
``get_image_features`` (vision tower + projector) on the batch's images, scatters the ``N_v``
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
4. the language model runs on ``S_l`` tokens with the Ulysses attention.

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

from typing import Any

import torch

from ulysses_sp.vlm.families import VLMParts
from ulysses_sp.vlm.layout import rows_by_rank, shard_index
from ulysses_sp.vlm.merge import check_inputs


def _positions(position_ids: torch.Tensor | None, b: int, s: int, device: Any) -> torch.Tensor:
    """``[B, S]`` text positions of the full sample (``None``: ``arange(S)``), checked."""
    if position_ids is None:
        return torch.arange(s, device=device).repeat(b, 1)
    if tuple(position_ids.shape) != (b, s):
        raise ValueError(
            f"a LLaVA-style VLM under sequence parallelism takes position_ids [B, S] = [{b}, {s}] over the full "
            f"sequence (packed documents restarting at 0), got {tuple(position_ids.shape)}"
        )
    return position_ids


def image_rows(parts: VLMParts, pixel_values: torch.Tensor, dtype: torch.dtype, kwargs: dict[str, Any]) -> torch.Tensor:
    """``[N_v, Hd]`` the batch's image features in placeholder order, as the model's forward makes them."""
    assert parts.scatter is not None
    if parts.scatter.cast_pixels:
        pixel_values = pixel_values.to(dtype)
    out = parts.inner.get_image_features(pixel_values=pixel_values, **kwargs, return_dict=True)
    pooled = out.pooler_output  # [N_img, T, Hd], or a list of [T_i, Hd] (per-image sizes)
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
        b, s = input_ids.shape
        positions = _positions(position_ids, b, s, input_ids.device)
        idx = shard_index(s, sp_rank, sp_size, ring_size, input_ids.device)
        embeds = inner.get_input_embeddings()(input_ids.index_select(1, idx))  # [B, S_l] -> [B, S_l, Hd]
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
        outputs = parts.language_model(
            input_ids=None,
            position_ids=positions.index_select(1, idx.to(positions.device)),  # [B, S] -> [B, S_l]
            attention_mask=None,
            cache=cache,
            inputs_embeds=embeds,
            use_cache=use_cache,
            **kwargs,
        )
        from transformers.modeling_outputs import MultimodalBaseModelOutputWithPast

        return MultimodalBaseModelOutputWithPast(**outputs)

    return forward
