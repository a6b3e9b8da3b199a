"""The tested ranges of transformers, peft and datasets: declared once, read back, and enforced before a run.

A release outside its range is refused in one line naming the installed version, the range and the pip
command; MESHKD_ALLOW_UNTESTED_VERSIONS=1 turns the refusal into a warning. `meshkd train` refuses before
any model is built or process started.
"""

from __future__ import annotations

from importlib import metadata

import pytest
from packaging.specifiers import SpecifierSet

from meshkd import cli
from meshkd.recipe.common import versions
from meshkd.recipe.common.versions import ALLOW_UNTESTED_ENV, UnsupportedVersionError, check_versions

RANGES = {"transformers": ">=5.24,<5.26", "peft": ">=0.18,<0.22"}


def test_the_declared_ranges_bound_each_library_and_hold_what_is_installed():
    ranges = versions.tested_ranges()
    assert set(ranges) == set(versions.CHECKED)
    for library, spec in ranges.items():
        specifier = SpecifierSet(spec)
        assert any(s.operator in (">=", ">") for s in specifier), (library, spec)
        assert any(s.operator in ("<", "<=", "==", "~=") for s in specifier), (library, spec)  # an upper bound
        assert specifier.contains(metadata.version(library)), (library, spec)
    check_versions()  # what the set-up command installed passes


@pytest.mark.parametrize("installed", ["5.23.0", "5.26.0", "6.0.0"], ids=["too_old", "too_new", "next_major"])
def test_a_release_outside_its_range_is_refused_naming_the_version_the_range_and_the_pip_command(
        installed, monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UnsupportedVersionError) as error:
        check_versions(RANGES, {"transformers": installed, "peft": "0.21.2"})
    message = str(error.value)
    assert f"transformers {installed} is installed" in message
    assert "transformers>=5.24,<5.26" in message
    assert "pip install 'transformers>=5.24,<5.26'" in message
    assert ALLOW_UNTESTED_ENV in message and "\n" not in message


def test_releases_inside_their_ranges_and_libraries_not_installed_pass(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    check_versions(RANGES, {"transformers": "5.24.0", "peft": None})
    check_versions(RANGES, {"transformers": "5.25.3", "peft": "0.18.0"})
    with pytest.raises(UnsupportedVersionError, match="peft 0.17.1 is installed"):
        check_versions(RANGES, {"transformers": "5.25.0", "peft": "0.17.1"})


def test_the_override_warns_once_and_lets_an_untested_release_run(monkeypatch, capsys):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    check_versions(RANGES, {"transformers": "5.27.0", "peft": "0.21.0"})
    warning = capsys.readouterr().err
    assert "meshkd: warning: transformers 5.27.0 is installed; meshkd is tested with transformers>=5.24,<5.26" \
        in warning and ALLOW_UNTESTED_ENV in warning
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "0")  # 0 is off
    with pytest.raises(UnsupportedVersionError):
        check_versions(RANGES, {"transformers": "5.27.0", "peft": "0.21.0"})


def test_meshkd_train_refuses_an_untested_transformers_before_anything_starts(monkeypatch, capsys):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    real = versions._installed
    monkeypatch.setattr(versions, "_installed",
                        lambda library: "5.17.0" if library == "transformers" else real(library))
    started = []
    monkeypatch.setattr(cli.commands, "train_command", lambda *args: started.append(args) or 0)
    assert cli.main(["train", "no-such-config.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshkd: error: transformers 5.17.0 is installed") and "pip install 'transformers" in err
    assert len(err.splitlines()) == 1 and not started
