"""The verdict on a whole function a student wrote: a forward against the library's on inputs of
the check's choosing, a backward against central differences too, and against torch where it is
importable; a wrong function is named by the slip function it matches, and the library itself is
refused as the answer (:mod:`refmath.lessons.library_refusal`)."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from refmath.lessons.checks import (NOT_YET, SLIP_RTOL, Verdict, _diagnose, _not_attempted, _rationed,
                                    _unanswered, _verdict, _within, strict)
from refmath.lessons.library_refusal import library_used
from refmath.lessons.trials import call_on_copy, resolve_cases, Trial, trials_of_cases

__all__ = ["check_function"]


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


def _outputs(value: Any, names: tuple[str, ...], trial: Trial) -> list[np.ndarray]:
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


def _evaluate(func: Callable, trials: list[Trial], names) -> list[list[np.ndarray]]:
    results = []
    for trial in trials:
        try:
            value = call_on_copy(func, trial)
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
            return [_outputs(call_on_copy(oracle, trial), names, trial) for trial in trials], ""
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
    refmath.lessons.checks.Verdict
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
        cases = resolve_cases(case)
        trials = trials_of_cases(cases, tuple(seeds))
        names = tuple(f"d{w}" for w in cases[0].wrt)
    else:
        given = inputs() if callable(inputs) else inputs
        trials = [Trial(f"input {i + 1}", tuple(a), {}) if isinstance(a, (tuple, list))
                  else Trial(f"input {i + 1}", (), dict(a)) for i, a in enumerate(given)]
        if not trials:
            raise ValueError("check_function: inputs is empty")
        names = _output_names(call_on_copy(reference, trials[0]), outputs)

    try:
        unwritten = _unwritten(call_on_copy(func, trials[0]))
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
