"""Each package imports only the ones above it in docs/architecture.md: `meshkd.core` nothing of
`meshkd.parallel` or `meshkd.recipe`, `meshkd.parallel` nothing of `meshkd.recipe`; within
`meshkd.recipe` each sub-package nothing of those after it in `RECIPE_ORDER`. Pure tier: the sources
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
    source.write_text("def f():\n    from meshkd import recipe\n    import meshkd.recipe.modeling.models\n")
    modules = [module for _, module in imported_modules(source)]
    assert "meshkd.recipe" in modules and "meshkd.recipe.modeling.models" in modules


# The recipe's sub-packages in docs/architecture.md's order: each imports only those before it.
RECIPE_ORDER = ("common", "settings", "corpus", "modeling", "teacher", "student", "lifecycle")


@pytest.mark.parametrize("package", RECIPE_ORDER)
def test_a_recipe_subpackage_imports_nothing_after_it(package):
    later = tuple(f"meshkd.recipe.{name}" for name in RECIPE_ORDER[RECIPE_ORDER.index(package) + 1:])
    files = sorted((PACKAGE / "recipe" / package).rglob("*.py"))
    assert files
    upward = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
              for path in files for line, module in imported_modules(path)
              if any(module == name or module.startswith(name + ".") for name in later)]
    assert not upward, "\n".join(upward)


def test_every_recipe_module_is_in_a_subpackage_of_the_order():
    recipe = PACKAGE / "recipe"
    loose = [path.name for path in recipe.glob("*.py") if path.name != "__init__.py"]
    unordered = [path.name for path in recipe.iterdir()
                 if path.is_dir() and path.name != "__pycache__" and path.name not in RECIPE_ORDER]
    assert not loose and not unordered, (loose, unordered)
