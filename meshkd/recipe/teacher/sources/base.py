"""What a teacher source is, and the registry of its kinds by name.

A teacher source is where one teacher's answers come from while the student trains (a
`meshkd.core.teacher_protocol.TeacherSource`). Each kind is one `SourceKind` subclass in a module of this package,
registered once under its name (`@register`); the kind a teacher (a `TeacherConfig` of the run's
`teacher_list`) describes is the one whose `describes` says so, and exactly one does (`kind_of`). Each method
takes the run's config and the teacher. Everything that varies with the kind asks it:

    describes(config, teacher, writing_cache)   whether the teacher describes this kind
    own_ranks                                   the teacher runs on ranks of its own (a bridge to them)
    loads_here                                  the teacher's weights load on the student's ranks
    check(config, teacher, tokenizer, ...)      preflight: what the teacher is (`TeacherCheck`), refusing what
                                                does not fit
    make(config, teacher, check, context)       the `TeacherSource` the student asks
    validation_answer(source)                   the answer it gives held-out rows, when not what the run asks
    head(config, teacher, context, held)        its output layer, for its hidden answers (`TeacherHead`)

Adding a kind is one module here (imported by `meshkd/recipe/teacher/sources/__init__.py`) and its test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from meshkd.core.cross_tokenizer_loss import VocabularyMap
from meshkd.core.registry import Registry
from meshkd.core.teacher_protocol import TeacherSource
from meshkd.core.topology import DistributedSetup
from meshkd.recipe.common.faults import about
from meshkd.recipe.modeling.loaders import load_section_skeleton, load_section_tokenizer
from meshkd.recipe.settings.config import KDRecipeConfig, TeacherConfig
from meshkd.recipe.teacher.teacher_cache import cache_teacher_tokenizer
from meshkd.recipe.teacher.teacher_head import TeacherHead


@dataclass
class TeacherCheck:
    """What preflight learnt of a teacher without its weights."""

    tokenizer: Any  # the tokenizer whose ids the teacher reads (the student's, unless kd.cross_tokenizer)
    vocab_rows: int  # its output layer's rows
    hidden_size: int | None = None  # its width, where known (kd.hidden_states)
    num_layers: int | None = None  # its decoder layers, where known (kd.hidden_states' pairs)
    skeleton: torch.nn.Module | None = None  # the teacher on the meta device, checked against its layout
    report: dict | None = None  # what the source reported: a cache's manifest, a server's health


@dataclass
class SourceContext:
    """What a student rank holds when it makes its teachers' sources."""

    setup: DistributedSetup
    device: torch.device
    datasets: dict  # {"train", "validation"}: the run's rows
    vocab_size: int
    vocabulary_map: VocabularyMap | None
    bridge: Any = None  # to the teacher's own ranks (`own_ranks` kinds)
    loaded: tuple | None = None  # (model, checkpoint) as `load_teacher` loaded it here (`loads_here` kinds)


class SourceKind:
    """One kind of teacher source. Subclasses set `name` and implement `describes`, `check` and `make`."""

    name: ClassVar[str]
    own_ranks: ClassVar[bool] = False
    """Whether the teacher runs on ranks of its own, joined to the student's by a bridge."""
    loads_here: ClassVar[bool] = False
    """Whether the teacher's weights load on the student's ranks."""

    @property
    def outside_job(self) -> bool:
        """Whether the teacher runs nowhere in this job (its answers are read or asked for)."""
        return not (self.own_ranks or self.loads_here)

    def describes(self, config: KDRecipeConfig, teacher: TeacherConfig, *, writing_cache: bool) -> bool:
        """Whether `teacher` of a run of `config` is of this kind (`writing_cache`: for `meshkd cache-teacher`,
        which writes the teacher's cache)."""
        raise NotImplementedError

    def check(self, config: KDRecipeConfig, teacher: TeacherConfig, tokenizer: Any, *,
              student_rows: int) -> TeacherCheck:
        """Preflight: the teacher as far as it can be known without its weights; ConfigError naming the key."""
        raise NotImplementedError

    def make(self, config: KDRecipeConfig, teacher: TeacherConfig, check: TeacherCheck,
             context: SourceContext) -> TeacherSource:
        """The source the student asks for this teacher's answers."""
        raise NotImplementedError

    def validation_answer(self, source: TeacherSource) -> str | None:
        """The answer it gives held-out rows when that is fixed by the source, not asked (None: as asked)."""
        return None

    def head(self, config: KDRecipeConfig, teacher: TeacherConfig, context: SourceContext,
             held: slice | None) -> TeacherHead:
        """The teacher's output layer on this student rank (`held`: the vocabulary entries to keep, None: all), for
        its hidden answers: read from the model section its ranks load (`TeacherHead.of`)."""
        with about("teacher_model"):
            return TeacherHead.of(teacher.model, vocab_size=context.vocab_size, device=context.device, held=held)


