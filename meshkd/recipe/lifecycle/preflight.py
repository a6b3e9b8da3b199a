"""Preflight: everything a run needs that can be checked without a process group or model weights.

`preflight(config)` reads the same files on every rank and nothing rank-dependent, so every rank raises
the same error without talking to the others, and `meshkd train` runs it in the calling process before
any worker starts. Errors name the config key they concern (`faults.about`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
from dataclasses import dataclass, replace

import torch

from meshkd.core.masks import attention_windows
from meshkd.parallel.data_parallel import check_experts_over_dp
from meshkd.parallel.tensor_parallel import check_tensor_parallel, experts_left_whole
from meshkd.recipe.common.faults import about
from meshkd.recipe.common.metrics import warn0
from meshkd.recipe.common.versions import check_versions
from meshkd.recipe.corpus import documents, hf_sources
from meshkd.recipe.corpus.aligned_data import check_row_lengths
from meshkd.recipe.lifecycle.world import uses_cuda
from meshkd.recipe.modeling import models
from meshkd.recipe.modeling.loaders import load_section_skeleton, load_section_tokenizer
from meshkd.recipe.records import format_named
from meshkd.recipe.settings.config import ConfigError, KDRecipeConfig, TeacherConfig
from meshkd.recipe.settings.config_loading import expand_path
from meshkd.recipe.settings.kd_checks import pairs_of
from meshkd.recipe.student.rollout_engine import check_server
from meshkd.recipe.teacher.hidden_states import check_pairs
from meshkd.recipe.teacher.sources import SourceKind, TeacherCheck, kind_of

# The corpus is read (each file checked to be text, and for a document) only when it is at most this large.
_PREFLIGHT_READ_BYTES = 64 << 20


@dataclass
class Preflight:
    """What `preflight` loaded that setup reuses."""

    tokenizer: object
    student_vocab_rows: int
    source: SourceKind  # where the teacher's answers come from (`meshkd.recipe.teacher.sources`)
    teacher: TeacherCheck  # what its preflight learnt of the teacher (a cache's manifest, a server's health)

    @property
    def teacher_tokenizer(self):
        """The tokenizer whose ids the teacher reads: the student's unless `kd.cross_tokenizer` (the student's
        too when the teacher's answers come from a cache)."""
        return self.teacher.tokenizer

    @property
    def teacher_vocab_rows(self) -> int:
        """The teacher's output rows: the skeleton's, the cache's teacher's, the server's."""
        return self.teacher.vocab_rows

    @property
    def teacher_width(self) -> int | None:
        """The teacher's hidden size (the skeleton's, or the cache's with kd.hidden_states)."""
        return self.teacher.hidden_size


def preflight_teachers(config: KDRecipeConfig) -> dict[str, Preflight]:
    """Teacher name -> `preflight` of the run with that teacher (`KDRecipeConfig.teacher_list`); errors about one
    of several teachers name it (teachers.NAME)."""
    teachers, checked = config.teacher_list(), {}
    names = [teacher.name for teacher in teachers]
    for index, teacher in enumerate(teachers):
        named = about(f"teachers.{teacher.name}") if config.teachers is not None else contextlib.nullcontext()
        with named:  # the data are the same for every teacher: read once
            checked[teacher.name] = preflight(config, teacher, check_data=index == 0, teachers=names)
    return checked


def _embedding_rows(model: torch.nn.Module) -> int:
    return model.get_output_embeddings().weight.shape[0]


