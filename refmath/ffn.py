"""Position-wise feature transforms: linear maps, activations, soft-capping, the two-layer FFN, and
the gated FFNs SwiGLU and GeGLU.

Every op here acts on each row (token) separately, so any leading batch dimensions are allowed.
Row vectors throughout: ``y = x @ W + b`` with ``W`` shaped ``(d_in, d_out)``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from refmath._validate import (check_axis, check_choice, check_flag, check_int, check_min_ndim,
                               check_ndim, check_real, float_array)
from refmath.registry import OpCase, register_case

__all__ = ["matmul_rows", "matmul_rows_many",
           "LinearCache", "linear_forward", "linear_backward", "ReLUCache", "relu_forward",
           "relu_backward", "standard_normal_cdf", "GELUCache", "gelu_forward", "gelu_backward",
           "sigmoid", "SiLUCache", "silu_forward", "silu_backward", "check_softcap", "SoftcapCache",
           "softcap_forward", "softcap_backward", "FFNCache", "ffn_forward", "ffn_backward",
           "SwiGLUCache", "swiglu_forward", "swiglu_backward", "GeGLUCache", "geglu_forward",
           "geglu_backward", "swiglu_hidden_size", "ffn_parameter_count", "FFN_KINDS",
           "GATED_FFN_KINDS"]

# The FFN kinds by name: one vocabulary for every model config's ``ffn`` field, refmath.sizing's
# ModelConfig and the compiled decode layer. Gated, three matrices: SwiGLU (N7) and GeGLU with
# tanh-GELU (N20). Plain, two matrices (N5): exact GELU, tanh-GELU, ReLU (the original
# Transformer); their activations are ACTIVATIONS' entries of the same names.
FFN_KINDS = ("swiglu", "geglu", "gelu", "gelu_tanh", "relu")
GATED_FFN_KINDS = ("swiglu", "geglu")

# ---- linear map ----------------------------------------------------------------------------------


def _check_linear(x, w, b, x_name="x", w_name="w", b_name="b"):
    """Validate one affine map ``x @ w + b``; the names let composite ops report their own."""
    x = float_array(x_name, x)
    w = float_array(w_name, w)
    check_min_ndim(x_name, x, 1, "(..., d_in)")
    check_ndim(w_name, w, 2, "(d_in, d_out)")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"{x_name}.shape[-1] must equal {w_name}.shape[0] (d_in), "
            f"got {x_name}.shape = {x.shape} and {w_name}.shape = {w.shape}"
        )
    return x, w, _check_bias(b, b_name, w, w_name)


def _check_bias(b, b_name, w, w_name):
    if b is None:
        return None
    b = float_array(b_name, b)
    if b.shape != (w.shape[1],):
        raise ValueError(
            f"{b_name} must have shape ({w.shape[1]},) to match {w_name}.shape = {w.shape}, "
            f"got {b_name}.shape = {b.shape}"
        )
    return b


def matmul_rows(x, w):
    """``x @ w`` for ``x`` of shape ``(..., d_in)``, computed as one 2-D matrix product.

    Every row goes through the same ``w``, so the leading dimensions fold into one (the reshapes are
    free for contiguous ``x``): a single BLAS call on a ``(rows, d_in)`` matrix. For a 3-D ``x``
    NumPy would instead run one product per batch entry, which with 2 BLAS threads cost up to twice
    the CPU time at (8, 256, d) inputs.
    """
    return matmul_rows_many(x, (w,))[0]


def matmul_rows_many(x, ws) -> list:
    """``[matmul_rows(x, w) for w in ws]``, e.g. a layer's Q, K and V projections. The ops that
    project at a decode step take a function of this signature as ``matmul=`` (this one by
    default), so that a caller can hand them another way to compute the same products
    (:mod:`refmath.fast.products`)."""
    rows = math.prod(x.shape[:-1])  # not -1: that cannot be resolved when d_in is 0
    x2 = x.reshape(rows, x.shape[-1])
    return [(x2 @ w).reshape(x.shape[:-1] + (w.shape[1],)) for w in ws]


class LinearCache(NamedTuple):
    x: np.ndarray  # the input, (..., d_in)
    w: np.ndarray  # (d_in, d_out)
    has_bias: bool


def linear_forward(x, w, b=None, *, matmul=matmul_rows_many):
    r"""Affine map on row vectors (the building block of N5, N7 and every projection).

    .. math::
        y = x W + b

    Shapes: ``x`` is ``(..., d_in)``, ``w`` is ``(d_in, d_out)``, ``b`` is ``(d_out,)`` or ``None``;
    ``y`` is ``(..., d_out)``. Returns ``(y, cache)``. ``matmul``: how the product is computed, a
    function with :func:`matmul_rows_many`'s signature (that one by default).
    """
    x, w, b = _check_linear(x, w, b)
    y = matmul(x, (w,))[0]
    if b is not None and np.result_type(y, b) == y.dtype:
        y += b  # in place: y is the product's fresh array, and b does not widen it
    elif b is not None:
        y = y + b
    return y, LinearCache(x, w, b is not None)


def linear_backward(dout, cache: LinearCache):
    r"""Gradients of the affine map: returns ``(dx, dw, db)``, ``db`` is ``None`` without a bias.

    Every row is an independent sample of the same map, so the weight gradients sum over all rows
    (all leading dimensions):

    .. math::
        dx = dy\,W^\top,\quad dW = \sum_{\text{rows}} x^\top dy,\quad db = \sum_{\text{rows}} dy
    """
    x, w, has_bias = cache
    x_rows = x.reshape(-1, w.shape[0])
    dout_rows = dout.reshape(-1, w.shape[1])
    dx = matmul_rows(dout, w.T)
    dw = x_rows.T @ dout_rows
    db = dout_rows.sum(axis=0) if has_bias else None
    return dx, dw, db


# ---- activations ---------------------------------------------------------------------------------


class ReLUCache(NamedTuple):
    slope: np.ndarray  # the derivative at x: 1 where x > 0, 0 where x <= 0, NaN where x is NaN


def relu_forward(x):
    r"""ReLU, the activation of the original FFN (catalogue N5): :math:`\max(0, x)` elementwise.

    A NaN entry stays NaN (``np.maximum`` propagates it, where ``np.where(x > 0, ...)`` would turn
    it into 0). Returns ``(y, cache)`` with ``y`` of the shape and dtype of ``x``.
    """
    x = float_array("x", x)
    # heaviside(x, 0) is 1 for x > 0, 0 for x <= 0 (we take 0 at the kink itself), NaN for NaN
    return np.maximum(x, np.zeros((), dtype=x.dtype)), ReLUCache(np.heaviside(x, 0.0))


def relu_backward(dout, cache: ReLUCache):
    """Gradient of ReLU: ``dx = dout`` where ``x > 0``, else 0 (NaN where ``x`` was NaN)."""
    return dout * cache.slope


# NumPy has no erf and scipy is not a dependency, so the exact GELU maps the standard library's
# math.erf over the array. math.erf is accurate to about an ulp in double precision,
# which the float64 gradient checks and the PyTorch oracle need; a short polynomial approximation
# would be faster but only good to ~1e-7. The cost (~0.25 s per million entries) is acceptable for a
# reference library; speed lives in the compiled kernels.
_erf = np.frompyfunc(math.erf, 1, 1)

_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_CUBIC = 0.044715


def standard_normal_cdf(x) -> np.ndarray:
    r""":math:`\Phi(x) = \tfrac12\,(1 + \operatorname{erf}(x/\sqrt2))`, computed in float64, returned
    in the dtype of ``x``."""
    x = float_array("x", x)
    x64 = x.astype(np.float64)
    erf = np.asarray(_erf(x64 / _SQRT_2), dtype=np.float64)  # frompyfunc gives objects (a float if 0-d)
    return (0.5 * (1.0 + erf)).astype(x.dtype)


class GELUCache(NamedTuple):
    x: np.ndarray
    # exact form: Phi(x); tanh form: tanh(sqrt(2/pi) (x + 0.044715 x^3))
    gate: np.ndarray
    approximate: bool


def _gelu_form(approximate) -> bool:
    """True for the tanh form: ``True`` or PyTorch's ``"tanh"``; False for the exact form:
    ``False`` or PyTorch's ``"none"``. Anything else is refused: a truthy string such as ``"none"``
    must not quietly select the approximation."""
    if isinstance(approximate, (bool, np.bool_)):
        return bool(approximate)
    if isinstance(approximate, str):
        return check_choice("approximate", approximate, ("none", "tanh")) == "tanh"
    raise TypeError(f"approximate must be False, True, 'none' or 'tanh', got {approximate!r} of "
                    f"type {type(approximate).__name__}")


def gelu_forward(x, approximate: bool | str = False):
    r"""GELU (catalogue N6), in both named forms.

    Exact (``approximate=False`` or ``"none"``, the definition; PyTorch's ``approximate='none'``):

    .. math::
        \operatorname{GELU}(x) = x\,\Phi(x) = \tfrac12\,x\,\big(1 + \operatorname{erf}(x/\sqrt2)\big)

    tanh approximation (``approximate=True`` or ``"tanh"``, PyTorch's spelling; the form in OpenAI's
    GPT and GPT-2 code):

    .. math::
        \operatorname{GELU}_{\tanh}(x)
            = \tfrac12\,x\,\Big(1 + \tanh\big(\sqrt{2/\pi}\,(x + 0.044715\,x^3)\big)\Big)

    The two differ by less than 5e-4 everywhere (see ``tests/test_ffn.py``).
    Returns ``(y, cache)`` with ``y`` of the shape and dtype of ``x``.
    """
    x = float_array("x", x)
    approximate = _gelu_form(approximate)
    if approximate:
        # x * x * x, not x**3: NumPy computes a float32 power with a general pow() per element,
        # about 30x slower than two multiplications (21 ms against 0.7 ms for 2M entries).
        gate = np.tanh(_SQRT_2_OVER_PI * (x + _GELU_TANH_CUBIC * (x * x * x)))
        y = 0.5 * x * (1.0 + gate)
    else:
        gate = standard_normal_cdf(x)
        y = x * gate
    return y, GELUCache(x, gate, bool(approximate))


def gelu_backward(dout, cache: GELUCache):
    # BEGIN SOLUTION
    r"""Gradient of GELU: returns ``dx``.

    Exact form, with :math:`\varphi` the standard normal density:

    .. math::
        \frac{d}{dx}\,x\Phi(x) = \Phi(x) + x\,\varphi(x),\qquad \varphi(x) = e^{-x^2/2}/\sqrt{2\pi}

    tanh form, with :math:`t = \tanh(\sqrt{2/\pi}(x + 0.044715 x^3))`:

    .. math::
        \frac{d}{dx} = \tfrac12(1 + t) + \tfrac12\,x\,(1 - t^2)\,\sqrt{2/\pi}\,(1 + 3 \cdot 0.044715\,x^2)
    """
    # END SOLUTION
    x, gate, approximate = cache
    if approximate:
        dgate = (1.0 - gate * gate) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_CUBIC * x * x)
        local = 0.5 * (1.0 + gate + x * dgate)  # the formula's two halves share the factor 1/2
    else:
        # BEGIN SOLUTION
        local = gate + x * (_INV_SQRT_2PI * np.exp(-0.5 * x * x))
        # END SOLUTION
    return dout * local


def sigmoid(x) -> np.ndarray:
    r"""Logistic function :math:`\sigma(x) = 1/(1+e^{-x})` without overflow.

    ``exp`` is only ever taken of ``-|x|``, so it lies in (0, 1]: for ``x >= 0`` we use
    :math:`1/(1+e^{-x})`, for ``x < 0`` the equal form :math:`e^{x}/(1+e^{x})`.
    """
    x = float_array("x", x)
    e = np.exp(-np.abs(x))
    # the two branches share the denominator 1 + e: one division instead of two
    return np.where(x >= 0, 1.0, e) / (1.0 + e)


class SiLUCache(NamedTuple):
    x: np.ndarray
    sig: np.ndarray  # sigma(x)


def silu_forward(x):
    r"""SiLU (also called Swish-1, catalogue N6): :math:`\operatorname{SiLU}(x) = x\,\sigma(x)`.

    Unlike a probability gate its output can be negative (minimum about -0.278) or above 1.
    Returns ``(y, cache)`` with ``y`` of the shape and dtype of ``x``.
    """
    x = float_array("x", x)
    sig = sigmoid(x)
    return x * sig, SiLUCache(x, sig)


def silu_backward(dout, cache: SiLUCache):
    r"""Gradient of SiLU: returns ``dx``, using :math:`\sigma' = \sigma(1-\sigma)`:

    .. math::
        \frac{d}{dx}\,x\sigma(x) = \sigma(x)\,\big(1 + x\,(1 - \sigma(x))\big)
    """
    x, sig = cache
    return dout * sig * (1.0 + x * (1.0 - sig))


# ---- soft-capping --------------------------------------------------------------------------------


def check_softcap(name: str, cap) -> float:
    """A cap is a finite number above 0: ``c tanh(x / c)`` means nothing at ``c = 0``, and a
    negative ``c`` gives the function of ``|c|`` (tanh is odd), so it is refused as a likely slip.
    Returns it as a plain float, which keeps float32 arrays float32."""
    return check_real(name, cap, 0.0, low_open=True)


class SoftcapCache(NamedTuple):
    tanh: np.ndarray  # tanh(x / c): the derivative 1 - tanh^2 needs nothing else


def softcap_forward(x, cap):
    r"""Soft-capping (catalogue N19): squash ``x`` smoothly into ``[-c, c]``.

    .. math::
        \operatorname{softcap}_c(x) = c \tanh(x / c)

    Near 0 it is the identity to first order: :math:`\tanh u = u - u^3/3 + O(u^5)` gives
    :math:`\operatorname{softcap}_c(x) = x - x^3 / (3 c^2) + O(x^5 / c^4)`, so values well inside
    the cap pass almost unchanged, while large ones saturate at :math:`\pm c` instead of growing.
    Gemma 2 caps its attention scores (``attn_logit_softcapping``, ``c = 50``; see
    :func:`refmath.attention.sdpa_forward`) and its final logits (``final_logit_softcapping``,
    ``c = 30``) this way. :math:`x = \pm\infty` gives :math:`\pm c`: a cap must therefore come
    before an additive ``-inf`` mask, never after it.

    ``x`` is any float array, ``cap`` a number above 0. Returns ``(y, cache)`` with ``y`` of the
    shape and dtype of ``x``.
    """
    x = float_array("x", x)
    cap = check_softcap("cap", cap)
    t = np.tanh(x / cap)
    return cap * t, SoftcapCache(t)


def softcap_backward(dout, cache: SoftcapCache):
    r"""Gradient of soft-capping: returns ``dx``.

    .. math::
        \frac{d}{dx}\, c \tanh(x / c) = c \cdot \frac{1}{c}\,\big(1 - \tanh^2(x / c)\big)
            = 1 - \tanh^2(x / c) = 1 - (y / c)^2

    The ``c`` of the outside and the ``1/c`` of the chain rule cancel, so the slope is 1 at 0
    (the identity to first order) and falls to 0 as ``y`` nears the cap.
    """
    t = cache.tanh
    return dout * (1.0 - t * t)


def _identity_forward(x):
    return float_array("x", x), None


def _identity_backward(dout, cache):
    return dout


# name -> (forward(x) -> (y, cache), backward(dout, cache) -> dx)
ACTIVATIONS = {
    "relu": (relu_forward, relu_backward),
    "gelu": (lambda x: gelu_forward(x, approximate=False), gelu_backward),
    "gelu_tanh": (lambda x: gelu_forward(x, approximate=True), gelu_backward),
    "identity": (_identity_forward, _identity_backward),
}


# ---- the two-layer position-wise FFN -------------------------------------------------------------


class FFNCache(NamedTuple):
    first: LinearCache  # holds x and w1
    act: object  # the activation's cache (None for identity)
    activation: str
    second: LinearCache  # holds the activated hidden layer and w2


def ffn_forward(x, w1, b1, w2, b2, activation: str = "relu"):
    r"""Two-layer position-wise feed-forward network (catalogue N5, GELU variant N6).

    .. math::
        F(x) = \phi(x W_1 + b_1)\, W_2 + b_2

    ``activation`` names :math:`\phi`: ``"relu"`` (original Transformer), ``"gelu"`` (exact),
    ``"gelu_tanh"`` (tanh approximation) or ``"identity"``. With the identity the network collapses to
    one affine map, :math:`x (W_1 W_2) + (b_1 W_2 + b_2)`: the nonlinearity is what makes the
    hidden width worth having.

    Shapes: ``x`` ``(..., d)``, ``w1`` ``(d, d_f)``, ``b1`` ``(d_f,)``, ``w2`` ``(d_f, d_out)``,
    ``b2`` ``(d_out,)`` (usually ``d_out = d``); either bias may be ``None``.
    Returns ``(y, cache)`` with ``y`` of shape ``(..., d_out)``.
    """
    check_choice("activation", activation, sorted(ACTIVATIONS))
    x, w1, b1 = _check_linear(x, w1, b1, "x", "w1", "b1")
    w2 = float_array("w2", w2)
    check_ndim("w2", w2, 2, "(d_f, d_out)")
    check_axis("w2", w2, 0, w1.shape[1], f"w1.shape = {w1.shape} (d_f)")
    b2 = _check_bias(b2, "b2", w2, "w2")
    act_forward, _ = ACTIVATIONS[activation]
    h, first = linear_forward(x, w1, b1)
    a, act = act_forward(h)
    y, second = linear_forward(a, w2, b2)
    return y, FFNCache(first, act, activation, second)


def ffn_backward(dout, cache: FFNCache):
    r"""Gradients of the FFN: returns ``(dx, dw1, db1, dw2, db2)`` (bias gradients ``None`` when the
    bias was ``None``).

    Back through the second map, the activation's local derivative, then the first map:

    .. math::
        da = dy\,W_2^\top,\quad dh = da \odot \phi'(h),\quad dx = dh\,W_1^\top,\quad
        dW_1 = \sum x^\top dh,\quad dW_2 = \sum a^\top dy
    """
    first, act, activation, second = cache
    _, act_backward = ACTIVATIONS[activation]
    da, dw2, db2 = linear_backward(dout, second)
    dh = act_backward(da, act)
    dx, dw1, db1 = linear_backward(dh, first)
    return dx, dw1, db1, dw2, db2


# ---- SwiGLU --------------------------------------------------------------------------------------


def _check_gated(x, w_gate, w_up, w_down):
    """The checks of a gated FFN (SwiGLU, GeGLU): ``x`` ``(..., d)``, ``w_gate`` and ``w_up`` both
    ``(d, d_f)``, ``w_down`` ``(d_f, d_out)``; returns the four as float arrays."""
    x, w_gate, _ = _check_linear(x, w_gate, None, "x", "w_gate")
    x, w_up, _ = _check_linear(x, w_up, None, "x", "w_up")
    if w_up.shape != w_gate.shape:
        raise ValueError(
            f"w_gate and w_up must have the same shape (d, d_f), "
            f"got w_gate.shape = {w_gate.shape} and w_up.shape = {w_up.shape}"
        )
    w_down = float_array("w_down", w_down)
    check_ndim("w_down", w_down, 2, "(d_f, d_out)")
    check_axis("w_down", w_down, 0, w_gate.shape[1], f"w_gate.shape = {w_gate.shape} (d_f)")
    return x, w_gate, w_up, w_down


class SwiGLUCache(NamedTuple):
    x: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    gate: SiLUCache  # x W_g and its sigmoid
    up: np.ndarray  # x W_u
    hidden: np.ndarray  # SiLU(x W_g) * (x W_u), the input of W_d


def swiglu_forward(x, w_gate, w_up, w_down, *, matmul=matmul_rows_many):
    r"""SwiGLU feed-forward network without biases (catalogue N7, LLaMA style).

    .. math::
        F(x) = \big[\operatorname{SiLU}(x W_g) \odot (x W_u)\big]\, W_d

    The "gate" :math:`\operatorname{SiLU}(x W_g)` is not confined to [0, 1]; the elementwise product
    of two learned projections is what the extra matrix buys. Parameter count ``3 d d_f`` against
    ``2 d d_f`` for the two-matrix FFN (:func:`ffn_parameter_count`, :func:`swiglu_hidden_size`).

    Shapes: ``x`` ``(..., d)``, ``w_gate`` and ``w_up`` ``(d, d_f)``, ``w_down`` ``(d_f, d_out)``.
    Returns ``(y, cache)`` with ``y`` of shape ``(..., d_out)``; ``matmul`` as in
    :func:`linear_forward`.
    """
    x, w_gate, w_up, w_down = _check_gated(x, w_gate, w_up, w_down)
    g, gate = silu_forward(matmul(x, (w_gate,))[0])
    up = matmul(x, (w_up,))[0]
    hidden = g * up
    return matmul(hidden, (w_down,))[0], SwiGLUCache(x, w_gate, w_up, w_down, gate, up, hidden)


def swiglu_backward(dout, cache: SwiGLUCache):
    # BEGIN SOLUTION
    r"""Gradients of SwiGLU: returns ``(dx, dw_gate, dw_up, dw_down)``.

    With :math:`g = x W_g`, :math:`u = x W_u`, :math:`s = \operatorname{SiLU}(g)`,
    :math:`m = s \odot u`:

    .. math::
        dm = dy\,W_d^\top,\quad ds = dm \odot u,\quad du = dm \odot s,\quad
        dg = ds \odot \operatorname{SiLU}'(g),\quad dx = dg\,W_g^\top + du\,W_u^\top

    and each weight gradient is its input transposed times its output gradient, summed over rows.
    """
    x, w_gate, w_up, w_down, gate, up, hidden = cache
    d, d_f = w_gate.shape
    dout_rows = dout.reshape(-1, w_down.shape[1])
    dw_down = hidden.reshape(-1, d_f).T @ dout_rows
    dm = matmul_rows(dout, w_down.T)
    s = gate.x * gate.sig  # SiLU(g), recomputed instead of cached
    dg = silu_backward(dm * up, gate)
    du = dm * s
    x_rows = x.reshape(-1, d)
    dw_gate = x_rows.T @ dg.reshape(-1, d_f)
    dw_up = x_rows.T @ du.reshape(-1, d_f)
    dx = matmul_rows(dg, w_gate.T) + matmul_rows(du, w_up.T)
    return dx, dw_gate, dw_up, dw_down
    # END SOLUTION


# ---- GeGLU ---------------------------------------------------------------------------------------


class GeGLUCache(NamedTuple):
    x: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    gate: GELUCache  # x W_g and its tanh(sqrt(2/pi) (g + 0.044715 g^3)), the tanh form
    up: np.ndarray  # x W_u
    hidden: np.ndarray  # GELU_tanh(x W_g) * (x W_u), the input of W_d


def geglu_forward(x, w_gate, w_up, w_down, *, matmul=matmul_rows_many):
    r"""GeGLU feed-forward network without biases (catalogue N20; the MLP of Gemma 1, 2 and 3).

    .. math::
        F(x) = \big[\operatorname{GELU}_{\tanh}(x W_g) \odot (x W_u)\big]\, W_d

    SwiGLU (N7) with the tanh form of GELU (N6, :func:`gelu_forward` with
    ``approximate="tanh"``; Hugging Face's ``gelu_pytorch_tanh``) in place of SiLU as the gate's
    activation. The shapes, the ``3 d d_f`` parameters and the cache's layout are SwiGLU's.

    Shapes: ``x`` ``(..., d)``, ``w_gate`` and ``w_up`` ``(d, d_f)``, ``w_down`` ``(d_f, d_out)``.
    Returns ``(y, cache)`` with ``y`` of shape ``(..., d_out)``; ``matmul`` as in
    :func:`linear_forward`.
    """
    x, w_gate, w_up, w_down = _check_gated(x, w_gate, w_up, w_down)
    a, gate = gelu_forward(matmul(x, (w_gate,))[0], approximate="tanh")
    up = matmul(x, (w_up,))[0]
    hidden = a * up
    return matmul(hidden, (w_down,))[0], GeGLUCache(x, w_gate, w_up, w_down, gate, up, hidden)


def geglu_backward(dout, cache: GeGLUCache):
    # BEGIN SOLUTION
    # (a region, like swiglu_backward's: the same chain would give that assignment away)
    r"""Gradients of GeGLU: returns ``(dx, dw_gate, dw_up, dw_down)``.

    With :math:`g = x W_g`, :math:`u = x W_u`, :math:`a = \operatorname{GELU}_{\tanh}(g)`,
    :math:`m = a \odot u`, the SwiGLU chain with the GELU's slope (:func:`gelu_backward`):

    .. math::
        dm = dy\,W_d^\top,\quad da = dm \odot u,\quad du = dm \odot a,\quad
        dg = da \odot \operatorname{GELU}_{\tanh}'(g),\quad dx = dg\,W_g^\top + du\,W_u^\top

    and each weight gradient is its input transposed times its output gradient, summed over rows.
    """
    x, w_gate, w_up, w_down, gate, up, hidden = cache
    d, d_f = w_gate.shape
    dout_rows = dout.reshape(-1, w_down.shape[1])
    dw_down = hidden.reshape(-1, d_f).T @ dout_rows
    dm = matmul_rows(dout, w_down.T)
    a = 0.5 * gate.x * (1.0 + gate.gate)  # GELU_tanh(g), recomputed from the cached tanh
    dg = gelu_backward(dm * up, gate)
    du = dm * a
    x_rows = x.reshape(-1, d)
    dw_gate = x_rows.T @ dg.reshape(-1, d_f)
    dw_up = x_rows.T @ du.reshape(-1, d_f)
    dx = matmul_rows(dg, w_gate.T) + matmul_rows(du, w_up.T)
    return dx, dw_gate, dw_up, dw_down
    # END SOLUTION


def swiglu_hidden_size(d: int, multiple_of: int = 256) -> int:
    r"""SwiGLU hidden width with the parameter budget of a ``4d`` two-matrix FFN (catalogue N7).

    Matching :math:`3 d d_f = 2 d (4d)` gives :math:`d_f = 8d/3`, which is then rounded UP to the
    smallest multiple of ``multiple_of`` that is at least :math:`8d/3` (hardware prefers such
    widths). Example: ``d = 4096`` gives 10922.67, rounded up to ``43 * 256 = 11008``.

    LLaMA's code truncates ``8d/3`` to an integer before rounding up; the two agree unless that
    truncated value is already a multiple of ``multiple_of`` (e.g. ``d = 4, multiple_of = 1``: 11
    here, 10 there).
    """
    d = check_int("d", d, 1)
    multiple_of = check_int("multiple_of", multiple_of, 1)
    # ceil(8 d / (3 m)) in exact integer arithmetic
    return multiple_of * (-(-8 * d // (3 * multiple_of)))


def ffn_parameter_count(d: int, d_f: int, gated: bool = False, biases: bool = False) -> int:
    r"""Parameters of a position-wise FFN (catalogue N5, N7).

    Two matrices (ReLU/GELU FFN): :math:`2 d d_f`; gated (SwiGLU, three matrices): :math:`3 d d_f`.
    ``biases=True`` adds one bias per output: ``d_f + d`` for two matrices, ``2 d_f + d`` gated.
    """
    d = check_int("d", d, 1)
    d_f = check_int("d_f", d_f, 1)
    gated = check_flag("gated", gated)
    biases = check_flag("biases", biases)
    matrices = 3 if gated else 2
    count = matrices * d * d_f
    if biases:
        count += (matrices - 1) * d_f + d
    return count


# ---- gradient-check cases ------------------------------------------------------------------------

_KINK_MARGIN = 0.05  # keep ReLU inputs this far from 0, far beyond the 2e-3 finite-difference reach


def _away_from_zero(rng, shape):
    """Normal samples pushed out of (-margin, margin), for ReLU inputs."""
    z = rng.standard_normal(shape)
    return z + np.sign(z) * _KINK_MARGIN + (z == 0) * _KINK_MARGIN


def _linear_inputs(shape, d_out, with_bias):
    def make(rng):
        inputs = {"x": rng.standard_normal(shape), "w": rng.standard_normal((shape[-1], d_out))}
        inputs["b"] = rng.standard_normal(d_out) if with_bias else None
        return inputs
    return make


def _linear_case_forward(x, w, b):
    return linear_forward(x, w, b)


def _linear_case_backward(dout, cache):
    dx, dw, db = linear_backward(dout, cache)
    return (dx, dw) if db is None else (dx, dw, db)


register_case(OpCase("linear", "bias (3, 4) -> 5", ("N5",), _linear_inputs((3, 4), 5, True),
                     _linear_case_forward, _linear_case_backward, ("x", "w", "b")))
register_case(OpCase("linear", "no bias (3, 4) -> 5", ("N5",), _linear_inputs((3, 4), 5, False),
                     _linear_case_forward, _linear_case_backward, ("x", "w")))
register_case(OpCase("linear", "batch (2, 3, 4) -> 6", ("N5",), _linear_inputs((2, 3, 4), 6, True),
                     _linear_case_forward, _linear_case_backward, ("x", "w", "b")))
# dW and db sum over every leading axis, however many
register_case(OpCase("linear", "4 leading axes (2, 1, 2, 3, 4) -> 5", ("N5",),
                     _linear_inputs((2, 1, 2, 3, 4), 5, True), _linear_case_forward,
                     _linear_case_backward, ("x", "w", "b")))
register_case(OpCase("linear", "d_in = d_out = 1 (3, 1) -> 1", ("N5",), _linear_inputs((3, 1), 1, True),
                     _linear_case_forward, _linear_case_backward, ("x", "w", "b")))

register_case(OpCase("relu", "(3, 7)", ("N5",), lambda rng: {"x": _away_from_zero(rng, (3, 7))},
                     relu_forward, relu_backward, ("x",)))
register_case(OpCase("gelu", "exact (3, 7)", ("N6",),
                     lambda rng: {"x": 2.0 * rng.standard_normal((3, 7)), "approximate": False},
                     gelu_forward, gelu_backward, ("x",)))
register_case(OpCase("gelu", "tanh (3, 7)", ("N6",),
                     lambda rng: {"x": 2.0 * rng.standard_normal((3, 7)), "approximate": True},
                     gelu_forward, gelu_backward, ("x",)))
register_case(OpCase("silu", "(3, 7)", ("N6",), lambda rng: {"x": 3.0 * rng.standard_normal((3, 7))},
                     silu_forward, silu_backward, ("x",)))
# Element-wise ops take any shape: one case each with four leading axes
register_case(OpCase("relu", "(2, 1, 2, 3, 4)", ("N5",),
                     lambda rng: {"x": _away_from_zero(rng, (2, 1, 2, 3, 4))}, relu_forward,
                     relu_backward, ("x",)))
register_case(OpCase("gelu", "exact (2, 1, 2, 3, 4)", ("N6",),
                     lambda rng: {"x": 2.0 * rng.standard_normal((2, 1, 2, 3, 4)), "approximate": False},
                     gelu_forward, gelu_backward, ("x",)))
register_case(OpCase("gelu", "tanh (2, 1, 2, 3, 4)", ("N6",),
                     lambda rng: {"x": 2.0 * rng.standard_normal((2, 1, 2, 3, 4)), "approximate": True},
                     gelu_forward, gelu_backward, ("x",)))
register_case(OpCase("silu", "(2, 1, 2, 3, 4)", ("N6",),
                     lambda rng: {"x": 3.0 * rng.standard_normal((2, 1, 2, 3, 4))},
                     silu_forward, silu_backward, ("x",)))


def _ffn_inputs(shape, d_f, activation, with_bias):
    def make(rng):
        d = shape[-1]
        scale = 1.0 / math.sqrt(d)
        for _ in range(100):
            x = rng.standard_normal(shape)
            w1 = scale * rng.standard_normal((d, d_f))
            b1 = 0.5 * rng.standard_normal(d_f) if with_bias else None
            h = x @ w1 + (0.0 if b1 is None else b1)
            # ReLU: every pre-activation must stay clear of the kink under the finite differences
            if activation != "relu" or np.abs(h).min() > _KINK_MARGIN:
                break
        else:
            raise RuntimeError("could not draw FFN inputs away from the ReLU kink")
        return {"x": x, "w1": w1, "b1": b1, "w2": scale * rng.standard_normal((d_f, d)),
                "b2": 0.5 * rng.standard_normal(d) if with_bias else None, "activation": activation}
    return make


def _ffn_case_backward(dout, cache):
    return tuple(g for g in ffn_backward(dout, cache) if g is not None)


_FFN_WRT = ("x", "w1", "b1", "w2", "b2")
for _act, _shape in (("relu", (3, 4)), ("gelu", (2, 3, 4)), ("gelu_tanh", (3, 4)), ("identity", (3, 4)),
                     ("gelu_tanh", (2, 1, 2, 2, 4))):
    register_case(OpCase("ffn", f"{_act} {_shape} d_f=6", ("N5", "N6"), _ffn_inputs(_shape, 6, _act, True),
                         ffn_forward, _ffn_case_backward, _FFN_WRT))
register_case(OpCase("ffn", "relu no bias (3, 4) d_f=6", ("N5",), _ffn_inputs((3, 4), 6, "relu", False),
                     ffn_forward, _ffn_case_backward, ("x", "w1", "w2")))


def _swiglu_inputs(shape, d_f, x_std=1.0):
    def make(rng):
        d = shape[-1]
        scale = 1.0 / math.sqrt(d)
        return {"x": x_std * rng.standard_normal(shape),
                "w_gate": scale * rng.standard_normal((d, d_f)),
                "w_up": scale * rng.standard_normal((d, d_f)),
                "w_down": scale * rng.standard_normal((d_f, d))}
    return make


register_case(OpCase("swiglu", "(3, 4) d_f=6", ("N7",), _swiglu_inputs((3, 4), 6),
                     swiglu_forward, swiglu_backward, ("x", "w_gate", "w_up", "w_down")))
register_case(OpCase("swiglu", "batch (2, 3, 4) d_f=5", ("N7",), _swiglu_inputs((2, 3, 4), 5),
                     swiglu_forward, swiglu_backward, ("x", "w_gate", "w_up", "w_down")))
register_case(OpCase("swiglu", "4 leading axes (2, 1, 2, 2, 4) d_f=3", ("N7",),
                     _swiglu_inputs((2, 1, 2, 2, 4), 3), swiglu_forward, swiglu_backward,
                     ("x", "w_gate", "w_up", "w_down")))
# GeGLU takes SwiGLU's inputs; x of std 2 puts many gate entries g in GELU's curved part, |g| ~ 1-2
for _label, _shape, _d_f in (("(3, 4) d_f=6", (3, 4), 6), ("batch (2, 3, 4) d_f=5", (2, 3, 4), 5),
                             ("4 leading axes (2, 1, 2, 2, 4) d_f=3", (2, 1, 2, 2, 4), 3)):
    register_case(OpCase("geglu", _label, ("N20", "N6"), _swiglu_inputs(_shape, _d_f, x_std=2.0),
                         geglu_forward, geglu_backward, ("x", "w_gate", "w_up", "w_down")))

# Soft-capping: inputs of std 2 against caps of 1.5 and 4 cover the linear part, the bend and the
# saturated tails; a cap of 50 (Gemma 2's attention cap) on the same inputs is nearly the identity.
for _label, _shape, _cap in (("(3, 7) cap 1.5", (3, 7), 1.5),
                             ("(2, 1, 2, 3, 4) cap 4", (2, 1, 2, 3, 4), 4.0),
                             ("(3, 7) cap 50", (3, 7), 50.0)):
    register_case(OpCase("softcap", _label, ("N19",),
                         lambda rng, shape=_shape, cap=_cap: {"x": 2.0 * rng.standard_normal(shape),
                                                              "cap": cap},
                         softcap_forward, softcap_backward, ("x",)))
