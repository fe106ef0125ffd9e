r"""Fused forms of reference ops, for the models' training path: the same numbers, fewer passes.

A chain of NumPy expressions such as ``0.5 * x * (1.0 + t)`` allocates a fresh array for every
operator and walks memory once per operator; PyTorch eager fuses the same chain into one or two
kernels. The functions here compute exactly what their reference counterparts compute, operation
for operation in the same order and the same dtype, so the results are equal bit for bit
(``tests/test_fused.py``), but write into a few buffers in place.

- :func:`bias_gelu_forward` / :func:`bias_gelu_backward`: the first half of the GELU FFN,
  :math:`a = \operatorname{GELU}(h + b)` with :math:`h = x W_1` (catalogue N5, N6), as
  :func:`refmath.ffn.linear_forward`'s bias followed by :func:`refmath.ffn.gelu_forward`.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from refmath.ffn import _GELU_TANH_CUBIC, _INV_SQRT_2PI, _SQRT_2_OVER_PI, standard_normal_cdf

__all__ = ["BiasGELUCache", "bias_gelu_forward", "bias_gelu_backward"]


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
    z = h
    if b is not None:
        z += b
    if approximate:
        gate = np.multiply(z, z)
        gate *= z
        gate *= _GELU_TANH_CUBIC
        gate += z
        gate *= _SQRT_2_OVER_PI
        np.tanh(gate, out=gate)
        a = np.multiply(z, 0.5)
        a *= gate + 1.0
    else:
        gate = standard_normal_cdf(z)
        a = np.multiply(z, gate)
    return a, BiasGELUCache(z, gate, bool(approximate))


def bias_gelu_backward(da: np.ndarray, cache: BiasGELUCache):
    r"""Gradient of :func:`bias_gelu_forward` with respect to ``h``: returns ``dh`` (the bias
    gradient is ``dh`` summed over rows). The local derivative is
    :func:`refmath.ffn.gelu_backward`'s: with :math:`t` the cached tanh,
    :math:`\tfrac12\big(1 + t + z (1 - t^2) \sqrt{2/\pi} (1 + 3 \cdot 0.044715 z^2)\big)`, or
    :math:`\Phi(z) + z\,\varphi(z)` for the exact form.
    """
    z, gate, approximate = cache
    if approximate:
        local = np.multiply(gate, gate)
        np.subtract(1.0, local, out=local)
        local *= _SQRT_2_OVER_PI
        slope = np.multiply(z, 3.0 * _GELU_TANH_CUBIC)
        slope *= z
        slope += 1.0
        local *= slope  # d tanh(...) / dz
        np.multiply(z, local, out=slope)
        np.add(gate, 1.0, out=local)
        local += slope
        local *= 0.5
    else:
        local = np.multiply(z, -0.5)
        local *= z
        np.exp(local, out=local)
        local *= _INV_SQRT_2PI
        local *= z
        local += gate
    local *= da
    return local
