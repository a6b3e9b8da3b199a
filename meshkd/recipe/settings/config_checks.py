"""Config checks: the rules `meshkd.recipe.settings.config`'s types cannot say, run once at load, before any
process group or model exists. Every check raises `ConfigError` naming the key. This module holds `validate` and
the checks of the sections it reads itself (models, peft, teachers, dataset, schedule, optimizer, the run's own
keys); `kd` as each teacher answers it is checked in `meshkd.recipe.settings.kd_checks`, the layout against its
world in `meshkd.recipe.settings.layout_checks`.

`validate` reads as the config's sections, in the order it checks them: `peft`; the teachers, as a list
(`KDRecipeConfig.teacher_list`: the one-teacher keys are a list of one), first the keys that spell it (the
one-teacher keys together, or `teachers`' names, weights and combining rule), then each teacher's model
section and `kd` as it answers it (`KDRecipeConfig.kd_of`: with its `generation` and `cross_tokenizer`), errors of
one of several prefixed `teachers.NAME:`; `dataset`, `step_scheduler`, `optimizer`, `lr_scheduler`, the run's own
keys (timeouts, device); the student layouts meshkd does not run; and last the layout of the student and every
teacher against the world it needs
(`validate_teacher_layouts`, for one teacher as for several).
"""

from __future__ import annotations

import math

from meshkd.core.answers import choices
from meshkd.core.combinations import COMBINATIONS, combination_named
from meshkd.recipe.records import format_named
from meshkd.recipe.records.chat_template import TRAIN_ON
from meshkd.recipe.settings.config import KDRecipeConfig, ModelConfig, OptimizerConfig, TeacherConfig
from meshkd.recipe.settings.kd_checks import check_kd, check_served_teacher
from meshkd.recipe.settings.layout_checks import check_student_layout, check_world
from meshkd.recipe.settings.typed_yaml import ConfigError


def validate(config: KDRecipeConfig) -> None:
    """Cross-field checks that need no process group; raises ConfigError naming the key.

    One teacher is the list of one (`KDRecipeConfig.teacher_list`): the keys that spell it are checked, then
    each teacher (errors of one of several named `teachers.NAME:`), then the layout of the student and every
    teacher against the world it needs."""
    check_dataset(config)  # first: the on-policy checks read the row format
    if config.peft is not None:
        check_peft(config)
    if config.teachers is None:
        check_one_teacher(config)
    else:
        check_teachers(config)
    for teacher in config.teacher_list():
        try:
            check_models(config, teacher)
            kd = config.kd_of(teacher)
            check_kd(config, kd)
            if teacher.model.url is not None:
                check_served_teacher(teacher.model, kd)
        except ConfigError as error:
            raise error if config.teachers is None else ConfigError(f"teachers.{teacher.name}: {error}") from None
    check_step_scheduler(config)
    check_optimizer(config.optimizer)
    check_lr_scheduler(config)
    check_run(config)
    check_student_layout(config)
    check_world(config)


def check_one_teacher(config: KDRecipeConfig) -> None:
    """The one-teacher keys: the teacher's own ranks need `separate_meshes` and its layout together (a run from
    `kd.teacher_cache` runs no teacher: the layout is the one `meshkd cache-teacher` uses)."""
    if config.dataset.teacher_key is not None:
        raise ConfigError("dataset.teacher_key routes rows to one of several teachers: give them in teachers "
                          "(with kd.combine route), or leave the key out")
    if config.kd.teacher_cache is not None or config.teacher_model.url is not None:
        return  # no teacher ranks (check_served_teacher refuses a layout given for a served one)
    if not config.separate_meshes and config.teacher_distributed is not None:
        raise ConfigError("teacher_distributed is set but separate_meshes is false: on shared meshes the teacher uses "
                          "the 'distributed' section; set separate_meshes: true to give the teacher its own ranks")
    if config.separate_meshes and config.teacher_distributed is None:
        raise ConfigError("separate_meshes is true but teacher_distributed is missing: give the teacher its own layout")


# ------------------------------------------------------------------------------------------------- model, teacher_model

