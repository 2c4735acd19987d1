"""A tiny Gemma 3n (``Gemma3nForConditionalGeneration``: transformers' own code, config built locally, fp32,
weights at std 0.2) and samples with images and audio clips for the SP tests.

The vision tower is a tiny SigLIP in place of the real timm MobileNet-V5 (timm needs torchvision, which does
not load beside this CPU torch); what the SP path touches — ``get_image_features`` giving 16 soft tokens an
image, scattered at the image placeholders — is the same. The media vocabularies sit inside the 128 ids as
the real model's do above its text vocabulary: vision ids 100-103 (``<eoi>`` 101, image placeholder 102),
audio ids 104-127 (``<eoa>`` 104, audio placeholder 105; the audio padding embedding is that of the last
text id, 127), the per-layer embedding table below them (an id from 100 on reads its row 0)."""

from __future__ import annotations

import torch

BOI, EOI, IMAGE, BOA, EOA, AUDIO = 100, 101, 102, 103, 104, 105
IMAGE_TOKENS, AUDIO_TOKENS, FRAMES = 16, 6, 64
"""Soft tokens an image (32 px, 8 px patches) and an audio clip (64 mel frames give 4; padded to 6)."""


def tiny_gemma3n(seed: int = 0, std: float = 0.2):
    """The tiny ``Gemma3nForConditionalGeneration`` (module docstring), 4 decoder layers (2 sharing KV), train mode."""
    from transformers import AutoConfig, Gemma3nForConditionalGeneration, SiglipVisionConfig

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_hidden_layers=4, pad_token_id=0, bos_token_id=2, eos_token_id=1, sliding_window=8,
                vocab_size_per_layer_input=100, hidden_size_per_layer_input=16, num_kv_shared_layers=2, laurel_rank=8,
                layer_types=["sliding_attention", "full_attention"] * 2)  # fmt: skip
    audio = dict(hidden_size=32, conf_num_attention_heads=2, conf_num_hidden_layers=1, sscp_conv_channel_size=[16, 8],
                 input_feat_size=16, vocab_offset=104, vocab_size=24)  # fmt: skip
    config = AutoConfig.for_model("gemma3n", text_config=text, audio_config=audio, vision_soft_tokens_per_image=16,
                                  audio_soft_tokens_per_image=AUDIO_TOKENS, boi_token_id=BOI, eoi_token_id=EOI,
                                  image_token_id=IMAGE, boa_token_id=BOA, eoa_token_id=EOA, audio_token_id=AUDIO)  # fmt: skip
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8, vocab_size=4, vocab_offset=100, rms_norm_eps=1e-6)  # fmt: skip
    object.__setattr__(config, "vision_config", vision)  # past the config's type check (a timm config by default)
    torch.manual_seed(seed)
    model = Gemma3nForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std) if p.dim() >= 2 else p.normal_(1.0, 0.1)
    return model.float().train()


def gemma3n_sample(spec: list, seed: int = 0) -> dict[str, torch.Tensor]:
    """One document from ``spec``: ints are runs of text tokens, ``"image"`` / ``"audio"`` one image / clip
    between its begin and end markers. Returns ``input_ids [1, S]``, ``pixel_values [N_img, 3, 32, 32]``,
    ``input_features [N_clip, 64, 16]`` and ``input_features_mask [N_clip, 64]`` (True: a valid frame; each clip's
    last frames padding, so the tower pads some of its soft tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    images, clips = [], []
    for part in spec:
        if isinstance(part, int):
            ids += torch.randint(3, 100, (part,), generator=g).tolist()
        elif part == "image":
            ids += [BOI, *[IMAGE] * IMAGE_TOKENS, EOI]
            images.append(torch.randn(3, 32, 32, generator=g))
        else:
            ids += [BOA, *[AUDIO] * AUDIO_TOKENS, EOA]
            clips.append(torch.randn(FRAMES, 16, generator=g))
    out = {"input_ids": torch.tensor([ids])}
    if images:
        out["pixel_values"] = torch.stack(images)
    if clips:
        out["input_features"] = torch.stack(clips)
        valid = [FRAMES - 20 - 16 * (i % 2) for i in range(len(clips))]  # the last 1 or 2 soft tokens padding
        out["input_features_mask"] = torch.stack([torch.arange(FRAMES) < v for v in valid])
    return out


def gemma3n_join(docs: list[dict[str, torch.Tensor]], *, packed: bool) -> dict[str, torch.Tensor]:
    """Documents of one length as a ``[B, S]`` batch (``packed=False``), or packed into one row with
    ``position_ids`` restarting at 0 at each; their images and clips concatenated in the same order."""
    ids = [d["input_ids"] for d in docs]
    row = {"input_ids": torch.cat(ids, dim=1 if packed else 0)}
    if packed:
        row["position_ids"] = torch.cat([torch.arange(i.shape[1]) for i in ids])[None]
    for key in ("pixel_values", "input_features", "input_features_mask"):
        if any(key in d for d in docs):
            row[key] = torch.cat([d[key] for d in docs if key in d])
    return row


def gemma3n_labels(ids: torch.Tensor) -> torch.Tensor:
    """Train on the text tokens: every media id (placeholders and markers, 100 on) ``-100``."""
    return ids.masked_fill(ids >= BOI, -100)
