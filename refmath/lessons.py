"""Verdicts for the exercises in the lessons, and the student copies of the lessons.

A lesson's "your turn" cell asks the student for a few lines of NumPy; the check cell after it
calls one of these functions, which prints a single line about the student's answer:

- ``no answer yet: NAME`` while the answer is still ``...``;
- ``right: NAME``;
- ``almost: NAME: right to the printed precision`` when the answer is the expected value rounded
  to the digits a print showed (the student copied a printed number instead of computing it);
- ``wrong: NAME: ...`` with a diagnosis: the slip it looks like (a known wrong answer the check
  was given, such as a catalogued mistake of :mod:`refmath.mistakes`), the ratio got/expected
  when the answer is a multiple of the expected one, or else the largest error and where it is.

The expected array itself is never printed, so the check does not give the answer away. A check
returns a :class:`Verdict`, true when right, which Jupyter does not display: the cell shows the
verdict line only.

The reference versions of the lessons carry the answers, and the test suite runs them with the
environment variable ``REFMATH_LESSONS_STRICT=1``: an answer that is not right then raises
``AssertionError`` instead of printing, so an answer that drifts from the library fails the tests,
and so does a slip the check could not tell from the right answer.

:func:`student_copy` turns a lesson into its answer-free version (the ``# BEGIN SOLUTION``
regions of :mod:`refmath.solutions` stripped) and :func:`leaked_lines` is the scan that proves
no solution line reached it; ``python -m refmath lessons student --out DIR`` writes every one.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from refmath import solutions

__all__ = ["Verdict", "check_close", "check_true", "catalogued", "strict", "student_copy",
           "leaked_lines", "write_student_copies", "lesson_paths"]

NOT_YET = "no answer yet"


def strict() -> bool:
    """True when wrong answers must raise (``REFMATH_LESSONS_STRICT=1``, set by the test suite)."""
    return os.environ.get("REFMATH_LESSONS_STRICT", "") not in ("", "0")


class Verdict:
    """What one check found: true when the answer is right, with the line it printed.

    A check is the last call of its cell, so Jupyter would display its value after the printed
    line (a stray ``True``/``False``); ``_ipython_display_`` displays nothing, and the cell shows
    the verdict line alone.
    """

    __slots__ = ("ok", "line")

    def __init__(self, ok: bool, line: str):
        self.ok, self.line = bool(ok), line

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"Verdict({self.line!r})"

    def _ipython_display_(self) -> None:
        pass


def _verdict(status: str, name: str, detail: str = "") -> Verdict:
    line = f"{status}: {name}" + (f": {detail}" if detail else "")
    if status != "right" and strict():
        raise AssertionError(line)
    print(line)
    return Verdict(status == "right", line)


def _not_attempted(got: Any) -> bool:
    return got is None or got is Ellipsis


def _unanswered(name: str) -> Verdict:
    return _verdict(NOT_YET, name, "replace the ... with your code")


def _as_array(value: Any) -> np.ndarray:
    return np.asarray(value() if callable(value) else value, dtype=np.float64)


def _within(have: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> bool:
    """Elementwise ``|have - want| <= atol + rtol |want|``, NaN matching NaN, shapes equal."""
    if have.shape != want.shape:
        return False
    nan_want = np.isnan(want)
    if np.any(np.isnan(have) != nan_want):
        return False
    error = np.where(nan_want, 0.0, np.abs(have - want))
    return bool(np.all(error <= atol + rtol * np.abs(np.where(nan_want, 0.0, want))))


# A slip is recognised with at least this relative tolerance: the check's own can be 1e-12, and a
# slip computed another way than the student's (the library with a mistake applied) differs from it
# by rounding.
SLIP_RTOL = 1e-9


def _slip_values(name: str, slips: Mapping[str, Any]) -> list[tuple[str, np.ndarray]]:
    """Each slip's value. For a student, a slip that cannot be computed is not recognised; under
    ``REFMATH_LESSONS_STRICT=1`` it raises, since a broken slip (a catalogued mistake whose line
    has changed, a typo) would otherwise go unnoticed."""
    values = []
    for label, value in slips.items():
        try:
            values.append((label, _as_array(value)))
        except Exception as err:
            if strict():
                raise AssertionError(f"{name}: the slip {label!r} cannot be computed "
                                     f"({type(err).__name__}: {err})") from err
    return values


def _matching_slip(have, values, rtol, atol) -> str | None:
    for label, value in values:
        if _within(have, value, max(rtol, SLIP_RTOL), atol):
            return label
    return None


def _decimals(values: np.ndarray, most: int = 12) -> int | None:
    """The fewest decimals that write every one of ``values`` exactly, or None beyond ``most``."""
    for d in range(most + 1):
        if np.all(np.round(values, d) == values):
            return d
    return None


def _rounded_from(have: np.ndarray, want: np.ndarray) -> int | None:
    """The decimals ``d`` when ``have`` is ``want`` rounded to ``d`` decimals (a copied print).

    Rounding to a single significant digit of a large value is not "the printed precision": the
    rounded answer must agree with ``want`` to 0.5% (4.328 for 4.3281, 0.9 for 0.9000000033).
    """
    if have.shape != want.shape or have.size == 0 or not np.all(np.isfinite(want)):
        return None
    d = _decimals(have)
    if d is None:
        return None
    half_step = 0.5 * 10.0 ** -d * (1 + 1e-9)
    error = np.abs(have - want)
    if np.all(error <= half_step) and np.all(error <= 5e-3 * np.abs(want)):
        return d
    return None


def _ratio(have: np.ndarray, want: np.ndarray) -> float | None:
    """c when ``have = c want`` (to 1e-9 relative) with ``want`` not all zero, else None."""
    if have.shape != want.shape or not np.all(np.isfinite(want)) or not np.any(want):
        return None
    if np.any(have[want == 0] != 0):
        return None
    c = float(np.sum(have * want) / np.sum(want * want))
    if not np.isfinite(c) or c == 0:
        return None
    return c if np.allclose(have, c * want, rtol=1e-9, atol=0) else None


def _ratio_text(c: float, scalar: bool, rtol: float) -> str:
    if math.isclose(c, -1.0, rel_tol=1e-9):
        return "the sign is flipped" + ("" if scalar else " everywhere")
    what = "got/expected" if scalar else "your answer is the expected one times"
    if abs(c - 1) < 5e-3:
        # Three digits would print "1": say how close without handing over the missing digits.
        return f"{what} 1.00, off by less than 0.5%, beyond the tolerance of {rtol:.2g} relative"
    return f"{what} {c:.3g}"


def check_close(name: str, got: Any, expected: Any | Callable[[], Any], *,
                rtol: float = 1e-7, atol: float = 0.0, hint: str = "",
                slips: Mapping[str, Any] | None = None) -> Verdict:
    r"""Print whether ``got`` equals ``expected`` within ``|got - expected| <= atol + rtol |expected|``.

    A wrong answer is diagnosed, most specific first: the first of ``slips`` it equals (within
    ``max(rtol, 1e-9)``) is named; an answer that is ``expected`` rounded to the digits it shows
    gets "right to the printed precision"; an answer that is a multiple of ``expected`` gets the
    ratio (3 significant digits, or "the sign is flipped"); otherwise the largest error, where it
    is, and the tolerance. The expected value is never printed.

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
    slips : mapping of str to array_like or callable, optional
        Typical wrong answers: what the slip is (printed as "looks like: ...") to the value it
        gives, or a callable computing it (see :func:`catalogued`). Under
        ``REFMATH_LESSONS_STRICT=1`` each slip is also fed to the check, which must reject it and
        name it: a slip the check cannot tell from the right answer, or from an earlier slip,
        raises ``AssertionError``.

    Returns
    -------
    Verdict
        True when right. Under ``REFMATH_LESSONS_STRICT=1`` an answer that is not right raises
        AssertionError.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"check_close: name must be a non-empty str, got {name!r}")
    if not (rtol >= 0 and atol >= 0):
        raise ValueError(f"check_close: rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    if slips is not None and not isinstance(slips, Mapping):
        raise TypeError(f"check_close: slips must be a mapping of str to values, got "
                        f"{type(slips).__name__}")
    if _not_attempted(got):
        return _unanswered(name)
    want = _as_array(expected)
    values = _slip_values(name, slips or {})
    if strict():
        _check_slips_are_told_apart(name, want, values, rtol, atol)
    try:
        have = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError) as err:
        return _verdict("wrong", name, f"not an array of real numbers ({err})")
    status, detail = _diagnose(have, want, values, rtol, atol)
    if status != "right" and hint:
        detail += f" ({hint})"
    return _verdict(status, name, detail)


