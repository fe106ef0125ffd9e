import math

import numpy as np
import pytest

from refmath.ffn import (
    ffn_forward,
    ffn_parameter_count,
    geglu_forward,
    gelu_backward,
    gelu_forward,
    linear_backward,
    linear_forward,
    silu_backward,
    silu_forward,
    softcap_backward,
    softcap_forward,
    standard_normal_cdf,
    swiglu_forward,
    swiglu_hidden_size,
)


def _ffn_params(rng, d=5, d_f=7, d_out=4):
    return (rng.standard_normal((d, d_f)), rng.standard_normal(d_f),
            rng.standard_normal((d_f, d_out)), rng.standard_normal(d_out))


def test_ffn_without_nonlinearity_collapses_to_one_affine_map_n5():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5))
    w1, b1, w2, b2 = _ffn_params(rng)
    y, _ = ffn_forward(x, w1, b1, w2, b2, activation="identity")
    np.testing.assert_allclose(y, x @ (w1 @ w2) + (b1 @ w2 + b2), rtol=1e-13, atol=1e-13)


def test_relu_ffn_is_the_catalogue_formula_n5():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5))
    w1, b1, w2, b2 = _ffn_params(rng)
    y, _ = ffn_forward(x, w1, b1, w2, b2)
    np.testing.assert_array_equal(y, np.maximum(x @ w1 + b1, 0.0) @ w2 + b2)


def test_linear_without_bias_has_no_bias_gradient():
    x, w = np.ones((2, 3, 4)), np.ones((4, 5))
    y, cache = linear_forward(x, w)
    dx, dw, db = linear_backward(np.ones_like(y), cache)
    assert db is None
    # every one of the 6 rows contributes x^T dout = 1 to each weight
    np.testing.assert_array_equal(dw, np.full((4, 5), 6.0))
    np.testing.assert_array_equal(dx, np.full((2, 3, 4), 5.0))


def test_exact_gelu_is_u_times_normal_cdf_n6():
    phi_1 = 0.5 * (1.0 + math.erf(1.0 / math.sqrt(2.0)))
    assert standard_normal_cdf(np.array(0.0)) == 0.5
    y, _ = gelu_forward(np.array([0.0, 1.0, -1.0, 2.5]))
    expected = [0.0, phi_1, -(1.0 - phi_1), 2.5 * 0.5 * (1.0 + math.erf(2.5 / math.sqrt(2.0)))]
    np.testing.assert_allclose(y, expected, rtol=1e-15, atol=1e-16)
    # Phi(u) + Phi(-u) = 1, hence GELU(u) - GELU(-u) = u exactly in real arithmetic
    u = np.linspace(-6.0, 6.0, 121)
    np.testing.assert_allclose(gelu_forward(u)[0] - gelu_forward(-u)[0], u, rtol=1e-14, atol=1e-15)
    # slope at 0 is Phi(0) + 0 * phi(0) = 1/2
    _, cache = gelu_forward(np.array([0.0]))
    np.testing.assert_array_equal(gelu_backward(np.array([1.0]), cache), [0.5])


def test_tanh_gelu_is_close_to_exact_gelu_n6():
    # Measured on this grid: the largest gap is 4.73e-4, near |u| = 2.70; both forms tend to u for
    # large u and to 0 for very negative u, so the grid covers the whole difference.
    u = np.linspace(-10.0, 10.0, 200_001)
    gap = np.abs(gelu_forward(u)[0] - gelu_forward(u, approximate=True)[0])
    assert 4.5e-4 < gap.max() < 5e-4
    assert abs(abs(u[gap.argmax()]) - 2.70) < 0.01
    assert gap[np.abs(u) > 8].max() < 1e-12


def test_silu_values_symmetry_and_range_n6():
    y, cache = silu_forward(np.array([0.0]))
    assert y[0] == 0.0
    np.testing.assert_array_equal(silu_backward(np.array([1.0]), cache), [0.5])
    # sigma(u) + sigma(-u) = 1, hence SiLU(u) - SiLU(-u) = u
    u = np.linspace(-30.0, 30.0, 601)
    np.testing.assert_allclose(silu_forward(u)[0] - silu_forward(-u)[0], u, rtol=1e-14, atol=1e-15)
    # the "gate" is not a probability: negative for u < 0, above 1 for u = 2
    assert silu_forward(np.array([-1.0]))[0][0] < 0 and silu_forward(np.array([2.0]))[0][0] > 1