KINDS: Registry[SourceKind] = Registry("teacher source", "no teacher source is named {name}: {known} are")
"""Every registered kind, by name (filled as `meshkd.recipe.teacher.sources` imports its modules)."""
register = KINDS.register
"""Class decorator: registers one instance of the class under its `name`."""


def kind_of(config: KDRecipeConfig, teacher: TeacherConfig, *, writing_cache: bool = False) -> SourceKind:
    """The kind of source `teacher` of a run of `config` is; ValueError when none or several kinds say so."""
    kinds = [kind for kind in KINDS.values() if kind.describes(config, teacher, writing_cache=writing_cache)]
    if len(kinds) != 1:
        raise ValueError(f"the teacher's config describes {len(kinds)} kinds of teacher source "
                         f"({', '.join(kind.name for kind in kinds) or 'none'}) of {', '.join(KINDS)}: exactly one "
                         f"must")
    return kinds[0]


def asks_http(teacher: TeacherConfig, api: str, writing_cache: bool) -> bool:
    """Whether `teacher` is asked over HTTP(S) at its model's url, by the protocol `api`, for its answers."""
    url = teacher.model.url
    return (isinstance(url, str) and url.startswith(("http://", "https://")) and teacher.model.api == api
            and not reads_cache(teacher, writing_cache))


def reads_cache(teacher: TeacherConfig, writing_cache: bool) -> bool:
    """Whether `teacher`'s answers are read from its cache (which then stands for the teacher)."""
    return teacher.cache is not None and not writing_cache


def answer_tokenizer(config: KDRecipeConfig, teacher: TeacherConfig, tokenizer: Any) -> Any:
    """The tokenizer whose ids a teacher that is not loaded here reads: the student's `tokenizer`, or with
    `kd.cross_tokenizer` the teacher's (`cross_teacher_tokenizer`)."""
    return cross_teacher_tokenizer(teacher) if config.kd.cross_tokenizer is not None else tokenizer


def cross_teacher_tokenizer(teacher: TeacherConfig) -> Any:
    """The teacher's tokenizer of a `kd.cross_tokenizer` run: its model section's, or, training from a cache
    with no teacher named, the one the cache holds (`teacher_cache.cache_teacher_tokenizer`)."""
    section = teacher.model
    with about("teacher_model.tokenizer"):
        names_tokenizer = section.tokenizer is not None or section.path is not None or section.gguf_file is not None
        if teacher.cache is not None and not names_tokenizer:
            return cache_teacher_tokenizer(teacher.cache)
        return load_section_tokenizer(section)


def model_check(teacher: TeacherConfig) -> TeacherCheck:
    """A teacher whose model runs in this job: its tokenizer and skeleton, as its model section describes them."""
    with about("teacher_model.tokenizer"):
        tokenizer = load_section_tokenizer(teacher.model)
    with about("teacher_model"):
        skeleton = load_section_skeleton(teacher.model, "teacher_model")
    text = skeleton.config.get_text_config()
    return TeacherCheck(tokenizer, vocab_rows=skeleton.get_output_embeddings().weight.shape[0],
                        hidden_size=text.hidden_size, num_layers=skeleton.config.num_hidden_layers, skeleton=skeleton)
