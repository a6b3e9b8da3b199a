"""What a combination of teachers is, and the registry of them by name (`kd.combine`).

With several teachers (`teachers`), a combination turns their answers to one micro-batch into the student's KD
term. Each is one `Combination` subclass in a module of this package, registered once under its `kd.combine`
name (`@register`); everything that varies with the combination asks the registry:

    check(config)                    what it needs of the config; ValueError naming the key
    routes_rows                      each row goes to one teacher, named by `dataset.teacher_key`, which alone
                                     is asked for it (the rows are packed teacher by teacher)
    combined(members, weights, ...)  an answer it makes of the members', once per micro-batch (None: none)
    loss(members, combined, divergence, weights, routes)   the KD term and each teacher's own divergence

The members are the teachers' answers (`meshkd.recipe.teacher.teacher_answers.Distribution`), read through what
every answer offers (`divergence`, and the classmethods `mixture` and `merged` of their type). Adding a
combination is one module here (imported by `meshkd/core/combinations/__init__.py`) and its test.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from torch import Tensor

from meshkd.core.registry import Registry

Divergence = Callable[..., Tensor]
"""`divergence(answer, rows=None) -> Tensor`: the student's divergence to `answer` (of the rows `rows` only)."""


class Combination:
    """One way several teachers' answers make the KD term. Subclasses set `name` and implement `loss`."""

    name: ClassVar[str]
    """The value of `kd.combine` that chooses it."""
    routes_rows: ClassVar[bool] = False
    """Whether each row goes to the one teacher its documents name (`dataset.teacher_key`)."""
    whole_distributions: ClassVar[bool] = False
    """Whether it reads the teachers' whole distributions (the config then refuses a top-k teacher, naming it)."""

    def check(self, config: Any) -> None:
        """ValueError naming the key when the recipe config (`teachers`, `kd`, `dataset`) does not suit it."""

    def combined(self, members: Mapping[str, Any], weights: Mapping[str, float], *, routes: Tensor | None,
                 temperature: float) -> Any:
        """What it makes of the members' answers once per micro-batch, whatever the chunks asking (None: nothing);
        `routes`: each row's teacher index, when `routes_rows`."""
        return None

    def loss(self, members: Mapping[str, Any], combined: Any, divergence: Divergence,
             weights: Mapping[str, float]) -> tuple[Tensor, dict[str, Tensor]]:
        """The KD term, and each teacher's own divergence (for the metrics; it may be computed without grad)."""
        raise NotImplementedError


COMBINATIONS: Registry[Combination] = Registry("combination", "kd.combine must be one of {known}, got {name}")
"""Every registered combination, by name (filled as `meshkd.core.combinations` imports its modules)."""
register = COMBINATIONS.register
"""Class decorator: registers one instance of the class under its `name`."""
combination_named = COMBINATIONS.named
"""The registered combination `name`; ValueError naming `kd.combine` and the known ones."""


def answer_type(members: Mapping[str, Any]) -> type:
    """The type of the members' answers (whose classmethods combine them)."""
    return type(next(iter(members.values())))
