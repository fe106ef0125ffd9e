"""Puts tests/ on ``sys.path``, so that test files in its subfolders (models/, inference/) import
the shared helpers as ``import _support`` too, whatever the import mode and wherever the tests run
(a checkout or an unpacked sdist); and defines the fixtures that the lesson tests share."""
import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import _support  # noqa: E402  (importable only once tests/ is on the path)


@pytest.fixture
def fresh_misses(monkeypatch):
    """The lesson checks as a student's first run meets them: no miss counted yet (a hint is
    rationed by the misses of the kernel, which would otherwise carry over from earlier tests),
    and a wrong answer printed rather than raised. Both are undone after the test."""
    import refmath.lessons.checks

    monkeypatch.setattr(refmath.lessons.checks, "_MISSES", {})
    monkeypatch.setenv("REFMATH_LESSONS_STRICT", "0")


@pytest.fixture
def said(fresh_misses, monkeypatch):
    """``said(number, answer, inputs=None, strict=False)``: the verdict line of
    ``check(number, answer)`` from a namespace holding ``inputs``; ``strict=True`` sets
    ``REFMATH_LESSONS_STRICT=1`` (a wrong answer raises, and a function exercise's check also feeds
    it each slip) through ``monkeypatch``, so the setting ends with the test."""
    def said(number, answer, inputs=None, strict=False):
        monkeypatch.setenv("REFMATH_LESSONS_STRICT", "1" if strict else "0")
        return _support.verdict_line(number, answer, inputs)

    return said
