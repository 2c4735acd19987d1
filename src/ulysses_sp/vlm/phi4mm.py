"""The per-shard merge of Phi-4-multimodal: its image and audio rows put into this rank's tokens only.

Phi-4-multimodal (``Phi4MultimodalForCausalLM``, ``families.PHI4_VLMS``) has no language model apart
from its towers: its decoder ``Phi4MultimodalModel`` embeds all ``S`` tokens, and its
``embed_tokens_extend`` (``VLMParts.media``) turns the batch's images (a SigLIP-style tower over each
image's crops, 2 x 2 average pooling, HD separator rows, an MLP projector) and audio clips (a conformer
over mel features, a projector) into ``N_v`` and ``N_a`` rows, which it writes (``index_put``) into the
``[B, S, Hd]`` embeddings at the image and audio tokens, in order; then the decoder layers run with 1-D
positions. Under SP, ``phi4_forward`` replaces the decoder's forward on each rank:

1. this rank's token indices (``merge.shard_index``) cut ``input_ids [B, S]`` and ``position_ids
   [B, S]`` (packed documents restart at 0; ``None``: ``arange(S)``);
2. the text embedding runs on the ``[B, S_l]`` ids only;
3. the model's own image embedding runs on **all** the batch's images, asked to write its rows into a
   ``[1, N_v, Hd]`` block of zeros at ``N_v`` placeholder ids: that block is exactly the ``[N_v, Hd]``
   rows its forward writes, in placeholder order. The row of each of this rank's placeholders is its
   rank among all the batch's (``merge.rows_by_rank``, from the ids alone); those ``[N_l, Hd]`` rows
   are scattered into the ``[B, S_l, Hd]`` embeddings. The audio rows likewise (with the model's
   projection: its ``vision`` one when the batch has images, else its ``speech`` one);
4. the decoder's own forward (its class's, not this replacement) runs on ``inputs_embeds [B, S_l, Hd]``
   and the shard's positions, with the Ulysses attention.

No ``[B, S, Hd]`` tensor exists on a rank; the largest media tensors are the batch's ``[N_v, Hd]`` and
``[N_a, Hd]`` rows. Each rank encodes every image and clip (their compute is repeated ``P`` times);
gradients reach both towers and projectors through this rank's rows only (the others get zero), and
summed over the SP group they are those of the model without SP. Two things of the model's own are
random in training: its ``embd_pdrop`` dropout (0 in the released config), applied here to every
position as the model does, with this rank's own mask; and the conformer's choice, on each call, of
whether to reverse its streaming chunks (``numpy``'s global generator): every rank encodes the same
audio only when the ranks of an SP group seed ``numpy`` alike.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``Hd`` hidden, ``N_v`` / ``N_a`` image
/ audio rows of the batch (one per placeholder), ``N_l`` this rank's, ``P`` sp size.
"""

from __future__ import annotations

from typing import Any

import torch

from ulysses_sp.vlm.families import VLMParts
from ulysses_sp.vlm.merge import check_inputs, rows_by_rank, shard_index
from ulysses_sp.vlm.scatter import full_positions


def media_rows(embedding: Any, token: int, n: int, like: torch.Tensor, what: str, **inputs: Any) -> torch.Tensor:
    """``[N, Hd]``: the rows ``embedding`` (the model's image or audio embedding) writes at ``n``
    placeholders ``token``, in order — its forward run on ``[1, N]`` placeholder ids and a zero block."""
    ids = torch.full((1, n), token, dtype=torch.long, device=like.device)  # [1, N]
    zeros = like.new_zeros(1, n, like.shape[-1])  # [1, N, Hd]
    try:
        return embedding(input_ids=ids, inputs_embeds=zeros, **inputs)[0]  # [1, N, Hd] -> [N, Hd]
    except RuntimeError as err:  # index_put of a row count that is not the placeholders'
        raise ValueError(
            f"the batch has {n} {what} placeholder tokens (id {token}) but its {what} inputs make a different "
            f"number of rows ({err}): the text must hold one placeholder per row, in order (build samples with "
            "the model's processor)"
        ) from err


def phi4_forward(parts: VLMParts, *, sp_rank: int, sp_size: int, ring_size: int) -> Any:
    """The replacement of ``parts.inner.forward`` for Phi-4-multimodal (module docstring)."""
    inner, media = parts.inner, parts.media
    assert media is not None
    image_token, audio_token = int(media.image_token_id), int(media.audio_token_id)
    decoder = type(inner).forward  # the class's forward: the decoder stack on inputs_embeds

    def forward(input_ids: torch.Tensor | None = None, attention_mask: Any = None,
                position_ids: torch.Tensor | None = None, cache: Any = None, inputs_embeds: Any = None,
                image_pixel_values: torch.Tensor | None = None, image_sizes: torch.Tensor | None = None,
                image_attention_mask: torch.Tensor | None = None, audio_input_features: torch.Tensor | None = None,
                audio_embed_sizes: Any = None, audio_attention_mask: Any = None, use_cache: bool | None = None,
                **kwargs: Any) -> Any:  # fmt: skip
        check_inputs(input_ids, attention_mask, inputs_embeds, None)
        b, s = input_ids.shape
        positions = full_positions(position_ids, b, s, input_ids.device)
        idx = shard_index(s, sp_rank, sp_size, ring_size, input_ids.device)
        embeds = inner.embed_tokens(input_ids.index_select(1, idx))  # [B, S_l] -> [B, S_l, Hd]
        kinds = []  # (placeholder token, rows [N, Hd], dropout): as the model, a modality with no tokens is skipped
        n_image, n_audio = int((input_ids == image_token).sum()), int((input_ids == audio_token).sum())
        if image_pixel_values is not None and n_image:
            rows = media_rows(media.image_embed, image_token, n_image, embeds, "image",
                              image_pixel_values=image_pixel_values, image_sizes=image_sizes,
                              image_attention_mask=image_attention_mask)  # fmt: skip
            kinds.append((image_token, rows, media.image_embed.drop))
        if audio_input_features is not None and n_audio:
            mode = "vision" if image_pixel_values is not None else "speech"
            rows = media_rows(media.audio_embed, audio_token, n_audio, embeds, "audio",
                              audio_input_features=audio_input_features, audio_embed_sizes=audio_embed_sizes,
                              audio_attention_mask=audio_attention_mask, audio_projection_mode=mode)  # fmt: skip
            kinds.append((audio_token, rows, media.audio_embed.drop))
        if kinds:
            embeds = kinds[-1][2](embeds)  # the text positions' dropout (the rows had theirs): every position's
        for token, rows, _ in kinds:
            full = input_ids == token  # [B, S]: this modality's placeholders in the whole batch
            mine = rows_by_rank(full, [idx])[0]  # [N_l] rows of this shard's placeholders among all
            local = full.index_select(1, idx)  # [B, S] -> [B, S_l]
            embeds = embeds.masked_scatter(local[..., None], rows.index_select(0, mine).to(embeds.dtype))
        return decoder(
            inner,
            input_ids=None,
            attention_mask=None,
            position_ids=positions.index_select(1, idx.to(positions.device)),  # [B, S] -> [B, S_l]
            cache=cache,
            inputs_embeds=embeds,
            use_cache=use_cache,
            **kwargs,
        )

    return forward
