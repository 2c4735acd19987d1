"""The per-shard forward of a prefix VLM (GIT): the image's tokens prepended to the text, cut per rank.

Without SP, ``GitModel.forward`` embeds the ``S`` text tokens (word + learned absolute positions
``0..S-1``, LayerNorm), runs its CLIP tower and ``visual_projection`` on the image (or on each frame of
a ``[B, F, C, H, W]`` video, with the frame's temporal embedding), **prepends** those ``N`` rows to the
text, and runs its BERT-style encoder over the ``T = N + S`` tokens with a mask where the image tokens
attend to each other in both directions and every text token causally to the text before it and to
the whole image. Its logits cover all ``T`` positions; the logit at ``N + i`` predicts text token ``i + 1``.

Under SP the global sequence is the model's own ``T = N + S``, split in ``P`` equal contiguous shards
(``prepare_prefix_batch`` pads the text on the right so that ``T % P == 0``: pad ids, labels ``-100``);
the image prefix may straddle any number of shard boundaries. ``prefix_forward`` replaces the forward on
each rank:

1. the tower and projection run on the batch's whole image on every rank (``[B, N, h]``: the tower's
   compute is repeated ``P`` times, as in ``scatter``); this rank keeps its rows of the prefix;
2. the text embedding runs on this rank's text tokens only, with their **global** text positions;
3. the encoder runs on ``[B, T_l, h]``; its self-attention is run head-parallel over the full ``T`` by
   ``mixers/prefix_attention.py`` (``apply_mixers``), told the prefix length ``N`` through
   ``PREFIX_KWARG`` (a host int), with the model's mask ``key <= query or key < N``.

Gradients reach the tower and projection through this rank's prefix rows (zero for the others); summed
over the group they are those of the model without SP. ``shift_labels [B, T_l]``: ``-100`` over the
prefix, then the text's next tokens (``T``-long before the cut). Not taken: packed rows (``position_ids``
that restart: GIT prepends one image to a whole row), an ``attention_mask``, ``inputs_embeds``, a cache,
the ring's zigzag order.

Shape legend: ``B`` batch, ``S`` text tokens, ``N`` image prefix tokens, ``T = N + S`` global sequence,
``T_l = T/P``, ``h`` hidden, ``P`` sp size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ulysses_sp.vlm.families import VLMParts
from ulysses_sp.vlm.merge import check_inputs

PREFIX_KWARG = "ulysses_sp_prefix_tokens"
"""The keyword ``prefix_forward`` passes through the encoder to its self-attention: ``N`` (host int)."""


def prefix_tokens(config: Any, pixel_values: torch.Tensor | None) -> int:
    """``N``: the image tokens GIT prepends for ``pixel_values`` (``[B, C, H, W]`` or ``[B, F, C, H, W]``;
    ``None``: 0), from the shapes alone: ``(H/p) * (W/p) + 1`` a frame (CLIP's patches and class token)."""
    if pixel_values is None:
        return 0
    if pixel_values.dim() not in (4, 5):
        raise ValueError(f"GIT takes pixel_values [B, C, H, W] or [B, F, C, H, W], got {tuple(pixel_values.shape)}")
    patch = config.vision_config.patch_size
    frames = pixel_values.shape[1] if pixel_values.dim() == 5 else 1
    return frames * ((pixel_values.shape[-2] // patch) * (pixel_values.shape[-1] // patch) + 1)


def prepare_prefix_batch(parts: VLMParts, batch: Mapping[str, Any], *, sp_rank: int, sp_size: int,
                         ring_size: int = 1, pad_token_id: int = 0) -> dict[str, Any]:  # fmt: skip
    """One rank's inputs from a full GIT batch (``input_ids [B, S]``, ``pixel_values``, optional ``labels``):
    the whole text padded so that ``N + S`` divides by ``P``, ``position_ids [B, S]``, ``pixel_values``, and this
    rank's ``shift_labels [B, T_l]`` (module docstring). Raises ``ValueError`` for what the path does not take."""
    if ring_size > 1:
        raise ValueError(f"GIT under sequence parallelism takes the plain Ulysses layout (ring_size 1), got {ring_size}")
    ids = batch["input_ids"]
    b, s = ids.shape
    unknown = sorted(set(batch) - {"input_ids", "pixel_values", "labels", "position_ids", "attention_mask"})
    if unknown:
        raise ValueError(f"GIT under sequence parallelism takes input_ids, pixel_values, labels and position_ids; got also {unknown}")
    pos = batch.get("position_ids")
    if pos is not None and not torch.equal(pos.cpu(), torch.arange(s).expand(b, s)):
        raise ValueError("GIT prepends its image to the whole row, so a row packs no documents: pass position_ids "
                         "0..S-1 (or none), one sample a row")  # fmt: skip
    pixels = batch.get("pixel_values")
    n = prefix_tokens(parts.inner.config, pixels)
    pad = -(n + s) % sp_size  # text padded on the right: N + S a multiple of P
    labels = batch.get("labels", ids)
    ids, labels = F.pad(ids, (0, pad), value=pad_token_id), F.pad(labels, (0, pad), value=-100)
    shift = F.pad(labels[:, 1:], (n, 1), value=-100)  # [B, S] -> [B, N + S]: the prefix predicts nothing
    t_l = shift.shape[1] // sp_size
    out = {"input_ids": ids, "position_ids": torch.arange(s + pad).expand(b, s + pad).clone(),
           "shift_labels": shift[:, sp_rank * t_l : (sp_rank + 1) * t_l]}  # fmt: skip
    return out if pixels is None else {**out, "pixel_values": pixels}


def _visual(inner: Any, pixel_values: torch.Tensor, interpolate: bool, batch: int) -> torch.Tensor:
    """``[B, N, h]``: the projected image (or frames) tokens, as ``GitModel.forward`` makes them."""
    if pixel_values.dim() == 4:
        feats = inner.image_encoder(pixel_values, interpolate_pos_encoding=interpolate).last_hidden_state
    else:  # [B, F, C, H, W]: each frame, plus its temporal embedding, along the sequence
        frames = [inner.image_encoder(pixel_values[:, f], interpolate_pos_encoding=interpolate).last_hidden_state
                  + inner.img_temporal_embedding[f] for f in range(pixel_values.shape[1])]  # fmt: skip
        feats = torch.cat(frames, dim=1)
    projected = inner.visual_projection(feats)  # [B_img, N, h]
    return projected.repeat(batch // projected.shape[0], 1, 1)  # the model's repeat to the text batch


def prefix_forward(parts: VLMParts, *, sp_rank: int, sp_size: int, ring_size: int) -> Any:
    """The replacement of ``GitModel.forward`` on SP rank ``sp_rank`` (module docstring)."""
    inner = parts.inner
    if ring_size > 1:
        raise ValueError(f"GIT under sequence parallelism takes the plain Ulysses layout (ring_size 1), got {ring_size}")

    def forward(input_ids: torch.Tensor | None = None, attention_mask: Any = None,
                position_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                inputs_embeds: Any = None, cache: Any = None, use_cache: bool | None = None,
                interpolate_pos_encoding: bool = False, **kwargs: Any) -> Any:  # fmt: skip
        check_inputs(input_ids, attention_mask, inputs_embeds, None)
        attention = [m for m in parts.language_model.modules() if hasattr(m, "image_patch_tokens")]
        if not all(getattr(vars(m).get("forward"), "ulysses_sp_mixer", False) for m in attention):
            raise ValueError("GIT's self-attention must run head-parallel over the full sequence with its image prefix: call "
                             "ulysses_sp.mixers.apply.apply_mixers(model, mesh) (initialize and prepare do)")  # fmt: skip
        if cache is not None or use_cache:
            raise ValueError("GIT under sequence parallelism runs without a cache: pass use_cache=False")
        b, s = input_ids.shape
        visual = None if pixel_values is None else _visual(inner, pixel_values, interpolate_pos_encoding, b)
        n = 0 if visual is None else visual.shape[1]
        if (n + s) % sp_size:
            raise ValueError(f"GIT's sequence is its {n} image tokens + {s} text tokens = {n + s}, not a multiple of "
                             f"sp_size {sp_size}: pad the text on the right (prepare_vlm_batch does)")  # fmt: skip
        t_l = (n + s) // sp_size
        lo, hi = sp_rank * t_l, (sp_rank + 1) * t_l  # this rank's [lo, hi) of the T tokens
        pieces = [] if lo >= n else [visual[:, lo : min(hi, n)]]  # [B, <=T_l, h]: its rows of the prefix
        if hi > n:  # its text tokens, at their global text positions
            a, e = max(lo, n) - n, hi - n
            pos = torch.arange(a, e, device=input_ids.device)[None] if position_ids is None else position_ids[:, a:e]
            pieces.append(inner.embeddings(input_ids=input_ids[:, a:e], position_ids=pos))
        hidden = torch.cat([p.to(pieces[-1].dtype) for p in pieces], dim=1)  # [B, T_l, h]
        out = parts.language_model(hidden, attention_mask=None, cache=None, **{PREFIX_KWARG: n}, **kwargs)
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=out.last_hidden_state, cache=None)

    return forward
