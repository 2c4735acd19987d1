"""What each decoder layer of a model holds, for the planner: softmax attention, an MLP, and which
sequence mixer with which sizes (``layer_kinds``).

Read off the built model's structure (on the ``meta`` device it costs nothing): a layer's mixer is
the module a handler of ``mixers.apply.HANDLERS`` claims, its sizes are that module's own attributes
(the ones the handler shards by); attention is a module the closed-world classifier places as
``ATTENTION``; the layer has an MLP when parameters remain beyond those two and the norms. Never by
model name. Plain dicts out (the ``plan`` package imports no model code): the CLI turns them into
``plan.inputs.LayerKind``.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ulysses_sp.mixers import gated_delta, kda
from ulysses_sp.mixers._kernels import model_function
from ulysses_sp.mixers.apply import HANDLERS
from ulysses_sp.mixers.base import claimed_by
from ulysses_sp.mixers.classify import ATTENTION, verdict
from ulysses_sp.mixers.stack import decoder_layers

SIZED = ("mamba2", "gated_delta_net", "short_conv", "mamba1", "mamba1_heads", "kimi_delta_attention", "kda_full_gate",
         "rg_lru", "rwkv", "lightning_attention", "mlstm")
"""The handlers whose mixers the planner sizes (``mixer_sizes``); the others (learned positions, causal
windows, a mask's window) leave their layer planned as attention and MLP."""


def _chunk(module: nn.Module, fn: str, default: int = 64) -> int:
    """The chunk length the model's scan ``fn`` runs with (its ``chunk_size`` default)."""
    f = model_function(module, fn)
    try:
        value = inspect.signature(f).parameters["chunk_size"].default if f is not None else default
    except (KeyError, TypeError, ValueError):
        return default
    return value if isinstance(value, int) else default


def mixer_sizes(module: nn.Module, kind: str) -> dict[str, Any]:
    """The sizes of a claimed mixer ``module`` of handler ``kind`` (``plan.inputs.MixerShape`` fields)."""
    if kind == "mamba2":
        return {"kind": kind, "heads": module.num_heads, "head_dim": module.head_dim, "groups": module.n_groups,
                "state": module.ssm_state_size, "chunk": module.chunk_size}  # fmt: skip
    if kind == "gated_delta_net":
        return {"kind": kind, "heads": module.num_v_heads, "head_dim": module.head_v_dim,
                "key_heads": module.num_k_heads, "key_dim": module.head_k_dim,
                "chunk": _chunk(module, gated_delta.SCAN_FN)}  # fmt: skip
    if kind == "short_conv":
        return {"kind": kind, "channels": module.conv.in_channels}
    if kind in ("mamba1", "mamba1_heads"):  # per-head projections: the same channels and state for the planner
        return {"kind": "mamba1", "channels": module.intermediate_size, "state": module.ssm_state_size}
    if kind in ("rg_lru", "rwkv"):  # per-channel scans, no state dim: Mamba-1's terms at N = 1 (not measured for
        # them; their exchange is 2 W in, W out: Mamba-1's counts W + 2 P more)
        width = module.conv_1d.in_channels if kind == "rg_lru" else module.time_decay.shape[0]
        return {"kind": "mamba1", "channels": width, "state": 1}
    if kind in ("kimi_delta_attention", "kda_full_gate"):  # Bailing's: the same scan, its decay exchanged whole
        return {"kind": "kimi_delta_attention", "heads": module.num_heads, "head_dim": module.head_dim,
                "chunk": _chunk(module, kda.SCAN_FN), "decay_exchanged": kind == "kda_full_gate"}  # fmt: skip
    if kind == "lightning_attention":  # its block is the chunk
        return {"kind": kind, "heads": module.num_attention_heads, "head_dim": module.head_dim, "chunk": module.block_size}
    if kind == "mlstm":  # planned as a gated delta-net with as many key as value heads: the same exchange (q, k,
        # v and two scalars per head in, v out) and the same chunked form; its memory terms not measured for the mLSTM
        h = module.config.num_heads
        return {"kind": "gated_delta_net", "heads": h, "head_dim": module.v_dim // h, "key_heads": h,
                "key_dim": module.qk_dim // h, "chunk": module.config.chunk_size}  # fmt: skip
    raise ValueError(f"no sizes known for mixer kind {kind!r}")


def layer_kinds(model: nn.Module) -> list[dict[str, Any]]:
    """One dict per decoder layer: ``{"attention": bool, "mlp": bool, "mixer": sizes or None,
    "mlp_width": int or None}`` — ``mlp_width``: the widest linear layer fed by the hidden state
    outside the mixer and the attention (the MLP's real width: LFM2 rounds its configured one up;
    ``None`` when the MLP has no such linear layer, e.g. experts held as stacked parameters).

    A layer with two mixers (none in transformers 5.24) reports the first."""
    _, layers = decoder_layers(model)
    width = getattr(getattr(model, "config", None), "hidden_size", 0) or 0
    out = []
    for layer in layers:
        mixer, attention, own_scores, owned = None, False, False, set()
        for _, module in layer.named_modules():
            if module in owned:
                continue
            handler = claimed_by(module, HANDLERS)
            if handler is not None and handler.name in ("own_scores", "prefix_attention", "pair_bias", "xlnet"):  # attention run head-parallel
                attention = own_scores = True  # its own dense [B, H/P, S, S] scores (and pair bias)
                owned.update(module.modules())
                continue
            if handler is not None and handler.name == "depth_attention":  # per token across depth: no sequence term
                owned.update(module.modules())
                continue
            if handler is not None and handler.name not in SIZED:  # a halo or a window: attention/MLP terms hold it
                handler = None
            if handler is not None and mixer is None:
                mixer = mixer_sizes(module, handler.name)
                owned.update(module.modules())
            elif handler is None and verdict(module).kind == ATTENTION and not attention:
                attention = True
                owned.update(module.modules())
        rest = [m for m in layer.modules() if m not in owned]
        left = sum(p.numel() for m in rest for p in m.parameters(recurse=False))
        widths = [m.out_features for m in rest if isinstance(m, nn.Linear) and m.in_features == width]
        # what is left beyond the mixer, the attention and a few norm vectors is an MLP (dense or experts)
        out.append({"attention": attention, "mlp": left > 4 * width, "mixer": mixer, "own_scores": own_scores,
                    "mlp_width": max(widths) if widths else None})  # fmt: skip
    return out
