"""Config checks of the layout against the world it needs: the processes a config lays out
(`required_world_size`), the student layouts meshkd does not run, and the student's and every teacher's ranks
laid out in that world (`validate_teacher_layouts`). `meshkd.recipe.settings.config_checks.validate` runs them
last; every check raises `ConfigError` naming the key.
"""

from __future__ import annotations

from meshkd.core.topology import validate_teacher_layouts
from meshkd.recipe.settings.config import DistributedConfig, KDRecipeConfig
from meshkd.recipe.settings.typed_yaml import ConfigError

MAX_WORLD_SIZE = 1 << 20
"""Ranks a layout may need at most: a typo of a size key should not build a mesh of a trillion ranks."""


def required_world_size(config: KDRecipeConfig) -> int | None:
    """The number of processes the layout needs, or None when shared meshes leave dp_size open."""
    def ranks(section: DistributedConfig) -> int | None:
        if section.dp_size is None:
            return None
        return section.dp_size * section.tp_size * section.cp_size * section.pp_size

    student = ranks(config.distributed)
    own = [ranks(layout) for layout in config.teacher_layouts().values() if layout is not None]
    if not own:
        return student
    return None if student is None or None in own else student + sum(own)


def check_student_layout(config: KDRecipeConfig) -> None:
    """The student layouts meshkd does not run: sequence parallel, a pipeline or tp under DDP, and a 1F1B
    pipeline with fewer micro-batches a step than stages."""
    layout, steps = config.distributed, config.step_scheduler
    if layout.sequence_parallel:
        raise ConfigError("distributed.sequence_parallel is not supported for the student; set it to false")
    if layout.pp_size > 1 and layout.strategy == "ddp":
        raise ConfigError(f"distributed.pp_size({layout.pp_size}) > 1 needs strategy fsdp2 (the stages are sharded "
                          f"with FSDP2 over the data-parallel axes); got strategy 'ddp'")
    if layout.strategy == "ddp" and layout.tp_size > 1:
        raise ConfigError(f"distributed.strategy 'ddp' with tp_size({layout.tp_size}) > 1 is not supported; use fsdp2")
    dp_size = layout.dp_size or 1  # shared meshes without dp_size: dp is resolved from the world later
    micro_batches = steps.global_batch_size // (steps.local_batch_size * dp_size)
    if layout.pp_size > 1 and layout.pp_schedule == "1f1b" and micro_batches < layout.pp_size:
        raise ConfigError(
            f"distributed.pp_schedule '1f1b' needs at least pp_size({layout.pp_size}) micro-batches per step, got "
            f"global_batch_size / (local_batch_size * dp_size) = {micro_batches}; raise "
            "step_scheduler.global_batch_size or use pp_schedule: gpipe"
        )


def check_world(config: KDRecipeConfig) -> None:
    """The world the layout needs (when it says): not absurdly large, the student's and every teacher's ranks
    laid out (`validate_teacher_layouts`), the student's batches divisible by its data-parallel size."""
    world_size = required_world_size(config)
    if world_size is None:
        return
    labels = {config.teacher_named().name: "teacher_distributed"} if config.teachers is None else {}
    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"the layout needs {world_size} ranks, more than meshkd lays out ({MAX_WORLD_SIZE}): check "
                          f"the *_size keys of distributed and {labels.get('teacher', 'teachers[i].distributed')}")
    try:
        validate_teacher_layouts(config.distributed, config.teacher_layouts(), world_size, labels=labels)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    steps, student_dp = config.step_scheduler, config.distributed.dp_size
    if steps.global_batch_size % (steps.local_batch_size * student_dp):
        raise ConfigError(
            f"step_scheduler.global_batch_size({steps.global_batch_size}) must be divisible by "
            f"local_batch_size({steps.local_batch_size}) * distributed.dp_size({student_dp})"
        )
