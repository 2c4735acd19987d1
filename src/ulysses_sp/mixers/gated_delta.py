"""Gated delta-net linear attention (Qwen3-Next ``Qwen3NextGatedDeltaNet``, Qwen3.5 dense and MoE
``Qwen3_5GatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet``) under Ulysses sequence parallelism.

``GATED_DELTA`` is the handler (``mixers.base.MixerHandler``). It recognises the mixer by structure,
not by name: a depthwise ``conv1d`` over ``[q | k | v]`` channels, per-value-head ``A_log`` and
``dt_bias``, ``num_k_heads``/``num_v_heads``, and a modeling module whose forward calls
``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``. The mechanism (halo convolution, one packed
all-to-all of q/k/v/decay/beta, the model's own chunked gated-delta rule over the full sequence for
the local heads, one all-to-all back) is ``mixers.linear_attn``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from ulysses_sp.mixers.documents import PositionTracker
from ulysses_sp.mixers.linear_attn import check_heads, wrap_linear_attention

CONV_FN = "causal_conv1d_fn"
SCAN_FN = "torch_chunk_gated_delta_rule"
ATTRS = ("conv1d", "A_log", "dt_bias", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")


class GatedDeltaNetHandler:
    """Shards gated delta-net mixers: key and value heads over the SP group (see the module doc)."""

    name = "gated_delta_net"

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
        check_heads(
            f"{type(module).__name__} (gated delta-net)", module.num_k_heads, module.num_v_heads, sp_size
        )

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        self.check(module, mesh.sp_size)
        what = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
        return wrap_linear_attention(
            module, mesh, self.positions, conv_fn=CONV_FN, scan_fns=(SCAN_FN,), what=what
        )


HANDLER = GatedDeltaNetHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
