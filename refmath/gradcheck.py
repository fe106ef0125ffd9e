r"""Numerical gradients and the vector-Jacobian check, with a bound derived from the stencil.

For an op ``y = f(x)`` and a random upstream gradient ``dout`` (the same shape as ``y``), the
analytic gradient ``backward(dout)`` must equal the gradient of the scalar
``phi(x) = sum(f(x) * dout)``, which we estimate by central differences in float64. A model is the
same thing with ``phi`` its loss and ``x`` its parameters (:func:`check_param_gradients`).

The stencil
-----------
Along one coordinate, with step ``h``, the five-point central stencil is

.. math::
    D(h) = \frac{8\,[\phi(x+h) - \phi(x-h)] - [\phi(x+2h) - \phi(x-2h)]}{12 h}.

**Truncation.** Taylor-expanding each value about ``x``, the even powers cancel, the ``h^3`` terms
cancel between the two brackets (:math:`8 \cdot 2/6 - 2 \cdot 8/6 = 0`), and what is left is

.. math::
    D(h) - \phi'(x) = \frac{8 \cdot 2 - 2 \cdot 32}{12 \cdot 120}\,h^4 \phi^{(5)}(\xi)
                    = -\frac{h^4}{30}\,\phi^{(5)}(\xi),

about ``3.3e-14 |phi^(5)|`` for ``h = 1e-3``.

**Rounding.** Each evaluation of ``phi`` in float64 is wrong by some ``delta_k``. Its size is a
multiple of the unit of the numbers summed: ``|delta| <= kappa * eps * Phi`` with ``eps`` the
machine epsilon (2.2e-16), ``Phi = sum |f(x) * dout|`` (the magnitude of what ``phi`` adds up) and
``kappa`` a small count of the roundings an output entry goes through on its way (a product, a
sum, an exponential...). The four errors enter ``D`` with weights ``8, 8, 1, 1`` over ``12 h``:

.. math::
    |D_{\text{float}}(h) - D(h)| \le \frac{18}{12 h}\,\kappa\,\epsilon\,\Phi
                                 = \frac{3\,\kappa\,\epsilon\,\Phi}{2 h}.

**Truncation, measured.** ``phi^(5)`` is not known in advance, and it is not always small: a
whole model's loss measures ``|D - phi'| ~ 2e-9`` at ``h = 1e-3``, far above its rounding term. So
the check measures it, coordinate by coordinate. The same expansion at ``2h`` gives
``D(2h) - phi' = -16 h^4 phi^(5) / 30 + O(h^6)``, hence

.. math::
    T = \frac{|D(2h) - D(h)|}{15} = \frac{h^4}{30}\,|\phi^{(5)}| + O(h^6),

which costs two more evaluations (at ``+-4h``; those at ``+-2h`` are shared) and carries rounding
of only ``~E / 10``. It uses ``phi`` alone, never the analytic gradient, so a wrong gradient cannot
widen its own bound; a kink within ``4h`` of the point (a ReLU input near 0) shows up as a large
``T`` rather than as a false failure.

**The step.** The total ``h^4 |phi^(5)| / 30 + 3 kappa eps Phi / (2h)`` is smallest at
``h = (45 kappa eps Phi / (4 |phi^(5)|))^(1/5)``: ``~1e-3`` when ``|phi^(5)|`` and ``kappa Phi`` are
of the same size, as for the ops here (inputs of order 1, weights scaled by ``1/sqrt(fan-in)``), and
``2.5e-4`` for the models, whose fifth derivative is 1e3 to 1e4 times larger (a case's ``step``).

**The bound.** With ``kappa = 16`` every numerical derivative is within ``E + 2T`` of the true
one: ``E = 3 kappa eps Phi / (2h)``, ``~5e-12 Phi`` at ``h = 1e-3``, and ``T`` the largest measured
truncation, doubled for the estimate's own error. This is an absolute error, the same for every
coordinate of a case. A case's relative bound is it over the case's typical gradient entry ``G``
(the median of ``|a| + |n|`` over the checked entries):

.. math::
    \text{bound} = (E + 2T) / G, \qquad
    \text{error}_i = \frac{|a_i - n_i|}{\max(|a_i| + |n_i|,\ G)} .

Entries at least as large as ``G`` are held to that relative error; smaller ones, whose relative
error the stencil cannot resolve that finely, to the absolute error ``E + 2T``. ``kappa`` is the one
constant not derived; measured over every registered case at three seeds, the largest error less
the truncation part is below ``1 * 3 eps Phi / (2h)`` (``kappa = 1`` would almost do), and no case
comes within half of its bound: 16 leaves room for deeper computations than these. The bound comes out
between 1e-11 and 1e-9 for the registered cases, and the typical (median) error of a correct
gradient is some 100 times below it. A systematic error of one part in 1e8 (a float32-rounded
constant) is therefore far outside the bound, where the former fixed bound of 1e-6 let it pass.

The plain :func:`relative_error` (``|a - n| / max(1e-12, |a| + |n|)``) is kept for the lessons and
model tests that report it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from refmath._validate import check_int
from refmath.models import MODELS
from refmath.registry import GROUPS, OpCase, ParamCase, registered

__all__ = ["EPS", "relative_error", "stencil_error", "numerical_gradient",
           "derivatives_with_truncation", "sample_coords", "CheckResult", "compare", "check_case",
           "check_param_gradients", "check_param_case", "check", "case_modules", "all_cases"]

STEP = 1e-3
EPS = float(np.finfo(np.float64).eps)
# kappa: roundings per output entry allowed for in the bound (the derivation above); measured <= 7
ROUNDING_FACTOR = 16.0


def relative_error(analytic: np.ndarray, numeric: np.ndarray) -> np.ndarray:
    """Entry-wise ``|a - n| / max(1e-12, |a| + |n|)``."""
    analytic = np.asarray(analytic, dtype=np.float64)
    numeric = np.asarray(numeric, dtype=np.float64)
    return np.abs(analytic - numeric) / np.maximum(1e-12, np.abs(analytic) + np.abs(numeric))


def stencil_error(phi_scale: float, h: float = STEP, kappa: float = ROUNDING_FACTOR) -> float:
    """``E = 3 kappa eps Phi / (2h)``: the largest rounding error of one five-point derivative of a
    ``phi`` that sums terms of total magnitude ``phi_scale`` (see the module docstring)."""
    return 1.5 * kappa * EPS * float(phi_scale) / h


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


def derivatives_with_truncation(phi, x: np.ndarray, coords, h: float = STEP):
    """Five-point derivatives ``D(h)`` of ``phi()`` w.r.t. ``x.flat[coords]``, and the measured size
    of their truncation error, ``|D(2h) - D(h)| / 15`` (module docstring), from six evaluations
    per coordinate (at ``+-h, +-2h, +-4h``; ``D(2h)`` reuses those at ``+-2h``).

    ``x`` is perturbed in place and restored, as in :func:`numerical_gradient`.
    """
    flat = x.reshape(-1)
    d_h = np.empty(len(coords), dtype=np.float64)
    d_2h = np.empty(len(coords), dtype=np.float64)
    for n, i in enumerate(coords):
        saved = flat[i]
        f = {}
        for step in (-4, -2, -1, 1, 2, 4):
            flat[i] = saved + step * h
            f[step] = phi()
        flat[i] = saved
        # differences first, as in numerical_gradient
        d_h[n] = (8.0 * (f[1] - f[-1]) - (f[2] - f[-2])) / (12.0 * h)
        d_2h[n] = (8.0 * (f[2] - f[-2]) - (f[4] - f[-4])) / (24.0 * h)
    return d_h, np.abs(d_2h - d_h) / 15.0


def sample_coords(size: int, max_coords: int | None, rng: np.random.Generator) -> np.ndarray:
    """All coordinates when the input is small, else a random sample without replacement."""
    if max_coords is None or size <= max_coords:
        return np.arange(size)
    return np.sort(rng.choice(size, size=max_coords, replace=False))


def _check_max_coords(max_coords):
    if max_coords is not None:
        check_int("max_coords", max_coords, 1)


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check.

    ``errors``: the largest error per input (the measure of the module docstring); ``typical``:
    the median error over every checked entry; ``bound``: the derived relative bound ``E / G``;
    ``tolerance``: ``E + 2T``, the absolute error the stencil may make; ``truncation``: ``T``;
    ``worst``: the input
    holding the largest error; ``problem``: why nothing could be compared (then ``passed`` is
    False).
    """

    name: str
    errors: dict[str, float]
    typical: float
    bound: float
    tolerance: float
    coords_checked: int
    truncation: float = 0.0  # the largest measured truncation error T
    problem: str = ""  # set when the check could not compare at all (a gradient of the wrong shape)

    @property
    def max_error(self) -> float:
        return max(self.errors.values(), default=0.0)

    @property
    def worst(self) -> str:
        return max(self.errors, key=self.errors.get) if self.errors else "-"

    @property
    def passed(self) -> bool:
        return self.max_error <= self.bound


