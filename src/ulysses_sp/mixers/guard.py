"""The closed-world guard: a model trained with sequence parallelism is exact, or refused before step 1.

Under SP each rank runs the model on ``S_l = S/P`` tokens. That is exact only where every module
either acts on each token alone or is a token mixer SP knows how to shard (the registered SP
attention; a sequence mixer a handler of ``mixers`` claims). Anything else — a short convolution,
a Mamba scan, a linear attention, a token shift — silently runs on the local shard alone. So
before the first step ``check_sequence_mixing`` classifies **every module of every decoder layer**
(and the modules of the decoder stack around the layers: embeddings, final norm, rotary table)
with ``classify.verdict`` and refuses, on every rank (the verdict is a pure function of the model,
the same everywhere: no collective), every module that is not

- the SP attention (its code dispatches through transformers' ``AttentionInterface``),
- position-wise (linear, norm, activation, dropout, embedding, rotary table, MoE router/experts,
  or a class declared with ``declare_position_wise``), or
- a sequence mixer claimed by one of ``handlers`` (``SUPPORTED_MIXERS``: the handlers of
  ``mixers.apply``, which ``initialize`` and ``prepare`` apply right after the check).

The config's layer types (``layer_types``, ``layers_block_type``) are a second witness: a layer
the config calls a mixer (``linear_attention``, ``conv``, ``mamba``, ...) must hold a claimed
mixer, and a layer it calls attention must hold an attention module. The refusal names the layer,
the module path and class, and why::

    layer 0: conv (Lfm2ShortConv) mixes tokens along the sequence (Conv1d, kernel 3), which
    sequence parallelism does not shard

A vision-language model is checked through its language model when ``ulysses_sp.vlm`` admits its
family (its vision tower encodes whole frames on a rank, so it mixes nothing across shards); any other
model with a vision or audio encoder is refused by name (``vlm.families.multimodal_refusal``).

Runs in ``initialize()`` (the CLI's path too) and in ``integrations.transformers.prepare``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ulysses_sp.attention.registration import layer_kind
from ulysses_sp.mixers.apply import HANDLERS
from ulysses_sp.mixers.base import MixerHandler, claimed_by
from ulysses_sp.mixers.classify import (
    ATTENTION,
    COMPOSITE,
    DECLARED,
    MIXER,
    SCORE_OPS,
    UNKNOWN,
    Verdict,
    code_constants,
    code_names,
    verdict,
)
from ulysses_sp.mixers.own_scores import own_attention
from ulysses_sp.mixers.own_scores import refusal as own_refusal
from ulysses_sp.mixers.pair_bias_cuts import bias_child, pair_cut
from ulysses_sp.mixers.stack import architecture_refusal, around_layers, decoder_layers
from ulysses_sp.vlm.families import multimodal_refusal, vlm_parts

PAIR_BIAS = "position_bias"
"""The keyword a model passes its attention function a ``[B, H, S_q, S_k]`` additive bias by (T5-style
relative positions, Inkling's relative logits, ALiBi tables)."""

SUPPORTED_MIXERS: tuple[MixerHandler, ...] = HANDLERS
"""The mixers SP shards (``mixers.apply``: short convolution, Mamba-2, Mamba-1, gated delta-net, KDA, causal windows), which
``initialize`` and ``prepare`` wrap right after this check."""


@dataclass(frozen=True)
class Finding:
    """One module of the model and what the guard made of it."""

    layer: int | None
    """The decoder layer's index; ``None`` for the modules around the layers."""
    path: str
    """The module's path inside its layer (or inside the decoder stack)."""
    cls: str
    kind: str
    """``attention``, ``mixer`` (claimed by a handler: supported), or ``refused``."""
    why: str = ""

    def message(self) -> str:
        where = f"layer {self.layer}" if self.layer is not None else "decoder stack"
        name = f"{self.path} ({self.cls})" if self.path else self.cls
        return f"{where}: {name} {self.why}"


class PositionWiseDeclaration:
    """What ``declare_position_wise`` returns; ``remove()`` (or leaving a ``with`` block) undoes it."""

    def __init__(self, classes: Sequence[type]) -> None:
        self._previous = [(cls, vars(cls).get(DECLARED)) for cls in classes]
        for cls in classes:
            setattr(cls, DECLARED, True)

    def remove(self) -> None:
        for cls, previous in reversed(self._previous):
            if previous is None:
                if DECLARED in vars(cls):
                    delattr(cls, DECLARED)
            else:
                setattr(cls, DECLARED, previous)
        self._previous = []

    def __enter__(self) -> PositionWiseDeclaration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def declare_position_wise(*classes: type[nn.Module]) -> PositionWiseDeclaration:
    """Declare module classes that act on every token alone, for the closed-world guard.

    A custom module the guard cannot place (an unknown leaf, or a module whose code it reads as a
    sequence operation) is refused under sequence parallelism. When you know that ``cls`` computes
    each token's output from that token's input only, declare it; its instances (and everything
    inside them) then count as position-wise. Exactly the classes given: a subclass is not covered.

    Returns:
        A handle; ``handle.remove()`` (or ``with declare_position_wise(...):``) takes it back.
    """
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"declare_position_wise takes torch.nn.Module subclasses, got {cls!r}")
    return PositionWiseDeclaration(classes)


