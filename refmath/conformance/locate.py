r"""Where a failing case fails, and which question it raises: the verdict an engineer acts on.

For one failing output, :func:`locate` finds the worst row (``(batch, head, query)`` for ``o``,
``lse`` and ``dq``; ``(batch, key/value head, key)`` for ``dk`` and ``dv``), splits the failing
rows by what they see (at least one key / no key / a NaN), gives the visible keys of the worst row,
and says in one line which convention question the split points to:

* only rows that see no key fail: the empty-row convention; the kernel's values in those rows are
  tried against each convention (:mod:`refmath.conformance.conventions`) and the matching one named;
* only rows that see a NaN fail: whether NaN must reach the row;
* a causal case with ``T_q != T_k`` whose output matches the other alignment: the alignment.
"""
from __future__ import annotations

import numpy as np

from refmath.conformance.bounds import tolerance
from refmath.conformance.case import AttentionCase, visible
from refmath.conformance.conventions import EMPTY_ROWS

__all__ = ["locate", "summary_line"]


def _key_range(keep: np.ndarray) -> str:
    seen = np.flatnonzero(keep)
    if not seen.size:
        return "no key"
    span = f"keys {seen[0]}..{seen[-1]}"
    if seen.size != seen[-1] - seen[0] + 1:
        span += " (not contiguous)"
    return f"{span}: {seen.size} of {keep.size}"


def _split(bad: np.ndarray, groups: dict) -> dict:
    """``{group: [failing rows, rows]}`` for boolean row masks ``groups``."""
    return {name: [int((bad & g).sum()), int(g.sum())] for name, g in groups.items()}


def _matching_convention(case, name, got, ref, oracle, conv, empty):
    """``(match, closest, error)``: the empty-row convention whose values the kernel's rows that see
    no key match within the case's bound (or None), and the nearest one with its largest error."""
    if name != "o":
        return None, None, None
    rows = got[empty]
    best = (None, np.inf)
    for option in EMPTY_ROWS:
        if option == "nan":
            if np.isnan(rows).all() and option != conv.empty_rows:
                return option, option, 0.0
            continue
        want = np.zeros_like(rows) if option == "zero" else oracle(empty_rows=option)["o"][empty]
        with np.errstate(invalid="ignore"):
            err = float(np.abs(rows - want).max(initial=0.0)) if np.isfinite(rows).all() else np.inf
        tol = tolerance(case, name, 0.0, float(np.abs(want).max(initial=0.0)))
        if err <= 2 * tol and option != conv.empty_rows:
            return option, option, err
        if err < best[1]:
            best = (option, err)
    return None, best[0], best[1]


def _other_alignment(case, name, got, oracle, judged) -> str | None:
    """The alignment the kernel's output matches, when it is not the case's."""
    if not case.causal or case.t_q == case.t_k or name not in ("o", "lse") or case.varlen:
        return None
    other = "top-left" if case.alignment == "bottom-right" else "bottom-right"
    want = oracle(case.replace(alignment=other))[name]
    ok = np.isfinite(want) & np.isfinite(got)
    if not ok.any():
        return None
    err = float(np.abs(got[ok] - want[ok]).max())
    return other if err <= max(judged.check.tolerance, 1e-6) else None


def locate(case: AttentionCase, name: str, judged, ref: dict, got: np.ndarray, oracle, conv) -> dict:
    """The worst row of a failing output, the split of its failing rows, the worst row's visible
    keys and the question it raises (module docstring). ``judged``: :func:`run._judge`'s figures;
    ``oracle(case=..., empty_rows=...)`` recomputes the float64 reference."""
    err, tol, bad = judged.row_error, judged.row_tolerance, judged.row_bad
    with np.errstate(invalid="ignore", divide="ignore"):
        score = np.where(np.isinf(err), np.inf, err / np.maximum(tol, 1e-300))
    score = np.where(bad, score, -1.0)
    worst = tuple(int(x) for x in np.unravel_index(int(np.argmax(score)), score.shape))
    b, h, i = worst
    out = {"output": name, "failing_rows": int(bad.sum()), "rows": int(bad.size)}
    out["worst"] = {"batch": b, ("head" if name != "dk" and name != "dv" else "kv_head"): h,
                    ("row" if name not in ("dk", "dv") else "key"): i,
                    "error": float(err[worst]) if np.isfinite(err[worst]) else "NaN mismatch",
                    "row_tolerance": float(tol[worst])}
    empty = ref["empty"]
    if name in ("o", "lse", "dq"):
        sees_nan = np.isnan(ref[name]).reshape(bad.shape + (-1,)).any(axis=-1) & ~empty
        groups = {"see >= 1 key": ~empty & ~sees_nan, "see no key": empty, "see a NaN": sees_nan}
        out["split"] = _split(bad, groups)
        out["worst_row_keys"] = _key_range(visible(case, b, slice(i, i + 1))[0])
        only = [g for g, m in groups.items() if (bad & ~m).sum() == 0 and bad.any()]
        question = None
        if "see no key" in only:
            match, closest, err = _matching_convention(case, name, got, ref, oracle, conv, empty)
            question = ("empty rows: only rows that see no key fail, a convention question "
                        f"(declared: {conv.empty_rows})")
            if match:
                question += f"; the kernel's rows match '{match}' (--empty-rows {match})"
            elif closest is not None and np.isfinite(err):
                question += (f"; they match no convention to the bound, the nearest is '{closest}' "
                             f"(error {err:.2g}: a finite mask fill's rounding, say)")
        elif "see a NaN" in only:
            question = ("NaN propagation: only rows that see a NaN fail (a NaN they see must reach "
                        "them; --allow-lost-nan)")
        else:
            other = _other_alignment(case, name, got, oracle, judged)
            if other:
                question = (f"alignment: the output matches the {other} causal alignment, not the "
                            f"case's {case.alignment} (query i at key i"
                            + (" + T_k - T_q)" if other == "bottom-right" else ")"))
            elif bad[~empty].any() and (np.isnan(got).reshape(bad.shape + (-1,)).any(axis=-1)
                                        & bad & ~sees_nan).all():
                question = ("NaN through the mask: the failing rows see no NaN, yet come out NaN "
                            "from positions they do not see")
        out["question"] = question
    else:
        seen = np.stack([visible(case, bb).any(axis=0) for bb in range(case.b)])  # (B, T_k)
        seen = np.broadcast_to(seen[:, None, :], bad.shape)
        out["split"] = _split(bad, {"keys a query sees": seen, "keys no query sees": ~seen})
        out["question"] = None
    return out


def summary_line(where: dict) -> str:
    """One line for a terminal: the worst row, the split, the visible keys, the question."""
    w = where["worst"]
    coords = ", ".join(f"{k}={v}" for k, v in w.items() if k not in ("error", "row_tolerance"))
    err = w["error"] if isinstance(w["error"], str) else f"{w['error']:.3g}"
    split = "; ".join(f"{g}: {n} of {t} fail" for g, (n, t) in where["split"].items())
    line = f"{where['output']}: worst ({coords}) error {err}; {split}"
    if where.get("worst_row_keys"):
        line += f"; worst row sees {where['worst_row_keys']}"
    if where.get("question"):
        line += f". {where['question']}"
    return line
