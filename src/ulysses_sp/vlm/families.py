"""Which vision-language models the SP path is exact for, and why the others are refused.

Closed world, like the guard (``mixers.guard``): the path of this package relies on what the
model's own forward does between its vision tower and its language model — it merges the visual
embeddings into ``inputs_embeds`` over the full sequence, takes (or computes) its positions, and
passes every other per-token input to the language model by keyword, which the per-shard forward
rebuilds for one shard. Three shapes of that forward are admitted:

- ``QWEN_VLMS`` (``merge``): ``[4, B, S]`` mrope positions from ``get_rope_index``, a vision tower
  over patch rows and ``[t, h, w]`` grids (its frames split over the SP group, ``split``);
- ``PREFIX_VLMS`` (``prefix``): GIT — the vision tower's projected tokens prepended to the text inside
  the forward, a bidirectional image prefix in its mask (``mixers/prefix_attention.py``);
- ``SCATTER_VLMS`` (``scatter``): the LLaVA pattern — 1-D positions, ``get_image_features`` (vision
  tower + projector over whole images) scattered into ``inputs_embeds`` at the image placeholder
  tokens, a standard text decoder. What differs between these families is only what their forward
  passes to ``get_image_features``, the name of the module that encodes the images and the output field
  that holds their rows (``ScatterFamily``; Fuyu's "tower" is one linear projection of raw patches).
  Gemma 3 (and ShieldGemma 2, the same class) also makes each image's tokens attend to each other both
  ways (``token_type_ids`` in its mask): the runs are found on the host from the full batch (``batch``)
  and shipped with the positions' host layout to the SP attention, which ORs them into its mask
  (``attention/span_mask.py``). Gemma 3n also scatters an audio tower's soft tokens and builds
  per-layer inputs from the ids (``gemma3n``);
- ``PHI4_VLMS`` (``phi4mm``): Phi-4-multimodal, whose decoder holds its image and audio towers
  (``embed_tokens_extend``, ``VLMParts.media``) and writes their rows into its own embeddings; 1-D positions.

That is read from the model's code for the families below and tested against the same model
without SP (``tests/test_vlm.py``, ``tests/test_vlm_llava.py``); any other model with a vision or
audio encoder is refused by name with the reason, before the first step.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

QWEN_VLMS: dict[str, str] = {
    "qwen2_5_vl": "Qwen2.5-VL: window-attention vision tower, 3-D mrope",
    "qwen3_vl": "Qwen3-VL: vision tower with deepstack features added in the first decoder layers, interleaved mrope",
}
"""``config.model_type`` -> what the Qwen path (``merge``) handles for it (exact, tested)."""


@dataclass(frozen=True)
class ScatterFamily:
    """What one LLaVA-style family's forward does differently (``scatter``): the rest is shared."""

    what: str
    """The family in a line (the supported table)."""
    image_kwargs: tuple[str, ...] = ()
    """The forward's keyword arguments it passes on to ``get_image_features`` (not to the language model)."""
    cast_pixels: bool = False
    """The forward casts ``pixel_values`` to the embeddings' dtype before the tower (GOT-OCR2)."""
    tower: str = "vision_tower"
    """The inner model's child that encodes the images (Fuyu's patch projection: ``vision_embed_tokens``)."""
    features: str = "pooler_output"
    """The field of ``get_image_features``'s output the forward scatters (Fuyu's: ``last_hidden_state``)."""
    spans_key: str | None = None
    """The forward's ``[B, S]`` input whose runs of 1 its own mask makes bidirectional (Gemma 3's
    ``token_type_ids``): shipped as host spans (``batch``, ``scatter``); ``None``: causal only."""
    per_layer_audio: bool = False
    """Gemma 3n's forward (``gemma3n``): media ids hard-embedded from their own vocabularies, per-layer inputs
    from the ids, and an audio tower's soft tokens scattered as the images' are."""


