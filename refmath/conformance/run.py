r"""Running a kernel through the cases: one verdict per case, never a crash of the sweep.

For each case that the adapter supports: draw the inputs, compute the oracle (float64) and the
plain implementation in the kernel's dtype, call the kernel twice on fresh copies of the same
inputs, and judge:

* every output named by the contract is there, of the right shape, dtype and device;
* NaN where, and only where, the oracle has NaN: NaN must propagate from what a row sees and must
  not leak from what it does not; an all-masked row is 0 or NaN as the convention says;
* the largest error of the finite entries is within rule (a) of :mod:`refmath.conformance.bounds`
  (and its standing against rule (b) is reported);
* the two calls give the same bits (determinism).

A kernel that raises, returns the wrong thing or runs past ``timeout`` seconds gets a failed case
with the reason; the sweep goes on (a hung call is left running in a daemon thread).
"""
from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from refmath.conformance import bounds
from refmath.conformance.adapters import Adapter, get_adapter
from refmath.conformance.arrays import BadOutput
from refmath.conformance.case import MASKED_ROWS, AttentionCase, make_inputs, sweep
from refmath.conformance.oracle import attention

OUTPUTS = {"forward": ("o", "lse"), "backward": ("dq", "dk", "dv"), "decode": ("o",),
           "paged": ("o",)}
DEFAULT_TIMEOUT = 60.0


@dataclass
class Check:
    """One output of one case: its error, the tolerance of rule (a) and the bound of rule (b)."""

    name: str
    error: float
    tolerance: float
    plain_error: float
    magnitude: float = 0.0  # max |oracle| over the finite entries
    apriori: float | None = None

    @property
    def ratio(self) -> float:
        """error / tolerance: at most 1 to pass."""
        if self.tolerance > 0:
            return self.error / self.tolerance
        return 0.0 if self.error == 0 else float("inf")


@dataclass
class CaseResult:
    """The verdict of one case: ``status`` is ``"pass"``, ``"fail"`` or ``"skip"`` (the case does
    not apply to the adapter; ``reason`` says why)."""

    case: AttentionCase
    status: str
    reason: str = ""
    checks: list[Check] = field(default_factory=list)
    deterministic: bool | None = None
    seconds: float = 0.0

    @property
    def worst(self) -> Check | None:
        return max(self.checks, key=lambda c: c.ratio, default=None)

    def to_dict(self) -> dict:
        w = self.worst
        return {"id": self.case.id, "case": self.case.describe(), "status": self.status,
                "reason": self.reason, "deterministic": self.deterministic,
                "seconds": round(self.seconds, 4),
                "worst_ratio": None if w is None else w.ratio,
                "checks": [{"output": c.name, "error": c.error, "tolerance": c.tolerance,
                            "plain_error": c.plain_error, "magnitude": c.magnitude,
                            "apriori_bound": c.apriori,
                            "ratio": c.ratio} for c in self.checks]}


class _Timeout(Exception):
    pass


