"""``__all__`` says what a module offers: every name it lists exists, none twice, and every public
module has one (the API pages document what it lists, and nothing else)."""
import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "refmath"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def declared_all(path: Path):
    """The literal ``__all__`` of a module's top level, or None."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def defined_names(path: Path) -> list[str]:
    """The names a module binds at its top level by ``def``, ``class`` or assignment, dunders such
    as ``__version__`` left out (a package's docstring alone defines nothing)."""
    names = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in names if not (n.startswith("__") and n.endswith("__"))]


def public_module(path: Path) -> bool:
    """No part of its dotted name below ``refmath`` starts with ``_`` (a package's ``__init__``
    stands for the package)."""
    parts = module_name(path).split(".")[1:]
    return not any(part.startswith("_") for part in parts)


WITH_ALL = sorted(p for p in PACKAGE.rglob("*.py") if declared_all(p) is not None)


def test_modules_with_all_are_found():
    assert len(WITH_ALL) >= 20, [module_name(p) for p in WITH_ALL]


@pytest.mark.parametrize("path", WITH_ALL, ids=module_name)
def test_all_lists_only_names_that_exist(path):
    names = declared_all(path)
    assert all(isinstance(n, str) for n in names), names
    assert len(names) == len(set(names)), f"{module_name(path)}: a name listed twice"
    module = importlib.import_module(module_name(path))
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{module_name(path)}.__all__ lists names it does not have: {missing}"


def test_every_public_module_declares_all():
    lacking = [module_name(p) for p in sorted(PACKAGE.rglob("*.py"))
               if public_module(p) and defined_names(p) and declared_all(p) is None]
    assert not lacking, f"these define names but no __all__: {lacking}"


def test_a_module_that_defines_only_dunders_needs_no_all(tmp_path):
    version_only = tmp_path / "m.py"
    version_only.write_text('"""A package."""\n__version__ = "1"\n')
    assert defined_names(version_only) == []
    version_only.write_text('__version__ = "1"\nTABLE = {}\n')
    assert defined_names(version_only) == ["TABLE"]
