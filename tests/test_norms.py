import numpy as np
import pytest

from refmath.norms import layernorm_backward, layernorm_forward, rmsnorm_forward


def test_worked_example_n3():
    # x = (2, 4, 6, 8): mean 5, biased variance 5, root mean square sqrt(30); eps set to 0
    x = np.array([2.0, 4.0, 6.0, 8.0])
    ones, zeros = np.ones(4), np.zeros(4)
    ln, _ = layernorm_forward(x, ones, zeros, eps=0.0)
    rms, _ = rmsnorm_forward(x, ones, eps=0.0)
    np.testing.assert_allclose(ln, np.array([-3.0, -1.0, 1.0, 3.0]) / np.sqrt(5.0), rtol=1e-15)
    np.testing.assert_allclose(rms, x / np.sqrt(30.0), rtol=1e-15)


def test_layernorm_output_has_zero_mean_unit_variance_before_affine():
    x = np.random.default_rng(0).standard_normal((4, 16)) * 3 + 2
    y, _ = layernorm_forward(x, np.ones(16), np.zeros(16), eps=0.0)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-14)
    np.testing.assert_allclose(y.var(-1), 1, rtol=1e-13)


def test_bad_inputs_name_the_argument_and_shapes():
    x = np.zeros((2, 4))
    with pytest.raises(ValueError, match=r"gamma must have shape \(4,\).*\(2, 4\).*\(3,\)"):
        layernorm_forward(x, np.ones(3), np.zeros(4))
    with pytest.raises(ValueError, match=r"beta must have shape \(4,\)"):
        layernorm_forward(x, np.ones(4), np.zeros(5))
    with pytest.raises(TypeError, match=r"x must be a floating-point array, got dtype int64"):
        rmsnorm_forward(np.zeros((2, 4), dtype=np.int64), np.ones(4))
    with pytest.raises(ValueError, match=r"x must have at least 1 dimensions"):
        rmsnorm_forward(np.float64(1.0), np.ones(1))


def _jacobian_from_backward(backward, n_out):
    """Rows of the Jacobian, one vector-Jacobian product per output coordinate."""
    return np.stack([backward(np.eye(n_out)[i]) for i in range(n_out)])


def _numerical_jacobian(f, x):
    from refmath.gradcheck import numerical_gradient

    x = x.copy()
    return np.stack([numerical_gradient(lambda: float(f(x)[i]), x, np.arange(x.size))
                     for i in range(x.size)])


def test_post_and_pre_ln_jacobians_n4():
    """N4: y = LN(x + F(x)) has Jacobian J_LN (I + J_F); y = x + F(LN(x)) has I + J_F J_LN."""
    from refmath.ffn import ffn_backward, ffn_forward

    rng = np.random.default_rng(4)
    d, d_f = 6, 10
    x = rng.standard_normal(d)
    gamma, beta = 1 + 0.3 * rng.standard_normal(d), 0.1 * rng.standard_normal(d)
    w1, b1 = rng.standard_normal((d, d_f)) / 2, rng.standard_normal(d_f) / 2
    w2, b2 = rng.standard_normal((d_f, d)) / 3, rng.standard_normal(d) / 3

    def ln(u):
        return layernorm_forward(u, gamma, beta)

    def ffn(u):
        return ffn_forward(u, w1, b1, w2, b2, activation="gelu")

    def jac_ln(u):
        return _jacobian_from_backward(lambda e: layernorm_backward(e, ln(u)[1])[0], d)

    def jac_ffn(u):
        return _jacobian_from_backward(lambda e: ffn_backward(e, ffn(u)[1])[0], d)

    eye = np.eye(d)
    post = jac_ln(x + ffn(x)[0]) @ (eye + jac_ffn(x))
    pre = eye + jac_ffn(ln(x)[0]) @ jac_ln(x)
    np.testing.assert_allclose(post, _numerical_jacobian(lambda u: ln(u + ffn(u)[0])[0], x), atol=1e-10)
    np.testing.assert_allclose(pre, _numerical_jacobian(lambda u: u + ffn(ln(u)[0])[0], x), atol=1e-10)
