"""The verdict on a value a student computed: one line, right, almost or wrong, with the slip
it looks like.

A check prints a single line about the student's answer:

- ``no answer yet: NAME`` while the answer is still ``...``;
- ``right: NAME``;
- ``almost: NAME: right to N decimals only`` when the answer is the expected value rounded to
  the digits it shows (a number copied from a print, rounded by hand, or read off a coarse grid);
- ``wrong: NAME: ...`` with a diagnosis: the slip it looks like (a known wrong answer the check
  was given, such as a catalogued mistake of :mod:`refmath.mistakes`), the factor when the
  answer is the expected one times a factor that names a slip (2, 1/8, sqrt(64)), only how much
  too large or too small (between 1.5x and 2x) when it is another multiple, or else the largest
  error and where it is.

The expected array itself is never printed, so the check does not give the answer away. A check
returns a :class:`Verdict`, true when right, which Jupyter does not display: the cell shows the
verdict line only.

The reference versions of the lessons carry the answers, and the test suite runs them with the
environment variable ``REFMATH_LESSONS_STRICT=1``: an answer that is not right then raises
``AssertionError`` instead of printing, so an answer that drifts from the library fails the tests,
and so does a slip the check could not tell from the right answer.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, Mapping

import numpy as np

from refmath.lessons.leaks import record_expected

__all__ = ["Verdict", "check_close", "check_true", "catalogued", "strict"]


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


# How many times each check has said "wrong" in this kernel: a hint is rationed. The first miss
# gets the diagnosis (the slip's name) and, where the check knows it, the section to reread; the
# hint itself, often the formula, only from the second miss on, or on request (:func:`hint`).
_MISSES: dict[str, int] = {}


def _rationed(name: str, hint: str, section: str = "") -> str:
    """The words a wrong verdict adds after its diagnosis: see :data:`_MISSES`."""
    _MISSES[name] = _MISSES.get(name, 0) + 1
    if not hint:
        return f" (reread {section})" if section else ""
    if _MISSES[name] == 1:
        where = f"reread {section}; " if section else ""
        return f" ({where}a second try that misses shows a hint)"
    return f" ({hint})"


def _as_array(value: Any) -> np.ndarray:
    return np.asarray(value() if callable(value) else value, dtype=np.float64)


def _errors(have: np.ndarray, want: np.ndarray) -> np.ndarray:
    """``|have - want|``, 0 where both are NaN or both the same infinity (an empty state's
    ``m = -inf``: ``-inf - (-inf)`` would be NaN)."""
    with np.errstate(invalid="ignore"):
        return np.where(np.isnan(want) | (have == want), 0.0, np.abs(have - want))


def _within(have: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> bool:
    """Elementwise ``|have - want| <= atol + rtol |want|``, NaN matching NaN, shapes equal."""
    if have.shape != want.shape:
        return False
    nan_want = np.isnan(want)
    if np.any(np.isnan(have) != nan_want):
        return False
    scale = np.abs(np.where(nan_want | np.isinf(want), 0.0, want))
    return bool(np.all(_errors(have, want) <= atol + rtol * scale))


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

    Every entry must be within half a step of ``d`` decimals of ``want``, and the rounding must
    have kept enough of ``want`` to be a print's and not a guess's. Either every entry agrees with
    ``want`` to 0.5% (4.328 for 4.3281, 0.9 for 0.9000000033), or the print shows at least two
    decimals and at least two significant digits of the largest entry: a step of ``10^-d`` no
    more than a tenth of ``max |want|`` (0.0012 for 0.00118, printed with 4 decimals, is 1.7% off
    but its step is 1e-4; [0.5123, 0.0012] for [0.51234, 0.00118] too). Rounding to one
    significant digit (0.6 for 0.605) or to a whole number (2 heads for 2.25) is not "the printed
    precision", and gets the diagnosis a wrong answer gets. The verdict is "almost" either way,
    never "right": the rule only chooses between two ways of saying wrong.
    """
    if have.shape != want.shape or have.size == 0 or not np.all(np.isfinite(want)):
        return None
    d = _decimals(have)
    if d is None:
        return None
    step = 10.0 ** -d
    error = np.abs(have - want)
    if not np.all(error <= 0.5 * step * (1 + 1e-9)):
        return None
    if np.all(error <= 5e-3 * np.abs(want)):
        return d
    if d >= 2 and step <= 0.1 * float(np.max(np.abs(want))) * (1 + 1e-9):
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


# A ratio that names a slip: an exact small fraction (a forgotten 1/2, a mean for a sum over n) or
# the square root of a width (a forgotten 1/sqrt(d_k)). Only these are printed exactly: they
# teach (the factor says which constant went missing), and a student who has made the slip
# learns nothing from them that rereading the step would not give.
_LARGEST_FACTOR = 4096
_SMALL_FRACTIONS = 16

