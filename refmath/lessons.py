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

A write-the-function exercise asks for a whole forward or backward function instead, and
:func:`check_function` judges the student's code: a backward against central differences of the
forward (:func:`refmath.gradcheck.check_case` on the registry's cases, with the student's function
as the backward), every function against the library's own on the same inputs and, where torch is
importable, against torch; a wrong function is diagnosed by the known slips' functions it matches
(the catalogued mistakes of :mod:`refmath.mistakes` among them).

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
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from refmath import solutions

__all__ = ["Verdict", "check", "hint", "check_close", "check_true", "check_function", "catalogued",
           "strict", "packaged_copies", "refresh_packaged_copies",
           "student_copy", "leaked_lines", "write_student_copies", "lesson_paths"]

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


# ---- what the student could see before an exercise (the test suite's scan) -------------------------

RECORD = "REFMATH_LESSONS_RECORD"
RECORD_MARK = "\x1erefmath-check "


def _record_expected(name: str, expected: Any) -> None:
    """Under ``REFMATH_LESSONS_RECORD=FILE`` (set by the test that scans the student copies), add
    the check's expected value to FILE as a JSON line, with the line of the lesson that called the
    check, and print a marker so that the scan knows what was printed before it. Nothing happens
    otherwise: a student never sees either."""
    path = os.environ.get(RECORD, "")
    if not path:
        return
    import json
    import sys

    frame, line = sys._getframe(1), None
    while frame is not None:  # the first frame outside refmath: the lesson's own line
        if not frame.f_globals.get("__name__", "").startswith("refmath"):
            line = frame.f_lineno
            break
        frame = frame.f_back
    try:
        value = _as_array(expected).ravel().tolist()
    except Exception:  # a value the unanswered copy cannot compute yet: nothing to look for
        value = None
    sys.stdout.flush()
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps({"name": name, "line": line, "value": value}) + "\n")
    print(f"{RECORD_MARK}{name}", flush=True)


def check_close(name: str, got: Any, expected: Any | Callable[[], Any], *,
                rtol: float = 1e-7, atol: float = 0.0, hint: str = "",
                slips: Mapping[str, Any] | None = None, section: str = "") -> Verdict:
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
    _record_expected(name, expected)
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
    if status != "right":
        detail += _rationed(name, hint, section)
    return _verdict(status, name, detail)


def _diagnose(have, want, values, rtol, atol) -> tuple[str, str]:
    """(status, detail) of ``have`` against ``want``: see :func:`check_close`."""
    if _within(have, want, rtol, atol):
        worst = float(_errors(have, want).max()) if have.size else 0.0
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
    error = _errors(have, want)
    bound = atol + rtol * np.abs(np.where(nan_want | np.isinf(want), 0.0, want))
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


# ---- write-the-function exercises ------------------------------------------------------------------

class _Trial(NamedTuple):
    """One set of arguments a function exercise is called with."""

    label: str  # where, for the verdict: a registry case's name, or "input 2"
    args: tuple
    kwargs: dict
    case: Any = None  # the registry's OpCase (a backward exercise)
    seed: int = 0
    inputs: dict | None = None  # the case's forward inputs (for the torch oracle)
    dout: np.ndarray | None = None


class _Failed(Exception):
    """A function of the exercise could not be evaluated on a trial; the message says why."""


def _unwritten(value: Any) -> bool:
    """The stub of a lesson's function returns its ``answer = ...`` names unchanged: ``...``, or a
    tuple or dict holding one."""
    if value is None or value is Ellipsis:
        return True
    parts = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return any(part is Ellipsis for part in parts)


def _output_names(value: Any, names) -> tuple[str, ...]:
    """The names of a reference function's outputs: a named tuple's fields, a dict's keys, else
    ``names`` (the check's ``outputs``) or their positions."""
    if names is not None:
        return tuple(names)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return tuple(value._fields)
    if isinstance(value, dict):
        return tuple(value)
    if isinstance(value, (tuple, list)):
        return tuple(f"output {i}" for i in range(len(value)))
    return ("the output",)


def _outputs(value: Any, names: tuple[str, ...], trial: _Trial) -> list[np.ndarray]:
    """``value`` as float64 arrays in the order of ``names``; raises :class:`_Failed` when its
    kind or count does not fit."""
    if trial.case is not None:
        try:
            value = list(trial.case.grads_by_name(value).values())
        except (ValueError, KeyError, TypeError) as err:
            raise _Failed(f"returns the wrong gradients: {err}; expected {', '.join(names)}") from err
    elif isinstance(value, dict):
        missing = [n for n in names if n not in value]
        if missing:
            raise _Failed(f"returns no output named {missing[0]!r} (expected {', '.join(names)})")
        value = [value[n] for n in names]
    elif isinstance(value, (tuple, list)):
        if len(value) != len(names):
            raise _Failed(f"returns {len(value)} values, expected {len(names)} ({', '.join(names)})")
    else:
        if len(names) != 1:
            raise _Failed(f"returns one value, expected {len(names)} ({', '.join(names)})")
        value = [value]
    arrays = []
    for name, part in zip(names, value):
        try:
            arrays.append(np.asarray(part, dtype=np.float64))
        except (TypeError, ValueError) as err:
            raise _Failed(f"{name} is not an array of real numbers ({err})") from err
    return arrays


def _call(func: Callable, trial: _Trial) -> Any:
    """``func`` on a private copy of the trial's arguments (a function that updates its arguments
    in place must not change what the next function sees)."""
    import copy

    return func(*copy.deepcopy(trial.args), **copy.deepcopy(trial.kwargs))


def _evaluate(func: Callable, trials: list[_Trial], names) -> list[list[np.ndarray]]:
    results = []
    for trial in trials:
        try:
            value = _call(func, trial)
        except _Failed:
            raise
        except Exception as err:
            raise _Failed(f"raised {type(err).__name__}: {err} (on {trial.label})") from err
        if _unwritten(value):
            raise _Failed(f"returns ... (on {trial.label}): some of its answers are not written yet")
        results.append(_outputs(value, names, trial))
    return results


def _atols(want: list[list[np.ndarray]], rtol: float, atol: float | None) -> list[float]:
    """The absolute tolerance of each output: ``atol``, or by default ``rtol`` times the output's
    largest entry over every trial (an entry near 0 that a sum of larger terms cancels to is
    rounded to the size of those terms, not to its own; a case where an output is 0 throughout,
    LayerNorm's dx at d = 1, is rounded to the size it has elsewhere)."""
    if atol is not None:
        return [atol] * len(want[0])
    scales = [0.0] * len(want[0])
    for outputs in want:
        for j, w in enumerate(outputs):
            finite = np.abs(w[np.isfinite(w)])
            scales[j] = max(scales[j], float(finite.max(initial=0.0)))
    return [rtol * s for s in scales]


def _same(have, want, rtol, atol) -> bool:
    tols = _atols(want, rtol, atol)
    return all(_within(h, w, rtol, tol) for hs, ws in zip(have, want)
               for h, w, tol in zip(hs, ws, tols))


def _first_difference(have, want, names, trials, rtol, atol) -> str | None:
    """Where ``have`` first differs from ``want``, diagnosed as :func:`check_close` does."""
    tols = _atols(want, rtol, atol)
    for trial, hs, ws in zip(trials, have, want):
        for name, h, w, tol in zip(names, hs, ws, tols):
            if not _within(h, w, rtol, tol):
                return f"{name} on {trial.label}: {_diagnose(h, w, [], rtol, tol)[1]}"
    return None


def _trials_of_cases(cases, seeds) -> list[_Trial]:
    """One trial per case and seed, drawn as :func:`refmath.gradcheck.check_case` draws them: the
    case's inputs, then the upstream gradient; the backward is called on ``(dout, cache)``."""
    trials = []
    for case in cases:
        for seed in seeds:
            rng = np.random.default_rng(seed)
            inputs = case.make_inputs(rng)
            for name in case.wrt:
                inputs[name] = np.ascontiguousarray(inputs[name], dtype=np.float64)
            out, cache = case.forward(**inputs)
            dout = rng.standard_normal(np.shape(out))
            label = case.name if len(seeds) == 1 else f"{case.name}, seed {seed}"
            trials.append(_Trial(label, (dout, cache), {}, case, seed, inputs, dout))
    return trials


def _resolve_cases(case) -> list:
    import fnmatch

    from refmath.gradcheck import all_cases
    from refmath.registry import OpCase

    wanted = [case] if isinstance(case, (str, OpCase)) else list(case)
    found = []
    for item in wanted:
        if isinstance(item, OpCase):
            found.append(item)
            continue
        if not isinstance(item, str):
            raise TypeError(f"check_function: case must be an OpCase or a glob over registry case "
                            f"names, got {type(item).__name__}")
        # a case's name holds brackets ("layernorm[rows (3, 8)]"): they are literal, only * and ?
        # are wildcards
        pattern = item.replace("[", "[[]")
        matches = [c for c in all_cases(group=None) if fnmatch.fnmatchcase(c.name, pattern)]
        if not matches or not all(isinstance(c, OpCase) for c in matches):
            raise ValueError(f"check_function: {item!r} matches no op case of the registry "
                             "(python -m refmath gradcheck --list names them)")
        found += matches
    return found


def _gradient_checks(func, trials, max_coords) -> list[tuple[str, Any]]:
    """``refmath.gradcheck.check_case`` of each trial's case with ``func`` as its backward:
    ``(case name, CheckResult)``, once per case and seed."""
    import dataclasses

    from refmath.gradcheck import check_case

    results = []
    for trial in trials:
        case = dataclasses.replace(trial.case, backward=func)
        try:
            results.append((trial.label, check_case(case, seed=trial.seed, max_coords=max_coords)))
        except Exception as err:  # it ran on the trial; a perturbed input can still break it
            results.append((trial.label, f"raised {type(err).__name__}: {err}"))
    return results


def _gradient_check_text(label: str, result) -> str:
    if isinstance(result, str):
        return f"the gradient check on {label} {result}"
    if result.problem:
        return f"the gradient check fails on {label}: {result.problem}"
    return (f"the gradient check fails on {label}: d{result.worst} has relative error "
            f"{result.errors[result.worst]:.2g}, bound {result.bound:.2g}")


def _torch_expected(oracle, trials, names):
    """The torch oracle's outputs on every trial, or a note saying why there are none. For a
    backward exercise ``oracle`` is a torch function of the case's inputs, and the expected
    gradients are its vector-Jacobian product with the trial's ``dout`` (``torch.autograd``);
    otherwise ``oracle`` takes the exercise's arguments and returns the expected value itself."""
    if trials[0].case is None:
        try:
            return [_outputs(_call(oracle, trial), names, trial) for trial in trials], ""
        except ImportError:
            return None, "torch is not installed: its check is skipped"
    try:
        import torch
    except ImportError:
        return None, "torch is not installed: its check is skipped"
    expected = []
    for trial in trials:
        tensors = {}
        for key, value in trial.inputs.items():
            if key in trial.case.wrt:
                tensors[key] = torch.tensor(value, dtype=torch.float64, requires_grad=True)
            elif isinstance(value, np.ndarray):
                tensors[key] = torch.from_numpy(value.copy())
            else:
                tensors[key] = value
        out = oracle(**tensors)
        finite = torch.isfinite(out.detach())
        # entries that are not finite (-inf at masked logits) are constants: no gradient from them
        upstream = torch.where(finite, torch.from_numpy(trial.dout), torch.zeros((), dtype=out.dtype))
        grads = torch.autograd.grad(torch.where(finite, out, 0.0), [tensors[k] for k in trial.case.wrt],
                                    upstream, allow_unused=True)
        expected.append([np.zeros(trial.inputs[k].shape) if g is None else g.numpy()
                         for k, g in zip(trial.case.wrt, grads)])
    return expected, ""


# ---- the library refused as an answer ----------------------------------------------------------------

def _code_of(func: Any):
    """The code object a callable runs (a function, a bound method, a partial's function), or None."""
    import functools

    while isinstance(func, functools.partial):
        func = func.func
    func = getattr(func, "__func__", func)
    return getattr(func, "__code__", None)


def _library_module(frame) -> str | None:
    """The refmath module a frame runs in, or None outside refmath (the checks themselves, in
    refmath.lessons, count as outside: they call the functions being compared)."""
    module = frame.f_globals.get("__name__", "")
    if (module == "refmath" or module.startswith("refmath.")) and module != __name__:
        return module
    return None


def _qualified(code, module: str) -> str:
    return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"


