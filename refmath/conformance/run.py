r"""Running a kernel through the cases: one verdict per case, never a crash of the sweep.

For each case that the adapter supports: draw the inputs, compute the oracle (float64) and the
plain implementation in the kernel's dtype, call the kernel twice on fresh copies of the same
inputs, and judge:

* every output named by the contract is there, of the right shape, dtype and device;
* NaN where, and only where, the oracle has NaN, under the conventions the kernel declares
  (:mod:`refmath.conformance.conventions`: what a row that sees no key gives, and three NaN rules:
  a NaN through the mask, one past a decode length, one the row sees that vanishes); a case that
  fails by one rule only gets a hint naming its flag;
* the largest error of the finite entries is within rule (a) of :mod:`refmath.conformance.bounds`
  against the worse of two summation orders of the plain implementation, output-wide and (for
  ``o`` and the lse) row by row, and its standing against rule (b) is reported;
* a failing output is located (:mod:`refmath.conformance.locate`): its worst row, the failing rows
  split by what they see, and the question the split raises;
* the two calls give the same bits (determinism).

A kernel that raises, returns the wrong thing or runs past ``timeout`` seconds gets a failed case
with the reason; the sweep goes on (a hung call is left running in a daemon thread).
"""
from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from refmath.conformance import bounds
from refmath.conformance.adapters import Adapter, get_adapter
from refmath.conformance.arrays import BadOutput
from refmath.conformance.case import AttentionCase, make_inputs, sweep
from refmath.conformance.conventions import EMPTY_ROWS, RULES, Conventions
from refmath.conformance.locate import locate
from refmath.conformance.oracle import attention

__all__ = ["Check", "CaseResult", "Judged", "resolve_conventions", "check_case", "check_attention"]

OUTPUTS = {"forward": ("o", "lse"), "backward": ("dq", "dk", "dv"), "decode": ("o",),
           "paged": ("o",)}
DEFAULT_TIMEOUT = 60.0
# The outputs also held row by row (bounds.row_tolerance): o, and the lse (one number per row, each
# held to its own magnitude, bounds.lse_row_magnitude). Not the gradients, whose rows include exact
# cancellations (a row that sees one key has dq = 0 exactly) where a relative rule means nothing.
ROW_CHECKED = ("o", "lse")


@dataclass
class Check:
    """One output of one case: its error, the tolerance of rule (a) and the bound of rule (b)."""

    name: str
    error: float
    tolerance: float
    plain_error: float
    magnitude: float = 0.0  # max |oracle| over the finite entries
    apriori: float | None = None
    row_ratio: float = 0.0  # the largest error/tolerance of one row against its own tolerance

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
    where: list = field(default_factory=list)  # per failing output: locate()'s dict
    hint: str = ""  # when the case fails by one convention rule only: which, and the flag
    conventions: Conventions | None = None

    @property
    def worst(self) -> Check | None:
        return max(self.checks, key=lambda c: c.ratio, default=None)

    def to_dict(self) -> dict:
        w = self.worst
        return {"id": self.case.id, "case": self.case.describe(),
                "parameters": {k: (list(v) if isinstance(v, tuple) else v)
                               for k, v in dataclasses.asdict(self.case).items()},
                "status": self.status,
                "reason": self.reason, "hint": self.hint, "where": self.where,
                "deterministic": self.deterministic,
                "seconds": round(self.seconds, 4),
                "worst_ratio": None if w is None else w.ratio,
                "checks": [{"output": c.name, "error": c.error, "tolerance": c.tolerance,
                            "plain_error": c.plain_error, "magnitude": c.magnitude,
                            "apriori_bound": c.apriori, "worst_row_ratio": c.row_ratio,
                            "ratio": c.ratio} for c in self.checks]}


class _Timeout(Exception):
    pass


def _call(adapter: Adapter, fn, case: AttentionCase, inputs, timeout: float,
          inline: bool = False) -> dict:
    if inline:
        return adapter.call(fn, case, inputs)
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


def _query_rows(name: str) -> bool:
    """Whether the rows of output ``name`` are query rows (``o``, ``lse``, ``dq``) rather than keys."""
    return name in ("o", "lse", "dq")


