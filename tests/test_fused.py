"""refmath.fast.fused computes exactly what the reference ops compute: equal bit for bit (and GeGLU,
new to the models, also against torch)."""
import numpy as np
import pytest

from refmath.ffn import gelu_backward, gelu_forward, linear_backward, linear_forward
from refmath.fast.fused import bias_gelu_backward, bias_gelu_forward


# (2, 5, 7): one block of rows; (3, 37, 1000): 111 rows in blocks of 32 rows (the fused functions
# work on blocks of 32768 elements), the last one partial.
SHAPES = [(2, 5, 6, 7), (3, 37, 20, 1000)]


@pytest.mark.parametrize("shape", SHAPES, ids=["one-block", "many-blocks"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("approximate", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_bias_gelu_equals_the_reference_bit_for_bit(dtype, approximate, bias, shape):
    b_, t, d, d_f = shape
    rng = np.random.default_rng(3)
    x = (3 * rng.standard_normal((b_, t, d))).astype(dtype)
    w = rng.standard_normal((d, d_f)).astype(dtype)
    b = rng.standard_normal(d_f).astype(dtype) if bias else None
    da = rng.standard_normal((b_, t, d_f)).astype(dtype)

    h, first = linear_forward(x, w, b)
    a_ref, act = gelu_forward(h, approximate)
    dh_ref = gelu_backward(da, act)
    dx_ref, dw_ref, db_ref = linear_backward(dh_ref, first)

    a, cache = bias_gelu_forward(linear_forward(x, w)[0], b, approximate)
    dh = bias_gelu_backward(da, cache)
    assert a.dtype == dh.dtype == dtype
    np.testing.assert_array_equal(a, a_ref)
    np.testing.assert_array_equal(dh, dh_ref)
    dx, dw, _ = linear_backward(dh, first._replace(has_bias=False))
    np.testing.assert_array_equal(dx, dx_ref)
    np.testing.assert_array_equal(dw, dw_ref)
    if bias:
        np.testing.assert_array_equal(dh.reshape(-1, d_f).sum(axis=0), db_ref)


def test_nan_stays_nan():
    h = np.array([[np.nan, 1.0]])
    a, cache = bias_gelu_forward(h, None, True)
    dh = bias_gelu_backward(np.ones_like(a), cache)
    assert np.isnan(a[0, 0]) and np.isnan(dh[0, 0]) and np.isfinite(a[0, 1])


@pytest.mark.parametrize("shape", SHAPES, ids=["one-block", "many-blocks"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_swiglu_equals_the_reference_bit_for_bit(dtype, shape):
    from refmath import ffn
    from refmath.fast import fused

    b, t, d, d_f = shape
    rng = np.random.default_rng(4)
    x = (3 * rng.standard_normal((b, t, d))).astype(dtype)
    w_gate, w_up = (rng.standard_normal((d, d_f)).astype(dtype) for _ in range(2))
    w_down = rng.standard_normal((d_f, d)).astype(dtype)
    dy = rng.standard_normal((b, t, d)).astype(dtype)
    y_ref, cache_ref = ffn.swiglu_forward(x, w_gate, w_up, w_down)
    y, cache = fused.swiglu_forward(x, w_gate, w_up, w_down)
    np.testing.assert_array_equal(y, y_ref)
    for got, want in zip(fused.swiglu_backward(dy, cache), ffn.swiglu_backward(dy, cache_ref)):
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape", SHAPES, ids=["one-block", "many-blocks"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_geglu_equals_the_reference_bit_for_bit(dtype, shape):
    from refmath import ffn
    from refmath.fast import fused

    b, t, d, d_f = shape
    rng = np.random.default_rng(6)
    x = (3 * rng.standard_normal((b, t, d))).astype(dtype)
    w_gate, w_up = (rng.standard_normal((d, d_f)).astype(dtype) for _ in range(2))
    w_down = rng.standard_normal((d_f, d)).astype(dtype)
    dy = rng.standard_normal((b, t, d)).astype(dtype)
    y_ref, cache_ref = ffn.geglu_forward(x, w_gate, w_up, w_down)
    y, cache = fused.geglu_forward(x, w_gate, w_up, w_down)
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, y_ref)
    for got, want in zip((cache.gate.x, cache.gate.gate, cache.up, cache.hidden),
                         (cache_ref.gate.x, cache_ref.gate.gate, cache_ref.up, cache_ref.hidden)):
        np.testing.assert_array_equal(got, want)
    assert cache.gate.approximate and cache_ref.gate.approximate
    for got, want in zip(fused.geglu_backward(dy, cache), ffn.geglu_backward(dy, cache_ref)):
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want)


def test_geglu_matches_a_torch_mlp_with_tanh_gelu():
    """Gemma's MLP in torch, down(gelu_pytorch_tanh(gate(x)) * up(x)), with refmath's (in, out)
    weights handed to F.linear transposed; gradients by autograd."""
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle; install the 'oracle' extra")
    from refmath.fast import fused

    F = torch.nn.functional
    rng = np.random.default_rng(7)
    x = 2.0 * rng.standard_normal((2, 5, 6))
    weights = [rng.standard_normal(s) / np.sqrt(s[0]) for s in ((6, 10), (6, 10), (10, 6))]
    dy = rng.standard_normal((2, 5, 6))
    y, cache = fused.geglu_forward(x, *weights)
    grads = fused.geglu_backward(dy, cache)
    tx, tg, tu, td = (torch.tensor(a, requires_grad=True) for a in (x, *weights))
    ty = F.linear(F.gelu(F.linear(tx, tg.T), approximate="tanh") * F.linear(tx, tu.T), td.T)
    ty.backward(torch.tensor(dy))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-13)
    for name, got, want in zip(("x", "w_gate", "w_up", "w_down"), grads, (tx, tg, tu, td)):
        np.testing.assert_allclose(got, want.grad.numpy(), rtol=1e-11, atol=1e-12, err_msg=name)


def test_geglu_nan_stays_nan():
    from refmath.fast import fused

    x = np.array([[np.nan, 1.0], [0.5, -1.0]])
    y, cache = fused.geglu_forward(x, np.ones((2, 3)), np.ones((2, 3)), np.ones((3, 2)))
    dx, *_ = fused.geglu_backward(np.ones_like(y), cache)
    assert np.isnan(y[0]).all() and np.isnan(dx[0]).all() and np.isfinite(y[1]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layernorm_equals_the_reference_bit_for_bit(dtype):
    from refmath import norms
    from refmath.fast import fused

    rng = np.random.default_rng(5)
    x = (3 * rng.standard_normal((2, 5, 8)) + 1).astype(dtype)
    gamma, beta = (rng.standard_normal(8).astype(dtype) for _ in range(2))
    dy = rng.standard_normal((2, 5, 8)).astype(dtype)
    y_ref, cache_ref = norms.layernorm_forward(x, gamma, beta, 1e-5)
    y, cache = fused.layernorm_forward(x, gamma, beta, 1e-5)
    np.testing.assert_array_equal(y, y_ref)
    for got, want in zip(cache, cache_ref):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(fused.layernorm_backward(dy, cache), norms.layernorm_backward(dy, cache_ref)):
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want)


def test_swiglu_nan_and_zero_gates_match_the_reference():
    # The fused sigmoid picks its numerator by a maximum instead of np.where: a NaN gate must
    # still give NaN, and a zero gate the value 1/2, as in refmath.ffn.
    from refmath import ffn
    from refmath.fast import fused

    x = np.array([[1.0, 0.0], [0.0, 1.0], [np.nan, 0.0]])
    w_gate = np.array([[0.0, -0.0, 3.0], [-2.0, 0.5, 0.0]])
    w_up, w_down = np.ones((2, 3)), np.ones((3, 2))
    want, cache_ref = ffn.swiglu_forward(x, w_gate, w_up, w_down)
    got, cache = fused.swiglu_forward(x, w_gate, w_up, w_down)
    np.testing.assert_array_equal(cache.gate.sig, cache_ref.gate.sig)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[2]).all() and cache.gate.sig[0, 0] == 0.5
