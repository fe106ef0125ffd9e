"""The package's floors (docs/layout.md): no import goes up a floor, none comes back round.

Every ``import`` statement of refmath/ counts, the ones inside functions too: a deferred import
still makes the lower module depend on the upper one.
"""
import ast
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs" / "layout.md"


def floors() -> dict[str, int]:
    """``{module pattern: floor}`` from the table of docs/layout.md."""
    table = {}
    for line in LAYOUT.read_text(encoding="utf-8").splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|(.*?)\|", line)
        if row:
            for pattern in re.findall(r"`([\w.*]+)`", row.group(2)):
                table[pattern] = int(row.group(1))
    return table


def modules() -> dict[str, Path]:
    """Every module of refmath/ by its dotted name (a package by its own name)."""
    found = {}
    for path in sorted((ROOT / "refmath").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def floor_of(module: str, table: dict[str, int]) -> int | None:
    exact = table.get(module)
    if exact is not None:
        return exact
    for pattern, floor in table.items():
        if pattern.endswith("*") and (module == pattern[:-1] or
                                      fnmatch.fnmatch(module, pattern[:-1] + ".*")):
            return floor
    return None


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The refmath modules that ``name`` imports, each statement resolved to a module of ``known``
    (``from refmath import kernels`` is ``refmath.kernels``; ``from refmath.x import f`` is
    ``refmath.x``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                     for alias in node.names]
        else:
            continue
        for target in names:
            while target and target not in known:  # refmath.x.f -> refmath.x
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("refmath"):
                targets.add(target)
    return targets


KNOWN = modules()
TABLE = floors()
GRAPH = {name: imports(name, path, KNOWN) for name, path in KNOWN.items()}


def test_the_table_is_read():
    assert set(TABLE.values()) == set(range(7)), TABLE
    assert floor_of("refmath.fast.fused", TABLE) == 2
    assert floor_of("refmath.models.decoder", TABLE) == 3
    assert floor_of("refmath.inference.kv_cache", TABLE) == 4
    assert floor_of("refmath.modelsx", TABLE) is None  # a package pattern is not a prefix


def test_every_module_has_a_floor():
    homeless = [name for name in KNOWN if floor_of(name, TABLE) is None]
    assert not homeless, f"modules on no floor of docs/layout.md: {homeless}"


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_no_import_goes_up_a_floor(name):
    own = floor_of(name, TABLE)
    upward = sorted(f"{target} (floor {floor_of(target, TABLE)})" for target in GRAPH[name]
                    if (floor_of(target, TABLE) or 0) > (own or 0))
    assert not upward, f"{name} (floor {own}) imports {upward}"


def test_no_import_cycle():
    # Tarjan's strongly connected components: any component of more than one module is a cycle
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checks_see_a_deferred_import(tmp_path):
    # an import inside a function counts as much as one at the top
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from refmath.hf import read_config\n    return read_config\n")
    assert imports("refmath.sizing", source, KNOWN) == {"refmath.hf"}


def test_no_model_is_named_outside_the_models():
    # A table of models outside refmath/models/ shows up as a model's name in code: every other
    # module reads refmath.models.MODELS (docstrings may name them)
    from refmath.models import MODELS

    named = []
    for module, path in KNOWN.items():
        if module == "refmath.models" or module.startswith("refmath.models."):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                           ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        named += [f"{module}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in MODELS
                  and id(node) not in docstrings]
    assert not named, f"model names in code outside refmath/models/: {named}"