_LAYER, _SELECT = "vision_feature_layer", "vision_feature_select_strategy"
SCATTER_VLMS: dict[str, ScatterFamily] = {
    "llava": ScatterFamily("LLaVA: CLIP/SigLIP tower + MLP projector", (_LAYER, _SELECT, "image_sizes")),
    "got_ocr2": ScatterFamily("GOT-OCR2: windowed SAM-style tower + conv projector, Qwen2 decoder", cast_pixels=True),
    "mistral3": ScatterFamily("Mistral 3: Pixtral tower (2-D rope, image_sizes) + patch merger", (_LAYER, "image_sizes")),
    "aya_vision": ScatterFamily("Aya Vision: SigLIP tower + pixel-shuffle projector, Cohere 2 decoder", (_LAYER, _SELECT)),
    "internvl": ScatterFamily("InternVL: InternViT tower + pixel-shuffle projector", (_LAYER, _SELECT)),
    "fuyu": ScatterFamily("Fuyu: raw image patches through a linear projection (no tower), Persimmon decoder",
                          tower="vision_embed_tokens", features="last_hidden_state"),  # fmt: skip
    "gemma3": ScatterFamily("Gemma 3: SigLIP tower + pooling projector, each image's tokens bidirectional "
                            "(token_type_ids)", spans_key="token_type_ids"),
    "shieldgemma2": ScatterFamily("ShieldGemma 2: Gemma 3's model (its image tokens bidirectional, "
                                  "token_type_ids)", spans_key="token_type_ids"),
    "gemma3n": ScatterFamily("Gemma 3n: vision and audio (conformer) towers' soft tokens, per-layer inputs from the "
                             "ids, AltUp/LAuReL decoder with KV sharing", per_layer_audio=True),  # fmt: skip
}
"""``config.model_type`` -> the LLaVA-style families the ``scatter`` path handles (exact, tested)."""

PREFIX_VLMS: dict[str, str] = {
    "git": "GIT: CLIP tower + projection prepended to the text (a bidirectional image prefix), BERT-style decoder",
}
"""``config.model_type`` -> the families whose forward prepends the image's tokens to the text (``prefix``)."""

PHI4_VLMS: dict[str, ScatterFamily] = {
    "phi4_multimodal": ScatterFamily("Phi-4-multimodal: SigLIP-style image tower (HD crops) and conformer audio tower, "
                                     "their rows put into the decoder's own embeddings (phi4mm)"),
}
"""``config.model_type`` -> the families whose decoder holds its towers (``media``, ``phi4mm``): 1-D positions."""

SUPPORTED_VLMS: dict[str, str] = {**QWEN_VLMS, **{k: f.what for k, f in {**SCATTER_VLMS, **PHI4_VLMS}.items()}, **PREFIX_VLMS}
"""``config.model_type`` -> what the path handles for it (exact, tested)."""

REFUSED_VLMS: dict[str, str] = {
    "emu3": "its VQ-VAE (vqmodel) turns each image into discrete codes whose embeddings its forward scatters into the "
    "placeholders of the whole sequence (masked_scatter over inputs_embeds)",
    "chameleon": "its VQ-VAE (vqmodel) turns each image into discrete codes its forward writes into the placeholders of "
    "the whole sequence",
    "paligemma": "its prefix (image + prompt) attends bidirectionally (a prefix-LM mask built from token_type_ids)",
    "llava_next": "its anyres tiles and image-newline rows have not been tested against the model without SP (the "
    "LLaVA path very likely applies)",
    "llava_onevision": "its anyres tiles, image-newline rows and videos have not been tested against the model "
    "without SP",
    "llama4": "its merge and chunked attention over image tokens have not been proven exact under this path",
    "qwen2_vl": "the Qwen2.5-VL path very likely applies, but it has not been tested against the model without SP",
    "qwen3_5": "its language model mixes gated delta-net and attention layers behind the vision merge, a "
    "combination not yet tested against the model without SP",
}
"""``config.model_type`` -> the specific reason a known multimodal family is refused."""

_ENCODER_KEYS = ("vision_config", "audio_config", "vision_tower", "audio_tower", "speech_config", "vq_config")


@dataclass(frozen=True)
class VLMParts:
    """The three modules of an admitted VLM the SP path works with."""

    inner: nn.Module
    """The module whose forward merges and positions (``Qwen2_5_VLModel``, ``LlavaModel``)."""
    vision: nn.Module
    """The vision tower: encodes whole frames (Qwen: split over the SP group, ``split``) or whole images
    (Fuyu: a linear projection of patch rows, which has no config of its own)."""
    language_model: nn.Module
    """The decoder stack: runs on each rank's ``S_l`` tokens with the Ulysses attention."""
    scatter: ScatterFamily | None = None
    """A LLaVA-style family (``SCATTER_VLMS``: 1-D positions, ``scatter``); ``None``: Qwen (mrope, ``merge``)."""
    media: nn.Module | None = None
    """The module of the decoder stack that holds the towers (Phi-4-multimodal's ``embed_tokens_extend``,
    ``PHI4_VLMS``: its forward is ``phi4mm``'s); it encodes whole images and audio on a rank, so the guard
    does not read it as a sequence mixer. ``None``: the towers sit beside the language model."""
    prefix: bool = False
    """The image's tokens prepended to the text inside the forward (``PREFIX_VLMS``: GIT, ``prefix``)."""


