"""The blockwise attention core alone: equal to sdpa with the dense mask, memory linear in S,
fully masked blocks never computed, K/V offload exact and counted, bad options refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ulysses_sp.attention.blockwise import AttnStructure, BlockCounts, blockwise_attention
from ulysses_sp.attention.core import check_blockwise_options
from ulysses_sp.attention.kv_offload import KVOffload
from ulysses_sp.attention.masks import SeqLayout, mask_for
from ulysses_sp.memory.meter import track_peak_memory


def _qkv(b, h, hkv, s, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g, dtype=dtype).requires_grad_() for n in (h, hkv, hkv)]


def _positions(docs_per_row):
    """``[B, S]`` position ids restarting at every document (rows may differ)."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs_per_row])


def _dense_reference(q, k, v, layout, window):
    mask = mask_for(layout, "sdpa", q.dtype, window)  # [B|1, 1, S, S] bool, or None for plain causal
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


STRUCTURES = {
    "causal": (None, None),
    "docs": ([(10, 15, 12), (20, 3, 14)], None),
    "window": (None, 6),
    "docs+window": ([(10, 15, 12), (37,)], 6),
}


@pytest.mark.parametrize("chunk", [4, 7, 37], ids=lambda c: f"chunk{c}")  # 37 = S; 4, 7 do not divide it
@pytest.mark.parametrize("name", list(STRUCTURES))
@pytest.mark.parametrize("heads, kv", [(4, 4), (4, 1), (6, 2)])
def test_blockwise_equals_sdpa_with_dense_mask_forward_and_backward(name, chunk, heads, kv):
    docs, window = STRUCTURES[name]
    q, k, v = _qkv(2, heads, kv, 37, 8)
    positions = _positions(docs) if docs else torch.arange(37)[None]
    layout = SeqLayout.from_positions(positions)
    structure = AttnStructure.build(layout.doc_ids, window)
    got = blockwise_attention(q, k, v, structure=structure, chunk=chunk)
    want = _dense_reference(q, k, v, layout, window)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_float32_and_custom_scale_match_sdpa():
    q, k, v = _qkv(1, 4, 2, 50, 16, dtype=torch.float32)
    layout = SeqLayout.from_positions(_positions([(20, 30)]))
    got = blockwise_attention(
        q, k, v, structure=AttnStructure.build(layout.doc_ids, None), scale=0.3, chunk=16
    )
    mask = mask_for(layout, "sdpa", q.dtype, None)
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.3
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fully_masked_blocks_are_never_computed():
    """Four documents of 64 tokens, blocks of 32: per query block only its own document's key blocks
    at or before it run: 3 of 8 per document row pair -> 12 of 64 blocks, forward and backward."""
    s, chunk = 256, 32
    q, k, v = _qkv(1, 2, 2, s, 4, dtype=torch.float32)
    layout = SeqLayout.from_positions(_positions([(64, 64, 64, 64)]))
    counts = BlockCounts()
    out = blockwise_attention(
        q, k, v, structure=AttnStructure.build(layout.doc_ids, None), chunk=chunk, counts=counts
    )
    after_forward = (counts.computed, counts.skipped, counts.unmasked, counts.flops)
    out.sum().backward()
    blocks = (s // chunk) ** 2
    per_block = 32 * 32 * 2 * 4  # bq * bk * H * D
    # each 64-token document is 2 query blocks x 2 key blocks, of which 3 are causal-visible
    assert after_forward == (12, blocks - 12, 4, 12 * 4 * per_block)
    assert (counts.computed, counts.skipped) == (24, 2 * (blocks - 12))
    assert counts.flops == 12 * 4 * per_block + 12 * 10 * per_block
    # dense causal attention costs 4 * S^2/2 * H * D forward; documents cut that by their share
    assert after_forward[3] / (4 * s * s * 2 * 4) == pytest.approx(12 / blocks)


def _peak_extra(s, chunk):
    q, k, v = _qkv(1, 2, 1, s, 8, dtype=torch.float32)
    layout = SeqLayout.from_positions(_positions([(s // 2, s // 4, s // 4)]))
    structure = AttnStructure.build(layout.doc_ids, None)
    with track_peak_memory("cpu") as mem:
        blockwise_attention(q, k, v, structure=structure, chunk=chunk).sum().backward()
    return mem.peak_bytes


def test_peak_memory_is_linear_in_sequence_length():
    small, large = _peak_extra(512, 128), _peak_extra(2048, 128)
    assert large < 4.5 * small, (small, large)  # 4x the tokens: ~4x the bytes, not ~16x
    assert large < 2048 * 2048 * 4 / 4, large  # far below one fp32 [S, S] score matrix


def test_offloaded_kv_gives_identical_results_and_is_counted():
    q, k, v = _qkv(2, 4, 2, 37, 8, dtype=torch.float32)
    layout = SeqLayout.from_positions(_positions([(10, 15, 12), (37,)]))
    structure = AttnStructure.build(layout.doc_ids, 5)
    want = blockwise_attention(q, k, v, structure=structure, chunk=7)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    store = KVOffload()
    got = blockwise_attention(q, k, v, structure=structure, chunk=7, offload=store)
    got_grads = torch.autograd.grad(got.sum(), (q, k, v))
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)
    kv_bytes = 2 * k.numel() * k.element_size()
    assert (store.stats.offloaded_bytes, store.stats.restored_bytes, store.stats.chunks) == (
        kv_bytes,
        kv_bytes,
        12,
    )


def test_offload_keeps_kv_on_the_host_between_forward_and_backward():
    """The K/V the forward saves are host-side (tracked as such); without offload they are device-side."""
    held = {}
    for offload in (None, KVOffload()):
        with track_peak_memory("cpu") as mem:
            q, k, v = _qkv(1, 2, 2, 256, 16, dtype=torch.float32)
            k, v = k.detach(), v.detach()  # not leaves of the graph: only the attention can hold them
            layout = SeqLayout.from_positions(_positions([(128, 128)]))
            out = blockwise_attention(
                q, k, v, structure=AttnStructure.build(layout.doc_ids, None), chunk=64, offload=offload
            )
            del k, v  # the caller's K/V die (as the all-to-all's output does): only what is saved remains
            held[offload is not None] = (mem.current_bytes, mem.host_current_bytes)
            out.sum().backward()
    kv = 2 * 256 * 2 * 16 * 4
    # host: the stashed chunks, and q and the output whole
    assert held[True][1] - held[False][1] == kv + kv
    # device: exactly the K/V bytes fewer held for backward (the caller's q and output are alive here)
    assert held[False][0] - held[True][0] == kv


def test_mismatched_shapes_and_options_are_refused():
    q, k, v = _qkv(1, 4, 3, 8, 4)
    with pytest.raises(ValueError, match=r"Hkv dividing H; got q \(1, 4, 8, 4\), k \(1, 3, 8, 4\)"):
        blockwise_attention(q, k, v)
    with pytest.raises(
        ValueError, match=r"attn_chunk must be a positive number of tokens or None \(auto\), got 0"
    ):
        check_blockwise_options("sdpa", 0, False)
    with pytest.raises(ValueError, match=r"offload_attention \(True\) configure the blockwise core.*'eager'"):
        check_blockwise_options("eager", None, True)
