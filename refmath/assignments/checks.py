"""What hidden tests are made of: a test builds its inputs from a fixed seed and returns a
:class:`Case`: the student-side function ``run``, its ``inputs``, and ``check``.

- ``run(**inputs)`` executes in the sandbox (see :mod:`refmath.assignments.sandbox`). Only its
  source text and its inputs are sent there, never the test module: it must use nothing but its
  arguments, ``np``, builtins and what it imports itself (the submission's refmath). It returns
  ``{name: array}``.
- ``check(out)`` executes in the grader's own process and never imports the submission: it compares
  ``out`` with values obtained independently (PyTorch autograd in float64, exact worked examples,
  properties) and returns a :class:`Verdict`.

.. code-block:: python

    @hidden_test("sdpa_forward, no mask, against torch")
    def sdpa_forward_plain():
        q, k, v = normal(0, (2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6))
        def run(q, k, v):
            from refmath.attention import sdpa_forward
            return {"o": sdpa_forward(q, k, v)[0]}
        def check(out):
            return compare("sdpa_forward", "o", out, torch_sdpa(q, k, v), shapes(q=q, k=k))
        return Case(run, dict(q=q, k=k, v=v), check)

The inputs are arrays, NumPy scalars, ``None``, booleans, numbers and strings, and lists, tuples
and dicts of those; they reach ``run`` as arrays and plain values (tuples as lists). No seed, no
check code and no expected value ever reaches the sandbox. Feedback names the function, the input
shapes and the error against its tolerance; it never prints an expected array.
"""
from __future__ import annotations

import builtins
import dis
import inspect
import textwrap
from typing import Callable, NamedTuple

import numpy as np

__all__ = ["Verdict", "Case", "reference_cpu_seconds", "within_cost", "run_source", "hidden_test",
           "normal", "shapes", "relative_error", "compare", "float32_rule", "exact", "all_of",
           "torch_tensors", "numpy_of"]

# Relative error of an analytic float64 result: rounding gives ~1e-15. A gradient by central
# differences is off by ~1e-10 (three-point) to ~1e-13 (five-point), so the backward tests also
# use inputs large enough that the O(n) forward calls of any difference scheme exceed the time limit.
TIGHT = 1e-11


class Verdict(NamedTuple):
    passed: bool
    message: str


class Case(NamedTuple):
    run: Callable  # run(**inputs) -> {name: array}, in the sandbox
    inputs: dict  # what run receives
    check: Callable  # check(out) -> Verdict, in the grader
    # whether check() reads out["grader:idle_cpu_s"] (see within_cost): measured once per sandbox
    costed: bool = False


# What the grader adds to every test's outputs, measured by the kernel outside the student's
# process (whatever the student's code returned under these names is replaced): the peak resident
# bytes of all the test's processes, their CPU seconds, and (for a costed Case) the CPU seconds of
# a test that does nothing.
PEAK_RSS, CPU_S, IDLE_CPU_S = "grader:peak_rss", "grader:cpu_s", "grader:idle_cpu_s"
COST_MULTIPLE = 3.0  # a backward may cost this many times the grader's own computation of it
COST_SLACK_S = 0.3  # CPU seconds of allowance for what the timings cannot see (input copies, GC)


def reference_cpu_seconds(compute: Callable, repeat: int = 3) -> float:
    """CPU seconds of ``compute()`` in the grader: the best of ``repeat`` runs."""
    import time
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        compute()
        best = min(best, time.process_time() - start)
    return best


