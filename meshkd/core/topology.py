"""Topology: which global ranks hold the student and the teacher, and how each role is laid out.

Design. A role's layout is a `DistributedSetup`: validated parallel sizes plus a DeviceMesh over exactly
the role's ranks with the fixed axes (pp, dp_replicate, dp_shard, cp, tp) and a flattened `dp` view.
`create_kd_distributed_setups` validates the whole configuration before touching torch.distributed, so a
bad config fails in milliseconds with a message naming the key; only then does it build the meshes.

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
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshkd.core.groups import mesh_backend_override

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SIZE_KEYS = ("dp_size", "dp_replicate_size", "tp_size", "cp_size", "pp_size", "ep_size")
SECTION_KEYS = frozenset((*SIZE_KEYS, "strategy", "sequence_parallel", "pp_schedule"))
STRATEGIES = ("fsdp2", "ddp")
PP_SCHEDULES = ("1f1b", "gpipe")


class _ConfigLike(Protocol):
    """Minimal recipe-config interface consumed by KD topology setup."""

    def get(self, key: str, default: Any = None) -> Any:
        """Return one configuration value or default."""


@dataclass(frozen=True)
class DistributedSetup:
    """Resolved layout of one model role.

    `dp_size` = `dp_replicate_size` * `dp_shard_size`; the role spans dp * cp * tp * pp ranks (expert
    parallelism is folded into data parallelism and does not add ranks). `device_mesh` has the axes
    `MESH_AXES` in that order, size-1 axes included, and a flattened `dp` view (`device_mesh["dp"]`) on
    its own ranks. It is None only for a setup that was validated but not built. `collective_timeout`: the
    timeout its mesh groups were created with (None: torch's default), which views flattened later take too.
    """

    ranks: tuple[int, ...]
    strategy: str = "fsdp2"
    dp_size: int = 1
    dp_replicate_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"  # a trained (student) pipeline's schedule, one of PP_SCHEDULES
    device_mesh: DeviceMesh | None = dataclasses.field(default=None, compare=False, repr=False)
    collective_timeout: datetime.timedelta | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def dp_shard_size(self) -> int:
        return self.dp_size // self.dp_replicate_size

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes of `MESH_AXES`, in order."""
        return (self.pp_size, self.dp_replicate_size, self.dp_shard_size, self.cp_size, self.tp_size)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def expert_axis(self) -> str | None:
        """The mesh axis whole MoE experts are spread over: "tp" (ep_size = tp_size: the ranks hold the same
        tokens), "dp_shard" (tp_size 1, ep_size = dp_shard_size: the ranks hold different tokens), or None."""
        if self.ep_size == 1:
            return None
        return "tp" if self.ep_size == self.tp_size else "dp_shard"

    @property
    def rank_grid(self) -> torch.Tensor:
        """Global ranks as an int tensor shaped `mesh_shape` (the same on every rank)."""
        return torch.tensor(self.ranks, dtype=torch.int64).reshape(self.mesh_shape)

    @property
    def is_member(self) -> bool:
        """Whether the calling rank belongs to this setup."""
        return dist.is_initialized() and dist.get_rank() in self.ranks

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The flattened data-parallel view (`device_mesh["dp"]`) on member ranks, else None."""
        if self.device_mesh is None or not self.is_member:
            return None
        with warnings.catch_warnings():
            # torch warns that slicing a flattened axis from the root is deprecated; it is the documented view.
            warnings.simplefilter("ignore")
            return self.device_mesh["dp"]

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """This rank's pipeline group, or None on a rank outside the setup."""
        if self.device_mesh is None or not self.is_member:
            return None
        return self.device_mesh.get_group("pp")


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

    @staticmethod
    def role(name: str) -> str:
        """How messages name teacher `name`: "teacher" for the one-teacher form's, else "teacher 'NAME'"."""
        return "teacher" if name == "teacher" else f"teacher '{name}'"

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


def _section_to_dict(section: Any) -> dict:
    """A config section (None, a mapping, a dataclass or an object with `to_dict`) as a plain dict."""
    if section is None:
        return {}
    if isinstance(section, Mapping):
        return dict(section)
    if hasattr(section, "to_dict"):
        return dict(section.to_dict())
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        return dataclasses.asdict(section)
    raise ValueError(f"expected a mapping for a distributed config section, got {type(section).__name__}")


def _resolve_section(section: Any, label: str, *, world_size: int | None) -> DistributedSetup:
    """Validate one section and resolve its sizes; `world_size` None means dp_size must be explicit."""
    values = _section_to_dict(section)
    unknown = sorted(set(values) - SECTION_KEYS)
    if unknown:
        raise ValueError(f"{label}: unknown key(s) {unknown}; known keys are {sorted(SECTION_KEYS)}")

    sizes = {}
    for key in SIZE_KEYS:
        value = values.get(key)
        if value is None and key != "dp_size":
            value = 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{label}.{key} must be a positive integer, got {value!r}")
        sizes[key] = value

    strategy = values.get("strategy") or "fsdp2"
    if strategy not in STRATEGIES:
        raise ValueError(f"{label}.strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    sequence_parallel = values.get("sequence_parallel") or False
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"{label}.sequence_parallel must be true or false, got {sequence_parallel!r}")
    pp_schedule = values.get("pp_schedule") or "1f1b"
    if pp_schedule not in PP_SCHEDULES:
        raise ValueError(f"{label}.pp_schedule must be one of {list(PP_SCHEDULES)}, got {pp_schedule!r}")

    model_parallel = sizes["tp_size"] * sizes["cp_size"] * sizes["pp_size"]
    if sizes["dp_size"] is None:
        if world_size is None:
            raise ValueError(f"{label}.dp_size is required with separate_meshes: true (each role's size is explicit)")
        if world_size % model_parallel:
            raise ValueError(
                f"{label}: world size {world_size} is not divisible by tp_size({sizes['tp_size']}) * "
                f"cp_size({sizes['cp_size']}) * pp_size({sizes['pp_size']}) = {model_parallel}"
            )
        sizes["dp_size"] = world_size // model_parallel
    if sizes["dp_size"] % sizes["dp_replicate_size"]:
        raise ValueError(
            f"{label}.dp_replicate_size({sizes['dp_replicate_size']}) must divide {label}.dp_size({sizes['dp_size']})"
        )
    ep_size, dp_shard_size = sizes["ep_size"], sizes["dp_size"] // sizes["dp_replicate_size"]
    if ep_size > 1 and ep_size != sizes["tp_size"] and not (sizes["tp_size"] == 1 and ep_size == dp_shard_size):
        raise ValueError(
            f"{label}.ep_size({ep_size}) > 1 must equal tp_size({sizes['tp_size']}) (whole experts over the "
            f"tensor-parallel ranks) or, with tp_size 1, the data-parallel shard size dp_size / dp_replicate_size "
            f"({dp_shard_size}) (whole experts over the data-parallel ranks)"
        )
    return DistributedSetup(
        ranks=(), strategy=strategy, sequence_parallel=sequence_parallel, pp_schedule=pp_schedule, **sizes
    )


def _num_ranks(setup: DistributedSetup) -> int:
    return setup.dp_size * setup.tp_size * setup.cp_size * setup.pp_size


def _size_product(setup: DistributedSetup, label: str) -> str:
    return (
        f"{label}: dp_size({setup.dp_size}) * tp_size({setup.tp_size}) * cp_size({setup.cp_size}) * "
        f"pp_size({setup.pp_size}) = {_num_ranks(setup)}"
    )


def _mesh_size(distributed_cfg: Any, label: str) -> int:
    """Return the explicitly requested mesh size for a separate KD model."""
    return _num_ranks(_resolve_section(distributed_cfg, label, world_size=None))


def validate_kd_config(cfg: _ConfigLike, world_size: int) -> tuple[DistributedSetup, DistributedSetup, bool]:
    """Check the whole topology config without any process group; returns unbuilt setups."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    separate = cfg.get("separate_meshes", False)
    if not isinstance(separate, bool):
        raise ValueError(f"separate_meshes must be true or false, got {separate!r}")
    student_section = cfg.get("distributed", None)
    teacher_section = cfg.get("teacher_distributed", None)

    if not separate:
        if teacher_section is not None:
            raise ValueError(
                "teacher_distributed is set but separate_meshes is false: on shared meshes the teacher uses the "
                "'distributed' section; set separate_meshes: true to give the teacher its own ranks"
            )
        setup = _resolve_section(student_section, "distributed", world_size=world_size)
        if _num_ranks(setup) != world_size:
            raise ValueError(f"{_size_product(setup, 'distributed')} != world size {world_size}")
        setup = dataclasses.replace(setup, ranks=tuple(range(world_size)))
        return setup, setup, False

    if teacher_section is None:
        raise ValueError("separate_meshes is true but teacher_distributed is missing: give the teacher its own layout")
    roles = []
    for section, label in ((student_section, "distributed"), (teacher_section, "teacher_distributed")):
        setup = _resolve_section(section, label, world_size=None)
        if setup.strategy == "ddp":
            raise ValueError(f"{label}.strategy 'ddp' is not supported with separate_meshes: true; use fsdp2")
        roles.append(setup)
    student, teacher = roles
    num_student, num_teacher = _num_ranks(student), _num_ranks(teacher)
    if num_student + num_teacher != world_size:
        raise ValueError(
            f"student and teacher ranks must fill the world: {_size_product(student, 'distributed')}, "
            f"{_size_product(teacher, 'teacher_distributed')}, {num_student} + {num_teacher} != world size {world_size}"
        )
    student = dataclasses.replace(student, ranks=tuple(range(num_student)))
    teacher = dataclasses.replace(teacher, ranks=tuple(range(num_student, world_size)))
    return student, teacher, True


def validate_teacher_layouts(student_section: Any, teacher_sections: Mapping[str, Any],
                             world_size: int) -> tuple[DistributedSetup, dict[str, DistributedSetup | None]]:
    """Check a student and several teachers' layouts without any process group; returns unbuilt setups.

    `teacher_sections`: name -> the teacher's own layout section, or None for a teacher on the student's ranks
    (with the student's layout). Sections are labelled `teachers.NAME.distributed` in messages. A student
    section without dp_size takes the ranks the teachers leave.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    own = {name: section for name, section in teacher_sections.items() if section is not None}
    teachers = {}
    for name, section in own.items():
        label = f"teachers.{name}.distributed"
        teachers[name] = _resolve_section(section, label, world_size=None)
        if teachers[name].strategy == "ddp":
            raise ValueError(f"{label}.strategy 'ddp' is not supported for a teacher on its own ranks; use fsdp2")
    teacher_ranks = sum(_num_ranks(setup) for setup in teachers.values())
    student = _resolve_section(student_section, "distributed", world_size=world_size - teacher_ranks)
    if own and student.strategy == "ddp":
        raise ValueError("distributed.strategy 'ddp' is not supported beside teachers on their own ranks; use fsdp2")
    if _num_ranks(student) + teacher_ranks != world_size:
        parts = [_size_product(student, "distributed")] + [
            _size_product(setup, f"teachers.{name}.distributed") for name, setup in teachers.items()]
        raise ValueError(f"the student's and the teachers' ranks must fill the world: {', '.join(parts)}; "
                         f"{_num_ranks(student) + teacher_ranks} != world size {world_size}")
    student = dataclasses.replace(student, ranks=tuple(range(_num_ranks(student))))
    start, placed = len(student.ranks), {}
    for name in teacher_sections:
        if name not in teachers:
            placed[name] = None
            continue
        size = _num_ranks(teachers[name])
        placed[name] = dataclasses.replace(teachers[name], ranks=tuple(range(start, start + size)))
        start += size
    return student, placed


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

