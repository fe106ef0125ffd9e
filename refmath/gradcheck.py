"""Numerical gradients and the vector-Jacobian check.

For an op ``y = f(x)`` and a random upstream gradient ``dout`` (the same shape as ``y``), the
analytic gradient ``backward(dout)`` must equal the gradient of the scalar
``phi(x) = sum(f(x) * dout)``, which we estimate by central differences in float64.

We use the five-point central stencil

    phi'(x) ~ (phi(x - 2h) - 8 phi(x - h) + 8 phi(x + h) - phi(x + 2h)) / (12 h),

whose truncation error is O(h^4) instead of the O(h^2) of the two-point rule. With h = 1e-3 both
truncation (~h^4) and rounding (~1e-16 |phi| / h) stay near 1e-13, so even gradient entries of size
1e-5 are checked to a relative error well below the 1e-6 bound.

The relative error of one entry is ``|a - n| / max(1e-12, |a| + |n|)``; a check reports the largest
over the coordinates it tried. Large inputs are checked on a random sample of coordinates.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refmath.registry import OpCase

STEP = 1e-3


def relative_error(analytic: np.ndarray, numeric: np.ndarray) -> np.ndarray:
    """Entry-wise ``|a - n| / max(1e-12, |a| + |n|)``."""
    analytic = np.asarray(analytic, dtype=np.float64)
    numeric = np.asarray(numeric, dtype=np.float64)
    return np.abs(analytic - numeric) / np.maximum(1e-12, np.abs(analytic) + np.abs(numeric))


def numerical_gradient(phi, x: np.ndarray, coords, h: float = STEP) -> np.ndarray:
    """Five-point central differences of the scalar function ``phi()`` w.r.t. ``x.flat[coords]``.

    ``x`` is perturbed in place and restored, so ``phi`` reads it through a closure.
    """
    flat = x.reshape(-1)  # a view: x must be contiguous
    grads = np.empty(len(coords), dtype=np.float64)
    for n, i in enumerate(coords):
        saved = flat[i]
        values = []
        for step in (-2, -1, 1, 2):
            flat[i] = saved + step * h
            values.append(phi())
        flat[i] = saved
        f_m2, f_m1, f_p1, f_p2 = values
        # Differences first: where phi does not depend on this entry the four values are equal and
        # the estimate is exactly 0; summed left to right they leave an ulp of phi (~1e-13 after
        # dividing by 12 h), a relative error of ~1e-2 against an exact zero gradient.
        grads[n] = (8.0 * (f_p1 - f_m1) - (f_p2 - f_m2)) / (12.0 * h)
    return grads


def sample_coords(size: int, max_coords: int | None, rng: np.random.Generator) -> np.ndarray:
    """All coordinates when the input is small, else a random sample without replacement."""
    if max_coords is None or size <= max_coords:
        return np.arange(size)
    return np.sort(rng.choice(size, size=max_coords, replace=False))


@dataclass(frozen=True)
class CheckResult:
    """The outcome of checking one case: the largest relative error per input."""

    case: OpCase
    errors: dict[str, float]
    coords_checked: int

    @property
    def max_error(self) -> float:
        return max(self.errors.values(), default=0.0)

    @property
    def passed(self) -> bool:
        return self.max_error <= self.case.bound


def check_case(case: OpCase, seed: int = 0, max_coords: int | None = 128) -> CheckResult:
    """Vector-Jacobian check of ``case`` in float64 with a random upstream gradient."""
    rng = np.random.default_rng(seed)
    inputs = case.make_inputs(rng)
    for name in case.wrt:
        inputs[name] = np.ascontiguousarray(inputs[name], dtype=np.float64)
    out, cache = case.forward(**inputs)
    dout = rng.standard_normal(np.shape(out))
    grads = case.grads_by_name(case.backward(dout, cache))

    def phi() -> float:
        return float(np.sum(case.forward(**inputs)[0] * dout))

    errors, checked = {}, 0
    for name in case.wrt:
        x = inputs[name]
        if grads[name].shape != x.shape:
            raise ValueError(
                f"{case.name}: gradient of {name} has shape {grads[name].shape}, input {x.shape}"
            )
        coords = sample_coords(x.size, max_coords, rng)
        numeric = numerical_gradient(phi, x, coords)
        errors[name] = float(relative_error(grads[name].reshape(-1)[coords], numeric).max(initial=0))
        checked += len(coords)
    return CheckResult(case, errors, checked)
