"""Layer normalisation and RMS normalisation over the last (feature) axis.

Both act on each row (token) separately, so any leading batch dimensions are allowed.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from refmath._validate import check_min_ndim, check_real, float_array
from refmath.registry import OpCase, register_case

__all__ = ["NORM_KINDS", "LayerNormCache", "layernorm_forward", "layernorm_backward",
           "RMSNormCache", "rmsnorm_forward", "rmsnorm_backward"]

# The norm kinds by name: one vocabulary for every model config's ``norm`` field, the blocks
# (refmath.models.blocks.norm_forward), refmath.sizing's ModelConfig and the compiled decode layer.
# RMSNorm (N2); LayerNorm with its bias (N1); LayerNorm without one (PaLM, Command-R).
NORM_KINDS = ("rmsnorm", "layernorm", "layernorm_no_bias")


def _check_norm_inputs(x, gamma, beta=None):
    x = float_array("x", x)
    gamma = float_array("gamma", gamma)
    check_min_ndim("x", x, 1, "(..., d)")
    d = x.shape[-1]
    if gamma.shape != (d,):
        raise ValueError(f"gamma must have shape ({d},) to match x.shape = {x.shape}, got {gamma.shape}")
    if beta is not None:
        beta = float_array("beta", beta)
        if beta.shape != (d,):
            raise ValueError(f"beta must have shape ({d},) to match x.shape = {x.shape}, got {beta.shape}")
    return x, gamma, beta


class LayerNormCache(NamedTuple):
    xhat: np.ndarray  # (x - mu) * rstd, shape (..., d)
    rstd: np.ndarray  # 1 / sqrt(var + eps), shape (..., 1)
    gamma: np.ndarray


def layernorm_forward(x, gamma, beta, eps: float = 1e-5):
    r"""LayerNorm (catalogue N1).

    .. math::
        \mu = \tfrac1d \sum_k x_k,\quad \sigma^2 = \tfrac1d \sum_k (x_k-\mu)^2,\quad
        y = \gamma \odot \frac{x-\mu}{\sqrt{\sigma^2+\epsilon}} + \beta

    The variance is the biased one (divide by ``d``), as in the original definition.

    Shapes: ``x`` is ``(..., d)``, ``gamma`` and ``beta`` are ``(d,)``; ``y`` has the shape of ``x``.
    Returns ``(y, cache)``.
    """
    x, gamma, beta = _check_norm_inputs(x, gamma, beta)
    eps = check_real("eps", eps, 0.0)  # 0 is allowed: the definition itself (N3) has no eps
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = xc * rstd
    return gamma * xhat + beta, LayerNormCache(xhat, rstd, gamma)


def layernorm_backward(dout, cache: LayerNormCache):
    # BEGIN SOLUTION
    r"""Gradients of LayerNorm: returns ``(dx, dgamma, dbeta)``.

    With :math:`\hat x = (x-\mu)/\sigma` and :math:`g = \gamma \odot dy`, the Jacobian of the
    normalisation removes the mean of ``g`` and its projection on :math:`\hat x`:

    .. math::
        dx = \frac{1}{\sigma}\Big(g - \overline{g} - \hat x\,\overline{g \odot \hat x}\Big),\quad
        d\gamma = \sum_{\text{rows}} dy \odot \hat x,\quad d\beta = \sum_{\text{rows}} dy

    where the bars are means over the ``d`` features.
    """
    xhat, rstd, gamma = cache
    rows = tuple(range(dout.ndim - 1))
    dgamma = np.sum(dout * xhat, axis=rows)
    dbeta = np.sum(dout, axis=rows)
    g = dout * gamma
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
    return dx, dgamma, dbeta
    # END SOLUTION


class RMSNormCache(NamedTuple):
    x: np.ndarray
    rrms: np.ndarray  # 1 / sqrt(mean(x^2) + eps), shape (..., 1)
    gamma: np.ndarray


def rmsnorm_forward(x, gamma, eps: float = 1e-6):
    r"""RMSNorm (catalogue N2): rescale by the root mean square, no mean subtraction, no bias.

    .. math::
        y = \gamma \odot \frac{x}{\sqrt{\tfrac1d \sum_k x_k^2 + \epsilon}}

    Shapes: ``x`` is ``(..., d)``, ``gamma`` is ``(d,)``. Returns ``(y, cache)``.
    """
    x, gamma, _ = _check_norm_inputs(x, gamma)
    eps = check_real("eps", eps, 0.0)  # 0 is allowed: the definition itself (N3) has no eps
    rrms = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return gamma * x * rrms, RMSNormCache(x, rrms, gamma)


def rmsnorm_backward(dout, cache: RMSNormCache):
    # BEGIN SOLUTION
    r"""Gradients of RMSNorm: returns ``(dx, dgamma)``.

    With :math:`r = (\overline{x^2}+\epsilon)^{-1/2}` and :math:`g = \gamma \odot dy`:

    .. math::
        dx = r\,g - r^3\, x\, \overline{g \odot x},\quad d\gamma = \sum_{\text{rows}} dy \odot x\,r
    """
    x, rrms, gamma = cache
    rows = tuple(range(dout.ndim - 1))
    dgamma = np.sum(dout * x * rrms, axis=rows)
    g = dout * gamma
    dx = rrms * g - rrms**3 * x * np.mean(g * x, axis=-1, keepdims=True)
    return dx, dgamma
    # END SOLUTION


# ---- gradient-check cases ------------------------------------------------------------------------

def _norm_inputs(shape, with_beta):
    def make(rng):
        d = shape[-1]
        inputs = {"x": rng.standard_normal(shape), "gamma": 1.0 + 0.5 * rng.standard_normal(d)}
        if with_beta:
            inputs["beta"] = rng.standard_normal(d)
        return inputs
    return make


# Shapes with 0, 1, 2 and 4 leading axes: dgamma and dbeta sum over all of them, and a sum over
# only the first two would pass every case up to 3-D. d = 1 is legal: x - mu = 0, the output is beta.
for _label, _shape in (("rows (3, 8)", (3, 8)), ("batch (2, 3, 5)", (2, 3, 5)),
                       ("4 leading axes (2, 1, 2, 3, 5)", (2, 1, 2, 3, 5)), ("one row (6,)", (6,)),
                       ("d = 1 (2, 3, 1)", (2, 3, 1))):
    register_case(OpCase("layernorm", _label, ("N1",), _norm_inputs(_shape, True),
                         layernorm_forward, layernorm_backward, ("x", "gamma", "beta")))
# No d = 1 case for RMSNorm: there it is x / sqrt(x^2 + eps), a smoothed sign(x) whose derivative
# eps / |x|^3 is tiny and whose higher derivatives are huge: no finite difference resolves it.
for _label, _shape in (("rows (3, 8)", (3, 8)), ("batch (2, 3, 5)", (2, 3, 5)),
                       ("4 leading axes (2, 1, 2, 3, 5)", (2, 1, 2, 3, 5)), ("one row (6,)", (6,)),
                       ("d = 2 (2, 3, 2)", (2, 3, 2))):
    register_case(OpCase("rmsnorm", _label, ("N2",), _norm_inputs(_shape, False),
                         rmsnorm_forward, rmsnorm_backward, ("x", "gamma")))
