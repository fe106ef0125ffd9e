"""Public tests of the attention assignment: run them with `python -m pytest -q tests`.

They check your functions against small hand-made examples and against central differences of
your own forward. The hidden tests check more cases, against an independent implementation, with
tight tolerances and time limits.
"""
import numpy as np
import pytest

from refmath.attention import causal_mask, gqa_head_map, mha_backward, mha_forward, sdpa_backward, sdpa_forward


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


def test_one_key_gives_its_value():
    # with a single key, every weight is 1 and every output row is that key's value
    q, k, v = np.ones((3, 2)), np.ones((1, 2)), np.array([[2.0, -1.0]])
    o, _ = sdpa_forward(q, k, v)
    np.testing.assert_allclose(o, np.repeat(v, 3, axis=0))


def test_equal_scores_average_the_values():
    # zero queries give equal scores, so each output is the mean of the values
    q, k = np.zeros((2, 3)), np.arange(12.0).reshape(4, 3)
    v = np.arange(8.0).reshape(4, 2)
    o, _ = sdpa_forward(q, k, v)
    np.testing.assert_allclose(o, np.tile(v.mean(axis=0), (2, 1)))


def test_causal_first_query_sees_first_key():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    o, _ = sdpa_forward(q, k, v, mask=causal_mask(4))
    np.testing.assert_allclose(o[0], v[0])


@pytest.mark.parametrize("which", [0, 1, 2])
def test_sdpa_backward_matches_central_differences(which):
    rng = np.random.default_rng(1)
    args = [rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 3))]
    mask = causal_mask(3, 5)
    dout = rng.standard_normal((2, 3, 3))
    _, cache = sdpa_forward(*args, mask=mask)
    analytic = sdpa_backward(dout, cache)[which]

    def f(x):
        inputs = list(args)
        inputs[which] = x
        return sdpa_forward(*inputs, mask=mask)[0]
    numeric = central_differences(f, args[which].copy(), dout)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


def test_gqa_head_map_small():
    assert list(gqa_head_map(4, 2)) == [0, 0, 1, 1]


def test_mha_backward_dx_matches_central_differences():
    rng = np.random.default_rng(2)
    d, h, g, d_h = 6, 4, 2, 3
    x = rng.standard_normal((2, 3, d))
    params = {"w_q": rng.standard_normal((d, h * d_h)), "w_k": rng.standard_normal((d, g * d_h)),
              "w_v": rng.standard_normal((d, g * d_h)), "w_o": rng.standard_normal((h * d_h, d))}
    dy = rng.standard_normal(x.shape)
    _, cache = mha_forward(x, params, n_heads=h, n_kv_heads=g)
    dx, grads = mha_backward(dy, cache)
    numeric = central_differences(lambda z: mha_forward(z, params, h, g)[0], x.copy(), dy)
    np.testing.assert_allclose(dx, numeric, rtol=1e-6, atol=1e-8)
    assert set(grads) == set(params)
