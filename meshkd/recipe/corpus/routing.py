"""Rows routed to one of several teachers (`kd.combine: route`, `dataset.teacher_key`).

Each JSONL document names its teacher (`meshkd.recipe.records.Document.route`). A split's documents are
packed teacher by teacher (`meshkd.recipe.corpus.stored_rows.plan_routed`), so a row holds one teacher's
documents only, and every row carries its teacher's index in `teachers` under
`meshkd.core.teacher_ensemble.ROUTE` ([rows, 1]; -1 in padding rows). The teacher ensemble then sends each
teacher only its rows.
"""

from __future__ import annotations


def route_names(config) -> list[str] | None:
    """The names routed rows may give, in the teachers' order (a row's index in it is its `ROUTE`), or None
    when rows are not routed."""
    return [teacher.name for teacher in config.teachers] if config.dataset.teacher_key is not None else None
