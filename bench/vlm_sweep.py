"""Coverage sweep of the vision-language models: every image-text-to-text family, at sp=2 against no SP.

    python -m bench.vlm_sweep [--only qwen2_5_vl,llava]  # all -> bench/results/vlm_sweep.md; a few: printed only

The families come from transformers' ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` (its vision2seq registry, where a
version still has one, and the multimodal-LM one's admitted VLMs: Phi-4-multimodal), not from a list kept here. Each gets a tiny config: the text tower shrunk as the decoder sweep
shrinks a decoder (``model_sweep.shrink``), every other tower (vision, audio, ...) to ``TOWER``, the media
tokens' ids moved inside the 128-token vocabulary, ``vlm_sweep_overrides.json`` last (merged into each
sub-config). Two gloo ranks (``model_sweep.run_family``'s workers) first build it on the meta device and ask
ulysses-sp's closed-world guard (``check_sequence_mixing``, which holds the multimodal refusal): a refusal is
the verdict, with ulysses-sp's reason. Otherwise the model is built with random weights (fp32, matrices
N(0, 0.2)) and one sample with two images (pixels of the shape its tower takes, as many placeholders as the
tower gives rows; Gemma 3n: an audio clip after them) is run by the model's own forward (the oracle) and at sp=2 through ``ulysses_sp.vlm``
(``register_with_transformers``, ``shard_vlm``, ``prepare_vlm_batch``, the SP loss). **exact**: every
position's logits and every gradient (vision tower included), summed over the group, equal the oracle's at
``rtol 1e-4`` (``model_sweep``'s tolerance); **refused**; **wrong** (a mismatch, or a model that takes images
admitted without ``ulysses_sp.vlm``'s path: a bug); **crash** (anything else: the sweep's config is to be fixed).
A registered class that takes no images (Mistral 4's causal LM) runs the decoder sweep's text step. A tower whose
config does not shrink is left at its defaults (``"_keep"``) only for families the guard refuses on the meta device.
Re-run families after a change: ``--only a,b``; their rows into the page: ``--table-from`` the full run's log and
theirs (a later row of a family replaces an earlier one).

Shape legend: ``S`` tokens of the sample, ``S_l = S/2`` per rank, ``N_p`` pixel rows (Qwen-style patches).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import resource
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from transformers.models.auto import modeling_auto as auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from bench import md, model_sweep
from bench.launch import max_over_ranks
from bench.model_sweep import _mismatches, grad_mismatches, shrink
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.mixers.apply import apply_mixers, has_unsharded_mixers
from ulysses_sp.mixers.guard import check_sequence_mixing
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.vlm import SUPPORTED_VLMS, prepare_vlm_batch, shard_vlm, vlm_parts
from ulysses_sp.vlm.prefix import prefix_tokens

TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, depth=2, num_attention_heads=2, num_heads=2,
             num_key_value_heads=2, head_dim=16, image_size=32, patch_size=8, out_hidden_size=64, embed_dim=32,
             projection_dim=64, num_layers=1, initializer_range=0.1)  # fmt: skip
"""A vision/audio tower's fields, shrunk where its config has them."""
MEDIA_TOKENS = 100
"""The first id given to the media tokens (``*_token_id`` / ``*_token_index`` outside the tiny vocabulary)."""
REGISTRY = {**auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, **{k: v for k, v in auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES.items() if k in SUPPORTED_VLMS}}
"""model type -> its class name in transformers (and Phi-4-multimodal: the multimodal-LM registry's admitted VLMs)."""
OVERRIDES = json.loads(Path(__file__).with_name("vlm_sweep_overrides.json").read_text())  # set last ("_why"s)


def families() -> list[str]:
    """The image-text-to-text model types of the installed transformers, from its auto registries."""
    return sorted({*REGISTRY, *getattr(auto, "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES", {})})


