"""`student_ranks`: the teacher loaded on the student's own ranks (shared meshes), laid out there and asked in
process (`meshkd.core.teacher_protocol.LocalTeacher` over its `TeacherForward`)."""

from __future__ import annotations

from meshkd.core.teacher_protocol import LocalTeacher
from meshkd.recipe.teacher.hidden_states import paired_layers
from meshkd.recipe.teacher.sources.base import SourceKind, model_check, reads_cache, register
from meshkd.recipe.teacher.teacher_worker import TeacherForward, lay_out_teacher


@register
class StudentRanks(SourceKind):
    name = "student_ranks"
    loads_here = True

    def describes(self, config, teacher, *, writing_cache):
        return teacher.distributed is None and teacher.model.url is None and not reads_cache(teacher, writing_cache)

    def check(self, config, teacher, tokenizer, *, student_rows):
        return model_check(teacher)

    def make(self, config, teacher, check, context):
        runner = lay_out_teacher(*context.loaded, context.setup, device=context.device)
        return LocalTeacher(TeacherForward(runner, vocab_size=context.vocab_size, kd=config.kd_of(teacher),
                                           seed=config.seed, vocabulary_map=context.vocabulary_map,
                                           hidden_layers=paired_layers(config, "teacher"), section=teacher.model))