def preflight(config: KDRecipeConfig, teacher: TeacherConfig | None = None, *, writing_cache: bool = False,
              check_data: bool = True, teachers: list[str] | None = None) -> Preflight:
    """Check everything a run of `config` with `teacher` (of `config.teacher_list()`; None: its only one) needs
    that needs no process group; raises before any process or collective is involved.

    Reads the same files on every rank and nothing rank-dependent, so every rank raises the same error
    without talking to the others. Loads no weights (models are built on the meta device) and reads the
    corpus only when it is at most 64 MiB. Checks: transformers, peft and datasets within their tested ranges
    (`meshkd.recipe.common.versions`); each role's dp_size on separate meshes; flex_attention on CUDA against
    head_dim;
    data files exist, are text (binary and non-UTF-8 files by `dataset.on_bad_file`) and hold a document; a
    `dataset.hf` dataset opens (streamed: its split, and its first row's columns);
    both tokenizers load and agree, and fit both embedding tables; each model directory's safetensors headers;
    `step_scheduler.sequence_length` against each model's max_position_embeddings; each model's layer
    attention kinds against the masks meshkd prepares; tp sizes against the model's own tensor-parallel plan
    (styles, attention and key/value head counts); both roles' pp_size against their decoder layers; a TP
    student's vocabulary against the common one; with `kd.cross_tokenizer`, both row lengths against the
    corpus's first documents (`meshkd.recipe.corpus.aligned_data.check_row_lengths`: refused when a row cannot hold
    an aligned group, a warning when the teacher's length leaves a side's rows under-filled). Training from
    `kd.teacher_cache` checks the cache against the run instead of the teacher
    (`meshkd.recipe.teacher.teacher_cache.check_cache`), and the teacher's identity when `teacher_model` is given;
    `writing_cache` (`meshkd cache-teacher`) checks the teacher. With `kd.generation.engine`, the vLLM server
    (`meshkd.recipe.student.rollout_engine.check_server`: reachable, the student's architecture and vocabulary, its
    reload endpoint). `check_data` False skips reading the corpus
    (`preflight_teachers`: read for the first teacher only); `teachers`: the names routed rows may give.

    Raises:
        ConfigError (a ValueError) or ValueError: naming the config key.
        FileNotFoundError: naming the missing file or path.
    """
    check_versions()
    teacher = teacher or config.teacher_named()
    kind = kind_of(config, teacher, writing_cache=writing_cache)
    separate = kind.own_ranks
    _check_sizes_given(config, teacher, separate)
    outputs = [("logging.run_dir", config.logging.run_dir), ("checkpoint.dir", config.checkpoint.dir)]
    for key, path in outputs + ([("kd.teacher_cache", teacher.cache)] if writing_cache else []):
        _check_writable_directory(key, path)
    dataset = config.dataset
    with about("dataset"):
        documents.check_arguments(config.step_scheduler.sequence_length, dataset.val_fraction, dataset.format,
                                  dataset.max_documents, dataset.max_document_chars, "replace")
    with about("dataset.paths"):
        files = documents.match_files([expand_path(pattern) for pattern in dataset.paths])
    with about("model.tokenizer"):
        tokenizer = load_section_tokenizer(config.model)
    found = _read_data(config, tokenizer, files, teachers) if check_data else None
    with about("model"):
        student = load_section_skeleton(config.model, "model")
    _warn_if_checkpoints_may_not_fit(config, student)
    if config.kd.generation.engine is not None:  # the vLLM server that draws the completions
        check_server(config.kd.generation.engine, architecture=type(student).__name__,
                     vocab_rows=_embedding_rows(student), sequence_length=config.step_scheduler.sequence_length)
    # The teacher, as its source knows it: a skeleton, a cache's manifest, a server's health.
    found_teacher = kind.check(config, teacher, tokenizer, student_rows=_embedding_rows(student))
    teacher_tokenizer = found_teacher.tokenizer
    vocab_size = _common_vocabulary(config, tokenizer, teacher_tokenizer, _embedding_rows(student),
                                    found_teacher.vocab_rows)
    roles = [Role("distributed", config.distributed, "model", student, config.model)]
    if found_teacher.skeleton is not None:
        roles.append(Role("teacher_distributed" if separate else "distributed", config.layout_of(teacher),
                          "teacher_model", found_teacher.skeleton, teacher.model))
    for role in roles:
        _check_role(config, role)
    _check_student_against_teacher(config, student, found_teacher.num_layers, vocab_size)
    if config.kd.cross_tokenizer is not None and found:  # the rows' lengths against the corpus's first documents
        if format_named(config.dataset.records).rendered:  # rows read again, rendered for both sides
            found = _read_data(config, tokenizer, files, teachers, teacher_tokenizer=teacher_tokenizer)
        check_row_lengths(config, found, tokenizer, teacher_tokenizer)
    return Preflight(tokenizer=tokenizer, student_vocab_rows=_embedding_rows(student), source=kind,
                     teacher=found_teacher)


def preflight_teacher(config: KDRecipeConfig, teacher: TeacherConfig) -> None:
    """`meshkd serve-teacher`'s checks: the teacher's tokenizer and skeleton, against its layout (`_check_role`)."""
    check_versions()
    with about("teacher_model.tokenizer"):
        load_section_tokenizer(teacher.model)
    with about("teacher_model"):
        skeleton = load_section_skeleton(teacher.model, "teacher_model")
    key = "teacher_distributed" if teacher.distributed is not None else "distributed"
    _check_role(config, Role(key, config.layout_of(teacher), "teacher_model", skeleton, teacher.model))


