"""Where one teacher's answers come from while the student trains: kinds of teacher source, a registry (`base`),
one module each: `cache` (kd.teacher_cache), `served` (meshkd serve-teacher at teacher_model.url), `completions`
(an OpenAI-compatible completions server), `own_ranks` (separate meshes), `student_ranks` (shared meshes)."""

from meshkd.recipe.teacher.sources import (  # noqa: F401  (each registers its kind)
    cache,
    completions,
    own_ranks,
    served,
    student_ranks,
)
from meshkd.recipe.teacher.sources.base import (
    KINDS,
    SourceContext,
    SourceKind,
    TeacherCheck,
    cross_teacher_tokenizer,
    kind_of,
    register,
)

__all__ = ["KINDS", "SourceContext", "SourceKind", "TeacherCheck", "cross_teacher_tokenizer", "kind_of", "register"]
