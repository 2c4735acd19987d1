"""Ring attention across processes equals attention over the full gathered sequence: each rank's
output and the gradients of its own q/k/v pieces against sdpa with the structure's dense mask (fp64),
at R = 2 and 4, zigzag and contiguous, with packed documents, a sliding window, GQA (Hkv = 1 too)
and blocks that do not divide the pieces; on ring sub-groups of a larger world (peers 2 apart, as
in the hybrid layout); overlap on/off bit-identical; bytes sent equal to the analytic ring volume;
causal FLOPs balanced under zigzag and not without it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ulysses_sp.attention.blockwise import AttnStructure, BlockCounts
from ulysses_sp.attention.masks import SeqLayout, mask_for
from ulysses_sp.attention.ring import RingStats, ring_attention
from ulysses_sp.parallel.mesh_shape import contiguous_spans, zigzag_spans

S = 40  # zigzag chunks of 10 (R = 2) and 5 (R = 4): blocks of 3 and 4 do not divide them
STRUCTURES = {
    "causal": (None, None),
    "docs": ([(13, 17, 10), (25, 3, 12)], None),  # boundaries inside zigzag chunks
    "window": (None, 6),
    "docs+window": ([(13, 17, 10), (40,)], 6),
}


def _ring_group(groups):
    """This rank's ring group among ``groups`` (global ranks; every rank creates every group)."""
    made = [(g, dist.new_group(g)) for g in groups]
    return next((i, pg) for i, (g, pg) in enumerate(made) if dist.get_rank() in g)


def _inputs(name, heads, kv, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, n, S, 8, generator=g, dtype=dtype) for n in (heads, kv, kv, heads))
    docs, window = STRUCTURES[name]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs]) if docs else torch.arange(S)[None]  # fmt: skip
    layout = SeqLayout.from_positions(positions)
    return q, k, v, dout, layout, window


def _dense(q, k, v, layout, window):
    """sdpa over the full sequence with the dense ``[B|1, 1, S, S]`` mask; K/V repeated for GQA."""
    mask = mask_for(layout, "sdpa", q.dtype, window)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _run(group, idx, q, k, v, dout, structure, **kw):
    """Ring attention on this rank's tokens ``idx``: output and the grads of its q/k/v pieces."""
    local = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
    out = ring_attention(*local, group=group, structure=structure, **kw)
    out.backward(dout[:, :, idx])
    return out.detach(), [x.grad for x in local]


def _ring_vs_full(groups, zigzag, name, heads, kv, chunk):
    gi, group = _ring_group(groups)
    r, rr = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout, layout, window = _inputs(name, heads, kv, seed=10 + gi)  # one sample per ring group
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    want = _dense(*full, layout, window)
    want.backward(dout)
    idx = torch.cat([torch.arange(a, b) for a, b in (zigzag_spans if zigzag else contiguous_spans)(S, r, rr)])
    structure = AttnStructure.build(layout.doc_ids, window)
    counts = BlockCounts()
    out, grads = _run(group, idx, q, k, v, dout, structure, chunk=chunk, zigzag=zigzag, counts=counts)
    torch.testing.assert_close(out, want.detach()[:, :, idx], rtol=1e-10, atol=1e-10)
    for got, ref, what in zip(grads, full, "qkv"):
        ref = ref.grad[:, :, idx]
        assert ref.abs().max() > 0, f"d{what}: zero reference gradient tests nothing"
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10, msg=lambda m, w=what: f"d{w}: {m}")
    return rr, counts.computed, counts.skipped


@pytest.mark.parametrize(
    "r, zigzag, name, heads, kv, chunk",
    [
        (2, True, "causal", 4, 4, None),
        (2, False, "causal", 4, 2, 3),
        (2, True, "docs", 4, 1, 3),  # Hkv = 1; block 3 does not divide the chunk of 10
        (2, True, "window", 6, 2, 4),
        (2, False, "docs+window", 4, 2, 4),
        (4, True, "causal", 4, 2, 3),  # block 3 does not divide the chunk of 5
        (4, True, "docs+window", 4, 1, 4),
        (4, False, "docs", 4, 4, 3),
        (4, True, "window", 6, 3, None),
    ],
)
def test_ring_attention_equals_full_sequence_attention(pool, r, zigzag, name, heads, kv, chunk):
    results = pool.run(_ring_vs_full, r, [list(range(r))], zigzag, name, heads, kv, chunk)
    assert sorted(rr for rr, _, _ in results) == list(range(r))
    assert all(computed > 0 for _, computed, _ in results)
    if name != "causal" or chunk is not None:
        assert all(skipped > 0 for _, _, skipped in results)  # fully masked blocks never computed


