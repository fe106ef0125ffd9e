r"""Lesson 1, attention, step by step (``notebooks/01_attention.py``): the expected value and the
known slips of each exercise, computed from the library and from the lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise, flat_parameters, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


_A6 = "the section 'A6 and A7: several heads'"


@exercise("01.5", "the parameters with heads 0 and 1 swapped", _A6,
          "head r owns columns r d_h .. (r + 1) d_h of w_q, w_k, w_v and the same rows of w_o",
          uses=("params", "d_h"), prepare=flat_parameters)  # names and shapes before values
def _swapped_heads(params, d_h):
    order = np.r_[d_h:2 * d_h, 0:d_h]
    columns = {k: np.asarray(params[k])[:, order] for k in ("w_q", "w_k", "w_v")}
    return flat_parameters({**columns, "w_o": np.asarray(params["w_o"])[order]}), {
        "w_o left as it was: its rows must follow the heads they read": flat_parameters(
            {**columns, "w_o": params["w_o"]}),
        "the rows of w_q, w_k, w_v swapped, not their columns (the heads split the output width)":
            flat_parameters({**{k: np.asarray(params[k])[order] for k in ("w_q", "w_k", "w_v")},
                           "w_o": np.asarray(params["w_o"])[order]}),
        "nothing swapped": flat_parameters(params)}


@exercise("01.1", "the masked output", "the section 'A3: a worked example to check by hand'",
          "o = sum_j a_j v_j with a = (1/3, 2/3, 0)", uses=("q", "k", "v"))
def _masked_output(q, k, v):
    from refmath.attention import sdpa_forward

    mask = np.array([[0.0, 0.0, -np.inf]])
    return sdpa_forward(q, k, v, mask=mask, scale=1.0)[0], {
        "the unmasked weights (1/4, 1/2, 1/4)": sdpa_forward(q, k, v, scale=1.0)[0],
        "the masked weights not renormalised, (1/4, 1/2, 0)": np.array([[0.25, 0.5, 0.0]]) @ v}


_A5 = "the section 'A5: the softmax Jacobian'"
_A8 = "the section 'A8: the backward pass, by hand'"


@exercise("01.3", "the Jacobian of (1/4, 1/2, 1/4)", _A5,
          "the diagonal is a_j (1 - a_j), off the diagonal -a_j a_u")
def _jacobian_a3():
    from refmath.softmax import softmax_jacobian

    a = np.array([0.25, 0.5, 0.25])
    return softmax_jacobian(a), {
        "diag(a) alone: the -a a^T term is forgotten": np.diag(a),
        "the diagonal only, a_j (1 - a_j): the off-diagonal -a_j a_u are not zero":
            np.diag(a - a**2),
        "a a^T taken as the inner product (a number), not the outer product (a matrix)":
            np.diag(a) - a @ a,
        "the sign flipped: a a^T - diag(a)": -softmax_jacobian(a)}


def _dk_with_a_slip(dout, cache, reduce=np.sum, scale=None):
    """dK of attention without dropout, with a slip: another reduction of A dA in dS, or another
    scale."""
    a, d_a = cache.a, dout @ cache.v.T
    d_s = a * (d_a - reduce(a * d_a, axis=1, keepdims=True))
    return d_s.T @ cache.q * (cache.scale if scale is None else scale)


@exercise("01.6", "dK (causal)", _A8,
          "dS = A (dA - rowsum(A dA)) with the causal weights; then back through "
          "S = Q K^T / sqrt(d_k): s_ij reaches key j, so key j collects column j of dS (a "
          "transpose), times q_i, with the scale",
          uses=("dO", "cache_causal", "cache"), atol=1e-15)
def _causal_dk(dout, cache_causal, cache):
    from refmath.attention import sdpa_backward

    def dk():
        return sdpa_backward(dout, cache_causal)[1]
    return dk(), {
        **catalogued("sdpa: dK without the transpose of dS", dk),
        "the scale 1/sqrt(d_k) missing from dK: S = Q K^T / sqrt(d_k), so dK = dS^T Q / sqrt(d_k)":
            _dk_with_a_slip(dout, cache_causal, scale=1.0),
        "dQ's formula, dS K / sqrt(d_k): the keys' gradient is dS^T Q / sqrt(d_k)":
            sdpa_backward(dout, cache_causal)[0],
        **catalogued("softmax: sign of the correction flipped", dk),
        **catalogued("softmax: the -a a^T term dropped (a * dout)", dk),
        "the unmasked weights A, not A_causal": sdpa_backward(dout, cache)[1],
        "a mean for the sum in dS: <A, dA> is a weighted sum, its weights sum to one":
            _dk_with_a_slip(dout, cache_causal, reduce=np.mean)}


@exercise("01.7", "(dV, dQ) with dropout", _A8,
          "D multiplies A in dV and dA = dO V^T; dS uses A itself",
          uses=("dO", "cache_drop"), atol=1e-15)
def _dropout_dv_dq(dout, cache):
    from refmath.attention import sdpa_backward

    def dv_dq():
        grads = sdpa_backward(dout, cache)
        return np.concatenate([grads[2], grads[0]])
    # A * D inside dS: the softmax's Jacobian is of A, before dropout
    dropped = cache.a * cache.dropout_mask
    d_a = (dout @ cache.v.T) * cache.dropout_mask
    d_s = dropped * (d_a - np.sum(dropped * d_a, axis=1, keepdims=True))
    return dv_dq(), {
        **catalogued("sdpa: dropout mask ignored in dA", dv_dq),
        **catalogued("sdpa: dV from the weights before dropout", dv_dq),
        **catalogued("sdpa: scale missing from dQ", dv_dq),
        "A * D inside dS: the softmax's Jacobian is of A, before dropout":
            np.concatenate([dropped.T @ dout, d_s @ cache.k * cache.scale])}


_A4 = "the section 'A4: why divide by $\\sqrt{d_k}$'"


def _refmath_attention(Q, K, V, mask=None):
    """The reference of 01.2: refmath's sdpa_forward, its output only."""
    from refmath.attention import sdpa_forward

    return sdpa_forward(Q, K, V, mask=mask)[0]