def compare(name: str, analytic: Mapping[str, np.ndarray], numeric: Mapping[str, np.ndarray],
            phi_scale: float, kappa: float = ROUNDING_FACTOR, h: float = STEP,
            truncation: float = 0.0) -> CheckResult:
    """Judge sampled analytic against numerical derivatives (flat arrays keyed by input name)
    with the derived bound: the error measure and ``(E + 2 T) / G`` of the module docstring, ``T``
    the largest measured truncation error."""
    tolerance = stencil_error(phi_scale, h, kappa) + 2.0 * truncation
    sizes = np.concatenate([np.abs(analytic[k]) + np.abs(numeric[k]) for k in analytic] or [[]])
    nonzero = sizes[sizes > 0]
    # G: the typical gradient entry. When every entry is 0 (softmax of one entry), G = 1: the
    # errors are then absolute, and the bound is E itself.
    typical_size = float(np.median(nonzero)) if nonzero.size else 1.0
    # never below E (or the smallest float, when E = 0 because phi is exactly 0)
    typical_size = max(typical_size, tolerance, np.finfo(np.float64).tiny)
    errors, all_errors = {}, []
    for key in analytic:
        a, n = analytic[key], numeric[key]
        err = np.abs(a - n) / np.maximum(np.abs(a) + np.abs(n), typical_size)
        errors[key] = float(err.max(initial=0.0))
        all_errors.append(err)
    every = np.concatenate(all_errors or [[]])
    typical = float(np.median(every)) if every.size else 0.0
    return CheckResult(name, errors, typical, tolerance / typical_size, tolerance, int(every.size),
                       truncation=float(truncation))