def check_models(config: KDRecipeConfig, teacher: TeacherConfig) -> None:
    """The student's and `teacher`'s model sections: one source, a known dtype and attention; precision keys for
    the student alone."""
    if config.model.url is not None:
        raise ConfigError("model.url: the student is trained here; only a teacher (teacher_model.url) may be served")
    for label, model in (("model", config.model), ("teacher_model", teacher.model)):
        if (label == "teacher_model" and (teacher.cache is not None or model.url is not None)
                and model.path is None and model.random_init is None):
            continue  # no teacher given: the cache's, or the server's, stands
        if (model.path is None) == (model.random_init is None):
            raise ConfigError(f"{label}: set exactly one of {label}.path or {label}.random_init")
        if isinstance(model.keep_layers, dict):
            check_layer_selection(label, model.keep_layers)
        if model.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"{label}.dtype must be float32, bfloat16 or float16, got {model.dtype!r}")
        # The recipe hands attention prepared masks (meshkd.core.masks): 4D tensors to sdpa and eager,
        # BlockMasks to flex attention. Flash attention builds its own and would attend across documents.
        if model.attn_implementation not in (None, "sdpa", "eager", "flex_attention"):
            raise ConfigError(f"{label}.attn_implementation: {model.attn_implementation!r} is not supported; "
                              "use sdpa, eager or flex_attention")
        if label == "model" and model.attn_implementation == "flex_attention" and config.device == "cpu":
            raise ConfigError("model.attn_implementation: flex_attention has no backward on the CPU (device: cpu), "
                              "so the student cannot train with it; use sdpa there (flex_attention serves a "
                              "teacher on the CPU)")
    check_student_precision(config.model, teacher.model)


def check_student_precision(student: ModelConfig, teacher: ModelConfig) -> None:
    """The training-only keys on the teacher, and the student dtypes meshkd cannot train in."""
    if teacher.pure_half_precision:
        raise ConfigError("teacher_model.pure_half_precision: the teacher runs forward only and keeps "
                          "teacher_model.dtype as its weights' dtype; the key is for the student")
    if teacher.activation_checkpointing:
        raise ConfigError("teacher_model.activation_checkpointing: the teacher runs forward only and keeps no "
                          "activations for a backward; the key is for the student")
    if student.dtype == "float16":
        raise ConfigError("model.dtype float16: a float16 student needs dynamic loss scaling, which meshkd does "
                          "not do (its gradients underflow below 6e-8 and its activations overflow above 65504); "
                          "use bfloat16, which has float32's range at the same memory")
    if student.pure_half_precision and student.dtype != "bfloat16":
        raise ConfigError(f"model.pure_half_precision keeps the parameters in model.dtype, which must then be "
                          f"bfloat16; got {student.dtype!r}")


def check_layer_selection(label: str, selection: dict) -> None:
    """`keep_layers: {auto: N, by, calibration_rows}`: the student's alone, with known keys and sizes."""
    key = f"{label}.keep_layers"
    if label != "model":
        raise ConfigError(f"{key}: {{auto: N}} chooses a student's layers; give the teacher's as a list")
    unknown = sorted(set(selection) - {"auto", "by", "calibration_rows"})
    if unknown or "auto" not in selection:
        raise ConfigError(f"{key} must be a list of layers or {{auto: N}} (optional by, calibration_rows), got "
                          f"{selection}")
    for name in ("auto", "calibration_rows"):
        value = selection.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}.{name} must be an integer >= 1, got {value!r}")
    if selection.get("by", "block") not in ("block", "layer"):
        raise ConfigError(f"{key}.by must be block or layer, got {selection['by']!r}")


# ----------------------------------------------------------------------------------------------------------------- peft

def check_peft(config: KDRecipeConfig) -> None:
    """LoRA sizes in range, and the student layouts and precision adapters cannot train in."""
    peft = config.peft
    if peft.rank < 1:
        raise ConfigError(f"peft.rank must be >= 1, got {peft.rank}")
    if not (peft.alpha > 0 and math.isfinite(peft.alpha)):
        raise ConfigError(f"peft.alpha must be a positive finite number, got {peft.alpha}")
    if not 0 <= peft.dropout < 1:
        raise ConfigError(f"peft.dropout must be in [0, 1), got {peft.dropout}")
    if not peft.target_modules:
        raise ConfigError("peft.target_modules is empty: name the modules to adapt, or all-linear")
    if config.distributed.tp_size > 1:
        raise ConfigError(f"peft with distributed.tp_size({config.distributed.tp_size}) > 1 is not supported: the "
                          f"model's tensor-parallel plan shards linear layers, which LoRA layers wrap; use dp, cp "
                          f"or pp for a LoRA student")
    if config.model.pure_half_precision:
        raise ConfigError("peft with model.pure_half_precision: the adapters train in float32 on the frozen base; "
                          "set model.pure_half_precision to false")


