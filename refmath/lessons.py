"""Verdicts for the exercises in the lessons.

A lesson's "your turn" cell asks the student for a few lines of NumPy; the check cell after it
calls one of these functions, which prints a single line: right, or wrong and why (the shapes that
differ, the largest error and where it is, against the tolerance). The expected array itself is
never printed, so the check does not give the answer away.

The reference versions of the lessons carry the answers, and the test suite runs them with the
environment variable ``REFMATH_LESSONS_STRICT=1``: a wrong answer then raises ``AssertionError``
instead of printing, so an answer that drifts from the library fails the tests.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

__all__ = ["check_close", "check_true", "strict"]


def strict() -> bool:
    """True when wrong answers must raise (``REFMATH_LESSONS_STRICT=1``, set by the test suite)."""
    return os.environ.get("REFMATH_LESSONS_STRICT", "") not in ("", "0")


def _verdict(name: str, ok: bool, detail: str) -> bool:
    line = f"{'right' if ok else 'wrong'}: {name}" + (f": {detail}" if detail else "")
    if not ok and strict():
        raise AssertionError(line)
    print(line)
    return ok


def _not_attempted(got: Any) -> bool:
    return got is None or got is Ellipsis


def check_close(name: str, got: Any, expected: Any | Callable[[], Any], *,
                rtol: float = 1e-7, atol: float = 0.0, hint: str = "") -> bool:
    r"""Print whether ``got`` equals ``expected`` within ``|got - expected| <= atol + rtol |expected|``.

    Parameters
    ----------
    name : str
        What the student computed, as the verdict should name it ("dX", "the softmax row").
    got : array_like, or ``...``/``None`` for an answer not written yet
        The student's value.
    expected : array_like, or a callable returning it
        The value to compare with; a callable is called only when ``got`` is there, so a check cell
        can name a computation that would fail on an unfinished exercise.
    rtol, atol : float
        The tolerance, elementwise, in the form of :func:`numpy.isclose`.
    hint : str
        Printed after a wrong verdict: where to look.

    Returns
    -------
    bool
        True when right. Under ``REFMATH_LESSONS_STRICT=1`` a wrong answer raises AssertionError.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"check_close: name must be a non-empty str, got {name!r}")
    if not (rtol >= 0 and atol >= 0):
        raise ValueError(f"check_close: rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    if _not_attempted(got):
        return _verdict(name, False, "no answer yet (replace the ... with your code)")
    want = np.asarray(expected() if callable(expected) else expected, dtype=np.float64)
    try:
        have = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError) as err:
        return _verdict(name, False, f"not an array of real numbers ({err})")
    suffix = f" ({hint})" if hint else ""
    if have.shape != want.shape:
        return _verdict(name, False, f"shape {have.shape}, expected {want.shape}{suffix}")
    nan_got, nan_want = np.isnan(have), np.isnan(want)
    if np.any(nan_got != nan_want):
        where = np.unravel_index(np.argmax(nan_got != nan_want), have.shape) if have.ndim else ()
        return _verdict(name, False, f"NaN where a number is expected, or the reverse, at index "
                                     f"{tuple(int(i) for i in where)}{suffix}")
    error = np.where(nan_want, 0.0, np.abs(have - want))
    bound = atol + rtol * np.abs(np.where(nan_want, 0.0, want))
    if have.size == 0 or np.all(error <= bound):
        worst = float(error.max()) if have.size else 0.0
        return _verdict(name, True, f"max error {worst:.2g}")
    excess = np.where(error > bound, error - bound, -np.inf)
    where = np.unravel_index(np.argmax(excess), have.shape) if have.ndim else ()
    index = tuple(int(i) for i in where)
    return _verdict(name, False, f"error {float(error[index]):.3g} at index {index}, tolerance "
                                 f"{float(bound[index]):.3g}{suffix}")


def check_true(name: str, condition: Any, why: str) -> bool:
    """Print a verdict on a property (a shape, a sign, a sum) rather than a value.

    ``why`` says what the property is, and is printed with a wrong verdict; ``condition`` of
    ``...`` or ``None`` means the exercise is not written yet.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"check_true: name must be a non-empty str, got {name!r}")
    if _not_attempted(condition):
        return _verdict(name, False, "no answer yet (replace the ... with your code)")
    ok = bool(condition)
    return _verdict(name, ok, "" if ok else why)
