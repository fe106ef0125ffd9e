"""Verdicts for the exercises in the lessons, and the student copies of the lessons.

A lesson's "your turn" cell asks the student for a few lines of NumPy, or a whole function; the
check cell after it makes one call that prints a single line about the answer (``right``,
``almost``, ``wrong`` with the slip it looks like, or ``no answer yet``) and never the expected
value. The parts, one file each:

- :mod:`~refmath.lessons.checks`: the verdict on a value (:func:`check_close`,
  :func:`check_true`), the diagnosis of a wrong one, the rationed hints, and the slips taken from
  the catalogue of mistakes (:func:`catalogued`);
- :mod:`~refmath.lessons.functions`: the verdict on a whole function the student wrote
  (:func:`check_function`: against the library, central differences and torch), over the inputs
  of :mod:`~refmath.lessons.trials`;
- :mod:`~refmath.lessons.library_refusal`: the library refused as an answer (a function that is,
  wraps or calls the reference is told to write it itself);
- :mod:`~refmath.lessons.table` and :mod:`~refmath.lessons.exercises`: the numbered exercises,
  ``check("05.3", answer)``, whose expected values and slips :mod:`refmath.lessons.expected`
  computes, one file per lesson;
- :mod:`~refmath.lessons.student`: the answer-free copies of the lessons, shipped as package
  data, and ``python -m refmath lessons student --out DIR``;
- :mod:`~refmath.lessons.leaks`: the scans that prove a copy gives no answer away.

The reference versions of the lessons carry the answers, and the test suite runs them with
``REFMATH_LESSONS_STRICT=1``: an answer that is not right then raises ``AssertionError``.
"""
# The names the lessons, the command line and the tests use, by their short names. The class
# Verdict stays in refmath.lessons.checks only, so that it is documented, and cross-referenced, once.
from refmath.lessons.checks import Verdict, catalogued, check_close, check_true, strict  # noqa: F401
from refmath.lessons.exercises import check, hint
from refmath.lessons.functions import check_function
from refmath.lessons.leaks import RECORD, RECORD_MARK, leaked_lines
from refmath.lessons.student import (lesson_paths, packaged_copies, refresh_packaged_copies,
                                     student_copy, write_student_copies)

__all__ = ["check", "hint", "check_close", "check_true", "check_function", "catalogued", "strict",
           "packaged_copies", "refresh_packaged_copies", "student_copy", "leaked_lines",
           "write_student_copies", "lesson_paths", "RECORD", "RECORD_MARK"]
