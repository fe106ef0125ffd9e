import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refmath.gradcheck import check_case
from refmath.registry import OpCase
from refmath.positions import (
    learned_positions_backward,
    learned_positions_forward,
    rope_backward,
    rope_forward,
    sinusoidal_positions,
)

# ---- sinusoidal (N8) -----------------------------------------------------------------------------


def test_sinusoidal_table_values_n8():
    d = 16
    table = sinusoidal_positions(60, d)
    assert table.shape == (60, d) and table.dtype == np.float64
    # position 0: every angle is 0, so (sin, cos) pairs are (0, 1)
    np.testing.assert_array_equal(table[0], np.tile([0.0, 1.0], d // 2))
    # pair r = 0 has frequency 1: P[i, 0] = sin(i), P[i, 1] = cos(i)
    i = np.arange(60)
    np.testing.assert_allclose(table[:, 0], np.sin(i), rtol=0, atol=1e-15)
    np.testing.assert_allclose(table[:, 1], np.cos(i), rtol=0, atol=1e-15)
    # the formula itself at a few entries
    for pos, r in [(3, 1), (17, 5), (59, 7)]:
        angle = pos / 10000.0 ** (2 * r / d)
        assert table[pos, 2 * r] == pytest.approx(math.sin(angle), rel=0, abs=1e-15)
        assert table[pos, 2 * r + 1] == pytest.approx(math.cos(angle), rel=0, abs=1e-15)


def test_sinusoidal_dtype_and_bad_width():
    assert sinusoidal_positions(4, 6, dtype=np.float32).dtype == np.float32
    with pytest.raises(ValueError, match=r"d must be a positive even integer.*got 5"):
        sinusoidal_positions(4, 5)
    with pytest.raises(ValueError, match=r"t must be an int >= 0, got -1"):
        sinusoidal_positions(-1, 4)


# ---- learned positions (N9) ----------------------------------------------------------------------


def test_learned_positions_add_the_table_rows_from_the_offset_n9():
    rng = np.random.default_rng(0)
    x, table = rng.standard_normal((2, 3, 4)), rng.standard_normal((8, 4))
    y, cache = learned_positions_forward(x, table, offset=5)
    np.testing.assert_array_equal(y, x + table[5:8])
    dout = rng.standard_normal(y.shape)
    dx, dtable = learned_positions_backward(dout, cache)
    np.testing.assert_array_equal(dx, dout)
    np.testing.assert_array_equal(dtable[:5], 0.0)
    np.testing.assert_allclose(dtable[5:], dout[0] + dout[1], rtol=1e-15)


def test_learned_positions_past_the_table_raise():
    x, table = np.zeros((2, 3, 4)), np.zeros((8, 4))
    with pytest.raises(ValueError, match=r"positions 6..8.*x.shape = \(2, 3, 4\).*8 rows of table.*\(8, 4\)"):
        learned_positions_forward(x, table, offset=6)
    with pytest.raises(ValueError, match=r"table.shape\[1\] must equal x.shape\[-1\].*\(2, 3, 4\).*\(8, 5\)"):
        learned_positions_forward(x, np.zeros((8, 5)))
    with pytest.raises(ValueError, match=r"offset must be an int >= 0, got -1"):
        learned_positions_forward(x, table, offset=-1)


# ---- RoPE (N10) ----------------------------------------------------------------------------------


def test_rope_rotates_each_pair_counterclockwise_by_position_times_frequency_n10():
    # d_k = 2 has one pair with frequency 1, so position p rotates by p radians:
    # (1, 0) -> (cos p, sin p) and (0, 1) -> (-sin p, cos p), i.e. x R(p)^T for row vectors.
    p = np.arange(5)
    y, _ = rope_forward(np.tile([[1.0, 0.0]], (5, 1)))
    np.testing.assert_allclose(y, np.stack([np.cos(p), np.sin(p)], axis=1), rtol=0, atol=1e-15)
    y, _ = rope_forward(np.tile([[0.0, 1.0]], (5, 1)))
    np.testing.assert_allclose(y, np.stack([-np.sin(p), np.cos(p)], axis=1), rtol=0, atol=1e-15)
    # pair r of d_k = 8 turns by p * 10000^(-2r/8); the position-3 row of a unit first coordinate
    x = np.zeros((4, 8))
    x[:, 6] = 1.0  # r = 3
    y, _ = rope_forward(x)
    angle = 3 * 10000.0 ** (-6 / 8)
    np.testing.assert_allclose(y[3, 6:], [math.cos(angle), math.sin(angle)], rtol=1e-14)
    np.testing.assert_array_equal(y[3, :6], 0.0)


widths = st.integers(1, 8).map(lambda n: 2 * n)


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 6), d_k=widths, offset=st.integers(0, 5000), seed=st.integers(0, 2**32 - 1))
def test_rope_preserves_norms_n10(t, d_k, offset, seed):
    x = np.random.default_rng(seed).standard_normal((2, t, d_k))
    y, _ = rope_forward(x, offset=offset)
    # each pair is rotated, so each pair's length (and the row's) is unchanged
    pair_norms = lambda a: np.hypot(a[..., 0::2], a[..., 1::2])  # noqa: E731
    np.testing.assert_allclose(pair_norms(y), pair_norms(x), rtol=1e-13)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-13)


