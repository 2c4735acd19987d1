"""Tiny LLaVA-style vision-language models and samples for tests: transformers' own code (LLaVA,
GOT-OCR2, Mistral 3, Aya Vision, InternVL, Fuyu, Gemma 3), configs built locally (nothing downloaded), fp32, weights
at std 0.2 so one wrong row shows. Each image is ``TOKENS[family]`` placeholder tokens."""

from __future__ import annotations

import torch

VOCAB, IMAGE = 128, 120
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2)
FAMILIES = ("llava", "got_ocr2", "mistral3", "aya_vision", "internvl", "fuyu")
TOKENS = {"llava": 16, "got_ocr2": 16, "mistral3": 4, "aya_vision": 4, "internvl": 4, "fuyu": 16, "gemma3": 16}
"""Placeholder tokens per (16 x 16, GOT-OCR2 64 x 64) image of the tiny models below."""
PIXELS = {"got_ocr2": 64}


def _config(family: str):
    from transformers import AutoConfig

    text = {"model_type": "llama", **TEXT}
    if family == "llava":  # CLIP tower (16 px, 4 px patches: 16 patches + CLS, CLS dropped), MLP projector
        vision = {"model_type": "clip_vision_model", **VISION, "image_size": 16, "patch_size": 4, "projection_dim": 32}
        return AutoConfig.for_model("llava", vision_config=vision, text_config=text, image_token_id=IMAGE,
                                    vision_feature_layer=-1)  # fmt: skip
    if family == "got_ocr2":  # SAM-style windowed tower + conv neck, two stride-2 convs: 16 x 16 patches -> 4 x 4
        vision = {"hidden_size": 16, "output_channels": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "image_size": 64, "patch_size": 4, "window_size": 4, "global_attn_indexes": [1], "mlp_dim": 32}  # fmt: skip
        return AutoConfig.for_model("got_ocr2", vision_config=vision, text_config={**text, "model_type": "qwen2"},
                                    image_token_index=IMAGE)  # fmt: skip
    if family == "mistral3":  # Pixtral tower (2-D rope), patch merger 2 x 2
        vision = {"model_type": "pixtral", **VISION, "head_dim": 16, "image_size": 16, "patch_size": 4}
        return AutoConfig.for_model("mistral3", vision_config=vision, text_config={**text, "model_type": "mistral"},
                                    image_token_index=IMAGE, spatial_merge_size=2)  # fmt: skip
    if family == "aya_vision":  # SigLIP tower, pixel shuffle 2 x 2, Cohere 2 decoder
        vision = {"model_type": "siglip_vision_model", **VISION, "image_size": 16, "patch_size": 4}
        return AutoConfig.for_model("aya_vision", vision_config=vision, image_token_index=IMAGE,
                                    text_config={**text, "model_type": "cohere2", "sliding_window": 8,
                                                 "layer_types": ["sliding_attention", "full_attention"]})  # fmt: skip
    if family == "fuyu":  # no tower: each 4 x 4 x 3 patch row projected by one Linear, Persimmon decoder (MHA)
        text = {k: v for k, v in text.items() if k not in ("num_key_value_heads", "head_dim")}
        return AutoConfig.for_model("fuyu", text_config={**text, "model_type": "persimmon"}, image_token_id=IMAGE,
                                    patch_size=4, num_channels=3)  # fmt: skip
    if family == "gemma3":  # SigLIP tower (16 patches), projector pooling 1 x 1 -> 16 rows; sliding layer of 4 first
        vision = {"model_type": "siglip_vision_model", **VISION, "image_size": 16, "patch_size": 4}
        text_cfg = {**text, "model_type": "gemma3_text", "sliding_window": 4, "query_pre_attn_scalar": 16,
                    "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
        return AutoConfig.for_model("gemma3", vision_config=vision, text_config=text_cfg, image_token_index=IMAGE,
                                    mm_tokens_per_image=16)  # fmt: skip
    # InternVL: its own tower (CLS dropped), pixel shuffle 0.5, Qwen2 decoder
    vision = {**VISION, "image_size": [16, 16], "patch_size": [4, 4]}
    return AutoConfig.for_model("internvl", vision_config=vision, text_config={**text, "model_type": "qwen2"},
                                image_token_id=IMAGE)  # fmt: skip


def tiny_llava(family: str, seed: int = 0, std: float = 0.2):
    """A tiny ``*ForConditionalGeneration`` of ``family`` (``FAMILIES``), fp32, train mode."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    attn = "eager" if family == "got_ocr2" else "sdpa"  # GOT-OCR2 does not take sdpa (its tower attends by hand)
    model = AutoModelForImageTextToText.from_config(_config(family), attn_implementation=attn)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std) if p.dim() >= 2 else p.normal_(1.0, 0.1)
    return model.float().train()


def llava_sample(spec: list, family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """One document from ``spec``: ints are runs of text tokens, ``"image"`` an image (its placeholders).
    Returns ``input_ids [1, S]``, ``pixel_values [N_img, 3, px, px]`` (Fuyu: ``[N_img, T, 3*4*4]`` patch rows;
    and Mistral 3's ``image_sizes``)."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    images = []
    px = PIXELS.get(family, 16)
    for part in spec:
        if isinstance(part, int):
            ids += torch.randint(3, 110, (part,), generator=g).tolist()
        else:
            ids += [IMAGE] * TOKENS[family]
            shape = (TOKENS[family], 3 * 4 * 4) if family == "fuyu" else (3, px, px)
            images.append(torch.randn(*shape, generator=g))
    out = {"input_ids": torch.tensor([ids])}
    if family == "gemma3":  # its mask makes each image's tokens see each other: runs of 1
        out["token_type_ids"] = (out["input_ids"] == IMAGE).long()
    if images:
        out["pixel_values"] = torch.stack(images)
        if family == "mistral3":
            out["image_sizes"] = torch.tensor([[px, px]] * len(images))
    return out


def llava_pack(docs: list[dict[str, torch.Tensor]], multiple: int = 4) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Documents padded (trailing text on the last, so the row divides by ``multiple``) and packed into
    one row, ``position_ids`` restarting at 0 at each; returns ``(docs as padded, row)``."""
    docs = [dict(d) for d in docs]
    n = -sum(d["input_ids"].shape[1] for d in docs) % multiple
    docs[-1]["input_ids"] = torch.cat([docs[-1]["input_ids"], torch.full((1, n), 7)], dim=1)
    if "token_type_ids" in docs[-1]:  # Gemma 3: the padding is text (type 0)
        docs[-1]["token_type_ids"] = torch.cat([docs[-1]["token_type_ids"], torch.zeros(1, n, dtype=torch.long)], 1)
    row = {"input_ids": torch.cat([d["input_ids"] for d in docs], dim=1),
           "position_ids": torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs])[None]}  # fmt: skip
    if all("token_type_ids" in d for d in docs):
        row["token_type_ids"] = torch.cat([d["token_type_ids"] for d in docs], dim=1)
    for key in ("pixel_values", "image_sizes"):
        parts = [d[key] for d in docs if key in d]
        if parts:
            row[key] = torch.cat(parts)
    return docs, row


def llava_labels(ids: torch.Tensor) -> torch.Tensor:
    """Train on the text tokens: image placeholders ``-100``."""
    return ids.masked_fill(ids == IMAGE, -100)
