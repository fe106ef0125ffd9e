"""Scaled dot-product attention, masks and multi-head attention (MHA, GQA, MQA, cross, fused QKV)."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refmath import kernels
from refmath.attention import (
    causal_attention_backward,
    causal_attention_forward,
    causal_mask,
    gqa_head_map,
    local_window_mask,
    mha_backward,
    mha_forward,
    padding_mask,
    SoftcapSDPACache,
    sdpa_backward,
    sdpa_forward,
)
from refmath.gradcheck import check_case
from refmath.inference.quantized import QuantizedKVCache, decode_with_quantized_cache
from refmath.gradcheck import all_cases
from _support import float32_rule

PROPERTY = settings(max_examples=30, deadline=None)
needs_cpu_kernels = pytest.mark.skipif(not kernels.cpu_available(),
                                       reason="the C++ module refmath._C is not built")


def _params(rng, d, h, g, d_h, d_ctx=None, biases=False):
    d_ctx = d if d_ctx is None else d_ctx
    shapes = {"w_q": (d, h * d_h), "w_k": (d_ctx, g * d_h), "w_v": (d_ctx, g * d_h),
              "w_o": (h * d_h, d)}
    params = {key: rng.standard_normal(shape) / math.sqrt(shape[0]) for key, shape in shapes.items()}
    if biases:
        params.update({"b" + key[1:]: rng.standard_normal(shape[1]) for key, shape in shapes.items()})
    return params


def _mha_by_loop(x, params, h, g, context=None, mask=0.0):
    """Multi-head attention written head by head from the catalogue's formulas, for one sequence:
    pi(r) = 1 + floor((r - 1) / (h / g)) with 1-based heads (A10),
    O_r = softmax(Q_r K_pi(r)^T / sqrt(d_h) + M) V_pi(r), Y = [O_1 ... O_h] W_O (A6)."""
    z = x if context is None else context
    d_h = params["w_q"].shape[1] // h
    heads = []
    for r in range(1, h + 1):
        u = 1 + (r - 1) // (h // g)
        cols_q = slice((r - 1) * d_h, r * d_h)
        cols_kv = slice((u - 1) * d_h, u * d_h)
        q = x @ params["w_q"][:, cols_q] + params.get("b_q", np.zeros(h * d_h))[cols_q]
        k = z @ params["w_k"][:, cols_kv] + params.get("b_k", np.zeros(g * d_h))[cols_kv]
        v = z @ params["w_v"][:, cols_kv] + params.get("b_v", np.zeros(g * d_h))[cols_kv]
        s = q @ k.T / math.sqrt(d_h) + mask
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        heads.append((e / e.sum(axis=-1, keepdims=True)) @ v)
    return np.concatenate(heads, axis=-1) @ params["w_o"] + params.get("b_o", 0.0)


# ---- scaled dot-product attention: worked example and scale (A2, A3, A4) ---------------------------

def test_a3_worked_example():
    # With d_k = 1, q = 1 and scale 1 the scores are the keys themselves: (0, log 2, 0).
    q = np.array([[1.0]])
    k = np.array([[0.0], [math.log(2.0)], [0.0]])
    v = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
    o, cache = sdpa_forward(q, k, v, scale=1.0)
    # e^s = (1, 2, 1) out of 4: weights (1/4, 1/2, 1/4); o = (1/4)(1,0) + (1/2)(0,2) + (1/4)(3,0).
    np.testing.assert_allclose(cache.a, [[0.25, 0.5, 0.25]], rtol=1e-15)
    np.testing.assert_allclose(o, [[1.0, 1.0]], rtol=1e-15)
    # Masking the third key renormalises (1, 2) out of 3; o = (1/3)(1,0) + (2/3)(0,2) = (1/3, 4/3).
    o, cache = sdpa_forward(q, k, v, mask=np.array([0.0, 0.0, -np.inf]), scale=1.0)
    np.testing.assert_allclose(cache.a, [[1 / 3, 2 / 3, 0.0]], rtol=1e-15)
    np.testing.assert_allclose(o, [[1 / 3, 4 / 3]], rtol=1e-15)


def test_a3_with_the_default_scale():
    # d_k = 4, default scale 1/2: q = (1,1,1,1) and k_j = (c_j/2)(1,1,1,1) give q.k_j / 2 = c_j.
    c = np.array([0.0, math.log(2.0), 0.0])
    q = np.ones((1, 4))
    k = np.outer(c / 2, np.ones(4))
    o, cache = sdpa_forward(q, k, np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]]))
    np.testing.assert_allclose(cache.a, [[0.25, 0.5, 0.25]], rtol=1e-15)
    np.testing.assert_allclose(o, [[1.0, 1.0]], rtol=1e-15)


@pytest.mark.parametrize("d_k", [1, 4, 16, 64])
def test_a4_score_variance_grows_like_d_k(d_k):
    # q.k = sum_r q_r k_r with independent N(0, 1) coordinates: each term has variance 1 and fourth
    # moment E[q^4] E[k^4] = 9, so X = q.k has Var X = d_k and E X^4 = 9 d_k + 3 d_k (d_k - 1).
    # The sample variance of N draws has variance ~ (E X^4 - (Var X)^2) / N = (2 d_k^2 + 6 d_k) / N,
    # so we allow 5 of its standard deviations (a false alarm has probability ~ 6e-7).
    n = 20_000
    rng = np.random.default_rng(d_k)
    q = rng.standard_normal((n, d_k))
    k = rng.standard_normal((n, d_k))
    dots = np.sum(q * k, axis=-1)
    tolerance = 5 * math.sqrt((2 * d_k**2 + 6 * d_k) / n)
    assert abs(dots.var() - d_k) < tolerance
    # Dividing by sqrt(d_k) divides the variance by d_k (and the tolerance with it): ~ 1 for all d_k.
    assert abs((dots / math.sqrt(d_k)).var() - 1.0) < tolerance / d_k
    # sdpa's default scale is exactly that 1/sqrt(d_k).
    _, cache = sdpa_forward(q[:3], k[:5], np.eye(5))
    s = q[:3] @ k[:5].T / math.sqrt(d_k)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(cache.a, e / e.sum(axis=-1, keepdims=True), rtol=1e-12)


# ---- properties of attention (A2, A8) ----------------------------------------------------------

@st.composite
def _attention_problem(draw):
    """Random q, k, v plus a random mask that leaves each query at least one visible key."""
    t_q, t_k, d_k, d_v = (draw(st.integers(1, 5)) for _ in range(4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    visible = rng.random((t_q, t_k)) < 0.6
    visible[np.arange(t_q), rng.integers(0, t_k, t_q)] = True
    mask = np.where(visible, 0.0, -np.inf)
    scale = draw(st.sampled_from([None, 0.1, 3.0]))  # 3.0: near one-hot weights
    return (2 * rng.standard_normal((t_q, d_k)), 2 * rng.standard_normal((t_k, d_k)),
            rng.standard_normal((t_k, d_v)), mask, visible, scale)


@PROPERTY
@given(_attention_problem())
def test_output_is_a_convex_combination_of_the_visible_values(problem):
    q, k, v, mask, visible, scale = problem
    o, cache = sdpa_forward(q, k, v, mask=mask, scale=scale)
    a = cache.a
    assert np.all(a >= 0)
    np.testing.assert_allclose(a.sum(axis=-1), 1.0, rtol=1e-14)
    assert np.all(a[~visible] == 0)
    for i in range(len(q)):
        lo = v[visible[i]].min(axis=0)
        hi = v[visible[i]].max(axis=0)
        slack = 1e-14 * (1 + np.abs(v).max())  # rounding of the weighted sum
        assert np.all(o[i] >= lo - slack) and np.all(o[i] <= hi + slack)


@PROPERTY
@given(_attention_problem(), st.integers(0, 2**32 - 1))
def test_keys_masked_for_every_query_get_zero_weight_and_zero_gradient(problem, seed):
    q, k, v, _, _, scale = problem
    rng = np.random.default_rng(seed)
    hidden = rng.random(len(k)) < 0.5
    hidden[rng.integers(0, len(k))] = False  # keep one key visible
    mask = np.where(hidden, -np.inf, 0.0)  # one row, broadcast over the queries
    o, cache = sdpa_forward(q, k, v, mask=mask, scale=scale)
    dq, dk, dv = sdpa_backward(rng.standard_normal(o.shape), cache)
    assert np.all(cache.a[:, hidden] == 0)
    assert np.all(dk[hidden] == 0) and np.all(dv[hidden] == 0)
    # The output does not depend on the hidden keys and values at all.
    k2, v2 = k.copy(), v.copy()
    k2[hidden] += 7.0
    v2[hidden] -= 3.0
    np.testing.assert_array_equal(sdpa_forward(q, k2, v2, mask=mask, scale=scale)[0], o)


def test_fully_masked_query_gives_a_zero_row_and_zero_gradients():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 3)), rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    mask = np.zeros((2, 4))
    mask[1] = -np.inf
    with np.errstate(all="raise"):
        o, cache = sdpa_forward(q, k, v, mask=mask)
        dq, dk, dv = sdpa_backward(np.ones_like(o), cache)
    np.testing.assert_array_equal(o[1], 0.0)
    np.testing.assert_array_equal(dq[1], 0.0)
    # The visible row is untouched by its neighbour.
    np.testing.assert_allclose(o[0], sdpa_forward(q[:1], k, v)[0][0], rtol=1e-15)


def test_dropout_mask_of_ones_is_no_dropout_and_zeros_drop_a_value():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 2)), rng.standard_normal((4, 2)), rng.standard_normal((4, 2))
    o, cache = sdpa_forward(q, k, v, mask=causal_mask(3, 4))
    o_ones, _ = sdpa_forward(q, k, v, mask=causal_mask(3, 4), dropout_mask=np.ones((3, 4)))
    np.testing.assert_array_equal(o_ones, o)
    keep = np.ones((3, 4))
    keep[:, 0] = 0.0  # drop key 0 for every query (an inverted-dropout mask, here with p = 0)
    o_drop, cache_drop = sdpa_forward(q, k, v, mask=causal_mask(3, 4), dropout_mask=keep)
    dq, dk, dv = sdpa_backward(np.ones_like(o), cache_drop)
    np.testing.assert_allclose(o_drop, o - cache.a[:, :1] * v[0], rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(dv[0], 0.0)


@pytest.mark.parametrize("case", [c for c in all_cases() if c.op in ("sdpa", "mha")],
                         ids=lambda c: c.name)
def test_a8_backward_matches_central_differences(case):
    result = check_case(case)
    assert result.passed, f"{case.name}: {result.errors}"


# ---- logit soft-capping and the query scale (N19, Gemma 2) --------------------------------------

def test_softcapped_scores_worked_example_n19():
    # d_k = 1, scale 1, cap 2: the raw scores q k_j = (0, ln 3, -ln 3) are capped to
    # 2 tanh(s / 2) = (0, 1, -1), since tanh(ln 3 / 2) = (3 - 1) / (3 + 1) = 1/2. With v = I the
    # output is the weight vector, e^(0, 1, -1) / (1 + e + 1/e).
    q = np.array([[1.0]])
    k = np.array([[0.0], [math.log(3.0)], [-math.log(3.0)]])
    v = np.eye(3)
    o, _ = sdpa_forward(q, k, v, scale=1.0, softcap=2.0)
    e = np.exp([0.0, 1.0, -1.0])
    np.testing.assert_allclose(o[0], e / e.sum(), rtol=1e-14)
    # hiding the second key renormalises the other two capped scores: (1, 0, 1/e) / (1 + 1/e)
    o, cache = sdpa_forward(q, k, v, mask=np.array([0.0, -np.inf, 0.0]), scale=1.0, softcap=2.0)
    np.testing.assert_allclose(o[0], np.array([1.0, 0.0, 1 / math.e]) / (1 + 1 / math.e),
                               rtol=1e-14)
    assert o[0, 1] == 0.0 and cache.attn.a[0, 1] == 0.0
    # the cap's state travels in a cache of its own: an uncapped cache still has its six fields
    assert isinstance(cache, SoftcapSDPACache)
    _, _, _, a, dropout_mask, scale = sdpa_forward(q, k, v, scale=1.0)[1]
    assert dropout_mask is None and scale == 1.0


def test_the_cap_comes_before_the_mask_so_hidden_keys_stay_hidden_n19():
    # Capping after the mask would give a hidden key the score -c and a share of the weight; with
    # the cap first, padded attention equals attention over the visible keys alone, and a sequence
    # with no visible key gets zero rows and zero gradients. Scale 1 makes the raw scores (std 2)
    # large against the cap of 1, so the cap is strongly in effect.
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 3)))
    mask = np.where(np.arange(5) < np.array([[3], [0]]), 0.0, -np.inf)[:, None, :]  # lengths 3, 0
    o, cache = sdpa_forward(q, k, v, mask=mask, scale=1.0, softcap=1.0)
    dq, dk, dv = sdpa_backward(rng.standard_normal(o.shape), cache)
    alone, _ = sdpa_forward(q[0], k[0, :3], v[0, :3], scale=1.0, softcap=1.0)
    np.testing.assert_allclose(o[0], alone, rtol=1e-14, atol=1e-15)
    assert np.all(cache.attn.a[0, :, 3:] == 0) and np.all(dk[0, 3:] == 0) and np.all(dv[0, 3:] == 0)
    for x in (o[1], dq[1], dk[1], dv[1]):
        np.testing.assert_array_equal(x, 0.0)


@PROPERTY
@given(_attention_problem(), st.sampled_from([0.5, 2.0, 50.0]), st.integers(0, 2**32 - 1))
def test_with_a_cap_masked_keys_still_get_zero_weight_and_zero_gradient_n19(problem, cap, seed):
    q, k, v, mask, visible, scale = problem
    o, cache = sdpa_forward(q, k, v, mask=mask, scale=scale, softcap=cap)
    dq, dk, dv = sdpa_backward(np.random.default_rng(seed).standard_normal(o.shape), cache)
    assert np.all(cache.attn.a[~visible] == 0)
    np.testing.assert_allclose(cache.attn.a.sum(axis=-1), 1.0, rtol=1e-14)
    hidden_everywhere = ~visible.any(axis=0)
    assert np.all(dk[hidden_everywhere] == 0) and np.all(dv[hidden_everywhere] == 0)


def test_a_cap_far_above_the_scores_moves_the_output_by_a_third_order_amount_n19():
    # |c tanh(s/c) - s| <= |s|^3 / (3 c^2) =: delta (test_ffn). Every score moving by at most
    # delta moves each log-weight by at most 2 delta, so |dA_ij| <= A_ij (e^{2 delta} - 1) and
    # |dO| <= (e^{2 delta} - 1) max |v|.
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 6), (2, 7, 6), (2, 7, 3)))
    cap = 1e3
    plain, cache = sdpa_forward(q, k, v, mask=causal_mask(4, 7))
    capped, _ = sdpa_forward(q, k, v, mask=causal_mask(4, 7), softcap=cap)
    s = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(6)
    delta = np.abs(s).max() ** 3 / (3 * cap**2)
    bound = np.expm1(2 * delta) * np.abs(v).max() + 1e-15
    assert 0 < np.abs(capped - plain).max() <= bound


def test_causal_attention_with_scale_and_softcap_equals_gemma2_eager_attention_in_torch():
    """The training path's attention against transformers' Gemma 2 eager attention, written out in
    torch: scores q k^T times the scale (query_pre_attn_scalar^-1/2), divided by the cap, tanh,
    times the cap, then the causal or sliding-window mask, softmax, times the values; keys and
    values repeated to every query head of their group (repeat_kv). Gradients by autograd."""
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle; install the 'oracle' extra")
    rng = np.random.default_rng(6)
    b, h, g, t, d = 2, 4, 2, 6, 8
    q, k, v = (rng.standard_normal(s) for s in ((b, h, t, d), (b, g, t, d), (b, g, t, d)))
    do = rng.standard_normal((b, h, t, d))
    scaling, cap = 4.0**-0.5, 2.0  # query_pre_attn_scalar = 4, not the head width 8
    for window in (None, 3):
        o, cache = causal_attention_forward(q, k, v, "numpy", window, scaling, cap)
        grads = causal_attention_backward(do, cache)

        tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
        key, value = tk.repeat_interleave(h // g, dim=1), tv.repeat_interleave(h // g, dim=1)
        weights = torch.matmul(tq, key.transpose(2, 3)) * scaling
        weights = torch.tanh(weights / cap) * cap
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        allowed = (j <= i) if window is None else (j <= i) & (i - j < window)
        weights = weights + torch.where(allowed, 0.0, -torch.inf).to(weights.dtype)
        out = torch.matmul(torch.softmax(weights, dim=-1), value)
        out.backward(torch.tensor(do))
        np.testing.assert_allclose(o, out.detach().numpy(), rtol=1e-12, atol=1e-14)
        for name, got, want in zip("qkv", grads, (tq.grad, tk.grad, tv.grad)):
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-11, atol=1e-13,
                                       err_msg=f"window {window}: d{name}")


def test_the_cpu_backend_refuses_a_softcap_in_one_line():
    q = np.zeros((1, 2, 3, 4), dtype=np.float32)
    k = np.zeros((1, 1, 3, 4), dtype=np.float32)
    message = (r"^softcap = 50.0 is not supported on backend='cpu' \(the compiled kernels do not "
               r"cap scores\); use backend='numpy'$")
    with pytest.raises(ValueError, match=message):
        causal_attention_forward(q, k, k, backend="cpu", softcap=50.0)


@needs_cpu_kernels
def test_the_cpu_backend_applies_the_scale():
    rng = np.random.default_rng(7)
    q, k, v, do = (rng.standard_normal(s) for s in ((2, 4, 9, 8), (2, 2, 9, 8), (2, 2, 9, 8),
                                                    (2, 4, 9, 8)))
    scale = 0.7  # twice 1/sqrt(8): the kernel's default would give other weights
    f32 = [x.astype(np.float32) for x in (q, k, v, do)]
    for window in (None, 4):
        o64, cache64 = causal_attention_forward(q, k, v, "numpy", window, scale)
        o32, cache32 = causal_attention_forward(*f32[:3], "numpy", window, scale)
        o_cpu, cache_cpu = causal_attention_forward(*f32[:3], "cpu", window, scale)
        floor = 4 * 2.0**-24 * np.abs(o64).max()
        float32_rule(f"cpu o, window {window}", o_cpu, o64, o32, 2, floor)
        for name, g_cpu, g64, g32 in zip("qkv", causal_attention_backward(f32[3], cache_cpu),
                                         causal_attention_backward(do, cache64),
                                         causal_attention_backward(f32[3], cache32)):
            float32_rule(f"cpu d{name}, window {window}", g_cpu, g64, g32, 2,
                         4 * 2.0**-24 * np.abs(g64).max())


def test_a_bad_softcap_names_the_argument():
    q = np.ones((2, 3))
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match=r"softcap must be a finite number > 0, got"):
            sdpa_forward(q, q, q, softcap=bad)
    with pytest.raises(TypeError, match=r"softcap must be a number, got '50' of type str"):
        sdpa_forward(q, q, q, softcap="50")


# ---- masks (A12) -------------------------------------------------------------------------------

def test_causal_mask_aligns_queries_with_the_last_keys():
    tri = causal_mask(3)
    np.testing.assert_array_equal(tri == 0, np.tril(np.ones((3, 3), bool)))
    assert tri.dtype == np.float64 and causal_mask(3, dtype=np.float32).dtype == np.float32
    np.testing.assert_array_equal(causal_mask(1, 5), np.zeros((1, 5)))  # a decode step sees all
    offset = causal_mask(2, 4) == 0
    np.testing.assert_array_equal(offset, [[1, 1, 1, 0], [1, 1, 1, 1]])


def test_padding_mask_shape_and_an_empty_sequence():
    m = padding_mask([3, 1, 0], 4)
    assert m.shape == (3, 1, 1, 4)
    np.testing.assert_array_equal(m[:, 0, 0] == 0, [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 2, 5, 3)) for _ in range(3))
    o, _ = sdpa_forward(q, k[..., :4, :], v[..., :4, :], mask=m)
    np.testing.assert_array_equal(o[2], 0.0)  # a length-0 sequence attends to nothing


@PROPERTY
@given(st.integers(1, 40), st.integers(1, 45))
def test_a12_local_window_allows_exactly_the_window(t, w):
    allowed = local_window_mask(t, w) == 0
    i, j = np.indices((t, t))
    np.testing.assert_array_equal(allowed, (i - w + 1 <= j) & (j <= i))
    # O(T w) pairs: query i sees min(i + 1, w) keys.
    assert allowed.sum() == sum(min(i + 1, w) for i in range(t))
    assert allowed.sum() <= t * w
    if w >= t:
        np.testing.assert_array_equal(local_window_mask(t, w), causal_mask(t))


# ---- multi-head attention (A1, A6, A7, A9, A10) ------------------------------------------------

def test_a10_head_map():
    np.testing.assert_array_equal(gqa_head_map(8, 2), [0, 0, 0, 0, 1, 1, 1, 1])
    # The catalogue's 1-based pi(r) = 1 + floor((r - 1) / (h / g)), shifted to 0-based.
    for h, g in [(8, 2), (32, 8), (6, 3), (4, 4), (5, 1)]:
        one_based = [1 + (r - 1) // (h // g) for r in range(1, h + 1)]
        np.testing.assert_array_equal(gqa_head_map(h, g), np.array(one_based) - 1)
    np.testing.assert_array_equal(gqa_head_map(8, 8), np.arange(8))  # MHA: g = h
    np.testing.assert_array_equal(gqa_head_map(8, 1), np.zeros(8))  # MQA: g = 1
    with pytest.raises(ValueError, match=r"n_kv_heads g = 3 must divide n_heads h = 8"):
        gqa_head_map(8, 3)


@pytest.mark.parametrize("h, g, cross, biases", [
    (2, 2, False, True),  # MHA
    (4, 2, False, False),  # GQA
    (4, 1, False, True),  # MQA
    (4, 2, True, True),  # GQA cross-attention
])
def test_mha_equals_the_per_head_formula(h, g, cross, biases):
    rng = np.random.default_rng(h + g)
    batch, t, s, d, d_ctx, d_h = 2, 4, 3, 6, 5, 3
    x = rng.standard_normal((batch, t, d))
    context = rng.standard_normal((batch, s, d_ctx)) if cross else None
    params = _params(rng, d, h, g, d_h, d_ctx if cross else None, biases)
    mask = None if cross else causal_mask(t)
    y, cache = mha_forward(x, params, h, g, context=context, mask=mask)
    # A7: a cross-attention score matrix is (queries x context rows) per head.
    assert cache.attn.a.shape == (batch, h, t, s if cross else t)
    for b in range(batch):
        expected = _mha_by_loop(x[b], params, h, g, None if context is None else context[b],
                                0.0 if mask is None else mask)
        np.testing.assert_allclose(y[b], expected, rtol=1e-12, atol=1e-13)
    # Query heads that share a K/V head keep their own weights, so their attention differs.
    assert not np.allclose(cache.attn.a[:, 0], cache.attn.a[:, 1])


def test_a9_fused_projection_equals_three_projections():
    rng = np.random.default_rng(9)
    h, g, d, d_h = 4, 2, 6, 2
    x = rng.standard_normal((2, 5, d))
    params = _params(rng, d, h, g, d_h, biases=True)
    fused = {"w_qkv": np.concatenate([params["w_q"], params["w_k"], params["w_v"]], axis=1),
             "b_qkv": np.concatenate([params["b_q"], params["b_k"], params["b_v"]]),
             "w_o": params["w_o"], "b_o": params["b_o"]}
    assert fused["w_qkv"].shape == (d, (h + 2 * g) * d_h)
    y, cache = mha_forward(x, params, h, g, mask=causal_mask(5))
    y_fused, cache_fused = mha_forward(x, fused, h, g, mask=causal_mask(5))
    np.testing.assert_allclose(y_fused, y, rtol=0, atol=1e-12)
    dout = rng.standard_normal(y.shape)
    dx, grads = mha_backward(dout, cache)
    dx_fused, grads_fused = mha_backward(dout, cache_fused)
    assert set(grads_fused) == {"w_qkv", "b_qkv", "w_o", "b_o"}
    for fused_key, parts in (("w_qkv", ("w_q", "w_k", "w_v")), ("b_qkv", ("b_q", "b_k", "b_v"))):
        separate = np.concatenate([grads[p] for p in parts], axis=-1)
        np.testing.assert_allclose(grads_fused[fused_key], separate, rtol=0, atol=1e-12)
    for key in ("w_o", "b_o"):
        np.testing.assert_allclose(grads_fused[key], grads[key], rtol=0, atol=1e-12)
    np.testing.assert_allclose(dx_fused, dx, rtol=0, atol=1e-12)


def test_key_bias_has_zero_gradient():
    # b_k adds q_i . b_k to every score of row i; softmax ignores a shift of a whole row, so b_k
    # changes nothing (which is why the registered cases leave it out of the gradient check).
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 4, 6))
    params = _params(rng, 6, 4, 2, 3, biases=True)
    y, cache = mha_forward(x, params, 4, 2, mask=causal_mask(4))
    _, grads = mha_backward(rng.standard_normal(y.shape), cache)
    assert np.abs(grads["b_k"]).max() < 1e-13 * np.abs(grads["b_q"]).max()
    shifted = dict(params, b_k=params["b_k"] + 5.0)
    np.testing.assert_allclose(mha_forward(x, shifted, 4, 2, mask=causal_mask(4))[0], y, rtol=1e-12)


@PROPERTY
@given(st.integers(2, 6), st.integers(0, 5), st.sampled_from([(2, 2), (4, 2), (4, 1)]),
       st.integers(0, 2**32 - 1))
def test_causal_output_ignores_later_tokens(t, i, heads, seed):
    i = i % t
    h, g = heads
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, t, 5))
    params = _params(rng, 5, h, g, 2, biases=True)
    y, _ = mha_forward(x, params, h, g, mask=causal_mask(t))
    changed = x.copy()
    changed[:, i + 1:] = rng.standard_normal(changed[:, i + 1:].shape)
    y_changed, _ = mha_forward(changed, params, h, g, mask=causal_mask(t))
    # Hidden keys get weight exactly 0, so rows <= i see identical arithmetic up to reordering.
    np.testing.assert_allclose(y_changed[:, :i + 1], y[:, :i + 1], rtol=1e-14, atol=1e-14)


def test_unbatched_input_equals_a_batch_of_one():
    rng = np.random.default_rng(5)
    x, context = rng.standard_normal((3, 4)), rng.standard_normal((5, 2))
    params = _params(rng, 4, 2, 1, 3, d_ctx=2)
    y, cache = mha_forward(x, params, 2, 1, context=context)
    y_batched, cache_batched = mha_forward(x[None], params, 2, 1, context=context[None])
    assert y.shape == (3, 4)
    np.testing.assert_array_equal(y, y_batched[0])
    dout = rng.standard_normal(y.shape)
    dx, grads, dcontext = mha_backward(dout, cache)
    dx_b, grads_b, dcontext_b = mha_backward(dout[None], cache_batched)
    assert dx.shape == (3, 4) and dcontext.shape == (5, 2)
    np.testing.assert_allclose(dx, dx_b[0], rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(dcontext, dcontext_b[0], rtol=1e-15, atol=1e-15)
    for key in grads:
        np.testing.assert_allclose(grads[key], grads_b[key], rtol=1e-15, atol=1e-15)


# ---- bad input -----------------------------------------------------------------------------------

def test_sdpa_bad_input_names_the_argument():
    q, k, v = np.ones((2, 3)), np.ones((4, 3)), np.ones((4, 5))
    with pytest.raises(ValueError, match=r"q must have at least 2 dimensions.*\(3,\)"):
        sdpa_forward(np.ones(3), k, v)
    with pytest.raises(ValueError, match=r"k.shape\[-1\] must be 3.*k.shape = \(4, 2\)"):
        sdpa_forward(q, np.ones((4, 2)), v)
    with pytest.raises(ValueError, match=r"v.shape\[-2\] must be 4.*v.shape = \(3, 5\)"):
        sdpa_forward(q, k, np.ones((3, 5)))
    with pytest.raises(ValueError, match=r"q and k must have the same leading"):
        sdpa_forward(np.ones((2, 2, 3)), np.ones((3, 4, 3)), np.ones((3, 4, 5)))
    with pytest.raises(ValueError, match=r"mask with shape \(3, 4\) does not broadcast"):
        sdpa_forward(q, k, v, mask=np.zeros((3, 4)))
    with pytest.raises(ValueError, match=r"mask with shape \(5, 2, 4\) would enlarge"):
        sdpa_forward(q, k, v, mask=np.zeros((5, 2, 4)))
    with pytest.raises(ValueError, match=r"dropout_mask with shape \(2, 3\) does not broadcast"):
        sdpa_forward(q, k, v, dropout_mask=np.ones((2, 3)))
    with pytest.raises(TypeError, match=r"q must be a floating-point array.*int"):
        sdpa_forward(np.ones((2, 3), dtype=int), k, v)
    with pytest.raises(TypeError, match=r"v must be a floating-point array"):
        sdpa_forward(q, k, np.ones((4, 5), dtype=np.int32))
    with pytest.raises(TypeError, match=r"mask must be boolean .* or an additive float mask.*int"):
        sdpa_forward(q, k, v, mask=np.ones((2, 4), dtype=np.int64))


# ---- the two forms of a mask: boolean (True = may attend) and additive (0 / -inf) --------------

_BOTH_FORMS = (r"mask must be boolean \(True = may attend, as in PyTorch\) or an additive float "
               r"mask \(0 = may attend, -inf = may not\), got a float mask whose values are only 0 "
               r"and 1")


def test_a_boolean_mask_means_may_attend_as_in_pytorch():
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 2))
    visible = np.tril(np.ones((3, 5), bool), k=2)
    visible[0, 1] = False
    additive = np.where(visible, 0.0, -np.inf)
    o_add, _ = sdpa_forward(q, k, v, mask=additive)
    o_bool, cache = sdpa_forward(q, k, v, mask=visible)
    np.testing.assert_array_equal(o_bool, o_add)
    assert np.all(cache.a[:, ~visible] == 0)  # the False entries got no weight
    # The same through multi-head attention, and in float32 the boolean mask keeps float32.
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    params = {name: rng.standard_normal((8, 8)).astype(np.float32) for name in ("w_q", "w_k", "w_v", "w_o")}
    y_bool, _ = mha_forward(x, params, 2, mask=np.tril(np.ones((5, 5), bool)))
    y_add, _ = mha_forward(x, params, 2, mask=causal_mask(5, dtype=np.float32))
    assert y_bool.dtype == np.float32
    np.testing.assert_array_equal(y_bool, y_add)


def test_a_float_mask_of_zeros_and_ones_is_refused_naming_both_forms():
    # Added to the scores, 0/1 hides nothing: softmax ignores a uniform shift, and a 1 on the
    # visible keys only nudges them. Read as booleans by another library, it would hide the zeros.
    rng = np.random.default_rng(8)
    q = k = v = rng.standard_normal((3, 4))
    ones_below = np.tril(np.ones((3, 3)))
    for mask in (ones_below, ones_below.astype(np.float32), np.ones((3, 3))):
        with pytest.raises(ValueError, match=_BOTH_FORMS) as caught:
            sdpa_forward(q, k, v, mask=mask)
        assert "\n" not in str(caught.value)
    x = rng.standard_normal((1, 3, 4))
    params = {name: rng.standard_normal((4, 4)) for name in ("w_q", "w_k", "w_v", "w_o")}
    with pytest.raises(ValueError, match=_BOTH_FORMS):
        mha_forward(x, params, 2, mask=ones_below)
    cache = QuantizedKVCache(1, 8, 4)
    cache.append(0, rng.standard_normal((1, 1, 3, 4)), rng.standard_normal((1, 1, 3, 4)))
    with pytest.raises(ValueError, match=_BOTH_FORMS):
        decode_with_quantized_cache(rng.standard_normal((1, 2, 3, 4)), cache, 0, mask=ones_below)
    np.testing.assert_array_equal(  # and there a boolean mask means what the default causal one does
        decode_with_quantized_cache(q[None, None], cache, 0, mask=np.tril(np.ones((3, 3), bool))),
        decode_with_quantized_cache(q[None, None], cache, 0))
    # An additive mask of zeros (every key visible) stays valid: it holds no 1.
    np.testing.assert_array_equal(sdpa_forward(q, k, v, mask=np.zeros((3, 3)))[0], sdpa_forward(q, k, v)[0])


def test_mask_builders_reject_bad_sizes():
    with pytest.raises(ValueError, match=r"t_k must be at least t_q.*t_q = 4, t_k = 2"):
        causal_mask(4, 2)
    with pytest.raises(ValueError, match=r"t_q must be an int >= 1, got 0"):
        causal_mask(0)
    with pytest.raises(ValueError, match=r"window must be an int >= 1, got 0"):
        local_window_mask(5, 0)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 4\)"):
        padding_mask([2, 4], 3)
    with pytest.raises(TypeError, match=r"lengths must be an integer array"):
        padding_mask([2.0, 1.0], 3)


def test_mha_bad_input_names_the_argument():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 6))
    params = _params(rng, 6, 4, 2, 2)
    with pytest.raises(ValueError, match=r"n_kv_heads g = 3 must divide n_heads h = 4"):
        mha_forward(x, params, 4, 3)
    with pytest.raises(ValueError, match=r"x must have 2 or 3 dimensions.*\(6,\)"):
        mha_forward(np.ones(6), params, 4, 2)
    with pytest.raises(TypeError, match=r"x must be a floating-point array"):
        mha_forward(x.astype(int), params, 4, 2)
    with pytest.raises(TypeError, match=r"params\['w_k'\] must be a floating-point array"):
        mha_forward(x, dict(params, w_k=np.ones((6, 4), dtype=int)), 4, 2)
    with pytest.raises(ValueError, match=r"params is missing \['w_v'\]"):
        mha_forward(x, {k: p for k, p in params.items() if k != "w_v"}, 4, 2)
    with pytest.raises(ValueError, match=r"params has unexpected keys \['b_x'\]"):
        mha_forward(x, dict(params, b_x=np.zeros(6)), 4, 2)
    with pytest.raises(ValueError, match=r"params has unexpected keys \['w_q'\]"):
        mha_forward(x, {"w_qkv": np.ones((6, 16)), "w_o": params["w_o"], "w_q": params["w_q"]}, 4, 2)
    with pytest.raises(ValueError, match=r"params\['w_q'\] must have shape \(d, 4 \* d_h\)"):
        mha_forward(x, dict(params, w_q=np.ones((5, 8))), 4, 2)
    with pytest.raises(ValueError, match=r"params\['w_k'\] must have shape \(6, 4\)"):
        mha_forward(x, dict(params, w_k=np.ones((6, 8))), 4, 2)
    with pytest.raises(ValueError, match=r"params\['b_q'\] must have shape \(8,\)"):
        mha_forward(x, dict(params, b_q=np.ones(6)), 4, 2)
    with pytest.raises(ValueError, match=r"context.shape\[0\] must be 2"):
        mha_forward(x, params, 4, 2, context=np.ones((3, 4, 6)))
    with pytest.raises(ValueError, match=r"fused 'w_qkv' are for self-attention only"):
        mha_forward(x, {"w_qkv": np.ones((6, 16)), "w_o": params["w_o"]}, 4, 2, context=x)
    with pytest.raises(ValueError, match=r"mask with shape \(2, 3\) does not broadcast"):
        mha_forward(x, params, 4, 2, mask=np.zeros((2, 3)))
