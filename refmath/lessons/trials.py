"""The inputs a write-the-function exercise is tried on: argument tuples of its own, or the
registry's gradient cases drawn as :func:`refmath.gradcheck.check_case` draws them; and the call
on a private copy of them."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

__all__ = ["Trial", "call_on_copy", "trials_of_cases", "resolve_cases"]


class Trial(NamedTuple):
    """One set of arguments a function exercise is called with."""

    label: str  # where, for the verdict: a registry case's name, or "input 2"
    args: tuple
    kwargs: dict
    case: Any = None  # the registry's OpCase (a backward exercise)
    seed: int = 0
    inputs: dict | None = None  # the case's forward inputs (for the torch oracle)
    dout: np.ndarray | None = None


def call_on_copy(func: Callable, trial: Trial) -> Any:
    """``func`` on a private copy of the trial's arguments (a function that updates its arguments
    in place must not change what the next function sees)."""
    import copy

    return func(*copy.deepcopy(trial.args), **copy.deepcopy(trial.kwargs))


def trials_of_cases(cases, seeds) -> list[Trial]:
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
            trials.append(Trial(label, (dout, cache), {}, case, seed, inputs, dout))
    return trials


def resolve_cases(case) -> list:
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
