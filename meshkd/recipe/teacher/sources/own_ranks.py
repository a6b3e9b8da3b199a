"""`own_ranks`: the teacher on ranks of its own in this job (`separate_meshes: true`), its answers sent over the
bridge (`meshkd.core.teacher_protocol.TeacherClient`; the teacher's ranks run
`meshkd.recipe.teacher.teacher_worker.TeacherWorker`)."""

from __future__ import annotations

from meshkd.core.teacher_protocol import TeacherClient
from meshkd.recipe.teacher.sources.base import SourceKind, model_check, reads_cache, register


@register
class OwnRanks(SourceKind):
    name = "own_ranks"
    own_ranks = True

    def describes(self, config, teacher, *, writing_cache):
        return (teacher.distributed is not None and teacher.model.url is None
                and not reads_cache(teacher, writing_cache))

    def check(self, config, teacher, tokenizer, *, student_rows):
        return model_check(teacher)

    def make(self, config, teacher, check, context):
        return TeacherClient(context.bridge)