class _CallTrace:
    """While active (a ``with`` block), records the Python functions called whose code is in
    ``watched`` (``sys.setprofile``: one look-up per call, so the student's function runs at
    nearly its own speed); with ``watched=None``, records instead every refmath function entered
    from outside refmath (the library functions a computation is made of)."""

    def __init__(self, watched: dict | None):
        self.watched, self.found = watched, {}

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if self.watched is not None:
            if code in self.watched and code not in self.found:
                self.found[code] = self.watched[code]
            return
        module = _library_module(frame)
        # a constructor (AdamW(...)) is not what an exercise asks for: the method called next is
        if module is not None and code not in self.found and code.co_name != "__init__" and (
                frame.f_back is None or _library_module(frame.f_back) is None):
            self.found[code] = _qualified(code, module)

    def __enter__(self):
        import sys

        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        import sys

        sys.setprofile(self._previous)
        return False


def _answer_functions(reference: Callable, trial) -> dict:
    """The library functions whose result the exercise asks for: ``reference`` itself when it is a
    refmath function, else the refmath functions it enters from outside refmath on ``trial``
    (a lesson's own reference, ``lambda ...: AdamW(...).step(...)``, names AdamW's ``step``),
    as code object -> ``refmath.module.name``."""
    code = _code_of(reference)
    module = getattr(reference, "__module__", "") or ""
    if code is not None and module.startswith("refmath.") and module != __name__:
        return {code: f"{module}.{getattr(code, 'co_qualname', code.co_name)}"}
    with _CallTrace(None) as trace:
        try:
            _call(reference, trial)
        except Exception:
            pass  # the reference's own failure is reported where it is evaluated
    return trace.found


def library_used(func: Callable, reference: Callable, trial, also: tuple = (),
                 allowed: tuple = ()) -> str | None:
    """How the student's ``func`` uses the library function the exercise asks for (see
    :func:`_answer_functions`; ``also`` adds more library functions, ``allowed`` takes some
    away) in place of writing it:
    ``"is refmath.softmax.softmax_backward"``, ``"wraps ..."`` or ``"calls ..."``; None when it
    writes the computation itself. ``func`` is called once on ``trial`` under a call trace."""
    answers = _answer_functions(reference, trial)
    own = _code_of(reference)
    if own is not None and own not in answers:  # a lesson's own reference, copied or called
        answers[own] = (f"the check's reference, {getattr(reference, '__module__', '?')}."
                        f"{getattr(own, 'co_qualname', own.co_name)}")
    for extra in also:
        code = _code_of(extra)
        if code is not None:
            answers[code] = (f"{getattr(extra, '__module__', '?')}."
                             f"{getattr(code, 'co_qualname', code.co_name)}")
    for permitted in allowed:
        answers.pop(_code_of(permitted), None)
    if not answers:
        return None
    wrapped, seen = func, set()
    while wrapped is not None and id(wrapped) not in seen:  # functools.wraps chains, partials
        seen.add(id(wrapped))
        if _code_of(wrapped) in answers:
            return ("is " if wrapped is func else "wraps ") + answers[_code_of(wrapped)]
        wrapped = getattr(wrapped, "__wrapped__", None)
    with _CallTrace(answers) as trace:
        try:
            _call(func, trial)
        except Exception:
            pass  # a failing function is diagnosed by the check itself
    found = sorted(trace.found.values(), key=lambda name: name.startswith("the check's"))
    return "calls " + found[0] if found else None  # the library's name first, if it was reached


def check_function(name: str, func: Any, reference: Callable, *, case: Any = None,
                   inputs: Any = None, seeds: tuple[int, ...] = (0,), outputs=None,
                   slips: Mapping[str, Callable] | None = None, oracle: Callable | None = None,
                   oracle_name: str = "torch", reference_name: str | None = None,
                   rtol: float = 1e-10, atol: float | None = None, max_coords: int | None = 128,
                   hint: str = "", refuse: tuple = (), allow: tuple = ()) -> Verdict:
    r"""Print whether the student's function ``func`` computes what ``reference`` does.

    The write-the-function exercise: the student writes a whole forward or backward function, and
    this check judges the code itself, on inputs of its own choosing, three ways:

    - **a backward** (``case=``): each registered :class:`refmath.registry.OpCase` that ``case``
      names is run with the student's function as its backward, through
      :func:`refmath.gradcheck.check_case` (a vector-Jacobian check against central differences
      of the case's forward, in float64, with the derived bound); the student's gradients are also
      compared with ``reference``'s (the library's backward) on the same ``(dout, cache)``, and,
      where torch is importable, with torch autograd of ``oracle`` (a torch function of the case's
      inputs, by name);
    - **a forward function** (``inputs=``): the student's function and ``reference`` are called on
      each argument tuple (or dict of keyword arguments) of ``inputs``, and their outputs
      compared; ``oracle``, when given, is an independent function of the same arguments (torch's
      optimiser step, say) whose outputs must agree as well; an ``ImportError`` from it (torch is
      not installed) skips it.

    Every function is called on a private copy of the arguments. The verdict is

    - ``no answer yet`` while the function raises ``NotImplementedError``, or returns ``...``
      (the lesson's stub: ``dx = ...`` and ``return dx``), or any of its outputs is ``...``;
    - ``right`` when the gradient check passes and the outputs agree with the reference (and
      torch) within ``|got - want| <= atol + rtol |want|``, output by output, NaN matching NaN;
    - ``wrong`` otherwise, diagnosed: the first of ``slips`` whose function the student's matches
      on every input (``looks like: ...``), else the first output that differs and how
      (:func:`check_close`'s diagnosis: a ratio, a flipped sign, the largest error and where), and
      the failing gradient check; or the exception the function raised and on which input.

    Before any of this, the library is refused as an answer: a function that is the reference
    (``my_backward = softmax_backward``), wraps it, or calls it, or calls the refmath functions a
    lesson's own reference is made of, gets ``wrong: ...: this calls refmath.softmax.
    softmax_backward: write it yourself``. The student's function runs once under
    ``sys.setprofile``, which sees every Python call it makes, however the call is spelled.

    The expected values are never printed.

    Parameters
    ----------
    name : str
        What the student wrote, as the verdict names it ("your LayerNorm backward").
    func : callable, or ``...``/``None`` while not written
        The student's function.
    reference : callable
        The library's function with the same signature: for a backward,
        ``reference(dout, cache)`` returns the gradients of the case's ``wrt`` inputs.
    case : str, OpCase or a list of them
        Registry cases whose backward the student's function replaces: the cases themselves, or
        patterns over their names in which ``*`` and ``?`` are wildcards (``"layernorm[rows*"``;
        brackets are literal). Exactly one of ``case`` and ``inputs``.
    inputs : list of tuples or dicts, or a callable returning one
        The arguments of a forward exercise; a callable is called only once the function is
        written.
    seeds : tuple of int
        The seeds of each case's inputs and upstream gradient (a backward exercise).
    outputs : sequence of str, optional
        Names of the outputs of a function returning a plain tuple (a named tuple names its own).
    slips : mapping of str to callable, optional
        Typical wrong functions with the signature of ``reference``, by what the slip is: a
        function written with the slip, or :func:`catalogued` of a mistake of
        :mod:`refmath.mistakes` and the library function it edits. Under
        ``REFMATH_LESSONS_STRICT=1`` each must be rejected and named as itself.
    oracle : callable, optional
        The independent oracle (see above).
    oracle_name : str
        What the verdict calls the oracle of a forward exercise ("torch.optim.AdamW").
    reference_name : str, optional
        What the verdict calls the reference (default: ``refmath's <its __name__>``).
    rtol, atol : float
        The tolerance; ``atol=None`` is ``rtol`` times the largest entry of each expected output
        over all the inputs.
    max_coords : int or None
        The coordinates sampled per input by the gradient check.
    hint : str
        Printed after a wrong verdict: where to look.
    refuse : tuple of callables
        More library functions the student's may not call (a forward whose backward is asked).
    allow : tuple of callables
        Library functions a lesson's own reference calls that the student's may call too (the
        softmax inside an attention whose layout is the exercise).

    Returns
    -------
    Verdict
        True when right. Under ``REFMATH_LESSONS_STRICT=1`` a verdict that is not right raises
        AssertionError.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"check_function: name must be a non-empty str, got {name!r}")
    if not callable(reference):
        raise TypeError(f"check_function: reference must be callable, got {type(reference).__name__}")
    if (case is None) == (inputs is None):
        raise ValueError("check_function: give exactly one of case= (a backward) and inputs= "
                         "(the arguments of a forward function)")
    if not (rtol >= 0 and (atol is None or atol >= 0)):
        raise ValueError(f"check_function: rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    if slips is not None and not (isinstance(slips, Mapping) and all(map(callable, slips.values()))):
        raise TypeError("check_function: slips must be a mapping of str to functions")
    if _not_attempted(func):
        return _unanswered(name)
    if not callable(func):
        return _verdict("wrong", name, f"not a function but a {type(func).__name__}")

    if case is not None:
        cases = _resolve_cases(case)
        trials = _trials_of_cases(cases, tuple(seeds))
        names = tuple(f"d{w}" for w in cases[0].wrt)
    else:
        given = inputs() if callable(inputs) else inputs
        trials = [_Trial(f"input {i + 1}", tuple(a), {}) if isinstance(a, (tuple, list))
                  else _Trial(f"input {i + 1}", (), dict(a)) for i, a in enumerate(given)]
        if not trials:
            raise ValueError("check_function: inputs is empty")
        names = _output_names(_call(reference, trials[0]), outputs)

    try:
        unwritten = _unwritten(_call(func, trials[0]))
    except NotImplementedError:
        unwritten = True
    except Exception:
        unwritten = False  # reported below, with the input it failed on
    if unwritten:
        return _verdict(NOT_YET, name, "write the body of the function (it still returns ...)")
    used = library_used(func, reference, trials[0], tuple(refuse), tuple(allow))
    if used is not None:
        return _verdict("wrong", name, f"this {used}: write it yourself")
    try:
        have = _evaluate(func, trials, names)
    except _Failed as failure:
        return _verdict("wrong", name, f"your function {failure}" + _rationed(name, hint))

    want = _evaluate(reference, trials, names)
    slip_values = []
    for label, slip in (slips or {}).items():
        try:
            slip_values.append((label, _evaluate(slip, trials, names)))
        except _Failed as failure:
            if strict():
                raise AssertionError(f"{name}: the slip {label!r} cannot be computed ({failure})")
    if strict():
        for label, value in slip_values:
            if _same(value, want, rtol, atol):
                raise AssertionError(f"{name}: the slip {label!r} passes as the right function")
            first = next(lab for lab, v in slip_values if _same(value, v, max(rtol, SLIP_RTOL), atol))
            if first != label:
                raise AssertionError(f"{name}: the slip {label!r} is reported as {first!r}")

    checks = _gradient_checks(func, trials, max_coords) if case is not None else []
    failed_checks = [(label, r) for label, r in checks if isinstance(r, str) or not r.passed]
    torch_note, torch_difference = "", None
    if oracle is not None:
        from_torch, torch_note = _torch_expected(oracle, trials, names)
        if from_torch is not None:
            torch_difference = _first_difference(have, from_torch, names, trials, rtol, atol)
    difference = _first_difference(have, want, names, trials, rtol, atol)

    if difference is None and torch_difference is None and not failed_checks:
        said = []
        if checks:
            worst = max((r for _, r in checks), key=lambda r: r.max_error / max(r.bound, 1e-300))
            said.append(f"passes the gradient check on {len(checks)} case"
                        f"{'s' if len(checks) > 1 else ''} (largest error {worst.max_error:.1g}, "
                        f"bound {worst.bound:.1g})")
        against = reference_name or f"refmath's {getattr(reference, '__name__', 'reference')}"
        if oracle is not None and not torch_note:
            against += " and torch autograd" if case is not None else f" and {oracle_name}"
        said.append(f"agrees with {against} on {len(trials)} input{'s' if len(trials) > 1 else ''}")
        if torch_note:
            said.append(torch_note)
        return _verdict("right", name, "; ".join(said))

    slip = next((label for label, value in slip_values
                 if _same(have, value, max(rtol, SLIP_RTOL), atol)), None)
    said = [f"looks like: {slip}"] if slip is not None else []
    if slip is None and difference is not None:
        said.append(difference)
    if failed_checks:
        said.append(_gradient_check_text(*failed_checks[0]))
    if slip is None and difference is None and torch_difference is not None:
        said.append(f"against {'torch' if case is not None else oracle_name}, {torch_difference}")
    detail = "; ".join(said) + _rationed(name, hint)
    return _verdict("wrong", name, detail)


# ---- the student copies ----------------------------------------------------------------------------

# As in the assignments' leak check: a solution line shorter than this ("else:", "return dx") says
# nothing and occurs everywhere; one at least SHORTEST_QUOTED long also leaks inside a longer line.
SHORTEST_SECRET = 10
SHORTEST_QUOTED = 20

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# The student copies shipped inside the package, so that an installed refmath (a wheel, with no
# checkout and so no answers nearby) can write them: NN_name.py.txt (.txt: data, not a module
# of refmath), refreshed from notebooks/ by refresh_packaged_copies() and kept equal to it by
# the tests.
PACKAGED = Path(__file__).resolve().parent / "student_lessons"
PACKAGED_SUFFIX = ".txt"


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


def packaged_copies() -> dict[str, str]:
    """The student copies shipped with the package, by lesson file name (``01_attention.py``):
    empty when this copy of refmath has none."""
    if not PACKAGED.is_dir():
        return {}
    return {path.name[:-len(PACKAGED_SUFFIX)]: path.read_text(encoding="utf-8")
            for path in sorted(PACKAGED.glob(f"[0-9][0-9]_*.py{PACKAGED_SUFFIX}"))}


def refresh_packaged_copies(lessons: list[Path] | None = None) -> list[Path]:
    """Rewrite the packaged student copies from the instructor lessons (default: the checkout's
    ``notebooks/``), after the leak scan; a packaged copy of a lesson that is gone is removed.
    Run after editing a lesson: ``python -c "import refmath.lessons as l;
    l.refresh_packaged_copies()"``."""
    sources = lessons if lessons is not None else lesson_paths()
    copies = _student_copies(sources)
    PACKAGED.mkdir(exist_ok=True)
    for stale in PACKAGED.glob(f"*{PACKAGED_SUFFIX}"):
        if stale.name[:-len(PACKAGED_SUFFIX)] not in copies:
            stale.unlink()
    written = []
    for name, copy in copies.items():
        target = PACKAGED / (name + PACKAGED_SUFFIX)
        target.write_text(copy, encoding="utf-8")
        written.append(target)
    return written