def _shape_mismatch(name: str, key: str, grad, shape) -> CheckResult:
    """A gradient of the wrong shape is a failed check, reported as such (not a crash)."""
    return CheckResult(name, {key: float("inf")}, float("inf"), 0.0, 0.0, 0,
                       problem=f"gradient of {key} has shape {np.shape(grad)}, input {shape}")


def check_case(case: OpCase, seed: int = 0, max_coords: int | None = 128) -> CheckResult:
    """Vector-Jacobian check of ``case`` in float64 with a random upstream gradient.

    Output entries that are not finite (``-inf`` at the masked entries of a log-softmax) are
    constants of the input, so ``phi`` leaves them out; their upstream gradient is still random
    and handed to ``backward``, which must ignore it (a leak shows up as an error).
    """
    _check_max_coords(max_coords)
    if case.max_coords is not None:
        max_coords = case.max_coords if max_coords is None else min(max_coords, case.max_coords)
    rng = np.random.default_rng(seed)
    inputs = case.make_inputs(rng)
    for name in case.wrt:
        inputs[name] = np.ascontiguousarray(inputs[name], dtype=np.float64)
    out, cache = case.forward(**inputs)
    finite = np.isfinite(out)
    dout = rng.standard_normal(np.shape(out))
    grads = case.grads_by_name(case.backward(dout.copy(), cache))
    dout_finite = np.where(finite, dout, 0.0)

    def phi() -> float:
        value = case.forward(**inputs)[0]
        return float(np.sum(np.where(finite, value, 0.0) * dout_finite))

    analytic, numeric, truncation = {}, {}, 0.0
    for name in case.wrt:
        x = inputs[name]
        if np.shape(grads[name]) != x.shape:
            return _shape_mismatch(case.name, name, grads[name], x.shape)
        coords = sample_coords(x.size, max_coords, rng)
        numeric[name], trunc = derivatives_with_truncation(phi, x, coords, case.step or STEP)
        truncation = max(truncation, float(trunc.max(initial=0.0)))
        analytic[name] = np.asarray(grads[name], dtype=np.float64).reshape(-1)[coords]
    phi_scale = float(np.sum(np.abs(np.where(finite, out, 0.0) * dout_finite)))
    return compare(case.name, analytic, numeric, phi_scale, case.kappa or ROUNDING_FACTOR,
                   case.step or STEP, truncation)


