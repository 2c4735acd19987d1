"""In-process pieces of the engine: the warmup schedules and mesh-shape planning."""

from __future__ import annotations

import math

import pytest
import torch

from ulysses_sp.config import load_config
from ulysses_sp.engine import WarmupCosineLR, WarmupDecayLR, WarmupLR
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