def _attention_inputs():
    """No mask, a causal mask, and a cross-attention whose key 3 is padding (masked for every
    query, so no column of its scores is fully masked: the column-softmax slip stays finite)."""
    from refmath.attention import causal_mask

    draw = np.random.default_rng(1)
    Q, K, V = draw.standard_normal((4, 8)), draw.standard_normal((4, 8)), draw.standard_normal((4, 3))
    cross_mask = np.zeros((2, 5))
    cross_mask[:, 3] = -np.inf  # key 3 is padding
    return [(Q, K, V, None), (Q, K, V, causal_mask(4)),
            (draw.standard_normal((2, 16)), draw.standard_normal((5, 16)),
             draw.standard_normal((5, 2)), cross_mask)]


def _column_softmax_attention(Q, K, V, mask=None):
    """The slip: the softmax taken down each column (over the queries). A column every query
    masks (a padded key) has no weights at all: 0, not 0 / 0, so that the check prints no
    warning of its own."""
    scores = Q @ K.T / np.sqrt(Q.shape[-1]) + (0.0 if mask is None else mask)
    top = np.max(scores, axis=0, keepdims=True)
    e = np.exp(np.where(np.isneginf(scores), -np.inf, scores - np.where(np.isneginf(top), 0.0, top)))
    total = e.sum(axis=0, keepdims=True)
    return (e / np.where(total == 0, 1.0, total)) @ V


@function_exercise("01.2", "your attention forward", _A4,
                   "scores = Q K^T / sqrt(d_k) + mask; softmax along axis -1; then @ V")
def _attention_forward():
    from refmath.attention import sdpa_forward

    return dict(
        reference=_refmath_attention, inputs=_attention_inputs, rtol=1e-12,
        reference_name="refmath's sdpa_forward",
        slips={**catalogued("sdpa: the 1/sqrt(d_k) scale missing from the scores",
                            _refmath_attention),
               "divided by d_k, not by sqrt(d_k)": lambda Q, K, V, mask=None:
                   sdpa_forward(Q, K, V, mask=mask, scale=1 / Q.shape[-1])[0],
               "the mask ignored": lambda Q, K, V, mask=None: sdpa_forward(Q, K, V)[0],
               "the softmax down each column (over the queries), not along each row":
                   _column_softmax_attention})


def _torch_softmax(x):
    """The oracle of 01.4: torch's softmax, as refmath treats masked rows (used only where torch
    is)."""
    import torch

    return torch.softmax(x.clamp(min=torch.finfo(x.dtype).min), -1) * ~torch.isneginf(x)


@function_exercise("01.4", "your softmax backward", _A5,
                   "dx = a * (dout - <a, dout>), the sum over the last axis")
def _softmax_backward():
    from refmath.softmax import softmax_backward

    return dict(
        reference=softmax_backward, case="softmax[*", oracle=_torch_softmax,
        slips={**catalogued("softmax: the -a a^T term dropped (a * dout)", softmax_backward),
               **catalogued("softmax: sign of the correction flipped", softmax_backward),
               **catalogued("softmax: sum over the wrong axis", softmax_backward),
               **catalogued("softmax: Jacobian's diagonal only", softmax_backward),
               **catalogued("softmax: a mean for the sum in <a, dout>", softmax_backward),
               "the sum over the row without the weights a: dout - sum(dout)":
                   lambda dout, cache: cache.a * (dout - np.sum(dout, axis=-1, keepdims=True)),
               # the derivation's slip: J_ju = a_j (delta_ju - a_u) gives the factor a_u to both
               # terms of ds_u, the second one's included
               "the factor a_u left off the sum's term: a dout - <a, dout>":
                   lambda dout, cache: cache.a * dout - np.sum(cache.a * dout, axis=-1,
                                                               keepdims=True)})
