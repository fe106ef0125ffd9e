r"""Fused forms of reference ops, for the models' training path: the same numbers, fewer passes.

A chain of NumPy expressions such as ``0.5 * x * (1.0 + t)`` allocates a fresh array for every
operator and walks memory once per operator; PyTorch eager fuses the same chain into one or two
kernels. The functions here compute exactly what their reference counterparts compute, operation
for operation in the same order and the same dtype, so the results are equal bit for bit
(``tests/test_fused.py``), but write into a few buffers in place.

- :func:`bias_gelu_forward` / :func:`bias_gelu_backward`: the first half of the GELU FFN,
  :math:`a = \operatorname{GELU}(h + b)` with :math:`h = x W_1` (catalogue N5, N6), as
  :func:`refmath.ffn.linear_forward`'s bias followed by :func:`refmath.ffn.gelu_forward`.
- :func:`swiglu_forward` / :func:`swiglu_backward`: :func:`refmath.ffn.swiglu_forward` and
  :func:`refmath.ffn.swiglu_backward` (N7), with the same cache.
- :func:`geglu_forward` / :func:`geglu_backward`: :func:`refmath.ffn.geglu_forward` and
  :func:`refmath.ffn.geglu_backward` (N20, Gemma's MLP), with the same cache.
- :func:`layernorm_forward` / :func:`layernorm_backward`: :func:`refmath.norms.layernorm_forward`
  and :func:`refmath.norms.layernorm_backward` (N1), with the same cache.

Like the models that call them, these functions leave the checking of their arguments to the
caller: the models check their parameters and configurations once, up front.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from refmath.ffn import (_GELU_TANH_CUBIC, _INV_SQRT_2PI, _SQRT_2_OVER_PI, GeGLUCache, GELUCache,
                         SiLUCache, SwiGLUCache, matmul_rows, matmul_rows_many,
                         standard_normal_cdf)
from refmath.norms import LayerNormCache

__all__ = ["BiasGELUCache", "bias_gelu_forward", "bias_gelu_backward", "swiglu_forward",
           "swiglu_backward", "geglu_forward", "geglu_backward", "layernorm_forward",
           "layernorm_backward"]


# Elementwise chains run over blocks of rows, each pass over a block while it is still in the
# core's cache, instead of each pass over the whole (B, T, d_f) array from memory: 32768 elements
# are 128 KiB in float32, so the few arrays of a chain fit in L2 together. Every element still
# goes through the same operations in the same order, so blocking changes no bit of the result.
_BLOCK_ELEMENTS = 32768


def _row_blocks(rows: int, width: int):
    """Slices that cut ``rows`` rows of ``width`` elements into blocks of about
    ``_BLOCK_ELEMENTS``."""
    step = max(1, _BLOCK_ELEMENTS // max(width, 1))
    return [slice(start, start + step) for start in range(0, rows, step)]


def _rows(x: np.ndarray) -> np.ndarray:
    """``x`` as a ``(rows, width)`` matrix: a view when ``x`` is contiguous."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # not -1: unresolvable at width 0


def _tanh_gate(z: np.ndarray, out: np.ndarray) -> None:
    """``out = tanh(sqrt(2/pi) (z + 0.044715 z^3))``, the tanh GELU's gate, with the operations of
    :func:`refmath.ffn.gelu_forward` in its order (``z^3`` as ``(z z) z``)."""
    np.multiply(z, z, out=out)
    out *= z
    out *= _GELU_TANH_CUBIC
    out += z
    out *= _SQRT_2_OVER_PI
    np.tanh(out, out=out)


def _tanh_gelu_slope(z: np.ndarray, t: np.ndarray, out: np.ndarray) -> None:
    """``out`` = the tanh GELU's derivative at ``z`` from its gate ``t``, with the operations of
    :func:`refmath.ffn.gelu_backward` in its order:
    ``0.5 (1 + t + z (1 - t^2) sqrt(2/pi) (1 + 3 0.044715 z^2))``."""
    np.multiply(t, t, out=out)
    np.subtract(1.0, out, out=out)
    out *= _SQRT_2_OVER_PI
    slope = np.multiply(z, 3.0 * _GELU_TANH_CUBIC)
    slope *= z
    slope += 1.0
    out *= slope  # d tanh(...) / dz
    np.multiply(z, out, out=slope)
    np.add(t, 1.0, out=out)
    out += slope
    out *= 0.5