def _tokens(defaults: dict, vocab: int) -> dict:
    """The media tokens' ids moved inside the tiny vocabulary (100, 101, ... in the config's order)."""
    keys = [k for k, v in defaults.items() if k.endswith(("_token_id", "_token_index")) and isinstance(v, int) and v >= vocab]
    return {k: {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(k, MEDIA_TOKENS + i) for i, k in enumerate(keys)}


def _merge(base: Any, over: Any, defaults: Any) -> Any:
    """``over`` into ``base`` dict by dict; a dict ``base`` lacks merges into the ``defaults``' one of its key."""
    if not (isinstance(over, dict) and isinstance(base, dict)):
        return over
    out = dict(base)
    for k, v in over.items():
        d = defaults.get(k) if isinstance(defaults, dict) else None
        out[k] = _merge(out.get(k, d), v, d)
    return out


def tiny_config(model_type: str) -> Any:
    """The config class's defaults, the text tower shrunk (``model_sweep.shrink``), the others to ``TOWER`` (a
    vision tower off by default turned on), the media tokens inside the vocabulary; the decoder sweep's
    overrides of the model type, then ``OVERRIDES`` ("_keep": sub-configs left at their defaults; "_swap": a
    sub-config of another kind), merged into the shrink."""
    spec = _merge(model_sweep.OVERRIDES.get(model_type, {}), OVERRIDES.get(model_type, {}), {})
    cls, over = CONFIG_MAPPING[model_type], {k: v for k, v in spec.items() if k[0] != "_"}
    defaults = cls().to_dict()
    kw = {**(shrink(defaults) if "hidden_size" in defaults and "text_config" not in defaults else {}), **_tokens(defaults, 128)}
    for key, sub_cls in (getattr(cls, "sub_configs", {}) or {}).items():
        sub = defaults.get(key)
        if sub is None and "vision" in key and hasattr(sub_cls, "model_type") and sub_cls.model_type:
            sub = defaults[key] = sub_cls().to_dict()  # the tower's own defaults (Gemma 4's is off by default)
        if not isinstance(sub, dict) or key in spec.get("_swap", {}):
            continue
        if key in spec.get("_keep", ()):
            kw[key] = sub
            continue
        small = shrink(sub) if key == "text_config" else {k: v for k, v in TOWER.items() if k in sub}
        kw[key] = {**({"model_type": sub["model_type"]} if "model_type" in sub else {}), **small, **_tokens(sub, 128)}
    config = cls(**_merge(kw, over, defaults))
    for key, sub in spec.get("_swap", {}).items():  # a sub-config of another kind, set past the config's type check
        object.__setattr__(config, key, CONFIG_MAPPING[sub["model_type"]](**{k: v for k, v in sub.items() if k != "model_type"}))
    return config


def build(model_type: str, *, meta: bool = False, seed: int = 0) -> Any:
    """The tiny model (``meta``: on the meta device, for the guard alone), random weights as the decoder sweep's."""
    config = tiny_config(model_type)
    cls = getattr(transformers, REGISTRY[model_type])
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = cls._from_config(config, attn_implementation="eager")
    if not meta:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2) if p.dim() >= 2 else p.normal_(1.0, 0.1)
    return model.float().eval()


