"""The adapter across real gloo ranks: round robin, len, passthrough, variable lengths, bad input."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.distributed as dist
from harness import WorkerError

from ulysses_sp.data import (
    PackingCollator,
    UlyssesSPDataLoaderAdapter,
    prepare_batch,
    shard_batch,
    sp_data_sampler,
)
from ulysses_sp.parallel.mesh import init_mesh

IGN = -100
B = 2


def _lengths(p: int) -> list[list[int]]:
    """lengths[rank][step]: different across ranks and steps, some not divisible by p."""
    return [[4 * p + 2 * r + 3 * j + (1 if (r + j) % 2 else 0) for j in range(3)] for r in range(p)]


def _batch(rank: int, step: int, s: int) -> dict:
    ids = rank * 10000 + step * 1000 + torch.arange(B * s).reshape(B, s)
    labels = ids.clone()
    labels[:, 1] = IGN
    return {
        "input_ids": ids,
        "labels": labels,
        "e": torch.randn(B, s, 3, generator=torch.Generator().manual_seed(rank * 10 + step)),
        "w": torch.tensor([rank, step]),  # no sequence dim: passed whole
        "meta": {"rank": rank, "step": step},  # non-tensor: passed unchanged
    }


class _Counting:
    """A loader that counts how many batches were taken from it."""

    def __init__(self, batches):
        self.batches, self.taken = batches, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for b in self.batches:
            self.taken += 1
            yield b


def _run_round_robin(p: int):
    rank = dist.get_rank()
    lengths = _lengths(p)[rank]
    dl = _Counting([_batch(rank, j, s) for j, s in enumerate(lengths)])
    ad = UlyssesSPDataLoaderAdapter(dl, rank, dist.group.WORLD, p, torch.device("cpu"))
    it = iter(ad)
    outs, taken = [], []
    for out in it:  # the loader is consumed one round at a time, never ahead
        taken.append(dl.taken)
        outs.append(out)
    return {"len": len(ad), "outs": outs, "taken": taken, "second_pass": len(list(ad))}


@pytest.mark.parametrize("p", [2, 4])
def test_round_robin_invariant_len_passthrough_variable_lengths(pool, p):
    res = pool.run(_run_round_robin, p, p)
    lengths = _lengths(p)
    assert any(s % p for row in lengths for s in row)  # the padding path is exercised
    for k, r in enumerate(res):
        assert r["len"] == 3 * p
        assert len(r["outs"]) == 3 * p
        assert r["taken"] == [t // p + 1 for t in range(3 * p)]  # one batch per round, when the round starts
        assert r["second_pass"] == 3 * p
        for t, out in enumerate(r["outs"]):
            j, i = divmod(t, p)  # round j, micro-step i: the batch SP rank i loaded at its step j
            src = _batch(i, j, lengths[i][j])
            want = shard_batch(prepare_batch(src, p), k, p)
            assert list(out) == list(want) == ["input_ids", "position_ids", "shift_labels", "e", "w", "meta"]
            for key in ("input_ids", "position_ids", "shift_labels", "e", "w"):
                torch.testing.assert_close(
                    out[key], want[key], rtol=0, atol=0, msg=f"{key} step {t} rank {k}"
                )
            s_pad = -(-lengths[i][j] // p) * p
            assert out["input_ids"].shape == (B, s_pad // p)
            assert out["meta"] == {"rank": i, "step": j}
            # rank k holds tokens [k*S/P, (k+1)*S/P) of that batch
            lo = k * (s_pad // p)
            assert out["position_ids"][0, 0].item() == lo
            if lo < lengths[i][j]:
                assert out["input_ids"][0, 0].item() == i * 10000 + j * 1000 + lo


def _run_boundary_and_log(p: int):
    rank = dist.get_rank()
    s = 4 * p + 1  # needs padding
    ids = torch.arange(1, s + 1).repeat(B, 1) + 100 * rank
    records = []

    class _H(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("ulysses_sp.data")
    h = _H()
    log.addHandler(h)
    try:
        ad = UlyssesSPDataLoaderAdapter(
            [{"input_ids": ids}] * 2, rank, dist.group.WORLD, p, "cpu", pad_token_id=7
        )
        outs = list(ad)
    finally:
        log.removeHandler(h)
    return outs, records


def test_boundary_labels_across_ranks_and_padding_logged_once(pool):
    p = 2
    res = pool.run(_run_boundary_and_log, p, p)
    for i in range(p):  # micro-step i of round 0: batch of rank i
        left, right = res[0][0][i], res[1][0][i]
        assert torch.equal(left["shift_labels"][:, -1], right["input_ids"][:, 0])
        assert (right["shift_labels"][:, -2:] == IGN).all()  # last real token, then the pad
        assert (right["input_ids"][:, -1] == 7).all()
    for _, records in res:
        assert len(records) == 1
        assert (
            "sequence length 9 is not divisible by 2 (sp 2); pad to a multiple of 2, e.g. 10: padded to 10"
            in records[0]
        )


# ----------------------------------------------------------------------------- bad input


def _run_bad(case: str, p: int):
    rank = dist.get_rank()
    group, sp_size, strict = dist.group.WORLD, p, False
    batch = {"input_ids": torch.ones(B, 4 * p, dtype=torch.long)}
    batches = [batch, batch]
    if case == "not_dict" and rank == 1:
        batches = [batch, [batch["input_ids"]]]
    elif case == "no_input_ids" and rank == 1:
        batches = [batch, {"labels": batch["input_ids"]}]
    elif case == "batch_size" and rank == 1:
        batches = [batch, {"input_ids": torch.ones(B + 1, 4 * p, dtype=torch.long)}]
    elif case == "position_ids" and rank == 1:
        batches = [batch, {"input_ids": batch["input_ids"], "position_ids": torch.arange(4 * p)[None]}]
    elif case == "strict":
        strict = True
        if rank == 1:
            batches = [batch, {"input_ids": torch.ones(B, 4 * p + 1, dtype=torch.long)}]
    elif case == "sp_size_all":
        sp_size = p + 1
    elif case == "sp_size_one" and rank == 1:
        sp_size = 1
    elif case == "lengths" and rank == 1:
        batches = [batch]
    elif case == "keys" and rank == 1:
        batches = [batch, {**batch, "x": torch.ones(3)}]
    ad = UlyssesSPDataLoaderAdapter(batches, rank, group, sp_size, "cpu", strict=strict)
    return len(list(ad))


BAD_CASES = {
    "not_dict": r"each batch must be a dict with 'input_ids'.*got list",
    "no_input_ids": r"batch has no 'input_ids'",
    "batch_size": r"batch size differs between SP ranks: input_ids batch sizes \[2, 3",
    "position_ids": r"'position_ids' has shape \(1, \d+\) but input_ids is \[B, S\] = \(2, \d+\)",
    "strict": r"sequence length (9|17) is not divisible by (2|4) \(sp (2|4)\); pad to a multiple of (2|4), e.g. (10|20)",
    "sp_size_all": r"sp_world_size \((3|5)\) != size of sp_group \((2|4)\)",
    "sp_size_one": r"sp_world_size \(1\) != size of sp_group \((2|4)\)",
    "lengths": r"loaders have different lengths: rank\(s\) \[1\] of the group ran out",
    "keys": r"batch keys differ between SP ranks",
}
# every case with p=2; with p=4 the cases whose message depends on the group size
BAD_RUNS = [(c, 2) for c in BAD_CASES] + [(c, 4) for c in ("batch_size", "strict", "sp_size_one")]


@pytest.mark.parametrize("case, p", BAD_RUNS)
def test_bad_input_raises_value_error_on_every_rank(pool, case, p):
    with pytest.raises(WorkerError) as ei:
        pool.run(_run_bad, p, case, p)
    err = ei.value
    assert sorted(err.failures) == list(range(p)), "every rank must fail, none may hang"
    assert err.types() == {"ValueError"}
    for msg in err.messages():
        assert re.search(BAD_CASES[case], msg), msg


# ----------------------------------------------------------------------------- deterministic order


def _run_order(dp: int, sp: int, n_docs: int):
    """Packed docs through sp_data_sampler + DataLoader + adapter; return the full input_ids of every
    micro-step (gathered over the SP group) as lists."""
    mesh = init_mesh((dp, sp))
    info = mesh
    docs = [[100 * i + t for t in range(1 + (i % 5))] for i in range(n_docs)]
    sampler = sp_data_sampler(docs, mesh, batch_size=3, seed=5)
    dl = torch.utils.data.DataLoader(docs, batch_size=3, sampler=sampler, collate_fn=PackingCollator(16))
    ad = UlyssesSPDataLoaderAdapter(dl, info.sp_rank, mesh.sp_group, sp, "cpu")
    steps = []
    for out in ad:
        parts = [torch.empty_like(out["input_ids"]) for _ in range(sp)]
        dist.all_gather(parts, out["input_ids"], group=mesh.sp_group)
        steps.append(torch.cat(parts, dim=1).tolist())
    return info.dp_rank, steps


def test_sp_run_sees_the_sp1_global_batches_in_the_same_order(pool):
    n = 48  # a multiple of dp * sp * batch_size: no tail padding
    sp_res = pool.run(_run_order, 4, 2, 2, n)
    ref = pool.run(_run_order, 2, 2, 1, n)
    for d in range(2):
        want = next(steps for dd, steps in ref if dd == d)
        for dd, steps in sp_res:
            if dd == d:
                assert len(steps) == len(want) == n // (2 * 3)
                assert steps == want
