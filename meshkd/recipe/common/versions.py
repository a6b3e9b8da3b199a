"""The versions of transformers, peft and datasets meshkd is tested with, checked before a run starts.

Design. The tested ranges live in one place, the `recipe` extra of pyproject.toml; pip installs within them
and this module reads them back from meshkd's installed metadata (importlib.metadata), so the two cannot
disagree. CI tests both ends of each range (`.ci/run`: the newest allowed in the main run, the oldest in a
second run of the tests that lean on them most and in the torch 2.11 run). `check_versions` refuses an
installed release outside its range in one line naming the installed version, the range and the pip command
that installs a tested one; with the environment variable MESHKD_ALLOW_UNTESTED_VERSIONS=1 it warns instead
(transformers' parallel styles change from one minor release to the next, so an untested release may fail
only once a run is laid out). A library that is not installed is not checked here: the feature that needs it
says so when used.
"""

from __future__ import annotations

import os
from importlib import metadata

from meshkd.recipe.common.metrics import warn0

__all__ = ["ALLOW_UNTESTED_ENV", "CHECKED", "UnsupportedVersionError", "check_versions", "tested_ranges"]

CHECKED = ("transformers", "peft", "datasets")
ALLOW_UNTESTED_ENV = "MESHKD_ALLOW_UNTESTED_VERSIONS"


class UnsupportedVersionError(ValueError):
    """An installed library release outside the range meshkd is tested with."""


def tested_ranges() -> dict[str, str]:
    """{library: its tested range, e.g. ">=5.24,<5.26"} from meshkd's installed metadata ({} when meshkd is not
    installed, only on the path)."""
    from packaging.requirements import Requirement

    try:
        requirements = metadata.requires("meshkd") or []
    except metadata.PackageNotFoundError:
        return {}
    ranges = {}
    for line in requirements:
        requirement = Requirement(line)
        if requirement.name in CHECKED and requirement.marker is not None \
                and requirement.marker.evaluate({"extra": "recipe"}):
            ranges[requirement.name] = str(requirement.specifier)
    return ranges


def _installed(library: str) -> str | None:
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return None


def check_versions(ranges: dict[str, str] | None = None, installed: dict[str, str | None] | None = None) -> None:
    """Raise UnsupportedVersionError for the first checked library installed outside its tested range (a
    warning instead with MESHKD_ALLOW_UNTESTED_VERSIONS=1). `ranges` and `installed` default to meshkd's
    declared ranges and the installed releases."""
    from packaging.specifiers import SpecifierSet

    ranges = tested_ranges() if ranges is None else ranges
    for library, spec in ranges.items():
        version = installed[library] if installed is not None else _installed(library)
        if version is None or SpecifierSet(spec).contains(version, prereleases=True):
            continue
        found = f"{library} {version} is installed; meshkd is tested with {library}{spec}"
        if os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0"):
            warn0(f"{found}; trying it untested ({ALLOW_UNTESTED_ENV} is set)")
            continue
        raise UnsupportedVersionError(f"{found}: pip install '{library}{spec}' (or set {ALLOW_UNTESTED_ENV}=1 "
                                      f"to try {version} at your own risk)")
