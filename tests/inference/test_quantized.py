"""Quantised KV cache (catalogue K12): quantiser bounds, int4 packing, bytes, attention error bounds."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from refmath.attention import causal_mask, gqa_head_map, sdpa_forward
from refmath.inference.quantized import (
    QuantizedKVCache, QuantizedTensor, decode_with_quantized_cache, dequantize, pack_int4,
    q_max, quantize, unpack_int4,
)
from refmath.sizing import quantized_kv_cache_bytes

EPS = np.finfo(np.float64).eps
SCALE_DTYPES = [np.float16, np.float32]


def _attention(q, k, v, mask=None):
    return sdpa_forward(q, k, v, mask=mask)[0]


def _weights(q, k, mask=None):
    """Attention weights A = softmax(q k^T / sqrt(d) + M)."""
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s + mask
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


# ---- the quantiser ----------------------------------------------------------------------------------

def test_q_max_is_2_to_the_bits_minus_1_minus_1():
    assert q_max(8) == 127
    assert q_max(4) == 7


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), bits=st.sampled_from([4, 8]),
       groups=st.integers(1, 4), group_size=st.sampled_from([1, 2, 3, 8, 16]),
       rows=st.integers(1, 5), exponent=st.integers(-6, 3), scale_dtype=st.sampled_from(SCALE_DTYPES))
def test_round_trip_error_is_at_most_half_a_step(seed, bits, groups, group_size, rows, exponent,
                                                 scale_dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, groups * group_size)) * 10.0**exponent
    qt = quantize(x, bits, group_size, scale_dtype)
    step = qt.element_scales()
    codes = qt.codes()
    # The stored scale is rounded up, so no group needs more than q_max: nothing is clipped, and
    # each group's largest magnitude sits within one step of q_max.
    assert np.all(np.abs(codes) <= q_max(bits))
    assert np.all(step * q_max(bits) >= np.abs(x))
    # round() is off by at most 1/2, so |x - s c| <= s/2 in exact arithmetic. The only rounding is
    # in fl(x / s), off by at most eps/2 * |x / s|, which moves x - s c by at most eps/2 * |x|; the
    # product s c is exact in float64 (at most 24 + 7 significant bits).
    err = np.abs(x - dequantize(qt))
    assert np.all(err <= step / 2 + EPS * np.abs(x))
    assert qt.scales.dtype == scale_dtype and dequantize(qt).dtype == x.dtype


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_values_on_the_grid_round_trip_exactly(bits, scale_dtype):
    # x = s c with s a stored-dtype number and one code of magnitude q_max in each group: the
    # quantiser must recover s and c exactly.
    rng = np.random.default_rng(1)
    qm = q_max(bits)
    codes = rng.integers(-qm, qm + 1, size=(6, 4, 8))
    codes[..., 0] = rng.choice([-qm, qm], size=(6, 4))
    s = (rng.random((6, 4)) * 2.0**rng.integers(-12, 6, size=(6, 4))).astype(scale_dtype)
    x = (codes * s[..., None].astype(np.float64)).reshape(6, 32)
    qt = quantize(x, bits, 8, scale_dtype)
    np.testing.assert_array_equal(qt.codes(), codes.reshape(6, 32))
    np.testing.assert_array_equal(qt.scales, s)
    np.testing.assert_array_equal(dequantize(qt), x)


def test_zero_groups_dequantise_to_exactly_zero_without_dividing_by_zero():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 16))
    x[0, 4:8] = 0.0      # one zero group among non-zero ones
    x[2] = 0.0           # a whole zero row
    for bits in (4, 8):
        with np.errstate(all="raise"):  # a division by zero would raise here
            qt = quantize(x, bits, 4)
            y = dequantize(qt)
        assert qt.scales[0, 1] == 0 and np.all(qt.scales[2] == 0)
        assert np.all(qt.codes()[0, 4:8] == 0) and np.all(qt.codes()[2] == 0)
        assert np.all(y[0, 4:8] == 0.0) and np.all(y[2] == 0.0)
        assert np.all(qt.scales[x.reshape(3, 4, 4).any(axis=-1)] > 0)
    np.testing.assert_array_equal(dequantize(quantize(np.zeros((2, 8)), 4, 8)), np.zeros((2, 8)))


def test_tiny_non_zero_group_keeps_a_positive_float16_scale():
    # max|x| / 127 underflows float16; rounding the scale up keeps it positive, so the bound holds.
    x = np.array([1e-12, -3e-13, 0.0, 2e-12])
    qt = quantize(x, 8, 4, np.float16)
    assert qt.scales[0] == np.finfo(np.float16).smallest_subnormal
    assert np.all(np.abs(x - dequantize(qt)) <= qt.element_scales() / 2)


def test_dtype_is_preserved():
    x = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)
    for bits in (4, 8):
        y = dequantize(quantize(x, bits, 4))
        assert y.dtype == np.float32
        # With float16 scales s c is exact in float32 (11 + 7 significant bits), so the float32
        # result equals the float64 one bit for bit.
        qt = quantize(x, bits, 4)
        np.testing.assert_array_equal(y, qt.codes() * qt.element_scales())


def test_int8_error_is_smaller_than_int4_error_on_the_same_data():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 128))
    q8, q4 = quantize(x, 8, 32), quantize(x, 4, 32)
    err8, err4 = np.abs(x - dequantize(q8)), np.abs(x - dequantize(q4))
    # Same groups, same max|x|: the steps differ by q_max(8) / q_max(4) = 127 / 7, up to the
    # float16 rounding (relative 2^-10 each way) of each scale.
    ratio = q4.scales.astype(np.float64) / q8.scales.astype(np.float64)
    np.testing.assert_allclose(ratio, 127 / 7, rtol=2 * 2.0**-10)
    # Worst case of int8 (s8/2) is below the typical int4 error (about s4/sqrt(12) = 5.2 s8).
    assert err8.max() <= q8.element_scales().max() / 2 < np.sqrt(np.mean(err4**2))
    assert np.sqrt(np.mean(err8**2)) < np.sqrt(np.mean(err4**2)) / 10


def test_quantize_rejects_bad_input_with_names():
    x = np.ones((2, 8))
    for bits in (3, 16, 0):
        with pytest.raises(ValueError, match=rf"bits must be one of 4, 8, got {bits}"):
            quantize(x, bits, 4)
    for bits in (True, 8.0, "8"):
        with pytest.raises(TypeError, match=r"bits must be an int, got"):
            quantize(x, bits, 4)
    with pytest.raises(ValueError, match=r"group_size = 3 must divide head_dim = 8"):
        quantize(x, 8, 3)
    for group_size in (0, -4):
        with pytest.raises(ValueError, match=rf"group_size must be an int >= 1, got {group_size}"):
            quantize(x, 8, group_size)
    with pytest.raises(TypeError, match=r"group_size must be an int, got 2.0"):
        quantize(x, 8, 2.0)
    with pytest.raises(TypeError, match=r"x must be a floating-point array.*int64"):
        quantize(np.ones((2, 8), dtype=np.int64), 8, 4)
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize(x, 8, 4, np.float64)
    with pytest.raises(ValueError, match="finite"):
        quantize(np.array([1.0, np.nan]), 8, 2)
    with pytest.raises(ValueError, match="overflows float16"):
        quantize(np.array([1e8, 1.0]), 8, 2)
    assert quantize(np.array([1e8, 1.0]), 8, 2, np.float32).scales.dtype == np.float32
    with pytest.raises(ValueError, match=r"x must have at least 1 dimensions"):
        quantize(np.float64(1.0), 8, 1)
    with pytest.raises(TypeError, match="QuantizedTensor"):
        dequantize(x)


# ---- int4 packing -----------------------------------------------------------------------------------

def test_int4_packing_round_trips_every_code_in_every_position():
    values = list(range(-7, 8))
    pairs = np.array(list(itertools.product(values, values)), dtype=np.int8)  # (225, 2)
    packed = pack_int4(pairs)
    assert packed.dtype == np.uint8 and packed.shape == (225, 1)
    np.testing.assert_array_equal(unpack_int4(packed, 2), pairs)
    # -8 has a nibble too (the quantiser never makes it: it is symmetric).
    np.testing.assert_array_equal(unpack_int4(pack_int4(np.int8([-8, 7])), 2), [-8, 7])


def test_int4_layout_is_low_nibble_first_twos_complement():
    # -7 = 0b1001 in the low nibble, 3 = 0b0011 in the high one.
    np.testing.assert_array_equal(pack_int4(np.int8([-7, 3])), np.uint8([0x39]))
    np.testing.assert_array_equal(pack_int4(np.int8([-1, 0])), np.uint8([0x0F]))
    # An odd row gets a zero high nibble in its last byte.
    np.testing.assert_array_equal(pack_int4(np.int8([1, 2, 3])), np.uint8([0x21, 0x03]))
    np.testing.assert_array_equal(unpack_int4(np.uint8([0x21, 0x03]), 3), [1, 2, 3])


def test_int4_packing_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(np.array([8, 0]))
    with pytest.raises(TypeError, match="codes must be an integer array"):
        pack_int4(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="packed must be a uint8 array"):
        unpack_int4(np.int8([1]), 2)
    with pytest.raises(ValueError, match=r"packed.shape\[-1\] must be 2"):
        unpack_int4(np.uint8([1]), 4)


# ---- bytes (K12 closed form) --------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype, scale_bytes", [(np.float16, 2), (np.float32, 4)])
@pytest.mark.parametrize("group_size", [4, 8, 16])
def test_cache_bytes_equal_the_closed_form(bits, scale_dtype, scale_bytes, group_size):
    batch, layers, kv_heads, head_dim = 2, 3, 2, 16
    rng = np.random.default_rng(5)
    cache = QuantizedKVCache(layers, bits, group_size, scale_dtype)
    for chunk in (3, 1, 2):  # a prefill and two decode-sized appends: T = 6
        for layer in range(layers):
            cache.append(layer, rng.standard_normal((batch, kv_heads, chunk, head_dim)),
                         rng.standard_normal((batch, kv_heads, chunk, head_dim)))
    expected = quantized_kv_cache_bytes(batch, layers, 6, kv_heads, head_dim, bits, group_size,
                                        scale_bytes)
    assert (cache.payload_bytes, cache.scale_bytes, cache.nbytes) == tuple(expected)
    # One tensor: d q / 8 payload bytes and d / G scales per row.
    qt = cache.quantized_keys(0)
    assert qt.payload_bytes == batch * kv_heads * 6 * head_dim * bits // 8
    assert qt.scale_bytes == batch * kv_heads * 6 * (head_dim // group_size) * scale_bytes
    assert qt.nbytes == qt.payload_bytes + qt.scale_bytes


# ---- error bounds on scores and outputs -----------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [4, 16])
def test_score_error_from_quantised_keys_is_bounded(bits, group_size):
    # S_ij = q_i . k_j / sqrt(d), so dS_ij = q_i . dk_j / sqrt(d), and elementwise
    #   |dS_ij| <= sum_u |q_iu| |dk_ju| / sqrt(d) <= sum_u |q_iu| (s_ju / 2) / sqrt(d)
    # with s_ju the step of k_ju's group.
    rng = np.random.default_rng(6)
    d = 16
    q, k = rng.standard_normal((2, 3, 5, d)), rng.standard_normal((2, 3, 9, d))
    k[..., 3] *= 20.0  # an outlier channel, as real keys have
    qt = quantize(k, bits, group_size)
    dk = dequantize(qt) - k
    ds = (q @ np.swapaxes(dequantize(qt), -1, -2) - q @ np.swapaxes(k, -1, -2)) / math.sqrt(d)
    by_error = np.abs(q) @ np.swapaxes(np.abs(dk), -1, -2) / math.sqrt(d)
    by_steps = np.abs(q) @ np.swapaxes(qt.element_scales() / 2, -1, -2) / math.sqrt(d)
    # Slack for the two float64 matmuls: each is off by at most d eps sum_u |q_iu| |k_ju|.
    rounding = 2 * d * EPS * (np.abs(q) @ np.swapaxes(np.abs(k) + np.abs(dk), -1, -2))
    assert np.all(np.abs(ds) <= by_error + rounding)
    assert np.all(by_error <= by_steps * (1 + 4 * d * EPS) + rounding)
    assert np.abs(ds).max() > 0  # the test compares something non-trivial


@pytest.mark.parametrize("bits", [4, 8])
def test_output_error_from_quantised_values_is_bounded(bits):
    # With exact keys the weights A are unchanged, so dO = A dV and, elementwise,
    #   |dO_iu| <= sum_j A_ij |dV_ju| <= sum_j A_ij s_ju / 2 <= max_j s_ju / 2
    # (each row of A is a convex combination).
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 2, t, 8)) for t in (4, 6, 6))
    qt = quantize(v, bits, 4)
    a = _weights(q, k)
    d_out = _attention(q, k, dequantize(qt)) - _attention(q, k, v)
    step = qt.element_scales()
    rounding = 8 * 6 * EPS * (a @ (np.abs(v) + step))
    assert np.all(np.abs(d_out) <= a @ (step / 2) + rounding)
    assert np.all(np.abs(d_out) <= step.max(axis=-2, keepdims=True) / 2 + rounding.max())
    assert np.abs(d_out).max() > 0


def _decode_bound(q, k, v, qk, qv, heads, mask):
    """Elementwise bound on |O' - O| when both K and V are quantised.

    If every score moves by at most eps_i in row i, each weight moves by a factor in
    [e^{-2 eps_i}, e^{2 eps_i}] (numerator and normaliser each by at most e^{eps_i}), so
    |A'_ij - A_ij| <= (e^{2 eps_i} - 1) A_ij and A'_ij <= e^{2 eps_i} A_ij. Then
    O' - O = sum_j (A'_ij - A_ij) v_j + sum_j A'_ij (v'_j - v_j) gives
    |O' - O| <= (e^{2 eps_i} - 1) A |V| + e^{2 eps_i} A (s_V / 2).
    """
    d = q.shape[-1]
    k, v = k[:, heads], v[:, heads]
    step_k, step_v = qk.element_scales()[:, heads], qv.element_scales()[:, heads]
    eps_row = (np.abs(q) @ np.swapaxes(step_k / 2, -1, -2) / math.sqrt(d)).max(axis=-1, keepdims=True)
    a = _weights(q, k, mask)
    grow = np.expm1(2 * eps_row)
    return grow * (a @ np.abs(v)) + (1 + grow) * (a @ (step_v / 2)), _attention(q, k, v, mask)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("t_q", [1, 3])
def test_decode_error_with_quantised_keys_and_values_is_bounded(bits, t_q):
    rng = np.random.default_rng(8)
    batch, h, g, d, t = 2, 4, 2, 8, 7
    k, v = rng.standard_normal((batch, g, t, d)), rng.standard_normal((batch, g, t, d))
    cache = QuantizedKVCache(1, bits, 4)
    cache.append(0, k[:, :, :4], v[:, :, :4])
    cache.append(0, k[:, :, 4:], v[:, :, 4:])
    q = rng.standard_normal((batch, h, t_q, d))
    out = decode_with_quantized_cache(q, cache, 0)
    mask = causal_mask(t_q, t)
    bound, exact = _decode_bound(q, k, v, cache.quantized_keys(0), cache.quantized_values(0),
                                 gqa_head_map(h, g), mask)
    err = np.abs(out - exact)
    assert np.all(err <= bound * (1 + 1e-9) + 1e-14)
    assert err.max() > 0
    print(f"\n{bits}-bit decode, t_q={t_q}: worst error is {np.max(err / bound):.3f} of its bound")


def test_int8_scores_and_outputs_are_closer_than_int4():
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((1, 4, t, 64)) for t in (8, 128, 128))
    exact_s, exact_o = q @ np.swapaxes(k, -1, -2), _attention(q, k, v)
    errors = {}
    for bits in (8, 4):
        kh, vh = dequantize(quantize(k, bits, 32)), dequantize(quantize(v, bits, 32))
        errors[bits] = (np.linalg.norm(q @ np.swapaxes(kh, -1, -2) - exact_s),
                        np.linalg.norm(_attention(q, kh, vh) - exact_o))
    assert errors[8][0] < errors[4][0] and errors[8][1] < errors[4][1]


# ---- the cache --------------------------------------------------------------------------------------

def test_appending_in_chunks_equals_quantising_all_tokens_at_once():
    # Groups lie along d_h, so each token is quantised on its own and appends commute with quantize.
    rng = np.random.default_rng(10)
    k, v = rng.standard_normal((2, 3, 6, 8)), rng.standard_normal((2, 3, 6, 4))
    for bits in (4, 8):
        cache = QuantizedKVCache(2, bits, 4)
        for lo, hi in ((0, 2), (2, 3), (3, 6)):
            cache.append(1, k[:, :, lo:hi], v[:, :, lo:hi])
        whole_k, whole_v = quantize(k, bits, 4), quantize(v, bits, 4)
        np.testing.assert_array_equal(cache.quantized_keys(1).data, whole_k.data)
        np.testing.assert_array_equal(cache.quantized_values(1).scales, whole_v.scales)
        np.testing.assert_array_equal(cache.keys(1), dequantize(whole_k))
        np.testing.assert_array_equal(cache.values(1), dequantize(whole_v))
        assert cache.length(1) == 6 and cache.length(0) == 0


def test_decode_matches_sdpa_on_the_dequantised_cache_and_keeps_float32():
    rng = np.random.default_rng(11)
    k = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    cache = QuantizedKVCache(1, 8, 8)
    cache.append(0, k, v)
    out = decode_with_quantized_cache(q, cache, 0)
    heads = gqa_head_map(4, 2)
    expected = _attention(q, cache.keys(0)[:, heads], cache.values(0)[:, heads])
    assert out.dtype == np.float32 and out.shape == (1, 4, 1, 8)
    np.testing.assert_array_equal(out, expected)


def test_cache_rejects_bad_input_with_names():
    cache = QuantizedKVCache(2, 4, 4)
    with pytest.raises(ValueError, match="holds no keys"):
        cache.keys(0)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 1\], got 2"):
        cache.append(2, np.ones((1, 1, 1, 4)), np.ones((1, 1, 1, 4)))
    with pytest.raises(ValueError, match=r"k must have 4 dimensions"):
        cache.append(0, np.ones((1, 1, 4)), np.ones((1, 1, 1, 4)))
    with pytest.raises(ValueError, match="k and v must agree"):
        cache.append(0, np.ones((1, 1, 2, 4)), np.ones((1, 1, 1, 4)))
    with pytest.raises(ValueError, match="group_size = 4 must divide head_dim = 6"):
        cache.append(0, np.ones((1, 1, 1, 6)), np.ones((1, 1, 1, 6)))
    cache.append(0, np.ones((1, 2, 1, 4)), np.ones((1, 2, 1, 4)))
    with pytest.raises(ValueError, match="must match them in B, g and width"):
        cache.append(0, np.ones((1, 1, 1, 4)), np.ones((1, 1, 1, 4)))
    with pytest.raises(ValueError, match=r"g = 2 key/value heads must divide q's h = 3"):
        decode_with_quantized_cache(np.ones((1, 3, 1, 4)), cache, 0)
    with pytest.raises(ValueError, match=r"q.shape\[3\] must be 4"):
        decode_with_quantized_cache(np.ones((1, 2, 1, 5)), cache, 0)
    with pytest.raises(ValueError, match="t_k must be at least t_q"):
        decode_with_quantized_cache(np.ones((1, 2, 2, 4)), cache, 0)
    for bad in ({"bits": 2}, {"group_size": 0}, {"scale_dtype": np.int8}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            QuantizedKVCache(1, **bad)
    with pytest.raises(ValueError, match="n_layers"):
        QuantizedKVCache(0)
    assert isinstance(cache.quantized_keys(0), QuantizedTensor)