class BiasGELUCache(NamedTuple):
    z: np.ndarray  # h + b, the GELU's input
    gate: np.ndarray  # tanh(...) for the tanh form, Phi(z) for the exact form
    approximate: bool


def bias_gelu_forward(h: np.ndarray, b: np.ndarray | None, approximate: bool):
    r"""``GELU(h + b)`` in the tanh form (``approximate=True``) or the exact one; returns
    ``(a, cache)``.

    ``h`` ``(..., d_f)`` must be a float array the caller no longer needs (the product
    :math:`x W_1`): the biased input :math:`z = h + b` is written over it and kept for the
    backward. The formulas are those of :func:`refmath.ffn.gelu_forward`:
    :math:`\tfrac12 z (1 + \tanh(\sqrt{2/\pi}(z + 0.044715 z^3)))` or :math:`z\,\Phi(z)`.
    """
    z = _rows(h)
    gate, a = np.empty_like(z), np.empty_like(z)
    for rows in _row_blocks(*z.shape):
        zb, gb, ab = z[rows], gate[rows], a[rows]
        if b is not None:
            zb += b
        if approximate:
            _tanh_gate(zb, out=gb)
            np.multiply(zb, 0.5, out=ab)
            ab *= gb + 1.0
        else:
            gb[...] = standard_normal_cdf(zb)
            np.multiply(zb, gb, out=ab)
    z, gate, a = (x.reshape(h.shape) for x in (z, gate, a))
    return a, BiasGELUCache(z, gate, bool(approximate))


def bias_gelu_backward(da: np.ndarray, cache: BiasGELUCache):
    r"""Gradient of :func:`bias_gelu_forward` with respect to ``h``: returns ``dh`` (the bias
    gradient is ``dh`` summed over rows). The local derivative is
    :func:`refmath.ffn.gelu_backward`'s: with :math:`t` the cached tanh,
    :math:`\tfrac12\big(1 + t + z (1 - t^2) \sqrt{2/\pi} (1 + 3 \cdot 0.044715 z^2)\big)`, or
    :math:`\Phi(z) + z\,\varphi(z)` for the exact form.
    """
    z, gate, approximate = cache
    shape = z.shape
    z, gate, da = _rows(z), _rows(gate), _rows(da)
    dh = np.empty_like(z)
    for rows in _row_blocks(*z.shape):
        zb, gb, local = z[rows], gate[rows], dh[rows]
        if approximate:
            _tanh_gelu_slope(zb, gb, out=local)
        else:
            np.multiply(zb, -0.5, out=local)
            local *= zb
            np.exp(local, out=local)
            local *= _INV_SQRT_2PI
            local *= zb
            local += gb
        local *= da[rows]
    return dh.reshape(shape)


def _gate_and_up_input_grads(x, dg, du, w_gate, w_up):
    r"""The two gated FFNs' last step, from the gradients ``dg``, ``du`` of the gate and up
    projections (as rows): ``(dx, dW_g, dW_u)`` with :math:`dW_g = x^\top dg`,
    :math:`dW_u = x^\top du`, :math:`dx = dg\,W_g^\top + du\,W_u^\top`."""
    x_rows = _rows(x)
    dx = matmul_rows(dg, w_gate.T)
    dx += matmul_rows(du, w_up.T)
    return dx.reshape(x.shape), x_rows.T @ dg, x_rows.T @ du


