"""Topology: which global ranks hold the student and the teacher, and how each role is laid out.

Design. A role's layout is a `DistributedSetup` (`meshkd.core.layouts`): validated parallel sizes plus a
DeviceMesh over exactly the role's ranks with the fixed axes (pp, dp_replicate, dp_shard, cp, tp) and a
flattened `dp` view. `create_kd_distributed_setups` validates the whole configuration before touching
torch.distributed (`meshkd.core.layouts.validate_kd_config`), so a bad config fails in milliseconds with a
message naming the key; only then does it build the meshes.

Mesh construction is collective over the whole world (every `new_group` inside DeviceMesh is), so every
rank builds both roles' meshes, including the one it is not in. torch cannot slice or flatten a mesh on a
rank outside it through the public API (`mesh[...]` needs the local rank), so the `dp` view is built from
the root mesh's layout, which every rank can compute (see `flatten_axes`).

Every mesh group (each axis, and the flattened views) is created with the run's collective timeout
(`timeout=`, kept in `DistributedSetup.collective_timeout` for the views flattened later) and without
NCCL's blocking wait, so FSDP2, tp, cp and pp overlap communication with compute: `meshkd.core.groups`.

The rank's own setup is registered as the "current" one (`set_current_setup`), which is where the
pipeline-parallel helpers find their default pipeline group.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshkd.core.groups import mesh_backend_override
from meshkd.core.layouts import (
    MESH_AXES,
    PP_SCHEDULES,
    DistributedSetup,
    _ConfigLike,
    validate_kd_config,
    validate_teacher_layouts,
)

__all__ = ["MESH_AXES", "PP_SCHEDULES", "DistributedSetup", "KDDistributedSetups", "Replica", "TeacherSetups",
           "create_kd_distributed_setups", "create_teacher_setups", "flatten_axes", "get_current_setup",
           "last_stage_ranks", "member_mesh", "model_replicas", "set_current_setup", "validate_kd_config",
           "validate_teacher_layouts"]


@dataclass(frozen=True)
class KDDistributedSetups:
    """Student/teacher setups plus their global-rank assignments."""

    student: DistributedSetup
    teacher: DistributedSetup
    student_ranks: tuple[int, ...]
    teacher_ranks: tuple[int, ...]
    separate: bool

    @property
    def local(self) -> DistributedSetup:
        """The setup of the calling rank's role (the student's where both roles share ranks)."""
        return self.student if dist.get_rank() in self.student_ranks else self.teacher

    @property
    def roles(self) -> dict[str, tuple[int, ...]]:
        """Role name -> its global ranks, as failure messages name them."""
        if not self.separate:
            return {"student and teacher": self.student_ranks}
        return {"student": self.student_ranks, "teacher": self.teacher_ranks}


@dataclass(frozen=True)
class TeacherSetups:
    """The student's setup and each teacher's: its own (on ranks of its own) or the student's (on its ranks).

    Ranks: the student's [0, S), then each teacher with ranks of its own in the order given. `teachers` maps
    a teacher's name to its setup, in that order.
    """

    student: DistributedSetup
    teachers: dict[str, DistributedSetup]

    def separate(self, name: str) -> bool:
        """Whether teacher `name` runs on ranks of its own."""
        return self.teachers[name] is not self.student

    def pair(self, name: str) -> KDDistributedSetups:
        """The student and teacher `name` as a one-teacher `KDDistributedSetups` (what a bridge connects)."""
        teacher = self.teachers[name]
        return KDDistributedSetups(student=self.student, teacher=teacher, student_ranks=self.student.ranks,
                                   teacher_ranks=teacher.ranks, separate=self.separate(name))

    def role(self, name: str) -> str:
        """How messages name teacher `name`: "teacher" when it is the only one, else "teacher 'NAME'"."""
        return "teacher" if len(self.teachers) == 1 else f"teacher '{name}'"

    @property
    def roles(self) -> dict[str, tuple[int, ...]]:
        """Role name -> its global ranks; the student's role also names the teachers that share its ranks."""
        shared = [self.role(name) for name in self.teachers if not self.separate(name)]
        student = " and ".join(["student", *shared]) if len(shared) < 2 else f"student and {len(shared)} teachers"
        return {student: self.student.ranks, **{self.role(name): setup.ranks
                                                for name, setup in self.teachers.items() if self.separate(name)}}

    @property
    def local(self) -> tuple[str | None, DistributedSetup]:
        """(the teacher's name, its setup) on a teacher-only rank; (None, the student's setup) on a student rank."""
        rank = dist.get_rank()
        for name, setup in self.teachers.items():
            if self.separate(name) and rank in setup.ranks:
                return name, setup
        return None, self.student


