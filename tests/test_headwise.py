"""The attention exchange head by head (``parallel/headwise.py``): bitwise the whole-tensor all-to-all,
gradients laid out like the inputs, and the memory it adds bounded by its outputs plus two pieces
(the packed exchange added a send and a receive buffer of every tensor on top), forward and backward."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.parallel.comm import heads_to_seq, seq_to_heads
from ulysses_sp.parallel.headwise import out_heads_to_seq, qkv_seq_to_heads

B, H, HKV, S_L, D = 2, 8, 4, 256, 16


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _metered(fn, include):
    """``fn()``'s result and the bytes it added at its worst (the meter, ``include`` alive at entry)."""
    with track_peak_memory("cpu", include=include) as mem:
        out = fn()
    return out, mem.extra_bytes


def _exchange_and_memory() -> dict:
    group, p = dist.group.WORLD, dist.get_world_size()
    g = torch.Generator().manual_seed(dist.get_rank())
    # q, k as rotary leaves them ([B, H*, S_l, D] contiguous); v a transposed view of its projection
    q, k = (torch.randn(B, h, S_L, D, generator=g, requires_grad=True) for h in (H, HKV))
    v = torch.randn(B, S_L, HKV, D, generator=g).transpose(1, 2).requires_grad_()
    piece = p * S_L * D * 4  # one [P, S_l, D] fp32 staging piece
    outs, fwd_extra = _metered(lambda: qkv_seq_to_heads(q, k, v, group), [q, k, v])
    douts = [torch.randn(o.shape, generator=g) for o in outs]
    _, bwd_extra = _metered(lambda: torch.autograd.backward(outs, douts), [*outs, *douts, q, k, v])
    grads = [t.grad for t in (q, k, v)]
    # the reference: the whole-tensor exchange of each, the same bytes
    ref = [seq_to_heads(t.detach().requires_grad_(), group) for t in (q, k, v)]
    ref_grads = torch.autograd.grad(ref, [r.grad_fn.next_functions[0][0].variable for r in ref], douts)
    # the output exchange: the core's [B, S, H_l, D] as a transposed view of what it saved
    core = torch.randn(B, H // p, p * S_L, D, generator=g).transpose(1, 2).requires_grad_()
    out, out_extra = _metered(lambda: out_heads_to_seq(core, group), [core])
    dout = torch.randn(out.shape, generator=g)
    _, out_bwd_extra = _metered(lambda: out.backward(dout), [out, dout, core])
    ref_out = heads_to_seq(core.detach().requires_grad_(), group, head_dim=2, seq_dim=1)
    (ref_core_grad,) = torch.autograd.grad(ref_out, ref_out.grad_fn.next_functions[0][0].variable, dout)
    return {
        "exact": all(torch.equal(a, b) for a, b in zip([*outs, *grads, out, core.grad],
                                                       [*ref, *ref_grads, ref_out, ref_core_grad])),  # fmt: skip
        "layouts": [t.stride() == x.stride() for t, x in zip([*grads, core.grad], [q, k, v, core])],
        "out_contiguous": out.is_contiguous(),
        "extra": (fwd_extra, bwd_extra, out_extra, out_bwd_extra),
        "bounds": (_nbytes(outs) + 2 * piece, _nbytes(grads) + 2 * piece, _nbytes([out]) + 2 * piece,
                   _nbytes([core]) + 2 * piece),  # fmt: skip
        "packed": (2 * _nbytes(outs), 2 * _nbytes(grads)),  # what send + receive buffers alone added
    }


def test_headwise_exchange_is_exact_and_adds_only_its_outputs(pool):
    for r in pool.run(_exchange_and_memory, 2):
        assert r["exact"] and all(r["layouts"]) and r["out_contiguous"], r
        assert all(e <= b for e, b in zip(r["extra"], r["bounds"])), r
        assert r["extra"][0] < r["packed"][0] and r["extra"][1] < r["packed"][1], r
