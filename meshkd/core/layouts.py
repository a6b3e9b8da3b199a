"""A role's parallel layout, resolved and checked without any process group.

A config section (`distributed`, `teacher_distributed`, `teachers[i].distributed`) becomes a
`DistributedSetup`: validated sizes and the global ranks it spans. `validate_kd_config` (a student and one
teacher, on shared or separate meshes) and `validate_teacher_layouts` (a student and several teachers) place
the roles on the world's ranks and fail in milliseconds with a message naming the key; `meshkd.core.topology`
then builds their meshes.
"""

from __future__ import annotations

import dataclasses
import datetime
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

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


def validate_teacher_layouts(student_section: Any, teacher_sections: Mapping[str, Any], world_size: int, *,
                             labels: Mapping[str, str] | None = None,
                             ) -> tuple[DistributedSetup, dict[str, DistributedSetup | None]]:
    """Check a student and several teachers' layouts without any process group; returns unbuilt setups.

    `teacher_sections`: name -> the teacher's own layout section, or None for a teacher on the student's ranks
    (with the student's layout). Messages name a teacher's section `teachers.NAME.distributed`, or as `labels`
    gives it (name -> key: `teacher_distributed` for a recipe's one-teacher form). A student section without
    dp_size takes the ranks the teachers leave.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    own = {name: section for name, section in teacher_sections.items() if section is not None}
    label = {name: (labels or {}).get(name, f"teachers.{name}.distributed") for name in own}
    teachers = {}
    for name, section in own.items():
        teachers[name] = _resolve_section(section, label[name], world_size=None)
        if teachers[name].strategy == "ddp":
            raise ValueError(f"{label[name]}.strategy 'ddp' is not supported for a teacher on its own ranks; use fsdp2")
    teacher_ranks = sum(_num_ranks(setup) for setup in teachers.values())
    student = _resolve_section(student_section, "distributed", world_size=world_size - teacher_ranks)
    if own and student.strategy == "ddp":
        raise ValueError("distributed.strategy 'ddp' is not supported beside teachers on their own ranks; use fsdp2")
    if _num_ranks(student) + teacher_ranks != world_size:
        parts = [_size_product(student, "distributed")] + [
            _size_product(setup, label[name]) for name, setup in teachers.items()]
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
