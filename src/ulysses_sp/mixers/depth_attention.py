"""Attention across depth, per token (Inkling-2's block attention residuals): position-wise under sequence
parallelism, run on the shard with its own eager attention.

Inkling-2 (and its Loop variant) mixes each token's states of earlier layer blocks with learned queries:
``Inkling2BlockAttentionResidual(block_states [B, S_l, N, h], partial [B, S_l, h])`` stacks them to
``[B, S_l, N+1, h]`` and calls transformers' attention interface with queries ``[B, S_l, Q, h]`` — the
sequence in the *heads* dim, the blocks in the sequence dim, no mask, ``is_causal = False``. Each token
attends over its own depth only: nothing crosses tokens, so a shard computes its tokens exactly. But the
SP attention registered in the interface would exchange those "heads" (tokens) for "sequence" (blocks):
so while such a module runs, its config names ``eager`` (``pair_bias.plain_core``).

Matched by structure: attention through the interface (``classify``), ``is_causal`` False, a forward
that takes no ``attention_mask``, and no projection of its own (no ``Linear``/``Conv1d``: learned query
parameters only). No communication, no extra memory.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ulysses_sp.mixers._kernels import replace_forward
from ulysses_sp.mixers.classify import ATTENTION, verdict
from ulysses_sp.mixers.pair_bias import plain_core


def depth_attention(module: nn.Module) -> bool:
    """Whether ``module`` is per-token attention across depth (see the module docstring)."""
    if getattr(module, "is_causal", None) is not False or verdict(module).kind != ATTENTION:
        return False
    if "attention_mask" in inspect.signature(type(module).forward).parameters:
        return False
    return not any(isinstance(m, (nn.Linear, nn.Conv1d)) for m in module.modules())


class DepthAttentionHandler:
    """Runs per-token depth attention on the shard with its eager attention (module docstring)."""

    name = "depth_attention"
    plain_layout_only = False
    """Per token: any token order (the ring's zigzag too)."""

    def __init__(self, positions: Any = None) -> None:
        self.positions = positions

    def matches(self, module: nn.Module) -> bool:
        return depth_attention(module)

    def check(self, module: nn.Module, sp_size: int) -> None:
        del module, sp_size  # any sp size: nothing is exchanged

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        del mesh

        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            with plain_core(module):
                return original(*args, **kwargs)

        return replace_forward(module, forward)


HANDLER = DepthAttentionHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
