r"""The oracle, and the plain implementation in the kernel's own dtype that the bound is measured by.

One loop computes both, over chunks of query rows so that ``T = 32k`` fits in memory (a chunk holds
at most :data:`CHUNK_ELEMENTS` scores):

.. math::
    s_{ij} = \operatorname{cap}\tanh\!\big(\tau\, q_i \cdot k_j / \operatorname{cap}\big)
             - \mathrm{slope}_r |p_i - j| \ \ (j \text{ visible, else } -\infty),\qquad
    P_{ij} = e^{s_{ij} - m_i} / \textstyle\sum_j e^{s_{ij} - m_i},\qquad o_i = \sum_j P_{ij} v_j

with ``lse_i = m_i + log sum_j e^{s_ij - m_i}`` and the backward of catalogue A8 / F4:
``dV = P^T dO``, ``dS = P * (dO V^T - delta)``, ``dQ = tau dS K``, ``dK = tau dS^T Q``
(times ``1 - tanh^2`` under a soft cap), each key/value head summing over its query heads.

* ``precision="float64"``: the oracle, every operation in float64 on the inputs as the kernel
  received them (already rounded to its dtype).
* ``precision=<dtype>``: the *plain implementation* of flash-attention's rule: every matmul's
  output rounded to the dtype (float32 accumulation, as a GPU matmul does), the softmax in float32
  on the rounded scores, ``P`` rounded to the dtype before ``P V``, as PyTorch's math path computes
  low-precision attention. For float32 it is plain float32 NumPy.
* ``order``: how the plain implementation sums over keys. ``"blas"``: the softmax denominator by
  NumPy's pairwise sum and ``P V`` by BLAS, whose blocked sums are several times more accurate than
  a loop; ``"in-order"``: both summed key after key in float32, and each score ``q . k`` over the head
  width in order, as a kernel that walks its keys and its head width does. The tolerance takes the worse of the two, so that it measures the kernel, not one
  library's summation order (:mod:`refmath.conformance.bounds`).
* ``empty_rows``: what a row that sees no key computes
  (:mod:`refmath.conformance.conventions`): ``"zero"`` and ``"nan"`` leave it out (the caller puts
  the NaN), ``"unmasked"`` lets it see every key of its sequence, ``"mean-of-v"`` gives every key
  the same score and no gradient through the scores.

NaN follows the math definition exactly: a NaN in a visible position reaches every output it
feeds, and a NaN or inf in a position a row does not see reaches nothing of that row (a product
``0 * NaN`` is never formed: masked terms are left out, not multiplied by zero). A row with no
visible key has ``o = 0``, ``lse = -inf`` and zero gradients (under ``empty_rows="zero"``);
``empty`` marks those rows whatever the convention.
"""
from __future__ import annotations

import numpy as np

from refmath.conformance.case import AttentionCase, Inputs, alibi_slopes, query_positions, visible
from refmath.conformance.precision import round32

__all__ = ["attention"]

CHUNK_ELEMENTS = 1 << 21  # scores per chunk of rows: 16 MiB in float64 per temporary


def _masked_matmul(a, allowed, b, work):
    """``a @ b`` where ``a`` is zero outside ``allowed`` and ``b`` may hold NaN/inf in rows that
    ``allowed`` hides: those reach only the entries whose row of ``allowed`` includes them."""
    bad = ~np.isfinite(b)
    if not bad.any():
        return a @ b
    out = a @ np.where(bad, 0.0, b).astype(work)
    poison = (allowed.astype(work) @ bad.astype(work)) > 0
    out[poison] = np.nan
    return out


IN_ORDER_ELEMENTS = 1 << 22  # products held at once by the in-order sum


