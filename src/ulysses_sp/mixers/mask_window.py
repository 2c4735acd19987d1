"""Attention whose sliding window lives only in the model's mask (Phi-MoE and kin): the SP attention is
told the window the mask applied.

Such a decoder builds its mask with ``create_sliding_window_causal_mask`` whenever
``config.sliding_window`` is set (the same window in every layer), and its attention module hands that
mask to the attention function without naming ``sliding_window``. The SP attention builds its own mask
from the global positions (the model's mask covers one shard), so it would attend over the whole
causal past. This handler passes ``sliding_window=config.sliding_window`` to the module's forward,
whose ``**kwargs`` carry it to the attention function: the SP attention then applies the same window
(key ``k`` is seen by query ``q`` when ``0 <= q - k < W``, transformers' ``sliding_window_overlay``),
per packed document as always. Nothing is exchanged; any sp size and the ring layout too.

Matched by structure, never by model name: a decoder layer's module (it has a ``layer_idx``) whose code
dispatches through transformers' ``ALL_ATTENTION_FUNCTIONS``, takes ``**kwargs`` and never names ``sliding_window``, with a
``config`` whose ``sliding_window`` is an int, no per-layer ``layer_types`` (so every layer gets the
window) and whose modeling file builds a sliding-window mask.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from ulysses_sp.mixers._kernels import replace_forward
from ulysses_sp.mixers.classify import ATTENTION, code_constants, code_names, verdict


class MaskWindowHandler:
    """Gives the SP attention the sliding window a model applies only through its mask (module docstring)."""

    name = "mask_window"
    attention = True
    """The module is the SP attention itself (the guard still checks its children)."""
    plain_layout_only = False
    """The SP attention applies a window in any token order (the ring's too)."""

    def __init__(self, positions: Any = None) -> None:
        del positions  # the window is a number: no document layout needed here

    def matches(self, module: nn.Module) -> bool:
        config = getattr(module, "config", None)
        if not isinstance(getattr(config, "sliding_window", None), int) or getattr(config, "layer_types", None):
            return False
        cls = type(module)
        modeling = sys.modules.get(cls.__module__)
        params = inspect.signature(cls.forward).parameters.values()
        return (
            verdict(module).kind == ATTENTION  # transformers' registry, not one of its own
            and isinstance(getattr(module, "layer_idx", None), int)  # a decoder layer's (not a vision tower's)
            and "sliding_window" not in code_names(cls, depth=0) | code_constants(cls)
            and callable(getattr(modeling, "create_sliding_window_causal_mask", None))
            and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        )

    def check(self, module: nn.Module, sp_size: int) -> None:
        del module, sp_size  # every sp size: a window is a rule on positions

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        del mesh
        window = module.config.sliding_window

        def forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("sliding_window", window)  # reaches the attention function through **kwargs
            return original(*args, **kwargs)

        return replace_forward(module, forward)


HANDLER = MaskWindowHandler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
