"""``check("05.3", answer)``: the verdict on a numbered exercise, its expected value and slips
(or, for a function the student writes, its reference, inputs and slips) taken from the table
(:mod:`refmath.lessons.table`), and its hint on request."""
from __future__ import annotations

from typing import Any, Mapping

import refmath.lessons.expected  # noqa: F401  (fills the table, one file per lesson)
from refmath.lessons.checks import (Verdict, _not_attempted, _rationed, _unanswered, _verdict,
                                    check_close)
from refmath.lessons.leaks import record_expected
from refmath.lessons.functions import check_function
from refmath.lessons.table import EXERCISES, Exercise, FunctionExercise, layout_difference

__all__ = ["check", "hint"]


def _exercise_of(number: str) -> Exercise | FunctionExercise:
    if number not in EXERCISES:
        raise ValueError(f"no exercise numbered {number!r} (known: {', '.join(sorted(EXERCISES))})")
    return EXERCISES[number]


def check(number: str, answer: Any) -> Verdict:
    """Print the verdict on the student's ``answer`` to exercise ``number`` ("05.3").

    The expected value is computed here, from the library and the lesson's inputs (read by name
    from the caller's namespace); a wrong answer is diagnosed as :func:`check_close` does, with the
    section to reread after a first miss and the hint from the second on. The answer to a
    write-the-function exercise is the student's function, judged by
    :func:`~refmath.lessons.functions.check_function` against the table's reference (which the
    student's may not call)."""
    import sys

    exercise, caller = _exercise_of(number), sys._getframe(1)
    if isinstance(exercise, FunctionExercise):
        # the options are built even before an answer, as the lesson's check cell built them: an
        # exercise whose inputs draw from the lesson's generator draws the same numbers either way
        inputs = _lesson_values(exercise.name, exercise.uses, caller)
        return check_function(exercise.name, answer, hint=exercise.hint,
                              **exercise.options(*inputs))
    if _not_attempted(answer):
        record_expected(exercise.name, lambda: _expected_and_slips(exercise, caller)[0])
        return _unanswered(exercise.name)
    expected, slips = _expected_and_slips(exercise, caller)
    given = answer  # as the student wrote it: where an index of the prepared array points
    if exercise.prepare is not None:
        try:
            answer = exercise.prepare(answer)
        except Exception as err:  # the answer has the wrong kind: say so, as check_close would
            return _verdict("wrong", exercise.name, f"not what the exercise asks for "
                            f"({type(err).__name__}: {err})")
        # a set of parameters: its names and shapes before its numbers, which alone would take a
        # renamed key or a reshaped array for the right one (see layout_difference)
        differs = layout_difference(answer, expected)
        if differs is not None:
            record_expected(exercise.name, expected)
            return _verdict("wrong", exercise.name, differs + _rationed(
                exercise.name, exercise.hint, exercise.section))
    where = None if exercise.where is None else (lambda index: exercise.where(given, index))
    return check_close(exercise.name, answer, expected, rtol=exercise.rtol, atol=exercise.atol,
                       hint=exercise.hint, section=exercise.section, slips=slips, where=where)


def _lesson_values(name: str, uses: tuple[str, ...], frame) -> list[Any]:
    """The values of the lesson's variables ``uses`` in the namespace of the check's caller."""
    names = {**frame.f_builtins, **frame.f_globals, **frame.f_locals}
    missing = [n for n in uses if n not in names]
    if missing:
        raise NameError(f"{name}: the check reads the lesson's {', '.join(missing)}; "
                        "run the lesson's cells above it first")
    return [names[n] for n in uses]


def _expected_and_slips(exercise: Exercise, frame) -> tuple[Any, Mapping[str, Any]]:
    inputs = _lesson_values(exercise.name, exercise.uses, frame)
    return exercise.expected(*inputs), exercise.slips(*inputs)


def hint(number: str) -> None:
    """Print the hint of exercise ``number`` now, without a second miss."""
    exercise = _exercise_of(number)
    print(f"hint: {exercise.name}: {exercise.hint} (see {exercise.section})")