@dataclass
class Role:
    """A model preflight checks against its layout: its layout key, its section's label, its skeleton."""

    key: str
    layout: object
    label: str
    model: torch.nn.Module
    section: object


def _check_sizes_given(config: KDRecipeConfig, teacher: TeacherConfig, separate: bool) -> None:
    """On separate meshes each role's dp_size (a run from a teacher cache, or writing one, has one role)."""
    if separate:
        for key, layout in (("distributed", config.distributed), ("teacher_distributed", teacher.distributed)):
            if layout is not None and layout.dp_size is None:
                raise ConfigError(
                    f"{key}.dp_size is required with separate_meshes: true (each role's size is explicit)"
                )


def _read_data(config: KDRecipeConfig, tokenizer, files: list[str], teachers: list[str] | None,
               teacher_tokenizer=None) -> list | None:
    """The corpus's documents when its files are small enough to read here (each checked for being text, by
    `dataset.on_bad_file`, and each row for its columns), else None: a large corpus is left to the students'
    setup, whose errors reach every rank too. A `dataset.hf` dataset is opened, not read: its path and
    split, and its first row's columns."""
    dataset = config.dataset
    routes = teachers if dataset.teacher_key else None
    if dataset.hf is not None:
        with about("dataset.hf"):
            read = documents.reading_arguments(dataset, tokenizer, routes)["read_record"]
            for row, where in itertools.islice(hf_sources.section_rows(replace(dataset.hf, streaming=True)), 1):
                read(row, where)
        return None
    if sum(os.path.getsize(path) for path in files) > _PREFLIGHT_READ_BYTES:
        return None
    with about("dataset.paths"):
        arguments = documents.reading_arguments(dataset, tokenizer, routes, teacher_tokenizer=teacher_tokenizer)
        found = documents.read_documents(files, format=dataset.format, max_documents=None, max_document_chars=None,
                                         encoding_errors="replace", on_bad_file=dataset.on_bad_file,
                                         read_record=arguments["read_record"])
        if not found:
            raise ValueError(f"no non-empty document in the {len(files)} file(s) matched by {dataset.paths}")
    return found


def _common_vocabulary(config: KDRecipeConfig, tokenizer, teacher_tokenizer, student_rows: int,
                       teacher_rows: int) -> int:
    """The vocabulary both sides share (`models.common_vocab_size`); with `kd.cross_tokenizer`, fast tokenizers."""
    with about("model.tokenizer / teacher_model.tokenizer"):
        vocab_size = models.common_vocab_size(tokenizer, teacher_tokenizer, student_vocab_size=student_rows,
                                              teacher_vocab_size=teacher_rows,
                                              cross_tokenizer=config.kd.cross_tokenizer is not None)
        if config.kd.cross_tokenizer is not None:  # byte spans come from the fast tokenizers' offset mappings
            for name, side in (("model", tokenizer), ("teacher_model", teacher_tokenizer)):
                if not getattr(side, "is_fast", False):
                    raise ValueError(f"{name}.tokenizer: kd.cross_tokenizer aligns tokens by their byte offsets, "
                                     f"which {type(side).__name__} (not a fast tokenizer) does not give")
    return vocab_size