# ------------------------------------------------------------------------------------------- teachers (several at once)

def check_teachers(config: KDRecipeConfig) -> None:
    """`teachers` replaces the one-teacher keys; names, weights and the combining rule."""
    given = {"teacher_model": config.teacher_model != type(config.teacher_model)(), "teacher_distributed":
             config.teacher_distributed is not None, "separate_meshes": config.separate_meshes}
    clash = [key for key, used in given.items() if used]
    if clash:
        raise ConfigError(f"teachers replaces {', '.join(clash)}: give each teacher's model and layout in its "
                          "entry (teachers[i].model, teachers[i].distributed; none: on the student's ranks)")
    if not config.teachers:
        raise ConfigError("teachers is empty: give at least one teacher, or use teacher_model")
    names = [teacher.name for teacher in config.teachers]
    for index, teacher in enumerate(config.teachers):
        if not teacher.name or not teacher.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"teachers[{index}].name must be a name of letters, digits, - and _, got "
                              f"{teacher.name!r}")
        if teacher.name in names[:index]:
            raise ConfigError(f"teachers[{index}].name {teacher.name!r} is already teachers"
                              f"[{names.index(teacher.name)}]'s: each teacher needs a name of its own")
        if not (teacher.weight >= 0 and math.isfinite(teacher.weight)):
            raise ConfigError(f"teachers.{teacher.name}.weight must be a finite number >= 0, got {teacher.weight}")
    if sum(teacher.weight for teacher in config.teachers) <= 0:
        raise ConfigError("teachers: every weight is 0; give at least one teacher a weight > 0")
    kd = config.kd
    try:
        combination = combination_named(kd.combine)
        if combination.routes_rows and config.dataset.teacher_key is None:
            raise ValueError(f"kd.combine {kd.combine} sends each row to the teacher its documents name: it needs "
                             "dataset.teacher_key (the JSONL field with the name)")
        if not combination.routes_rows and config.dataset.teacher_key is not None:
            routing = ", ".join(name for name, other in COMBINATIONS.items() if other.routes_rows)
            raise ValueError(f"dataset.teacher_key routes rows to their teachers: it needs a kd.combine that does "
                             f"({routing}), not {kd.combine}")
        combination.check(config)
        whole = choices("logits_transport", whole_distribution=True)
        for teacher in config.teachers if combination.whole_distributions else ():
            transport = teacher.logits_transport or kd.logits_transport
            if transport not in whole:
                raise ValueError(f"kd.combine {kd.combine} mixes the teachers' whole distributions: "
                                 f"teachers.{teacher.name}.logits_transport (or kd.logits_transport) must be "
                                 f"{' or '.join(whole)}, got {transport!r}")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if kd.teacher_cache is not None:
        raise ConfigError("kd.teacher_cache: with several teachers each has its own, teachers[i].cache")
    if kd.cross_tokenizer is not None:
        raise ConfigError("kd.cross_tokenizer does not yet work with several teachers (teachers); use one teacher "
                          "(teacher_model) for it")
    if kd.hidden_states is not None:
        raise ConfigError("kd.hidden_states does not yet work with several teachers (teachers); use one teacher "
                          "(teacher_model) for it")


# -------------------------------------------------------------------------------------------------------------- dataset

