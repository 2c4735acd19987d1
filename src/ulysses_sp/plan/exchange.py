"""The attention exchange in the plan: which path a setting runs (packed or head by head) and its latency.

The layer decides at run time (``parallel/headwise.packed_exchange``) from the size of one ``[U, S_l, D]``
piece and the link's ``LinkCost`` (``parallel/exchange_cost.py``); the planner decides the same way from
the settings, so that the memory model adds the packed path's transient buffer exactly where it runs
(short sequences) and the time model counts one latency (alpha) per collective of the path.
"""

from __future__ import annotations

from ulysses_sp.parallel.exchange_cost import GLOO_SHM, NCCL_NVLINK, use_packed
from ulysses_sp.plan.hardware import Hardware, link_cost
from ulysses_sp.plan.inputs import DTYPE_BYTES, ModelShape, Settings


def packed_exchange(m: ModelShape, s: Settings, hw: Hardware | None) -> bool:
    """Whether the attention all-to-all runs packed under ``s``: pieces of ``S/R`` tokens x ``D`` in the model
    dtype on the Ulysses group's link (``hw`` ``None``: gloo on CPU, else NVLink). Never with head groups
    (they have their own exchange) or without an all-to-all."""
    u = s.sp // s.ring_size
    if u <= 1 or s.head_chunks > 1:
        return False
    link = link_cost(hw, u) if hw is not None else GLOO_SHM if s.device_type == "cpu" else NCCL_NVLINK
    return use_packed(s.exchange, s.seq_len // s.ring_size * m.head_dim * DTYPE_BYTES[s.dtype], link)


def exchange_collectives(m: ModelShape, s: Settings, hw: Hardware | None) -> int:
    """All-to-alls per pass (forward, backward or recompute) over the model's layers: one each way packed
    (and per sequence mixer), one per piece head by head (``B (H_l + 2 Hkv_l)`` in, ``B H_l`` out), one per
    head group each way with head groups; 0 without an all-to-all."""
    u = s.sp // s.ring_size
    if u <= 1:
        return 0
    hl, hkvl = m.heads // u, max(m.kv_heads, u) // u
    attn = (2 if packed_exchange(m, s, hw) else 2 * s.head_chunks if s.head_chunks > 1
            else s.micro_batch_size * (2 * hl + 2 * hkvl))  # fmt: skip
    return sum(attn * k.attention + 2 * (k.mixer is not None) for k in m.kinds())


def exchange_latency_s(m: ModelShape, s: Settings, hw: Hardware, passes: int) -> float:
    """Seconds of collective latency (alpha) the attention and mixer exchanges add to a step of ``passes``."""
    return passes * exchange_collectives(m, s, hw) * link_cost(hw, s.sp // s.ring_size).alpha_s
