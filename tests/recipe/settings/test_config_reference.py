"""The configuration reference (a Markdown table) names exactly the config's fields, with their defaults.

Each row's first cell names keys in backticks: a dotted path from the top of the config (`kd.mode`); later
names of the cell without a dot share the first one's section (`dataset.format` / `text_key`); `*.` stands for
both model sections (`model`, `teacher_model`); `teachers[i].` for an entry of `teachers`; and `section.*` for
every key of a section. The second cell gives the defaults in the same order (one value for all of them; `-`:
a key the user must give; none for `section.*`).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from meshkd.recipe.settings.config import KDRecipeConfig

REFERENCE = Path(__file__).parents[3] / "docs" / "configuration.md"  # the page holding the table
HEADING = "# Configuration reference"
MODEL_SECTIONS = ("model", "teacher_model")  # what `*.` stands for


def _nested(cls: type, name: str) -> type | None:
    """The dataclass a field holds (alone, optional, or in a list), or None for a plain value."""
    hint = typing.get_type_hints(cls)[name]
    candidates = [hint, *typing.get_args(hint)]
    candidates += [inner for arg in candidates[1:] for inner in typing.get_args(arg)]  # list[TeacherConfig] | None
    return next((arg for arg in candidates if dataclasses.is_dataclass(arg)), None)


def _leaves(cls: type) -> set[tuple[type, str]]:
    """Every (dataclass, field) of the config tree that holds a value, not a section."""
    leaves = set()
    for item in dataclasses.fields(cls):
        nested = _nested(cls, item.name)
        leaves |= _leaves(nested) if nested else {(cls, item.name)}
    return leaves


def _rows() -> list[tuple[str, str]]:
    """(first cell, default cell) of each row of the reference table."""
    text = REFERENCE.read_text()
    assert HEADING in text, f"{REFERENCE} has no {HEADING!r} section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    cells = [line.strip().strip("|").split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return [(row[0], row[1].strip()) for row in cells]


def _names(cell: str) -> list[str]:
    """The dotted keys a first cell names, later names without a dot read in the first one's section."""
    names = cell.split("`")[1::2]
    section = names[0].rpartition(".")[0]
    return [name if "." in name or not section else f"{section}.{name}" for name in names]


def _resolve(name: str) -> list[tuple[type, str, dataclasses.Field | None]]:
    """(dataclass, field name, field) of each key a name stands for; `section.*` stands for all of the section's."""
    paths = [f"{section}.{name[2:]}" for section in MODEL_SECTIONS] if name.startswith("*.") else [name]
    resolved = []
    for path in paths:
        cls, *parents, last = [KDRecipeConfig, *path.replace("[i]", "").split(".")]
        for part in parents:
            assert part in {item.name for item in dataclasses.fields(cls)}, f"{name}: {part!r} is no key of {cls}"
            cls = _nested(cls, part)
            assert cls is not None, f"{name}: {part!r} is not a section"
        fields = {item.name: item for item in dataclasses.fields(cls)}
        if last == "*":
            resolved += [(cls, item_name, None) for item_name in fields]
        else:
            assert last in fields, f"{name}: no such key (the keys of {cls.__name__}: {sorted(fields)})"
            resolved.append((cls, last, fields[last]))
    return resolved


def test_every_row_names_real_keys_and_every_key_has_a_row():
    named = set()
    for cell, _ in _rows():
        named |= {(cls, name) for item in _names(cell) for cls, name, _ in _resolve(item)}
    missing = sorted(f"{cls.__name__}.{name}" for cls, name in _leaves(KDRecipeConfig) - named)
    assert not missing, f"keys with no row in {REFERENCE.name}'s {HEADING!r}: {missing}"


def _default(item: dataclasses.Field):
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return item.default


@pytest.mark.parametrize("cell, defaults", _rows(), ids=lambda value: value[:40])
def test_each_row_gives_the_real_defaults(cell, defaults):
    keys = [(name, item) for name in _names(cell) for _, _, item in _resolve(name) if item is not None]
    if not keys or defaults == "-":
        return  # whole sections, or keys the user must give
    keys = list(dict(keys).items())  # `*.x` stands for a key of both model sections: one default
    values = defaults.split(" / ") if " / " in defaults else defaults.split(", ")
    values = values if len(values) > 1 else values * len(keys)
    assert len(values) == len(keys), f"{cell}: {len(keys)} keys, defaults {defaults!r}"
    for (name, item), value in zip(keys, values):
        assert value == "-" or yaml.safe_load(value) == _default(item), f"{name}: default {_default(item)!r}, " \
                                                                       f"the table says {value!r}"


@pytest.mark.parametrize("key", ["logits_transport", "topk_encoding"])
def test_the_reference_names_every_value_a_registered_answer_encoding_takes(key):
    from meshkd.core.answers import choices

    text = REFERENCE.read_text()
    row = next(line for line in text.splitlines() if line.startswith(f"| `kd.{key}`"))
    default = row.split(" | ")[1]
    missing = [value for value in choices(key) if f"`{value}`" not in row and value != default]
    assert not missing, f"docs/configuration.md's kd.{key} row does not name {missing}"



@pytest.mark.parametrize("key, package, registry", [("dataset.records", "meshkd.recipe.records", "FORMATS"),
                                                    ("kd.combine", "meshkd.core.combinations", "COMBINATIONS")])
def test_the_reference_names_every_registered_row_format_and_combination(key, package, registry):
    import importlib

    names = getattr(importlib.import_module(package), registry)
    row = next(line for line in REFERENCE.read_text().splitlines() if line.startswith(f"| `{key}`"))
    default = row.split(" | ")[1]
    missing = [name for name in names if f"`{name}`" not in row and name != default]
    assert not missing, f"docs/configuration.md's {key} row does not name {missing}"
