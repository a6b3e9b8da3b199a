"""Topology: config validation (no process group) and meshes built on a real 8-rank gloo world."""

import datetime

import pytest
import torch
import torch.distributed as dist

from meshkd.core.layouts import _mesh_size
from meshkd.core.topology import (
    MESH_AXES,
    DistributedSetup,
    Replica,
    create_kd_distributed_setups,
    get_current_setup,
    last_stage_ranks,
    model_replicas,
    validate_kd_config,
)
from tests.world import world_test


def separate(student, teacher):
    return {"separate_meshes": True, "distributed": student, "teacher_distributed": teacher}


@pytest.mark.parametrize(
    "cfg, world_size, message",
    [
        ({"teacher_distributed": {"dp_size": 1}}, 2, "teacher_distributed is set but separate_meshes is false"),
        ({"separate_meshes": True, "distributed": {"dp_size": 1}}, 2, "teacher_distributed is missing"),
        (separate({"tp_size": 2}, {"dp_size": 1}), 3, r"distributed.dp_size is required"),
        (separate({"dp_size": 1}, {"tp_size": 2}), 3, r"teacher_distributed.dp_size is required"),
        (separate({"dp_size": 2}, {"dp_size": 1, "ep_size": 2}), 3, r"teacher_distributed.ep_size\(2\) > 1 must equal"),
        (separate({"dp_size": 1, "ep_size": 2}, {"dp_size": 1}), 3, r"^distributed.ep_size\(2\) > 1 must equal"),
        (separate({"dp_size": 4, "dp_replicate_size": 2, "ep_size": 4}, {"dp_size": 1}), 5,
         r"^distributed.ep_size\(4\) > 1 must equal tp_size\(1\) .* dp_size / dp_replicate_size \(2\)"),
        (separate({"dp_size": 2, "tp_size": 2}, {"dp_size": 1}), 4, r"4 \+ 1 != world size 4"),
        (separate({"dp_size": 2, "strategy": "ddp"}, {"dp_size": 1}), 3, "distributed.strategy 'ddp'"),
        ({"distributed": {"tp_size": 0}}, 2, r"distributed.tp_size must be a positive integer, got 0"),
        ({"distributed": {"cp_size": 1.5}}, 2, r"distributed.cp_size must be a positive integer, got 1.5"),
        ({"distributed": {"pp_size": True}}, 2, r"distributed.pp_size must be a positive integer"),
        ({"distributed": {"tp_size": 3}}, 4, r"world size 4 is not divisible by .* = 3"),
        ({"distributed": {"dp_size": 3}}, 4, r"dp_size\(3\) \* tp_size\(1\) .* = 3 != world size 4"),
        ({"distributed": {"dp_size": 4, "dp_replicate_size": 3}}, 4, r"dp_replicate_size\(3\) must divide"),
        ({"distributed": {"tp": 2}}, 2, r"distributed: unknown key\(s\) \['tp'\]"),
        (separate({"dp_size": 1}, {"dp_size": 1, "pp": 2}), 2, r"teacher_distributed: unknown key\(s\) \['pp'\]"),
        ({"distributed": {"strategy": "zero3"}}, 2, "distributed.strategy must be one of"),
        ({"separate_meshes": "yes"}, 2, "separate_meshes must be true or false"),
    ],
)
def test_bad_configs_fail_before_any_collective(cfg, world_size, message):
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=message):
        create_kd_distributed_setups(cfg, world_size)


def test_experts_go_over_the_tp_ranks_or_with_tp_1_over_the_dp_shard_ranks():
    layouts = {(2, 2, 2): "tp", (4, 1, 4): "dp_shard", (2, 2, 1): None}  # (dp, tp, ep) -> axis
    for (dp, tp, ep), axis in layouts.items():
        student, _, _ = validate_kd_config(separate({"dp_size": dp, "tp_size": tp, "ep_size": ep}, {"dp_size": 1}),
                                           dp * tp + 1)
        assert student.expert_axis == axis, (dp, tp, ep)


def test_shared_sizes_resolve_left_over_ranks_to_data_parallel():
    student, teacher, is_separate = validate_kd_config({"distributed": {"tp_size": 2, "dp_replicate_size": 2}}, 8)
    assert not is_separate and student is teacher
    assert (student.dp_size, student.dp_replicate_size, student.dp_shard_size, student.tp_size) == (4, 2, 2, 2)
    assert student.ranks == tuple(range(8)) and student.strategy == "fsdp2"


def test_separate_sizes_assign_student_then_teacher_ranks():
    cfg = separate({"dp_size": 3}, {"dp_size": 1, "tp_size": 2, "pp_size": 2})
    student, teacher, is_separate = validate_kd_config(cfg, 7)
    assert is_separate and student.ranks == (0, 1, 2) and teacher.ranks == (3, 4, 5, 6)
    assert _mesh_size({"dp_size": 2, "tp_size": 2, "cp_size": 2}, "teacher_distributed") == 8


def test_replica_endpoints_without_a_process_group():
    setup = DistributedSetup(ranks=tuple(range(8)), dp_size=2, pp_size=2, tp_size=2)
    # Axes (pp, dp_replicate, dp_shard, cp, tp): rank = 4 * pp + 2 * dp + tp.
    assert model_replicas(setup) == [
        Replica(ranks=(0, 1, 4, 5), input_rank=0, output_rank=4),
        Replica(ranks=(2, 3, 6, 7), input_rank=2, output_rank=6),
    ]
    assert last_stage_ranks(setup) == [(4, 5), (6, 7)]


