"""`cache`: the teacher's answers read from `kd.teacher_cache` (`meshkd cache-teacher` wrote them), no teacher
process; the cache's manifest, checked against the run at preflight, stands for the teacher."""

from __future__ import annotations

from pathlib import Path

from meshkd.recipe.settings.config import ConfigError
from meshkd.recipe.teacher.sources.base import (
    SourceKind,
    TeacherCheck,
    answer_tokenizer,
    reads_cache,
    register,
)
from meshkd.recipe.teacher.teacher_cache import TEACHER_HEAD, CachedTeacher, check_cache, rows_asked
from meshkd.recipe.teacher.teacher_head import TeacherHead


@register
class Cache(SourceKind):
    name = "cache"

    def describes(self, config, teacher, *, writing_cache):
        return reads_cache(teacher, writing_cache)

    def check(self, config, teacher, tokenizer, *, student_rows):
        # The student's tokenizer, or with kd.cross_tokenizer the teacher's (the config's, or the one saved in it).
        teacher_tokenizer = answer_tokenizer(config, teacher, tokenizer)
        manifest = check_cache(config, teacher, tokenizer, student_vocab_rows=student_rows,
                               teacher_tokenizer=teacher_tokenizer)
        return TeacherCheck(teacher_tokenizer, vocab_rows=manifest["teacher_vocab_rows"],
                            hidden_size=manifest.get("teacher_hidden_size"), report=manifest)

    def make(self, config, teacher, check, context):
        return CachedTeacher(teacher.cache, check.report, context.datasets, device=context.device,
                             asked=rows_asked(config, context.datasets, dp_size=context.setup.dp_size))

    def validation_answer(self, source):
        return source.answer_mode("validation")  # what the cache holds

    def head(self, config, teacher, context, held):
        """The output layer the cache holds beside its hidden answers (`teacher_cache.TEACHER_HEAD`)."""
        directory = Path(teacher.cache, TEACHER_HEAD)
        if not directory.is_dir():
            raise ConfigError(f"kd.teacher_cache: {teacher.cache} holds no teacher output layer ({TEACHER_HEAD}/) to "
                              "read hidden answers with: rewrite it with `meshkd cache-teacher` and "
                              f"kd.logits_transport {config.kd_of(teacher).logits_transport}")
        return TeacherHead.saved(directory, device=context.device, held=held)
