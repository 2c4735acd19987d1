"""Ring attention's pure parts, in one process: the zigzag and contiguous layouts (every token held
once, causal work equal across ring ranks under zigzag), a ring of one equal to the blockwise core
(output and gradients), and bad input refused with messages that say what to do."""

from __future__ import annotations

import pytest
import torch

from ulysses_sp.attention.blockwise import AttnStructure, BlockCounts, blockwise_attention
from ulysses_sp.attention.masks import SeqLayout
from ulysses_sp.attention.ring import RingStats, ring_attention
from ulysses_sp.parallel.mesh_shape import contiguous_spans, zigzag_spans


def test_zigzag_spans_hold_chunk_i_then_chunk_2r_minus_1_minus_i():
    assert zigzag_spans(8, 2, 0) == [(0, 2), (6, 8)]
    assert zigzag_spans(8, 2, 1) == [(2, 4), (4, 6)]
    assert zigzag_spans(16, 4, 1) == [(2, 4), (12, 14)]
    assert zigzag_spans(6, 1, 0) == [(0, 3), (3, 6)]
    assert contiguous_spans(12, 3, 2) == [(8, 12)]


@pytest.mark.parametrize("spans_of", [zigzag_spans, contiguous_spans])
@pytest.mark.parametrize("ring_size", [1, 2, 3, 4])
def test_every_token_is_held_by_exactly_one_ring_rank(spans_of, ring_size):
    s = 24
    held = sorted(t for r in range(ring_size) for a, b in spans_of(s, ring_size, r) for t in range(a, b))
    assert held == list(range(s))
    assert {sum(b - a for a, b in spans_of(s, ring_size, r)) for r in range(ring_size)} == {s // ring_size}


@pytest.mark.parametrize("ring_size", [2, 4, 8])
def test_zigzag_gives_every_ring_rank_the_same_causal_work(ring_size):
    """Causal score entries per rank: a query at global position ``p`` sees ``p + 1`` keys."""
    s = 16 * ring_size

    def work(spans):
        return sum(p + 1 for a, b in spans for p in range(a, b))

    zig = [work(zigzag_spans(s, ring_size, r)) for r in range(ring_size)]
    cont = [work(contiguous_spans(s, ring_size, r)) for r in range(ring_size)]
    assert len(set(zig)) == 1
    assert max(cont) / min(cont) > 2 * ring_size - 2  # rank R-1 does ~(2R-1)x rank 0's work


def test_layouts_refuse_lengths_they_cannot_split_naming_the_padded_length():
    with pytest.raises(ValueError, match=r"divisible by 2 \* ring_size = 8; got 10: pad the sequence to 16"):
        zigzag_spans(10, 4, 0)
    with pytest.raises(ValueError, match=r"divisible by ring_size = 4; got 10: pad the sequence to 12"):
        contiguous_spans(10, 4, 0)
    with pytest.raises(
        ValueError, match=r"ring_rank must be in \[0, ring_size\); got ring_rank 2, ring_size 2"
    ):
        zigzag_spans(8, 2, 2)


def _qkv(h, hkv, s, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, s, 8, generator=g, dtype=dtype).requires_grad_() for n in (h, hkv, hkv)]


def _structure(s):
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ((9, 13, s - 22), (s,))])
    return AttnStructure.build(SeqLayout.from_positions(positions).doc_ids, 5)


@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("heads, kv, chunk", [(4, 4, None), (4, 1, 3), (6, 2, 5)])
def test_a_ring_of_one_equals_the_blockwise_core(zigzag, heads, kv, chunk):
    """R = 1 (no group): no communication; output and gradients equal ``blockwise_attention``'s."""
    q, k, v = _qkv(heads, kv, 30)
    structure = _structure(30)
    stats, counts = RingStats(), BlockCounts()
    got = ring_attention(q, k, v, group=None, structure=structure, chunk=chunk, zigzag=zigzag,
                         stats=stats, counts=counts)  # fmt: skip
    want = blockwise_attention(q, k, v, structure=structure, chunk=chunk)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        assert w.abs().max() > 0
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    assert (stats.bytes_sent, stats.messages, stats.steps) == (0, 0, 2)
    # documents and window leave blocks out (with one block for the whole sequence there is none to skip)
    assert counts.computed > 0 and (counts.skipped > 0 or (chunk is None and not zigzag))


def test_bf16_inputs_give_bf16_output_close_to_fp32():
    q, k, v = _qkv(4, 2, 32, dtype=torch.float32)
    want = blockwise_attention(q, k, v)
    got = ring_attention(*(x.detach().bfloat16() for x in (q, k, v)), group=None, chunk=8)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_bad_inputs_are_refused_with_the_shapes():
    q, k, v = _qkv(4, 2, 8)
    with pytest.raises(ValueError, match=r"Hkv dividing H; got q \(2, 4, 8, 8\), k \(2, 3, 8, 8\)"):
        ring_attention(q, torch.zeros(2, 3, 8, 8), torch.zeros(2, 3, 8, 8), group=None)
    with pytest.raises(ValueError, match="as many local keys as queries"):
        ring_attention(q, k[:, :, :4], v[:, :, :4], group=None)
    with pytest.raises(
        ValueError, match=r"doc_ids covers 4 tokens but the ring's sequence is R \* S_r = 1 \* 8 = 8"
    ):
        ring_attention(q, k, v, group=None, structure=AttnStructure.build(torch.zeros(1, 4), None))
    with pytest.raises(
        ValueError, match=r"ring_rank 1 is not this process's rank in the ring group \(0 of 1\)"
    ):
        ring_attention(q, k, v, group=None, ring_rank=1)
    with pytest.raises(ValueError, match="pad the sequence to 8"):
        ring_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], group=None)
