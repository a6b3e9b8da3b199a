"""`completions`: a teacher behind an OpenAI-compatible completions endpoint such as vLLM's
(`teacher_model.url` with `teacher_model.api: completions`), asked for its prompt log-probabilities
(`meshkd.recipe.teacher.completions_teacher.CompletionsTeacher`). Preflight asks only whether it answers: its
vocabulary is taken to be the student's."""

from __future__ import annotations

from meshkd.recipe.settings.config import ConfigError
from meshkd.recipe.teacher.completions_teacher import MODELS_PATH, CompletionsTeacher
from meshkd.recipe.teacher.served_teacher import health
from meshkd.recipe.teacher.sources.base import SourceKind, TeacherCheck, answer_tokenizer, asks_http, register
from meshkd.recipe.teacher.sources.served import asking
from meshkd.recipe.teacher.teacher_answers import ANSWERS


@register
class Completions(SourceKind):
    name = "completions"

    def describes(self, config, teacher, *, writing_cache):
        return asks_http(teacher, "completions", writing_cache)

    def check(self, config, teacher, tokenizer, *, student_rows):
        transport = config.kd_of(teacher).logits_transport
        if ANSWERS.named(transport).reads_hidden:
            raise ConfigError(f"kd.logits_transport {transport}: a completions endpoint sends log-probabilities, "
                              "neither its hidden states nor its output layer; use topk")
        health(teacher.model.url, path=MODELS_PATH)
        return TeacherCheck(answer_tokenizer(config, teacher, tokenizer), vocab_rows=student_rows)

    def make(self, config, teacher, check, context):
        return CompletionsTeacher(teacher.model.url, model=teacher.model.served_model,
                                  **asking(config, teacher, context))
