"""The (dp, sp) mesh: group membership, axis names, coordinates, and the DP world-size rule."""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist
from harness import WorkerError

from ulysses_sp.parallel.mesh import MESH_AXES, Mpu, init_mesh
from ulysses_sp.parallel.mesh_shape import check_mesh_param, data_parallel_world_size, resolve_mesh_shape


def _groups(mesh_param):
    mesh = init_mesh(mesh_param)
    mpu = Mpu(mesh)
    info = mesh
    return {
        "names": tuple(mesh.device_mesh.mesh_dim_names),
        "sp_ranks": dist.get_process_group_ranks(mpu.get_sequence_parallel_group()),
        "dp_ranks": dist.get_process_group_ranks(mpu.get_data_parallel_group()),
        "coords": (info.dp_rank, info.sp_rank),
        "sizes": (mpu.get_data_parallel_world_size(), mpu.get_sequence_parallel_world_size()),
        "mpu_ranks": (mpu.get_data_parallel_rank(), mpu.get_sequence_parallel_rank()),
    }


@pytest.mark.parametrize(
    "mesh_param, sp_groups",
    [
        ((2, 4), [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ((1, 2), [[0, 1]]),
        ((2, 1), [[0], [1]]),
        ((2, 2), [[0, 1], [2, 3]]),
    ],
)
def test_mesh_groups_match_reference_layout(pool, mesh_param, sp_groups):
    dp, sp = mesh_param
    out = pool.run(_groups, dp * sp, mesh_param)
    for rank, o in enumerate(out):
        assert o["names"] == MESH_AXES
        assert o["sp_ranks"] == sp_groups[rank // sp]
        assert o["dp_ranks"] == [rank % sp + j * sp for j in range(dp)]
        assert o["coords"] == (rank // sp, rank % sp) == o["mpu_ranks"]
        assert o["sizes"] == (dp, sp)


def test_mesh_wrong_product_fails_every_rank_with_numbers(pool):
    with pytest.raises(WorkerError) as ei:
        pool.run(_groups, 4, (3, 2))
    assert len(ei.value.failures) == 4
    for msg in ei.value.messages():
        assert "dp_size (3) * sp_size (2) = 6 != world_size (4)" in msg


def test_init_mesh_without_process_group_says_how_to_launch():
    with pytest.raises(ValueError, match="torchrun"):
        init_mesh((1, 1))


@pytest.mark.parametrize(
    "world, dp, sp, want",
    [(8, None, 4, (2, 4)), (8, 2, None, (2, 4)), (8, None, None, (8, 1)), (4, 2, 2, (2, 2))],
)
def test_resolve_mesh_shape_derives_missing_size(world, dp, sp, want):
    assert resolve_mesh_shape(world, dp, sp) == want


@pytest.mark.parametrize(
    "dp, sp, match",
    [
        (0, 2, r"data_parallel_size must be >= 1, got 0"),
        (2, 0, r"sequence_parallel_size must be >= 1, got 0"),
        (2, 1.5, r"sequence_parallel_size must be a positive int, got 1.5"),
        (None, 3, r"sequence_parallel_size \(3\) does not divide world_size \(8\)"),
        (3, None, r"data_parallel_size \(3\) does not divide world_size \(8\)"),
        (2, 2, r"dp_size \(2\) \* sp_size \(2\) = 4 != world_size \(8\)"),
        (True, 8, r"must be a positive int, got True"),
    ],
)
def test_resolve_mesh_shape_rejects_bad_sizes(dp, sp, match):
    with pytest.raises(ValueError, match=match):
        resolve_mesh_shape(8, dp, sp)


@pytest.mark.parametrize("bad", [4, (2,), (1, 2, 3), "2,2", None])
def test_mesh_param_must_be_a_pair(bad):
    with pytest.raises(ValueError, match="mesh_param must be a pair"):
        check_mesh_param(bad)


class _FullMpu:
    def get_data_parallel_world_size(self):
        return 3

    def get_sequence_parallel_world_size(self):
        return 4


class _UlyssesMpu:
    def get_sequence_parallel_world_size(self):
        return 4


def test_dp_world_size_rule_1_mpu_with_dp_size_wins():
    mesh = types.SimpleNamespace(mesh_dim_names=MESH_AXES, size=lambda d: (5, 1)[d])
    assert data_parallel_world_size(12, mpu=_FullMpu(), mesh=mesh, sequence_parallel_size=6) == 3


def test_dp_world_size_rule_2_mpu_without_dp_size_divides_by_sp():
    mesh = types.SimpleNamespace(mesh_dim_names=MESH_AXES, size=lambda d: (5, 1)[d])
    assert data_parallel_world_size(8, mpu=_UlyssesMpu(), mesh=mesh, sequence_parallel_size=1) == 2


def test_dp_world_size_rule_3_mesh_data_parallel_axis():
    mesh = types.SimpleNamespace(mesh_dim_names=MESH_AXES, size=lambda d: (2, 4)[d])
    assert data_parallel_world_size(8, mesh=mesh, sequence_parallel_size=8) == 2


def test_dp_world_size_rule_4_config_sequence_parallel_size():
    assert data_parallel_world_size(8, sequence_parallel_size=4) == 2


def test_dp_world_size_rule_5_full_world():
    assert data_parallel_world_size(8) == 8


def test_dp_world_size_rule_rejects_sp_not_dividing_world():
    with pytest.raises(ValueError, match=r"sequence_parallel_size \(3\) does not divide world_size \(8\)"):
        data_parallel_world_size(8, sequence_parallel_size=3)
