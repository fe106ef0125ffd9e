r"""Lesson 4, the feed-forward block and where tokens sit (``notebooks/04_ffn_and_positions.py``):
the expected value and the known slips of each exercise, computed from the library and from the
lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


_N6 = "the section 'N6: GELU, its tanh approximation, and SiLU'"
_N7 = "the section 'N7: SwiGLU, its backward, and its width'"
_N10 = "the section 'N10: RoPE rotates queries and keys'"


def _silu_one() -> float:
    """The u > 0 where SiLU(u) = 1, by Newton's method from u = 1, with
    SiLU'(u) = sigma (1 + u (1 - sigma))."""
    u = 1.0
    for _ in range(50):
        sigma = 1 / (1 + np.exp(-u))
        u -= (u * sigma - 1) / (sigma * (1 + u * (1 - sigma)))
    return u


@exercise("04.1", "the u where SiLU(u) = 1", _N6,
          "SiLU is increasing for u > 0: halve the interval [0, 4] until it is 1e-9 wide",
          rtol=1e-9)
def _silu_crossing():
    return _silu_one(), {"sigma(u) = 1/2 (the sigmoid's midpoint, u = 0)": 0.0,
                         "u = 1 (SiLU read as the identity)": 1.0}


@exercise("04.2", "the smallest value of SiLU", _N6,
          "SiLU(-u) = SiLU(u) - u; the minimum sits at minus the crossing point", rtol=1e-8)
def _silu_minimum():
    return 1 - _silu_one(), {"0 (SiLU read as a ReLU that stops at 0)": 0.0,
                             "the minimum's place, not its value": -_silu_one(),
                             "the sign flipped: the minimum of SiLU lies below zero, "
                             "SiLU(-u) = SiLU(u) - u": _silu_one() - 1}


@exercise("04.3", "GELU'(0, 1, -2), exact and tanh", _N6,
          "product rule: Phi(u) + u phi(u); for tanh, d tanh = 1 - tanh^2", uses=("points",))
def _gelu_derivatives(points):
    from refmath.ffn import gelu_backward, gelu_forward, standard_normal_cdf

    u = np.asarray(points, dtype=np.float64)
    t = np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3))
    exact, tanh = (gelu_backward(np.ones(u.shape), gelu_forward(u, approximate=form)[1])
                   for form in (False, True))
    return np.stack([exact, tanh]), {
        "the product rule's second term forgotten: Phi(u) and (1 + t) / 2 alone":
            np.stack([standard_normal_cdf(u), 0.5 * (1 + t)]),
        "exact form: the product rule's second term u phi(u) forgotten, Phi(u) alone":
            np.stack([standard_normal_cdf(u), tanh]),
        "tanh form: the product rule's second term forgotten, (1 + t) / 2 alone":
            np.stack([exact, 0.5 * (1 + t)]),
        # the derivation's slips inside the chain rule of the tanh form
        **catalogued("gelu tanh: the 3 of d(x^3)/dx forgotten", lambda: np.stack([
            exact, gelu_backward(np.ones(u.shape), gelu_forward(u, approximate=True)[1])])),
        "tanh form: tanh' written 1 - t, not 1 - t^2": np.stack([
            exact, 0.5 * (1 + t) + 0.5 * u * (1 - t) * np.sqrt(2 / np.pi)
            * (1 + 3 * 0.044715 * u**2)]),
        "tanh form: the inner derivative sqrt(2/pi) (1 + 3 c u^2) left out of the chain rule":
            np.stack([exact, 0.5 * (1 + t) + 0.5 * u * (1 - t**2)]),
        "tanh form: the factor sqrt(2/pi) of the inner derivative left out":
            np.stack([exact, 0.5 * (1 + t) + 0.5 * u * (1 - t**2) * (1 + 3 * 0.044715 * u**2)]),
        "exact form: phi(u) without its 1/sqrt(2 pi)":
            np.stack([standard_normal_cdf(u) + u * np.exp(-u**2 / 2), tanh]),
        # the two rows differ by under 1e-3 here, which would otherwise read as a rounding
        "the rows swapped: the first row is the exact form, the second the tanh form":
            np.stack([tanh, exact])}


@exercise("04.5", "SwiGLU dx", _N7, "two paths into x: dg W_g^T and du W_u^T",
          uses=("dy", "swiglu_cache"), rtol=1e-10, atol=1e-14)
def _swiglu_dx(dy, cache):
    from refmath.ffn import swiglu_backward

    def dx():
        return swiglu_backward(dy, cache)[0]
    # the two paths into x, written out as the lesson's equations give them
    g, sig = cache.gate.x, cache.gate.sig
    dm = dy @ cache.w_down.T
    du = dm * g * sig
    dg = dm * cache.up * sig * (1 + g * (1 - sig))
    return dx(), {
        **catalogued("swiglu: du uses the gate's input, not SiLU of it", dx),
        **catalogued("silu: product rule forgotten", dx),
        "SiLU'(g) taken as sigma(g): g sigma(g) is a product, its derivative has two terms":
            (dm * cache.up * sig) @ cache.w_gate.T + du @ cache.w_up.T,
        "only the gate's path, dg W_g^T: x feeds two projections, so du W_u^T adds to it":
            dg @ cache.w_gate.T,
        "only the up projection's path, du W_u^T: dg W_g^T is forgotten": du @ cache.w_up.T}


