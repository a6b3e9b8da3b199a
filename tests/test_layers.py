"""Each package imports only the ones above it in docs/architecture.md: `meshkd.core` nothing of
`meshkd.parallel` or `meshkd.recipe`, `meshkd.parallel` nothing of `meshkd.recipe`; within
`meshkd.recipe` each sub-package nothing of those after it in `RECIPE_ORDER`; and no module of `meshkd`
imports, through others, itself (no import circle). Pure tier: the sources are read with `ast`, imports inside
functions included (those under `if TYPE_CHECKING:`, which never run, left out); nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "meshkd"
# package -> the packages it must not import (those below it)
BELOW = {"core": ("meshkd.parallel", "meshkd.recipe"), "parallel": ("meshkd.recipe",)}


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """The import nodes under `if TYPE_CHECKING:` (annotations only: never run)."""
    return {node for block in ast.walk(tree) if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
            for statement in block.body for node in ast.walk(statement)}


def imported_modules(path: Path, *, runtime_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, `from meshkd import recipe` as `meshkd.recipe`;
    `runtime_only` leaves out those under `if TYPE_CHECKING:`."""
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
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
RECIPE_ORDER = ("common", "records", "settings", "corpus", "modeling", "teacher", "student", "lifecycle")


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


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_circles(root: Path) -> list[list[str]]:
    """The import circles among the modules under `root` (strongly connected components of more than one
    module). `from package import module` counts as importing that module, not the package's `__init__`."""
    modules = {module_name(path, root): path for path in root.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        imported = {module for _, module in imported_modules(path, runtime_only=True)}
        # `from a import b` yields both a and a.b: a submodule b stands for the import, not its package
        edges[name] = {module for module in imported if module in modules and module != name
                       and not any(other.startswith(module + ".") for other in imported if other in modules)}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return circles


def test_no_module_imports_itself_through_others():
    assert import_circles(PACKAGE) == []


def test_the_circle_check_sees_a_circle_and_leaves_out_type_checking_imports(tmp_path):
    package = tmp_path / "meshkd"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "inner" / "__init__.py").write_text("")
    (package / "inner" / "a.py").write_text("def f():\n    from meshkd.inner import b\n")
    # b and c would close a circle too, but b imports c for annotations only
    (package / "inner" / "b.py").write_text("from typing import TYPE_CHECKING\nfrom meshkd.inner.a import f\n"
                                            "if TYPE_CHECKING:\n    from meshkd.inner.c import g\n")
    (package / "inner" / "c.py").write_text("from meshkd.inner.b import f\ng = f\n")
    assert import_circles(package) == [["meshkd.inner.a", "meshkd.inner.b"]]
