"""Kimi delta attention (KDA, Kimi-Linear ``KimiLinearDeltaAttention``) under Ulysses sequence
parallelism: gated delta-net with a per-channel decay ``g [B, S, H, D]`` instead of per-head.

``KDA`` is the handler (``mixers.base.MixerHandler``). It recognises the mixer by structure: a
depthwise ``conv1d`` over ``[q | k | v]`` channels, a ``forget_gate`` module (the per-channel decay,
holding ``A_log``/``dt_bias``), ``num_heads``/``head_dim``, and a modeling module whose forward
calls ``causal_conv1d_fn`` and ``chunk_kimi_delta_attention``. The mechanism is the gated delta-net's
(``mixers.linear_attn``): halo convolution on local tokens, one packed all-to-all of q/k/v/decay/beta,
the model's own chunked KDA rule over the full sequence for the local heads, one all-to-all back. The
decay is computed by the model on the local tokens from the full ``A_log``/``dt_bias``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from ulysses_sp.mixers.documents import PositionTracker
from ulysses_sp.mixers.linear_attn import check_heads, wrap_linear_attention

CONV_FN = "causal_conv1d_fn"
SCAN_FN = "chunk_kimi_delta_attention"
ATTRS = ("conv1d", "forget_gate", "num_heads", "head_dim", "b_proj")


class KimiDeltaAttentionHandler:
    """Shards KDA mixers: heads over the SP group (see the module doc)."""

    name = "kimi_delta_attention"

    def __init__(self, positions: PositionTracker | None = None) -> None:
        self.positions = positions
        """Where the forward's position ids come from (``apply_mixers`` binds one; ``None``: every
        row one document)."""

    def matches(self, module: nn.Module) -> bool:
        modeling = sys.modules.get(type(module).__module__)
        return (
            all(hasattr(module, a) for a in ATTRS)
            and isinstance(module.conv1d, nn.Conv1d)
            and callable(getattr(modeling, CONV_FN, None))
            and callable(getattr(modeling, SCAN_FN, None))
        )

    def check(self, module: nn.Module, sp_size: int) -> None:
        heads = module.num_heads
        check_heads(f"{type(module).__name__} (KDA)", heads, heads, sp_size)

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        self.check(module, mesh.sp_size)
        what = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
        return wrap_linear_attention(
            module, mesh, self.positions, conv_fn=CONV_FN, scan_fns=(SCAN_FN,), what=what
        )


HANDLER = KimiDeltaAttentionHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
