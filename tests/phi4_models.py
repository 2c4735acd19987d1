"""A tiny Phi-4-multimodal and its samples for tests: transformers' own code, a config built locally
(nothing downloaded), float64, weights at std 0.2 so one wrong row shows.

A sample is a list of parts: ``n`` (that many random text tokens), ``("image", h, w)`` (an image of
``h x w`` pixels: ``h/32 x w/32`` crops of 32 px and the global one, ``(2h/32) (2w/32 + 1) + 7`` rows)
or ``("audio", t)`` (``t`` mel frames, ``ceil(t/8)`` rows)."""

from __future__ import annotations

import math

import torch

VOCAB, IMAGE, AUDIO = 128, 120, 121
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=8, crop_size=32, image_token_id=IMAGE)  # fmt: skip
AUDIO_TOWER = dict(hidden_size=32, intermediate_size=48, num_blocks=1, num_attention_heads=2, input_size=16,
                   nemo_conv_channels=8, ext_pw_out_channel=32, depthwise_separable_out_channel=32,
                   audio_token_id=AUDIO)  # fmt: skip


def tiny_phi4(seed: int = 0, std: float = 0.2, dtype: torch.dtype = torch.float64):
    """A tiny ``Phi4MultimodalForCausalLM`` (2 decoder layers, 2-layer image tower, 1-block conformer), train mode;
    float64 by default (its conformer's small attention gradients sit within fp32 rounding of the sums)."""
    from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM

    torch.manual_seed(seed)
    config = Phi4MultimodalConfig(**TEXT, vision_config=VISION, audio_config=AUDIO_TOWER)
    model = Phi4MultimodalForCausalLM._from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std) if p.dim() >= 2 else p.normal_(1.0, 0.1)
    return model.to(dtype).train()


def image_rows(h: int, w: int) -> int:
    """Placeholder tokens of an ``h x w`` image (32-px crops, 2 x 2 pooled patches of 8 px, separator rows)."""
    return (2 * h // 32) * (2 * w // 32 + 1) + 1 + 2 * 3


def phi4_sample(spec: list, seed: int = 0) -> dict[str, torch.Tensor]:
    """One sample's ``input_ids [1, S]`` and media (every image of one crop count, every clip of one length)."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    images, sizes, clips = [], [], []
    for part in spec:
        if isinstance(part, int):
            ids += torch.randint(3, IMAGE - 1, (part,), generator=g).tolist()
        elif part[0] == "image":
            h, w = part[1], part[2]
            images.append(torch.randn(1 + h * w // 32**2, 3, 32, 32, generator=g))  # [crops, C, H, W]
            sizes.append([h, w])
            ids += [IMAGE] * image_rows(h, w)
        else:
            clips.append(torch.randn(part[1], 16, generator=g))  # [T, mel]
            ids += [AUDIO] * math.ceil(part[1] / 8)
    out = {"input_ids": torch.tensor([ids])}
    if images:
        out["image_pixel_values"] = torch.stack(images)  # [N_img, crops, C, H, W]
        out["image_sizes"] = torch.tensor(sizes)
        out["image_attention_mask"] = torch.ones(len(images), images[0].shape[0], 4, 4, dtype=torch.long)
    if clips:
        out["audio_input_features"] = torch.stack(clips)  # [N_a, T, mel]
        out["audio_attention_mask"] = torch.ones(len(clips), clips[0].shape[0], dtype=torch.bool)
        out["audio_embed_sizes"] = torch.tensor([math.ceil(c.shape[0] / 8) for c in clips])
    return out


def phi4_pack(docs: list[dict[str, torch.Tensor]], multiple: int) -> dict[str, torch.Tensor]:
    """The documents packed into one row (positions restarting at 0, media in document order), padded to ``multiple``."""
    ids = torch.cat([d["input_ids"] for d in docs], dim=1)
    pos = torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs])[None]
    pad = -ids.shape[1] % multiple
    row = {"input_ids": torch.nn.functional.pad(ids, (0, pad)),
           "position_ids": torch.cat([pos, pos[:, -1:] + 1 + torch.arange(pad)[None]], dim=1)}  # fmt: skip
    for key in dict.fromkeys(k for d in docs for k in d):
        if key != "input_ids":
            row[key] = torch.cat([d[key] for d in docs if key in d])
    return row


def phi4_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Labels: the text tokens (placeholders and padding ignored)."""
    return input_ids.masked_fill((input_ids >= IMAGE) | (input_ids == 0), -100)
