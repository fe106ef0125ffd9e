"""The table of the lessons' numbered exercises, filled by the files of
:mod:`refmath.lessons.expected`, one per lesson.

A lesson's check cell is one call, ``check("05.3", answer)``: the expected value, the known slips
and the hint live here, computed from the library, so that nothing in the lesson (not the check
cell's source on the student site, not a variable, not a print) holds the answer before the
student has tried. An exercise computes from the lesson's own inputs, read by name from the
namespace that calls the check (``uses``), so the numbers the student sees are the numbers
checked, and the lesson stays the one place they are written.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

__all__ = ["Exercise", "FunctionExercise", "EXERCISES", "exercise", "function_exercise",
           "FlatParameters", "flat_parameters", "layout_difference", "parameter_at"]


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
    # (answer as given, index into the prepared array) -> what sits there, in the answer's own
    # terms (a parameter and its element): so that "error at index (1234,)" says what 1234 is
    where: Callable[[Any, tuple[int, ...]], str] | None = None


class FunctionExercise(NamedTuple):
    """One write-the-function exercise of a lesson, checked by
    :func:`refmath.lessons.functions.check_function`."""

    name: str  # what the verdict calls the student's function
    section: str  # the lesson's section to reread
    hint: str  # given from the second miss on, or by hint()
    options: Callable[..., dict]  # check_function's keyword arguments: reference, inputs, slips...
    uses: tuple[str, ...] = ()  # the lesson's variables ``options`` takes, by name


EXERCISES: dict[str, Exercise | FunctionExercise] = {}


def exercise(number: str, name: str, section: str, hint: str, uses: tuple[str, ...] = (),
             rtol: float = 1e-12, atol: float = 0.0, prepare: Callable[[Any], Any] | None = None,
             where: Callable[[Any, tuple[int, ...]], str] | None = None):
    """Register the decorated ``(*uses) -> (expected, slips)`` function as exercise ``number``.

    ``where(answer, index)`` names the element at ``index`` of the prepared answer in the terms of
    the answer as given; with ``prepare=flat_parameters`` it is :func:`parameter_at` unless given."""
    if where is None and prepare is flat_parameters:
        where = parameter_at

    def register(both: Callable[..., tuple[Any, Mapping[str, Any]]]):
        EXERCISES[number] = Exercise(name, section, hint, lambda *a: both(*a)[0],
                                     lambda *a: both(*a)[1], uses, rtol, atol, prepare, where)
        return both
    return register


def function_exercise(number: str, name: str, section: str, hint: str,
                      uses: tuple[str, ...] = ()):
    """Register the decorated ``(*uses) -> dict`` function, which gives the keyword arguments of
    :func:`refmath.lessons.functions.check_function` (``reference``, ``inputs`` or ``case``,
    ``slips``, ``oracle``...) from the lesson's variables named in ``uses`` (its worked example,
    its random generator), as the write-the-function exercise ``number``. The hint and the slips
    live here, not in the lesson's check cell, so that the cell (``check("01.2", my_attention)``)
    shows no formula before the student's attempt."""
    def register(options: Callable[..., dict]):
        EXERCISES[number] = FunctionExercise(name, section, hint, options, tuple(uses))
        return options
    return register


class FlatParameters(np.ndarray):
    """The vector :func:`flat_parameters` makes, with ``layout``: the ``(name, shape)`` of each
    array in it, in order. The numbers alone do not say which parameter they came from: an answer
    with a key renamed (that sorts where the old one did), an array reshaped, or a key missing or
    added would be compared by position, or fail only by its total length; with the layout, a
    check compares the names and the shapes first (:func:`layout_difference`).

    The layout is set by :func:`flat_parameters` only: any array made from this one (a slice, a
    product, a copy) has ``layout`` None, since its positions need not hold the same parameters."""

    layout: tuple[tuple[str, tuple[int, ...]], ...] | None

    def __array_finalize__(self, obj) -> None:
        self.layout = None


def flat_parameters(params) -> np.ndarray:
    """A dict of arrays as one float64 vector, its names in sorted order: how an exercise whose
    answer is a set of parameters compares it (``prepare=flat_parameters``). The vector is a
    :class:`FlatParameters` that keeps each name and shape, so that the check compares them before
    the values (:func:`layout_difference`)."""
    if not isinstance(params, Mapping):
        raise TypeError(f"flat_parameters: expected a dict of arrays by parameter name, got "
                        f"{type(params).__name__}")
    names = sorted(params)
    arrays = [np.asarray(params[n], dtype=np.float64) for n in names]
    flat = np.concatenate([a.ravel() for a in arrays] or [np.zeros(0)]).view(FlatParameters)
    flat.layout = tuple((str(n), a.shape) for n, a in zip(names, arrays))
    return flat


def _listed(names: list[str], most: int = 4) -> str:
    """``names`` joined by commas, the first ``most`` of them and a count of the rest."""
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def layout_difference(got: Any, want: Any) -> str | None:
    """What differs between the parameter names and shapes of two :func:`flat_parameters`
    vectors, as the verdict says it, or None when they agree (or either has no layout).

    Names first, in one line: ``"missing: ln_f.beta; unexpected: ln_f.bias"``; then the first
    array whose shape differs, by name: ``"layers.0.ffn.b1 has shape (1, 128), expected
    (128,)"``, with how many more do. Only then are the values worth comparing: a renamed key
    that sorts where the right one did, or a (1, n) row for an (n,) vector, holds the right
    numbers in the right positions and would pass."""
    got_layout, want_layout = getattr(got, "layout", None), getattr(want, "layout", None)
    if got_layout is None or want_layout is None:
        return None
    have, expected = dict(got_layout), dict(want_layout)
    missing = [n for n in expected if n not in have]
    unexpected = [n for n in have if n not in expected]
    if missing or unexpected:
        return "; ".join(f"{what}: {_listed(names)}" for what, names in
                         (("missing", missing), ("unexpected", unexpected)) if names)
    reshaped = [n for n in expected if have[n] != expected[n]]
    if reshaped:
        first = reshaped[0]
        more = len(reshaped) - 1
        return (f"{first} has shape {have[first]}, expected {expected[first]}"
                + (f" ({more} more parameter{'s' if more > 1 else ''} of another shape too)"
                   if more else ""))
    return None


def parameter_at(params, index: tuple[int, ...]) -> str:
    """The parameter and element that position ``index`` of :func:`flat_parameters` ``(params)``
    holds, as ``"name[i, j]"`` (``"name"`` alone for a scalar): the flat vector is the sorted
    names' arrays one after another, each in C order, so position p falls in the first name whose
    running size passes p, at p minus the sizes before it, unravelled in that array's shape."""
    (position,) = index
    start = 0
    for name in sorted(params):
        shape = np.shape(params[name])
        size = int(np.prod(shape, dtype=np.int64))
        if position < start + size:
            element = np.unravel_index(position - start, shape) if shape else ()
            return name + (f"[{', '.join(str(int(i)) for i in element)}]" if shape else "")
        start += size
    raise IndexError(f"parameter_at: position {position} is past the {start} numbers of the parameters")