def check_dataset(config: KDRecipeConfig) -> None:
    """Some data to read, known record formats, and what cross-tokenizer rows cannot hold yet."""
    dataset = config.dataset
    if dataset.on_bad_file not in ("error", "skip"):
        raise ConfigError(f"dataset.on_bad_file must be error or skip, got {dataset.on_bad_file!r}")
    if not dataset.paths and dataset.hf is None:
        raise ConfigError("dataset.paths is empty and dataset.hf unset: give text, JSONL, parquet, CSV, arrow or "
                          "JSON files (globs allowed), or a Hugging Face dataset")
    if dataset.hf is not None and not dataset.hf.path:
        raise ConfigError("dataset.hf.path is empty: give a save_to_disk directory, a Hub id or a datasets builder")
    if dataset.tokenize_workers < 1:
        raise ConfigError(f"dataset.tokenize_workers must be >= 1, got {dataset.tokenize_workers}")
    try:
        row_format = format_named(dataset.records)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if dataset.train_on not in TRAIN_ON:
        raise ConfigError(f"dataset.train_on must be one of {', '.join(TRAIN_ON)}, got {dataset.train_on!r}")
    if row_format.rendered and config.kd.cross_tokenizer is not None and config.kd.generates:
        raise ConfigError(f"dataset.records {dataset.records!r} with kd.cross_tokenizer does not yet work with "
                          "kd.mode on_policy or kd.generation.evaluate (the student's samples would reach the "
                          "teacher in the student's chat template); use kd.mode off_policy")


# ------------------------------------------------------------------------------ step_scheduler, optimizer, lr_scheduler

def check_step_scheduler(config: KDRecipeConfig) -> None:
    """Positive sizes and intervals (the batch against the data-parallel size: `check_world`)."""
    steps = config.step_scheduler
    for name in ("max_steps", "global_batch_size", "local_batch_size", "sequence_length"):
        if getattr(steps, name) < 1:
            raise ConfigError(f"step_scheduler.{name} must be >= 1, got {getattr(steps, name)}")
    for name in ("val_every_steps", "val_batches", "ckpt_every_steps"):
        if getattr(steps, name) is not None and getattr(steps, name) < 1:
            raise ConfigError(f"step_scheduler.{name} must be >= 1 or null, got {getattr(steps, name)}")


def check_optimizer(optimizer: OptimizerConfig) -> None:
    """Values torch would reject only inside the workers, or accept and train to NaN with."""
    if optimizer.name not in ("adamw", "sgd"):
        raise ConfigError(f"optimizer.name must be adamw or sgd, got {optimizer.name!r}")
    if not (optimizer.lr > 0 and math.isfinite(optimizer.lr)):
        raise ConfigError(f"optimizer.lr must be a finite number > 0, got {optimizer.lr}")
    if not (optimizer.weight_decay >= 0 and math.isfinite(optimizer.weight_decay)):
        raise ConfigError(f"optimizer.weight_decay must be a finite number >= 0, got {optimizer.weight_decay}")
    if not (optimizer.eps > 0 and math.isfinite(optimizer.eps)):
        raise ConfigError(f"optimizer.eps must be a finite number > 0, got {optimizer.eps}")
    if len(optimizer.betas) != 2 or not all(0.0 <= beta < 1.0 for beta in optimizer.betas):
        raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {optimizer.betas}")
    if optimizer.max_grad_norm is not None and not (optimizer.max_grad_norm > 0
                                                    and math.isfinite(optimizer.max_grad_norm)):
        raise ConfigError(f"optimizer.max_grad_norm must be a finite number > 0 or null, got {optimizer.max_grad_norm}")


def check_lr_scheduler(config: KDRecipeConfig) -> None:
    """A known decay shape, and steps and ratios in range."""
    schedule = config.lr_scheduler
    if schedule.decay not in ("cosine", "linear", "constant"):
        raise ConfigError(f"lr_scheduler.decay must be cosine, linear or constant, got {schedule.decay!r}")
    if schedule.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps must be >= 0, got {schedule.warmup_steps}")
    if schedule.total_steps is not None and schedule.total_steps < 1:
        raise ConfigError(f"lr_scheduler.total_steps must be >= 1 or null, got {schedule.total_steps}")
    if not 0.0 <= schedule.min_lr_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {schedule.min_lr_ratio}")


# ------------------------------------------------------------------------------------------------- the run's own keys

def check_run(config: KDRecipeConfig) -> None:
    """`collective_timeout_s`, `setup_timeout_s` and `device`."""
    if not (config.collective_timeout_s > 0 and math.isfinite(config.collective_timeout_s)):
        raise ConfigError(f"collective_timeout_s must be a finite number of seconds > 0, got "
                          f"{config.collective_timeout_s}")
    if not (config.setup_timeout_s > 0 and math.isfinite(config.setup_timeout_s)):
        raise ConfigError(f"setup_timeout_s must be a finite number of seconds > 0, got {config.setup_timeout_s}")
    if config.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda, got {config.device!r}")