def within_cost(function: str, out: dict, reference_s: float, what: str) -> Verdict:
    """The test's CPU time, less a do-nothing test's, at most :data:`COST_MULTIPLE` times
    ``reference_s`` (the grader's own computation of the same results) plus :data:`COST_SLACK_S`.
    A gradient by differences of the forward (a complex step over colours of columns, dual
    numbers) costs several forward passes per backward and does not fit."""
    used = float(out.get(CPU_S, np.nan)) - float(out.get(IDLE_CPU_S, np.nan))
    budget = COST_MULTIPLE * reference_s + COST_SLACK_S
    verdict = (f"{function}: {used:.2f} s of CPU for {what} (measured by the kernel), budget "
               f"{budget:.2f} s = {COST_MULTIPLE:g} x {reference_s:.2f} s of a plain NumPy "
               f"computation of the same + {COST_SLACK_S:g} s")
    return Verdict(bool(used <= budget), verdict)


# The one name a student-side function may use without importing it.
RUN_GLOBALS = {"np"}


def _global_names(code) -> set[str]:
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _global_names(const)
    return names


def run_source(run: Callable, where: str = "") -> str:
    """The source of ``run``, dedented, after checking that it stands alone: no closure and no
    global name but ``np`` and builtins (``ValueError`` names what it reaches for)."""
    label = f"{where}: " if where else ""
    if not inspect.isfunction(run):
        raise TypeError(f"{label}run must be a function, got {type(run).__name__}")
    if run.__code__.co_freevars:
        raise ValueError(f"{label}run() uses {', '.join(run.__code__.co_freevars)} from around it: "
                         "pass them as inputs (only its source text reaches the sandbox)")
    outside = sorted(n for n in _global_names(run.__code__)
                     if n not in RUN_GLOBALS and not hasattr(builtins, n))
    if outside:
        raise ValueError(f"{label}run() uses the module's {', '.join(outside)}: pass them as inputs "
                         "or import them inside run()")
    return textwrap.dedent(inspect.getsource(run))


def hidden_test(description: str):
    """Mark a function as a hidden test; ``description`` is the name students see."""
    def mark(make):
        make.description = description
        return make
    return mark


def normal(seed: int, *shapes, dtype=np.float64):
    """Standard normal arrays of the given shapes from one seeded generator."""
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape).astype(dtype) for shape in shapes]
    return arrays[0] if len(arrays) == 1 else arrays


def shapes(**arrays) -> str:
    """``"q (2, 3, 5, 4), k (2, 3, 7, 4)"``: the input shapes, for feedback."""
    return ", ".join(f"{name} {tuple(np.shape(a))}" for name, a in arrays.items())


def relative_error(got, expected, floor: float = 0.0) -> float:
    r""":math:`\max |g - e| / \max(\max |e|, \text{floor})` for ``got`` :math:`g` and ``expected``
    :math:`e` (the denominator is 1 where that maximum is 0). ``floor`` is the
    size of related results, for a result that is zero in exact arithmetic (the gradient of a key
    bias, which the softmax cannot see) and so rounding noise in any implementation."""
    scale = max(float(np.max(np.abs(expected))) if np.size(expected) else 0.0, floor)
    return float(np.max(np.abs(got - expected))) / (scale if scale > 0 else 1.0) if np.size(got) else 0.0