def layer_types(model: nn.Module) -> list[str] | None:
    """The config's per-layer types (``layer_types`` or ``layers_block_type``), when it has them."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("layer_types", "layers_block_type"):
        types = getattr(text, key, None)
        if isinstance(types, (list, tuple)) and types and all(isinstance(t, str) for t in types):
            return list(types)
    return None


def classify_model(model: nn.Module, handlers: Iterable[MixerHandler] = SUPPORTED_MIXERS) -> list[Finding]:
    """Every attention module, claimed mixer and refused module of ``model`` (see the module docstring).

    Pure: reads the model's structure and classes, runs nothing; the same answer on every rank.
    """
    handlers = tuple(handlers)
    if (whole := architecture_refusal(model)) is not None:  # no token sequence to shard: its layers do not matter
        return [Finding(None, "", type(model).__name__, "refused", whole)]
    parts = vlm_parts(model)  # an admitted VLM: its tower encodes whole frames on a rank; check the decoder
    stack, layers = decoder_layers(model if parts is None else parts.language_model)
    mm = multimodal_refusal(model)
    findings = [] if mm is None else [Finding(None, "", type(model).__name__, "refused", mm)]
    for name, child in around_layers(stack, layers):
        if parts is None or child is not parts.media:  # Phi-4's towers in its decoder: whole media on a rank
            findings += _walk(child, name, None, handlers)
    for i, layer in enumerate(layers):
        findings += _walk(layer, "", i, handlers)
    findings += _window_findings(model, stack, layers, findings)
    return findings + _layer_type_findings(model, layers, findings)


def refusals(model: nn.Module, handlers: Iterable[MixerHandler] = SUPPORTED_MIXERS) -> list[str]:
    """The messages of every refused module (empty: sequence parallelism is exact for this model)."""
    return [f.message() for f in classify_model(model, handlers) if f.kind == "refused"]


def check_sequence_mixing(
    model: Any, *, sp_size: int, handlers: Iterable[MixerHandler] = SUPPORTED_MIXERS
) -> None:
    """Raise ``ValueError`` naming every module sequence parallelism would get wrong (``sp_size > 1``).

    Models without a transformers config (plain ``nn.Module``s the user shards himself) are not
    checked: their attention is not ours to know.
    """
    if (
        sp_size <= 1
        or not isinstance(model, nn.Module)
        or not hasattr(getattr(model, "config", None), "to_dict")
    ):
        return
    found = refusals(model, handlers)
    if found:
        raise ValueError(
            f"sequence parallelism (sp_size {sp_size}) cannot train {type(model).__name__} exactly: each rank "
            "holds only its shard of the sequence, and these modules would mix tokens within the shard "
            "alone:\n  " + "\n  ".join(found) + "\nTrain it with sp_size 1, or, for a custom module that "
            "does act on every token alone, call ulysses_sp.declare_position_wise(ItsClass) first."
        )


def check_document_mixing(model: Any, *, what: str = "packed documents") -> None:
    """Raise ``ValueError`` when ``model`` cannot keep packed documents apart without sequence
    parallelism (sp 1, rows of several documents whose ``position_ids`` restart at 0).

    At sp 1 documents stay apart only where every module that mixes tokens takes its document
    boundaries from ``position_ids``: the SP attention (``train`` routes sp 1 through it for every
    plain-attention text model) and the mixers a handler claims (applied at sp 1 too). A module the
    guard refuses at sp > 1 mixes the whole row at sp 1, across documents; so does a sparse or
    compressed attention kind other than DSA's (its own forward picks keys from the whole row; DSA's
    indexer runs per document through ``attention/indexer.py``; DeepSeek-V4's pooled K/V per document
    through ``attention/pooled_kv.py``), and a claimed module whose handler says so (``packed_refusal``:
    CPM-Ant's one prompt per row). Those are refused for packed rows here.
    """
    from ulysses_sp.attention.layer_kinds import packed_refusal

    if not isinstance(model, nn.Module) or not hasattr(getattr(model, "config", None), "to_dict"):
        return
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    found = [f"layer {i}: {kind!r} {why}" for i, kind in enumerate(getattr(text, "layer_types", None) or ())
             if (why := packed_refusal(text, kind))]  # fmt: skip
    found += refusals(model)
    found += _packed_refusals(model)
    if found:
        raise ValueError(
            f"{what} cannot be kept apart in {type(model).__name__}: these modules mix tokens across the "
            "whole row, not within each document (the model would attend across documents):\n  "
            + "\n  ".join(found) + "\nTrain it with one sample per row (--packing none), or, for a custom "
            "module that does act on every token alone, call ulysses_sp.declare_position_wise(ItsClass) first."
        )


def _packed_refusals(model: nn.Module) -> list[str]:
    """Claimed modules whose handler says packed documents cannot be kept apart in them (``packed_refusal``:
    CPM-Ant's attention over one prompt-prefixed row), once per class."""
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        handler = claimed_by(module, SUPPORTED_MIXERS)
        why = getattr(handler, "packed_refusal", lambda _: None)(module) if handler is not None else None
        if why:
            out.setdefault(type(module).__name__, f"{name} ({type(module).__name__}): {why}")
    return list(out.values())


def _walk(
    root: nn.Module, prefix: str, layer: int | None, handlers: tuple[MixerHandler, ...]
) -> list[Finding]:
    """Findings for ``root`` and its subtree, top-down; a refused module is reported once, at the
    top-most module of its subtree that shows the mixing (with its children's evidence)."""
    handler = claimed_by(root, handlers)
    if handler is not None and not getattr(handler, "attention", False):  # an attention handler: walked on
        return [
            Finding(layer, prefix, type(root).__name__, "mixer", f"is sharded by the {handler.name} handler")
        ]
    v = verdict(root)
    if handler is not None and v.kind == ATTENTION:
        v = Verdict(ATTENTION, f"its window is set by the {handler.name} handler")
    if v.kind in (MIXER, UNKNOWN):
        evidence = [*_child_evidence(root, handlers), v.why]
        text = "; ".join(dict.fromkeys(e for e in evidence if e))
        why = (
            f"mixes tokens along the sequence ({text}), which sequence parallelism does not shard"
            if v.kind == MIXER
            else f"is {text}"
        )
        if v.kind == MIXER and own_attention(root) and (reason := own_refusal(root)):
            why = f"computes its own attention scores ({v.why}), and its heads cannot run apart: {reason}"
        return [Finding(layer, prefix, type(root).__name__, "refused", why)]
    if v.kind == ATTENTION and PAIR_BIAS in code_constants(type(root)):
        cut = pair_cut(root) if bias_child(root) is not None else None  # the pair_bias handler's, when it has one
        return [Finding(layer, prefix, type(root).__name__, "refused",
                        f"passes its attention a relative-position bias over token pairs ({PAIR_BIAS}, [B, H, S_q, "
                        "S_k]) built from the tokens it is given: on a shard it covers only the pairs within the "
                        "shard, and the SP attention exchanges q, k and v, not a bias per pair"
                        + (f"; its heads cannot run apart either: {cut}" if isinstance(cut, str) else ""))]  # fmt: skip
    out = [Finding(layer, prefix, type(root).__name__, ATTENTION, v.why)] if v.kind == ATTENTION else []
    if v.kind in (ATTENTION, COMPOSITE):
        for name, child in root.named_children():
            out += _walk(child, f"{prefix}.{name}" if prefix else name, layer, handlers)
    return out


def _child_evidence(root: nn.Module, handlers: tuple[MixerHandler, ...]) -> list[str]:
    """Why the modules below ``root`` mix tokens (convolution kernels, scans) — for the message."""
    found = []
    for child in root.modules():
        if child is root or claimed_by(child, handlers) is not None:
            continue
        v = verdict(child)
        if v.kind == MIXER:
            found.append(v.why)
    return found


def _layer_type_findings(model: nn.Module, layers: nn.ModuleList, findings: list[Finding]) -> list[Finding]:
    """What the config's layer types say that the modules did not already show."""
    types = layer_types(model)
    out = []
    by_layer: dict[int, set[str]] = {}
    for f in findings:
        if f.layer is not None:
            by_layer.setdefault(f.layer, set()).add(f.kind)
    for i in range(len(layers)):
        kinds = by_layer.get(i, set())
        t = types[i] if types is not None and i < len(types) else None
        if t is None or "refused" in kinds:
            continue
        kind = layer_kind(t)
        if kind == MIXER and "mixer" not in kinds:
            suspects = ", ".join(f"{n} ({type(m).__name__})" for n, m in _suspects(layers[i]))
            out.append(Finding(i, "", type(layers[i]).__name__, "refused",
                               f"is a {t!r} layer (the config's layer types): a sequence mixer other than attention "
                               f"({suspects or 'no module of it'}) that sequence parallelism does not shard"))  # fmt: skip
        elif kind == ATTENTION and ATTENTION not in kinds:
            out.append(Finding(i, "", type(layers[i]).__name__, "refused",
                               f"is a {t!r} layer (the config's layer types), but none of its modules calls "
                               "transformers' attention interface, so the SP attention cannot run in it"))  # fmt: skip
    if not any(f.kind in (ATTENTION, "mixer") or f.kind == "refused" for f in findings + out):
        out.append(Finding(None, "", type(model).__name__, "refused",
                           "has no layer whose attention calls transformers' attention interface, so the SP "
                           "attention cannot run in it"))  # fmt: skip
    return out


def _suspects(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of a mixer layer that compute token-to-token products (matmul, einsum) in their
    own code; else every child that is not position-wise."""
    others = [(n, m) for n, m in layer.named_children() if verdict(m).kind != "position-wise"]
    scoring = [(n, m) for n, m in others if code_names(type(m), depth=0) & SCORE_OPS]
    return scoring or others


def _window_findings(
    model: nn.Module, stack: nn.Module, layers: nn.ModuleList, found: list[Finding]
) -> list[Finding]:
    """Attention modules whose sliding window lives only in the model's mask: the decoder stack builds
    a sliding-window mask (``config.sliding_window`` set) but the attention module never passes
    ``sliding_window`` to the attention function — the SP attention, which builds its own
    full-sequence mask from positions, would attend over the whole causal past."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if not isinstance(window, int) or "create_sliding_window_causal_mask" not in code_names(type(stack)):
        return []
    out = []
    for f in found:
        if f.kind == ATTENTION and f.layer is not None and not f.why:  # f.why: a handler sets its window
            attn = layers[f.layer].get_submodule(f.path)
            if "sliding_window" not in code_names(type(attn), depth=0) | code_constants(type(attn)):
                out.append(Finding(f.layer, f.path, f.cls, "refused",
                                   f"applies its sliding window (config.sliding_window = {window}) only through the "
                                   "model's attention mask: it does not pass sliding_window to the attention "
                                   "function, and the SP attention builds its own mask from positions"))  # fmt: skip
    return out
