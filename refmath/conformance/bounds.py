r"""The error bound a kernel is held to, derived rather than guessed (catalogue C1).

(a) The rule (flash-attention's test suite; the house rule of ``DESIGN.md``). With ``o*`` the
float64 oracle on the inputs as the kernel received them, ``o_k`` the kernel's output and ``o_p``
the *plain implementation* in the kernel's own dtype (:mod:`refmath.conformance.oracle`: matmuls
rounded to the dtype with float32 accumulation, the softmax in float32, ``P`` rounded before
``P V``):

.. math::
    \max |o_k - o^*| \;\le\; \max\big(c\, \max |o_p - o^*|,\ \ 2u \max|o^*|\big)

with ``u`` the dtype's unit roundoff (:mod:`refmath.conformance.precision`). ``o_p`` is computed
in two summation orders (:mod:`refmath.conformance.oracle`: BLAS's blocked sums, and key after key
with each score summed over the head width in order) and the worse error is taken: BLAS's sums
are several times more accurate than a loop's at long lengths, and the bound must measure the
kernel, not one library's order. The output ``o`` and the lse are held row by row as well
(:func:`row_tolerance`, :func:`lse_row_magnitude`). Why ``c = 2``
(:data:`C`): the kernel and the plain implementation round at the same places and by the same
amounts (inputs, scores, ``P`` before ``P V``, float32 accumulation, the output), so each maximum
is the largest of many roundings of one size; a correct tiled kernel adds only the float32
rescalings of the online softmax (F3), one relative ``u_32`` per key tile, which is below the
dtype's ``u`` for 16-bit formats and of the order of the plain float32 implementation's own
accumulation error ``sqrt(T_k) u_32`` for float32. A factor of 2 leaves room for the maximum of one
set of roundings falling where the other's did not, and no more: a bug that changes which keys, how
they are weighed or which head is read moves the output by ``O(1)`` times its magnitude. The same
``c`` holds the gradients. The floor ``2u max|o*|`` is at least one ulp of the output's largest
entry (``2u |x| >= ulp(x)``): the kernel must deliver its result in its dtype, and that final
rounding alone costs up to half an ulp, the plain implementation's another half. So no tolerance is
ever below one ulp of the output's magnitude (sglang #35795), and none is wider than the plain
implementation's error allows (mlir-air #1427's ``atol = 0.5``).

For the gradients ``c = 3`` (:data:`C_BACKWARD`, as refmath's own kernel tests hold them): the
backward recomputes each weight from a saved float32 log-sum-exp, whose rounding ``u_32 |lse|``
becomes a relative error of every weight that the plain implementation (which keeps ``P``) never
pays, and ``dS = P (dP - delta)`` subtracts two sums of different orders.

One more term, added to the tolerance: the scale. A kernel receives ``tau`` as a real number and
uses its own rounded copy (``fl(tau)``, or ``fl(sqrt tau)^2`` when it scales ``q`` and ``k``
separately, as PyTorch does): within ``2 u_32`` of ``tau``. That moves every score by the same
relative amount, an error that does not average out as roundings do. Its size is measured, not
estimated: the oracle is run again at ``tau (1 + 2 u_32)`` and the largest change of each output
is added to its tolerance. For the gradients likewise the saved log-sum-exp: the oracle's backward
is run again with every weight times ``1 + u_32 |lse_i|`` and that change is added too.

(b) An a-priori bound, reported beside (a) to say how far inside the worst case the kernel sits.
For row ``i`` with ``n_i`` visible keys, to first order in ``u``, with ``u_a = 2^{-24}`` (float32
accumulation) and :math:`\gamma_n = n u_a / (1 - n u_a)`:

.. math::
    |\delta s_{ij}| \le \gamma_D\, \tau \sum_d |q_{id} k_{jd}| + u\, |s_{ij}| =: E_{ij}

.. math::
    |o_{k,i} - o^*_i| \le \big(2 \max_j E_{ij} + u + \gamma_{n_i} + 4 u_a\big)
        \max_{j\ \mathrm{visible}} |v_j|_\infty + u\, |o^*_i|

The softmax is 1-Lipschitz from the max norm of the scores to the 1-norm of the weights, twice
(:math:`\sum_j |\delta p_j| \le 2 \max_j |\delta s_j|`), whence the 2; rounding ``P`` costs
``u sum_j p_j |v_j|``, the float32 ``P V`` sum ``gamma_n`` of the same, the float32 softmax a few
``u_a``, and the final rounding ``u |o|``. For the log-sum-exp (1-Lipschitz in the max norm):
:math:`|\delta\,\mathrm{lse}_i| \le \max_j E_{ij} + \gamma_{n_i} + 4 u_a`. No a-priori bound is
stated for the gradients.
"""
from __future__ import annotations

import math

import numpy as np

from refmath.conformance.case import AttentionCase, Inputs, visible
from refmath.conformance.precision import U32, unit_roundoff

__all__ = ["factor", "tolerance", "row_tolerance", "lse_row_magnitude", "apriori"]

C_FORWARD = 2.0  # the factor of rule (a) for o and lse
C_BACKWARD = 3.0  # and for dq, dk, dv
SCALE_ROUNDING = 2 * U32  # how far from tau a kernel's own copy of it may be: fl(tau) or fl(sqrt tau)^2


def factor(name: str) -> float:
    """``c`` of rule (a) for the output ``name``."""
    return C_BACKWARD if name in ("dq", "dk", "dv") else C_FORWARD


def _gamma(n, u=U32):
    return n * u / (1.0 - n * u)


