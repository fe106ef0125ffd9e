r"""Lesson 4, the feed-forward block and where tokens sit (``notebooks/04_ffn_and_positions.py``):
the expected value and the known slips of each exercise, computed from the library and from the
lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise


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
                             "the minimum's place, not its value": -_silu_one()}


@exercise("04.3", "GELU'(0, 1, -2), exact and tanh", _N6,
          "product rule: Phi(u) + u phi(u); for tanh, d tanh = 1 - tanh^2", uses=("points",))
def _gelu_derivatives(points):
    from refmath.ffn import gelu_backward, gelu_forward, standard_normal_cdf

    u = np.asarray(points, dtype=np.float64)
    t = np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3))
    return np.stack([gelu_backward(np.ones(u.shape), gelu_forward(u, approximate=form)[1])
                     for form in (False, True)]), {
        "the product rule's second term forgotten: Phi(u) and (1 + t) / 2 alone":
            np.stack([standard_normal_cdf(u), 0.5 * (1 + t)])}


@exercise("04.5", "SwiGLU dx", _N7, "two paths into x: dg W_g^T and du W_u^T",
          uses=("dy", "swiglu_cache"), rtol=1e-10, atol=1e-14)
def _swiglu_dx(dy, cache):
    from refmath.ffn import swiglu_backward

    return swiglu_backward(dy, cache)[0], {}


@exercise("04.6", "(d_f, excess) at d = 1000", _N7,
          "round 8d/3 = 2666.7 up to a multiple of 64; excess = d_f / (8d/3) - 1")
def _swiglu_width():
    from refmath.ffn import ffn_parameter_count, swiglu_hidden_size

    d_f = swiglu_hidden_size(1000, 64)
    excess = ffn_parameter_count(1000, d_f, gated=True) / ffn_parameter_count(1000, 4000) - 1
    return (d_f, excess), {}


_ROPE_ROW = np.array([[3.0, 4.0, 1.0, 0.0]])


@exercise("04.7", "RoPE of (3, 4, 1, 0) at position 2", _N10,
          "pairs are (x0, x1) and (x2, x3); theta = p omega_r", atol=1e-15)
def _rope_rotated():
    from refmath.positions import rope_forward

    return rope_forward(_ROPE_ROW, positions=np.array([2]))[0], {}


@exercise("04.8", "RoPE dx", _N10, "the same rotation with -theta", atol=1e-15)
def _rope_dx():
    from refmath.positions import rope_backward, rope_forward

    def dx():
        return rope_backward(np.array([[1.0, 0.0, 0.0, 1.0]]),
                             rope_forward(_ROPE_ROW, positions=np.array([2]))[1])
    return dx(), catalogued("rope: forward rotation used in backward", dx)