def check_param_gradients(loss: Callable[[dict], float], grads: Mapping[str, np.ndarray],
                          params: dict, max_coords: int | None = 6, seed: int = 0,
                          h: float = STEP, kappa: float = ROUNDING_FACTOR,
                          name: str = "params") -> CheckResult:
    """Check a hand-written gradient dictionary against central differences of a scalar loss.

    ``params`` is a flat ``{name: float64 array}`` dict (a model's parameters), ``loss(params)`` the
    scalar loss at ``params``, and ``grads`` the analytic gradient dict at those parameters, with
    the same keys and shapes. ``max_coords`` coordinates of each array are sampled (all of them for
    smaller arrays). Each array is perturbed in place and restored, so ``loss`` must read
    ``params`` afresh on every call, and be deterministic (draw any dropout mask from a generator
    seeded inside ``loss``). The error measure and the bound are those of the module docstring,
    with ``Phi = |loss(params)|``.

    An instructor checking a student's model (``student.forward(params, batch) -> (loss, cache)``
    and ``student.backward(cache) -> grads``)::

        from refmath.gradcheck import check_param_gradients
        from refmath.models import gpt

        params = gpt.init_params(config, seed=0)          # float64
        loss, cache = student.forward(params, batch, config)
        result = check_param_gradients(
            lambda p: student.forward(p, batch, config)[0], student.backward(cache), params)
        assert result.passed, (result.worst, result.errors[result.worst], result.bound)

    A missing or extra key, or a gradient of the wrong shape, fails the check (``problem`` says
    which); parameters that are not contiguous float64 arrays raise ``ValueError``.
    """
    _check_max_coords(max_coords)
    missing = sorted(set(params) - set(grads))
    extra = sorted(set(grads) - set(params))
    if missing or extra:
        return CheckResult(name, {(missing + extra)[0]: float("inf")}, float("inf"), 0.0, 0.0, 0,
                           problem=f"gradient keys differ from the parameters: missing {missing}, "
                           f"unexpected {extra}")
    rng = np.random.default_rng(seed)
    analytic, numeric, truncation = {}, {}, 0.0
    for key, value in params.items():
        if not (isinstance(value, np.ndarray) and value.dtype == np.float64
                and value.flags.c_contiguous):
            raise ValueError(f"{name}: params[{key!r}] must be a contiguous float64 array")
        if np.shape(grads[key]) != value.shape:
            return _shape_mismatch(name, key, grads[key], value.shape)
        coords = sample_coords(value.size, max_coords, rng)
        numeric[key], trunc = derivatives_with_truncation(lambda: float(loss(params)), value, coords, h)
        truncation = max(truncation, float(trunc.max(initial=0.0)))
        analytic[key] = np.asarray(grads[key], dtype=np.float64).reshape(-1)[coords]
    return compare(name, analytic, numeric, abs(float(loss(params))), kappa, h, truncation)


def check_param_case(case: ParamCase, seed: int = 0, max_coords: int | None = None) -> CheckResult:
    """Check a registered model: :func:`check_param_gradients` on the case's parameters, with at
    most ``case.max_coords`` coordinates per array (fewer if ``max_coords`` is smaller)."""
    _check_max_coords(max_coords)
    params, forward = case.make(np.random.default_rng(seed))
    _, cache = forward(params)
    per_array = case.max_coords if max_coords is None else min(case.max_coords, max_coords)
    return check_param_gradients(lambda p: forward(p)[0], case.backward(cache), params,
                                 max_coords=per_array, seed=seed, h=case.step or STEP,
                                 kappa=case.kappa or ROUNDING_FACTOR, name=case.name)


def check(case: OpCase | ParamCase, seed: int = 0, max_coords: int | None = 128) -> CheckResult:
    """Check any registered case: :func:`check_case` for an op, :func:`check_param_case` for a
    model. A case's own ``max_coords`` applies where it is smaller than ``max_coords``."""
    if isinstance(case, ParamCase):
        return check_param_case(case, seed, max_coords)
    return check_case(case, seed, max_coords)


# ---- every registered case ----------------------------------------------------------------------

# The op modules that register cases (each at its end, see refmath.registry), in the order of the
# story; every model of refmath.models.MODELS registers its own after them.
OP_MODULES = (
    "refmath.softmax",
    "refmath.attention",
    "refmath.norms",
    "refmath.ffn",
    "refmath.moe",
    "refmath.positions",
    "refmath.embedding",
    "refmath.losses",
    "refmath.flash",
)


def case_modules() -> tuple[str, ...]:
    """The modules whose import registers cases: :data:`OP_MODULES`, then the models' (M1 to M4)."""
    return OP_MODULES + tuple(entry.module for entry in MODELS.values())


def all_cases(group: str | None = "ops") -> list:
    """The registered cases of ``group`` (one of :data:`refmath.registry.GROUPS`; ``None`` for
    all), in the order of :func:`case_modules`.

    The default is the single-equation ops, each an :class:`~refmath.registry.OpCase` with a
    PyTorch mirror in the oracle tests; ask for the other groups by name.
    """
    if group is not None and group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS} or None, got {group!r}")
    modules = case_modules()
    for module in modules:
        importlib.import_module(module)

    def module_order(case) -> int:
        # modules register as they are imported, which follows their imports of each other; list
        # the cases in the order of case_modules instead (the order of the story, M1 to M4)
        defined_in = (case.make if isinstance(case, ParamCase) else case.forward).__module__
        return modules.index(defined_in) if defined_in in modules else len(modules)

    cases = [case for case in registered() if group is None or case.group == group]
    return sorted(cases, key=module_order)  # stable: within a module, the order of registration
