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
