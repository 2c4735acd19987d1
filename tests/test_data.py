"""Pure data logic, in-process: label shift and sharding, padding/strict, packing, sampler order."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DistributedSampler

from ulysses_sp.data import (
    PackingCollator,
    SPDistributedSampler,
    UlyssesSPDataLoaderAdapter,
    make_shift_labels,
    prepare_batch,
    shard_batch,
    sp_data_sampler,
)

IGN = -100


def _ids(b: int, s: int, start: int = 1) -> torch.Tensor:
    return torch.arange(start, start + b * s).reshape(b, s)


# ----------------------------------------------------------------------------- shift and shard


def test_shift_labels_next_token_and_ignore_at_end():
    labels = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    assert make_shift_labels(labels).tolist() == [[11, 12, 13, IGN], [21, 22, 23, IGN]]


def test_shift_labels_keeps_existing_ignore():
    labels = torch.tensor([[10, IGN, 12, IGN, 14]])
    assert make_shift_labels(labels).tolist() == [[IGN, 12, IGN, 14, IGN]]


def test_shift_labels_ignores_the_position_before_a_document_start():
    labels = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    assert make_shift_labels(labels, pos).tolist() == [[2, 3, IGN, 5, IGN, 7, IGN]]


@pytest.mark.parametrize("sp", [2, 4])
def test_shard_boundary_token_is_labelled_with_first_token_of_next_shard(sp):
    ids = _ids(2, 16)
    full = prepare_batch({"input_ids": ids}, sp)
    shards = [shard_batch(full, k, sp) for k in range(sp)]
    sl = 16 // sp
    for k, sh in enumerate(shards):
        assert sh["input_ids"].shape == sh["shift_labels"].shape == sh["position_ids"].shape == (2, sl)
        assert torch.equal(sh["input_ids"], ids[:, k * sl : (k + 1) * sl])
        assert torch.equal(sh["position_ids"], torch.arange(k * sl, (k + 1) * sl).expand(2, sl))
        if k + 1 < sp:  # last token of shard k -> first token of shard k+1
            assert torch.equal(sh["shift_labels"][:, -1], shards[k + 1]["input_ids"][:, 0])
    assert (shards[-1]["shift_labels"][:, -1] == IGN).all()
    # concatenated shards are exactly the full-sequence shift
    cat = torch.cat([s["shift_labels"] for s in shards], dim=1)
    assert torch.equal(cat, make_shift_labels(ids))


def test_prepare_uses_labels_and_masks_padding_and_drops_consumed_keys():
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    labels = torch.tensor([[IGN, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    before = [t.clone() for t in (ids, labels, mask)]
    out = prepare_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, 2)
    assert all(torch.equal(a, b) for a, b in zip(before, (ids, labels, mask)))  # inputs untouched
    assert list(out) == ["input_ids", "position_ids", "shift_labels"]
    assert out["shift_labels"].tolist() == [[6, 7, 8, IGN], [10, IGN, IGN, IGN]]
    assert out["shift_labels"].dtype == torch.long


def test_prepare_keeps_given_position_ids_and_passes_other_entries():
    ids = _ids(2, 4)
    pos = torch.tensor([[3, 4, 5, 6], [0, 1, 0, 1]])
    extra = torch.arange(2 * 4 * 3).reshape(2, 4, 3)
    whole = torch.tensor([7, 8])
    out = prepare_batch(
        {"input_ids": ids, "position_ids": pos, "w": extra, "v": whole, "name": ["a", "b"]}, 2
    )
    assert torch.equal(out["position_ids"], pos)
    assert out["shift_labels"].tolist() == [[2, 3, 4, IGN], [6, IGN, 8, IGN]]
    assert out["name"] == ["a", "b"] and out["v"] is whole and out["w"] is extra
    sh = shard_batch(out, 1, 2)
    assert torch.equal(sh["w"], extra[:, 2:]) and sh["v"] is whole and sh["name"] == ["a", "b"]


def test_odd_length_is_padded_with_pad_id_ignore_labels_and_continuing_positions():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    extra = torch.ones(1, 7, 2)
    out = prepare_batch({"input_ids": ids, "position_ids": pos, "e": extra}, 4, pad_token_id=99)
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 99]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert out["shift_labels"].tolist() == [[2, 3, IGN, 5, 6, 7, IGN, IGN]]
    assert out["e"].shape == (1, 8, 2) and out["e"][0, 7].tolist() == [0, 0]


def test_strict_raises_with_length_sp_and_padded_length():
    with pytest.raises(
        ValueError,
        match=r"^sequence length 1001 is not divisible by 4 \(sp 4\); pad to a multiple of 4, e.g. 1004$",
    ):
        prepare_batch({"input_ids": torch.zeros(1, 1001, dtype=torch.long)}, 4, strict=True)
    assert prepare_batch({"input_ids": torch.zeros(1, 1000, dtype=torch.long)}, 4, strict=True)[
        "input_ids"
    ].shape == (1, 1000)


@pytest.mark.parametrize(
    "batch, match",
    [
        ([torch.zeros(1, 4)], r"each batch must be a dict with 'input_ids'.*got list"),
        ({"labels": torch.zeros(1, 4)}, r"batch has no 'input_ids' \(keys: \['labels'\]\)"),
        ({"input_ids": torch.zeros(4)}, r"'input_ids' must be a non-empty \[B, S\] tensor, got \(4,\)"),
        ({"input_ids": torch.zeros(2, 4), "position_ids": torch.zeros(1, 4)},
         r"'position_ids' has shape \(1, 4\) but input_ids is \[B, S\] = \(2, 4\)"),
        ({"input_ids": torch.zeros(2, 4), "labels": torch.zeros(2, 5)}, r"'labels' has shape \(2, 5\)"),
        ({"input_ids": torch.zeros(2, 4), "x": torch.zeros(3, 4)}, r"'x' has shape \(3, 4\).*batch size 2"),
        ({"input_ids": torch.zeros(2, 4), "shift_labels": torch.zeros(2, 4)}, r"already has 'shift_labels'"),
    ],
)  # fmt: skip
def test_bad_batches_raise_value_error(batch, match):
    with pytest.raises(ValueError, match=match):
        prepare_batch(batch, 2)


# ----------------------------------------------------------------------------- adapter without SP


def test_adapter_without_group_yields_prepared_batches_and_logs_padding_once(caplog):
    batches = [{"input_ids": _ids(1, 5), "tag": i} for i in range(3)]
    ad = UlyssesSPDataLoaderAdapter(batches, 0, None, 1, "cpu")
    assert len(ad) == 3
    with caplog.at_level(logging.WARNING, logger="ulysses_sp.data"):
        out = list(ad)
    assert [o["tag"] for o in out] == [0, 1, 2]
    assert out[0]["shift_labels"].tolist() == [[2, 3, 4, 5, IGN]]
    assert not [r for r in caplog.records if "padded" in r.getMessage()]  # 5 % 1 == 0
    assert len(list(ad)) == 3  # a second pass (epoch) starts over


def test_adapter_counts_the_real_tokens_of_each_batch_from_its_attention_mask():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    batches = [{"input_ids": _ids(2, 5), "attention_mask": mask}, {"input_ids": _ids(1, 5)}]
    ad = UlyssesSPDataLoaderAdapter(batches, 0, None, 1, "cpu")
    seen = []
    for out in ad:
        assert "attention_mask" not in out and not any(k.startswith("__") for k in out)  # never to the model
        seen.append(ad.last_real_tokens)
    assert seen == [7, 5]  # the mask's ones; without a mask, every token


def test_adapter_without_group_rejects_sp_size():
    with pytest.raises(ValueError, match=r"sp_group is None but sp_world_size=2"):
        UlyssesSPDataLoaderAdapter([], 0, None, 2, "cpu")


# ----------------------------------------------------------------------------- packing


def test_packing_collator_restarts_positions_and_ignores_boundaries():
    col = PackingCollator(12, pad_token_id=0)
    out = col([{"input_ids": [1, 2, 3]}, [4, 5], torch.tensor([6, 7, 8, 9])])
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 6]]
    assert out["labels"].tolist() == [[IGN, 2, 3, IGN, 5, IGN, 7, 8, 9, IGN, IGN, IGN]]
    shifted = prepare_batch(out, 2)["shift_labels"]
    # the last token of each document predicts nothing; padding predicts nothing
    assert shifted.tolist() == [[2, 3, IGN, 5, IGN, 7, 8, 9, IGN, IGN, IGN, IGN]]


def test_packing_collator_keeps_document_labels_and_truncates(caplog):
    col = PackingCollator(4)
    with caplog.at_level(logging.WARNING, logger="ulysses_sp.data"):
        out = col([{"input_ids": [1, 2, 3], "labels": [IGN, IGN, 3]}, [4, 5]])
    assert out["input_ids"].tolist() == [[1, 2, 3, 4]]
    assert out["labels"].tolist() == [[IGN, IGN, 3, IGN]]
    assert any("truncating" in r.getMessage() for r in caplog.records)


def test_packing_collator_without_max_length_pads_to_multiple():
    out = PackingCollator(pad_to_multiple_of=4, pad_token_id=9)([[1, 2, 3], [4, 5]])
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 9, 9, 9]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]


# ----------------------------------------------------------------------------- sampler order


def _batches(sampler, b):
    idx = list(sampler)
    return [idx[i : i + b] for i in range(0, len(idx), b)]


@pytest.mark.parametrize("dp, sp", [(1, 2), (2, 2), (3, 4)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_sampler_batch_size_1_is_distributed_sampler_at_rank_sp_rank_times_dp_plus_dp_rank(dp, sp, shuffle):
    data = list(range(50))
    for d in range(dp):
        for k in range(sp):
            s = sp_data_sampler(data, dp_size=dp, sp_size=sp, dp_rank=d, sp_rank=k, shuffle=shuffle, seed=3)
            ref = DistributedSampler(data, num_replicas=dp * sp, rank=k * dp + d, shuffle=shuffle, seed=3)
            assert isinstance(s, DistributedSampler) and (s.num_replicas, s.rank) == (dp * sp, k * dp + d)
            assert list(s) == list(ref) and len(s) == len(ref)
            order = (
                torch.randperm(50, generator=torch.Generator().manual_seed(3)).tolist() if shuffle else data
            )
            # rank (d, k)'s j-th sample is global sample (j*P + k)*D + d
            assert all(x == order[((j * sp + k) * dp + d) % 50] for j, x in enumerate(s))


@pytest.mark.parametrize("dp, sp, b", [(1, 2, 1), (2, 2, 3), (2, 4, 2), (1, 3, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_round_robin_reproduces_sp1_batch_order(dp, sp, b, drop_last):
    """Micro-step j*P + k of replica d (adapter order) is batch j of SP rank k: it must equal batch
    j*P + k of replica d in an sp=1 run with the same dp, seed and batch size."""
    data = list(range(61))
    for d in range(dp):
        ref = _batches(
            sp_data_sampler(data, dp_size=dp, sp_size=1, dp_rank=d, sp_rank=0, seed=1, batch_size=b), b
        )
        per_k = [
            _batches(sp_data_sampler(data, dp_size=dp, sp_size=sp, dp_rank=d, sp_rank=k, seed=1, batch_size=b,
                                     drop_last=drop_last), b)
            for k in range(sp)
        ]  # fmt: skip
        assert len({len(x) for x in per_k}) == 1  # every SP rank has the same number of batches
        steps = [per_k[k][j] for j in range(len(per_k[0])) for k in range(sp)]
        assert all(len(x) == b for x in steps)
        n_full = len(data) // (dp * b)  # sp=1 batches made of real (unpadded) samples
        m = min(len(steps), n_full)
        assert m >= 2 and steps[:m] == ref[:m]
        # ... which is also what a plain DistributedSampler over the D replicas gives an sp=1 run
        plain = _batches(DistributedSampler(data, num_replicas=dp, rank=d, seed=1), b)
        assert steps[:m] == plain[:m]


def test_sampler_set_epoch_changes_order_and_validates():
    s = SPDistributedSampler(list(range(20)), dp_size=1, sp_size=2, dp_rank=0, sp_rank=1)
    a = list(s)
    s.set_epoch(1)
    assert list(s) != a and len(s) == 10
    with pytest.raises(ValueError, match=r"sp_rank \(2\) must be in \[0, sp_size \(2\)\)"):
        SPDistributedSampler([1], dp_size=1, sp_size=2, dp_rank=0, sp_rank=2)
    with pytest.raises(ValueError, match="without a mesh give dp_size"):
        sp_data_sampler([1], dp_size=1)
