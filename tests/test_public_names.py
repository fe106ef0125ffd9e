"""``__all__`` says what a module offers: every name it lists exists, none twice, and every public
module of the models and of inference has one (the API pages document what it lists)."""
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


def defines_names(path: Path) -> bool:
    """Whether a module defines anything at its top level (a package's docstring alone does not)."""
    return any(isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign))
               for node in ast.parse(path.read_text(encoding="utf-8")).body)


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


@pytest.mark.parametrize("folder", ["models", "inference"])
def test_every_public_module_of_the_models_and_inference_declares_all(folder):
    lacking = [module_name(p) for p in sorted((PACKAGE / folder).glob("*.py"))
               if not p.name.startswith("_") or p.name == "__init__.py"
               if defines_names(p) and declared_all(p) is None]
    assert not lacking, f"these define public names but no __all__: {lacking}"
