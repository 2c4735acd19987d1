"""Layout arithmetic of the hybrid Ulysses x Ring split, pure: ring sizes, zigzag shards, token order."""

from __future__ import annotations

import pytest
import torch

from ulysses_sp.data import prepare_batch, shard_batch
from ulysses_sp.parallel.mesh_shape import (
    resolve_ring_size,
    seq_multiple,
    shard_spans,
    sp_token_order,
    valid_ring_sizes,
)


def test_auto_ring_size_is_one_when_the_heads_allow_ulysses_alone():
    assert resolve_ring_size(4, 8, 8) == 1
    assert resolve_ring_size(4, 8, 8, "auto") == 1


def test_auto_ring_size_is_the_smallest_that_splits_the_heads():
    assert resolve_ring_size(4, 2, 2) == 2  # 2 heads: at most 2 Ulysses ranks
    assert resolve_ring_size(8, 2, 1) == 4
    assert resolve_ring_size(6, 4, 4) == 3  # 6 does not split 4 heads, 2 does: ring 3 x ulysses 2
    assert valid_ring_sizes(8, 4, 2) == [2, 4, 8]


@pytest.mark.parametrize(
    "sp, ring, match",
    [
        (4, 3, r"ring_size \(3\) does not divide sequence_parallel_size \(4\); valid ring sizes .* \[2, 4\]"),
        (4, 1, r"ulysses size sp/ring = 4 cannot split 2 attention heads .* \[2, 4\]"),
        (4, 0, "ring_size must be >= 1"),
    ],
)
def test_impossible_ring_size_is_refused_naming_the_valid_ones(sp, ring, match):
    with pytest.raises(ValueError, match=match):
        resolve_ring_size(sp, 2, 2, ring)


def test_without_a_ring_rank_k_holds_the_kth_contiguous_slice():
    assert [shard_spans(16, k, 4) for k in range(4)] == [[(0, 4)], [(4, 8)], [(8, 12)], [(12, 16)]]
    assert sp_token_order(16, 4) is None


def test_ring_ranks_hold_zigzag_chunks_split_contiguously_over_their_ulysses_ranks():
    # sp 4 = ring 2 x ulysses 2, S 16: chunks of 4; ring rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    spans = [shard_spans(16, k, 4, 2) for k in range(4)]
    assert spans == [[(0, 4)], [(12, 16)], [(4, 8)], [(8, 12)]]
    # sp 2 = ring 2 x ulysses 1: each ring rank's two chunks in one shard
    assert [shard_spans(8, k, 2, 2) for k in range(2)] == [[(0, 2), (6, 8)], [(2, 4), (4, 6)]]
    # ulysses 3: a Ulysses piece straddles the ring rank's two chunks
    assert shard_spans(24, 1, 6, 2) == [(4, 6), (18, 20)]  # ring rank 0: [0, 6) and [18, 24)


@pytest.mark.parametrize("s, sp, ring", [(16, 4, 2), (8, 2, 2), (16, 4, 4), (24, 6, 2), (48, 6, 3)])
def test_shards_cover_the_sequence_once_and_token_order_inverts_them(s, sp, ring):
    order = sp_token_order(s, sp, ring)
    assert sorted(order.tolist()) == list(range(s))
    gathered = torch.cat(
        [torch.arange(s)[[i for a, b in shard_spans(s, k, sp, ring) for i in range(a, b)]] for k in range(sp)]
    )
    restored = torch.empty_like(gathered).index_copy_(0, order, gathered)
    assert restored.tolist() == list(range(s))


def test_ring_needs_a_length_divisible_by_twice_the_sp_size():
    assert seq_multiple(4, 1) == 4 and seq_multiple(4, 2) == 8
    with pytest.raises(
        ValueError,
        match=r"sequence length 12 is not divisible by 8 \(sp 4 x 2 zigzag chunks per ring rank, ring size 2\); pad to a multiple of 8, e.g. 16",
    ):
        shard_spans(12, 0, 4, 2)
    batch = {"input_ids": torch.arange(12)[None]}
    with pytest.raises(
        ValueError, match=r"not divisible by 8 \(sp 4 x 2 zigzag chunks per ring rank, ring size 2\)"
    ):
        prepare_batch(batch, 4, strict=True, ring_size=2)
    prepared = prepare_batch(batch, 4, ring_size=2)  # padded to 16
    assert prepared["input_ids"].shape == (1, 16)


def test_shard_batch_cuts_zigzag_tokens_with_labels_shifted_over_the_full_sequence():
    ids = torch.arange(16)[None]
    prepared = prepare_batch({"input_ids": ids}, 2, ring_size=2)
    shards = [shard_batch(prepared, k, 2, 2) for k in range(2)]
    assert shards[0]["input_ids"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert shards[0]["position_ids"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    # token t is labelled with t+1 of the full sequence, wherever the shard boundary falls
    assert shards[0]["shift_labels"].tolist() == [[1, 2, 3, 4, 13, 14, 15, -100]]
    assert shards[1]["shift_labels"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]


class _PerLayerConfig:
    """A config whose head counts differ by layer: reading the global count raises, as transformers'
    heterogeneous configs do (``AmbiguousGlobalPerLayerAttributeError``, a ``RuntimeError``)."""

    def __init__(self, pairs):
        from types import SimpleNamespace

        self.per_layer_config = [
            SimpleNamespace(num_attention_heads=h, num_key_value_heads=kv) for h, kv in pairs
        ]

    @property
    def num_attention_heads(self):
        raise RuntimeError("'num_attention_heads' is a per-layer attribute")


def test_heads_of_a_per_layer_config_are_read_layer_by_layer_and_the_ring_splits_every_layer():
    from ulysses_sp.parallel.mesh_shape import head_counts, resolve_ring_size_for_layers

    cfg = _PerLayerConfig([(4, 4), (4, 4), (64, 64)])
    assert head_counts(cfg) == [(4, 4), (64, 64)]
    assert resolve_ring_size_for_layers(2, head_counts(cfg)) == 1
    # 6 heads at sp 4 cannot split over 4 Ulysses ranks: the ring must take the layer that cannot
    assert resolve_ring_size_for_layers(4, [(8, 8), (6, 6)]) == 2
    with pytest.raises(ValueError, match="cannot split 6 attention heads"):
        resolve_ring_size_for_layers(4, [(8, 8), (6, 6)], 1)
    # no attention layers (pure Mamba-2): no ring, unless one is asked for
    assert resolve_ring_size_for_layers(2, []) == resolve_ring_size_for_layers(2, [], "auto") == 1
    with pytest.raises(ValueError, match="ring_size 2: the model has no attention layers"):
        resolve_ring_size_for_layers(2, [], 2)
