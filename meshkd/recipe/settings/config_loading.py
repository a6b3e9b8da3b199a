"""The recipe config from YAML: read, overridden, built into `meshkd.recipe.settings.config`'s dataclasses and checked.

`load_config(path, overrides)` reads YAML (`read_config_document`), applies `a.b=value` overrides (values parsed
as YAML) and builds the dataclass tree, rejecting unknown keys and mistyped values with the dotted key in the message
(`meshkd.recipe.settings.typed_yaml`); `meshkd.recipe.settings.config_checks.validate` then checks the rules across
keys. A command that builds the config more than once (with overrides it adds, as `meshkd.commands` does) reads
the file once with `read_config_document` and builds each config from that document with `config_from_dict`.
"""

from __future__ import annotations

import copy
import sysconfig
from pathlib import Path

import yaml

from meshkd.recipe.settings.config import KDRecipeConfig
from meshkd.recipe.settings.config_checks import validate
from meshkd.recipe.settings.typed_yaml import ConfigError, apply_override, build, parse_yaml


def config_from_dict(data: dict, overrides: list[str] = ()) -> KDRecipeConfig:
    """Build and validate a config from a dict plus overrides (`data` itself is left as it is)."""
    data = copy.deepcopy(data or {})
    for assignment in overrides:
        apply_override(data, assignment)
    config = build(KDRecipeConfig, data, "")
    validate(config)
    return config


def read_config_document(path: str | Path) -> dict:
    """The YAML config file as its mapping of sections (`{}` for an empty file), not yet built or checked."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data or {}


def load_config(path: str | Path, overrides: list[str] = ()) -> KDRecipeConfig:
    """Read a YAML config file, apply overrides, build and validate it."""
    return config_from_dict(read_config_document(path), overrides)


def expand_path(pattern: str) -> str:
    """Expand `${stdlib}` (this interpreter's standard library sources) and `~` in a dataset path."""
    return str(Path(pattern.replace("${stdlib}", sysconfig.get_paths()["stdlib"])).expanduser())