# ---- checks on a real 8-rank world ----


def check_shared_mesh_has_fixed_axes_and_dp_view():
    setups = create_kd_distributed_setups({"distributed": {"dp_size": 2, "pp_size": 2, "tp_size": 2}}, 8)
    assert not setups.separate and setups.student is setups.teacher
    assert setups.student_ranks == setups.teacher_ranks == tuple(range(8))
    mesh = setups.student.device_mesh
    assert mesh.mesh_dim_names == MESH_AXES and tuple(mesh.shape) == (2, 1, 2, 1, 2)
    rank = dist.get_rank()
    dp_mesh = mesh["dp"]
    assert dp_mesh.size() == 2
    assert dist.get_process_group_ranks(dp_mesh.get_group()) == sorted({rank, rank ^ 2})
    assert dist.get_process_group_ranks(setups.student.pp_group) == sorted({rank, rank ^ 4})
    assert get_current_setup() is setups.student
    assert model_replicas(setups.student) == [
        Replica(ranks=(0, 1, 4, 5), input_rank=0, output_rank=4),
        Replica(ranks=(2, 3, 6, 7), input_rank=2, output_rank=6),
    ]
    # The dp group works: sum of ranks over dp.
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=dp_mesh.get_group())
    assert total.item() == rank + (rank ^ 2)


def check_hsdp_dp_view_spans_replicate_and_shard():
    setups = create_kd_distributed_setups({"distributed": {"dp_size": 4, "dp_replicate_size": 2, "tp_size": 2}}, 8)
    mesh = setups.student.device_mesh
    assert tuple(mesh.shape) == (1, 2, 2, 1, 2)
    tp_rank = dist.get_rank() % 2
    assert dist.get_process_group_ranks(mesh["dp"].get_group()) == [r for r in range(8) if r % 2 == tp_rank]
    assert len(model_replicas(setups.student)) == 4


def check_separate_meshes_span_only_their_ranks():
    cfg = separate({"dp_size": 2, "tp_size": 2}, {"dp_size": 1, "pp_size": 2, "tp_size": 2})
    setups = create_kd_distributed_setups(cfg, 8)
    rank = dist.get_rank()
    assert setups.separate and setups.student_ranks == (0, 1, 2, 3) and setups.teacher_ranks == (4, 5, 6, 7)
    mine = setups.student if rank < 4 else setups.teacher
    assert get_current_setup() is mine and mine.is_member
    assert mine.device_mesh.get_coordinate() is not None
    other = setups.teacher if rank < 4 else setups.student
    assert other.device_mesh.get_coordinate() is None and other.pp_group is None
    dp_ranks = dist.get_process_group_ranks(mine.device_mesh["dp"].get_group())
    assert dp_ranks == ([rank % 2, rank % 2 + 2] if rank < 4 else [rank])
    # Every rank (members or not) computes the same replicas.
    assert model_replicas(setups.student) == [
        Replica(ranks=(0, 1), input_rank=0, output_rank=0),
        Replica(ranks=(2, 3), input_rank=2, output_rank=2),
    ]
    assert model_replicas(setups.teacher) == [Replica(ranks=(4, 5, 6, 7), input_rank=4, output_rank=6)]


def check_mesh_groups_take_the_timeout_and_never_the_world_group():
    timeout = datetime.timedelta(seconds=41)
    setup = create_kd_distributed_setups({"distributed": {"dp_size": 4, "tp_size": 2}}, 8, timeout=timeout).student
    assert setup.collective_timeout == timeout
    mesh = setup.device_mesh
    # The flattened dp view spans dp_shard alone here, the whole world with tp 1 (a view made later, as cp's is).
    whole = create_kd_distributed_setups({"distributed": {"dp_size": 8}}, 8, timeout=timeout).student.device_mesh
    for group in [*(mesh.get_group(axis) for axis in (*MESH_AXES, "dp")), whole.get_group("dp_shard"),
                  whole.get_group("dp")]:
        # A mesh axis spanning the world would otherwise reuse the world group, where meshkd waits blocking.
        assert group is not dist.group.WORLD
        assert group._get_backend(torch.device("cpu")).options._timeout == timeout


def check_world_size_must_match_the_process_group():
    with pytest.raises(ValueError, match="world_size 4 does not match the process group's size 8"):
        create_kd_distributed_setups({"distributed": {"dp_size": 4}}, 4)


def check_replicas_need_a_data_parallel_axis():
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.arange(8).reshape(2, 4), mesh_dim_names=("pp", "tp"))
    setup = DistributedSetup(ranks=tuple(range(8)), tp_size=4, pp_size=2, dp_size=1, device_mesh=mesh)
    with pytest.raises(ValueError, match="no data-parallel axis"):
        model_replicas(setup)


test_eight_rank_world = world_test(
    8,
    [
        check_shared_mesh_has_fixed_axes_and_dp_view,
        check_hsdp_dp_view_spans_replicate_and_shard,
        check_separate_meshes_span_only_their_ranks,
        check_mesh_groups_take_the_timeout_and_never_the_world_group,
        check_world_size_must_match_the_process_group,
        check_replicas_need_a_data_parallel_axis,
    ],
)