def _model_type(model: Any) -> str | None:
    return getattr(getattr(model, "config", None), "model_type", None)


def vlm_parts(model: Any) -> VLMParts | None:
    """The parts of an admitted VLM (``SUPPORTED_VLMS``), else ``None``. PEFT wrappers are looked
    through: the first module of the model's tree whose config is of an admitted family and that holds
    the vision tower and the language model as children (Qwen: ``visual`` and ``get_rope_index``;
    LLaVA-style: ``ScatterFamily.tower`` (``vision_tower``) and ``get_image_features``; Phi-4: the decoder, with
    ``embed_tokens_extend`` and ``layers``)."""
    if not isinstance(model, nn.Module):
        return None
    for module in model.modules():
        kind = _model_type(module)
        if kind not in SUPPORTED_VLMS:
            continue
        if kind in PREFIX_VLMS:  # GIT: image_encoder + visual_projection prepended, the encoder as the decoder
            tower, stack = module._modules.get("image_encoder"), module._modules.get("encoder")
            if isinstance(tower, nn.Module) and isinstance(stack, nn.Module) and "visual_projection" in module._modules:
                return VLMParts(module, tower, stack, prefix=True)
            continue
        if kind in PHI4_VLMS:  # the decoder (Phi4MultimodalModel) holds the towers and merges itself
            media, layers = module._modules.get("embed_tokens_extend"), module._modules.get("layers")
            if isinstance(media, nn.Module) and isinstance(layers, nn.Module):
                vision = media.get_submodule("image_embed.img_processor")
                return VLMParts(module, vision, module, PHI4_VLMS[str(kind)], media)
            continue
        scatter = SCATTER_VLMS.get(str(kind))
        tower, method = ("visual", "get_rope_index") if scatter is None else (scatter.tower, "get_image_features")
        vision, lm = module._modules.get(tower), module._modules.get("language_model")
        if isinstance(vision, nn.Module) and isinstance(lm, nn.Module) and hasattr(module, method):
            return VLMParts(module, vision, lm, scatter)
    return None


def _encoders(model: nn.Module) -> list[str]:
    """The model config's non-text sub-configs (vision, audio, ...) that hold parameters in the model."""
    config = getattr(model, "config", None)
    subs = [k for k in getattr(config, "sub_configs", {}) or {} if k != "text_config"]
    return [k for k in subs if k in _ENCODER_KEYS or k.endswith(("vision_config", "audio_config"))]


MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "image_patches", "input_features", "audio_values")
MEDIA_WORDS = ("vision", "image", "audio", "patch")
"""Module names of a model's media path (Fuyu's ``vision_embed_tokens``): with ``MEDIA_INPUTS`` in its forward,
a multimodal model even where its config has no vision/audio sub-config (a model whose towers are off holds
no such module: text-only, not refused)."""


def multimodal_refusal(model: nn.Module) -> str | None:
    """Why SP refuses ``model``'s multimodal path, or ``None`` (a text model, or an admitted VLM).

    A model whose config has a vision/audio sub-config and whose modules hold that encoder, but
    whose family is not in ``SUPPORTED_VLMS``, is refused: its own forward merges the encoder's
    embeddings (and may build positions or masks from the token types) in ways this path has not
    been proven exact for.
    """
    if vlm_parts(model) is not None:
        return None
    encoders = _encoders(model)
    has_encoder = any(
        name.split(".")[-1] in ("visual", "vision_tower", "vision_model", "audio_tower", "vision_encoder", "vqmodel")
        for name, _ in model.named_modules()
    )
    media = [p for p in MEDIA_INPUTS if p in inspect.signature(type(model).forward).parameters]
    media_modules = [n for n, _ in model.named_modules() if any(w in n.rsplit(".", 1)[-1] for w in MEDIA_WORDS)]
    if media and media_modules and not (encoders and has_encoder):  # no vision sub-config, images taken (Fuyu)
        encoders, has_encoder = [f"its forward takes {', '.join(media)} into {media_modules[0]}"], True
    if not encoders or not has_encoder:
        return None
    admitted = ", ".join(sorted(SUPPORTED_VLMS))
    why = REFUSED_VLMS.get(str(_model_type(model)), "")
    return (
        f"is a multimodal model ({_model_type(model)}: {', '.join(encoders)}) whose own forward merges the "
        f"encoder's embeddings into the token sequence{'; ' + why if why else ''}; ulysses-sp shards that merge "
        "exactly only for "
        f"{admitted} (ulysses_sp.vlm). Train its text model alone (the *ForCausalLM class of its text "
        "config) with SP, or this model with sp_size 1"
    )
