"""docs/equations.md is the project's copy of the equation catalogue: every ID points to code,
tests and (where written) a lesson. This test keeps that page honest."""
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "equations.md").read_text()
SHARED = ROOT.parent / "shared" / "EQUATIONS.md"

ROW = re.compile(r"^\|\s*([A-Z]\d+)\s*\|(.*)\|\s*$", re.MULTILINE)


def _section(title):
    start = PAGE.index(f"## {title}")
    end = PAGE.find("\n## ", start + 1)
    return PAGE[start:] if end < 0 else PAGE[start:end]


def _rows(text):
    return {m.group(1): [cell.strip() for cell in m.group(2).split("|")] for m in ROW.finditer(text)}


COVERED = _rows(_section("Covered"))
LATER = _rows(_section("Left for later"))


def _ticked(cell):
    return re.findall(r"`([^`]+)`", cell)


def test_every_catalogue_id_is_listed_once():
    assert not set(COVERED) & set(LATER), "an ID is both covered and left for later"
    ids = [m.group(1) for m in ROW.finditer(PAGE)]
    assert len(ids) == len(set(ids)), \
        f"IDs with two rows: {sorted({i for i in ids if ids.count(i) > 1})}"
    if SHARED.exists():
        shared_ids = set(re.findall(r"^\|\s*([A-Z]\d+)\s*\|", SHARED.read_text(), re.MULTILINE))
        missing = shared_ids - set(COVERED) - set(LATER)
        assert not missing, f"catalogue IDs missing from docs/equations.md: {sorted(missing)}"


@pytest.mark.parametrize("eq_id", sorted(COVERED))
def test_covered_id_has_code_and_tests(eq_id):
    _what, code, tests, lesson = COVERED[eq_id][:4]
    names = _ticked(code)
    assert names, f"{eq_id}: no function listed"
    for dotted in names:
        module, _, attr = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), attr), f"{eq_id}: {dotted} does not exist"
    tests_listed = _ticked(tests)
    assert tests_listed, f"{eq_id}: no test listed"
    for ref in tests_listed:
        path, _, name = ref.partition("::")
        source = (ROOT / path).read_text()
        assert re.search(rf"^\s*def {re.escape(name)}\b", source, re.MULTILINE), f"{eq_id}: {ref} not found"
    for ref in _ticked(lesson):
        assert (ROOT / ref).exists(), f"{eq_id}: lesson {ref} not found"