def _student_copies(sources: list[Path]) -> dict[str, str]:
    """Each lesson's student copy by file name, after the leak scan (``ValueError`` listing the
    leaked lines when any would reach a copy)."""
    copies, leaks = {}, []
    for path in sources:
        text = path.read_text(encoding="utf-8")
        copies[path.name] = copy = student_copy(text, str(path))
        leaks += leaked_lines(text, copy, path.name)
    if leaks:
        raise ValueError(f"{len(leaks)} solution line(s) would reach the student copies; nothing "
                         "was written:\n  " + "\n  ".join(leaks[:20]))
    return copies


def write_student_copies(out: str | os.PathLike, lessons: list[Path] | None = None, *,
                         force: bool = False) -> list[Path]:
    """Write the student copy of each lesson into ``out`` under the same name. With ``lessons``
    (instructor lessons, answers inside), the copies are made from them after the leak scan: if
    any solution line would reach a copy, raise ``ValueError`` listing them and write nothing.
    Without, the copies are the ones shipped in the package (:func:`packaged_copies`): an
    installed refmath needs no checkout, and no answer is anywhere near the student. ``out`` is created if needed; a file there, or the lessons' own folder,
    is refused with ``ValueError``, and so is a folder that holds anything already unless ``force``
    (a student's edited lessons would be overwritten)."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {str(folder)!r} is a file, not a folder")
    sources = lessons if lessons is not None else []
    instructors = {path.parent.resolve() for path in sources} | (
        {NOTEBOOKS.resolve()} if NOTEBOOKS.is_dir() else set())
    if folder.exists() and folder.resolve() in instructors:
        # The copies would replace the lessons they are made from, answers and all.
        raise ValueError(f"--out {str(folder)!r} is the folder of the instructor lessons; "
                         "write the student copies elsewhere")
    if folder.is_dir() and not force and any(folder.iterdir()):
        raise ValueError(f"--out {str(folder)!r} is not empty: the copies would overwrite what is "
                         "there (a student's answers among it); give an empty or new folder, or "
                         "--force to overwrite")
    if lessons is not None:
        copies = _student_copies(sources)
    else:
        copies = packaged_copies()
        if not copies:
            raise ValueError("this copy of refmath ships no student lessons; give the instructor "
                             "lessons with --from DIR")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, copy in copies.items():
        (folder / name).write_text(copy, encoding="utf-8")
        written.append(folder / name)
    return written


# ---- the lessons' exercises, by number -------------------------------------------------------------
#
# A lesson's check cell is one call, ``check("05.3", answer)``: the expected value, the known slips
# and the hint live here, computed from the library, so that nothing in the lesson (not the check
# cell's source on the student site, not a variable, not a print) holds the answer before the
# student has tried. An exercise computes from the lesson's own inputs, read by name from the
# namespace that calls the check (``uses``), so the numbers the student sees are the numbers
# checked, and the lesson stays the one place they are written.


class Exercise(NamedTuple):
    """One value exercise of a lesson."""

    name: str  # what the verdict calls the answer
    section: str  # the lesson's section to reread after a first miss
    hint: str  # the formula or the step, given from the second miss on, or by hint()
    expected: Callable[..., Any]  # the expected value from the lesson's inputs (``uses``)
    slips: Callable[..., Mapping[str, Any]]  # the known wrong answers, from the same inputs
    uses: tuple[str, ...] = ()  # the lesson's variables the two functions take, by name
    rtol: float = 1e-12
    atol: float = 0.0
    prepare: Callable[[Any], Any] | None = None  # the answer as an array (a dict of weights...)


EXERCISES: dict[str, Exercise] = {}


def _exercise(number: str, name: str, section: str, hint: str, uses: tuple[str, ...] = (),
              rtol: float = 1e-12, atol: float = 0.0, prepare: Callable[[Any], Any] | None = None):
    """Register the decorated ``(*uses) -> (expected, slips)`` function as exercise ``number``."""
    def register(both: Callable[..., tuple[Any, Mapping[str, Any]]]):
        EXERCISES[number] = Exercise(name, section, hint, lambda *a: both(*a)[0],
                                     lambda *a: both(*a)[1], uses, rtol, atol, prepare)
        return both
    return register


def _exercise_of(number: str) -> Exercise:
    if number not in EXERCISES:
        raise ValueError(f"no exercise numbered {number!r} (known: {', '.join(sorted(EXERCISES))})")
    return EXERCISES[number]


def check(number: str, answer: Any) -> Verdict:
    """Print the verdict on the student's ``answer`` to exercise ``number`` ("05.3").

    The expected value is computed here, from the library and the lesson's inputs (read by name
    from the caller's namespace); a wrong answer is diagnosed as :func:`check_close` does, with the
    section to reread after a first miss and the hint from the second on."""
    import sys

    exercise, caller = _exercise_of(number), sys._getframe(1)
    if _not_attempted(answer):
        _record_expected(exercise.name, lambda: _expected_and_slips(exercise, caller)[0])
        return _unanswered(exercise.name)
    expected, slips = _expected_and_slips(exercise, caller)
    if exercise.prepare is not None:
        try:
            answer = exercise.prepare(answer)
        except Exception as err:  # the answer has the wrong kind: say so, as check_close would
            return _verdict("wrong", exercise.name, f"not what the exercise asks for "
                            f"({type(err).__name__}: {err})")
    return check_close(exercise.name, answer, expected, rtol=exercise.rtol, atol=exercise.atol,
                       hint=exercise.hint, section=exercise.section, slips=slips)


def _expected_and_slips(exercise: Exercise, frame) -> tuple[Any, Mapping[str, Any]]:
    names = {**frame.f_builtins, **frame.f_globals, **frame.f_locals}
    missing = [n for n in exercise.uses if n not in names]
    if missing:
        raise NameError(f"{exercise.name}: the check reads the lesson's {', '.join(missing)}; "
                        "run the lesson's cells above it first")
    inputs = [names[n] for n in exercise.uses]
    return exercise.expected(*inputs), exercise.slips(*inputs)


def hint(number: str) -> None:
    """Print the hint of exercise ``number`` now, without a second miss."""
    exercise = _exercise_of(number)
    print(f"hint: {exercise.name}: {exercise.hint} (see {exercise.section})")


# ---- lesson 5: the loss and the optimiser

_L2 = "the section 'L2, L3: cross-entropy and its gradient'"
_L5 = "the section 'L5: the fine-tuning loss'"
_O1 = "the section 'O1, O2: Adam and its bias correction'"
_O4 = "the section 'O3, O4, O7: weight decay inside Adam or beside it'"
_O6 = "the section 'O6: learning-rate schedules'"


@_exercise("05.1", "dloss/dlogits", _L2, "p - onehot(target), divided by the number of positions",
           uses=("logits", "targets"))
def _cross_entropy_gradient(logits, targets):
    from refmath.losses import cross_entropy_backward, cross_entropy_forward
    from refmath.softmax import softmax_forward

    _, cache = cross_entropy_forward(logits, targets)
    mean = cross_entropy_backward(1.0, cache)
    n = np.size(targets)
    return mean, {
        "not divided by the number of positions (the sum's gradient, not the mean's)": n * mean,
        "the one-hot target forgotten: p / T": softmax_forward(logits)[0] / n,
        "the sign flipped: y - p": -mean}


def _sft(logits, targets, mask, reduction):
    from refmath.losses import cross_entropy_forward

    return cross_entropy_forward(logits, targets, loss_mask=mask, reduction=reduction)


@_exercise("05.2", "the summed SFT loss", _L5,
           "only the answer positions count, and nothing divides the sum",
           uses=("sft_logits", "sft_targets", "answer_mask"))
def _sft_sum(logits, targets, mask):
    from refmath.losses import cross_entropy_forward

    total = _sft(logits, targets, mask, "sum")[0]
    return total, {
        "the mean over the answer tokens, not the sum": _sft(logits, targets, mask, "mean")[0],
        "the prompt positions counted too": cross_entropy_forward(logits, targets, reduction="sum")[0],
        "the sign flipped: the sum of log p, not of -log p": -total}


@_exercise("05.3", "the last row of dlogits (sum)", _L5,
           "p - y, with no division: the sum does not divide by the number of tokens",
           uses=("sft_logits", "sft_targets", "answer_mask"))
def _sft_last_row(logits, targets, mask):
    from refmath.losses import cross_entropy_backward

    row = cross_entropy_backward(1.0, _sft(logits, targets, mask, "sum")[1])[-1]
    mean_row = cross_entropy_backward(1.0, _sft(logits, targets, mask, "mean")[1])[-1]
    return row, {"divided by the answer tokens: that is the mean's gradient": mean_row,
                 "the sign flipped: y - p": -row}


def _adam_first_step(eps: float = 1e-8, **options):
    from refmath.optim import Adam

    w = {"w": np.array([1.0, -2.0])}
    Adam(lr=0.1, eps=eps, **options).step(w, {"w": np.array([0.3, -0.1])})
    return w["w"]


@_exercise("05.5", "theta after one Adam step", _O1,
           "m_hat = g and v_hat = g^2 after one step, so the step is lr g / (|g| + eps)")
def _adam_step():
    plain = np.array([1.0, -2.0]) - 0.1 * np.array([0.3, -0.1])
    return _adam_first_step(), {
        **catalogued("adam: bias correction missing", _adam_first_step),
        # theta - lr sign(g) = (0.9, -1.9) would otherwise read as "a printed number copied"
        "eps left out of the denominator: lr g / |g| is not quite lr g / (|g| + eps)":
            np.array([1.0, -2.0]) - 0.1 * np.sign([0.3, -0.1]),
        "a plain gradient step, theta - lr g": plain}


@_exercise("05.6", "v_hat after two steps", _O1,
           "v_2 = beta2 (1 - beta2) g_1^2 + (1 - beta2) g_2^2, then divide by 1 - beta2^2")
def _adam_second_moment():
    from refmath.optim import Adam

    adam, w = Adam(lr=0.1), {"w": np.array([1.0])}
    for g in (0.3, 0.5):
        adam.step(w, {"w": np.array([g])})
    m_hat, v_hat = (float(x[0]) for x in adam.corrected_moments("w"))
    raw = v_hat * (1 - 0.999**2)
    return v_hat, {
        "a centred variance, v_hat - m_hat^2: v is the raw second moment, nothing subtracts m":
            v_hat - m_hat**2,
        "the variance of the two gradients: v weighs g^2 and never subtracts the mean":
            float(np.var([0.3, 0.5])),
        "v_2 without its bias correction 1 - beta2^2": raw}


ADAMW_STEPS = 200


def _adamw_path(steps: int, optimiser=None):
    from refmath.optim import AdamW

    # decay_of: by default AdamW decays matrices only, and this weight is a vector
    optimiser = optimiser or AdamW(lr=0.1, weight_decay=0.1, decay_of=lambda name: 0.1)
    p, path = {"w": np.array([1.0])}, [1.0]
    for _ in range(steps):
        optimiser.step(p, {"w": np.array([0.0])})
        path.append(float(p["w"][0]))
    return np.array(path)


@_exercise("05.7", f"AdamW's weight after {ADAMW_STEPS} steps", _O4,
           "each step multiplies by (1 - lr * weight_decay); m_hat stays 0")
def _adamw_after():
    path = _adamw_path(ADAMW_STEPS)
    return path[-1], {
        "(1 - lr lambda)^(n - 1): one step too few": path[-2],
        **catalogued("adamw: decay not scaled by the learning rate",
                     lambda: _adamw_path(ADAMW_STEPS)[-1]),
        **catalogued("adamw: decay also inside the moments", lambda: _adamw_path(ADAMW_STEPS)[-1])}


@_exercise("05.8", "(peak, half-way rate)", _O6,
           "at s = w both branches equal d^-1/2 w^-1/2; cos(pi/2) = 0")
def _schedule_values():
    from refmath.optim import transformer_schedule, warmup_cosine

    peak = transformer_schedule(4000, d_model=512, warmup=4000)
    return (peak, warmup_cosine(11000, max_lr=3e-4, warmup=2000, total=20000, min_lr=3e-5)), {
        **catalogued("warmup-cosine: progress measured over the whole run", lambda: (
            peak, warmup_cosine(11000, max_lr=3e-4, warmup=2000, total=20000, min_lr=3e-5))),
        "the floor forgotten: half of max_lr, not half-way from min_lr to max_lr":
            (peak, 0.5 * 3e-4)}


# ---- lesson 6: the encoder-decoder

@_exercise("06.3", "tensor2tensor target", "the section 'L4: label smoothing, three conventions'",
           "1 - eps on the right token y, eps / (V - 1) on each of the others",
           uses=("z", "y"))
def _tensor2tensor_target(z, y):
    from refmath.losses import cross_entropy_backward, cross_entropy_forward
    from refmath.softmax import softmax_forward

    vocab, eps = np.shape(z)[-1], 0.1
    target = np.full(vocab, eps / (vocab - 1))
    target[int(y[0])] = 1 - eps
    # refmath's own target for the same eps: q = p - dloss/dlogits (the gradient is p - q)
    ours = softmax_forward(z)[0] - cross_entropy_backward(1.0, cross_entropy_forward(
        z, y, label_smoothing=eps)[1])
    return target, {"refmath's target for eps = 0.1, eps / V on every token: tensor2tensor puts "
                    "eps / (V - 1) on the others and nothing extra on y": ours[0]}


# ---- lesson 7: GPT

@_exercise("07.5", "(inputs, targets)", "the section 'The prefix is the conditioning'",
           "the inputs are the row without its last token, the targets the row without its first",
           uses=("row_of_tokens",))
def _shifted_pair(row):
    row = np.asarray(row)
    return (row[:, :-1], row[:, 1:]), {
        "shifted the wrong way: the targets come before the inputs": (row[:, 1:], row[:, :-1]),
        "not shifted: the targets are the inputs, so each position is scored on its own token":
            (row[:, :-1], row[:, :-1])}


# ---- lesson 1: attention

_A6 = "the section 'A6 and A7: several heads'"
_MHA_WEIGHTS = ("w_q", "w_k", "w_v", "w_o")


def _flat_weights(params) -> np.ndarray:
    return np.concatenate([np.asarray(params[k], dtype=np.float64).ravel() for k in _MHA_WEIGHTS])


@_exercise("01.5", "the parameters with heads 0 and 1 swapped", _A6,
           "head r owns columns r d_h .. (r + 1) d_h of w_q, w_k, w_v and the same rows of w_o",
           uses=("params", "d_h"), prepare=_flat_weights)
def _swapped_heads(params, d_h):
    order = np.r_[d_h:2 * d_h, 0:d_h]
    columns = {k: np.asarray(params[k])[:, order] for k in ("w_q", "w_k", "w_v")}
    return _flat_weights({**columns, "w_o": np.asarray(params["w_o"])[order]}), {
        "w_o left as it was: its rows must follow the heads they read": _flat_weights(
            {**columns, "w_o": params["w_o"]}),
        "the rows of w_q, w_k, w_v swapped, not their columns (the heads split the output width)":
            _flat_weights({**{k: np.asarray(params[k])[order] for k in ("w_q", "w_k", "w_v")},
                           "w_o": np.asarray(params["w_o"])[order]}),
        "nothing swapped": _flat_weights(params)}


# ---- lesson 2: normalisation

@_exercise("02.5", "the stream's RMS after 8 blocks", "the section 'N4: Post-LN against Pre-LN'",
           "each block adds RMSNorm(x), of RMS 1 and x's direction, so the RMS grows by 1 a block",
           uses=("stream0",))
def _stream_rms(stream0):
    from refmath.norms import rmsnorm_forward

    stream = np.asarray(stream0, dtype=np.float64)
    branch = stream
    for _ in range(8):
        branch = rmsnorm_forward(stream, np.ones(stream.shape[-1]), eps=1e-6)[0]
        stream = stream + branch
    rms = float(np.sqrt(np.mean(stream**2)))
    return rms, {"the RMS of the last block's normalised input, not of the stream: "
                 "RMSNorm bounds what a branch reads, not the stream": float(
                     np.sqrt(np.mean(branch**2))),
                 "the starting stream left out: 8 blocks of RMS 1 add to 8, on top of stream0":
                     rms - float(np.sqrt(np.mean(np.asarray(stream0, dtype=float)**2)))}


# ---- lesson 11: latent attention

@_exercise("11.2", "the smallest exact latent widths", "the section 'K8: weight absorption'",
           "W_K = W_DKV W_UK holds exactly only if d_c >= rank(W_K): np.linalg.matrix_rank",
           uses=("mha_w_k", "factored_w_k"), rtol=0.0)
def _smallest_latent(w_k, factored):
    ranks = [int(np.linalg.matrix_rank(np.asarray(w, dtype=np.float64))) for w in (w_k, factored)]
    width = np.shape(w_k)[1]
    return ranks, {"the widths of the matrices, not their ranks: a product through 6 numbers has "
                   "rank at most 6": [width, np.shape(factored)[1]],
                   "one head's key width: the latent is shared by every head, so it must hold "
                   "all of their keys": [width // 4, width // 4]}


@_exercise("01.1", "the masked output", "the section 'A3: a worked example to check by hand'",
           "o = sum_j a_j v_j with a = (1/3, 2/3, 0)", uses=("q", "k", "v"))
def _masked_output(q, k, v):
    from refmath.attention import sdpa_forward

    mask = np.array([[0.0, 0.0, -np.inf]])
    return sdpa_forward(q, k, v, mask=mask, scale=1.0)[0], {
        "the unmasked weights (1/4, 1/2, 1/4)": sdpa_forward(q, k, v, scale=1.0)[0],
        "the masked weights not renormalised, (1/4, 1/2, 0)": np.array([[0.25, 0.5, 0.0]]) @ v}


# ---- lesson 12: from the equation to the kernel

def _forward_scratch_bytes(d: int, block_q: int = 128, block_k: int = 128, leave_out=()) -> int:
    """Bytes of one thread's scratch in the C++ forward pass (csrc/flash_cpu.cpp), padded to 16
    floats; the lesson checks the same count against the kernel's own expression."""
    parts = {"S": block_q * block_k, "U": block_q * d, "PV": block_q * d,
             "m, l, alpha": 3 * block_q, "KT": d * block_k, "Vs": block_k * d}
    floats = sum(n for name, n in parts.items() if name not in leave_out)
    return 4 * (-(-floats // 16) * 16)


@_exercise("12.2", "scratch bytes per thread at D = 128",
           "the section 'F4: the scratch memory of a tile'", "six buffers; 4 bytes a float",
           rtol=0.0)
def _scratch_bytes():
    full = _forward_scratch_bytes(128)
    return full, {
        "float32 numbers, not bytes": full / 4,
        # at D = B_k = 128, U, PV, KT and Vs are all 128 x 128: the check cannot tell which one
        # is missing, so its name does not guess
        "one of the 128 x 128 buffers left out (U, PV, KT or Vs)":
            _forward_scratch_bytes(128, leave_out=("Vs",)),
        "m, l and alpha left out": _forward_scratch_bytes(128, leave_out=("m, l, alpha",)),
        "only the score tile S": 4 * 128 * 128,
        "D = 64's scratch": _forward_scratch_bytes(64)}


def _cpu_splits(batch: int, kv_heads: int, longest: int, threads: int) -> int:
    """choose_splits of csrc/decode_cpu.cpp for a contiguous cache (the lesson checks it against
    the kernel's choice)."""
    if threads == 1:
        return 1
    return max(1, min(-(-8 * threads // (batch * kv_heads)), longest // 512))


@_exercise("12.4", "the splits chosen for (a) and (b)",
           "the section 'K2 and F3: a decode step, split across the cores'",
           "work items are the B G pairs, about 8 per thread; no split below 512 keys", rtol=0.0)
def _splits_chosen():
    return (_cpu_splits(3, 8, 32768, 16), _cpu_splits(1, 1, 4096, 16)), {
        "the 512-key floor ignored": (-(-8 * 16 // 24), 8 * 16),
        "rounded down: 128 / 24 = 5.33 needs 6 splits": (8 * 16 // 24, 8),
        "one work item per query head, not per key/value head":
            (_cpu_splits(3, 32, 32768, 16), _cpu_splits(1, 1, 4096, 16)),
        "one work item per thread, not 8": (-(-16 // 24), min(16, 4096 // 512))}


# ---- lesson 1: the softmax Jacobian and the backward pass

_A5 = "the section 'A5: the softmax Jacobian'"
_A8 = "the section 'A8: the backward pass, by hand'"


@_exercise("01.3", "the Jacobian of (1/4, 1/2, 1/4)", _A5,
           "the diagonal is a_j (1 - a_j), off the diagonal -a_j a_u")
def _jacobian_a3():
    from refmath.softmax import softmax_jacobian

    a = np.array([0.25, 0.5, 0.25])
    return softmax_jacobian(a), {
        "diag(a) alone: the -a a^T term is forgotten": np.diag(a),
        "a a^T taken as the inner product (a number), not the outer product (a matrix)":
            np.diag(a) - a @ a,
        "the sign flipped: a a^T - diag(a)": -softmax_jacobian(a)}


def _dq_with_a_slip(dout, cache, reduce=np.sum, transposed=False):
    """dQ of attention without dropout, with a slip in dS: another reduction of A dA, or dS
    transposed."""
    a, d_a = cache.a, dout @ cache.v.T
    d_s = a * (d_a - reduce(a * d_a, axis=1, keepdims=True))
    return (d_s.T if transposed else d_s) @ cache.k * cache.scale


@_exercise("01.6", "dQ (causal)", _A8, "the same formula, with the causal weights",
           uses=("dO", "cache_causal", "cache"), atol=1e-15)
def _causal_dq(dout, cache_causal, cache):
    from refmath.attention import sdpa_backward

    def dq():
        return sdpa_backward(dout, cache_causal)[0]
    return dq(), {
        **catalogued("sdpa: scale missing from dQ", dq),
        **catalogued("softmax: sign of the correction flipped", dq),
        **catalogued("softmax: the -a a^T term dropped (a * dout)", dq),
        "the unmasked weights A, not A_causal": sdpa_backward(dout, cache)[0],
        "a mean for the sum in dS: <A, dA> is a weighted sum, its weights sum to one":
            _dq_with_a_slip(dout, cache_causal, reduce=np.mean),
        "dS transposed: dS^T K / sqrt(d_k) mixes keys, not queries":
            _dq_with_a_slip(dout, cache_causal, transposed=True)}


@_exercise("01.7", "(dV, dQ) with dropout", _A8,
           "D multiplies A in dV and dA = dO V^T; dS uses A itself",
           uses=("dO", "cache_drop"), atol=1e-15)
def _dropout_dv_dq(dout, cache):
    from refmath.attention import sdpa_backward

    def dv_dq():
        grads = sdpa_backward(dout, cache)
        return np.concatenate([grads[2], grads[0]])
    # A * D inside dS: the softmax's Jacobian is of A, before dropout
    dropped = cache.a * cache.dropout_mask
    d_a = (dout @ cache.v.T) * cache.dropout_mask
    d_s = dropped * (d_a - np.sum(dropped * d_a, axis=1, keepdims=True))
    return dv_dq(), {
        **catalogued("sdpa: dropout mask ignored in dA", dv_dq),
        **catalogued("sdpa: dV from the weights before dropout", dv_dq),
        **catalogued("sdpa: scale missing from dQ", dv_dq),
        "A * D inside dS: the softmax's Jacobian is of A, before dropout":
            np.concatenate([dropped.T @ dout, d_s @ cache.k * cache.scale])}


# ---- lesson 2: the LayerNorm and RMSNorm backward passes

_N_LN = "the section 'The LayerNorm backward: three terms'"
_N_RMS = "the section 'The RMSNorm backward: two terms'"


@_exercise("02.1", "LayerNorm dx", _N_LN, "(g - mean(g) - xhat mean(g xhat)) / sigma",
           uses=("dy", "ln_cache"))
def _layernorm_dx(dy, cache):
    from refmath.norms import layernorm_backward

    def dx():
        return layernorm_backward(dy, cache)[0]
    rstd = np.asarray(cache.rstd)  # 1 / sigma
    return dx(), {**catalogued("layernorm: variance path dropped", dx),
                  "the 1/sigma forgotten": dx() / rstd,
                  "the mean path dropped: only the direct and sigma terms":
                      dx() + np.mean(dy) * rstd}


@_exercise("02.2", "RMSNorm dx", _N_RMS, "r g - r^3 x mean(g x): no mean term",
           uses=("dy", "rms_cache"))
def _rmsnorm_dx(dy, cache):
    from refmath.norms import rmsnorm_backward

    def dx():
        return rmsnorm_backward(dy, cache)[0]
    r = np.asarray(cache.rrms)
    return dx(), {**catalogued("rmsnorm: r^2 instead of r^3", dx),
                  "LayerNorm's mean term kept (RMSNorm subtracts no mean)": dx() - np.mean(dy) * r,
                  "the sign of the r^3 term flipped": 2 * r * dy - dx()}


@_exercise("02.3", "(dgamma, dbeta)", _N_LN,
           "gamma and beta are shared by every row: sum over the rows",
           uses=("upstream", "xs", "gamma", "beta"))
def _layernorm_dgamma_dbeta(upstream, xs, gamma, beta):
    from refmath.norms import layernorm_backward, layernorm_forward

    def both():
        return np.stack(layernorm_backward(upstream, layernorm_forward(xs, gamma, beta)[1])[1:])
    return both(), {**catalogued("layernorm: dbeta averaged over rows", both),
                    "both averaged over the rows, not summed": both() / np.shape(xs)[0],
                    "dgamma and dbeta swapped": both()[::-1],
                    "dgamma from x instead of xhat":
                        np.stack([np.sum(upstream * xs, axis=0), np.sum(upstream, axis=0)])}


# ---- lesson 3: the online softmax, the tiled backward, the traffic, the cache

_F1 = "the section 'F1-F3: attention as a ratio of sums, merged block by block'"


@_exercise("03.1", "(m, l) of the merge", _F1, "rescale each l by e^(its m - the larger m)",
           uses=("a", "b"))
def _merged_m_l(a, b):
    from refmath.softmax import online_softmax_merge

    merged = online_softmax_merge(a, b)
    smaller = min(a.m, b.m)
    return (merged.m, merged.l), {
        "the l added without rescaling them to the larger m": (merged.m, a.l + b.l),
        "rescaled to the smaller m, not the larger":
            (smaller, merged.l * np.exp(merged.m - smaller))}


@_exercise("03.3", "dQ from the logsumexp", "the section 'F4: the backward pass from the logsumexp'",
           "P = exp(S - lse) at visible pairs, 0 elsewhere; delta = rowsum(dO * O)",
           uses=("do_small", "q_small", "k_small", "v_small", "o_small", "lse_small"),
           rtol=1e-10, atol=1e-14)
def _dq_from_lse(do, q, k, v, o, lse):
    from refmath.flash import flash_attention_backward

    def dq():
        return flash_attention_backward(do, q, k, v, o, lse, causal=True, block_q=2, block_k=2)[0]
    return dq(), {
        **catalogued("flash: delta = rowsum(dO * O) left out", dq),
        **catalogued("flash: causal mask forgotten in the backward", dq),
        "the scale tau = 1/sqrt(d) missing from dQ (it is in S and in dQ)":
            np.sqrt(np.shape(q)[-1]) * dq()}


@_exercise("03.4", "dense bytes at T = 2048",
           "the section 'F6: what the tiles save is traffic to slow memory'",
           "4 h T^2 for S and P (each written and read) plus 4 h T d_h for Q, K, V, O", rtol=0.0)
def _dense_bytes_2048():
    from refmath.flash import attention_memory_traffic

    total = attention_memory_traffic(1, 12, 2048, 2048, 64, bytes_per_element=2).total_bytes
    return total, {"elements, not bytes: the 2 bytes of each forgotten": total / 2}


@_exercise("03.5", "the cache bytes", "the section 'K6-K7: what the cache costs in memory'",
           "2 (K and V) x B x L x T x g x d_h x bytes", rtol=0.0)
def _cache_bytes():
    from refmath.sizing import kv_cache_bytes

    def size(batch=8, layers=40):
        return kv_cache_bytes(batch=batch, layers=layers, tokens=4096, kv_heads=8, head_dim=128,
                              bytes_per_element=2)
    return size(), {**catalogued("kv cache: the factor 2 for K and V forgotten", size),
                    "one layer only (x 40 layers forgotten)": size(layers=1),
                    "one sequence only (x a batch of 8 forgotten)": size(batch=1)}


# ---- lesson 4: the feed-forward block and positions

_N6 = "the section 'N6: GELU, its tanh approximation, and SiLU'"
_N7 = "the section 'N7: SwiGLU, its backward, and its width'"
_N10 = "the section 'N10: RoPE rotates queries and keys'"


def _silu_one() -> float:
    """The u > 0 where SiLU(u) = 1, by Newton's method from u = 1, with
    SiLU'(u) = sigma (1 + u (1 - sigma))."""
    u = 1.0
    for _ in range(50):
        sigma = 1 / (1 + np.exp(-u))
        u -= (u * sigma - 1) / (sigma * (1 + u * (1 - sigma)))
    return u


@_exercise("04.1", "the u where SiLU(u) = 1", _N6,
           "SiLU is increasing for u > 0: halve the interval [0, 4] until it is 1e-9 wide",
           rtol=1e-9)
def _silu_crossing():
    return _silu_one(), {"sigma(u) = 1/2 (the sigmoid's midpoint, u = 0)": 0.0,
                         "u = 1 (SiLU read as the identity)": 1.0}


@_exercise("04.2", "the smallest value of SiLU", _N6,
           "SiLU(-u) = SiLU(u) - u; the minimum sits at minus the crossing point", rtol=1e-8)
def _silu_minimum():
    return 1 - _silu_one(), {"0 (SiLU read as a ReLU that stops at 0)": 0.0,
                             "the minimum's place, not its value": -_silu_one()}


@_exercise("04.3", "GELU'(0, 1, -2), exact and tanh", _N6,
           "product rule: Phi(u) + u phi(u); for tanh, d tanh = 1 - tanh^2", uses=("points",))
def _gelu_derivatives(points):
    from refmath.ffn import gelu_backward, gelu_forward, standard_normal_cdf

    u = np.asarray(points, dtype=np.float64)
    t = np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3))
    return np.stack([gelu_backward(np.ones(u.shape), gelu_forward(u, approximate=form)[1])
                     for form in (False, True)]), {
        "the product rule's second term forgotten: Phi(u) and (1 + t) / 2 alone":
            np.stack([standard_normal_cdf(u), 0.5 * (1 + t)])}


@_exercise("04.5", "SwiGLU dx", _N7, "two paths into x: dg W_g^T and du W_u^T",
           uses=("dy", "swiglu_cache"), rtol=1e-10, atol=1e-14)
def _swiglu_dx(dy, cache):
    from refmath.ffn import swiglu_backward

    return swiglu_backward(dy, cache)[0], {}


@_exercise("04.6", "(d_f, excess) at d = 1000", _N7,
           "round 8d/3 = 2666.7 up to a multiple of 64; excess = d_f / (8d/3) - 1")
def _swiglu_width():
    from refmath.ffn import ffn_parameter_count, swiglu_hidden_size

    d_f = swiglu_hidden_size(1000, 64)
    excess = ffn_parameter_count(1000, d_f, gated=True) / ffn_parameter_count(1000, 4000) - 1
    return (d_f, excess), {}


_ROPE_ROW = np.array([[3.0, 4.0, 1.0, 0.0]])


@_exercise("04.7", "RoPE of (3, 4, 1, 0) at position 2", _N10,
           "pairs are (x0, x1) and (x2, x3); theta = p omega_r", atol=1e-15)
def _rope_rotated():
    from refmath.positions import rope_forward

    return rope_forward(_ROPE_ROW, positions=np.array([2]))[0], {}


@_exercise("04.8", "RoPE dx", _N10, "the same rotation with -theta", atol=1e-15)
def _rope_dx():
    from refmath.positions import rope_backward, rope_forward

    def dx():
        return rope_backward(np.array([[1.0, 0.0, 0.0, 1.0]]),
                             rope_forward(_ROPE_ROW, positions=np.array([2]))[1])
    return dx(), catalogued("rope: forward rotation used in backward", dx)


# ---- lesson 6: the encoder-decoder (06.3 is above)

_L1 = "the section 'L1: the decoder reads the target shifted right by one'"


@_exercise("06.1", "shifted decoder input", _L1,
           "a column of BOS ids in front, the last target token dropped",
           uses=("targets_2", "bos"), rtol=0.0)
def _shifted_decoder_input(targets, bos):
    from refmath.models import transformer

    targets = np.asarray(targets)
    return transformer.shift_right(targets, bos_id=bos), {
        "the targets themselves, not shifted": targets,
        "shifted the wrong way: the first target dropped, BOS put last":
            np.concatenate([targets[:, 1:], np.full((len(targets), 1), bos)], axis=1)}


@_exercise("06.2", "p(y | x)", _L1, "p[0, t, tgt[0, t]] is the factor of position t",
           uses=("loss", "z", "tgt"))
def _target_probability(loss, z, tgt):
    from refmath.softmax import softmax_forward

    tgt = np.asarray(tgt)
    factors = softmax_forward(z)[0][0, np.arange(tgt.shape[1]), tgt[0]]
    return np.exp(-tgt.shape[1] * float(loss)), {
        "the mean of the probabilities, not their product": float(np.mean(factors)),
        "the loss exp(-l) of the mean, not of the sum over the tokens": np.exp(-float(loss))}


@_exercise("06.4", "its loss through refmath", "the section 'L4: label smoothing, three conventions'",
           "label_smoothing = eps V / (V - 1)", uses=("z", "y"))
def _tensor2tensor_loss(z, y):
    from refmath.losses import cross_entropy_forward
    from refmath.softmax import softmax_forward

    target = _tensor2tensor_target(z, y)[0]
    return float(-(target * np.log(softmax_forward(z)[0][0])).sum()), {
        "label_smoothing = eps itself: refmath's eps / V on every token, not tensor2tensor's "
        "target": float(cross_entropy_forward(z, y, label_smoothing=0.1)[0])}


@_exercise("06.7", "dE", "the section 'N12: the embedding lookup, and repeated tokens in its "
           "backward'", "each token's gradient is added to its row: np.add.at(dE, ids, dy)",
           uses=("dy", "emb_cache"), rtol=0.0)
def _embedding_gradient(dy, cache):
    from refmath.embedding import embedding_backward

    return embedding_backward(dy, cache), catalogued(
        "embedding: repeated ids keep one contribution", lambda: embedding_backward(dy, cache))


# ---- lesson 7: GPT (07.5 is above)

_N11 = "the section 'N11: initialisation, std 0.02 and residual projections scaled by $1/\\sqrt{2L}$'"
_SFT = "the section 'The prefix is the conditioning: tasks, instructions, preferences'"


@_exercise("07.1", "dP", "the section 'N9: learned absolute positions'",
           "row offset + t gets the batch sum of dy[:, t]", uses=("dy", "pos_cache"), rtol=0.0)
def _position_table_gradient(dy, cache):
    from refmath.positions import learned_positions_backward

    def d_table():
        return learned_positions_backward(dy, cache)[1]
    return d_table(), {
        **catalogued("learned positions: table gradient averaged over the batch", d_table),
        **catalogued("learned positions: offset ignored", d_table)}


def _count(shapes) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


@_exercise("07.2", "GPT-2 small parameters", "the section 'M2: GPT, Post-LN (GPT-1) and Pre-LN "
           "(GPT-2)'", "per layer 12 d^2 + 13 d", rtol=0.0)
def _gpt2_small_parameters():
    from refmath.models import gpt

    config = gpt.GPT_CONFIGS["gpt2-small"]
    total, d = _count(gpt.param_shapes(config)), config.d_model
    return total, {"the position table forgotten (T_ctx d)": total - config.max_seq_len * d,
                   "the final LayerNorm forgotten (2 d)": total - 2 * d,
                   "an untied output matrix counted (V d more: GPT-2 reuses E)":
                       total + config.vocab_size * d}


@_exercise("07.3a", "prescribed std", _N11, "0.02 / sqrt(2 L): two residual writers per layer",
           uses=("config4",))
def _prescribed_std(config):
    layers = config.n_layers
    return 0.02 / math.sqrt(2 * layers), {
        "0.02 / sqrt(L): each layer has two residual writers, attention and the FFN":
            0.02 / math.sqrt(layers),
        "0.02, unscaled: w_o writes into the residual stream": 0.02}


@_exercise("07.3b", "measured std of w_o", _N11,
           "params4[f'layers.{i}.attn.w_o'].std() for each layer i, then their mean",
           uses=("params4", "config4"))
def _measured_std(params, config):
    stds = [float(np.std(params[f"layers.{i}.attn.w_o"])) for i in range(config.n_layers)]
    return float(np.mean(stds)), {
        "the rule's std, not the one measured on params4": 0.02 / math.sqrt(2 * config.n_layers),
        "layer 0's std only, not the mean over the layers": stds[0]}


@_exercise("07.4", "mean of the prefix losses", "the section 'L6: one masked pass scores every "
           "prefix'", "loss_mask 1 on the last of the n positions only, then the mean over n",
           uses=("params", "batch", "gpt_config"), rtol=1e-13)
def _mean_of_prefixes(params, batch, config):
    from refmath.models import gpt

    return float(gpt.forward(params, batch, config)[0]), {}


def _sft_mask(batch, first: int) -> np.ndarray:
    mask = np.zeros(np.shape(batch["tokens"]), dtype=int)
    mask[:, first:] = 1
    return mask


@_exercise("07.6a", "the SFT loss", _SFT,
           "the first answer token is the target of the question's last position",
           uses=("params", "sft_batch", "gpt_config", "q_ids"))
def _gpt_sft_loss(params, batch, config, q_ids):
    from refmath.models import gpt

    def loss(first, summed=True):
        mask = _sft_mask(batch, first)
        mean = float(gpt.forward(params, {**batch, "loss_mask": mask}, config)[0])
        return mean * mask.sum() if summed else mean
    first = len(q_ids) - 1
    return loss(first), {
        "the question's tokens counted too (the plain language-model loss)":
            float(gpt.forward(params, batch, config)[0]),
        "the first answer token left out (the mask starts one position late)": loss(first + 1),
        "the mean over the answer, not the sum (gpt.forward's reduction)":
            loss(first, summed=False)}


@_exercise("07.6b", "answer_mask", _SFT,
           "1 on the positions whose target is an answer token, 0 elsewhere",
           uses=("sft_batch", "q_ids"), rtol=0.0)
def _gpt_answer_mask(batch, q_ids):
    first = len(q_ids) - 1
    return _sft_mask(batch, first), {
        "the mask starts one position late: the question's last position predicts the first "
        "answer token": _sft_mask(batch, first + 1),
        "the question's positions marked, not the answer's": 1 - _sft_mask(batch, first)}


def _flat_parameters(params) -> np.ndarray:
    return np.concatenate([np.asarray(params[n], dtype=np.float64).ravel() for n in sorted(params)])


@_exercise("07.7", "parameters after one AdamW step", "the section 'O5: which parameters take "
           "weight decay'", "a decayed parameter is multiplied by 1 - lr lambda, the others kept",
           uses=("before",), rtol=1e-15, prepare=_flat_parameters)
def _after_one_adamw_step(before):
    from refmath.optim import AdamW, takes_weight_decay

    stepped = {name: np.array(value, dtype=np.float64) for name, value in before.items()}
    AdamW(lr=0.1, weight_decay=0.5).step(stepped, {n: np.zeros_like(v) for n, v in stepped.items()})
    return _flat_parameters(stepped), {
        "every parameter decayed, biases, norms and embeddings too":
            _flat_parameters(before) * (1 - 0.1 * 0.5),
        "the decay not scaled by the learning rate: 1 - lambda":
            _flat_parameters({n: v * (1 - 0.5 if takes_weight_decay(n) else 1.0)
                              for n, v in before.items()})}


# ---- lesson 8: the modern decoder and grouped-query attention

_HEAD_SUM = "the section 'The head-sum in the key and value gradients'"
_A13 = "the section 'A13: what grouping saves, and what it does not'"
_N19 = "the section 'N19, N20: Gemma's soft caps, GeGLU and local layers'"


def _fused_weights(params) -> np.ndarray:
    return np.concatenate([np.asarray(params[k], dtype=np.float64).ravel() for k in ("w_qkv", "w_o")])


@_exercise("08.2", "the fused parameters", "the section 'A9: one fused projection equals three'",
           "w_qkv = [w_q w_k w_v] side by side (axis=1), in that order; w_o unchanged",
           uses=("separate",), prepare=_fused_weights)
def _fused_parameters(separate):
    def fused(*names):
        return _fused_weights({"w_qkv": np.concatenate([separate[n] for n in names], axis=1),
                               "w_o": separate["w_o"]})
    return fused("w_q", "w_k", "w_v"), {
        "the order Q, V, K: the heads read K before V": fused("w_q", "w_v", "w_k"),
        "the order K, Q, V: the queries come first": fused("w_k", "w_q", "w_v")}


@_exercise("08.3", "dV of the shared head", _HEAD_SUM,
           "dV = A_0^T dO_0 + A_1^T dO_1: a copy's backward is a sum",
           uses=("do_small", "cache_small"), rtol=1e-14)
def _shared_dv(do, cache):
    from refmath.attention import causal_attention_backward

    dv = causal_attention_backward(do, cache)[2]
    weights = cache.saved.a[0]  # (h, T, T)
    head0 = (weights[0].T @ do[0, 0]).reshape(dv.shape)
    return dv, {"head 0's copy only, head 1's dropped": head0,
                "A dO, not A^T dO: the transpose forgotten":
                    sum(weights[r] @ do[0, r] for r in range(2)).reshape(dv.shape)}


@_exercise("08.4", "dK of the shared heads", _HEAD_SUM, "sum over the h/g query heads of each block",
           uses=("q5", "k5", "v5", "do5", "per_head"), rtol=1e-7, atol=1e-9)
def _shared_dk(q, k, v, do, per_head):
    from refmath.attention import causal_attention_forward
    from refmath.gradcheck import numerical_gradient

    def phi():
        return float((causal_attention_forward(q, k, v)[0] * do).sum())
    b, g, t, d = np.shape(k)
    grouped = np.asarray(per_head).reshape(b, g, -1, t, d)
    return numerical_gradient(phi, k, np.arange(k.size)).reshape(k.shape), {
        "the mean over the sharing query heads, not the sum": grouped.mean(axis=2),
        "one query head's copy only, the other sharing head's dropped": grouped[:, :, 0]}


def _llama3_design(kv_heads: int = 8):
    from refmath.sizing import attention_design_cost

    return attention_design_cost(4096, 32, kv_heads, 128, 8192)


@_exercise("08.5a", "score FLOPs", _A13, "2 FLOPs per multiply-add, h d_h t for q k^T and again "
           "for A V", rtol=0.0)
def _score_flops():
    flops = _llama3_design().score_flops
    # q k^T alone and multiply-adds counted as one FLOP both give half: one name for both
    return flops, {"half of it: q k^T without A V, or a multiply-add counted as one FLOP":
                       flops / 2,
                   "the g key/value heads, not the h query heads": flops * 8 / 32}


@_exercise("08.5b", "cache bytes", _A13, "2 (K and V) x t x g x d_h x bytes, for one layer",
           rtol=0.0)
def _decode_cache_bytes():
    size = _llama3_design().cache_bytes
    return size, {"the factor 2 for K and V forgotten": size / 2,
                  "every query head's keys and values (MHA's cache)":
                      _llama3_design(kv_heads=32).cache_bytes}


@_exercise("08.5c", "MHA / GQA cache", _A13, "the cache is proportional to g", rtol=0.0)
def _mha_over_gqa():
    ratio = _llama3_design(kv_heads=32).cache_bytes / _llama3_design().cache_bytes
    return ratio, {"GQA / MHA, the ratio upside down": 1 / ratio}


@_exercise("08.6", "llama3 frequencies", "the section 'N13-N17: context extension, rescaling "
           "RoPE's frequencies'",
           "pair 0 (wavelength 6.3) is kept; pair 1 (wavelength 30) is blended")
def _llama3_frequencies():
    from refmath.positions import rope_inv_freq

    plain = 500.0 ** (-np.arange(4) / 4)
    return rope_inv_freq(8, 500.0, dict(rope_type="llama3", factor=8.0,
                                        original_max_seq_len=32))[0], {
        "every pair divided by s = 8 (position interpolation)": plain / 8,
        "the frequencies left as they were": plain}


_CAPPED_SCORES = np.array([0.0, 25.0, 50.0, 100.0])


@_exercise("08.7a", "the capped scores", _N19,
           "y = c tanh(x / c): at x = c it is c tanh(1), about 0.76 c")
def _capped_scores():
    from refmath.ffn import softcap_forward

    x = _CAPPED_SCORES
    return softcap_forward(x, 50.0)[0], {"tanh(x / c) without the factor c": np.tanh(x / 50.0),
                                         "c tanh(x), the score not divided by c":
                                             50.0 * np.tanh(x)}


@_exercise("08.7b", "the slopes", _N19, "the derivative of c tanh(x / c) is 1 - tanh^2(x / c)")
def _cap_slopes():
    from refmath.ffn import softcap_forward

    x = _CAPPED_SCORES
    return 1.0 - (softcap_forward(x, 50.0)[0] / 50.0) ** 2, {
        "1 - tanh(x / c), not squared": 1.0 - np.tanh(x / 50.0),
        "the slope of tanh(x), not divided by c": 1.0 - np.tanh(x) ** 2}


@_exercise("08.8", "the fused input projection's width", "the section 'N21, N22: the parallel "
           "block, and norms after the sublayers'",
           "queries h d_h, keys and values one head each, the gate and the up projection", rtol=0.0)
def _palm_fused_width():
    d, h, d_h, d_f = 18432, 48, 256, 4 * 18432
    return h * d_h + 2 * d_h + 2 * d_f, {
        "keys and values for every head (MHA, not MQA)": 3 * h * d_h + 2 * d_f,
        "one FFN matrix (the gate forgotten)": h * d_h + 2 * d_h + d_f,
        "the down projection counted too (it reads the FFN's hidden, not x)":
            h * d_h + 2 * d_h + 3 * d_f}


# ---- lesson 9: numerics and sampling

@_exercise("09.1", "stable softmax rows", "the section 'A11: the stable softmax, and a row with "
           "nothing to attend to'", "a row of -inf gives zeros, not NaN",
           uses=("rows",), rtol=1e-14, atol=1e-300)
def _stable_rows(rows):
    from refmath.softmax import softmax_forward

    right = softmax_forward(rows)[0]
    return right, {"NaN for the fully masked row: its max is -inf, and -inf - (-inf) is NaN":
                   np.where(np.isneginf(rows).all(axis=1, keepdims=True), np.nan, right)}


def _first_broken_x() -> float:
    """The first x on a fine grid where the float16 sum of exp(x - 2), exp(x - 1), exp(x) is inf."""
    grid = np.arange(10.0, 11.5, 1e-4)
    with np.errstate(over="ignore"):
        sums = np.array([np.exp(np.array([x - 2, x - 1, x], dtype=np.float16)).sum(
            dtype=np.float16) for x in grid])
    return float(grid[np.argmax(np.isinf(sums))])


# float16 rounds each exponential to 11 bits, so the grid finds the crossing to about 1e-3
@_exercise("09.2", "x where the float16 sum overflows", "the section 'S4: why half precision "
           "needs the shift'", "e^x (1 + e^-1 + e^-2) = 65504: take the log of both sides",
           rtol=2e-3)
def _x_sum_overflows():
    x = _first_broken_x()
    return x, {"where e^x alone overflows: the other two terms of the sum count too":
               np.log(65504), "log2 taken for ln": x / np.log(2)}


@_exercise("09.3", "visible pairs, T = 10, w = 4", "the section 'A12: a sliding window'",
           "w (w + 1) / 2 for the first w rows, then w for each of the T - w others", rtol=0.0)
def _window_pairs():
    from refmath.attention import local_window_mask

    return int(np.count_nonzero(local_window_mask(10, 4) == 0)), {
        "T w: the first w - 1 rows see fewer than w keys": 10 * 4,
        "the causal count T (T + 1) / 2: the window hides the older keys": 10 * 11 // 2}


@_exercise("09.4", "top-p, p = 0.6", "the section 'L7: picking the next token'",
           "sort, keep a token while the mass before it is below p, renormalise",
           uses=("pi4",), rtol=1e-14)
def _top_p_by_hand(pi):
    from refmath.inference.sampling import top_p_filter

    kept = top_p_filter(pi, 0.6)
    return kept, {"the kept probabilities not renormalised to sum to one":
                  np.where(kept > 0, pi, 0.0),
                  "only the most likely token: top-p keeps tokens until their mass reaches p":
                      np.eye(len(pi))[int(np.argmax(pi))]}


# ---- lesson 10: what a generated token costs

def _layer0_keys(params, config, tokens, rotated: bool = True) -> np.ndarray:
    """Layer 0's cached keys after a prefill of 3 tokens and 3 decode steps (the lesson's run),
    or the same keys before RoPE's rotation."""
    from refmath.inference.kv_cache import decode_step, prefill
    from refmath.models import decoder
    from refmath.norms import rmsnorm_forward

    tokens = np.asarray(tokens)
    if not rotated:
        u, _ = rmsnorm_forward(params["tok_emb"][tokens], params["layers.0.ln1.gamma"],
                               config.norm_eps)
        raw = (u @ params["layers.0.attn.w_k"]).reshape(*tokens.shape, config.kv_heads, config.d_h)
        return raw.transpose(0, 2, 1, 3)
    _, cache = prefill(decoder, params, config, tokens[:, :3])
    for t in range(3, tokens.shape[1]):
        decode_step(decoder, params, config, cache, tokens[:, t])
    return cache.layer(0)[0]


@_exercise("10.1", "cached keys of layer 0", "the section 'K3: RoPE keys are cached after their "
           "rotation'", "rotate after splitting into heads, at positions 0..5",
           uses=("params", "config", "tokens"), atol=1e-15)
def _cached_keys(params, config, tokens):
    return _layer0_keys(params, config, tokens), {
        "the keys not rotated: the cache holds them after RoPE":
            _layer0_keys(params, config, tokens, rotated=False)}


@_exercise("10.3", "visible pairs after a prefill of 5 and 3 steps", "the section 'K5: the prompt "
           "is quadratic, each new token linear'",
           "P (P + 1) / 2 for the prefill, then P + 1, P + 2, P + 3 for the steps",
           uses=("params", "config", "tokens"), rtol=0.0)
def _visible_pairs(params, config, tokens):
    from refmath.inference.kv_cache import decode_step, prefill
    from refmath.models import decoder

    _, cache = prefill(decoder, params, config, np.asarray(tokens)[:, :5])
    for t in range(3):
        decode_step(decoder, params, config, cache, np.array([t + 1]))
    total = cache.counts.visible[0]
    return total, {"the prefill's pairs only": 5 * 6 // 2,
                   "each step's query not counted against its own key": total - 3}


@_exercise("10.4", "lower bound on time per token", "the section 'K13: decode is bound by memory "
           "bandwidth'", "weights are read once per step; add the whole cache",
           uses=("step",))
def _seconds_per_token(step):
    from refmath.sizing import decode_time_lower_bound

    bound = decode_time_lower_bound(step, 2e12)  # step: the lesson's traffic at t = 8192
    return bound, {"the cache forgotten: the weights alone": 2 * 7_504_658_432 / 2e12,
                   "the weights counted in 1 byte, not 2 (bf16)": bound - 7_504_658_432 / 2e12}


_K12 = "the section 'K12: a cache of small integers'"


@_exercise("10.5a", "scale", _K12, "s = max |x| / q_max, q_max = 2^(q - 1) - 1 = 7 for 4 bits",
           uses=("x",), rtol=0.0)
def _quantiser_scale(x):
    from refmath.inference.quantized import quantize

    scale = quantize(x, bits=4, group_size=4).scales[0]
    return scale, {"max |x| / 8: the symmetric 4-bit range is -7 .. 7, not -8 .. 7": scale * 7 / 8,
                   "max |x| / 15: the 16 levels split over both signs": scale * 7 / 15}


@_exercise("10.5b", "x_hat", _K12, "x_hat = s clip(round(x / s), -7, 7)", uses=("x",), rtol=0.0)
def _quantised_x(x):
    from refmath.inference.quantized import dequantize, quantize

    packed = quantize(x, bits=4, group_size=4)
    x_hat = dequantize(packed)
    return x_hat, {"the codes c, not x_hat = s c": x_hat / packed.scales[0]}



# ---- lesson 11: latent attention, shared pages, memory (11.2 is above)

@_exercise("11.1", "absorbed scores", "the section 'K8: weight absorption, scoring against the "
           "cache without expanding it'", "q_hat = q W_UK^T (width d_c), then q_hat c_j^T",
           uses=("q_c", "c_lat", "W_UK"), rtol=0.0)
def _absorbed_scores(q_c, c_lat, w_uk):
    scores = q_c @ (c_lat @ w_uk).T
    return scores, {"the scores scaled by 1/sqrt(d_k): the exercise asks for q_hat c_j^T":
                    scores / np.sqrt(np.shape(w_uk)[1])}


_S3 = "the section 'S3: how much each attention design saves, computed'"


def _deepseek_v2_numbers(kind: str) -> float:
    """Numbers cached per token and layer by DeepSeek-V2's attention shape, as MLA or as MHA."""
    from refmath.sizing import PRESETS, attention_cache_rows

    ds = PRESETS["deepseek-v2"]
    rows = {r.kind: r for r in attention_cache_rows(ds.n_layers, ds.n_heads, ds.kv_heads,
                                                    ds.head_dim, 8192, latent_dim=ds.d_c,
                                                    rope_dim=ds.d_rope)}
    return rows[kind].bytes_per_token / (ds.n_layers * 2)


@_exercise("11.4a", "MLA numbers per token and layer", _S3, "the latent d_c and the rotary key d_R",
           rtol=0.0)
def _mla_numbers():
    mla = _deepseek_v2_numbers("MLA")
    return mla, {"the latent alone: the shared rotary key (64 numbers) is cached too": mla - 64,
                 "x2 for K and V: MLA caches one latent for both": 2 * mla}


@_exercise("11.4b", "MHA numbers per token and layer", _S3, "2 (K and V) x h x d_h", rtol=0.0)
def _mha_numbers():
    mha = _deepseek_v2_numbers("MHA")
    return mha, {"K or V only: the cache holds both, a factor 2": mha / 2}


@_exercise("11.4c", "MHA / MLA", _S3, "the MHA count over the MLA count")
def _mha_over_mla():
    ratio = _deepseek_v2_numbers("MHA") / _deepseek_v2_numbers("MLA")
    return ratio, {"MLA / MHA, the ratio upside down": 1 / ratio}


_K11 = "the section 'K11: sharing a prompt between sequences, and copying on write'"


def _pages_used(shared: bool) -> int:
    """Pages in use after 16 samples of a 1000-token prompt (pages of 16 tokens) each append one
    token: forked from one prompt (the original appends last), or each with its own copy."""
    from refmath.inference.paged import PagedKVCache

    def kv(values):
        x = np.repeat(np.asarray(values, dtype=float)[:, None, None], 2, axis=2)
        return x, -x
    cache = PagedKVCache(n_pages=1100, page_size=16, n_kv_heads=1, head_dim=2)
    if shared:
        cache.add_sequence(0)
        cache.append(0, *kv(np.arange(1000)))
        for child in range(1, 16):
            cache.fork(0, child)
    for seq in range(15, -1, -1):
        if not shared:
            cache.add_sequence(seq)
            cache.append(seq, *kv(np.arange(1000)))
        cache.append(seq, *kv([1000 + seq]))
    return cache.pages_used


@_exercise("11.5a", "pages with sharing", _K11,
           "the full prompt pages once, its part-full last page, and one copy per fork", rtol=0.0)
def _pages_shared():
    used = _pages_used(shared=True)
    return used, {"no copy on write: the forks' tokens taken to fit in the shared last page":
                  used - 15,
                  "a copy for every sample, the original too": used + 1}


@_exercise("11.5b", "pages without sharing", _K11,
           "each sample holds the whole prompt: 16 x ceil(1000 / 16)", rtol=0.0)
def _pages_unshared():
    used = _pages_used(shared=False)
    return used, {"a new page for each sample's token: the last prompt page holds 8 tokens, "
                  "with room to spare": used + 16}


_S1 = "the section 'S1 and S2: memory for serving and for training'"


@_exercise("11.6a", "serving, rule of thumb", _S1, "2 bytes a parameter, times 1.2")
def _serve_bytes():
    from refmath.sizing import inference_memory_rule_of_thumb

    total = inference_memory_rule_of_thumb(1000).total
    return total, {"the weights alone, 2 P: the 20% allowance forgotten": total / 1.2}


@_exercise("11.6b", "AdamW training state", _S1,
           "2 + 2 + 4 + 8 bytes a parameter: weights, gradients, master copy, two moments",
           rtol=0.0)
def _train_bytes():
    from refmath.sizing import adamw_training_memory

    total = adamw_training_memory(1000).total
    return total, {"12 bytes a parameter: the master copy or one of the two moments forgotten":
                   total * 12 / 16,
                   "the fp16 weights and gradients alone, 4 bytes a parameter": total * 4 / 16}


# ---- lesson 12: the float32 rule (12.2 and 12.4 are above)

@_exercise("12.1", "the rule's bound on o", "the section 'F4 in float32: how close is close "
           "enough'", "c = 2 for an output; the floor is 4 u max|v| with u = 2^-24",
           uses=("ref_o", "np32_o", "vg"))
def _float32_bound(ref_o, np32_o, vg):
    u = 2.0**-24  # float32's unit roundoff
    error = float(np.abs(np.asarray(np32_o, dtype=np.float64) - ref_o).max())
    big_v = float(np.abs(vg).max())
    return 2 * error + 4 * u * big_v, {
        "u = 2^-23: that is the gap after 1, the unit roundoff is half of it":
            2 * error + 4 * 2.0**-23 * big_v,
        "the floor 4 u M left out": 2 * error,
        "c = 3, the factor of the gradients": 3 * error + 4 * u * big_v,
        "M = max |o|: the floor is set by the values summed, max |v|":
            2 * error + 4 * u * float(np.abs(ref_o).max()),
        "NumPy's error taken in float32, against the reference rounded to float32":
            2 * float(np.abs(np32_o - np.asarray(ref_o).astype(np.float32)).max()) + 4 * u * big_v}


# ---- lesson 13: real weights

@_exercise("13.1", "the embedding read from the file", "the section 'The safetensors format'",
           "the offsets count from the end of the header, 8 + N bytes into the file",
           uses=("params",), rtol=0.0)
def _embedding_from_file(params):
    return params["tok_emb"], {}


@_exercise("13.2", "W_Q from q_proj.weight", "the section 'Two "
           "RoPE layouts, one function'", "within each head: half coordinate r, then r + d_h/2",
           uses=("heads", "d_h"), rtol=0.0)
def _interleaved_rows(heads, d_h):
    from refmath import hf

    moved = hf.interleaved_to_half(np.arange(heads * d_h), d_h)  # half row j <- interleaved moved[j]
    return np.argsort(moved), {
        "the rows in Hugging Face's order, unpermuted: its halves layout is not refmath's "
        "interleaved one": np.arange(heads * d_h),
        "the permutation the other way: interleaved to half, not back": moved}


@_exercise("13.4", "the bfloat16 patterns as numbers", "the section 'bfloat16 without bfloat16'",
           "shift the 16 bits into the upper half of a uint32", uses=("patterns",), rtol=0.0)
def _bfloat16_values(patterns):
    patterns = np.asarray(patterns, dtype=np.uint16)
    s, e, m = patterns >> 15, (patterns >> 7) & 0xFF, patterns & 0x7F
    if not np.all((e > 0) & (e < 255)):
        raise ValueError("13.4: the formula holds for normal numbers only")
    return (-1.0) ** s * 2.0 ** (e.astype(np.int64) - 127) * (1 + m / 2**7), {
        "the patterns read as float16: bfloat16 has float32's 8 exponent bits":
            patterns.view(np.float16).astype(np.float32)}


_GPT2_CONFIG = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
                "n_layer": 12, "n_head": 12}
_REAL_NEEDS = "the section 'What a real model needs'"


@_exercise("13.5a", "this lesson's parameter count", _REAL_NEEDS,
           "embeddings, then per layer two RMSNorms, the four attention and three FFN matrices, "
           "then the final norm (and an untied output)", uses=("hf_config",), rtol=0.0)
def _tiny_count(hf_config):
    from refmath.sizing import hf_parameter_count

    total = hf_parameter_count(hf_config)
    d = hf_config["hidden_size"]
    return total, {"the final norm forgotten (d)": total - d}


@_exercise("13.5b", "GPT-2 small's parameter count", _REAL_NEEDS,
           "the final LayerNorm and the position table count too", rtol=0.0)
def _gpt2_count():
    from refmath.sizing import hf_parameter_count

    total = hf_parameter_count(_GPT2_CONFIG)
    return total, {"the position table forgotten (1024 x 768)": total - 1024 * 768,
                   "the final LayerNorm forgotten (2 x 768)": total - 2 * 768,
                   "an output matrix counted: GPT-2 ties it to the token table":
                       total + 50257 * 768}


@_exercise("13.5c", "GPT-2 small in float32, MiB", _REAL_NEEDS,
           "4 bytes a parameter, and a MiB is 2^20 bytes")
def _gpt2_mib():
    from refmath.sizing import hf_parameter_count

    total = hf_parameter_count(_GPT2_CONFIG)
    return 4 * total / 2**20, {"MB (10^6 bytes), not MiB (2^20)": 4 * total / 1e6,
                               "2 bytes per parameter: that is bfloat16, not float32":
                                   2 * total / 2**20}


# ---- lesson 14: the synthesis

@_exercise("14.1", "logits of the whole decoder", "the section 'The recurrence'",
           "rotate Q and K after splitting heads; values are never rotated",
           uses=("params", "tokens", "config"), rtol=1e-10, atol=1e-12)
def _decoder_logits(params, tokens, config):
    from refmath.models import decoder

    return decoder.logits(params, tokens, config), catalogued(
        "sdpa: the 1/sqrt(d_k) scale missing from the scores",
        lambda: decoder.logits(params, tokens, config))


@_exercise("14.2", "MHA twin of the GQA decoder", "the section 'From the Transformer to an LLM: "
           "what each change acts on'", "head r of the twin reads shared head gqa_head_map(h, g)[r]",
           uses=("params", "tokens", "config"), rtol=1e-10, atol=1e-12)
def _mha_twin_logits(params, tokens, config):
    from refmath.models import decoder

    # the twin is the same function: its logits are the GQA decoder's
    return decoder.logits(params, tokens, config), {}


@_exercise("14.3", "bound on the speed-up", "the section 'The cost of one decode step, all "
           "together'", "the sum of weights and cache for MHA, over the same sum for int4 GQA",
           uses=("batch", "context"))
def _speedup_bound(batch, context):
    gqa_weights = 2 * 7_504_658_432  # bf16 weights a GQA step multiplies by (lesson 10)
    mha_weights = gqa_weights + 2 * 32 * 2 * 4096 * (32 - 8) * 128  # wider W_K, W_V in 32 layers
    mha_cache = batch * context * 2 * 32 * 32 * 128 * 2  # 2 B T L g d_h b with g = 32
    int4_payload = batch * context * 2 * 32 * 8 * 128 * 4 / 8
    int4_cache = int4_payload + batch * context * 2 * 32 * 8 * 128 * 2 / 32  # and the scales
    return (mha_weights + mha_cache) / (gqa_weights + int4_cache), {
        "the caches alone: the weights are read at every step too": mha_cache / int4_cache,
        "the int4 cache without its scales (2 bytes per group of 32)":
            (mha_weights + mha_cache) / (gqa_weights + int4_payload),
        "the cache ratio upside down": (gqa_weights + int4_cache) / (mha_weights + mha_cache)}


# ---- lesson 15: mixture of experts

_E7 = "the section 'E7, E2, E3: top-2 routing by hand'"
_E5 = "the section 'E5: load balance'"
_E8 = "the section 'E8: total against active parameters'"
_E9 = "the section 'E9, E10: the memory against the compute, and the all-to-all'"


def _worked_routing(logits):
    """(probabilities, Mixtral's routing, the routing without renormalised gates) of the worked
    example, whose router input is the logits themselves (W_r = I)."""
    from refmath.moe import MoEConfig, route, router_scores

    probs = router_scores(logits, np.eye(np.shape(logits)[1]))[1]
    n = np.shape(logits)[1]
    return (probs, route(probs, MoEConfig(n_experts=n, top_k=2, d_expert=1, norm_topk=True)),
            route(probs, MoEConfig(n_experts=n, top_k=2, d_expert=1)))


@_exercise("15.1a", "the probabilities", _E7, "a softmax along each row, over the experts",
           uses=("worked_logits",))
def _worked_probabilities(logits):
    probs = _worked_routing(logits)[0]
    e = np.exp(logits)
    return probs, {"exp(z) without dividing by its sum": e,
                   "the softmax over the wrong axis: over the tokens (columns), not the experts":
                       e / e.sum(axis=0)}


@_exercise("15.1b", "the top-2 experts", _E7,
           "best first; equal probabilities go to the lower index", uses=("worked_logits",),
           rtol=0.0)
def _worked_top2(logits):
    probs, mixtral, _ = _worked_routing(logits)
    chosen = mixtral[0]
    ascending = np.argsort(probs, axis=1, kind="stable")
    return chosen, {"an ascending argsort reversed: ties go to the higher index":
                    ascending[:, ::-1][:, :2],
                    "the two smallest probabilities (argsort is ascending)": ascending[:, :2],
                    "experts numbered from 1: refmath, like NumPy, numbers them from 0":
                        chosen + 1}


@_exercise("15.1c", "the gates", _E7, "the chosen probabilities divided by their sum",
           uses=("worked_logits",))
def _worked_gates(logits):
    from refmath.softmax import softmax_forward

    _, mixtral, plain = _worked_routing(logits)
    return mixtral[1], {"not renormalised: the chosen probabilities themselves": plain[1],
                        "a softmax over the chosen probabilities, not a division by their sum":
                            softmax_forward(plain[1])[0]}


def _load_of(probs, first_only: bool = False):
    from refmath.moe import MoEConfig, expert_load, route

    n = np.shape(probs)[1]
    chosen = route(probs, MoEConfig(n_experts=n, top_k=2, d_expert=1))[0]
    return expert_load(chosen[:, :1] if first_only else chosen, n)


@_exercise("15.2a", "the load", _E5, "count each expert among every token's two choices",
           uses=("probs6",), rtol=0.0)
def _load6(probs):
    return _load_of(probs), {"the first choice only": _load_of(probs, first_only=True)}


@_exercise("15.2b", "L_ExpBal", _E5, "f_i = E / (k N) load_i, P_i the mean probability; sum f P",
           uses=("probs6",))
def _balance_loss6(probs):
    from refmath.moe import expert_balance_loss

    load, (n, e) = _load_of(probs), np.shape(probs)
    mean_p = np.asarray(probs).mean(axis=0)
    return expert_balance_loss(probs, load, 2)[0], {
        "Switch's and Mixtral's (E / N) sum load P: k times DeepSeek's":
            e / n * np.sum(load * mean_p),
        "f_i = load_i, without E / (k N)": np.sum(load * mean_p),
        "the load of the first choices only":
            expert_balance_loss(probs, _load_of(probs, first_only=True), 1)[0]}


@_exercise("15.3", "the biases after one update", "the section 'E6: DeepSeek-V3's bias balancing'",
           "b_i - gamma sign(load_i - mean load)", uses=("bias_before", "load_step"))
def _bias_after(bias, load):
    from refmath.moe import balance_bias_update

    load = np.asarray(load, dtype=np.float64)
    return balance_bias_update(bias, load, 0.001), {
        "the sign flipped: the overloaded expert's bias raised":
            balance_bias_update(bias, -load, 0.001),
        "a step of gamma (load - mean), not gamma sign(load - mean)":
            bias - 0.001 * (load - load.mean())}


def _toy_counts():
    from refmath.moe import MoEConfig
    from refmath.sizing import ModelConfig, active_parameters

    return active_parameters(ModelConfig(
        "toy-moe", n_layers=4, d_model=256, n_heads=4, kv_heads=4, head_dim=64, vocab_size=1000,
        moe=MoEConfig(n_experts=8, top_k=2, d_expert=512, n_shared=1)))


_ONE_EXPERT = 3 * 256 * 512  # a SwiGLU expert: three d x d_e matrices


@_exercise("15.4a", "the total", _E8, "every expert counts, the shared one too, and the untied "
           "output matrix", rtol=0.0)
def _toy_total():
    total = _toy_counts().total
    return total, {"the shared expert forgotten": total - 4 * _ONE_EXPERT,
                   "the output matrix forgotten (it is untied)": total - 1000 * 256,
                   "2 d d_e per expert: a SwiGLU has three matrices": total - 4 * 9 * 256 * 512}


@_exercise("15.4b", "the active parameters", _E8,
           "the total less the E - k routed experts each token leaves idle, in every layer",
           rtol=0.0)
def _toy_active():
    counts = _toy_counts()
    return counts.active, {
        "all E routed experts taken off, the k chosen ones too": counts.total - 4 * 8 * _ONE_EXPERT,
        "2 d d_e per idle expert taken off a right total: a SwiGLU has three matrices":
            counts.total - 4 * 6 * 2 * 256 * 512,
        # the two slips give one number: 9 experts at 2 d d_e less 6 idle ones is 21 d d_e a
        # layer, as is the shared expert's 3 d d_e more taken off
        "3 d d_e a layer short: 2 d d_e per expert throughout (a SwiGLU has three matrices), "
        "or the shared expert taken off as well": counts.active - 4 * _ONE_EXPERT}


@_exercise("15.5a", "bytes on 64 devices", _E9,
           "2 (there and back) x k x (1 - 1/D) x d x b", rtol=1e-12)
def _bytes_64_devices():
    from refmath.sizing import expert_parallel_bytes

    both = expert_parallel_bytes(7168, 8, 64)
    return both, {"one way only: the outputs come back too": both / 2,
                  "(1 - 1/D) left out: an expert on the token's own device costs nothing":
                      2 * 8 * 7168 * 2}


@_exercise("15.5b", "bytes, node-limited", _E9,
           "a node receives the token once: min(k, M) sends, with (1 - 1/nodes)", rtol=1e-12)
def _bytes_node_limited():
    from refmath.sizing import expert_parallel_bytes

    both = expert_parallel_bytes(7168, 8, 8, max_devices=4)
    return both, {"k sends: a node receives the token once, min(k, M) in all":
                  expert_parallel_bytes(7168, 8, 8),
                  "one way only: the outputs come back too": both / 2}


# ---- lesson 16: the capstone

@_exercise("16.5", "your model's gradients against the library's", "the section 'The whole "
           "model, checked'", "each of your four backward passes is checked above: fix the one "
           "whose check is not right", uses=("cache", "backward", "library"), rtol=1e-10,
           atol=1e-14, prepare=_flat_parameters)
def _capstone_gradients(cache, backward, library):
    # the lesson's own backward through the model, with the library's four functions inside
    return _flat_parameters(backward(cache, library)), {}