def test_silu_is_stable_for_huge_inputs():
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is fine
        y, cache = silu_forward(np.array([-1000.0, 1000.0]))
        dx = silu_backward(np.ones(2), cache)
    np.testing.assert_array_equal(y, [0.0, 1000.0])
    np.testing.assert_array_equal(dx, [0.0, 1.0])


def test_swiglu_is_the_catalogue_formula_n7():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 4))
    w_gate, w_up, w_down = (rng.standard_normal(s) for s in ((4, 6), (4, 6), (6, 4)))
    y, _ = swiglu_forward(x, w_gate, w_up, w_down)
    g = x @ w_gate
    expected = (g / (1.0 + np.exp(-g)) * (x @ w_up)) @ w_down
    np.testing.assert_allclose(y, expected, rtol=1e-13, atol=1e-13)


def test_geglu_is_the_catalogue_formula_n20():
    # Gemma's MLP: [GELU_tanh(x W_g) * (x W_u)] W_d, the tanh GELU written out (N6)
    rng = np.random.default_rng(3)
    x = 2.0 * rng.standard_normal((2, 3, 4))
    w_gate, w_up, w_down = (rng.standard_normal(s) for s in ((4, 6), (4, 6), (6, 4)))
    y, _ = geglu_forward(x, w_gate, w_up, w_down)
    g = x @ w_gate
    gelu = 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
    np.testing.assert_allclose(y, (gelu * (x @ w_up)) @ w_down, rtol=1e-13, atol=1e-13)


def test_softcap_worked_example_n19():
    # c = 2, x = ln 3: tanh(ln 3 / 2) = (3 - 1) / (3 + 1) = 1/2, so y = 1 and the slope 1 - (1/2)^2
    y, cache = softcap_forward(np.array([math.log(3.0), 0.0, -math.log(3.0)]), 2.0)
    np.testing.assert_allclose(y, [1.0, 0.0, -1.0], rtol=1e-15, atol=0)
    np.testing.assert_allclose(softcap_backward(np.ones(3), cache), [0.75, 1.0, 0.75], rtol=1e-15)


def test_softcap_is_the_identity_to_first_order_and_bounded_by_the_cap_n19():
    cap = 30.0
    # For 0 <= u: u - u^3/3 <= tanh u <= u, so 0 <= x - c tanh(x/c) <= x^3 / (3 c^2) for x >= 0
    # (and the mirror image for x < 0): the error of the identity is third order in x / c.
    x = np.linspace(-3.0, 3.0, 61)  # |x| <= c / 10
    y, cache = softcap_forward(x, cap)
    gap = np.abs(x - y)
    assert np.all(gap <= np.abs(x) ** 3 / (3 * cap**2) * (1 + 1e-12) + 1e-15)
    assert np.all(np.sign(x - y) == np.sign(x))  # it pulls towards 0, never past the identity
    # the slope 1 - tanh^2(x/c) is 1 at 0 and within (x/c)^2 of it nearby
    slope = softcap_backward(np.ones_like(x), cache)
    assert slope[30] == 1.0 and np.all((1.0 - slope) <= (x / cap) ** 2 + 1e-15)
    # however large the input, the output stays within the cap, reaching it at infinity
    big = np.array([-np.inf, -1e300, -1e3, 1e3, 1e300, np.inf])
    y_big, cache_big = softcap_forward(big, cap)
    assert np.all(np.abs(y_big) <= cap)
    np.testing.assert_array_equal(y_big[[0, -1]], [-cap, cap])
    np.testing.assert_array_equal(softcap_backward(np.ones(6), cache_big), np.zeros(6))


def test_softcap_keeps_float32_and_refuses_a_bad_cap():
    y, cache = softcap_forward(np.ones(3, dtype=np.float32), 50.0)
    assert y.dtype == softcap_backward(np.ones(3, dtype=np.float32), cache).dtype == np.float32
    for bad in (0.0, -5.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"cap must be a finite number > 0, got"):
            softcap_forward(np.ones(3), bad)
    with pytest.raises(TypeError, match=r"cap must be a number, got True of type bool"):
        softcap_forward(np.ones(3), True)
    with pytest.raises(TypeError, match=r"x must be a floating-point array"):
        softcap_forward(np.arange(3), 1.0)