@pytest.mark.parametrize(
    "groups", [[[0, 2], [1, 3]], [[0], [1], [2], [3]]], ids=["two-rings-of-2", "rings-of-1"]
)
def test_ring_on_sub_groups_of_a_larger_world(pool, groups):
    """World 4 split into rings whose peers are 2 apart (the hybrid layout puts ring peers U apart),
    each ring on its own sample; and rings of one (no communication)."""
    results = pool.run(_ring_vs_full, 4, groups, True, "docs+window", 4, 1, 3)
    assert sorted(rr for rr, _, _ in results) == sorted(rr for g in groups for rr in range(len(g)))


def _overlap_and_stats(dtype):
    group = dist.new_group(list(range(dist.get_world_size())))
    r, rr = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout, layout, _ = _inputs("docs", 4, 2, seed=3, dtype=dtype)
    idx = torch.cat([torch.arange(a, b) for a, b in zigzag_spans(S, r, rr)])
    structure = AttnStructure.build(layout.doc_ids, None)
    runs = {}
    for overlap in (True, False):
        stats = RingStats()
        runs[overlap] = (
            _run(group, idx, q, k, v, dout, structure, chunk=4, overlap=overlap, stats=stats),
            stats,
        )
    (out_a, grads_a), stats = runs[True]
    (out_b, grads_b), stats_b = runs[False]
    identical = torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    kv_elems = 2 * k.shape[0] * k.shape[1] * (S // r) * k.shape[-1]  # [2, B, Hkv, S_r, D] per hop
    analytic = 2 * (r - 1) * kv_elems * k.element_size() + r * kv_elems * 4  # K/V fwd+bwd, dK/dV fp32
    return (
        identical,
        (stats.bytes_sent, stats.messages, stats.steps),
        (stats_b.bytes_sent, stats_b.messages),
        analytic,
    )


@pytest.mark.parametrize("r", [2, 4])
def test_overlap_is_bit_identical_and_bytes_equal_the_analytic_ring_volume(pool, r):
    """fp32 and bf16 inputs (K/V hops in the input dtype, dK/dV accumulators in fp32):
    ``2 (R-1)`` K/V hops and ``R`` dK/dV hops per rank, ``3R - 2`` messages, ``2R`` steps."""
    for dtype in (torch.float32, torch.bfloat16):
        for identical, (sent, messages, steps), no_overlap, analytic in pool.run(
            _overlap_and_stats, r, dtype
        ):
            assert identical
            assert sent == analytic and (messages, steps) == (3 * r - 2, 2 * r)
            assert no_overlap == (sent, messages)


def _causal_flops(zigzag, chunk):
    group = dist.new_group(list(range(dist.get_world_size())))
    r, rr = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout, _, _ = _inputs("causal", 4, 2, seed=5)
    idx = torch.cat([torch.arange(a, b) for a, b in (zigzag_spans if zigzag else contiguous_spans)(S, r, rr)])
    counts = BlockCounts()
    _run(group, idx, q, k, v, dout, None, chunk=chunk, zigzag=zigzag, counts=counts)
    return counts.flops, counts.computed, counts.skipped


@pytest.mark.parametrize("r", [2, 4])
def test_zigzag_balances_causal_flops_and_contiguous_does_not(pool, r):
    """Blocks of one zigzag chunk ``c``. Zigzag, per pass: the own step computes 3 of 4 piece pairs
    and every other step 2 of 4 — ``2R + 1`` blocks computed and ``2R - 1`` skipped on every rank.
    Contiguous: rank ``i`` computes ``4i + 3`` blocks (``4`` per earlier rank, ``3`` on its own
    diagonal), so the busiest does ``(4R - 1) / 3`` times the least busy's work."""
    c = S // (2 * r)
    zig = pool.run(_causal_flops, r, True, c)
    flops = [f for f, _, _ in zig]
    assert max(flops) / min(flops) <= 1.02
    assert {(computed, skipped) for _, computed, skipped in zig} == {(2 * (2 * r + 1), 2 * (2 * r - 1))}
    cont = [f for f, _, _ in pool.run(_causal_flops, r, False, c)]
    assert max(cont) / min(cont) == pytest.approx((4 * r - 1) / 3)
    assert sum(cont) == sum(flops)  # the same total work, distributed differently
