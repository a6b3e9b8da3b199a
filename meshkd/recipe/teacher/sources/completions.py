"""`completions`: a teacher behind an OpenAI-compatible completions endpoint such as vLLM's
(`teacher_model.url` with `teacher_model.api: completions`), asked for its prompt log-probabilities
(`meshkd.recipe.teacher.completions_teacher.CompletionsTeacher`). Preflight asks only whether it answers: its
vocabulary is taken to be the student's."""

from __future__ import annotations

from meshkd.recipe.teacher.completions_teacher import MODELS_PATH, CompletionsTeacher
from meshkd.recipe.teacher.served_teacher import health
from meshkd.recipe.teacher.sources.base import SourceKind, TeacherCheck, answer_tokenizer, asks_http, register
from meshkd.recipe.teacher.sources.served import asking


@register
class Completions(SourceKind):
    name = "completions"

    def describes(self, view, *, writing_cache):
        return asks_http(view, "completions", writing_cache)

    def check(self, view, tokenizer, *, student_rows):
        health(view.teacher_model.url, path=MODELS_PATH)
        return TeacherCheck(answer_tokenizer(view, tokenizer), vocab_rows=student_rows)

    def make(self, view, check, context):
        return CompletionsTeacher(view.teacher_model.url, model=view.teacher_model.served_model,
                                  **asking(view, context))
