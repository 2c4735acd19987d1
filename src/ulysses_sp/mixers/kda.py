"""Kimi delta attention (KDA: Kimi-Linear ``KimiLinearDeltaAttention``, Ling/Bailing hybrid
``BailingHybridDeltaAttention``) under Ulysses sequence parallelism: gated delta-net with a
per-channel decay ``g [B, S, H, D]`` instead of per-head. Two handlers, one per way the model makes
that decay (both call the same ``chunk_kimi_delta_attention``).

``HANDLER`` (``KimiDeltaAttentionHandler``, a ``mixers.base.MixerHandler``) recognises the mixer by structure: a
depthwise ``conv1d`` over ``[q | k | v]`` channels, a ``forget_gate`` module (the per-channel decay,
holding ``A_log``/``dt_bias``), ``num_heads``/``head_dim``, and a modeling module whose forward
calls ``causal_conv1d_fn`` and ``chunk_kimi_delta_attention``. The mechanism is the gated delta-net's
(``mixers.linear_attn``): halo convolution on local tokens, one packed all-to-all of q/k/v/decay/beta,
the model's own chunked KDA rule over the full sequence for the local heads, one all-to-all back. The
per-channel decay ``g [B, S, H, D]`` (fp32) would be the largest thing in the exchange; it comes from
a rank-``D`` feature (``forget_gate.f_a_proj``, one ``[B, S, D]`` vector shared by all heads), so
that feature rides the all-to-all instead (to every rank) and each rank runs the model's own
``forget_gate`` on the full sequence with its heads' rows of ``f_b_proj``/``dt_bias``/``A_log``
(sliced inside forward: autograd returns full-parameter gradients). Per token and rank that sends
``(P-1) * D`` values in the model dtype instead of ``(P-1)/P * H * D`` in fp32.

``FULL_GATE_HANDLER`` (``FullGateKdaHandler``) is for a decay made by a full-rank projection (Bailing's
``forget_gate.f_proj``: hidden -> ``H * D``, then ``dt_bias`` and a per-head ``A_log [H]``): there is
no narrower feature to send, so it goes as gated delta-net's decay does — the model computes it on
the local tokens from the full parameters (full-parameter gradients, no slicing) and it rides the
packed all-to-all head-sharded with q, k, v and beta: ``(P-1)/P * H * D`` more values per token, in
the model dtype. Everything else is the mechanism above, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from ulysses_sp.mixers._kernels import replace_forward
from ulysses_sp.mixers.linear_attn import LinearAttentionHandler, in_sharded_forward, wrap_linear_attention

SCAN_FN = "chunk_kimi_delta_attention"
ATTRS = ("conv1d", "forget_gate", "num_heads", "head_dim", "b_proj")
GATE_ATTRS = ("f_a_proj", "f_b_proj", "dt_bias", "A_log", "head_dim")
FULL_GATE_ATTRS = ("f_proj", "dt_bias", "A_log", "head_dim", "num_heads")


class _KdaHandler(LinearAttentionHandler):
    """What both KDA handlers share: the scan, the attributes, one key head per value head."""

    label = "KDA"
    attrs = ATTRS
    scan_fn = SCAN_FN

    def heads(self, module: nn.Module) -> tuple[int, int]:
        return module.num_heads, module.num_heads


class KimiDeltaAttentionHandler(_KdaHandler):
    """Shards KDA mixers: heads over the SP group (see the module doc)."""

    name = "kimi_delta_attention"

    def matches(self, module: nn.Module) -> bool:
        return (
            super().matches(module)
            and all(hasattr(module.forget_gate, a) for a in GATE_ATTRS)
            and module.forget_gate.A_log.dim() == 4  # [1, 1, H, 1]
        )

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        self.check(module, mesh.sp_size)
        what = self.what(module)
        gate = module.forget_gate
        own = [False]  # True while local_decay runs the gate's own forward on the gathered features

        def feature(original: Callable[..., Any], hidden_states: torch.Tensor) -> torch.Tensor:
            if own[0] or not in_sharded_forward():
                return original(hidden_states)
            return gate.f_a_proj(hidden_states)  # the model passes this [B, S_l, D] feature as ``g``

        def local_decay(features: torch.Tensor) -> torch.Tensor:
            prev, own[0] = own[0], True
            try:
                return _local_decay(gate, features, mesh.sp_rank, mesh.sp_size)
            finally:
                own[0] = prev

        undos = [replace_forward(gate, feature)]
        undos.append(wrap_linear_attention(module, mesh, self.positions, conv_fn=self.conv_fn, scan_fns=(self.scan_fn,),
                                           what=what, local_decay=local_decay))  # fmt: skip

        def undo() -> None:
            for u in reversed(undos):
                u()

        return undo


def _local_decay(gate: nn.Module, features: torch.Tensor, sp_rank: int, sp_size: int) -> torch.Tensor:
    """``[B, S, D]`` gate features -> ``[B, S, H_l, D]``: the model's ``forget_gate`` forward on this
    rank's heads (``f_b_proj`` rows, ``dt_bias``, ``A_log`` sliced here, so gradients reach the full
    parameters); ``f_a_proj`` already ran on the owning rank (an identity here: exact)."""
    heads, dim = gate.A_log.shape[2], gate.head_dim
    h0, n = sp_rank * heads // sp_size, heads // sp_size
    eye = torch.eye(features.shape[-1], dtype=gate.f_a_proj.weight.dtype, device=features.device)
    params = {
        "f_a_proj.weight": eye,  # [D, D]: the feature is f_a_proj's output already
        "f_b_proj.weight": gate.f_b_proj.weight.narrow(0, h0 * dim, n * dim),  # [H_l*D, D]
        "dt_bias": gate.dt_bias.narrow(0, h0 * dim, n * dim),  # [H_l*D]
        "A_log": gate.A_log.narrow(2, h0, n),  # [1, 1, H_l, 1]
    }
    return functional_call(gate, params, (features,), strict=False)


HANDLER = KimiDeltaAttentionHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""


class FullGateKdaHandler(_KdaHandler):
    """Shards KDA mixers whose decay comes from a full-rank ``forget_gate.f_proj`` (Bailing): heads
    over the SP group, the decay exchanged with q, k, v and beta (see the module doc)."""

    name = "kda_full_gate"

    def matches(self, module: nn.Module) -> bool:
        gate = getattr(module, "forget_gate", None)
        return (
            super().matches(module)
            and all(hasattr(gate, a) for a in FULL_GATE_ATTRS)
            and not hasattr(gate, "f_a_proj")  # a low-rank gate: KimiDeltaAttentionHandler's
            and isinstance(gate.f_proj, nn.Linear)
            and gate.f_proj.out_features == gate.num_heads * gate.head_dim  # [hidden] -> [H*D], per token
            and gate.A_log.shape == (gate.num_heads,)  # [H]: per head, token-local
        )


FULL_GATE_HANDLER = FullGateKdaHandler()
"""An unbound instance for ``claimed_by``; ``apply_mixers`` binds its own."""