def compare(function: str, name: str, out: dict, expected, inputs: str, tol: float = TIGHT,
            dtype=None, floor: float = 0.0) -> Verdict:
    """Compare ``out[name]`` with ``expected``: present, same shape (and ``dtype`` if given),
    finite where expected is, and within ``tol`` relative error."""
    label = f"{function}: {name} for {inputs}"
    if name not in out:
        return Verdict(False, f"{label}: no result (the test's call returned nothing for it)")
    got = np.asarray(out[name])
    expected = np.asarray(expected)
    if got.shape != expected.shape:
        return Verdict(False, f"{label}: shape {got.shape}, expected {expected.shape}")
    if dtype is not None and got.dtype != np.dtype(dtype):
        return Verdict(False, f"{label}: dtype {got.dtype}, expected {np.dtype(dtype)} "
                       "(dtype in = dtype out)")
    if not np.issubdtype(got.dtype, np.number) and got.dtype != np.bool_:
        return Verdict(False, f"{label}: dtype {got.dtype} is not numeric")
    got = got.astype(np.float64)
    expected = expected.astype(np.float64)
    bad = ~np.isfinite(got) & np.isfinite(expected)
    if bad.any():
        return Verdict(False, f"{label}: {int(bad.sum())} of {got.size} entries are NaN or inf")
    same_nonfinite = ~np.isfinite(expected)
    if same_nonfinite.any():
        if not np.array_equal(np.isnan(got), np.isnan(expected)) or \
                not np.array_equal(got[np.isinf(expected)], expected[np.isinf(expected)]):
            return Verdict(False, f"{label}: NaN/inf entries in the wrong places")
        got, expected = np.where(same_nonfinite, 0.0, got), np.where(same_nonfinite, 0.0, expected)
    error = relative_error(got, expected, floor)
    if not error <= tol:
        return Verdict(False, f"{label}: relative error {error:.1e} > tolerance {tol:.0e}")
    return Verdict(True, f"{label}: relative error {error:.1e} <= {tol:.0e}")


FLOAT32_ROUNDING = 2.0 ** -24  # half an ulp of 1.0 in float32


def float32_rule(function: str, name: str, out: dict, expected, plain, inputs: str) -> Verdict:
    """The kernel tests' rule for float32 results: the worst error against the float64
    ``expected`` at most twice the worst error of ``plain`` (a plain float32 NumPy computation of
    the same thing), plus one float32 rounding; infinities must match where expected has them."""
    label = f"{function}: {name} for {inputs}"
    if name not in out:
        return Verdict(False, f"{label}: no result (the test's call returned nothing for it)")
    got, expected = np.asarray(out[name]), np.asarray(expected, dtype=np.float64)
    if got.shape != expected.shape:
        return Verdict(False, f"{label}: shape {got.shape}, expected {expected.shape}")
    if got.dtype != np.float32:
        return Verdict(False, f"{label}: dtype {got.dtype}, expected float32")
    got = got.astype(np.float64)
    infinite = np.isinf(expected)
    if not np.array_equal(got[infinite], expected[infinite]) or np.isnan(got).any():
        return Verdict(False, f"{label}: NaN or infinite entries where none are expected, or "
                       "missing where a row sees no key")
    finite = ~infinite
    bound = 2 * float(np.max(np.abs(np.asarray(plain, np.float64)[finite] - expected[finite]),
                             initial=0.0)) + FLOAT32_ROUNDING
    error = float(np.max(np.abs(got[finite] - expected[finite]), initial=0.0))
    verdict = f"worst error {error:.2e} = {error / bound:.2f} of the float32 bound {bound:.2e}"
    return Verdict(error <= bound, f"{label}: {verdict}")


def exact(function: str, name: str, out: dict, expected, inputs: str) -> Verdict:
    """Integer (or exactly representable) results: equal entry for entry."""
    label = f"{function}: {name} for {inputs}"
    if name not in out:
        return Verdict(False, f"{label}: no result")
    got, expected = np.asarray(out[name]), np.asarray(expected)
    if got.shape != expected.shape:
        return Verdict(False, f"{label}: shape {got.shape}, expected {expected.shape}")
    wrong = int(np.sum(got != expected))
    if wrong:
        return Verdict(False, f"{label}: {wrong} of {got.size} entries wrong")
    return Verdict(True, f"{label}: exact")


def all_of(*verdicts: Verdict) -> Verdict:
    """Passed when every verdict passed; the message is the first failure's (or all successes)."""
    for verdict in verdicts:
        if not verdict.passed:
            return verdict
    return Verdict(True, "; ".join(v.message for v in verdicts))


def torch_tensors(*arrays, grad: bool = True):
    """float64 CPU tensors (requiring gradients) of NumPy arrays; torch is imported here, in the
    grader only."""
    import torch
    return [torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad) for a in arrays]


def numpy_of(tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()
