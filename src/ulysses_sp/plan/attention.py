"""The attention layer's terms in the planner's memory model, per local token (``plan.model``).

``attention_terms(m, s, hw, norm)`` gives, in elements of the model dtype per local token
(``T = B * S_l``; ``q = H D``, ``kv = max(Hkv, P) D``: kv heads replicated when fewer than ``P``):

* ``saved``: what the layer's forward keeps — the input norm's tensors, q/k norms' inputs (the q and k
  projections' outputs, ``m.qk_norm``: read off Qwen3-32B rehearsals; an output gate's ``3 q``,
  ``m.output_gate``: read off Qwen3-Next rehearsals), q/k/v as the core receives
  them (``q + 2 kv``) and the core's output with the o-projection's input (a view of it at sp 1, a
  copy made by the return exchange at ``P > 1``); blockwise attention keeps only q on the device.
* ``exchange_in``: with ``P > 1`` the tensors handed to the all-to-all (kv before replication).
* ``workspace``: the backward's transient set on top of ``saved`` (grads of q, k, v and the output;
  with ``P > 1`` an exchange term of ``2 q`` per head group, and the packed exchange's receive buffer
  of the q/k/v gradients where it exceeds that: plan_check measured the same peaks either way). With
  head groups at sp 1: the output's gradient, dk and dv (dq is q's storage) and one group's output, dq,
  dk, dv with the fp32 sums of its kv heads (``q + 2 kv + 2 q / N + 6 Hkv_c D``).
* ``backward``: on CUDA with ``P > 1``, one head group and the head-by-head exchange, the whole set at
  the backward's exchange of the q/k/v gradients home, read off rehearsals of Llama-3-8B at
  ``P`` 2, 8, 16 and 32 (``bench.scale_table``'s shapes, 2 layers; within 1.2 %): the core's output
  and dq, dk, dv as it returns them (``q + 2 kv``); dq home and its running sum (``2 q``); dk, dv home
  (``2 Hkv D``); with several query heads per rank the core's gradient re-laid out for the exchange
  (``q``) and a staged ``[P, S_l, D]`` piece each way (``parallel.comm.exchange_pieces``), else one.
  0 where ``saved + workspace`` stands instead.
* ``core``: on CUDA, the set while the flash kernel's backward runs, its in-kernel workspace included
  (``rehearse.tracker.kernel_workspace``: FlashAttention-2's fp32 dq accumulator over the rank's
  query heads and, with fewer kv heads than query heads on the rank, dk/dv expanded to the query
  heads): q, k, v, the output, its gradient and dq, dk, dv (``4 q + 4 kv``) + the workspace, divided
  by the head groups. With head groups at sp 1 (no exchange: ``attention.head_chunks`` over views of
  the layer's q/k/v) the layer's q, k, v, the output's gradient and dk, dv (``2 q + 4 kv``; dq is q's
  own storage) + one group's output and dq, its kv heads' dk, dv and their fp32 sums (``6 Hkv_c D``)
  and the kernel's workspace for the group's ``H/N`` query heads (expanded dk/dv only where the group
  has fewer kv heads than query heads). 0 on other devices (a CPU kernel's buffers are per thread).

With the whole attention block per head group (``head_blocks``, the default with head groups): the
layer keeps the block's input; the backward one group's set next to the input's gradient
(``_block_terms``), read off rehearsals of Llama-3-8B (2 layers) at sp 1 and 8. With ``head_overlap`` the
block's forward (and its checkpoint recompute) holds a second group's exchange: ``OVERLAP_GQ``/``OVERLAP_GKV``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ulysses_sp.plan.exchange import packed_exchange
from ulysses_sp.plan.hardware import Hardware
from ulysses_sp.plan.inputs import DTYPE_BYTES, ModelShape, Settings


@dataclass(frozen=True)
class AttentionTerms:
    """Elements of the model dtype per local token (module docstring)."""

    saved: int
    exchange_in: int
    workspace: int
    packed: int
    """The packed exchange's extra receive buffer (0 head by head)."""
    backward: int
    core: int
    recompute: int = 0
    """The checkpoint recompute's set of the attention block per head group (0: the model's own)."""


OVERLAP_GQ, OVERLAP_GKV = 7, 6
"""The block forward's elements per local token above one group at a time under ``head_overlap``
(``attention/block_overlap.py``), in a group's query / kv features: the next group's q/k/v three times
(projections, packed send and receive buffers, or receive and unpacked: ``3 gq + 6 gkv``), its output
buffer (``gq``), the previous group's output exchange (send and receive, ``2 gq``) and its output buffer
(``gq``). Measured (the library's meter, one attention-dominated layer's forward, sp 2, 4096 tokens, D 64,
4 groups): 12 ``gq`` with 16 heads (``gkv = gq``), 9 with 16:4 GQA (``gkv = gq/2``), 13 with one query head
per group (8 heads); 9 and 6 with 2 groups (a shorter pipeline)."""


