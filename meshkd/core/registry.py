"""A registry: one instance of each registered class, by the class's `name`.

Each kind of thing that varies keeps one (answer encodings, row formats, combinations of teachers, teacher
sources; docs/architecture.md, "Registries"), so that adding one is a module that registers its class.
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


class Registry(dict[str, T]):
    """name -> the one instance of the class registered under it (or the class itself, `classes`), in registration
    order."""

    def __init__(self, kind: str, unknown: str, *, classes: bool = False) -> None:
        """`kind` names what is registered in errors ("answer encoding"); `unknown` is the refusal of a name none
        has, a format string of `{known}` (the names, comma-separated) and `{name}` (the one asked for);
        `classes`: the registered classes themselves are kept (each value made of them is an instance, as a
        teacher answer of its wire dict), not one instance each."""
        super().__init__()
        self.kind, self.unknown, self.classes = kind, unknown, classes

    def register(self, cls: type) -> type:
        """Class decorator: registers one instance of `cls` (or `cls` itself) under `cls.name`."""
        if cls.name in self:
            raise ValueError(f"{self.kind} {cls.name!r} is registered twice")
        self[cls.name] = cls if self.classes else cls()
        return cls

    def named(self, name: Any) -> T:
        """The instance registered as `name`; ValueError (`unknown`) naming the registered ones otherwise."""
        if name not in self:
            raise ValueError(self.unknown.format(known=", ".join(self), name=repr(name)))
        return self[name]