@dataclass(frozen=True)
class Replica:
    """One data-parallel copy of a model: its ranks, where its input enters, where its output leaves."""

    ranks: tuple[int, ...]
    input_rank: int
    output_rank: int


_current_setup: DistributedSetup | None = None


def set_current_setup(setup: DistributedSetup | None) -> None:
    """Register the setup whose pipeline group the pipeline-parallel helpers use by default.

    `create_kd_distributed_setups` registers the calling rank's own role; call this to override it.
    """
    global _current_setup
    _current_setup = setup


def get_current_setup() -> DistributedSetup | None:
    """The setup registered by `set_current_setup` (or by `create_kd_distributed_setups`)."""
    return _current_setup


def create_teacher_setups(student_section: Any, teacher_sections: Mapping[str, Any], world_size: int, *,
                          device_type: str | None = None, timeout: datetime.timedelta | None = None) -> TeacherSetups:
    """Build the student's and every teacher's setups (`validate_teacher_layouts`); every rank must call this.

    Meshes are built in order, the student's first, then each teacher with ranks of its own; a teacher on
    the student's ranks shares the student's setup. The calling rank's own setup is registered with
    `set_current_setup`. `timeout`: how long a mesh group's collective may wait (None: torch's default).
    """
    student, teachers = validate_teacher_layouts(student_section, teacher_sections, world_size)
    if not dist.is_initialized():
        raise RuntimeError("create_teacher_setups needs torch.distributed.init_process_group() first")
    if dist.get_world_size() != world_size:
        raise ValueError(f"world_size {world_size} does not match the process group's size {dist.get_world_size()}")
    device_type = device_type or _default_device_type()
    student = _build_mesh(student, device_type, timeout)
    setups = TeacherSetups(student=student, teachers={
        name: student if setup is None else _build_mesh(setup, device_type, timeout)
        for name, setup in teachers.items()})
    set_current_setup(setups.local[1])
    return setups