def _rotated(v, position):
    return rope_forward(v[None, :], positions=np.array([position]))[0][0]


@settings(max_examples=30, deadline=None)
@given(d_k=widths, i=st.integers(0, 2000), gap=st.integers(0, 2000), shift=st.integers(0, 2000),
       seed=st.integers(0, 2**32 - 1))
def test_rope_scores_depend_only_on_the_offset_n10(d_k, i, gap, shift, seed):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal(d_k), rng.standard_normal(d_k)
    j = i + gap
    score = _rotated(q, i) @ _rotated(k, j)
    # shifting both positions leaves the score unchanged
    shifted = _rotated(q, i + shift) @ _rotated(k, j + shift)
    scale = np.linalg.norm(q) * np.linalg.norm(k)
    # angles up to 6000 rad are rounded to ~6000 * 2^-53 ~ 7e-13 rad, so the bound is relative to
    # |q| |k| (the worst seen over 3000 draws was 7e-14 |q| |k|)
    assert abs(score - shifted) <= 1e-12 * scale
    # and equals q R((j - i) w) k^T: rotating k alone by the offset j - i
    assert abs(score - q @ _rotated(k, gap)) <= 1e-12 * scale


def test_rope_with_offset_on_a_slice_equals_the_full_sequence_sliced_n10():
    # decoding: the rows after a cached prefix of 6 tokens are rotated at positions 6..9
    x = np.random.default_rng(3).standard_normal((2, 3, 10, 8))
    full, _ = rope_forward(x)
    np.testing.assert_array_equal(rope_forward(x[..., 6:, :], offset=6)[0], full[..., 6:, :])
    np.testing.assert_array_equal(rope_forward(x[..., 6:, :], positions=np.arange(6, 10))[0], full[..., 6:, :])


def test_rope_backward_is_the_inverse_rotation_n10():
    x = np.random.default_rng(4).standard_normal((2, 5, 6))
    y, cache = rope_forward(x, offset=11, base=500.0)
    np.testing.assert_allclose(rope_backward(y, cache), x, rtol=1e-13, atol=1e-15)