def swiglu_forward(x, w_gate, w_up, w_down, *, matmul=matmul_rows_many):
    r""":math:`[\operatorname{SiLU}(x W_g) \odot (x W_u)]\, W_d`, as
    :func:`refmath.ffn.swiglu_forward` (whose checks the caller has made: float arrays of matching
    shapes); returns ``(y, cache)`` with the same :class:`refmath.ffn.SwiGLUCache`. ``matmul``:
    how the products are computed, as in :func:`refmath.ffn.linear_forward`.

    The sigmoid is :func:`refmath.ffn.sigmoid`'s overflow-free form,
    :math:`\sigma(g) = [g \ge 0\ ?\ 1 : e] / (1 + e)` with :math:`e = e^{-|g|}`.
    """
    g, up = matmul(x, (w_gate, w_up))
    shape = g.shape
    g, up = _rows(g), _rows(up)
    sig, hidden = np.empty_like(g), np.empty_like(g)
    for rows in _row_blocks(*g.shape):
        gb, sb, e = g[rows], sig[rows], hidden[rows]
        np.abs(gb, out=e)
        np.negative(e, out=e)
        np.exp(e, out=e)
        # The numerator [g >= 0 ? 1 : e] as max(e, [g >= 0]): e <= 1, so the maximum is 1 where
        # g >= 0 and e elsewhere (NaN stays NaN), the same values as np.where at a quarter of its
        # cost, which is slow with a scalar operand.
        np.maximum(e, gb >= 0, out=sb)
        e += 1.0
        sb /= e
        np.multiply(gb, sb, out=e)  # SiLU(g)
        e *= up[rows]
    g, sig, up, hidden = (x.reshape(shape) for x in (g, sig, up, hidden))
    return matmul(hidden, (w_down,))[0], SwiGLUCache(x, w_gate, w_up, w_down, SiLUCache(g, sig), up,
                                                    hidden)


def swiglu_backward(dout, cache: SwiGLUCache):
    r"""Gradients of :func:`swiglu_forward`: ``(dx, dw_gate, dw_up, dw_down)``, as
    :func:`refmath.ffn.swiglu_backward`: :math:`dm = dy\,W_d^\top`,
    :math:`dg = dm \odot u \odot \sigma(g)\,(1 + g\,(1 - \sigma(g)))`,
    :math:`du = dm \odot \operatorname{SiLU}(g)`, :math:`dx = dg\,W_g^\top + du\,W_u^\top`.
    """
    x, w_gate, w_up, w_down, gate, up, hidden = cache
    dw_down = _rows(hidden).T @ _rows(dout)
    dm = _rows(matmul_rows(dout, w_down.T))
    g, sig = _rows(gate.x), _rows(gate.sig)
    up = _rows(up)
    dg, du = np.empty_like(dm), np.empty_like(dm)
    for rows in _row_blocks(*dm.shape):
        dgb, slope, sb, gb = dg[rows], du[rows], sig[rows], g[rows]
        np.multiply(dm[rows], up[rows], out=dgb)
        dgb *= sb
        np.subtract(1.0, sb, out=slope)
        slope *= gb
        slope += 1.0
        dgb *= slope  # dm u SiLU'(g)
        np.multiply(gb, sb, out=slope)  # du: SiLU(g), recomputed instead of cached
        slope *= dm[rows]
    return (*_gate_and_up_input_grads(x, dg, du, w_gate, w_up), dw_down)


def geglu_forward(x, w_gate, w_up, w_down, *, matmul=matmul_rows_many):
    r""":math:`[\operatorname{GELU}_{\tanh}(x W_g) \odot (x W_u)]\, W_d`, as
    :func:`refmath.ffn.geglu_forward` (whose checks the caller has made: float arrays of matching
    shapes); returns ``(y, cache)`` with the same :class:`refmath.ffn.GeGLUCache`. ``matmul``:
    how the products are computed, as in :func:`refmath.ffn.linear_forward`.

    The gate is :func:`refmath.ffn.gelu_forward`'s tanh form,
    :math:`\tfrac12 g (1 + t)` with :math:`t = \tanh(\sqrt{2/\pi}(g + 0.044715 g^3))`.
    """
    g, up = matmul(x, (w_gate, w_up))
    shape = g.shape
    g, up = _rows(g), _rows(up)
    t, hidden = np.empty_like(g), np.empty_like(g)
    for rows in _row_blocks(*g.shape):
        gb, tb, hb = g[rows], t[rows], hidden[rows]
        _tanh_gate(gb, out=tb)
        np.multiply(gb, 0.5, out=hb)
        hb *= tb + 1.0  # GELU_tanh(g)
        hb *= up[rows]
    g, t, up, hidden = (x.reshape(shape) for x in (g, t, up, hidden))
    return matmul(hidden, (w_down,))[0], GeGLUCache(x, w_gate, w_up, w_down, GELUCache(g, t, True),
                                                   up, hidden)


