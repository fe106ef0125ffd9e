"""The list of every differentiable op, each with a small input generator.

Each op module registers its own cases at its end (``register_case(OpCase(...))``), next to the
code they exercise. The gradient-check suite, the PyTorch oracle tests and ``python -m refmath
gradcheck`` all iterate over :func:`all_cases`, so a new op is checked everywhere once it is
registered here, with no hand-written list per test.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

# Modules that register cases; importing them fills the registry.
OP_MODULES = (
    "refmath.softmax",
    "refmath.attention",
    "refmath.norms",
    "refmath.ffn",
    "refmath.positions",
    "refmath.embedding",
    "refmath.losses",
)


@dataclass(frozen=True)
class OpCase:
    """One op on one kind of input.

    ``make_inputs(rng)`` returns a dict of float64 inputs (plus any non-differentiable ones such as
    masks or token ids). ``forward(**inputs)`` returns ``(out, cache)`` with a single array ``out``;
    ``backward(dout, cache)`` returns the gradients of the inputs named in ``wrt``, either as a
    tuple in that order, a single array when ``wrt`` has one name, or a dict keyed by those names.
    """

    op: str
    label: str
    ids: tuple[str, ...]
    make_inputs: Callable[[np.random.Generator], dict]
    forward: Callable
    backward: Callable
    wrt: tuple[str, ...]
    bound: float = 1e-6

    @property
    def name(self) -> str:
        return f"{self.op}[{self.label}]"

    def grads_by_name(self, grads) -> dict[str, np.ndarray]:
        """Normalise whatever ``backward`` returned into ``{input name: gradient}``."""
        if isinstance(grads, dict):
            return {k: grads[k] for k in self.wrt}
        if isinstance(grads, np.ndarray):
            grads = (grads,)
        if len(grads) != len(self.wrt):
            raise ValueError(f"{self.name}: backward returned {len(grads)} gradients for {self.wrt}")
        return dict(zip(self.wrt, grads))


_CASES: dict[str, OpCase] = {}


def register_case(case: OpCase) -> OpCase:
    """Add ``case`` to the registry; names must be unique."""
    if case.name in _CASES:
        raise ValueError(f"duplicate op case {case.name!r}")
    _CASES[case.name] = case
    return case


def all_cases() -> list[OpCase]:
    """Every registered case, in module order."""
    for module in OP_MODULES:
        importlib.import_module(module)
    return list(_CASES.values())
