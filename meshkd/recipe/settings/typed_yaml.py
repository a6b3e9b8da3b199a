"""YAML read into typed dataclasses: the machinery under `meshkd.recipe.settings.config`.

`build(cls, values, key)` makes a dataclass tree from a parsed mapping, checking every field against its
type hint (bool, int, float, str, list[...], dict, nested dataclasses, unions with None) and rejecting
unknown keys; every error is a `ConfigError` naming the dotted key. `apply_override` applies one
`a.b=value` override, the value parsed as YAML. `parse_yaml` reads 1e-3 as a number, as YAML 1.2 does.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any

import yaml

__all__ = ["ConfigError", "apply_override", "build", "parse_yaml"]


class _Loader(yaml.SafeLoader):
    """YAML as PyYAML reads it, except that 1e-3 is a number, as in YAML 1.2 (PyYAML reads a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    """A YAML document as PyYAML's SafeLoader reads it, with 1e-3 a number."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key."""


def build(cls: type, values: Any, key: str) -> Any:
    """Build dataclass `cls` from a mapping, checking every field's type; errors name the dotted key."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{key or 'config'}: expected a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        prefix = f"{key}." if key else ""
        raise ConfigError(f"unknown config key(s) {[prefix + name for name in unknown]}; known: {sorted(names)}")
    return cls(**{name: _coerce(hints[name], value, f"{key}.{name}" if key else name)
                  for name, value in values.items()})


def _coerce(hint: Any, value: Any, key: str) -> Any:
    is_union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    options = typing.get_args(hint) if is_union else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{key} must not be null")
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            return _coerce_one(option, value, key)
        except ConfigError as error:
            errors.append(error)
    raise errors[0]


def _coerce_one(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key)
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce_one(item, element, f"{key}[{i}]") if item is not Any else element
                for i, element in enumerate(value)]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {hint}")


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` override to a nested dict; the value is parsed as YAML."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like key.path=value")
    dotted, raw = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
        node = child
    try:
        node[parts[-1]] = parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise ConfigError(f"override {assignment!r}: the value is not valid YAML ({problem})") from None
