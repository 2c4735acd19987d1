"""In-process pieces of the engine: the warmup schedules, the SP sampler, mesh-shape planning."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from ulysses_sp.config import load_config
from ulysses_sp.engine import SequenceParallelSampler, WarmupCosineLR, WarmupDecayLR, WarmupLR
from ulysses_sp.engine.build import plan_mesh_shape

# ---- schedulers: optimizer step k runs with lr(k) ----


def _lrs(make, steps, lr=1.0):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_lr_linear_then_constant():
    lrs = _lrs(lambda o: WarmupLR(o, warmup_min_lr=0.1, warmup_num_steps=4, warmup_type="linear"), 7, lr=0.5)
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5])


def test_warmup_lr_log_and_explicit_max():
    lrs = _lrs(lambda o: WarmupLR(o, warmup_max_lr=2.0, warmup_num_steps=8), 10)
    assert lrs[0] == 0.0 and lrs[8:] == [2.0, 2.0]
    assert lrs[3] == pytest.approx(2.0 * math.log(4) / math.log(8))


def test_warmup_decay_lr_linear_decay_to_min_at_total():
    lrs = _lrs(lambda o: WarmupDecayLR(o, total_num_steps=6, warmup_num_steps=2, warmup_type="linear"), 8)
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


def test_warmup_cosine_lr_ratio_of_base_lr():
    make = lambda o: WarmupCosineLR(  # noqa: E731
        o,
        total_num_steps=6,
        warmup_num_steps=2,
        warmup_min_ratio=0.5,
        cos_min_ratio=0.1,
        warmup_type="linear",
    )
    lrs = _lrs(make, 8, lr=2.0)
    assert lrs[:3] == pytest.approx([1.0, 1.5, 2.0])
    assert lrs[4] == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))  # half-way down the cosine
    assert lrs[6:] == pytest.approx([0.2, 0.2])


def test_scheduler_rejects_total_below_warmup():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=r"total_num_steps \(3\) < warmup_num_steps \(5\)"):
        WarmupCosineLR(opt, total_num_steps=3, warmup_num_steps=5)


def test_scheduler_state_dict_resumes_exactly():
    def make(o):
        return WarmupDecayLR(o, total_num_steps=10, warmup_num_steps=3)

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make(opt)
    for _ in range(4):
        opt.step()
        sched.step()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = make(opt2)
    sched2.load_state_dict(sched.state_dict())
    sched.step()
    sched2.step()
    assert sched2.get_last_lr() == sched.get_last_lr()


# ---- the sampler: an sp=P run loads the batches of the sp=1 run, round-robin over SP ranks ----


@pytest.mark.parametrize("n, dp, sp, b", [(40, 2, 2, 3), (37, 2, 4, 2), (16, 1, 2, 1), (50, 3, 2, 4)])
def test_sp_sampler_round_robin_equals_the_sp1_batches(n, dp, sp, b):
    data = list(range(n))
    for d in range(dp):
        sp1 = [
            x.tolist()
            for x in DataLoader(data, batch_size=b, sampler=DistributedSampler(data, dp, d, seed=3))
        ]
        per_rank = [
            [x.tolist() for x in DataLoader(data, batch_size=b, sampler=SequenceParallelSampler(
                data, dp_size=dp, dp_rank=d, sp_size=sp, sp_rank=k, batch_size=b, seed=3))]
            for k in range(sp)
        ]  # fmt: skip
        assert len({len(r) for r in per_rank}) == 1  # every SP rank yields the same number of batches
        assert all(len(batch) == b for r in per_rank for batch in r)  # all full: padded by wrap-around
        interleaved = [per_rank[i % sp][i // sp] for i in range(len(per_rank[0]) * sp)]
        full_sp1 = [batch for batch in sp1 if len(batch) == b]  # sp=1 may end with a short batch
        assert interleaved[: len(full_sp1)] == full_sp1


def test_sp_sampler_epochs_and_drop_last():
    data = list(range(20))
    s = SequenceParallelSampler(
        data, dp_size=1, dp_rank=0, sp_size=2, sp_rank=0, batch_size=3, drop_last=True
    )
    assert len(s) == len(list(s)) == 9  # 18 of 20 samples form 3 full rounds of 2 batches of 3
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first


def test_world_size_sampler_regroups_batches_when_micro_batch_above_one():
    """Why the sampler is not DistributedSampler(num_replicas=dp*sp): with B > 1 it deals out
    samples, not batches, and the round-robin order no longer reproduces the sp=1 batches."""
    data, dp, sp, b = list(range(16)), 1, 2, 2
    sp1 = [
        x.tolist()
        for x in DataLoader(data, batch_size=b, sampler=DistributedSampler(data, dp, 0, shuffle=False))
    ]
    per_rank = [
        [
            x.tolist()
            for x in DataLoader(
                data, batch_size=b, sampler=DistributedSampler(data, dp * sp, k, shuffle=False)
            )
        ]
        for k in range(sp)
    ]
    assert [per_rank[i % sp][i // sp] for i in range(len(sp1))] != sp1


# ---- planning the mesh shape (pure) ----


class _Mpu:
    def __init__(self, sp, dp=None):
        self.sp, self.dp = sp, dp

    def get_sequence_parallel_world_size(self):
        return self.sp


class _FullMpu(_Mpu):
    def get_data_parallel_world_size(self):
        return self.dp


@pytest.mark.parametrize(
    "config, kwargs, want",
    [
        ({}, {}, (8, 1)),
        ({"sequence_parallel_size": 4}, {}, (2, 4)),
        ({"data_parallel_size": 4}, {}, (4, 2)),
        ({}, {"mesh_param": (2, 4)}, (2, 4)),
        ({"sequence_parallel_size": 4}, {"mesh_param": (2, 4)}, (2, 4)),
        ({}, {"mpu": _Mpu(2)}, (4, 2)),
        ({"sequence_parallel_size": 2, "data_parallel_size": 4}, {"mpu": _FullMpu(2, 4)}, (4, 2)),
        ({}, {"mpu": _Mpu(4), "mesh_param": (2, 4)}, (2, 4)),
    ],
)
def test_plan_mesh_shape(config, kwargs, want):
    assert plan_mesh_shape(8, load_config(config), **kwargs) == want


@pytest.mark.parametrize(
    "config, kwargs, match",
    [
        ({"sequence_parallel_size": 2}, {"mesh_param": (2, 4)}, r"config sequence_parallel_size \(2\) disagrees with mesh_param \(2, 4\)"),
        ({"data_parallel_size": 1}, {"mesh_param": (2, 4)}, r"config data_parallel_size \(1\) disagrees with mesh_param"),
        ({"sequence_parallel_size": 8}, {"mpu": _Mpu(4)}, r"config sequence_parallel_size \(8\) disagrees with the mpu \(sp_size 4\)"),
        ({}, {"mpu": _FullMpu(4, 4)}, r"dp_size \(4\) \* sp_size \(4\) = 16 != world_size \(8\)"),
        ({}, {"mpu": _Mpu(3)}, r"sequence_parallel_size \(3\) does not divide world_size \(8\)"),
        ({}, {"mpu": object()}, r"mpu must have get_sequence_parallel_world_size"),
        ({}, {"mesh_param": (4, 4)}, r"dp_size \(4\) \* sp_size \(4\) = 16 != world_size \(8\)"),
        ({}, {"mesh_param": [2, True]}, r"must be a positive int, got True"),
        ({}, {"mesh_param": "2x4"}, r"mesh_param must be a pair"),
    ],
)  # fmt: skip
def test_plan_mesh_shape_errors(config, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_mesh_shape(8, load_config(config), **kwargs)
