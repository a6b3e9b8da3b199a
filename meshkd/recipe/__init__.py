"""The training recipe, in sub-packages that each import only those before them: common, settings, corpus,
modeling, teacher, student, lifecycle (docs/architecture.md)."""
