"""The heads' output width an attention module reads from its input's size, told the width of a rank's heads.

TrOCR's decoder attention takes its output width from its input, not from an attribute::

    bsz, tgt_len, embed_dim = hidden_states.size()
    ...
    attn_output = attn_output.reshape(bsz, tgt_len, embed_dim)  # [B, S, H, D] -> [B, S, H*D]
    attn_output = self.out_proj(attn_output)

Its input is ``h = H * D`` wide; on a rank's heads (``mixers/own_scores.py``) the heads' output is
``H_l * D`` wide, so that reshape fails. Shrinking an attribute cannot fix a width read from a tensor;
``reported_width(x, width)`` does: a ``TorchFunctionMode`` scoped to the module's call in which ``x``'s
``size()`` and ``shape`` (that one tensor's, by identity) report ``width`` as the last size. Every
operation runs as it is (the q/k/v projections read all ``h`` features of ``x``; gradients unchanged),
fake tensors included (the rehearsal), so the module's own forward runs unchanged on the rank's heads.

Which modules (by bytecode, never by name): those whose forward stores a width local (``embed_dim``,
``hidden_size``, ``split_size``) only as the last item of unpacking its first argument's ``size()`` or
``shape``. A width local assigned any other way is refused by the fallback (``width_refusal``): what it
holds is not known. Shape legend: ``B`` batch, ``S`` sequence, ``h`` hidden, ``H_l`` a rank's heads, ``D`` head dim.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

WIDTH_LOCALS = ("embed_dim", "hidden_size", "split_size")
"""Local names a forward may hold the heads' output width in (``H * D``: the hidden size)."""
_CALLS = {"PRECALL", "CALL", "CACHE"}


def width_refusal(module: nn.Module) -> str | None:
    """Why the fallback cannot run ``module`` on a share of its heads for a width local (``None``: it can)."""
    forward = inspect.unwrap(type(module).forward)
    local = sorted(set(forward.__code__.co_varnames) & set(WIDTH_LOCALS))
    if local and not input_width(type(module)):
        return (f"its forward reads the heads' output width into {local[0]} other than from its input's size, "
                "so it cannot run on a share of its heads")  # fmt: skip
    return None


@functools.lru_cache(maxsize=256)
def input_width(cls: type) -> bool:
    """Whether ``cls.forward`` has width locals and stores each only as the last item of unpacking its first
    argument's ``size()`` or ``shape`` (``bsz, tgt_len, embed_dim = hidden_states.size()``)."""
    forward = inspect.unwrap(cls.forward)
    first = list(inspect.signature(forward).parameters)[1]
    ins = [i for i in dis.get_instructions(forward) if i.opname not in _CALLS]
    stores = [n for n, i in enumerate(ins) if i.opname in ("STORE_FAST", "STORE_DEREF") and i.argval in WIDTH_LOCALS]
    return bool(stores) and all(_unpacked_from_size(ins, n, first) for n in stores)


def _unpacked_from_size(ins: list[dis.Instruction], n: int, first: str) -> bool:
    """Whether store ``n`` is the last of ``first.size()``'s (or ``first.shape``'s) unpacked items."""
    for k in range(1, min(n, 8) + 1):
        op = ins[n - k]
        if op.opname == "UNPACK_SEQUENCE":
            return op.argval == k and n >= k + 2 and ins[n - k - 1].argval in ("size", "shape") \
                and ins[n - k - 2].opname == "LOAD_FAST" and ins[n - k - 2].argval == first  # fmt: skip
        if op.opname not in ("STORE_FAST", "STORE_DEREF"):
            return False
    return False


class _ReportedWidth(TorchFunctionMode):
    """While active: ``x.size()`` / ``x.shape`` (of this one tensor) report ``width`` as the last size."""

    def __init__(self, x: torch.Tensor, width: int) -> None:
        super().__init__()
        self.x, self.width = x, width

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))  # this mode is off inside its own handler: every op runs as it is
        if func not in (torch.Tensor.size, torch.Tensor.shape.__get__) or not args or args[0] is not self.x:
            return out
        if isinstance(out, torch.Size):  # [B, S, h] -> [B, S, width]
            return torch.Size([*out[:-1], self.width])
        dim = args[1] if len(args) > 1 else (kwargs or {}).get("dim")
        return self.width if dim % self.x.dim() == self.x.dim() - 1 else out


def reported_width(x: torch.Tensor, width: int | None) -> contextlib.AbstractContextManager:
    """A context in which ``x`` ``[B, S, h]`` reports its size as ``[B, S, width]`` (every operation on it, and
    its gradients, unchanged); a no-op for ``width`` ``None``."""
    return contextlib.nullcontext() if width is None else _ReportedWidth(x, width)