def _in_order_sum(p, allowed, vv, work):
    """``p @ vv`` summed term after term in ``work`` precision (``cumsum`` is a sequential sum),
    by blocks of terms so that ``rows x terms x cols`` stays small: ``P V`` key after key, or
    (``allowed`` None) ``q k^T`` over the head width in order. NaN/inf in ``vv`` reach only the
    rows that ``allowed`` lets see them, as in :func:`_masked_matmul`; with ``allowed`` None they
    reach every row, as in a plain product."""
    if allowed is None:
        allowed = np.ones(p.shape, dtype=bool)
    rows, n = p.shape
    d = vv.shape[1]
    bad = ~np.isfinite(vv)
    clean = np.where(bad, 0.0, vv).astype(work)
    acc = np.zeros((rows, d), dtype=work)
    block = max(1, IN_ORDER_ELEMENTS // max(1, rows * d))
    for j0 in range(0, n, block):
        terms = p[:, j0:j0 + block, None] * clean[None, j0:j0 + block, :]
        terms[:, 0] += acc
        acc = np.cumsum(terms, axis=1, dtype=work)[:, -1]
    if bad.any():
        acc[(allowed.astype(work) @ bad.astype(work)) > 0] = np.nan
    return acc


def attention(case: AttentionCase, inputs: Inputs, precision: str = "float64",
              saved_lse_rounding: float = 0.0, order: str = "blas",
              empty_rows: str = "zero") -> dict:
    """``o``, ``lse`` and ``empty`` (and ``dq``, ``dk``, ``dv`` for a backward case) of ``case`` at
    ``precision`` (see the module docstring); all returned in float64.

    ``saved_lse_rounding = u``: the backward uses the weights ``P (1 + u |lse_i|)``, as a kernel
    does that recomputes them as ``exp(s - lse)`` from a log-sum-exp saved to within ``u |lse|``."""
    if order not in ("blas", "in-order"):
        raise ValueError(f"order must be 'blas' or 'in-order', got {order!r}")
    exact = precision == "float64"
    in_order = order == "in-order" and not exact
    fill = empty_rows in ("unmasked", "mean-of-v")
    work = np.float64 if exact else np.float32

    def rnd(x):
        return x if exact else round32(x, precision)

    q, k, v = (x.astype(work) for x in (inputs.q, inputs.k, inputs.v))
    b_, h, t_q, d = q.shape
    g, t_k = k.shape[1], k.shape[2]
    group = h // g
    tau = work(case.scale_value)
    backward = case.contract == "backward"
    dout = inputs.dout.astype(work) if backward else None
    o = np.zeros((b_, h, t_q, d), dtype=work)
    lse = np.full((b_, h, t_q), -np.inf, dtype=work)
    empty = np.zeros((b_, h, t_q), dtype=bool)
    if backward:
        dq = np.zeros_like(q)
        dk32 = np.zeros(k.shape, dtype=work)
        dv32 = np.zeros(v.shape, dtype=work)
    slopes = alibi_slopes(h) if case.alibi else None
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(1, t_k))
    positions = query_positions(case)
    for b in range(b_):
        for i0 in range(0, t_q, rows_per_chunk):
            rows = slice(i0, min(t_q, i0 + rows_per_chunk))
            vis = visible(case, b, rows)
            none_seen = ~vis.any(axis=1)
            if fill and none_seen.any():  # the convention: such a row sees every key
                vis = vis.copy()
                vis[none_seen] = True
            # Only the keys some row of the chunk sees: hidden keys add nothing (and causal
            # attention costs half), exactly as a kernel skips the tiles a mask hides.
            seen = np.flatnonzero(vis.any(axis=0))
            keys = slice(int(seen[0]), int(seen[-1]) + 1) if seen.size else slice(0, 0)
            vis = vis[:, keys]
            bias = None
            if slopes is not None:
                bias = -np.abs(positions[rows][:, None] - np.arange(t_k)[None, keys]).astype(work)
            for r in range(h):
                u = r // group
                kk, vv, qq = k[b, u, keys], v[b, u, keys], q[b, r, rows]
                with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
                    raw = rnd(_in_order_sum(qq, None, kk.T, work) if in_order else qq @ kk.T) * tau
                    s = raw
                    if case.softcap is not None:
                        cap = work(case.softcap)
                        t = np.tanh(raw / cap)
                        s = cap * t
                    if bias is not None:
                        s = s + work(slopes[r]) * bias
                    s = np.where(vis, s, -np.inf)
                    if empty_rows == "mean-of-v":  # one score for every key: uniform weights
                        s = np.where(none_seen[:, None], 0.0, s)
                    m = s.max(axis=-1, keepdims=True, initial=-np.inf)  # NaN propagates
                    m_safe = np.where(np.isneginf(m), 0.0, m)
                    e = np.exp(s - m_safe)
                    if in_order:
                        l = np.cumsum(e, axis=-1, dtype=work)[:, -1:] if e.shape[1] else \
                            np.zeros((e.shape[0], 1), dtype=work)
                    else:
                        l = e.sum(axis=-1, keepdims=True)
                    none = l == 0
                    p = e / np.where(none, 1.0, l)
                    p = np.where(vis, rnd(p), 0.0).astype(work)
                    if in_order:
                        o_rows = rnd(_in_order_sum(p, vis, vv, work))
                    else:
                        o_rows = rnd(_masked_matmul(p, vis, vv, work))
                    o[b, r, rows] = o_rows
                    lse[b, r, rows] = (m_safe + np.log(l))[:, 0]
                    empty[b, r, rows] = none_seen
                    if backward:
                        do = dout[b, r, rows]
                        if saved_lse_rounding:
                            p = p * (1.0 + saved_lse_rounding * np.abs(
                                np.where(np.isfinite(lse[b, r, rows]), lse[b, r, rows], 0.0)))[:, None]
                        delta = (do * o_rows).sum(axis=-1, keepdims=True)
                        dv32[b, u, keys] += _masked_matmul(p.T, vis.T, do, work)
                        dp = rnd(_dp(do, vv, vis, work))
                        ds = np.where(vis, p * (dp - delta), 0.0)
                        if empty_rows == "mean-of-v":  # the scores were replaced: no gradient
                            ds = np.where(none_seen[:, None], 0.0, ds)
                        if case.softcap is not None:
                            ds = ds * (1.0 - t * t)
                        ds = rnd(ds)
                        dq[b, r, rows] = rnd(tau * _masked_matmul(ds, vis, kk, work))
                        dk32[b, u, keys] += tau * _masked_matmul(ds.T, vis.T, qq, work)
    out = {"o": o.astype(np.float64), "lse": lse.astype(np.float64), "empty": empty}
    if backward:
        out.update(dq=dq.astype(np.float64), dk=rnd(dk32).astype(np.float64),
                   dv=rnd(dv32).astype(np.float64))
    return out


def _dp(do, vv, vis, work):
    """``dO V^T`` restricted to the visible pairs: a NaN in a hidden value reaches no entry."""
    bad = ~np.isfinite(vv).all(axis=-1)  # keys whose value holds NaN/inf
    dp = do @ np.where(bad[:, None], 0.0, vv).astype(work).T
    if bad.any():
        dp[vis & bad[None, :]] = np.nan
    return dp
