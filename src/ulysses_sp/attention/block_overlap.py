"""Overlap for the whole attention block per head group: the next group's exchange in flight during this one's core.

``attention/head_blocks.py`` runs an attention module's block once per head group (projections, q/k/v
exchange, core, output exchange, ``o_proj``). With ``head_chunk_overlap`` its forward (and so the
checkpoint recompute, which is that forward again) runs the groups as a two-stage pipeline:

1. **post** group ``g+1``: its module forward runs up to the attention call; there the attention function
   (``UlyssesSPAttentionHF``, seeing ``attention.block_overlap`` set) packs its q/k/v and *posts* their
   all-to-all (``comm.start_exchange``, ``async_op=True``) instead of waiting for it, and hands the module an
   empty output buffer ``[B, S_l, H_g, D]``; the module's reshape of it is a view, which the group's
   ``o_proj`` stand-in (``GroupProj``) records instead of multiplying (``Deferred.then``);
2. **attend** group ``g`` (posted one round earlier): wait for its exchange, run the core on its
   ``[B, H_c, S, D]`` heads, post the output's all-to-all;
3. **land** group ``g-1``: wait for its output exchange, copy what arrived into its buffer, and run the
   recorded ``o_proj`` (adds into the block's output).

So group ``g+1``'s q/k/v exchange runs behind group ``g``'s core and group ``g-1``'s output exchange behind it
too. Every rank posts the same collectives in the same order (``in 0, in 1, out 0, in 2, out 1, ...``), so
the group's all-to-alls stay matched. Nothing reads a buffer before its wait: the arriving q/k/v are the
values ``start_exchange``'s ``finish`` returns (only after ``work.wait()``), and a posted exchange's send
buffer is held by its ``finish`` until then (on CUDA the collective's own stream and ``wait``'s event
order the use; the caching allocator cannot reuse a held buffer). The math is the same as one group
at a time: the same core on the same heads, the same ``o_proj`` sums in the same group order: bitwise.

Memory: two groups' exchanged q/k/v (one arriving, one attended), the next group's output buffer and
one output exchange in flight: ``7 gq + 6 gkv`` elements per local token above one group at a time
(``plan/attention.py``: ``gq``/``gkv`` a group's query/kv features over the ``P`` ranks; measured there). Backward (each group's block again under autograd, its gradients taken inside
the group's call) runs the groups one at a time: the module's backward must run inside the group's
``functional_call`` scope. Not used where the layer's attention is not a plain Ulysses exchange
(the hybrid ring, Ulysses-Offload) or the module has per-head parameters (sinks: the core reads the
group's cut while the group's call runs).

Shape legend: ``B`` batch, ``S`` full sequence, ``S_l = S/P``, ``H_g`` a group's query heads on every rank
(``P H_c``), ``H_c`` one rank's, ``Hkv_g`` its kv heads, ``D`` head dim, ``P`` Ulysses size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ulysses_sp.parallel.comm import start_exchange
from ulysses_sp.parallel.comm_timing import active_comm_times

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(q [B, H_c, S, D], k, v [B, Hkv_c, S, D]) -> [B, S, H_c, D]``: the layer's core for the group."""


class Deferred:
    """One head group's block between its post and its landing (``pipelined``)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        """``[B, S_l, H_g, D]``: the attention output the module was handed (``None``: nothing deferred)."""
        self.then: Callable[[], None] | None = None
        """The group's ``o_proj``, recorded by ``GroupProj`` on a view of ``buffer``."""
        self._arrive: Callable | None = None
        self._home: Callable | None = None
        self._attend: Attend | None = None
        self._group: dist.ProcessGroup | None = None

    def post(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend,
             group: dist.ProcessGroup) -> torch.Tensor:  # fmt: skip
        """Post the group's q ``[B, H_g, S_l, D]`` and k, v ``[B, Hkv_g, S_l, D]`` exchange; return the empty
        output buffer ``[B, S_l, H_g, D]`` the module goes on with (filled by ``land``)."""
        p = dist.get_world_size(group)
        if k.shape[1] < p:  # [B, Hkv_g, S_l, D] -> [B, P, S_l, D]: rank j receives the kv head its queries use
            k, v = (t.repeat_interleave(p // t.shape[1], dim=1) for t in (k, v))
        # [B, H*, S_l, D] -> [P, B, H*/P, S_l, D]: rank j's heads first; arriving glued along S_l: [B, H*/P, S, D]
        parts = [t.unflatten(1, (p, -1)).movedim(1, 0) for t in (q, k, v)]
        self._arrive = start_exchange(parts, [2, 2, 2], group, active_comm_times(), async_op=True)
        self._attend, self._group = attend, group
        b, h, s_l, d = q.shape
        self.buffer = q.new_empty(b, s_l, h, d)  # [B, S_l, H_g, D], contiguous as the exchange's output
        return self.buffer

    def attend(self) -> None:
        """Wait for the q/k/v, run the core, post the output's exchange home."""
        if self._arrive is None:
            return
        q, k, v = self._arrive()  # the wait: nothing reads the received buffer before it
        self._arrive = None
        o = self._attend(q, k, v)  # [B, S, H_c, D]
        del q, k, v
        # [B, S, H_c, D] -> [P, B, S_l, H_c, D]: rank j's tokens first; arriving [P(src), B, S_l, H_c, D]
        part = o.unflatten(1, (dist.get_world_size(self._group), -1)).movedim(1, 0)
        self._home = start_exchange([part], [None], self._group, active_comm_times(), async_op=True)
        self._attend = None

    def land(self) -> None:
        """Wait for the output, copy it into the module's buffer, run the recorded ``o_proj``."""
        if self._home is not None:
            (o,) = self._home()
            self._home = None
            b, s_l, h, d = self.buffer.shape
            # [P(src), B, S_l, H_c, D] -> [B, S_l, P, H_c, D]: rank r's heads at [r H_c, (r+1) H_c)
            self.buffer.view(b, s_l, o.shape[0], h // o.shape[0], d).copy_(o.movedim(0, 2))
        if self.then is not None:
            self.then()
        self.buffer = self.then = None


def pipelined(call: Callable[[int, Deferred], None], groups: int) -> None:
    """Run ``groups`` head groups' blocks overlapped (module docstring): ``call(g, deferred)`` runs group
    ``g``'s module forward with ``deferred`` as the attention's ``block_overlap`` (posting its exchange)."""

    def post(g: int) -> Deferred:
        deferred = Deferred()
        call(g, deferred)
        return deferred

    landing, current = None, post(0)
    for g in range(groups):
        following = post(g + 1) if g + 1 < groups else None  # its exchange posted before this group's core
        current.attend()
        if landing is not None:
            landing.land()  # the previous group's output exchange ran behind this group's core
        landing, current = current, following
    landing.land()