# Any other ratio is only placed between two of these (and their reciprocals, for an answer too
# small): "too large by between 1.5x and 2x". The ratio itself, to a digit or more, would hand
# over the expected value: got divided by it.
_LADDER = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 100.0, 1e3, 1e4, 1e6, 1e9, math.inf)


def _named_factor(c: float) -> str | None:
    """``c`` written as the factor of a slip ("2", "1/8", "3/2", "sqrt(8)", "1/sqrt(8)") when it
    is one exactly (to 1e-9 relative), else None."""
    size = abs(c)
    for value, text in ((size, ""), (1 / size, "1/")):
        k = round(value)
        if 2 <= k <= _LARGEST_FACTOR and math.isclose(value, k, rel_tol=1e-9):
            return f"{text}{k}"
        k2 = round(value * value)
        root = math.isqrt(k2)
        if 2 <= k2 <= _LARGEST_FACTOR and root * root != k2 and math.isclose(value * value, k2, rel_tol=1e-9):
            return f"{text}sqrt({k2})"
    for q in range(2, _SMALL_FRACTIONS + 1):
        p = round(size * q)
        if p >= 1 and math.gcd(p, q) == 1 and p != q and p <= _SMALL_FRACTIONS * q \
                and math.isclose(size, p / q, rel_tol=1e-9):
            return f"{p}/{q}"
    return None


def _bracket(size: float, rtol: float) -> tuple[float, float]:
    """The rungs around ``size`` >= 1 of :data:`_LADDER` thinned for the tolerance.

    No single guess lies within ``rtol`` of two expected values whose ratio exceeds
    ``(1 + rtol) / (1 - rtol)``; a rung is kept only when it is more than the square of that (with
    a margin) above the last one kept, and above ``1 + rtol`` (closer to 1 the answer would be
    right), so that whatever ``size`` is in its bracket, the bracket also admits an expected value
    that no guess shares with the true one. The rungs depend on ``rtol`` only, never on ``size``:
    two answers in one bracket get one line."""
    floor = 1.0 + rtol
    spread = ((1.0 + rtol) / (1.0 - rtol)) ** 2.5 if rtol < 1 else math.inf
    rungs = [1.0]
    for rung in _LADDER[1:]:
        if rung == math.inf or rung / max(rungs[-1], floor) >= spread:
            rungs.append(rung)
    low = max(r for r in rungs if r <= size)
    return low, min(r for r in rungs if r > size)


def _ratio_text(c: float, scalar: bool, rtol: float) -> str:
    """The diagnosis of an answer that is ``c`` times the expected one: the sign, the factor when
    it names a slip (:func:`_named_factor`), else only a bracket (:func:`_bracket`) from which the
    expected value cannot be recovered to the tolerance."""
    if math.isclose(c, -1.0, rel_tol=1e-9):
        return "the sign is flipped" + ("" if scalar else " everywhere")
    sign = "the sign flipped and " if c < 0 else ""
    factor = _named_factor(c)
    if factor is not None:
        what = "your answer is" if scalar else "your answer is the expected one"
        return f"{sign}{what} {factor} times the expected value" if scalar else \
            f"{sign}{what} times {factor}"
    size = abs(c)
    larger = size > 1
    low, high = _bracket(size if larger else 1 / size, rtol)
    way = "too large" if larger else "too small"
    if low == 1.0:
        beyond = "" if sign else f", beyond the tolerance of {rtol:.2g} relative"
        return f"{sign}{way} by less than a factor {high:g}{beyond}"
    if high == math.inf:
        return f"{sign}{way} by more than a factor {low:g}"
    return f"{sign}{way} by a factor between {low:g} and {high:g}"