def _expected(case: AttentionCase, ref: dict, name: str, conventions: Conventions):
    """``(want, free)``: the oracle's ``name`` under the declared conventions, and the entries that
    are not compared (any value passes there)."""
    want = ref[name].copy()
    free = np.zeros(want.shape, dtype=bool)
    empty = ref["empty"]
    if name == "lse":  # an all-masked row's lse is -inf, NaN or the fill's: never compared
        free |= empty
    elif conventions.empty_rows == "nan" and empty.any():
        if name == "o":
            want[empty] = np.nan
        elif name == "dq":  # the gradient of a row of 0/0 weights: undefined, not compared
            free[empty] = True
        else:  # dk, dv: every weight of such a row is 0/0, so the head it reads may be NaN
            hit = empty.reshape(case.b, case.g, case.h // case.g, case.t_q).any(axis=(2, 3))
            free[hit] = True
    return want, free


def _leak_rule(case: AttentionCase) -> str | None:
    """The NaN rule a NaN in an output where the oracle is finite breaks, by where this case puts
    its hidden NaN: slots past a decode length, or keys the mask hides (None: there are none, so
    the NaN is the kernel's own, an overflow)."""
    if case.contract in ("decode", "paged"):
        return "past_length_nan_may_leak"
    if case.inputs in ("nan", "inf-masked"):
        return "masked_nan_may_leak"
    return None


@dataclass
class Judged:
    """What :func:`_judge` found for one output: the reasons it fails (each with the rule it
    breaks, or None), its check, and the per-row figures that locate a failure."""

    reasons: list
    check: Check | None
    row_error: np.ndarray | None = None  # the largest error of each row (inf: a NaN mismatch)
    row_tolerance: np.ndarray | None = None
    row_bad: np.ndarray | None = None


def _rows(x):
    """The largest entry of each row (the last axis reduced; a 3-axis lse is its own rows)."""
    return x if x.ndim == 3 else x.max(axis=-1, initial=0.0)


def _judge(case, name, got, want, free, plains, shifted, ref, conventions, notes) -> Judged:
    """Judge one output: NaN by the three rules of :mod:`~refmath.conformance.conventions`, then
    the error of the finite entries against rule (a), output-wide and row by row."""
    reasons = []
    free = free.copy()
    want_nan, got_nan = np.isnan(want), np.isnan(got)
    true_nan = np.isnan(ref[name])  # NaN the inputs put there, not a convention's
    empty = ref["empty"]
    empty_entries = np.broadcast_to(empty[..., None], want.shape) if _query_rows(name) and \
        want.ndim == 4 else (empty if name == "lse" else np.zeros(want.shape, bool))
    lost = want_nan & ~got_nan & ~free
    if (lost & true_nan).any():
        n = int((lost & true_nan).sum())
        if conventions.visible_nan_may_vanish:
            notes.append(f"{name}: {n} entries finite where a NaN the row sees should reach "
                         "(allowed)")
            free |= lost & true_nan
        else:
            reasons.append((f"{name}: {n} entries should be NaN (a NaN their row sees) but are not",
                            "visible_nan_may_vanish"))
    if (lost & ~true_nan).any():
        reasons.append((f"{name}: {int((lost & ~true_nan).sum())} entries of rows that see no key "
                        "should be NaN (empty rows: nan) but are not", "empty_rows"))
    leaked = got_nan & ~want_nan & ~free
    if leaked.any():
        n = int(leaked.sum())
        rule = "empty_rows" if (empty_entries | ~leaked).all() else _leak_rule(case)
        if rule not in (None, "empty_rows") and getattr(conventions, rule):
            notes.append(f"{name}: {n} entries NaN: {RULES[rule][0]} (allowed)")
            free |= leaked
        elif rule == "empty_rows":
            reasons.append((f"{name}: {n} entries NaN in rows that see no key (empty rows: "
                            f"{conventions.empty_rows})", rule))
        else:
            why = RULES[rule][0] if rule else ("an overflow, since no position of this case "
                                                 "holds NaN or inf")
            reasons.append((f"{name}: {n} entries are NaN where the oracle is finite ({why})", rule))
    compared = ~want_nan & ~free & ~got_nan
    with np.errstate(invalid="ignore"):
        diff = np.abs(got - want)
        diff = np.where(np.isnan(diff), np.inf, diff)  # inf vs finite, or inf - inf of unlike signs
        diff = np.where(np.isinf(want) & (got == want), 0.0, diff)
    diff = np.where(compared, diff, 0.0)
    mismatch = (lost & ~free) | (leaked & ~free)
    error = float(diff.max(initial=0.0))
    plain_diff = np.zeros(want.shape)
    for plain in plains:  # the worse summation order, entry by entry
        with np.errstate(invalid="ignore"):
            d = np.abs(plain - want)
        d = np.where(np.isinf(want) & (plain == want), 0.0, d)
        d = np.nan_to_num(np.where(compared, d, 0.0), nan=0.0, posinf=0.0)
        plain_diff = np.maximum(plain_diff, d)
    plain_error = float(plain_diff.max(initial=0.0))
    size = np.where(compared & np.isfinite(want), np.abs(np.nan_to_num(want, nan=0.0,
                                                                       posinf=0.0, neginf=0.0)), 0.0)
    magnitude = float(size.max(initial=0.0))
    shift_entry = np.zeros(want.shape)
    shift = 0.0
    for x in shifted:  # the oracle moved by what a kernel may legitimately hold differently
        both = np.isfinite(want) & np.isfinite(x) & compared
        d = np.where(both, np.abs(np.nan_to_num(x) - np.nan_to_num(want)), 0.0)
        shift += float(d.max(initial=0.0))
        shift_entry += d
    tol = bounds.tolerance(case, name, plain_error, magnitude, shift)
    row_error = np.where(_rows(mismatch.astype(float)) > 0, np.inf, _rows(diff))
    row_size = bounds.lse_row_magnitude(case, size, compared) if name == "lse" else _rows(size)
    row_tol = bounds.row_tolerance(case, name, _rows(plain_diff), row_size, _rows(shift_entry))
    if name not in ROW_CHECKED:
        row_tol = np.full(row_error.shape, tol)
    row_bad = (row_error > np.minimum(row_tol, tol)) if name in ROW_CHECKED else row_error > tol
    check = Check(name, error, tol, plain_error, magnitude)
    with np.errstate(invalid="ignore", divide="ignore"):
        finite_rows = np.isfinite(row_error)
        ratios = np.where(finite_rows & (row_tol > 0), row_error / np.where(row_tol > 0, row_tol, 1),
                          0.0)
    check.row_ratio = float(ratios.max(initial=0.0))
    # an error only in rows that see no key is a question of the empty-row convention
    only_empty = "empty_rows" if (_query_rows(name) and row_bad.any()
                                  and not (row_bad & ~empty).any()) else None
    if error > tol:
        reasons.append((f"{name}: error {error:.3g} > tolerance {tol:.3g} (max of "
                        f"{bounds.factor(name):g} x the plain {case.dtype} error {plain_error:.3g} "
                        f"and 2u max|ref| with max|ref| = {magnitude:.3g}, plus {shift:.2g} for the "
                        "rounding of the scale and the saved lse)", only_empty))
    elif name in ROW_CHECKED and ((row_error > row_tol) & finite_rows).any():
        n = int(((row_error > row_tol) & finite_rows).sum())
        worst = np.unravel_index(int(np.argmax(ratios)), ratios.shape)
        reasons.append((f"{name}: {n} rows exceed their own tolerance (worst row error "
                        f"{float(row_error[worst]):.3g} > {float(row_tol[worst]):.3g}, "
                        f"{bounds.factor(name):g} x the plain error of that row or 2u "
                        f"{'(|lse| + 2 log T_k)' if name == 'lse' else 'max|row|'}): "
                        "an error concentrated in a few rows, under the output-wide tolerance "
                        f"{tol:.3g}", only_empty))
    return Judged(reasons, check, row_error, row_tol, row_bad)


def resolve_conventions(adapter: Adapter, conventions: Conventions | None = None,
                        masked_rows: str | None = None, allow_nan_leaks: bool = False) -> Conventions:
    """The conventions a case is judged under: ``conventions`` (default: the adapter's), with
    ``masked_rows`` (an empty-row convention) and ``allow_nan_leaks`` (masked-key NaN may leak)
    laid over them where given."""
    base = adapter.conventions if conventions is None else conventions
    if not isinstance(base, Conventions):
        raise TypeError(f"conventions must be a Conventions, got {type(base).__name__}")
    if masked_rows is not None and masked_rows not in EMPTY_ROWS:
        raise ValueError(f"masked_rows must be one of {EMPTY_ROWS}, got {masked_rows!r}")
    return base.replace(empty_rows=masked_rows, masked_nan_may_leak=True if allow_nan_leaks else None)


def check_case(fn, adapter: Adapter | str, case: AttentionCase, masked_rows: str | None = None,
               timeout: float = DEFAULT_TIMEOUT, allow_nan_leaks: bool = False,
               conventions: Conventions | None = None, inline: bool = False) -> CaseResult:
    """Run ``fn`` through one case and return its verdict (see the module docstring).

    ``conventions``: what the kernel declares (:class:`~refmath.conformance.conventions.Conventions`;
    default the adapter's). ``masked_rows``: the empty-row convention, ``"zero"``, ``"nan"``,
    ``"unmasked"`` or ``"mean-of-v"``, over the declared one; ``allow_nan_leaks``: a NaN that
    reaches a row from a key its mask hides is noted instead of failing the case (the
    ``masked_nan_may_leak`` rule; a read past a decode length and a lost visible NaN have their
    own). ``inline``: call the kernel on this thread (no timeout), for libraries whose state is
    bound to the thread that made it."""
    if isinstance(adapter, str):
        adapter = get_adapter(adapter)
    conv = resolve_conventions(adapter, conventions, masked_rows, allow_nan_leaks)
    start = time.perf_counter()
    why_not = adapter.supports(case)
    if why_not is not None:
        return CaseResult(case, "skip", why_not)
    inputs = make_inputs(case)
    def oracle(c=case, **kw):
        return attention(c, inputs, **{"empty_rows": conv.empty_rows, **kw})

    ref = oracle()
    orders = ("blas",) if case.contract == "backward" else ("blas", "in-order")
    plains = [oracle(precision=case.dtype, order=o) for o in orders]
    shifts = [oracle(case.replace(scale=case.scale_value * (1 + bounds.SCALE_ROUNDING)))]
    if case.contract == "backward":
        shifts.append(oracle(saved_lse_rounding=bounds.U32))
    result = CaseResult(case, "pass")
    try:
        inline = inline or adapter.inline
        first = _call(adapter, fn, case, _copy_inputs(inputs), timeout, inline)
        second = _call(adapter, fn, case, _copy_inputs(inputs), timeout, inline)
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
        reasons.append((f"the kernel returned no {', '.join(missing)}", None))
    apriori = bounds.apriori(case, inputs, ref) if case.contract != "backward" else {}
    for name in names:
        want, free = _expected(case, ref, name, conv)
        plain_wants = [_expected(case, p, name, conv)[0] for p in plains]
        shifted = [_expected(case, x, name, conv)[0] for x in shifts]
        judged = _judge(case, name, first[name], want, free, plain_wants, shifted, ref, conv, notes)
        if judged.check is not None:
            judged.check.apriori = apriori.get(name)
            result.checks.append(judged.check)
        if judged.reasons:
            reasons += judged.reasons
            result.where.append(locate(case, name, judged, ref, first[name], oracle, conv))
    result.deterministic = all(np.array_equal(first[n], second.get(n), equal_nan=True)
                               for n in first)
    if not result.deterministic:
        reasons.append(("not deterministic: the same inputs twice gave different bits", None))
    if reasons:
        result.status = "fail"
        result.reason = "; ".join(text for text, _ in reasons)
        rules = {rule for _, rule in reasons}
        if len(rules) == 1 and None not in rules:
            result.hint = RULES[rules.pop()][1]
    elif notes:
        result.reason = "; ".join(notes)
    result.conventions = conv
    result.seconds = time.perf_counter() - start
    return result


def check_attention(fn, adapter: str = "sdpa", quick: bool = False, dtypes=("float32",),
                    contracts=None, masked_rows: str | None = None, device: str = "cpu",
                    timeout: float = DEFAULT_TIMEOUT, progress=None, cases=None,
                    fail_fast: bool = False, allow_nan_leaks: bool = False,
                    long: bool = False, conventions: Conventions | None = None,
                    inline: bool = False) -> list[CaseResult]:
    """Run ``fn`` through the sweep (:func:`refmath.conformance.case.sweep`) with the adapter
    named ``adapter``; returns one :class:`CaseResult` per case, skips included. ``contracts``
    defaults to the adapter's own; ``progress`` is called as ``progress(done, total, result)``
    after each case; ``cases`` replaces the sweep; ``fail_fast`` stops at the first failure;
    ``masked_rows``, ``allow_nan_leaks``, ``conventions`` and ``inline`` are :func:`check_case`'s;
    ``long`` adds the
    ``T = 32k`` cases."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable kernel, got {type(fn).__name__}")
    adapter_obj = get_adapter(adapter, device) if isinstance(adapter, str) else adapter
    resolve_conventions(adapter_obj, conventions, masked_rows, allow_nan_leaks)  # bad input first
    if cases is None:
        contracts = adapter_obj.contracts if contracts is None else tuple(contracts)
        cases = sweep(contracts, tuple(dtypes), quick, long)
    results = []
    for i, case in enumerate(cases):
        results.append(check_case(fn, adapter_obj, case, masked_rows, timeout, allow_nan_leaks,
                                  conventions, inline))
        if progress is not None:
            progress(i + 1, len(cases), results[-1])
        if fail_fast and results[-1].status == "fail":
            break
    return results