def sample(model: Any, seed: int = 1) -> dict[str, torch.Tensor]:
    """Two images between text, ``S`` a multiple of 4, and its labels (text tokens only). Qwen-style (a
    ``spatial_merge_size`` tower): 4x4-patch grids, ``[N_p, C*T*P*P]`` pixels, 4 placeholders an image between
    vision start/end tokens; otherwise ``[2, C, H, W]`` pixels at the tower's ``image_size``, as many placeholders
    as its ``get_image_features`` gives rows; a model without a vision sub-config (Fuyu) ``[2, T, C*P*P]`` patch rows,
    one placeholder a row."""
    g, cfg = torch.Generator().manual_seed(seed), model.config
    vision = getattr(cfg, "vision_config", None)
    image = getattr(cfg, "image_token_id", None) or getattr(cfg, "image_token_index", None)
    text = lambda n: torch.randint(3, MEDIA_TOKENS - 4, (n,), generator=g).tolist()  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    if (parts := vlm_parts(model)) is not None and parts.prefix:  # GIT: one image prepended inside the model
        size = vision.image_size
        out["pixel_values"] = torch.randn(1, getattr(vision, "num_channels", 3), size, size, generator=g)
        n = prefix_tokens(cfg, out["pixel_values"])  # the image straddles the sp-2 shard boundary: S < N
        out["input_ids"] = torch.tensor([text(-(n + n // 2) % 4 + n // 2)])
        out["labels"] = out["input_ids"].clone()
        return out
    if "image_pixel_values" in inspect.signature(model.forward).parameters:  # Phi-4-multimodal: images and audio
        return _phi4_sample(model, text)
    elif vision is None:  # Fuyu: no tower, each image its [T, C*P*P] patch rows through one Linear
        t = (cfg.image_size // cfg.patch_size) ** 2
        out["pixel_values"] = torch.randn(2, t, cfg.num_channels * cfg.patch_size**2, generator=g)  # [2, T, C*P*P]
        per = [image] * t
    elif hasattr(vision, "spatial_merge_size"):
        t, p, m = getattr(vision, "temporal_patch_size", 1), vision.patch_size, vision.spatial_merge_size
        c = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
        out["pixel_values"] = torch.randn(2 * 16, c * t * p * p, generator=g)  # [N_p, C*T*P*P]
        out["image_grid_thw"] = torch.tensor([[1, 4, 4], [1, 4, 4]])
        start, end = ([i for w in ("vision", "image") if (i := getattr(cfg, f"{w}_{e}_token_id", None)) is not None][:1]
                      for e in ("start", "end"))  # Qwen's vision_*, GLM-4V's image_* markers  # fmt: skip
        per = [*start, *[image] * (16 // m**2), *end]
    else:
        size = vision.image_size if isinstance(vision.image_size, int) else int(vision.image_size[0])  # InternVL: [H, W]
        out["pixel_values"] = torch.randn(2, getattr(vision, "num_channels", 3), size, size, generator=g)
        sizes = inspect.signature(model.get_image_features).parameters.get("image_sizes")
        if sizes is not None and sizes.default is inspect.Parameter.empty:  # Mistral 3, LLaVA-NeXT: each image's [H, W]
            out["image_sizes"] = torch.tensor([[size, size]] * 2)
        with torch.no_grad():
            feats = model.get_image_features(**{k: v[:1] for k, v in out.items()})
        feats = getattr(feats, "pooler_output", feats)
        rows = sum(f.numel() for f in (feats if isinstance(feats, (list, tuple)) else [feats])) // cfg.get_text_config().hidden_size
        per = [image] * rows
    ids = text(5) + per + text(3) + per  # the second image straddles the sp-2 shard boundary
    clip = getattr(cfg, "audio_soft_tokens_per_image", None)
    if clip and "input_features_mask" in inspect.signature(model.forward).parameters:  # Gemma 3n: an audio clip too
        frames = 64  # 4 soft tokens from the tiny conformer, 1 of them padding, the rest up to `clip` filled
        out["input_features"] = torch.randn(1, frames, cfg.audio_config.input_feat_size, generator=g)
        out["input_features_mask"] = (torch.arange(frames) < frames - 20)[None]  # [1, T] True: a valid frame
        ids += text(2) + [cfg.audio_token_id] * clip
    ids += text(-(len(ids) + 9) % 4 + 9)
    out["input_ids"] = torch.tensor([ids])
    out["mm_token_type_ids"] = (out["input_ids"] == image).int()
    if "token_type_ids" in inspect.signature(model.forward).parameters:  # Gemma 3: its image tokens' bidirectional mask
        out["token_type_ids"] = out["mm_token_type_ids"]
    media = torch.tensor([i >= MEDIA_TOKENS for i in ids])
    out["labels"] = out["input_ids"].masked_fill(media[None], -100)
    return out


def _phi4_sample(model: Any, text: Any) -> dict[str, torch.Tensor]:
    """Phi-4-multimodal: two ``crop x 2 crop`` images (global crop + 2 sub-crops) and a 40-frame audio clip."""
    g, v, a = torch.Generator().manual_seed(2), model.config.vision_config, model.config.audio_config
    crop, side = v.crop_size, v.image_size // v.patch_size
    out = {"image_pixel_values": torch.randn(2, 3, v.num_channels, crop, crop, generator=g), "image_sizes":
           torch.tensor([[crop, 2 * crop]] * 2), "image_attention_mask": torch.ones(2, 3, side, side, dtype=torch.long),
           "audio_input_features": torch.randn(1, 40, a.input_size, generator=g), "audio_attention_mask":
           torch.ones(1, 40, dtype=torch.bool), "audio_embed_sizes": torch.tensor([-(-40 // a.time_reduction)])}  # fmt: skip
    base = (side + side % 2) // 2  # rows: sub-crops (a separator column), one separator, global crop
    image = [v.image_token_id] * (base * (2 * base + 1) + 1 + base * (base + 1))
    ids = text(5) + image + text(3) + image + text(2) + [a.audio_token_id] * int(out["audio_embed_sizes"][0])
    out["input_ids"] = torch.tensor([ids + text(-(len(ids) + 9) % 4 + 9)])  # the 2nd image straddles the boundary
    return {**out, "labels": out["input_ids"].masked_fill(out["input_ids"] >= MEDIA_TOKENS, -100)}


def compare(model: Any, *, seed: int = 1) -> dict[str, str]:
    """One step at sp = world size through ``ulysses_sp.vlm`` against the model's own forward; call on every
    rank of a gloo group. ``{"verdict": "exact"|"refused"|"wrong", "detail": ...}``."""
    sp, rank = dist.get_world_size(), dist.get_rank()
    ref = copy.deepcopy(model)
    batch = sample(ref, seed)
    labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # [1, S], shifted
    ref_logits = ref(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits  # [1, S, V]
    labels = F.pad(labels, (ref_logits.shape[1] - labels.shape[1], 0), value=-100)  # GIT: [1, N + S], prefix first
    F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    try:
        reg = UlyssesSPAttentionHF.register_with_transformers(model, "eager", sp, 1)
    except ValueError as err:
        return {"verdict": "refused", "detail": str(err).replace("\n", " ")[:400]}
    handles = [reg]
    try:
        handles.append(shard_vlm(model, sp_rank=rank, sp_size=sp))
        if has_unsharded_mixers(model):  # GIT's self-attention: head-parallel (mixers/prefix_attention.py)
            handles.append(apply_mixers(model, reg.mesh))
        inputs = prepare_vlm_batch(model, batch, sp_rank=rank, sp_size=sp)
    except ValueError as err:
        for h in reversed(handles):
            h.remove()
        return {"verdict": "refused", "detail": str(err).replace("\n", " ")[:400]}
    try:
        shift = inputs.pop("shift_labels")
        logits = model(**inputs, use_cache=False).logits  # [1, S_l, V]
        sp_causal_lm_loss(logits, shift, reg.mesh.sp_group).backward()
    finally:
        for h in reversed(handles):
            h.remove()
    s_l = logits.shape[1]
    problems = _mismatches(logits.detach(), ref_logits.detach()[:, rank * s_l : (rank + 1) * s_l], "logits", 0.0)
    problems += grad_mismatches(model, ref)[2]
    if max_over_ranks(len(problems)):  # one verdict for the group
        return {"verdict": "wrong", "detail": problems[0] if problems else "another rank differs"}
    return {"verdict": "exact", "detail": ""}


def _not_a_vlm(model: Any) -> dict[str, str]:
    """A family the guard admits without ``ulysses_sp.vlm``'s path: a text-only class (the decoder sweep's step),
    else wrong (a model that takes images, left unrefused)."""
    if getattr(model.config, "vision_config", None) is None and "pixel_values" not in inspect.signature(model.forward).parameters:
        row = model_sweep.compare(model)
        return {**row, "detail": f"{type(model).__name__} takes no images: its text step, as the decoder sweep's. {row['detail']}".strip()}
    return {"verdict": "wrong", "detail": f"{type(model).__name__} takes images, yet ulysses-sp's guard admits it without "
            "ulysses_sp.vlm's per-shard merge: its own forward merges over the whole sequence (a guard gap)"}  # fmt: skip


def refusal(model: Any) -> str | None:
    """ulysses-sp's closed-world guard at sp 2 (the multimodal refusal among its findings): the reason, or ``None``."""
    try:
        check_sequence_mixing(model, sp_size=2)
    except ValueError as err:
        lines = str(err).splitlines()  # the guard's: a header, one line per module, a hint
        return " | ".join(x.strip() for x in lines[1:-1] or lines)
    return None


def _rank_main(model_type: str, rank: int, store: str, mem_bytes: int, out: Any) -> None:
    """One rank of one family's run (``model_sweep.run_family``'s worker), under the memory cap."""
    resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    try:
        why = refusal(build(model_type, meta=True))
        if why is not None:
            out.put((rank, {"verdict": "refused", "detail": why}))
            return
        model = build(model_type)
        dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                                timeout=timedelta(seconds=120))  # fmt: skip
        out.put((rank, compare(model) if vlm_parts(model) is not None else _not_a_vlm(model)))
    except BaseException as err:  # noqa: BLE001 - reported as a crash with its reason
        out.put((rank, {"verdict": "crash", "detail": f"{type(err).__name__}: {err}"[:300]}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def write_table(rows: list[dict[str, Any]], path: Path, run: dict, note: str = "") -> str:
    """The results page (the run's header, the counts, ``note``, one row per family); returns the text."""
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("exact", "refused", "skipped", "crash", "wrong")}
    return md.page(path, "VLM coverage sweep", run, [
        f"transformers {transformers.__version__}: {len(rows)} image-text-to-text families from its auto registries (Phi-4-multimodal: its multimodal-LM one), "
        "each at sp=2 through `ulysses_sp.vlm` against the same model without SP (two images; per-position "
        "logits and every gradient, vision tower included, fp32, rtol 1e-4), or refused by ulysses-sp's guard "
        "with its reason. `python -m bench.vlm_sweep` regenerates this file.",
        "**" + ", ".join(f"{n} {v}" for v, n in counts.items()) + "**", *([note] if note else []),
        md.table(["family", "verdict", "reason"], [[r["family"], r["verdict"], r["detail"][:400]] for r in rows])])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    model_sweep.main(argv, sweep=sys.modules[__name__])  # its command line, workers and log replay


if __name__ == "__main__":
    main()