def check_close(name: str, got: Any, expected: Any | Callable[[], Any], *,
                rtol: float = 1e-7, atol: float = 0.0, hint: str = "",
                slips: Mapping[str, Any] | None = None, section: str = "",
                where: Callable[[tuple[int, ...]], str] | None = None) -> Verdict:
    r"""Print whether ``got`` equals ``expected`` within ``|got - expected| <= atol + rtol |expected|``.

    A wrong answer is diagnosed, most specific first: the first of ``slips`` it equals (within
    ``max(rtol, 1e-9)``) is named; an answer that is ``expected`` rounded to the digits it shows
    gets "right to N decimals only"; one that is a slip so rounded gets the slip's name and "rounded
    as well, to N decimals"; an answer that is ``c`` times ``expected`` gets "the
    sign is flipped" (c = -1), the factor itself when it names a slip (an integer or its
    reciprocal up to 4096, the square root of one, or p/q with q <= 16: a forgotten 1/2, sqrt(d_k),
    1/n), and otherwise only a bracket ("too large by a factor between 1.5 and 2"), wide enough
    that no value in it recovers ``expected`` to the tolerance (got / c would hand it over);
    otherwise the largest error, where it is, and the tolerance. The expected value is never
    printed.

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
        Where to look, often the formula: printed after the second wrong verdict of this check
        and later ones, not the first (see :func:`hint` to ask for it).
    slips : mapping of str to array_like or callable, optional
        Typical wrong answers: what the slip is (printed as "looks like: ...") to the value it
        gives, or a callable computing it (see :func:`catalogued`). Under
        ``REFMATH_LESSONS_STRICT=1`` each slip is also fed to the check, which must reject it and
        name it: a slip the check cannot tell from the right answer, or from an earlier slip,
        raises ``AssertionError``.

    section : str
        The lesson's section to reread, named after a first wrong verdict.
    where : callable, optional
        ``where(index)`` names the element at ``index`` of ``got`` where the index alone would not
        say what it is (a set of parameters compared as one flat vector: "w_q[3, 5]"); the
        verdict then says "at w_q[3, 5]" instead of "at index (1234,)".

    Returns
    -------
    refmath.lessons.checks.Verdict
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
    record_expected(name, expected)
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
    status, detail = _diagnose(have, want, values, rtol, atol, where)
    if status != "right":
        detail += _rationed(name, hint, section)
    return _verdict(status, name, detail)


def _diagnose(have, want, values, rtol, atol, where=None) -> tuple[str, str]:
    """(status, detail) of ``have`` against ``want``: see :func:`check_close`."""
    def at(index):
        return f"at {where(index)}" if where is not None else f"at index {index}"

    if _within(have, want, rtol, atol):
        worst = float(_errors(have, want).max()) if have.size else 0.0
        return "right", f"max error {worst:.2g}"
    slip = _matching_slip(have, values, rtol, atol)
    if slip is not None:
        return "wrong", f"looks like: {slip}"
    decimals = _rounded_from(have, want)
    if decimals is not None:
        digits = f"{decimals} decimal" + ("" if decimals == 1 else "s")
        # where those digits came from is the student's to say: a print, a rounding by hand, a
        # grid; the verdict says only that the rest of the digits are missing
        return "almost", (f"right to {digits} only; keep full precision: compute it, do not "
                          "round it, copy it from a print or read it off a coarse grid")
    # a slip, and rounded as well (a count given in billions, copied as 33.33): the slip is what
    # to fix first, so it is named, with the rounding after it
    for label, value in values:
        decimals = _rounded_from(have, value)
        if decimals is not None:
            digits = f"{decimals} decimal" + ("" if decimals == 1 else "s")
            return "wrong", f"looks like: {label}; rounded as well, to {digits}"
    if have.shape != want.shape:
        return "wrong", f"shape {have.shape}, expected {want.shape}"
    nan_got, nan_want = np.isnan(have), np.isnan(want)
    if np.any(nan_got != nan_want):
        first = np.unravel_index(np.argmax(nan_got != nan_want), have.shape) if have.ndim else ()
        return "wrong", (f"NaN where a number is expected, or the reverse, "
                         f"{at(tuple(int(i) for i in first))}")
    # A scalar off the mark is always a multiple of the expected value: its ratio is the diagnosis.
    c = _ratio(np.where(nan_want, 0.0, have), np.where(nan_want, 0.0, want))
    if c is not None:
        return "wrong", _ratio_text(c, have.size == 1, rtol)
    error = _errors(have, want)
    bound = atol + rtol * np.abs(np.where(nan_want | np.isinf(want), 0.0, want))
    excess = np.where(error > bound, error - bound, -np.inf)
    index = tuple(int(i) for i in np.unravel_index(np.argmax(excess), have.shape)) if have.ndim else ()
    return "wrong", (f"error {float(error[index]):.3g} {at(index)}, tolerance "
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


def catalogued(mistake: str, compute: Callable[..., Any]) -> dict[str, Callable[..., Any]]:
    """A slip from :mod:`refmath.mistakes`, under the label ``"<mistake name> (<why>)"``: a
    function that calls ``compute`` with the mistake applied, passing its arguments on.

    For :func:`check_close`, ``compute`` takes no argument (a call of the library function the
    mistake edits: ``lambda: layernorm_backward(dy, cache)[0]``) and the slip is its value; for
    :func:`check_function`, ``compute`` is the library function itself (``layernorm_backward``)
    and the slip is the wrong function, evaluated on the inputs the student's is. Raises
    ``ValueError`` for a name the catalogue lacks."""
    try:
        from refmath.mistakes import MISTAKES, applied
    except ImportError as err:  # the assignments' student copies of refmath leave the catalogue out
        raise ValueError("catalogued: refmath.mistakes is not part of this copy of refmath") from err

    found = [m for m in MISTAKES if m.name == mistake]
    if not found:
        raise ValueError(f"catalogued: no mistake named {mistake!r} in refmath.mistakes")
    if not callable(compute):
        raise TypeError(f"catalogued: compute must be callable, got {type(compute).__name__}")

    def with_the_mistake(*args, **kwargs):
        with applied(found[0]):
            return compute(*args, **kwargs)

    return {f"{found[0].name} ({found[0].why})": with_the_mistake}
