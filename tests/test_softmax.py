"""Stable softmax, log-softmax, the softmax Jacobian and the online (blockwise) softmax."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from refmath.softmax import (
    OnlineSoftmaxState,
    log_softmax_backward,
    log_softmax_forward,
    online_softmax_block,
    online_softmax_empty,
    online_softmax_logsumexp,
    online_softmax_merge,
    online_softmax_result,
    softmax_backward,
    softmax_forward,
    softmax_jacobian,
)

PROPERTY = settings(max_examples=30, deadline=None)
FINITE = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False)


def _naive_softmax(x):
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


# ---- stable softmax (A11, S4) --------------------------------------------------------------------

@PROPERTY
@given(arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(1, 6)), elements=FINITE))
def test_rows_are_distributions_even_for_huge_scores(x):
    # Entries up to 1e4: exp(1e4) overflows float64 (max ~ exp(709.8)), the shifted form cannot.
    a, _ = softmax_forward(x)
    assert np.all(np.isfinite(a)) and np.all(a >= 0) and np.all(a <= 1)
    np.testing.assert_allclose(a.sum(axis=-1), 1.0, rtol=1e-12)
    # The largest score always gets the largest weight.
    assert np.all(a[np.arange(len(x)), x.argmax(axis=-1)] == a.max(axis=-1))


@PROPERTY
@given(arrays(np.float64, (3, 5), elements=st.floats(-20, 20)), st.floats(-1e3, 1e3))
def test_shift_invariance_and_agreement_with_the_naive_formula(x, c):
    a, _ = softmax_forward(x)
    np.testing.assert_allclose(a, _naive_softmax(x), rtol=1e-12, atol=1e-300)
    # Rounding x + c moves each score by at most ulp(1e3) / 2 ~ 6e-14, and each weight by about
    # twice that relative amount.
    np.testing.assert_allclose(softmax_forward(x + c)[0], a, rtol=1e-12, atol=1e-300)


def test_naive_softmax_overflows_where_the_stable_one_does_not():
    # S4 / A11. float16 tops out at 65504, and exp(12) = 162754.79 > 65504, so the naive exp(x)
    # of x = 12 is inf and inf / inf = NaN. Subtracting the row max leaves exponents <= 0.
    x = np.array([12.0, 11.0, 0.0, -3.0], dtype=np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        naive = _naive_softmax(x)
        assert np.isinf(np.exp(x[0])) and np.isnan(naive[0])
    stable, _ = softmax_forward(x)
    assert stable.dtype == np.float16 and np.all(np.isfinite(stable))
    reference = _naive_softmax(x.astype(np.float64))  # float64 has the range for exp(12)
    # float16 carries 11 significant bits: a few ulps (2^-10 each) of relative error are expected.
    np.testing.assert_allclose(stable, reference, rtol=4 * 2.0**-10, atol=1e-4)
    # The same overflow in float64 needs scores beyond log(max float64) ~ 709.78.
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.isnan(_naive_softmax(np.array([1e4, 0.0]))[0])
    np.testing.assert_allclose(softmax_forward(np.array([1e4, 0.0]))[0], [1.0, 0.0])


def test_partly_masked_row_renormalises_over_the_visible_entries():
    x = np.array([[1.0, -np.inf, 2.0, -np.inf]])
    a, cache = softmax_forward(x)
    e = np.exp([1.0, 2.0])
    np.testing.assert_allclose(a, [[e[0] / e.sum(), 0.0, e[1] / e.sum(), 0.0]], rtol=1e-15)
    dx = softmax_backward(np.array([[0.3, 5.0, -1.0, 7.0]]), cache)
    assert dx[0, 1] == 0.0 and dx[0, 3] == 0.0


def test_fully_masked_row_gives_zeros_and_zero_gradient_without_nan():
    x = np.array([[0.5, -1.0, 2.0], [-np.inf, -np.inf, -np.inf]])
    with np.errstate(all="raise"):  # any NaN produced on the way would raise here
        a, cache = softmax_forward(x)
        dx = softmax_backward(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), cache)
    np.testing.assert_array_equal(a[1], 0.0)
    np.testing.assert_array_equal(dx[1], 0.0)
    np.testing.assert_allclose(a[0], _naive_softmax(x[0]), rtol=1e-15)
    # An empty last axis is a row with no keys: an empty result, not an error.
    assert softmax_forward(np.zeros((2, 0)))[0].shape == (2, 0)


def test_float32_stays_float32():
    x = np.array([[1.0, 2.0, -np.inf]], dtype=np.float32)
    a, cache = softmax_forward(x)
    assert a.dtype == np.float32
    assert softmax_backward(np.ones_like(a), cache).dtype == np.float32


# ---- the softmax Jacobian (A5) -------------------------------------------------------------------

def test_jacobian_formula_equals_central_differences():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(5)
    a, cache = softmax_forward(x)
    h = 1e-5
    numeric = np.empty((5, 5))
    for u in range(5):  # column u: d a / d x_u
        step = np.zeros(5)
        step[u] = h
        numeric[:, u] = (softmax_forward(x + step)[0] - softmax_forward(x - step)[0]) / (2 * h)
    jacobian = softmax_jacobian(a)
    # Two-point central differences: truncation ~ h^2 = 1e-10, rounding ~ 1e-16 / h = 1e-11.
    np.testing.assert_allclose(jacobian, numeric, atol=1e-9)
    # Entry by entry, da_j / dx_u = a_j (delta_ju - a_u).
    np.testing.assert_allclose(jacobian[1, 3], a[1] * (0 - a[3]), rtol=1e-15)
    np.testing.assert_allclose(jacobian[2, 2], a[2] * (1 - a[2]), rtol=1e-15)
    # Backward is the vector-Jacobian product J^T dout without building J.
    dout = rng.standard_normal(5)
    np.testing.assert_allclose(softmax_backward(dout, cache), jacobian.T @ dout, atol=1e-15)


def test_jacobian_rows_sum_to_zero_and_saturation_kills_it():
    # Weights always sum to 1, so every column of J sums to 0. A near one-hot row (large scores,
    # the saturation that the 1/sqrt(d_k) scale guards against) has a Jacobian near 0.
    a, _ = softmax_forward(np.array([0.3, -0.2, 1.1]))
    np.testing.assert_allclose(softmax_jacobian(a).sum(axis=0), 0.0, atol=1e-16)
    saturated, _ = softmax_forward(np.array([30.0, 0.0, 0.0]))
    assert np.abs(softmax_jacobian(saturated)).max() < 1e-12


# ---- log-softmax ---------------------------------------------------------------------------------

@PROPERTY
@given(arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(1, 6)), elements=FINITE))
def test_log_softmax_is_the_log_of_softmax(x):
    y, _ = log_softmax_forward(x)
    assert np.all(np.isfinite(y)) and np.all(y <= 0)
    np.testing.assert_allclose(np.exp(y).sum(axis=-1), 1.0, rtol=1e-12)
    a, _ = softmax_forward(x)
    visible = a > 1e-300  # where the probability did not underflow, log(a) is accurate
    np.testing.assert_allclose(y[visible], np.log(a[visible]), rtol=1e-12, atol=1e-12)


def test_log_softmax_of_a_tiny_probability_stays_finite():
    # softmax underflows to 0 for a gap of 1000, so log(softmax) is -inf; the direct form is exact.
    y, _ = log_softmax_forward(np.array([0.0, -1000.0]))
    np.testing.assert_allclose(y, [0.0, -1000.0], atol=1e-12)


def test_log_softmax_masks():
    x = np.array([[1.0, -np.inf, 2.0], [-np.inf, -np.inf, -np.inf]])
    with np.errstate(all="raise"):
        y, cache = log_softmax_forward(x)
        dx = log_softmax_backward(np.array([[0.5, 3.0, -1.0], [1.0, 1.0, 1.0]]), cache)
    lse = np.log(np.exp(1.0) + np.exp(2.0))
    # atol: a few ulps of lse ~ 1.3 (one ulp is 2.2e-16).
    np.testing.assert_allclose(y[0], [1.0 - lse, -np.inf, 2.0 - lse], rtol=0, atol=1e-15)
    np.testing.assert_array_equal(y[1], 0.0)  # the documented convention for a fully masked row
    assert dx[0, 1] == 0.0
    np.testing.assert_array_equal(dx[1], 0.0)
    # The visible entries' gradient ignores the masked upstream value: dx = g - a * sum(g).
    a = np.exp(y[0, [0, 2]])
    g = np.array([0.5, -1.0])
    np.testing.assert_allclose(dx[0, [0, 2]], g - a * g.sum(), rtol=1e-14)


# ---- online softmax (F1, F2, F3) -----------------------------------------------------------------

def _blocks(scores, values, cuts):
    """States of the consecutive key blocks [cuts[i], cuts[i+1])."""
    return [online_softmax_block(scores[..., lo:hi], values[lo:hi]) for lo, hi in zip(cuts, cuts[1:])]


def _fold(states):
    total = online_softmax_empty(states[0].m.shape, states[0].u.shape[-1])
    for state in states:
        total = online_softmax_merge(total, state)
    return total


def _assert_states_close(a, b):
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14)


@PROPERTY
@given(st.integers(1, 12), st.integers(0, 2**32 - 1), st.data())
def test_merged_blocks_equal_the_full_softmax(n, seed, data):
    rng = np.random.default_rng(seed)
    scores = 3.0 * rng.standard_normal((3, n))
    scores[rng.random((3, n)) < 0.3] = -np.inf  # masked keys; row 0 may end up fully masked
    values = rng.standard_normal((n, 2))
    inner = sorted(data.draw(st.lists(st.integers(0, n), max_size=4)))  # repeats = empty blocks
    merged = _fold(_blocks(scores, values, [0] + inner + [n]))

    a, _ = softmax_forward(scores)  # F1: the full computation, o = softmax(s) v
    np.testing.assert_allclose(online_softmax_result(merged), a @ values, rtol=1e-10, atol=1e-12)
    with np.errstate(divide="ignore"):
        full_lse = np.log(np.sum(np.exp(scores), axis=-1))  # small scores: no overflow here
    np.testing.assert_allclose(online_softmax_logsumexp(merged), full_lse, rtol=1e-12)


def test_block_statistics_match_their_definition():
    # F2 on one row: m = max s, l = sum exp(s - m), u = sum exp(s - m) v.
    s = np.array([0.5, 2.0, -1.0])
    v = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    state = online_softmax_block(s, v)
    w = np.exp(s - 2.0)
    assert state.m == 2.0
    np.testing.assert_allclose(state.l, w.sum(), rtol=1e-15)
    np.testing.assert_allclose(state.u, w @ v, rtol=1e-15)


def test_merge_is_commutative_and_associative():
    rng = np.random.default_rng(1)
    scores = 4.0 * rng.standard_normal((2, 9))
    values = rng.standard_normal((9, 3))
    a, b, c = _blocks(scores, values, [0, 2, 6, 9])
    for x, y in zip(online_softmax_merge(a, b), online_softmax_merge(b, a)):
        np.testing.assert_array_equal(x, y)  # max and a two-term sum are symmetric bit for bit
    _assert_states_close(online_softmax_merge(online_softmax_merge(a, b), c),
                         online_softmax_merge(a, online_softmax_merge(b, c)))


def test_empty_and_fully_masked_blocks_are_identities():
    rng = np.random.default_rng(2)
    scores = rng.standard_normal((2, 4))
    values = rng.standard_normal((4, 3))
    state = online_softmax_block(scores, values)
    empty = online_softmax_empty(2, 3)
    no_keys = online_softmax_block(np.zeros((2, 0)), np.zeros((0, 3)))
    masked = online_softmax_block(np.full((2, 4), -np.inf), values)
    with np.errstate(all="raise"):  # -inf - (-inf) anywhere would raise
        for identity in (empty, no_keys, masked):
            assert np.all(np.isneginf(identity.m)) and np.all(identity.l == 0)
            _assert_states_close(online_softmax_merge(state, identity), state)
            _assert_states_close(online_softmax_merge(identity, state), state)
        nothing = online_softmax_merge(masked, empty)
        np.testing.assert_array_equal(online_softmax_result(nothing), 0.0)
        assert np.all(np.isneginf(online_softmax_logsumexp(nothing)))


def test_values_may_carry_the_row_dimensions():
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((2, 3, 5))
    values = rng.standard_normal((2, 3, 5, 4))  # a different value set per row
    state = online_softmax_block(scores, values)
    assert state.u.shape == (2, 3, 4)
    a, _ = softmax_forward(scores)
    np.testing.assert_allclose(online_softmax_result(state), np.einsum("...n,...nd->...d", a, values),
                               rtol=1e-12)
    assert isinstance(state, OnlineSoftmaxState)


# ---- bad input -----------------------------------------------------------------------------------

def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match=r"x must be a floating-point array.*int"):
        softmax_forward(np.arange(3))
    with pytest.raises(TypeError, match="x must be"):
        log_softmax_forward([1, 2, 3])
    with pytest.raises(ValueError, match=r"x must have at least 1 dimensions.*\(\)"):
        softmax_forward(np.float64(1.0))
    with pytest.raises(ValueError, match=r"a must have 1 dimensions"):
        softmax_jacobian(np.ones((2, 2)) / 2)
    with pytest.raises(ValueError, match=r"values.shape\[-2\] must be 3"):
        online_softmax_block(np.zeros((2, 3)), np.zeros((4, 2)))
    with pytest.raises(TypeError, match="scores must be"):
        online_softmax_block(np.zeros((2, 3), dtype=int), np.zeros((3, 2)))
