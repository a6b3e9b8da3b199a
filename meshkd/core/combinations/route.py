"""`route`: each row's divergence to its own teacher, which alone was asked for it (the teacher its documents
name under `dataset.teacher_key`; the answers put back together into one, `merged`). On-policy, a completion row
keeps its prompt's teacher (`meshkd.recipe.student.on_policy`), so the same holds for the student's samples."""

from __future__ import annotations

from meshkd.core.combinations.base import Combination, answer_type, register


@register
class Route(Combination):
    name = "route"
    routes_rows = True

    def check(self, config):
        """What routing each row to one teacher cannot do yet, or makes meaningless."""
        teachers = config.teachers
        if len(teachers) < 2:
            raise ValueError("kd.combine route sends each row to one of several teachers: give at least two in "
                             "teachers, or leave kd.combine and dataset.teacher_key out")
        cached = [teacher.name for teacher in teachers if teacher.cache is not None]
        if cached:
            raise ValueError(f"teachers.{cached[0]}.cache does not yet work with kd.combine route (a cache holds "
                             "the rows of unrouted packing)")
        for teacher in teachers:
            if teacher.weight != 1.0:
                raise ValueError(f"teachers.{teacher.name}.weight: with kd.combine route each row learns from its "
                                 "own teacher alone, so weights have no effect; leave them out")
        transports = {teacher.logits_transport or config.kd.logits_transport for teacher in teachers}
        if len(transports) > 1:
            raise ValueError(f"kd.combine route puts the teachers' answers for one micro-batch together: give every "
                             f"teacher the same logits_transport, got {sorted(transports)}")

    def combined(self, members, weights, *, routes, temperature):
        rows = {name: routes == index for index, name in enumerate(members)}
        return answer_type(members).merged(members, rows), rows

    def loss(self, members, combined, divergence, weights):
        merged, rows = combined
        each = {name: divergence(merged, rows[name]) for name in members}
        return sum(each.values()), each
