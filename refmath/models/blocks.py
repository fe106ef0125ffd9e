r"""The blocks a decoder layer is written with, each a forward/backward pair that reads no
configuration: every size, kind and option arrives as an argument.

- the norms (:func:`norm_forward`): RMSNorm (N2), LayerNorm with its bias (N1) or without (PaLM);
- the residual sublayer (:func:`sublayer_forward`, N2, N4): :math:`x + F(N(x))`;
- the parallel block (:func:`parallel_forward`, N21): :math:`x + \operatorname{Attn}(N_1(x)) +
  \operatorname{FFN}(N_2(x))`;
- the post-normed branch (:func:`post_normed`, N22): :math:`F` followed by a norm of its output;
- the gated FFN (:func:`ffn_forward`, SwiGLU N7 or GeGLU N20) and the plain two-layer FFN
  (:func:`plain_ffn_forward`, N5, N6).

A family file writes its layer as a list of these calls and its backward as the mirror
(:mod:`refmath.models.decoder` for Llama and the families written as its options,
:mod:`refmath.models.falcon` for the parallel block, :mod:`refmath.models.olmo2` for the norms
after the sublayers, :mod:`refmath.models.gemma` for the sandwich norms and GeGLU,
:mod:`refmath.models.cohere`).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from refmath._validate import check_choice
from refmath.ffn import (LinearCache, SwiGLUCache, linear_backward, linear_forward,
                         matmul_rows_many)
from refmath.fast.fused import BiasGELUCache, swiglu_backward, swiglu_forward
from refmath.fast import fused as fused_ops
from refmath.models.common import apply_mask, prefixed
from refmath.norms import (NORM_KINDS, LayerNormCache, RMSNormCache, rmsnorm_backward,
                           rmsnorm_forward)

__all__ = [
    "LayerNormNoBiasCache", "norm_forward", "norm_backward", "SublayerCache",
    "sublayer_forward", "sublayer_backward", "parallel_forward", "parallel_backward",
    "ffn_forward", "ffn_backward", "geglu_ffn_backward", "PlainFFNCache", "plain_ffn_forward",
    "plain_ffn_backward", "PostNormCache", "post_normed", "post_normed_backward"
]


class LayerNormNoBiasCache(NamedTuple):
    ln: LayerNormCache  # of a LayerNorm whose bias is 0 and no parameter (PaLM)


def norm_forward(x, kind: str, gamma, beta, eps: float):
    r"""The layer norm ``kind`` (one of :data:`refmath.norms.NORM_KINDS`) with gain ``gamma`` on
    the rows ``x``: RMSNorm (N2), or LayerNorm (N1, :func:`refmath.fast.fused.layernorm_forward`)

    .. math::
        \operatorname{RMSNorm}(x) = \gamma \odot \frac{x}{\operatorname{rms}(x)},\qquad
        \operatorname{LN}(x) = \gamma \odot \frac{x - \mu}{\sigma} + \beta

    ``beta`` is LayerNorm's bias (``"layernorm"``; None for the others: ``"layernorm_no_bias"``
    has :math:`\beta = 0` and no parameter). Returns ``(y, cache)``.
    """
    check_choice("kind", kind, NORM_KINDS)  # another spelling must not fall through to the last
    if kind == "rmsnorm":
        return rmsnorm_forward(x, gamma, eps)
    if kind == "layernorm":
        return fused_ops.layernorm_forward(x, gamma, beta, eps)
    y, ln = fused_ops.layernorm_forward(x, gamma, 0.0, eps)
    return y, LayerNormNoBiasCache(ln)


def norm_backward(dy, cache):
    """Gradients of :func:`norm_forward`: ``(dx, {"gamma": ...})``, with ``"beta"`` for a LayerNorm
    with its bias. Without a norm (``cache`` None: the branch read ``x`` itself) ``dy`` passes
    through."""
    if cache is None:
        return dy, {}
    if isinstance(cache, RMSNormCache):
        dx, dgamma = rmsnorm_backward(dy, cache)
        return dx, {"gamma": dgamma}
    if isinstance(cache, LayerNormNoBiasCache):
        dx, dgamma, _ = fused_ops.layernorm_backward(dy, cache.ln)
        return dx, {"gamma": dgamma}
    dx, dgamma, dbeta = fused_ops.layernorm_backward(dy, cache)
    return dx, {"gamma": dgamma, "beta": dbeta}


class SublayerCache(NamedTuple):
    norm: object  # the pre-norm's cache (RMSNorm's or LayerNorm's); None where there is none
    branch: object  # the branch's own cache (attention or FFN)
    drop: np.ndarray | None  # residual dropout multiplier: 0 (dropped) or 1/(1-p), or None


def sublayer_forward(x, norm: Callable | None, branch_forward: Callable, drop=None):
    r"""A residual sublayer (N2, N4): :math:`y = x + D \odot F(N(x))` with the pre-norm
    :math:`N` (``norm(x) -> (N(x), cache)``, a norm with its parameters bound), or, with ``norm`` None,
    :math:`y = x + D \odot F(x)` (OLMo 2, whose branch normalises its output instead).

    ``branch_forward(h) -> (F(h), cache)`` is the attention or the FFN; ``drop`` is the residual
    dropout multiplier ``D`` (None: no dropout). Returns ``(y, cache)``.
    """
    h, norm_cache = (x, None) if norm is None else norm(x)
    f, branch = branch_forward(h)
    return x + apply_mask(f, drop), SublayerCache(norm_cache, branch, drop)


def sublayer_backward(dout, cache: SublayerCache, branch_backward: Callable):
    r"""Gradients of :func:`sublayer_forward`: returns ``(dx, norm_grads, branch_grads)``, the
    norm's gradients keyed ``"gamma"`` (and ``"beta"``).

    The identity path passes ``dout`` straight through (the point of Pre-LN, N4's :math:`I + J_F
    J_{LN}`); the branch path goes back through the dropout mask, the branch and the norm.
    """
    df = apply_mask(dout, cache.drop)
    dh, branch_grads = branch_backward(df, cache.branch)
    dx, norm_grads = norm_backward(dh, cache.norm)
    return dout + dx, norm_grads, branch_grads


def parallel_forward(x, norms: tuple, branches: tuple, drops=(None, None)):
    r"""A parallel block (N21; GPT-J, PaLM, Falcon): attention and FFN read the block's input and
    add to the residual together,

    .. math::
        x' = x + D_1 \odot \operatorname{Attn}(N_1(x)) + D_2 \odot \operatorname{FFN}(N_2(x))

    ``norms`` = ``(N_1, N_2)`` as :func:`sublayer_forward` takes a norm, ``N_2`` None when the FFN
    reads :math:`N_1(x)` too (one norm: GPT-J, PaLM, Falcon-7B; two: Falcon-40B); ``branches`` the
    attention and FFN forwards, ``drops`` their residual dropout multipliers (one per branch, as
    for the sequential sublayers; Falcon drops their sum with one). Returns ``(x', attn, ffn)``,
    each a :class:`SublayerCache` (the FFN's without a norm cache when it shares the attention's).
    """
    attn_norm, ffn_norm = norms
    h, attn_norm_cache = attn_norm(x)
    u, ffn_norm_cache = (h, None) if ffn_norm is None else ffn_norm(x)
    a, attn = branches[0](h)
    f, ffn = branches[1](u)
    y = x + apply_mask(a, drops[0]) + apply_mask(f, drops[1])
    return (y, SublayerCache(attn_norm_cache, attn, drops[0]),
            SublayerCache(ffn_norm_cache, ffn, drops[1]))


def parallel_backward(dout, attn: SublayerCache, ffn: SublayerCache, backwards: tuple,
                      shared: bool):
    r"""Gradients of :func:`parallel_forward`: ``(dx, attn_norm_grads, ffn_norm_grads,
    attn_grads, ffn_grads)``.

    ``x`` feeds three paths, the identity and both branches, so their gradients add up:

    .. math::
        dx = dx' + J_{N_1}^\top\, dh + J_{N_2}^\top\, du,\qquad
        dh = J_{\text{Attn}}^\top (D_1 \odot dx'),\quad du = J_{\text{FFN}}^\top (D_2 \odot dx')

    and with one norm (``shared``) both branches read :math:`h = N(x)`: :math:`dx = dx' +
    J_N^\top (dh + du)`, one backward through the norm.
    """
    dh, attn_grads = backwards[0](apply_mask(dout, attn.drop), attn.branch)
    du, ffn_grads = backwards[1](apply_mask(dout, ffn.drop), ffn.branch)
    if shared:
        dx, attn_norm_grads = norm_backward(dh + du, attn.norm)
        return dout + dx, attn_norm_grads, {}, attn_grads, ffn_grads
    dx_attn, attn_norm_grads = norm_backward(dh, attn.norm)
    dx_ffn, ffn_norm_grads = norm_backward(du, ffn.norm)
    return dout + dx_attn + dx_ffn, attn_norm_grads, ffn_norm_grads, attn_grads, ffn_grads


def ffn_forward(h, params: dict, activation: str = "silu", *, matmul=matmul_rows_many):
    """The SwiGLU branch (N7) with this layer's ``w_gate``, ``w_up``, ``w_down``: the numbers of
    :func:`refmath.ffn.swiglu_forward`, computed in place by :func:`refmath.fast.fused.swiglu_forward`;
    with ``activation="gelu_tanh"`` Gemma's GeGLU (N20, :func:`refmath.fast.fused.geglu_forward`).
    ``matmul``: how the products are computed (:func:`refmath.ffn.linear_forward`)."""
    w = (params["w_gate"], params["w_up"], params["w_down"])
    if activation == "gelu_tanh":
        return fused_ops.geglu_forward(h, *w, matmul=matmul)
    return swiglu_forward(h, *w, matmul=matmul)


def ffn_backward(dy, cache: SwiGLUCache):
    """Gradients of :func:`ffn_forward`: ``(dh, {"w_gate", "w_up", "w_down"})``."""
    dh, dw_gate, dw_up, dw_down = swiglu_backward(dy, cache)
    return dh, {"w_gate": dw_gate, "w_up": dw_up, "w_down": dw_down}


def geglu_ffn_backward(dy, cache):
    """Gradients of :func:`ffn_forward` with ``activation="gelu_tanh"``: ``(dh, {"w_gate",
    "w_up", "w_down"})``."""
    dh, dw_gate, dw_up, dw_down = fused_ops.geglu_backward(dy, cache)
    return dh, {"w_gate": dw_gate, "w_up": dw_up, "w_down": dw_down}


class PlainFFNCache(NamedTuple):
    first: LinearCache  # z = h W_1
    act: BiasGELUCache  # GELU(z), exact or in its tanh form
    second: LinearCache  # y = a W_2


def plain_ffn_forward(h, params: dict, approximate: bool, *, matmul=matmul_rows_many):
    r"""The plain two-layer FFN without biases (N5, N6; Falcon, GPT-J), with this layer's ``w_up``
    (:math:`W_1`, ``(d, d_f)``) and ``w_down`` (:math:`W_2`, ``(d_f, d)``):

    .. math::
        F(h) = \operatorname{GELU}(h W_1)\, W_2

    the GELU exact or, with ``approximate``, in its tanh form
    (:func:`refmath.fast.fused.bias_gelu_forward`, the numbers of :func:`refmath.ffn.gelu_forward`).
    Returns ``(y, cache)``; ``matmul`` as in :func:`ffn_forward`.
    """
    z, first = linear_forward(h, params["w_up"], matmul=matmul)
    a, act = fused_ops.bias_gelu_forward(z, None, approximate)
    y, second = linear_forward(a, params["w_down"], matmul=matmul)
    return y, PlainFFNCache(first, act, second)


def plain_ffn_backward(dy, cache: PlainFFNCache):
    r"""Gradients of :func:`plain_ffn_forward`: ``(dh, {"w_up", "w_down"})``; with :math:`z = h
    W_1`, :math:`a = \operatorname{GELU}(z)`: :math:`da = dy\, W_2^\top`, :math:`dz = da \odot
    \operatorname{GELU}'(z)`, :math:`dh = dz\, W_1^\top`."""
    da, dw_down, _ = linear_backward(dy, cache.second)
    dz = fused_ops.bias_gelu_backward(da, cache.act)
    dh, dw_up, _ = linear_backward(dz, cache.first)
    return dh, {"w_up": dw_up, "w_down": dw_down}


class PostNormCache(NamedTuple):
    branch: object  # the branch's cache
    norm: object  # of the norm on its output


def post_normed(branch_forward: Callable, norm: Callable) -> Callable:
    r"""The branch followed by a norm of its output (``norm(y) -> (N(y), cache)``): Gemma 2/3's
    sandwich :math:`x + \operatorname{RMSNorm}(F(\operatorname{RMSNorm}(x)))`, or, without the
    pre-norm, OLMo 2's :math:`x + \operatorname{RMSNorm}(F(x))` (N22)."""
    def forward(h):
        y, branch = branch_forward(h)
        z, norm_cache = norm(y)
        return z, PostNormCache(branch, norm_cache)
    return forward


def post_normed_backward(branch_backward: Callable, grads: dict, name: str) -> Callable:
    """The backward of :func:`post_normed`; the output norm's gradients go to ``grads`` under
    ``name`` (``name.gamma``, ...)."""
    def backward(dz, cache: PostNormCache):
        dy, norm_grads = norm_backward(dz, cache.norm)
        grads.update(prefixed(name, norm_grads))
        return branch_backward(dy, cache.branch)
    return backward
