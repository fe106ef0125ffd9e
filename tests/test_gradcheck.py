"""The gradient-check machinery itself, and every registered op checked through it."""
import numpy as np
import pytest

from refmath.gradcheck import check_case, numerical_gradient, relative_error
from refmath.registry import OpCase, all_cases

CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradient_matches_central_differences(case):
    result = check_case(case)
    assert result.passed, f"{case.name}: errors {result.errors} > bound {result.bound:.1e}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_float32_in_float32_out(case):
    inputs = case.make_inputs(np.random.default_rng(0))
    for name in case.wrt:
        inputs[name] = inputs[name].astype(np.float32)
    out, cache = case.forward(**inputs)
    assert out.dtype == np.float32, f"{case.name}: output dtype {out.dtype}"
    grads = case.grads_by_name(case.backward(np.ones_like(out), cache))
    for name, grad in grads.items():
        assert grad.dtype == np.float32, f"{case.name}: gradient of {name} has dtype {grad.dtype}"


def test_numerical_gradient_of_a_cubic_is_exact_to_rounding():
    # phi(x) = sum(x^3) has phi' = 3 x^2; the five-point stencil is exact for polynomials of
    # degree <= 4, so only rounding error remains.
    x = np.array([0.5, -1.25, 2.0])
    numeric = numerical_gradient(lambda: float(np.sum(x**3)), x, np.arange(3))
    np.testing.assert_allclose(numeric, 3 * x**2, rtol=1e-11)
    np.testing.assert_array_equal(x, [0.5, -1.25, 2.0])  # perturbations are undone


def test_relative_error_formula():
    np.testing.assert_allclose(relative_error([1.0, 0.0, -2.0], [1.1, 0.0, 2.0]), [0.1 / 2.1, 0.0, 1.0])


def test_a_wrong_gradient_is_caught():
    def forward(x):
        return x**2, x

    def wrong_backward(dout, x):
        return dout * 2.02 * x  # 1% off

    case = OpCase("square", "wrong", (), lambda rng: {"x": rng.standard_normal(5) + 3.0},
                  forward, wrong_backward, ("x",))
    result = check_case(case)
    assert not result.passed
    assert result.max_error == pytest.approx(0.02 / 4.02, rel=1e-6)


def test_large_inputs_are_sampled():
    case = OpCase("double", "big", (), lambda rng: {"x": rng.standard_normal(10_000)},
                  lambda x: (2 * x, None), lambda dout, _: 2 * dout, ("x",))
    result = check_case(case, max_coords=50)
    assert result.coords_checked == 50 and result.passed

