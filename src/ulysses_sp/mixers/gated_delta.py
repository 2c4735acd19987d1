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

from torch import nn

from ulysses_sp.mixers.linear_attn import LinearAttentionHandler

SCAN_FN = "torch_chunk_gated_delta_rule"
ATTRS = ("conv1d", "A_log", "dt_bias", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")


class GatedDeltaNetHandler(LinearAttentionHandler):
    """Shards gated delta-net mixers: key and value heads over the SP group (see the module doc)."""

    name = "gated_delta_net"
    label = "gated delta-net"
    attrs = ATTRS
    scan_fn = SCAN_FN

    def heads(self, module: nn.Module) -> tuple[int, int]:
        return module.num_k_heads, module.num_v_heads


HANDLER = GatedDeltaNetHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