def _diagnose(have, want, values, rtol, atol) -> tuple[str, str]:
    """(status, detail) of ``have`` against ``want``: see :func:`check_close`."""
    if _within(have, want, rtol, atol):
        nan_want = np.isnan(want)
        worst = float(np.where(nan_want, 0.0, np.abs(have - want)).max()) if have.size else 0.0
        return "right", f"max error {worst:.2g}"
    slip = _matching_slip(have, values, rtol, atol)
    if slip is not None:
        return "wrong", f"looks like: {slip}"
    decimals = _rounded_from(have, want)
    if decimals is not None:
        digits = f"{decimals} decimal" + ("" if decimals == 1 else "s")
        return "almost", (f"right to the printed precision ({digits}); keep full "
                          "precision: compute it rather than copy a printed number")
    if have.shape != want.shape:
        return "wrong", f"shape {have.shape}, expected {want.shape}"
    nan_got, nan_want = np.isnan(have), np.isnan(want)
    if np.any(nan_got != nan_want):
        where = np.unravel_index(np.argmax(nan_got != nan_want), have.shape) if have.ndim else ()
        return "wrong", (f"NaN where a number is expected, or the reverse, at index "
                         f"{tuple(int(i) for i in where)}")
    # A scalar off the mark is always a multiple of the expected value: its ratio is the diagnosis.
    c = _ratio(np.where(nan_want, 0.0, have), np.where(nan_want, 0.0, want))
    if c is not None:
        return "wrong", _ratio_text(c, have.size == 1, rtol)
    error = np.where(nan_want, 0.0, np.abs(have - want))
    bound = atol + rtol * np.abs(np.where(nan_want, 0.0, want))
    excess = np.where(error > bound, error - bound, -np.inf)
    index = tuple(int(i) for i in np.unravel_index(np.argmax(excess), have.shape)) if have.ndim else ()
    return "wrong", (f"error {float(error[index]):.3g} at index {index}, tolerance "
                     f"{float(bound[index]):.3g}")