def _check_role(config: KDRecipeConfig, role: Role) -> None:
    """One model against the run: its layer kinds against the masks meshkd prepares, FlexAttention's head
    size on CUDA, the sequence length against its positions, and its layout (experts, tp plan, pp stages)."""
    key, layout, label, model, section = role.key, role.layout, role.label, role.model, role.section
    with about(label):
        attention_windows(model.config, model)  # the masks meshkd prepares fit every layer kind
    shape = model.config
    head_dim = getattr(shape, "head_dim", None) or shape.hidden_size // shape.num_attention_heads
    if section.attn_implementation == "flex_attention" and uses_cuda(config) and head_dim < 16:
        raise ConfigError(f"{label}.attn_implementation: flex_attention on CUDA needs head_dim >= 16 (the "
                          f"compiled kernel's smallest); {label} has head_dim {head_dim}: use sdpa")
    limit = getattr(model.config, "max_position_embeddings", None)
    length_key, length = "step_scheduler.sequence_length", config.step_scheduler.sequence_length
    if label == "teacher_model" and config.kd.cross_tokenizer is not None:
        length_key, length = "kd.cross_tokenizer.teacher_sequence_length", config.teacher_sequence_length
    if limit is not None and length > limit:
        raise ConfigError(f"{length_key}({length}) exceeds {label}'s max_position_embeddings({limit})")
    if layout.ep_size > 1 and layout.ep_size != layout.tp_size:  # whole experts over the data-parallel ranks
        if label == "teacher_model":
            raise ConfigError(
                f"{key}.ep_size({layout.ep_size}) would spread the teacher's experts over its data-parallel "
                "ranks, which answer different requests and do not run forward in step; use ep_size equal "
                "to tp_size"
            )
        try:
            check_experts_over_dp(layout)
        except ValueError as error:
            raise ConfigError(f"{key}.{error}") from None
    try:
        check_tensor_parallel(model, layout.tp_size, layout.ep_size)
    except ValueError as error:
        sizes = f"tp_size({layout.tp_size})" + (f", ep_size({layout.ep_size})" if layout.ep_size > 1 else "")
        raise ConfigError(f"{key}.{sizes} does not fit {label}: {error}") from None
    if layout.tp_size > 1 and layout.ep_size == 1 and experts_left_whole(model):
        warn0(f"{key}.ep_size: {label}'s experts stay whole on each of its {layout.tp_size} tp ranks (this "
              f"transformers release's tensor-parallel plan does not shard experts); set ep_size: "
              f"{layout.tp_size} to spread them over the tp ranks")
    num_layers = model.config.num_hidden_layers
    if layout.pp_size > num_layers:
        raise ConfigError(
            f"{key}.pp_size({layout.pp_size}) exceeds {label}'s {num_layers} decoder layers"
            + (" (after keep_layers)" if section.keep_layers is not None else "")
        )


def _check_student_against_teacher(config: KDRecipeConfig, student: torch.nn.Module, teacher_layers: int | None,
                                   vocab_size: int) -> None:
    """The hidden-state pairs against both models' layers (the teacher's as its source knows them, e.g. as its
    server reports them), and a TP student's vocabulary against the common one."""
    if config.kd.hidden_states is not None:
        try:
            check_pairs(pairs_of(config.kd.hidden_states, config.model.keep_layers),
                        student_layers=student.config.num_hidden_layers,
                        teacher_layers=teacher_layers)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    tp_size = config.distributed.tp_size
    if tp_size > 1 and _embedding_rows(student) != vocab_size:
        raise ConfigError(
            f"model: vocabulary {_embedding_rows(student)} differs from the common vocabulary {vocab_size} (the "
            f"teacher's): distributed.tp_size({tp_size}) > 1 needs them equal"
        )


def _existing_ancestor(path: str) -> str:
    existing = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def _warn_if_checkpoints_may_not_fit(config: KDRecipeConfig, student: torch.nn.Module) -> None:
    """A warning when the run's checkpoints (weights and optimizer moments, each save kept) exceed the free disk."""
    steps = config.step_scheduler
    if not config.checkpoint.enabled or not steps.ckpt_every_steps:
        return
    weights = sum(parameter.numel() * parameter.element_size() for parameter in student.parameters())
    per_checkpoint = weights * (3 if config.optimizer.name == "adamw" else 1)  # AdamW: two moments
    saves = steps.max_steps // steps.ckpt_every_steps
    root = config.checkpoint.dir or os.path.join(config.logging.run_dir, "checkpoints")
    existing = _existing_ancestor(root)
    free = shutil.disk_usage(existing).free
    if per_checkpoint * saves > free:
        warn0(f"checkpoint.dir: the run's {saves} checkpoints take about {per_checkpoint * saves / 2**20:.1f} MiB "
              f"({per_checkpoint / 2**20:.1f} MiB each), {free / 2**20:.1f} MiB are free under {existing}")


def _check_writable_directory(key: str, path: str | None) -> None:
    """`path` is a directory this process can write, or can be created as one."""
    if path is None:
        return
    target = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(f"{key}: {path} exists and is not a directory")
    existing = _existing_ancestor(target)
    if not os.path.isdir(existing):
        raise ConfigError(f"{key}: {path} cannot be created: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {path} is not writable (no write permission on {existing})")
