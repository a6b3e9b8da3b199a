"""Each package imports only the ones above it in docs/architecture.md: `meshkd.core` nothing of
`meshkd.parallel` or `meshkd.recipe`, `meshkd.parallel` nothing of `meshkd.recipe`. Pure tier: the sources
are read with `ast`, imports inside functions included; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "meshkd"
# package -> the packages it must not import (those below it)
BELOW = {"core": ("meshkd.parallel", "meshkd.recipe"), "parallel": ("meshkd.recipe",)}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, `from meshkd import recipe` as `meshkd.recipe`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's own package
                parts = path.relative_to(PACKAGE.parent).with_suffix("").parts[: -node.level]
                base = ".".join(parts + ((node.module,) if node.module else ()))
            else:
                base = node.module or ""
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


@pytest.mark.parametrize("package", sorted(BELOW))
def test_a_package_imports_nothing_below_it(package):
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files
    upward = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
              for path in files for line, module in imported_modules(path)
              if any(module == below or module.startswith(below + ".") for below in BELOW[package])]
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from meshkd import recipe\n    import meshkd.recipe.models\n")
    modules = [module for _, module in imported_modules(source)]
    assert "meshkd.recipe" in modules and "meshkd.recipe.models" in modules