def _check_slips_are_told_apart(name, want, values, rtol, atol) -> None:
    """Feed each slip to the check (strict mode): it must be rejected and named as itself."""
    for label, value in values:
        status, detail = _diagnose(value, want, values, rtol, atol)
        if status == "right":
            raise AssertionError(f"{name}: the slip {label!r} passes as the right answer")
        if detail != f"looks like: {label}":
            raise AssertionError(f"{name}: the slip {label!r} is reported as {detail!r}")


_ABSENT = object()


def check_true(name: str, condition: Any, why: str, *, of: Any = _ABSENT) -> Verdict:
    """Print a verdict on a property of the student's answer (a shape, a sign, a sum).

    ``why`` says what the property is, and is printed with a wrong verdict. With ``of=answer``,
    ``condition`` is a function of the answer, called only once the answer is written (``...`` or
    ``None`` gives "no answer yet"); without it, ``condition`` is the property's value, ``...`` or
    ``None`` meaning not written yet. A condition that raises on the answer is a wrong verdict that
    names the error.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"check_true: name must be a non-empty str, got {name!r}")
    if of is not _ABSENT:
        if not callable(condition):
            raise TypeError(f"check_true: with of=..., condition must be a function of the answer, "
                            f"got {type(condition).__name__}")
        if _not_attempted(of):
            return _unanswered(name)
        try:
            condition = condition(of)
        except Exception as err:  # the answer has the wrong kind or shape for the property
            return _verdict("wrong", name, f"{why} (checking your answer raised "
                                           f"{type(err).__name__}: {err})")
    if _not_attempted(condition):
        return _unanswered(name)
    ok = bool(condition)
    return _verdict("right" if ok else "wrong", name, "" if ok else why)


def catalogued(mistake: str, compute: Callable[[], Any]) -> dict[str, Callable[[], Any]]:
    """A slip for :func:`check_close` from :mod:`refmath.mistakes`: ``compute()`` (a call of the
    library function the mistake edits) evaluated with the mistake applied, under the label
    ``"<mistake name> (<why>)"``. Raises ``ValueError`` for a name the catalogue lacks."""
    try:
        from refmath.mistakes import MISTAKES, applied
    except ImportError as err:  # the assignments' student copies of refmath leave the catalogue out
        raise ValueError("catalogued: refmath.mistakes is not part of this copy of refmath") from err

    found = [m for m in MISTAKES if m.name == mistake]
    if not found:
        raise ValueError(f"catalogued: no mistake named {mistake!r} in refmath.mistakes")
    if not callable(compute):
        raise TypeError(f"catalogued: compute must be callable, got {type(compute).__name__}")

    def with_the_mistake():
        with applied(found[0]):
            return compute()

    return {f"{found[0].name} ({found[0].why})": with_the_mistake}


# ---- the student copies ----------------------------------------------------------------------------

# As in the assignments' leak check: a solution line shorter than this ("else:", "return dx") says
# nothing and occurs everywhere; one at least SHORTEST_QUOTED long also leaks inside a longer line.
SHORTEST_SECRET = 10
SHORTEST_QUOTED = 20

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def lesson_paths(root: str | os.PathLike | None = None) -> list[Path]:
    """The lessons (``NN_name.py`` py:percent scripts) of ``root`` (default: the checkout's
    ``notebooks/``), in order. Raises ``ValueError`` when ``root`` holds none."""
    folder = Path(root) if root is not None else NOTEBOOKS
    paths = sorted(folder.glob("[0-9][0-9]_*.py"))
    if not paths:
        raise ValueError(f"no lesson (NN_name.py) in {folder}")
    return paths


def student_copy(text: str, where: str = "<lesson>") -> str:
    """The answer-free version of a lesson: every ``# BEGIN SOLUTION`` region of an exercise cell
    replaced by ``# your code here`` (the ``answer = ...`` lines before it stay, so its check says
    "no answer yet"), and every Markdown answer by a prompt line (:func:`refmath.solutions.strip_notebook`)."""
    return solutions.strip_notebook(text, where)


def leaked_lines(instructor: str, student: str, where: str = "<lesson>") -> list[str]:
    """The lines of ``student`` that are, or quote, a line of one of ``instructor``'s solution
    regions, compared normalised: empty when nothing leaks. Each entry is ``"where:line: text"``.

    As in the assignments' leak check (``refmath.assignments.build``), a solution line counts only
    when it gives something away: at least 10 characters long, and not a line the lesson shows
    outside its regions anyway (``with open(path, "rb") as f:`` taught before an exercise, or a
    function that restates the answer after its check); a line of 20 characters or more also
    leaks when quoted inside a longer line, unless the lesson's own text quotes it too.
    """
    regions = solutions.find_regions(instructor, where)
    inside = {n for r in regions for n in range(r.begin, r.end + 1)}
    public = {solutions.normalise(line) for n, line in enumerate(instructor.splitlines())
              if n not in inside}
    public_text = "\n".join(public)
    secrets = {line for line in solutions.region_lines(instructor, regions)
               if len(line) >= SHORTEST_SECRET} - public
    quoted = [s for s in secrets if len(s) >= SHORTEST_QUOTED and s not in public_text]
    found = []
    for number, line in enumerate(student.splitlines(), 1):
        flat = solutions.normalise(line)
        if flat in secrets or any(s in flat for s in quoted):
            found.append(f"{where}:{number}: {line.strip()}")
    return found


def write_student_copies(out: str | os.PathLike, lessons: list[Path] | None = None) -> list[Path]:
    """Write the student copy of each lesson (default: all of them) into ``out`` under the same
    name, after the leak scan: if any solution line would reach a copy, raise ``ValueError`` listing
    them and write nothing. ``out`` is created if needed; a file there, or the lessons' own folder,
    is refused with ``ValueError``."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {str(folder)!r} is a file, not a folder")
    sources = lessons if lessons is not None else lesson_paths()
    if folder.exists() and any(path.parent.resolve() == folder.resolve() for path in sources):
        # The copies would replace the lessons they are made from, answers and all.
        raise ValueError(f"--out {str(folder)!r} is the folder of the instructor lessons; "
                         "write the student copies elsewhere")
    copies, leaks = {}, []
    for path in sources:
        text = path.read_text(encoding="utf-8")
        copies[path.name] = copy = student_copy(text, str(path))
        leaks += leaked_lines(text, copy, path.name)
    if leaks:
        raise ValueError(f"{len(leaks)} solution line(s) would reach the student copies; nothing "
                         "was written:\n  " + "\n  ".join(leaks[:20]))
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, copy in copies.items():
        (folder / name).write_text(copy, encoding="utf-8")
        written.append(folder / name)
    return written
