"""The list of every hand-written gradient, each with a small input generator.

Each module registers its own cases at its end (``register_case(OpCase(...))``), next to the code
they exercise. The cases come in three groups:

- ``"ops"``: one equation each (softmax, layernorm, sdpa, ...), an :class:`OpCase`;
- ``"attention execution"``: attention as the models and kernels run it (the FlashAttention
  reference's tiled backward, RoPE attention, MLA attention), also :class:`OpCase`;
- ``"models"``: a whole network's loss against its parameter dict, a :class:`ParamCase`.

The gradient-check suite, the PyTorch oracle tests and ``python -m refmath gradcheck`` iterate over
:func:`refmath.gradcheck.all_cases`, so a new op is checked everywhere once it is registered here,
with no hand-written list per test.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["GROUPS", "OpCase", "ParamCase", "layer_case_ops", "register_case", "registered"]

GROUPS = ("ops", "attention execution", "models")


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
    group: str = "ops"
    max_coords: int | None = None  # at most this many coordinates per input (the slow cases)
    # The stencil's step and rounding factor (refmath.gradcheck); None: the defaults there
    step: float | None = None
    kappa: float | None = None

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


@dataclass(frozen=True)
class ParamCase:
    """A scalar loss of a flat parameter dict with a hand-written gradient dict (a whole model).

    ``make(rng)`` returns ``(params, forward)``: float64 parameters and ``forward(params) ->
    (loss, cache)`` with the batch, the config and any dropout seed fixed inside it, so that every
    call computes the same function. ``backward(cache)`` returns the gradient dict. The check
    samples ``max_coords`` coordinates of every parameter array.
    """

    op: str
    label: str
    ids: tuple[str, ...]
    make: Callable[[np.random.Generator], tuple]
    backward: Callable
    group: str = "models"
    max_coords: int = 4
    step: float | None = None
    kappa: float | None = None

    @property
    def name(self) -> str:
        return f"{self.op}[{self.label}]"


_CASES: dict[str, OpCase | ParamCase] = {}


def layer_case_ops(forward, backward):
    """``(forward, backward)`` of a case for a layer ``forward(x, params, config) -> (y, cache)``
    with ``backward(dy, cache) -> (dx, dparams)``: the case passes ``x``, ``config`` and each
    parameter by name, and gets the gradients back as one dict keyed by those names."""
    def case_forward(x, config, **params):
        return forward(x, params, config)

    def case_backward(dy, cache):
        dx, grads = backward(dy, cache)
        return {"x": dx, **grads}

    case_forward.__module__ = forward.__module__  # all_cases lists the case with its layer's module
    return case_forward, case_backward


def register_case(case: OpCase | ParamCase) -> OpCase | ParamCase:
    """Add ``case`` to the registry; names must be unique and the group one of :data:`GROUPS`."""
    if case.name in _CASES:
        raise ValueError(f"duplicate op case {case.name!r}")
    if case.group not in GROUPS:
        raise ValueError(f"{case.name}: group must be one of {GROUPS}, got {case.group!r}")
    _CASES[case.name] = case
    return case


def registered() -> list:
    """Every case registered so far, in the order of registration (the modules that register
    cases are imported by :func:`refmath.gradcheck.all_cases`, which lists them in order)."""
    return list(_CASES.values())