@exercise("04.6", "(d_f, excess) at d = 1000", _N7,
          "round 8d/3 = 2666.7 up to a multiple of 64; excess = d_f / (8d/3) - 1")
def _swiglu_width():
    from refmath.ffn import ffn_parameter_count, swiglu_hidden_size

    d_f = swiglu_hidden_size(1000, 64)
    excess = ffn_parameter_count(1000, d_f, gated=True) / ffn_parameter_count(1000, 4000) - 1

    def pair(width, matrices=3):
        return (width, matrices * width / (2 * 4000) - 1)
    return (d_f, excess), {
        "rounded down to a multiple of 64: round up, or the width falls short of 8d/3":
            pair(64 * (8000 // 3 // 64)),
        "rounded up to a multiple of 256 (the text's example), not of 64": pair(256 * -(-8000 // 768)),
        "the excess in percent: write it as a fraction, like +0.125": (d_f, 100 * excess),
        "SwiGLU counted with two matrices: it has three, W_g, W_u and W_d": pair(d_f, matrices=2)}


_ROPE_ROW = np.array([[3.0, 4.0, 1.0, 0.0]])


def _rotated(row, angles, halves=False):
    """``row`` with its pairs turned by ``angles``: neighbours (x0, x1), (x2, x3), or, with
    ``halves``, the other layout's (x0, x2), (x1, x3)."""
    row = np.asarray(row, dtype=np.float64)[0]
    first, second = (row[:2], row[2:]) if halves else (row[0::2], row[1::2])
    turned = (first * np.cos(angles) - second * np.sin(angles),
              first * np.sin(angles) + second * np.cos(angles))
    return (np.concatenate(turned) if halves else np.stack(turned, axis=1).reshape(-1))[None]


def _as_row(answer):
    """A row of four numbers, given as (4,) or (1, 4): the prompt says "the row", and both are
    it (any other size is left as it is, and the check names its shape)."""
    answer = np.asarray(answer, dtype=np.float64)
    return answer.reshape(1, 4) if answer.size == 4 else answer


@exercise("04.7", "RoPE of (3, 4, 1, 0) at position 2", _N10,
          "pairs are (x0, x1) and (x2, x3); theta = p omega_r", atol=1e-15, prepare=_as_row)
def _rope_rotated():
    from refmath.positions import rope_forward

    angles = 2 * np.array([1.0, 1 / 100])  # p omega_r for d_k = 4
    return rope_forward(_ROPE_ROW, positions=np.array([2]))[0], {
        "turned the wrong way, by -theta: the rotation is (x cos - y sin, x sin + y cos)":
            _rotated(_ROPE_ROW, -angles),
        "the pairs taken as (x0, x2) and (x1, x3): that is the halves layout; here pairs are "
        "neighbours": _rotated(_ROPE_ROW, angles, halves=True),
        "both pairs turned by p radians: pair 1 turns by p omega_1 = p / 100":
            _rotated(_ROPE_ROW, np.array([2.0, 2.0])),
        "the position left out: theta = p omega_r, not omega_r": _rotated(_ROPE_ROW, angles / 2)}


@exercise("04.8", "RoPE dx", _N10, "the same rotation with -theta", atol=1e-15, prepare=_as_row)
def _rope_dx():
    from refmath.positions import rope_backward, rope_forward

    def dx():
        return rope_backward(np.array([[1.0, 0.0, 0.0, 1.0]]),
                             rope_forward(_ROPE_ROW, positions=np.array([2]))[1])
    return dx(), catalogued("rope: forward rotation used in backward", dx)


def _torch_gelu(x, approximate):
    """The oracle of 04.4 (used only where torch is installed): torch's GELU, in the same form."""
    import torch

    return torch.nn.functional.gelu(x, approximate="tanh" if approximate else "none")


def _tanh_derivative_one_minus_t(dout, cache):
    """A slip of 04.4: in the tanh form, d tanh(z)/dz written 1 - t for 1 - t^2."""
    from refmath.ffn import gelu_backward

    if not cache.approximate:
        return gelu_backward(dout, cache)
    x, t = cache.x, cache.gate
    dt = (1.0 - t) * np.sqrt(2 / np.pi) * (1.0 + 3.0 * 0.044715 * x * x)
    return dout * 0.5 * (1.0 + t + x * dt)


@function_exercise("04.4", "your GELU backward", _N6,
                   "Phi(x) + x phi(x); for tanh, the chain rule through t")
def _gelu_backward():
    from refmath.ffn import gelu_backward, gelu_forward

    return dict(
        reference=gelu_backward, case="gelu[*", oracle=_torch_gelu,
        slips={**catalogued("gelu exact: x phi(x) term dropped", gelu_backward),
               **catalogued("gelu tanh: the 3 of d(x^3)/dx forgotten", gelu_backward),
               **catalogued("gelu tanh: sqrt(2/pi) rounded to float32", gelu_backward),
               **catalogued("gelu tanh: 0.044715 rounded to float32", gelu_backward),
               "the exact form used for both": lambda dout, cache: gelu_backward(
                   dout, gelu_forward(cache.x)[1]),
               "tanh form: tanh' taken as 1 - t, not 1 - t^2": _tanh_derivative_one_minus_t})