def test_rope_bad_inputs_name_the_argument_and_shape():
    with pytest.raises(ValueError, match=r"x.shape\[-1\] \(d_k\) must be even.*x.shape = \(2, 3, 5\)"):
        rope_forward(np.zeros((2, 3, 5)))
    with pytest.raises(ValueError, match=r"x must have at least 2 dimensions"):
        rope_forward(np.zeros(4))
    with pytest.raises(TypeError, match=r"x must be a floating-point array"):
        rope_forward(np.zeros((3, 4), dtype=np.int32))
    with pytest.raises(ValueError, match=r"positions must have shape \(3,\).*\(3, 4\).*\(2,\)"):
        rope_forward(np.zeros((3, 4)), positions=np.array([0, 1]))
    with pytest.raises(TypeError, match=r"positions must be an integer array"):
        rope_forward(np.zeros((3, 4)), positions=np.array([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"either offset or positions"):
        rope_forward(np.zeros((3, 4)), offset=2, positions=np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"positions must be non-negative"):
        rope_forward(np.zeros((3, 4)), positions=np.array([-1, 0, 1]))


# ---- RoPE's two pair layouts ---------------------------------------------------------------------

def _half_from_interleaved(d):
    """perm with x_half = x_interleaved[..., perm]: half slot r holds interleaved 2r, and slot
    r + d/2 holds 2r + 1, so that each layout's pair r is the same two numbers."""
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


def test_half_layout_is_interleaved_up_to_a_fixed_permutation():
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 8))
    perm = _half_from_interleaved(8)
    interleaved, _ = rope_forward(x, offset=3, base=100.0)
    half, cache = rope_forward(x[..., perm], offset=3, base=100.0, layout="half")
    np.testing.assert_allclose(half, interleaved[..., perm], rtol=1e-14, atol=1e-15)
    # the backward is the inverse rotation in the same layout
    dout = np.random.default_rng(1).standard_normal(x.shape)
    dx = rope_backward(dout[..., perm], cache)
    _, cache_i = rope_forward(x, offset=3, base=100.0)
    np.testing.assert_allclose(dx, rope_backward(dout, cache_i)[..., perm], rtol=1e-14, atol=1e-15)
    with pytest.raises(ValueError, match="layout must be one of 'interleaved', 'half', got 'neox'"):
        rope_forward(x, layout="neox")


def test_half_layout_gradient():
    case = OpCase("rope", "half layout", ("N10",),
                  lambda rng: {"x": rng.standard_normal((2, 4, 6)), "offset": 2, "layout": "half"},
                  rope_forward, rope_backward, ("x",))
    result = check_case(case)
    assert result.passed, result.errors


# ---- context extension: rescaled frequencies (N13-N17) --------------------------------------------

from refmath.positions import (RopeScaling, rope_frequencies_change, rope_inv_freq,  # noqa: E402
                               rope_softmax_scale, yarn_mscale)

RULES = {
    "linear": dict(rope_type="linear", factor=4.0),
    "dynamic": dict(rope_type="dynamic", factor=4.0, original_max_seq_len=64),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_seq_len=64),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_seq_len=64, beta_fast=32.0,
                 beta_slow=1.0),
    "yarn-deepseek": dict(rope_type="yarn", factor=40.0, original_max_seq_len=64, mscale=0.707,
                          mscale_all_dim=0.707),
    "longrope": dict(rope_type="longrope", factor=4.0, original_max_seq_len=64,
                     short_factor=tuple(np.linspace(1, 2, 8)),
                     long_factor=tuple(np.linspace(1, 9, 8))),
}


def test_inv_freq_worked_example_n13_n15():
    omega, m = rope_inv_freq(4, 10000.0)
    np.testing.assert_allclose(omega, [1.0, 0.01], rtol=1e-15)
    assert m == 1.0
    np.testing.assert_allclose(rope_inv_freq(4, 10000.0, RULES["linear"])[0], [0.25, 0.0025],
                               rtol=1e-15)
    np.testing.assert_allclose(rope_inv_freq(4, 10000.0, RULES["llama3"])[0], [1.0, 0.00125],
                               rtol=1e-15)


def test_dynamic_ntk_is_plain_rope_up_to_the_trained_context_n14():
    omega = rope_inv_freq(16, 500.0)[0]
    for length in (None, 1, 64):
        np.testing.assert_array_equal(rope_inv_freq(16, 500.0, RULES["dynamic"], length)[0], omega)
    longer = rope_inv_freq(16, 500.0, RULES["dynamic"], 128)[0]
    assert longer[0] == omega[0] and np.all(longer[1:] < omega[1:])  # the fastest pair is kept
    # at length l: b' = b (s l / L - (s - 1))^(d / (d - 2)); at 128 = 2L with s = 4 that is 5
    np.testing.assert_allclose(longer, (500.0 * 5 ** (16 / 14)) ** -(np.arange(8) * 2 / 16),
                               rtol=1e-14)


