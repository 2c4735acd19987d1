"""Head groups in the plan: which ``head_chunks`` count ``ulysses-sp plan`` offers beside a setting.

Head groups (``attention/head_chunks.py``, ``--head-chunks N``) trade one more attention forward per
layer for memory: the attention backward's exchange buffers at sp > 1 and, on CUDA, the flash kernel's
backward workspace (its fp32 dq accumulator and GQA-expanded dk/dv over the full sequence) at any sp,
sp 1 included, are one group's instead of every head's. So the planner offers a grouped setting only
where it does better than one group: at ``--max`` the fewest groups that reach the longest sequence,
at a given ``--seq-len`` the fewest that fit it where one group does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ulysses_sp.attention.head_chunks import valid_head_chunks
from ulysses_sp.plan.inputs import ModelShape, Settings


def with_head_groups(
    m: ModelShape, s: Settings, fit: Callable[[Settings], int], seq_len: int | None
) -> list[tuple[Settings, int]]:
    """``[(s, fit(s))]`` and, where a head-group count does better (module docstring), ``(s with it,
    its longest sequence)``. ``fit``: a setting's longest sequence; ``seq_len``: ``None`` for ``--max``."""
    out = [(s, fit(s))]
    if not m.heads or not any(k.attention for k in m.kinds()):
        return out
    best = out[0]
    for n in valid_head_chunks(m.heads, m.kv_heads, s.sp // s.ring_size)[1:]:
        grouped = replace(s, head_chunks=n)
        longest = fit(grouped)
        if longest > best[1] and (seq_len is None or best[1] < seq_len):
            best = (grouped, longest)
    if best is out[0] or (seq_len is not None and best[1] < seq_len):
        return out
    return [*out, best]
