"""Softmax over the last axis: the stable form, its log, its Jacobian, and the online form.

Every softmax here subtracts the row maximum before exponentiating (catalogue A11, S4): the result
is unchanged in real arithmetic, and no exponential can overflow because its argument is at most 0.

Masked entries are ``-inf``. They get weight exactly 0 and gradient exactly 0. A row in which every
entry is ``-inf`` (a query with no visible key, a padded sequence of length 0) has no distribution at
all; it is handled explicitly, because the max-subtraction trick would compute
``-inf - (-inf) = NaN`` there. By convention such a row gives zeros and a zero gradient.

"Fully masked" means every entry is ``-inf`` and nothing else. A row holding a NaN is not masked:
NaN in gives NaN out, in every function here, forward and backward, so a NaN can never pass for a
good-looking number downstream.

The online form (catalogue F2, F3) keeps, for a set of keys, the running maximum ``m``, the sum ``l``
of ``exp(s - m)`` and the weighted value sum ``u``. Two disjoint sets merge exactly, so keys can be
processed block by block without ever holding a whole row of scores: the core of FlashAttention.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from refmath._validate import check_axis, check_min_ndim, check_ndim, float_array
from refmath.registry import OpCase, register_case

__all__ = ["SoftmaxCache", "softmax_forward", "softmax_backward", "softmax_jacobian",
           "LogSoftmaxCache", "log_softmax_forward", "log_softmax_backward", "OnlineSoftmaxState",
           "online_softmax_empty", "online_softmax_block", "online_softmax_merge",
           "online_softmax_result", "online_softmax_logsumexp"]


def _shifted_exp(x: np.ndarray):
    """Return ``(exp(x - m), m, masked)`` with ``m`` the row maximum, made safe for fully masked rows.

    ``masked`` (bool, ``(..., 1)``) marks the fully masked rows: those whose maximum is ``-inf``,
    which happens exactly when every entry is ``-inf`` (``np.max`` returns NaN for a row holding a
    NaN, so such a row is never taken for a masked one). For a masked row ``x - m`` would be NaN;
    shifting it by 0 instead gives ``exp(-inf) = 0`` everywhere and a zero row sum. An empty last
    axis is treated the same way (``initial=-inf``): no keys at all is a fully masked row.
    """
    m = np.max(x, axis=-1, keepdims=True, initial=-np.inf)
    masked = np.isneginf(m)
    m = np.where(masked, 0.0, m)
    shifted = x - m
    # exp in place: x - m is a fresh array of our own, and attention's score tensors are large
    return np.exp(shifted, out=shifted), m, masked


class SoftmaxCache(NamedTuple):
    a: np.ndarray  # the softmax output, shape (..., n); 0 at masked entries and on fully masked rows


def softmax_forward(x):
    r"""Stable softmax over the last axis (catalogue A2, A11).

    .. math::
        a_j = \frac{e^{x_j - m}}{\sum_u e^{x_u - m}},\qquad m = \max_u x_u

    ``x`` is ``(..., n)`` and may hold ``-inf`` (masked entries, weight 0). A fully masked row gives
    a row of zeros instead of NaN: there is nothing to normalise, and zeros let the caller's sums
    (``a @ v`` in attention) come out as 0 rather than poisoning a whole batch with NaN.

    Returns ``(a, cache)`` with ``a`` the shape and dtype of ``x``.
    """
    x = float_array("x", x)
    check_min_ndim("x", x, 1, "(..., n)")
    e, _, masked = _shifted_exp(x)
    total = e.sum(axis=-1, keepdims=True)
    # A fully masked row sums to 0; dividing it by 1 keeps it at exactly 0. Every other row sums to
    # at least 1 (its maximum contributes exp(0)), or to NaN, which then reaches every entry.
    e /= np.where(masked, 1.0, total)  # normalise in place: e is ours, and no copy is needed
    return e, SoftmaxCache(e)


def softmax_backward(dout, cache: SoftmaxCache):
    r"""Gradient of softmax: returns ``dx`` (catalogue A5, A8).

    The Jacobian is :math:`\partial a_j / \partial x_u = a_j(\delta_{ju} - a_u)`, so the
    vector-Jacobian product needs no ``n x n`` matrix:

    .. math::
        dx_u = a_u \Big(dout_u - \sum_j a_j\, dout_j\Big)

    Masked entries and fully masked rows have ``a = 0`` and so receive exactly zero gradient.
    """
    a = cache.a
    return a * (dout - np.sum(a * dout, axis=-1, keepdims=True))


def softmax_jacobian(a):
    r"""The Jacobian of softmax at one row, from its output ``a`` (catalogue A5).

    .. math::
        J = \operatorname{diag}(a) - a a^\top,\qquad J_{ju} = \frac{\partial a_j}{\partial x_u}
          = a_j(\delta_{ju} - a_u)

    ``a`` has shape ``(n,)``; ``J`` is ``(n, n)`` and symmetric. For teaching and tests only: the
    backward pass uses the product form and never builds ``J``.
    """
    a = float_array("a", a)
    check_ndim("a", a, 1, "(n,)")
    return np.diag(a) - np.outer(a, a)


class LogSoftmaxCache(NamedTuple):
    a: np.ndarray  # softmax probabilities, shape (..., n); 0 at masked entries and on fully masked rows
    allowed: np.ndarray  # bool (..., n): True where the input was not -inf


def log_softmax_forward(x):
    r"""Stable log-softmax over the last axis.

    .. math::
        y_j = x_j - m - \log \sum_u e^{x_u - m},\qquad m = \max_u x_u

    Computed directly rather than as ``log(softmax(x))``, which would give ``-inf`` wherever a
    probability underflows to 0 although ``y`` is finite there.

    Masked entries (``-inf``) of a partly masked row are ``-inf`` in the output: they have
    probability 0. A fully masked row has no distribution; by convention it gives zeros (not NaN and
    not ``-inf``), so that a loss which multiplies such rows by a zero weight stays finite.

    Returns ``(y, cache)`` with ``y`` the shape and dtype of ``x``.
    """
    x = float_array("x", x)
    check_min_ndim("x", x, 1, "(..., n)")
    e, m, masked = _shifted_exp(x)
    total = np.where(masked, 1.0, e.sum(axis=-1, keepdims=True))
    # (x - m) is exact-ish and small; subtracting log(total) from it, rather than x - (m + log total),
    # avoids rounding the large m + log(total) first when the logits are large. Only the fully
    # masked rows become 0; a row with a NaN stays NaN.
    y = np.where(masked, 0.0, (x - m) - np.log(total))
    a = e / total
    return y, LogSoftmaxCache(a, ~np.isneginf(x))


def log_softmax_backward(dout, cache: LogSoftmaxCache):
    r"""Gradient of log-softmax: returns ``dx``.

    Since :math:`\partial y_j / \partial x_u = \delta_{ju} - a_u`:

    .. math::
        dx_u = dout_u - a_u \sum_j dout_j

    where the sum runs over the allowed (finite-input) entries only. A masked entry is the constant
    ``-inf``: no finite change of the input moves it, so it receives zero gradient, and its upstream
    gradient reaches nothing (any loss that weighted a ``-inf`` output would be infinite anyway).
    Fully masked rows are constant zeros and get zero gradient.
    """
    a, allowed = cache
    dout = np.where(allowed, dout, 0.0)
    return dout - a * np.sum(dout, axis=-1, keepdims=True)


# ---- online softmax (FlashAttention's running statistics) ---------------------------------------

class OnlineSoftmaxState(NamedTuple):
    """Statistics of softmax-weighted values over a set of keys (catalogue F2).

    For each query row: ``m`` the largest score seen, ``l = sum exp(s_j - m)`` and
    ``u = sum exp(s_j - m) v_j``. A set with no visible key is carried as ``m = -inf, l = 0, u = 0``.
    """

    m: np.ndarray  # (...,)
    l: np.ndarray  # (...,)
    u: np.ndarray  # (..., d_v)


def online_softmax_empty(shape, d_v: int, dtype=np.float64) -> OnlineSoftmaxState:
    """The state of an empty set of keys: the identity of :func:`online_softmax_merge`.

    ``shape`` is the shape of the query rows (an int or a tuple), ``d_v`` the value width.
    """
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
    return OnlineSoftmaxState(
        np.full(shape, -np.inf, dtype=dtype),
        np.zeros(shape, dtype=dtype),
        np.zeros(shape + (int(d_v),), dtype=dtype),
    )


def online_softmax_block(scores, values) -> OnlineSoftmaxState:
    r"""Statistics of one block of keys (catalogue F2).

    .. math::
        m = \max_j s_j,\quad l = \sum_j e^{s_j - m},\quad u = \sum_j e^{s_j - m} v_j

    ``scores`` is ``(..., n)`` (``-inf`` for masked keys), ``values`` is ``(n, d_v)`` (shared by
    every row) or ``(..., n, d_v)``. A block whose keys are all masked, or that has ``n = 0``,
    gives the empty state ``m = -inf, l = 0, u = 0``.
    """
    scores = float_array("scores", scores)
    values = float_array("values", values)
    check_min_ndim("scores", scores, 1, "(..., n)")
    check_min_ndim("values", values, 2, "(n, d_v) or (..., n, d_v)")
    check_axis("values", values, -2, scores.shape[-1], f"scores.shape = {scores.shape}")
    p, m, masked = _shifted_exp(scores)
    l = p.sum(axis=-1)
    u = np.matmul(p[..., None, :], values)[..., 0, :]
    # _shifted_exp replaced the max of an all-masked row by 0; the state records it as -inf.
    m = np.where(masked[..., 0], -np.inf, m[..., 0])
    return OnlineSoftmaxState(m, l, u)


def online_softmax_merge(a: OnlineSoftmaxState, b: OnlineSoftmaxState) -> OnlineSoftmaxState:
    r"""Merge the statistics of two disjoint sets of keys (catalogue F3).

    .. math::
        m = \max(m_A, m_B),\quad l = e^{m_A - m} l_A + e^{m_B - m} l_B,\quad
        u = e^{m_A - m} u_A + e^{m_B - m} u_B

    Exact in real arithmetic, commutative (bit for bit) and associative (up to rounding). An empty
    set (``m = -inf``) gets factor ``e^{-inf} = 0``; when both are empty the shift is replaced by 0
    so that ``-inf - (-inf)`` never occurs and the result is again the empty state.
    """
    # BEGIN SOLUTION
    m = np.maximum(a.m, b.m)
    shift = np.where(np.isneginf(m), 0.0, m)
    alpha = np.exp(a.m - shift)
    beta = np.exp(b.m - shift)
    return OnlineSoftmaxState(
        m,
        alpha * a.l + beta * b.l,
        alpha[..., None] * a.u + beta[..., None] * b.u,
    )
    # END SOLUTION


def online_softmax_result(state: OnlineSoftmaxState) -> np.ndarray:
    r"""The attention output :math:`o = u / l` (catalogue F1, F3); 0 for rows with no visible key.

    A row with no visible key is recognised by ``m = -inf``, not by ``l = 0``: a NaN ``l`` must
    give a NaN output, and ``l > 0`` is False for NaN.
    """
    empty = np.isneginf(state.m)[..., None]
    return np.where(empty, 0.0, state.u / np.where(empty, 1.0, state.l[..., None]))


def online_softmax_logsumexp(state: OnlineSoftmaxState) -> np.ndarray:
    r"""The row logsumexp :math:`m + \log l = \log \sum_j e^{s_j}`; ``-inf`` for rows with no key.

    This one number per row is what FlashAttention saves for its backward pass: with it, the
    weights are recomputed as :math:`a_j = e^{s_j - \mathrm{lse}}`.
    """
    empty = np.isneginf(state.m)
    return np.where(empty, -np.inf, state.m + np.log(np.where(empty, 1.0, state.l)))


# ---- gradient-check cases ------------------------------------------------------------------------

def _softmax_rows(shape, n_masked=0, fully_masked_row=False):
    """Random rows; the first ``n_masked`` entries of every other row are masked with -inf, and the
    last row of the first batch entry is masked entirely when ``fully_masked_row`` is set."""
    def make(rng):
        x = 2.0 * rng.standard_normal(shape)
        rows = x.reshape(-1, shape[-1])
        rows[::2, :n_masked] = -np.inf
        if fully_masked_row:
            x[(0,) * (x.ndim - 2) + (-1,)] = -np.inf
        return {"x": x}
    return make


register_case(OpCase("softmax", "rows (3, 7)", ("A5", "A11"), _softmax_rows((3, 7)),
                     softmax_forward, softmax_backward, ("x",)))
register_case(OpCase("softmax", "partly masked rows (2, 3, 6)", ("A5", "A11"),
                     _softmax_rows((2, 3, 6), n_masked=2), softmax_forward, softmax_backward, ("x",)))
register_case(OpCase("softmax", "with a fully masked row (2, 3, 5)", ("A5", "A11"),
                     _softmax_rows((2, 3, 5), n_masked=1, fully_masked_row=True),
                     softmax_forward, softmax_backward, ("x",)))
register_case(OpCase("softmax", "4 leading axes (2, 1, 2, 3, 4), partly masked", ("A5", "A11"),
                     _softmax_rows((2, 1, 2, 3, 4), n_masked=3), softmax_forward, softmax_backward,
                     ("x",)))
register_case(OpCase("softmax", "one entry per row (3, 1)", ("A5", "A11"), _softmax_rows((3, 1)),
                     softmax_forward, softmax_backward, ("x",)))
# A partly masked row gives -inf outputs at its masked entries: the check leaves those constants
# out of sum(out * dout) but still hands their random dout to the backward, which must ignore it.
register_case(OpCase("log_softmax", "rows (4, 6)", ("A11",), _softmax_rows((4, 6)),
                     log_softmax_forward, log_softmax_backward, ("x",)))
register_case(OpCase("log_softmax", "partly masked rows (2, 3, 6)", ("A11",),
                     _softmax_rows((2, 3, 6), n_masked=2), log_softmax_forward, log_softmax_backward,
                     ("x",)))
register_case(OpCase("log_softmax", "with a fully masked row (2, 3, 5)", ("A11",),
                     _softmax_rows((2, 3, 5), n_masked=1, fully_masked_row=True),
                     log_softmax_forward, log_softmax_backward, ("x",)))
register_case(OpCase("log_softmax", "4 leading axes (2, 1, 2, 3, 4), partly masked", ("A11",),
                     _softmax_rows((2, 1, 2, 3, 4), n_masked=1), log_softmax_forward,
                     log_softmax_backward, ("x",)))
register_case(OpCase("log_softmax", "one entry per row (3, 1)", ("A11",), _softmax_rows((3, 1)),
                     log_softmax_forward, log_softmax_backward, ("x",)))