def test_llama3_keeps_fast_pairs_divides_slow_pairs_and_blends_between_n15():
    omega = rope_inv_freq(64, 10000.0)[0]
    scaled = rope_inv_freq(64, 10000.0, RULES["llama3"])[0]
    wavelength = 2 * np.pi / omega
    fast, slow = wavelength < 64 / 4, wavelength > 64 / 1
    assert fast.any() and slow.any() and (~fast & ~slow).any()
    np.testing.assert_array_equal(scaled[fast], omega[fast])
    np.testing.assert_allclose(scaled[slow], omega[slow] / 8, rtol=1e-15)
    ratio = scaled[~fast & ~slow] / omega[~fast & ~slow]
    assert np.all((1 / 8 < ratio) & (ratio < 1)) and np.all(np.diff(ratio) < 0)


def test_yarn_ramp_endpoints_and_temperature_n16():
    d, base, L = 32, 10000.0, 64
    omega = rope_inv_freq(d, base)[0]
    scaled, m = rope_inv_freq(d, base, RULES["yarn"])
    turns = L * omega / (2 * np.pi)  # rotations of each pair over the trained context
    np.testing.assert_array_equal(scaled[turns > 32], omega[turns > 32])  # extrapolated
    np.testing.assert_allclose(scaled[turns < 1], omega[turns < 1] / 4, rtol=1e-15)  # interpolated
    assert m == pytest.approx(0.1 * math.log(4) + 1, rel=1e-15)
    # DeepSeek: mscale = mscale_all_dim cancels in m and moves into the softmax scale
    _, m_ds = rope_inv_freq(d, base, RULES["yarn-deepseek"])
    assert m_ds == 1.0
    assert rope_softmax_scale(d, RULES["yarn-deepseek"]) == pytest.approx(
        (0.1 * 0.707 * math.log(40) + 1) ** 2 / math.sqrt(d), rel=1e-15)
    assert rope_softmax_scale(d) == 1 / math.sqrt(d)
    assert yarn_mscale(1.0) == 1.0 and yarn_mscale(0.5, 3.0) == 1.0


def test_longrope_switches_factors_past_the_trained_context_n17():
    omega = rope_inv_freq(16, 10000.0)[0]
    short, m = rope_inv_freq(16, 10000.0, RULES["longrope"], seq_len=64)
    long, _ = rope_inv_freq(16, 10000.0, RULES["longrope"], seq_len=65)
    np.testing.assert_allclose(short, omega / np.linspace(1, 2, 8), rtol=1e-15)
    np.testing.assert_allclose(long, omega / np.linspace(1, 9, 8), rtol=1e-15)
    assert m == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)), rel=1e-15)


@pytest.mark.parametrize("rule", ["linear", "llama3", "yarn"])
def test_scaled_rope_scores_still_depend_only_on_the_offset(rule):
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((1, 16)), rng.standard_normal((1, 16))
    freq, m = rope_inv_freq(16, 10000.0, RULES[rule])

    def score(i, j):
        qi = rope_forward(q, positions=np.array([i]), inv_freq=freq, attention_factor=m)[0]
        kj = rope_forward(k, positions=np.array([j]), inv_freq=freq, attention_factor=m)[0]
        return float((qi @ kj.T)[0, 0])

    assert score(3, 10) == pytest.approx(score(103, 110), rel=1e-11)
    # the attention factor scales every score by m^2
    plain = rope_forward(q, inv_freq=freq)[0] @ rope_forward(k, inv_freq=freq)[0].T
    scaled = rope_forward(q, inv_freq=freq, attention_factor=m)[0] @ rope_forward(
        k, inv_freq=freq, attention_factor=m)[0].T
    np.testing.assert_allclose(scaled, m * m * plain, rtol=1e-14)


