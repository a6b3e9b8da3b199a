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

    def describes(self, view, *, writing_cache):
        return not view.separate_meshes and view.teacher_model.url is None and not reads_cache(view, writing_cache)

    def check(self, view, tokenizer, *, student_rows):
        return model_check(view)

    def make(self, view, check, context):
        runner = lay_out_teacher(*context.loaded, context.setup, device=context.device)
        return LocalTeacher(TeacherForward(runner, vocab_size=context.vocab_size, kd=view.kd, seed=view.seed,
                                           vocabulary_map=context.vocabulary_map,
                                           hidden_layers=paired_layers(view, "teacher")))