def flatten_axes(mesh: DeviceMesh, axes: tuple[str, ...], name: str, *,
                 timeout: datetime.timedelta | None = None) -> None:
    """Create the flattened view `mesh[name]` of `axes` of a root mesh; every world rank must call this.

    Members flatten through the public path. Non-members cannot (slicing needs the local rank), yet the
    process groups behind the flatten are created collectively over the whole world, so they make the
    same group-creation calls from the root layout, which does not depend on membership. `timeout`: the
    view's group's (None: torch's default).
    """
    override = mesh_backend_override(timeout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mesh.get_coordinate() is not None:
            mesh[axes]._flatten(name, backend_override=override)
        else:
            layout = _flat_layout(mesh._get_slice_mesh_layout(axes))
            DeviceMesh._init_one_process_group(layout, mesh._rank_map, name, override or (None, None))


def _flat_layout(layout: Any) -> Any:
    """The one-axis layout `DeviceMesh._flatten` gives the group of a flattened view, on either torch layout API.

    torch 2.13 collapses a slice's layout into one flat axis (`collapse`); torch 2.11 has no `collapse`: its
    `_flatten` coalesces the layout, nests it when more than one mode remains, and creates the group from
    axis 0 of that, which is what this returns there.
    """
    if hasattr(layout, "collapse"):
        return layout.collapse()
    coalesced = layout.coalesce()
    return (coalesced.nest() if len(coalesced) > 1 else coalesced)[0]


def _build_mesh(setup: DistributedSetup, device_type: str, timeout: datetime.timedelta | None) -> DistributedSetup:
    override = mesh_backend_override(timeout)
    mesh = DeviceMesh(device_type, setup.rank_grid, mesh_dim_names=MESH_AXES,
                      backend_override=None if override is None else (override,) * len(MESH_AXES))
    flatten_axes(mesh, ("dp_replicate", "dp_shard"), "dp", timeout=timeout)
    return dataclasses.replace(setup, device_mesh=mesh, collective_timeout=timeout)


def _default_device_type() -> str:
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def create_kd_distributed_setups(
    cfg: _ConfigLike, world_size: int, *, device_type: str | None = None, timeout: datetime.timedelta | None = None
) -> KDDistributedSetups:
    """Build shared or explicitly disjoint student and teacher setups.

    Args:
        cfg: anything with `.get(key, default)` holding `separate_meshes`, `distributed` and (separate
            meshes only) `teacher_distributed`.
        world_size: total number of global ranks available to both models.
        device_type: DeviceMesh device type; default "cuda" under NCCL, else "cpu".
        timeout: how long a collective of a mesh group may wait for a peer (None: torch's default).

    Returns:
        The resolved setups. Shared meshes: one setup over all ranks serves both roles. Separate meshes:
        student ranks [0, S), teacher ranks [S, world_size). Every rank must call this (mesh
        construction is collective); each rank's own role is registered with `set_current_setup`.

    Raises:
        ValueError: naming the key and the numbers, before any collective is issued.
    """
    student, teacher, separate = validate_kd_config(cfg, world_size)
    if not dist.is_initialized():
        raise RuntimeError("create_kd_distributed_setups needs torch.distributed.init_process_group() first")
    if dist.get_world_size() != world_size:
        raise ValueError(f"world_size {world_size} does not match the process group's size {dist.get_world_size()}")
    device_type = device_type or _default_device_type()
    student = _build_mesh(student, device_type, timeout)
    teacher = _build_mesh(teacher, device_type, timeout) if separate else student
    setups = KDDistributedSetups(
        student=student,
        teacher=teacher,
        student_ranks=student.ranks,
        teacher_ranks=teacher.ranks,
        separate=separate,
    )
    set_current_setup(setups.local)
    return setups


def model_replicas(setup: DistributedSetup) -> list[Replica]:
    """One `Replica` per data-parallel coordinate, in coordinate order.

    Input rank: pp = cp = tp = 0. Output rank: the last pipeline stage with cp = tp = 0.
    """
    return [
        Replica(ranks=tuple(sorted(block.flatten().tolist())), input_rank=int(block[0, 0]),
                output_rank=int(block[-1, 0]))
        for block in _replica_blocks(setup)
    ]


def last_stage_ranks(setup: DistributedSetup) -> list[tuple[int, ...]]:
    """Per replica (in `model_replicas` order): the ranks of its last pipeline stage, where the logits are."""
    return [tuple(sorted(block[-1].tolist())) for block in _replica_blocks(setup)]


def _replica_blocks(setup: DistributedSetup) -> torch.Tensor:
    """Global ranks as [replica, pipeline stage, rank within the stage], replicas in coordinate order."""
    mesh = setup.device_mesh
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else MESH_AXES
    grid = setup.rank_grid if mesh is None else _full_rank_grid(mesh)
    dp_axes = [i for i, name in enumerate(names) if name in ("dp_replicate", "dp_shard", "dp")]
    if not dp_axes:
        raise ValueError(f"mesh axes {names} have no data-parallel axis (dp, dp_replicate or dp_shard)")
    pp_axes = [i for i, name in enumerate(names) if name == "pp"]
    inner_axes = [i for i in range(len(names)) if i not in dp_axes and i not in pp_axes]
    # Reorder to [dp..., pp, inner...] so each replica is one [pp, inner] block.
    grid = grid.permute(*dp_axes, *pp_axes, *inner_axes)
    num_stages = grid.shape[len(dp_axes)] if pp_axes else 1
    return grid.reshape(math.prod(grid.shape[: len(dp_axes)]), num_stages, -1)


def _full_rank_grid(mesh: DeviceMesh) -> torch.Tensor:
    """Global ranks of a root mesh as a tensor, readable on ranks outside the mesh too."""
    return mesh._layout.remap_to_tensor(mesh._rank_map).reshape(mesh.shape).to(torch.int64)


def member_mesh(setup: DistributedSetup) -> DeviceMesh:
    if setup.device_mesh is None or not setup.is_member:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of this setup (ranks {setup.ranks}); call on its ranks only"
        )
    return setup.device_mesh