def test_inv_freq_of_the_plain_rule_is_rope_forwards_default():
    x = np.random.default_rng(0).standard_normal((2, 5, 8))
    default = rope_forward(x, offset=3, base=500.0)[0]
    given = rope_forward(x, offset=3, inv_freq=rope_inv_freq(8, 500.0)[0])[0]
    np.testing.assert_allclose(given, default, rtol=1e-14, atol=1e-15)


def test_a_length_dependent_rule_invalidates_cached_keys_k3():
    """The seed's rule: keys are cached rotated at their positions (K3), so a scaling rule that
    depends on the current length rotates the same key differently once the length grows."""
    dynamic = RopeScaling(**RULES["dynamic"])
    assert not rope_frequencies_change(dynamic, 10, 64)  # within L: the plain frequencies
    assert rope_frequencies_change(dynamic, 10, 65) and rope_frequencies_change(dynamic, 70, 71)
    assert rope_frequencies_change(RULES["longrope"], 64, 65)
    assert not rope_frequencies_change(RULES["longrope"], 65, 90)
    for rule in ("linear", "llama3", "yarn"):
        assert not rope_frequencies_change(RULES[rule], 10, 10_000)
    key = np.random.default_rng(1).standard_normal((1, 16))
    cached = rope_forward(key, positions=np.array([5]),
                          inv_freq=rope_inv_freq(16, 10000.0, dynamic, 64)[0])[0]
    recomputed = rope_forward(key, positions=np.array([5]),
                              inv_freq=rope_inv_freq(16, 10000.0, dynamic, 65)[0])[0]
    assert np.abs(cached - recomputed).max() > 1e-6


def test_bad_scaling_names_the_field():
    with pytest.raises(ValueError, match=r"rope_scaling.rope_type must be one of .*got 'ntk'"):
        RopeScaling(rope_type="ntk", factor=2.0)
    for factor in (0.0, -1.0):
        with pytest.raises(ValueError, match=r"rope_scaling.factor must be .*> 0.*got"):
            RopeScaling(rope_type="linear", factor=factor)
    with pytest.raises(ValueError, match="rope_scaling.original_max_seq_len"):
        RopeScaling(rope_type="yarn", factor=2.0)
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeScaling(rope_type="llama3", factor=8.0, original_max_seq_len=8, low_freq_factor=4.0,
                    high_freq_factor=1.0)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['scale'\]"):
        rope_inv_freq(8, scaling={"rope_type": "linear", "scale": 2.0})
    with pytest.raises(ValueError, match="long_factor has 8 entries; d_k = 8 needs 4"):
        rope_inv_freq(8, scaling=RULES["longrope"], seq_len=100)
    with pytest.raises(ValueError, match=r"inv_freq must have shape \(4,\)"):
        rope_forward(np.zeros((3, 8)), inv_freq=np.ones(3))
    with pytest.raises(ValueError, match="attention_factor"):
        rope_forward(np.zeros((3, 8)), attention_factor=0.0)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_inv_freq_equals_transformers(rule):
    """Hugging Face's rope initialisers (float32 there) give the same frequencies and factor."""
    pytest.importorskip("torch", reason="the comparison needs torch")
    transformers = pytest.importorskip("transformers", reason="the comparison needs transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = dict(RULES[rule])
    params = {"rope_type": fields.pop("rope_type"), "rope_theta": 10000.0, **fields}
    if "original_max_seq_len" in params:
        params["original_max_position_embeddings"] = params.pop("original_max_seq_len")
    for name in ("short_factor", "long_factor"):
        if name in params:
            params[name] = list(params[name])
    context = params.get("original_max_position_embeddings", 64)
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                      max_position_embeddings=context, rope_parameters=params)
    for seq_len in (context, 2 * context):
        theirs, m = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, seq_len=seq_len)
        ours, our_m = rope_inv_freq(16, 10000.0, RULES[rule], seq_len)
        np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=3e-7)
        assert our_m == pytest.approx(m, rel=1e-12)
