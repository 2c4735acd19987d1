"""Gemma 3n's per-shard merge: this rank's ``[B, S_l, Hd]`` input and per-layer inputs from its own tokens.

Without SP, ``Gemma3nModel.forward`` (transformers 5.24) builds the language model's two inputs from
all ``S`` token ids, then merges its towers' soft tokens:

1. ``inputs_embeds``: the text embedding of every id, replaced by the vision embedder's hard embedding
   where the id lies in the vision vocabulary (``[embed_vision.vocab_offset, embed_audio.vocab_offset)``:
   the image placeholder and the end-of-image marker) and by the audio embedder's at or above
   ``embed_audio.vocab_offset`` (the audio placeholder, end of audio);
2. ``per_layer_inputs [B, S, L, Hp]``: the per-layer embedding of every id, an id outside its table
   (``vocab_size_per_layer_input``: every media id) taken as id 0;
3. the image soft tokens (``get_image_features``: tower + ``embed_vision``, ``[N_img, T_img, Hd]``)
   scattered at the image placeholders in order (``masked_scatter``);
4. when ``input_features`` and ``input_features_mask`` are both given, the audio soft tokens
   (``get_audio_features``: conformer + ``embed_audio``), the frames the tower marks as padding and
   the tail up to ``audio_soft_tokens_per_image`` filled with the audio embedding of the last text id,
   ``[N_a, T_aud, Hd]``, scattered at the audio placeholders in order.

Steps 1-2 are token-local; 3-4 are the LLaVA-style scatter (``scatter``). Under SP,
``gemma3n_forward`` replaces that forward on each rank: steps 1-2 on the rank's ``[B, S_l]`` ids
(``merge.shard_index``), both towers on **all** the batch's images and clips (each rank repeats the
towers' compute, as ``scatter`` does), and only the rows of this shard's placeholders
(``merge.rows_by_rank``, from the ids alone) scattered; the language model then runs on ``S_l``
tokens with the Ulysses attention, given the shard's per-layer inputs and positions (recorded as the
SP attention's call positions, as ``scatter`` does; its mask stays causal: the model builds no
bidirectional span). Gradients reach both towers and both embedders through this
rank's rows only; summed over the SP group they are those of the model without SP.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``Hd`` hidden, ``L`` decoder layers,
``Hp`` per-layer input width, ``N_v`` / ``N_a`` image / audio rows of the batch (one per placeholder),
``P`` sp size.
"""

from __future__ import annotations

from typing import Any

import torch

from ulysses_sp.vlm.families import VLMParts
from ulysses_sp.vlm.merge import check_inputs, rows_by_rank, shard_index
from ulysses_sp.vlm.scatter import full_positions, image_rows, local_positions, record_call_positions