def test_swiglu_parameter_counts_n7():
    d, d_f = 6, 10
    assert ffn_parameter_count(d, d_f) == 2 * d * d_f == 120
    assert ffn_parameter_count(d, d_f, gated=True) == 3 * d * d_f == 180
    assert ffn_parameter_count(d, d_f, biases=True) == 120 + d_f + d
    # the arrays swiglu_forward takes hold exactly the gated count
    shapes = [(d, d_f), (d, d_f), (d_f, d)]
    assert sum(math.prod(s) for s in shapes) == ffn_parameter_count(d, d_f, gated=True)
    # d_f = 8d/3 gives the same budget as a two-matrix FFN of width 4d (d = 6: 8d/3 = 16)
    assert ffn_parameter_count(6, swiglu_hidden_size(6, multiple_of=1), gated=True) == ffn_parameter_count(6, 24)


def test_swiglu_hidden_size_rounds_8d_over_3_up_n7():
    # d = 4096: 8d/3 = 10922.67 = 42.67 * 256, rounded up to 43 * 256 = 11008 (LLaMA-7B's width)
    assert swiglu_hidden_size(4096) == 11008
    # d = 5120: 8d/3 = 13653.33 = 53.33 * 256 -> 54 * 256 = 13824
    assert swiglu_hidden_size(5120) == 13824
    assert swiglu_hidden_size(4, multiple_of=1) == 11  # ceil(10.67)
    for m in (1, 8, 64, 256):
        for d in range(1, 300):
            h = swiglu_hidden_size(d, multiple_of=m)
            # the smallest multiple of m that is >= 8d/3, in exact integer arithmetic
            assert h % m == 0 and 3 * h >= 8 * d and 3 * (h - m) < 8 * d


def test_bad_inputs_name_the_arguments_and_shapes():
    x = np.zeros((2, 4))
    with pytest.raises(ValueError, match=r"x.shape\[-1\] must equal w.shape\[0\].*\(2, 4\).*\(5, 3\)"):
        linear_forward(x, np.zeros((5, 3)))
    with pytest.raises(ValueError, match=r"b must have shape \(3,\).*\(4, 3\).*\(4,\)"):
        linear_forward(x, np.zeros((4, 3)), np.zeros(4))
    with pytest.raises(ValueError, match=r"w must have 2 dimensions"):
        linear_forward(x, np.zeros(4))
    with pytest.raises(TypeError, match=r"x must be a floating-point array, got dtype int64"):
        linear_forward(np.zeros((2, 4), dtype=np.int64), np.zeros((4, 3)))
    w1, b1, w2, b2 = np.zeros((4, 6)), np.zeros(6), np.zeros((5, 4)), np.zeros(4)
    with pytest.raises(ValueError, match=r"w2.shape\[0\] must be 6 to match w1.shape = \(4, 6\).*\(5, 4\)"):
        ffn_forward(x, w1, b1, w2, b2)
    with pytest.raises(ValueError, match=r"x.shape\[-1\] must equal w1.shape\[0\].*\(2, 3\).*\(4, 6\)"):
        ffn_forward(np.zeros((2, 3)), w1, b1, np.zeros((6, 4)), b2)
    with pytest.raises(ValueError, match=r"b2 must have shape \(4,\)"):
        ffn_forward(x, w1, b1, np.zeros((6, 4)), np.zeros(3))
    with pytest.raises(ValueError, match=r"activation must be one of .*'swish'"):
        ffn_forward(x, w1, b1, np.zeros((6, 4)), b2, activation="swish")
    with pytest.raises(ValueError, match=r"w_gate and w_up must have the same shape.*\(4, 6\).*\(4, 5\)"):
        swiglu_forward(x, w1, np.zeros((4, 5)), np.zeros((6, 4)))
    with pytest.raises(ValueError, match=r"w_down.shape\[0\] must be 6"):
        swiglu_forward(x, w1, w1, np.zeros((5, 4)))
    with pytest.raises(ValueError, match=r"w_gate and w_up must have the same shape.*\(4, 6\).*\(4, 5\)"):
        geglu_forward(x, w1, np.zeros((4, 5)), np.zeros((6, 4)))
    with pytest.raises(ValueError, match=r"x.shape\[-1\] must equal w_gate.shape\[0\]"):
        geglu_forward(np.zeros((2, 3)), w1, w1, np.zeros((6, 4)))
    with pytest.raises(TypeError, match=r"x must be a floating-point array"):
        gelu_forward(np.arange(3))
    with pytest.raises(ValueError, match=r"d must be an int >= 1, got 0"):
        swiglu_hidden_size(0)
    with pytest.raises(TypeError, match=r"multiple_of must be an int, got 2.5 of type float"):
        swiglu_hidden_size(64, multiple_of=2.5)