def tolerance(case: AttentionCase, name: str, plain_error: float, magnitude: float,
              scale_shift: float = 0.0) -> float:
    r"""The tolerance of rule (a) for one output (catalogue C1): with ``o*`` the float64 oracle,
    ``o_p`` the plain implementation in the kernel's dtype (unit roundoff ``u``) and ``c`` 2 for
    ``o`` and ``lse``, 3 for the gradients,

    .. math::
        \max |o_k - o^*| \;\le\; \max\big(c \max |o_p - o^*|,\ 2u \max |o^*|\big)
        + \max \big|o^*\big(\tau (1 + 2u_{32})\big) - o^*(\tau)\big|

    ``plain_error`` is ``max |o_p - o*|``, ``magnitude`` is ``max |o*|`` and ``scale_shift`` the
    last term, the oracle's own change when ``tau`` is moved by :data:`SCALE_ROUNDING` (and, for
    the gradients, when the saved lse is rounded). The module docstring derives each part."""
    return max(factor(name) * plain_error, 2.0 * unit_roundoff(case.dtype) * magnitude) + scale_shift


def row_tolerance(case: AttentionCase, name: str, plain_error, magnitude, scale_shift):
    r"""Rule (a) row by row (arrays over the rows of one output). An error confined to a few rows
    (a reduced-precision accumulator on one code path, say) can sit under the output-wide
    tolerance, which the rows of largest magnitude set, and still be several ulps in its own rows.
    Row ``i`` of magnitude ``m_i = max|o*_i|`` with plain error ``e_i`` may err by

    .. math::
        \max\big(c \max(e_i,\ r\, m_i),\ 2u\, m_i\big) \;+\; \text{its scale shift},
        \qquad r = \max_j e_j / m_j

    ``r`` is the plain implementation's worst error *relative to its row's magnitude*: rule (a)
    with every row brought to one scale, so that a row of small magnitude is held to its own size
    and not to the largest row's. (One row's own plain error alone would not do: it is one draw of
    a random rounding and can fall near zero where the kernel's does not.) ``c`` is (a)'s."""
    plain_error, magnitude = np.asarray(plain_error, float), np.asarray(magnitude, float)
    live = magnitude > 0
    rel = float((plain_error[live] / magnitude[live]).max(initial=0.0))
    floor = 2.0 * unit_roundoff(case.dtype) * magnitude
    c = factor(name)
    return np.maximum(c * np.maximum(plain_error, rel * magnitude), floor) + np.asarray(scale_shift)


def lse_row_magnitude(case: AttentionCase, size, compared) -> np.ndarray:
    r"""The magnitude that row ``i``'s lse is held to by :func:`row_tolerance`. A kernel computes
    ``lse = m + log l`` (``m`` the row's largest score, ``1 <= l <= n`` the sum of the shifted
    exponentials over its ``n <= T_k`` visible keys), and each part is rounded at its own size, so
    the error scales with ``|m| + |log l|``, not with ``|lse|``: the two nearly cancel when the
    scores are negative (``m = -3``, ``log l = 2.7``, ``lse = -0.3``). Since
    ``m <= lse <= m + log n``,

    .. math::
        |m| + |\log l| \;\le\; |lse| + 2 \log T_k

    which is the magnitude used (0 for rows not compared)."""
    size = np.asarray(size, float)
    return np.where(compared, size + 2.0 * math.log(max(case.t_k, 1)), 0.0)


def apriori(case: AttentionCase, inputs: Inputs, ref: dict) -> dict[str, float]:
    """Rule (b) for ``o`` and ``lse``: the largest per-row bound over the rows (see the module
    docstring); rows that are all masked or hold NaN have none."""
    u = unit_roundoff(case.dtype)
    tau = case.scale_value
    out = {"o": 0.0, "lse": 0.0}
    q = np.nan_to_num(inputs.q, nan=0.0, posinf=0.0, neginf=0.0)
    k = np.nan_to_num(inputs.k, nan=0.0, posinf=0.0, neginf=0.0)
    v = np.nan_to_num(inputs.v, nan=0.0, posinf=0.0, neginf=0.0)
    group = case.h // case.g
    gd = _gamma(case.d)
    rows_per_chunk = max(1, (1 << 21) // max(1, case.t_k))  # as the oracle: T = 32k fits
    for b in range(case.b):
        for i0 in range(0, case.t_q, rows_per_chunk):
            rows = slice(i0, min(case.t_q, i0 + rows_per_chunk))
            vis = visible(case, b, rows)
            n = vis.sum(axis=1)
            for r in range(case.h):
                u_head = r // group
                qr, kr = q[b, r, rows], k[b, u_head]
                absdot = np.abs(qr) @ np.abs(kr).T
                s = tau * (qr @ kr.T)
                if case.softcap is not None:
                    s = case.softcap * np.tanh(s / case.softcap)
                e = np.where(vis, gd * tau * absdot + u * np.abs(s), 0.0).max(axis=1, initial=0.0)
                vrow = np.abs(v[b, u_head]).max(axis=1)
                vmax = np.where(vis, vrow[None, :], 0.0).max(axis=1, initial=0.0)
                o_ref = ref["o"][b, r, rows]
                o_mag = np.nan_to_num(np.abs(o_ref), nan=0.0).max(axis=1)
                row_o = (2 * e + u + _gamma(n) + 4 * U32) * vmax + u * o_mag
                row_lse = e + _gamma(n) + 4 * U32
                ok = (n > 0) & np.isfinite(o_ref).all(axis=1)
                if ok.any():
                    out["o"] = max(out["o"], float(row_o[ok].max()))
                    out["lse"] = max(out["lse"], float(row_lse[ok].max()))
    return out