def _call(adapter: Adapter, fn, case: AttentionCase, inputs, timeout: float) -> dict:
    box = {}

    def target():
        try:
            box["out"] = adapter.call(fn, case, inputs)
        except BaseException as err:  # noqa: BLE001 - any failure of the kernel is a verdict
            box["err"] = err

    thread = threading.Thread(target=target, daemon=True, name=f"conformance {case.id}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise _Timeout(f"the kernel did not return within {timeout:g} s")
    if "err" in box:
        raise box["err"]
    return box["out"]


def _copy_inputs(inputs):
    import copy

    return copy.deepcopy(inputs)


def _expected(case: AttentionCase, ref: dict, name: str, masked_rows: str) -> np.ndarray:
    want = ref[name].copy()
    if name in ("o",) and masked_rows == "nan":
        want[ref["empty"]] = np.nan
    return want


def _judge(case, name, got, want, plain, ref, shifted, allow_nan_leaks=False, notes=None):
    """A failure reason (or None) and the check of one output."""
    rows = None
    if name == "lse":  # an all-masked row's lse is -inf or +inf by convention: not compared
        rows = ~ref["empty"]
        got, want, plain = got[rows], want[rows], plain[rows]
        shifted = [x[rows] for x in shifted]
    want_nan, got_nan = np.isnan(want), np.isnan(got)
    if (want_nan & ~got_nan).any():
        n = int((want_nan & ~got_nan).sum())
        return (f"{name}: {n} entries should be NaN (a NaN the rows see, or an all-masked row "
                f"under the 'nan' convention) but are not"), None
    hidden_nan = case.inputs in ("nan", "inf-masked") or case.contract in ("decode", "paged")
    if (got_nan & ~want_nan).any() and allow_nan_leaks and hidden_nan:
        leaked = got_nan & ~want_nan
        notes.append(f"{name}: {int(leaked.sum())} entries NaN from hidden positions (allowed)")
        want, plain = np.where(leaked, np.nan, want), np.where(leaked, np.nan, plain)
        shifted = [np.where(leaked, np.nan, x) for x in shifted]
        want_nan = np.isnan(want)
    if (got_nan & ~want_nan).any():
        n = int((got_nan & ~want_nan).sum())
        why = ("read from a position those rows do not see: every hidden key, slot and page of this "
               "case holds NaN or inf" if hidden_nan else
               "an overflow, or an all-masked row under the 'zero' convention")
        return f"{name}: {n} entries are NaN where the oracle is finite ({why})", None
    finite = ~want_nan
    want_f, got_f, plain_f = want[finite], got[finite], plain[finite]
    with np.errstate(invalid="ignore"):
        diff = np.abs(got_f - want_f)
    diff = np.where(np.isnan(diff), np.inf, diff)  # inf vs finite, or inf - inf of unlike signs
    same_inf = np.isinf(want_f) & (got_f == want_f)
    diff = np.where(same_inf, 0.0, diff)
    error = float(diff.max(initial=0.0))
    plain_diff = np.abs(plain_f - want_f)
    plain_diff = np.where(np.isinf(want_f) & (plain_f == want_f), 0.0, plain_diff)
    plain_error = float(np.nan_to_num(plain_diff, nan=0.0, posinf=0.0).max(initial=0.0))
    magnitude = float(np.abs(want_f[np.isfinite(want_f)]).max(initial=0.0))
    shift = 0.0
    for x in shifted:  # the oracle moved by what a kernel may legitimately hold differently
        both = np.isfinite(want) & np.isfinite(x)
        shift += float(np.abs(x[both] - want[both]).max(initial=0.0))
    tol = bounds.tolerance(case, name, plain_error, magnitude, shift)
    check = Check(name, error, tol, plain_error, magnitude)
    if error > tol:
        return (f"{name}: error {error:.3g} > tolerance {tol:.3g} (max of {bounds.factor(name):g} x "
                f"the plain {case.dtype} error {plain_error:.3g} and 2u max|ref| with max|ref| = "
                f"{magnitude:.3g}, plus {shift:.2g} for the rounding of the scale and the saved lse)"), check
    return None, check


def check_case(fn, adapter: Adapter | str, case: AttentionCase, masked_rows: str | None = None,
               timeout: float = DEFAULT_TIMEOUT, allow_nan_leaks: bool = False) -> CaseResult:
    """Run ``fn`` through one case and return its verdict (see the module docstring).

    ``masked_rows``: what an all-masked row must give, ``"zero"`` or ``"nan"`` (default: the
    adapter's convention). ``allow_nan_leaks``: a NaN that reaches a row from a position the row
    does not see is noted instead of failing the case (implementations that add the mask to the
    scores, as PyTorch's math path does, compute ``NaN + (-inf) = NaN``); NaN must still
    propagate from what a row sees."""
    if isinstance(adapter, str):
        adapter = get_adapter(adapter)
    masked_rows = adapter.masked_rows if masked_rows is None else masked_rows
    if masked_rows not in MASKED_ROWS:
        raise ValueError(f"masked_rows must be one of {MASKED_ROWS}, got {masked_rows!r}")
    start = time.perf_counter()
    why_not = adapter.supports(case)
    if why_not is not None:
        return CaseResult(case, "skip", why_not)
    inputs = make_inputs(case)
    ref = attention(case, inputs)
    plain = attention(case, inputs, case.dtype)
    shifts = [attention(case.replace(scale=case.scale_value * (1 + bounds.SCALE_ROUNDING)), inputs)]
    if case.contract == "backward":
        shifts.append(attention(case, inputs, saved_lse_rounding=bounds.U32))
    result = CaseResult(case, "pass")
    try:
        first = _call(adapter, fn, case, _copy_inputs(inputs), timeout)
        second = _call(adapter, fn, case, _copy_inputs(inputs), timeout)
    except (BadOutput, _Timeout) as err:
        return CaseResult(case, "fail", str(err), seconds=time.perf_counter() - start)
    except Exception as err:  # noqa: BLE001 - the kernel raised: a failed case, not a crash
        last = traceback.extract_tb(err.__traceback__)[-1]
        return CaseResult(case, "fail", f"the kernel raised {type(err).__name__}: {err} "
                          f"({last.filename.rsplit('/', 1)[-1]}:{last.lineno})",
                          seconds=time.perf_counter() - start)
    reasons, notes = [], []
    names = [n for n in OUTPUTS[case.contract] if n in first]
    missing = [n for n in OUTPUTS[case.contract] if n not in first and n != "lse"]
    if missing:
        reasons.append(f"the kernel returned no {', '.join(missing)}")
    apriori = bounds.apriori(case, inputs, ref) if case.contract != "backward" else {}
    for name in names:
        want = _expected(case, ref, name, masked_rows)
        plain_want = _expected(case, plain, name, masked_rows)
        shifted = [_expected(case, x, name, masked_rows) for x in shifts]
        reason, check = _judge(case, name, first[name], want, plain_want, ref, shifted,
                               allow_nan_leaks, notes)
        if check is not None:
            check.apriori = apriori.get(name)
            result.checks.append(check)
        if reason:
            reasons.append(reason)
    result.deterministic = all(np.array_equal(first[n], second.get(n), equal_nan=True)
                               for n in first)
    if not result.deterministic:
        reasons.append("not deterministic: the same inputs twice gave different bits")
    if reasons:
        result.status, result.reason = "fail", "; ".join(reasons)
    elif notes:
        result.reason = "; ".join(notes)
    result.seconds = time.perf_counter() - start
    return result


def check_attention(fn, adapter: str = "sdpa", quick: bool = False, dtypes=("float32",),
                    contracts=None, masked_rows: str | None = None, device: str = "cpu",
                    timeout: float = DEFAULT_TIMEOUT, progress=None, cases=None,
                    fail_fast: bool = False, allow_nan_leaks: bool = False,
                    long: bool = False) -> list[CaseResult]:
    """Run ``fn`` through the sweep (:func:`refmath.conformance.case.sweep`) with the adapter
    named ``adapter``; returns one :class:`CaseResult` per case, skips included. ``contracts``
    defaults to the adapter's own; ``progress`` is called as ``progress(done, total, result)``
    after each case; ``cases`` replaces the sweep; ``fail_fast`` stops at the first failure;
    ``masked_rows`` and ``allow_nan_leaks`` are :func:`check_case`'s; ``long`` adds the
    ``T = 32k`` cases."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable kernel, got {type(fn).__name__}")
    adapter_obj = get_adapter(adapter, device) if isinstance(adapter, str) else adapter
    if cases is None:
        contracts = adapter_obj.contracts if contracts is None else tuple(contracts)
        cases = sweep(contracts, tuple(dtypes), quick, long)
    results = []
    for i, case in enumerate(cases):
        results.append(check_case(fn, adapter_obj, case, masked_rows, timeout, allow_nan_leaks))
        if progress is not None:
            progress(i + 1, len(cases), results[-1])
        if fail_fast and results[-1].status == "fail":
            break
    return results