def geglu_backward(dout, cache: GeGLUCache):
    r"""Gradients of :func:`geglu_forward`: ``(dx, dw_gate, dw_up, dw_down)``, as
    :func:`refmath.ffn.geglu_backward`: :math:`dm = dy\,W_d^\top`,
    :math:`dg = dm \odot u \odot \operatorname{GELU}_{\tanh}'(g)`,
    :math:`du = dm \odot \operatorname{GELU}_{\tanh}(g)`, :math:`dx = dg\,W_g^\top + du\,W_u^\top`.
    """
    x, w_gate, w_up, w_down, gate, up, hidden = cache
    dw_down = _rows(hidden).T @ _rows(dout)
    dm = _rows(matmul_rows(dout, w_down.T))
    g, t = _rows(gate.x), _rows(gate.gate)
    up = _rows(up)
    dg, du = np.empty_like(dm), np.empty_like(dm)
    for rows in _row_blocks(*dm.shape):
        dgb, dub, gb, tb = dg[rows], du[rows], g[rows], t[rows]
        _tanh_gelu_slope(gb, tb, out=dgb)
        np.multiply(dm[rows], up[rows], out=dub)  # dm u, the GELU's upstream gradient
        dgb *= dub
        np.multiply(gb, 0.5, out=dub)  # du: GELU_tanh(g), recomputed instead of cached
        dub *= tb + 1.0
        dub *= dm[rows]
    return (*_gate_and_up_input_grads(x, dg, du, w_gate, w_up), dw_down)


def layernorm_forward(x, gamma, beta, eps: float = 1e-5):
    r"""LayerNorm, :math:`\gamma \odot (x - \mu)/\sqrt{\sigma^2 + \epsilon} + \beta` over the
    last axis, as :func:`refmath.norms.layernorm_forward`; returns ``(y, cache)`` with the same
    :class:`refmath.norms.LayerNormCache`. Two arrays the shape of ``x`` instead of four."""
    mu = x.mean(axis=-1, keepdims=True)
    xhat = x - mu
    y = np.multiply(xhat, xhat)
    var = np.mean(y, axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat *= rstd
    np.multiply(xhat, gamma, out=y)
    y += beta
    return y, LayerNormCache(xhat, rstd, gamma)


def layernorm_backward(dout, cache: LayerNormCache):
    r"""Gradients of :func:`layernorm_forward`: ``(dx, dgamma, dbeta)``, as
    :func:`refmath.norms.layernorm_backward`: with :math:`g = \gamma \odot dy`,
    :math:`dx = \big(g - \overline{g} - \hat x\,\overline{g \odot \hat x}\big)/\sigma`."""
    xhat, rstd, gamma = cache
    rows = tuple(range(dout.ndim - 1))
    scratch = np.multiply(dout, xhat)
    dgamma = np.sum(scratch, axis=rows)
    dbeta = np.sum(dout, axis=rows)
    dx = np.multiply(dout, gamma)  # g, then dx in place
    np.multiply(dx, xhat, out=scratch)
    projection = np.mean(scratch, axis=-1, keepdims=True)
    dx -= dx.mean(axis=-1, keepdims=True)
    np.multiply(xhat, projection, out=scratch)
    dx -= scratch
    dx *= rstd
    return dx, dgamma, dbeta
