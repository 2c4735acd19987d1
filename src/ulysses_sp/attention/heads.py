"""One rank's view of an attention layer after the all-to-all: its slice of the query heads.

After ``qkv_seq_to_heads`` rank ``j`` of the Ulysses group holds query heads
``[j*H_l, (j+1)*H_l)`` of the full sequence (DESIGN.md step 4) and the core attention runs on them
alone. Whatever the core reads **per head** must be cut to the same slice:

- the kv-group ratio ``H_l / Hkv_l`` (differs from the model's ``H / Hkv`` when ``Hkv < P`` and kv
  heads were replicated before the exchange);
- **attention sinks** (gpt-oss, MiMo-V2-Flash, GraniteSWA, DeepSeek-V4...): one learned logit per
  query head that joins every query's softmax. Transformers hands them to the attention function as
  ``s_aux`` and the models' own eager functions read them as ``module.sinks``; both are ``[H]``. They
  are sliced **inside forward** (a view of the parameter), so autograd returns a gradient in the full
  parameter's shape, zero outside this rank's heads: the SP group's gradient sum assembles it whole.

Per-**query** inputs a model computes on its shard (per-token sinks ``[B, H, S_l, 1]``, relative
position biases) are not per-head parameters: they are refused, naming the tensor.

``HeadView`` is what the core function receives in place of the module: every attribute is the
module's except the overridden ones; the module itself is never modified.

Shape legend: ``H`` query heads, ``H_l = H/U`` query heads per rank (``U`` the Ulysses group size),
``Hkv_l`` kv heads on this rank, ``B`` batch, ``S`` full sequence.
"""

from __future__ import annotations

from typing import Any

import torch

SINK_ATTRS = ("sinks",)
"""Module attributes the models' own attention functions read per-head sinks from."""
PER_QUERY_KWARGS = ("sinks", "position_bias")
"""Keyword arguments some models compute per query on the local shard (per-token sinks, relative
position biases): refused, not sliced."""


class HeadView:
    """The attention module as one rank's core attention sees it: ``overrides`` win, the rest is the
    module's (read-only view; setting an attribute on it raises)."""

    __slots__ = ("_module", "_overrides")

    def __init__(self, module: torch.nn.Module, overrides: dict[str, Any]) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name: str) -> Any:
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_module"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"HeadView of {type(self._module).__name__} is read-only (set {name!r} on the module)"
        )


def head_slice(tensor: torch.Tensor, num_heads: int, rank: int, local_heads: int) -> torch.Tensor:
    """``[H, ...] -> [H_l, ...]``: this rank's query heads of a per-head tensor (a differentiable view).

    Raises ``ValueError`` naming the shapes when the first dim is not the model's ``H`` heads.
    """
    if tensor.dim() < 1 or tensor.shape[0] != num_heads:
        raise ValueError(
            f"per-head attention sinks of shape {tuple(tensor.shape)} do not have one entry per query head "
            f"({num_heads}); sequence parallelism needs [num_attention_heads] sinks to give each rank its heads'"
        )
    return tensor[rank * local_heads : (rank + 1) * local_heads]


def local_view(
    module: torch.nn.Module,
    kwargs: dict[str, Any],
    *,
    num_heads: int,
    local_heads: int,
    local_kv_heads: int,
    rank: int,
) -> HeadView:
    """The module as this rank's core sees it, and ``kwargs['s_aux']`` cut to its heads (in place).

    Args:
        num_heads: ``H``, the model's query heads (before the all-to-all).
        local_heads, local_kv_heads: ``H_l`` and ``Hkv_l`` after it.
        rank: this rank's index in the all-to-all group (its heads are ``[rank*H_l, (rank+1)*H_l)``).
    """
    overrides: dict[str, Any] = {"num_key_value_groups": local_heads // local_kv_heads}
    if local_heads != num_heads:
        for name in PER_QUERY_KWARGS:
            t = kwargs.get(name)
            if isinstance(t, torch.Tensor) and t.dim() >= 3:
                raise ValueError(
                    f"{type(module).__name__} passes its attention a per-query {name!r} of shape "
                    f"{tuple(t.shape)}, computed from this rank's shard of the sequence; sequence "
                    "parallelism does not exchange it with q/k/v, so this model cannot run with sp_size > 1"
                )
        sinks = kwargs.get("s_aux")
        if isinstance(sinks, torch.Tensor):
            kwargs["s_aux"] = head_slice(sinks, num_heads, rank, local_heads)
        for name in SINK_ATTRS:
            own = getattr(module, name, None)
            if isinstance(own, torch.Tensor):
                overrides[name] = head_slice(own, num_heads, rank, local_heads)
    return HeadView(module, overrides)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head, from attention without it: exact and differentiable.

    A sink adds ``e^sink`` to every query's softmax denominator and contributes no value, so the
    output without it is rescaled by ``e^lse / (e^lse + e^sink) = sigmoid(lse - sink)``.

    Args:
        out: ``[B, H_l, S, D]`` attention output without sinks; lse: ``[B, H_l, S]`` its log-sum-exp
            (``-inf`` for a query that sees no key); sinks: ``[H_l]`` this rank's sink logits.

    Returns:
        ``[B, H_l, S, D]`` in ``out``'s dtype (the rescale in at least fp32).
    """
    acc = torch.promote_types(lse.dtype, torch.float32)
    # [B, H_l, S] - [1, H_l, 1] -> [B, H_l, S, 1]
    scale = torch.sigmoid(lse.to(acc) - sinks.to(acc)[None, :, None])[..., None]
    return (out.to(acc) * scale).to(out.dtype)
