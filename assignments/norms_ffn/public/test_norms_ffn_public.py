"""Public tests of the normalisation and feed-forward assignment: `python -m pytest -q tests`.

Each backward is compared with central differences of the (given or your) forward on small inputs.
The hidden tests compare with an independent implementation, tightly, on more cases and larger
inputs (where a gradient by finite differences would run out of time).
"""
import numpy as np
import pytest

from refmath.ffn import gelu_backward, gelu_forward, swiglu_backward, swiglu_forward
from refmath.norms import layernorm_backward, layernorm_forward, rmsnorm_backward, rmsnorm_forward
from refmath.positions import rope_backward, rope_forward


def central_differences(f, x, dout, h=1e-6):
    """d sum(f(x) * dout) / dx by central differences, one coordinate at a time."""
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + h
        plus = np.sum(f(x) * dout)
        x[i] = old - h
        minus = np.sum(f(x) * dout)
        x[i] = old
        grad[i] = (plus - minus) / (2 * h)
    return grad


rng = np.random.default_rng(0)


def test_layernorm_dx():
    x, gamma, beta, dout = rng.standard_normal((3, 5)), rng.standard_normal(5), rng.standard_normal(5), rng.standard_normal((3, 5))
    dx, dgamma, dbeta = layernorm_backward(dout, layernorm_forward(x, gamma, beta)[1])
    np.testing.assert_allclose(dx, central_differences(lambda z: layernorm_forward(z, gamma, beta)[0], x.copy(), dout), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dbeta, dout.sum(axis=0))


def test_rmsnorm_dx():
    x, gamma, dout = rng.standard_normal((3, 5)), rng.standard_normal(5), rng.standard_normal((3, 5))
    dx, _ = rmsnorm_backward(dout, rmsnorm_forward(x, gamma)[1])
    np.testing.assert_allclose(dx, central_differences(lambda z: rmsnorm_forward(z, gamma)[0], x.copy(), dout), rtol=1e-6, atol=1e-8)


def test_gelu_exact_dx():
    x, dout = rng.standard_normal(7), rng.standard_normal(7)
    dx = gelu_backward(dout, gelu_forward(x)[1])
    np.testing.assert_allclose(dx, central_differences(lambda z: gelu_forward(z)[0], x.copy(), dout), rtol=1e-6, atol=1e-8)


def test_swiglu_dx():
    x, wg, wu, wd = rng.standard_normal((2, 4)), rng.standard_normal((4, 6)), rng.standard_normal((4, 6)), rng.standard_normal((6, 3))
    dout = rng.standard_normal((2, 3))
    dx = swiglu_backward(dout, swiglu_forward(x, wg, wu, wd)[1])[0]
    np.testing.assert_allclose(dx, central_differences(lambda z: swiglu_forward(z, wg, wu, wd)[0], x.copy(), dout), rtol=1e-6, atol=1e-8)


def test_rope_position_zero_is_the_identity():
    x = rng.standard_normal((1, 8))
    np.testing.assert_allclose(rope_forward(x)[0], x)


def test_rope_first_pair_turns_one_radian_per_token():
    x = np.zeros((2, 4))
    x[:, 0] = 1.0  # the pair (x_0, x_1) = (1, 0)
    y, _ = rope_forward(x)
    np.testing.assert_allclose(y[1, :2], [np.cos(1.0), np.sin(1.0)])


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_dx(layout):
    x, dout = rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
    dx = rope_backward(dout, rope_forward(x, offset=1, layout=layout)[1])
    np.testing.assert_allclose(dx, central_differences(lambda z: rope_forward(z, offset=1, layout=layout)[0], x.copy(), dout), rtol=1e-6, atol=1e-8)
