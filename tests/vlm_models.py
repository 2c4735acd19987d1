"""Tiny vision-language models and samples for tests: transformers' own Qwen2.5-VL / Qwen3-VL code,
configs built locally (nothing downloaded), fp32, weights at std 0.2 so one wrong position shows."""

from __future__ import annotations

import json

import torch

VOCAB, IMAGE, VIDEO, V_START, V_END = 128, 120, 121, 122, 123
PATCH, TEMPORAL, MERGE = 4, 2, 2
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH  # one row of pixel_values


def tiny_vlm(family: str, seed: int = 0, std: float = 0.2):
    """A tiny ``*ForConditionalGeneration`` of ``family`` (``qwen2_5_vl`` / ``qwen3_vl``)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, out_hidden_size=64)  # fmt: skip
    tokens = dict(
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START, vision_end_token_id=V_END
    )
    if family == "qwen2_5_vl":
        cfg = Qwen2_5_VLConfig(text_config={**text, "rope_parameters": rope},
                               vision_config={**vision, "window_size": 16, "fullatt_block_indexes": [1]}, **tokens)  # fmt: skip
        cls = Qwen2_5_VLForConditionalGeneration
    else:
        # 3 text layers: the deepstack features are added after decoder layers 0 and 1 (transformers
        # 5.24 drops the gradient of a feature added after the last layer)
        cfg = Qwen3VLConfig(text_config={**text, "num_hidden_layers": 3, "head_dim": 16, "rope_parameters": {**rope, "mrope_interleaved": True}},
                            vision_config={**vision, "deepstack_visual_indexes": [0, 1], "num_position_embeddings": 16},
                            **tokens)  # fmt: skip
        cls = Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model.float().train()


def sample(spec: list, family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """One document from ``spec``: ints are runs of text tokens, ``("image", h, w)`` an image and
    ``("video", t, h, w)`` a video (grids in patches). Returns the processor's keys for it."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    pixels: dict[str, list] = {"image": [], "video": []}
    grids: dict[str, list] = {"image": [], "video": []}
    for part in spec:
        if isinstance(part, int):
            ids += torch.randint(3, 110, (part,), generator=g).tolist()
            continue
        kind, *thw = part
        t, h, w = (1, *thw) if kind == "image" else thw
        pixels[kind].append(torch.randn(t * h * w, PATCH_DIM, generator=g))
        grids[kind].append([t, h, w])
        per_frame = h * w // MERGE**2
        token = IMAGE if kind == "image" else VIDEO
        if kind == "video" and family == "qwen3_vl":  # frames apart, each after its timestamp token
            for _ in range(t):
                ids += (
                    [int(torch.randint(3, 110, (1,), generator=g)), V_START] + [token] * per_frame + [V_END]
                )
        else:
            ids += [V_START] + [token] * (per_frame * t) + [V_END]
    out = {"input_ids": torch.tensor([ids])}
    out["mm_token_type_ids"] = (out["input_ids"] == IMAGE).int() + 2 * (out["input_ids"] == VIDEO).int()
    for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        if pixels[kind]:
            out[key] = torch.cat(pixels[kind])
            out[f"{kind}_grid_thw"] = torch.tensor(grids[kind])
    return out


def pack(docs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Documents concatenated into one row, ``position_ids`` restarting at 0 at each."""
    out = {
        "input_ids": torch.cat([d["input_ids"] for d in docs], dim=1),
        "mm_token_type_ids": torch.cat([d["mm_token_type_ids"] for d in docs], dim=1),
        "position_ids": torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs])[None],
    }
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        parts = [d[key] for d in docs if key in d]
        if parts:
            out[key] = torch.cat(parts)
    return out


def labels_for(ids: torch.Tensor) -> torch.Tensor:
    """Train on the text tokens: placeholders and vision markers ``-100``."""
    return ids.masked_fill((ids == IMAGE) | (ids == VIDEO) | (ids == V_START) | (ids == V_END), -100)


CHAT_TEMPLATE = (  # Qwen-VL's shape: string or list content, and a generation prompt
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% else %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = {"<|im_start|>": 124, "<|im_end|>": 125, "<|vision_start|>": V_START, "<|vision_end|>": V_END,
           "<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO, "<|endoftext|>": 0}  # fmt: skip


def save_vlm_dir(path: str, family: str = "qwen2_5_vl", *, processor: bool = True) -> None:
    """A local VLM directory: the tiny model, a character-level tokenizer whose special tokens are
    the model's ids, and (``processor``) a PIL image processor (4-pixel patches, at most 32x32) and
    the video processor's settings (2 frames a second, at most 32x32 pixels a frame; Qwen3-VL: a clip)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tiny_vlm(family).save_pretrained(path)
    vocab = {chr(i): i - 29 for i in range(32, 127)}  # ids 3..97: printable characters
    vocab.update({"\n": 1, **SPECIAL})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL if t != "<|endoftext|>"]})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    if processor:
        Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE,
                                 min_pixels=8 * 8, max_pixels=32 * 32).save_pretrained(path)  # fmt: skip
        kind = "Qwen3VLVideoProcessor" if family == "qwen3_vl" else "Qwen2VLVideoProcessor"
        video = {"video_processor_type": kind, "size": {"shortest_edge": 8 * 8, "longest_edge": 32 * 32},
                 "patch_size": PATCH, "temporal_patch_size": TEMPORAL, "merge_size": MERGE, "do_sample_frames": True,
                 "fps": 2, "min_frames": 2}  # fmt: skip
        with open(f"{path}/video_preprocessor_config.json", "w") as f:
            json.dump(video, f)


def save_video(path: str, frames: int = 10, fps: int = 4, height: int = 20, width: int = 28, seed: int = 0) -> None:
    """A tiny MPEG-4 clip of random frames, written with PyAV."""
    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    with av.open(path, "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            pixels = (rng.random((height, width, 3)) * 255).astype("uint8")
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