def shard_embeddings(inner: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-2 of the module docstring on ``ids [B, S_l]``: ``([B, S_l, Hd], [B, S_l, L, Hp])``."""
    embeds = inner.get_input_embeddings()(ids)  # [B, S_l] -> [B, S_l, Hd]
    per_layer = inner.language_model.get_per_layer_inputs(ids)  # [B, S_l] -> [B, S_l, L, Hp]
    vision, audio = inner.embed_vision, inner.embed_audio
    for embedder, mask in (
        (vision, (ids >= vision.vocab_offset) & (ids < audio.vocab_offset)),
        (audio, ids >= audio.vocab_offset),
    ):
        dummy = embedder.vocab_offset + embedder.vocab_size - 1  # the model's own filler id for the other tokens
        hard = embedder(input_ids=torch.where(mask, ids, dummy)).to(embeds.device, embeds.dtype)  # [B, S_l, Hd]
        embeds = torch.where(mask[..., None], hard, embeds)
    return embeds, per_layer


def audio_rows(inner: Any, features: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[N_a, Hd]`` the batch's audio soft tokens in placeholder order, padded as the model's forward pads them."""
    out = inner.get_audio_features(features, ~valid, return_dict=True)
    feats, padded = out.pooler_output, out.audio_mel_mask  # [N_clip, T, Hd], [N_clip, T] (True: padding)
    fill = inner.embed_audio(input_ids=torch.tensor([[inner.vocab_size - 1]], device=feats.device))  # [1, 1, Hd]
    feats = torch.where(padded[..., None], fill, feats)
    n, t, hd = feats.shape
    extra = int(inner.config.audio_soft_tokens_per_image) - t
    if extra < 0:
        raise ValueError(
            f"the audio tower gives {t} soft tokens a clip but audio_soft_tokens_per_image is "
            f"{inner.config.audio_soft_tokens_per_image}: shorten the clips' input_features"
        )
    feats = torch.cat((feats, fill.expand(n, extra, hd)), dim=1)  # [N_clip, T_aud, Hd]
    return feats.reshape(-1, hd)  # [N_clip, T_aud, Hd] -> [N_a, Hd]: masked_scatter's order


def _scatter(embeds: torch.Tensor, ids: torch.Tensor, token: int, idx: torch.Tensor, rows: torch.Tensor,
             what: str) -> torch.Tensor:  # fmt: skip
    """``embeds [B, S_l, Hd]`` with this shard's rows of ``rows [N, Hd]`` at its placeholders (``ids [B, S] == token``)."""
    full = ids == token  # [B, S]: the placeholders of the whole batch
    if rows.shape[0] != int(full.sum()):
        raise ValueError(
            f"the batch has {int(full.sum())} {what} placeholder tokens (id {token}) but its {what} inputs make "
            f"{rows.shape[0]} soft tokens: the text must hold one placeholder per soft token, in order (build "
            "samples with the model's processor)"
        )
    mine = rows_by_rank(full, [idx])[0]  # [N_l] rows of this shard's placeholders among all
    local = full.index_select(1, idx)  # [B, S] -> [B, S_l]
    return embeds.masked_scatter(local[..., None], rows.index_select(0, mine).to(embeds.device, embeds.dtype))


def gemma3n_forward(parts: VLMParts, *, sp_rank: int, sp_size: int, ring_size: int) -> Any:
    """The replacement of ``Gemma3nModel.forward`` under SP (module docstring)."""
    inner = parts.inner
    image, audio = int(inner.config.image_token_id), int(inner.config.audio_token_id)

    def forward(input_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                input_features: torch.Tensor | None = None, attention_mask: Any = None,
                input_features_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cache: Any = None, token_type_ids: Any = None, inputs_embeds: Any = None,
                per_layer_inputs: Any = None, use_cache: bool | None = None, mm_encoder_outputs: Any = None,
                labels: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        check_inputs(input_ids, attention_mask, inputs_embeds, mm_encoder_outputs)
        if per_layer_inputs is not None:
            raise ValueError("Gemma 3n under sequence parallelism builds per_layer_inputs from input_ids; drop them")
        b, s = input_ids.shape
        positions = full_positions(position_ids, b, s, input_ids.device)
        idx = shard_index(s, sp_rank, sp_size, ring_size, input_ids.device)
        embeds, per_layer = shard_embeddings(inner, input_ids.index_select(1, idx))
        if pixel_values is not None:
            rows = image_rows(parts, pixel_values, embeds.dtype, {})  # [N_v, Hd]
            embeds = _scatter(embeds, input_ids, image, idx, rows, "image")
        if input_features is not None and input_features_mask is not None:
            rows = audio_rows(inner, input_features, input_features_mask)  # [N_a, Hd]
            embeds = _scatter(embeds, input_ids, audio, idx, rows, "audio")
        local_pos = local_positions(positions, idx, False, None)  # [B, S] -> [B, S_l] (a host layout kept)
        record_call_positions(local_pos)  # the SP attention's call positions: this shard's (``scatter``, step 4)
        outputs = parts.language_model(
            input_ids=None,
            per_layer_inputs=per_layer,
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