def block_groups(m: ModelShape, s: Settings) -> tuple[int, int] | None:
    """With the whole block per head group (``attention/head_blocks.py``): one group's query and kv
    features per rank before the exchange (``P`` ranks' ``H_c`` query heads and one kv set each: a kv head
    several groups share is computed and sent once per group); ``None`` without."""
    n, p = s.head_chunks, s.sp // s.ring_size
    if n <= 1 or not s.head_blocks or s.attention == "blockwise":
        return None
    hc = m.heads // p // n
    return p * hc * m.head_dim, p * max(1, hc * m.kv_heads // m.heads) * m.head_dim


def _block_terms(m: ModelShape, s: Settings, norm: int, gq: int, gkv: int) -> AttentionTerms:
    """Per local token: the block keeps its input (the norm's output); its backward one group's q, k, v,
    output and their gradients (``4 gq + 4 gkv``, the full sequence of the rank's ``H_c`` heads) beside the
    input's gradient; on CUDA the flash kernel's workspace for the group's heads (fp32 dq, GQA-expanded
    dk/dv); the recompute's forward adds the output's running sum."""
    h, d, p, e = m.hidden, m.head_dim, s.sp // s.ring_size, DTYPE_BYTES[s.dtype]
    ws = 4 * gq + 4 * gkv + (gq + gkv if m.qk_norm else 0)  # (q/k norms keep the group's projections' outputs)
    core = 0
    if s.device_type == "cuda":
        core = 2 * h + ws + 4 * (gq // d) * (-(-d // 32) * 32 + 1) // e + (2 * gq if gq > gkv else 0)
    recompute = 4 * h + 2 * (gq + 2 * gkv) + 3 * gq  # + the output's sum; q/k/v (and exchanged), the core's output
    if s.head_overlap and p > 1:  # the next group's send and receive buffers, its output buffer; one output in flight
        recompute += OVERLAP_GQ * gq + OVERLAP_GKV * gkv
    return AttentionTerms(saved=norm + h, exchange_in=gq + 2 * gkv if p > 1 else 0, workspace=ws, packed=0,
                          backward=0, core=core, recompute=recompute)  # fmt: skip


def attention_terms(m: ModelShape, s: Settings, hw: Hardware | None, norm: int) -> AttentionTerms:
    """The attention's memory terms under ``s`` (``norm``: what its input norm keeps per token)."""
    blocks = block_groups(m, s)
    if blocks is not None:
        return _block_terms(m, s, norm, *blocks)
    e = DTYPE_BYTES[s.dtype]
    d, p = m.head_dim, s.sp
    q, kv, kv_pre = m.heads * d, max(m.kv_heads, p) * d, m.kv_heads * d
    qn = q + kv_pre if m.qk_norm else 0  # q/k norms keep the projections' outputs
    qn += 3 * q if m.output_gate else 0  # the gate: the q projection's second half, its sigmoid and the gated output
    saved = norm + qn + (q + 2 * kv) + (2 * q if p > 1 else q)
    if s.attention == "blockwise":
        saved = norm + q  # q/k/v and the core's output go to the host with the blocks
    is_packed = packed_exchange(m, s, hw)
    packed = max(0, q + 2 * kv - 2 * q) if is_packed else 0
    workspace = 2 * q + 2 * kv + (2 * q // s.head_chunks if p > 1 else 0) + packed
    n, d_r = s.head_chunks, -(-d // 32) * 32
    hc, kvc = m.heads // n, max(1, m.heads // n * m.kv_heads // m.heads)  # a head group's query / kv heads
    if p == 1 and n > 1:  # head groups at sp 1: dq in q's own storage; one group's output, dq, dk, dv, fp32 sums
        workspace = q + 2 * kv + 2 * q // n + 6 * kvc * d
    cuda = s.device_type == "cuda" and s.attention != "blockwise"
    backward = 0
    if cuda and p > 1 and s.head_chunks == 1 and not is_packed:
        several = m.heads > p
        backward = norm + qn + (5 if several else 4) * q + 2 * kv + 2 * kv_pre
        backward += (2 if several else 1) * p * d // s.micro_batch_size
    core = 0
    if cuda and p == 1 and n > 1:  # one group's core at a time over views of the layer's q/k/v
        flash = 4 * hc * (d_r + 1) // e + (2 * hc * d if hc > kvc else 0)
        core = norm + qn + 2 * q + 4 * kv + 2 * q // n + 6 * kvc * d + flash
    elif cuda:
        flash = 4 * m.heads * (d_r + 1) // e + (2 * q if m.heads > max(m.kv_heads, p) else 0)
        core = norm + qn + 4 * q + 4 * kv + flash // n
    return AttentionTerms(saved=saved, exchange_in=q + 2 * kv_pre if p > 1 else 0, workspace=workspace,
                          packed=packed, backward=backward, core=core)  # fmt: skip
