"""Checks run in the launching process, before any worker starts (``run.resolve.resolve_run`` and the
``eval`` command's validation call them): what would otherwise surface only after the workers
start, as raw tracebacks from every rank.

- ``check_option_types``: a ``--config`` JSON value of the wrong type (``"lr": "0.1"``) names the
  key and the type expected;
- ``check_attention_available``: the requested core attention can run here (flash-attn installed,
  flex attention in this torch);
- ``check_seq_len_fits``: ``--seq-len`` within the model's ``max_position_embeddings``, or within
  what its RoPE scaling extends it to.

No processes, no collectives; every check raises ``ValueError`` naming the value and the fix.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

_SCALED_ROPE = ("linear", "dynamic", "yarn", "longrope", "llama3")


def _accepts(kind: Any, value: Any) -> bool:
    """Whether ``value`` (from JSON) fits the annotation ``kind`` (``int``, ``float | None``, ...)."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(k, value) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:  # JSON writes 1.0 as 1
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if origin is tuple:
        args = typing.get_args(kind)
        return isinstance(value, (list, tuple)) and len(value) == len(args) and all(
            _accepts(k, v) for k, v in zip(args, value)
        )  # fmt: skip
    return True  # a type this checker does not know: the config's own validation decides


def _name(kind: Any) -> str:
    if typing.get_origin(kind) is tuple:
        return f"a list of {len(typing.get_args(kind))} numbers"
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(_name(k) for k in typing.get_args(kind))
    return {type(None): "null", bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        kind, str(kind)
    )  # fmt: skip


def check_option_types(cls: type, values: Mapping[str, Any], *, source: str = "--config") -> None:
    """Raise ``ValueError`` for each value of ``values`` whose type does not fit ``cls``'s field."""
    hints = typing.get_type_hints(cls)
    bad = []
    for f in dataclasses.fields(cls):
        if f.name in values and not _accepts(hints[f.name], values[f.name]):
            value = values[f.name]
            bad.append(f"{f.name!r} must be {_name(hints[f.name])}, got {value!r} ({type(value).__name__})")
    if bad:
        raise ValueError(f"{source}: " + "; ".join(bad))


def check_attention_available(attn: str) -> None:
    """Raise ``ValueError`` if the core attention ``attn`` cannot run in this environment."""
    from transformers import utils

    probes = {
        "flash_attention_2": ("is_flash_attn_2_available", "the flash-attn package (pip install flash-attn) and a CUDA GPU"),
        "flash_attention_3": ("is_flash_attn_3_available", "the flash-attn 3 package (hopper build) and a CUDA GPU"),
        "flex_attention": ("is_torch_flex_attn_available", "torch >= 2.5 with flex attention"),
    }  # fmt: skip
    if attn not in probes:
        return
    probe, needs = probes[attn]
    available = getattr(utils, probe, None)
    if available is not None and not available():
        raise ValueError(f"--attn {attn} is not available here: it needs {needs}; use --attn sdpa instead")


def max_trained_length(model_config: Any) -> tuple[int | None, str]:
    """``(tokens, why)``: the longest sequence the model's positions cover (``None``: no limit known)."""
    limit = getattr(model_config, "max_position_embeddings", None)
    rope = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, Mapping) else None
    if limit is None:
        return None, ""
    if kind in _SCALED_ROPE and rope.get("factor"):
        base = rope.get("original_max_position_embeddings") or limit
        scaled = int(base * float(rope["factor"]))
        if scaled > limit:
            return (
                scaled,
                f"max_position_embeddings {limit}, RoPE {kind} scaling x{rope['factor']} -> {scaled}",
            )
    return limit, f"max_position_embeddings {limit}"


def check_seq_len_fits(seq_len: int, model_config: Any, model: str) -> None:
    """Refuse a ``--seq-len`` beyond the positions the model was built for (garbage, not an error,
    if it ran): the fix is a model with RoPE scaling (``rope_scaling`` in its ``config.json``)."""
    limit, why = max_trained_length(model_config)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"--seq-len {seq_len} is longer than model {model!r} covers ({why}): positions past {limit} were "
            f"never trained. Use --seq-len <= {limit}, or a model whose config.json extends its context "
            '(rope_scaling, e.g. {"rope_type": "yarn", "factor": 4.0}) or raises max_position_embeddings'
        )
