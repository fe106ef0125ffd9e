"""FlashAttention in NumPy against dense attention: values, logsumexp, gradients, tile counts and
temporary sizes (F1-F5, A12).

The reference is the dense float64 path: the full score matrix with an additive mask built here
from the index rule, :func:`sdpa_forward`/:func:`sdpa_backward` on the key/value heads repeated to
every query head, and the repeated heads' gradients added back into their shared head.
"""
import dataclasses
import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refmath.attention import (
    causal_mask,
    gqa_head_map,
    local_window_mask,
    sdpa_backward,
    sdpa_forward,
)
from refmath.flash import (
    FlashCounters,
    attention_memory_traffic,
    flash_attention_backward,
    flash_attention_forward,
)
from refmath.softmax import OnlineSoftmaxState, online_softmax_merge, online_softmax_result
from _support import float32_rule, visible

PROPERTY = settings(max_examples=30, deadline=None)
U32 = 2.0**-24  # unit roundoff of float32


# ---- the dense reference ------------------------------------------------------------------------

def _dense(q, k, v, do, causal=False, window=None, scale=None, softcap=None):
    """Return (o, lse, dq, dk, dv) by dense attention with repeated key/value heads; with a
    ``softcap`` c the scores are c tanh(s / c) before the mask (sdpa_forward's order)."""
    h, g, t_q, t_k = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = np.where(visible(t_q, t_k, causal, window), 0.0, -np.inf)
    heads = gqa_head_map(h, g)
    o, cache = sdpa_forward(q, k[:, heads], v[:, heads], mask=mask, scale=scale, softcap=softcap)
    dq, dk_rep, dv_rep = sdpa_backward(do, cache)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for r in range(h):  # each query head's gradient goes to the key/value head it read
        dk[:, heads[r]] += dk_rep[:, r]
        dv[:, heads[r]] += dv_rep[:, r]
    scores = (q @ np.swapaxes(k[:, heads], -1, -2)) * scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    lse = np.logaddexp.reduce(scores + mask, axis=-1)  # -inf for a row of -inf
    return o, lse, dq, dk, dv


def _inputs(seed, b, h, g, t_q, t_k, d, d_v=None, dtype=np.float64):
    rng = np.random.default_rng(seed)
    d_v = d if d_v is None else d_v
    q = rng.standard_normal((b, h, t_q, d))
    k = rng.standard_normal((b, g, t_k, d))
    v = rng.standard_normal((b, g, t_k, d_v))
    do = rng.standard_normal((b, h, t_q, d_v))
    return tuple(x.astype(dtype) for x in (q, k, v, do))


def _flash(q, k, v, do, counters=None, **options):
    o, lse = flash_attention_forward(q, k, v, counters=counters, **options)
    return (o, lse) + flash_attention_backward(do, q, k, v, o, lse, counters=counters, **options)


def _assert_close(actual, expected, label):
    """float64 rounding level: relative 1e-12, with an absolute floor of 1e-12 of the largest
    entry for entries that cancel to near 0 (summation orders differ between the two paths)."""
    assert actual.shape == expected.shape, label
    assert not np.isnan(actual).any(), label
    floor = 1e-12 * max(1.0, np.abs(expected).max(initial=0.0))
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=floor, err_msg=label)


def _assert_lse(lse, expected):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected))
    live = np.isfinite(expected)
    np.testing.assert_allclose(lse[live], expected[live], rtol=1e-12, atol=1e-12)


def test_reference_mask_is_the_library_mask():
    for t_q, t_k in ((5, 5), (3, 7), (1, 4)):
        np.testing.assert_array_equal(np.where(visible(t_q, t_k, causal=True), 0.0, -np.inf),
                                      causal_mask(t_q, t_k))
    for w in (1, 3, 9):
        np.testing.assert_array_equal(np.where(visible(7, 7, window=w), 0.0, -np.inf),
                                      local_window_mask(7, w))


# ---- equal to dense attention (F1-F4, A10, A12) -------------------------------------------------

# (B, H, G, T_q, T_k, D, D_v, block_q, block_k)
SHAPES = [
    (2, 4, 2, 37, 37, 5, 5, 8, 16),  # GQA, T not a multiple of either block
    (1, 4, 1, 37, 37, 3, 4, 16, 8),  # MQA, D_v != D
    (2, 2, 2, 1, 1, 4, 4, 16, 16),  # T = 1
    (1, 2, 2, 5, 23, 4, 6, 4, 8),  # T_q < T_k: a chunk of queries after a prefix
    (1, 2, 1, 1, 19, 4, 4, 8, 8),  # one decode step
    (1, 2, 2, 20, 9, 3, 3, 8, 4),  # T_q > T_k: under a mask the first 11 queries see nothing
]
MASKS = [(False, None), (True, None), (False, 1), (False, 5), (True, 100)]


@pytest.mark.parametrize("causal, window", MASKS)
@pytest.mark.parametrize("shape", SHAPES,
                         ids=lambda s: "B{}H{}G{}Tq{}Tk{}D{}Dv{}bq{}bk{}".format(*s))
def test_flash_equals_dense(shape, causal, window):
    b, h, g, t_q, t_k, d, d_v, block_q, block_k = shape
    q, k, v, do = _inputs(sum(shape), b, h, g, t_q, t_k, d, d_v)
    options = dict(causal=causal, window=window, block_q=block_q, block_k=block_k)
    o, lse, dq, dk, dv = _flash(q, k, v, do, **options)
    ref_o, ref_lse, ref_dq, ref_dk, ref_dv = _dense(q, k, v, do, causal, window)
    for name, actual, expected in (("o", o, ref_o), ("dq", dq, ref_dq), ("dk", dk, ref_dk),
                                   ("dv", dv, ref_dv)):
        _assert_close(actual, expected, name)
    _assert_lse(lse, ref_lse)


def test_explicit_scale():
    q, k, v, do = _inputs(1, 1, 2, 1, 9, 9, 3)
    got = _flash(q, k, v, do, causal=True, scale=0.37, block_q=4, block_k=4)
    for name, actual, expected in zip(("o", "lse", "dq", "dk", "dv"), got,
                                      _dense(q, k, v, do, causal=True, scale=0.37)):
        _assert_close(actual, expected, name)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, 5)])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[5]],
                         ids=lambda s: "B{}H{}G{}Tq{}Tk{}D{}Dv{}bq{}bk{}".format(*s))
def test_flash_with_a_softcap_equals_dense_n19(shape, causal, window):
    # Scores of std about 1 against a cap of 1: most of them in tanh's bend, where a tile that
    # capped after masking, or a backward without the cap's slope, would be far off.
    b, h, g, t_q, t_k, d, d_v, block_q, block_k = shape
    q, k, v, do = _inputs(sum(shape) + 1, b, h, g, t_q, t_k, d, d_v)
    options = dict(causal=causal, window=window, block_q=block_q, block_k=block_k)
    got = _flash(q, k, v, do, softcap=1.0, **options)
    want = _dense(q, k, v, do, causal, window, softcap=1.0)
    for name, actual, expected in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        if name == "lse":
            _assert_lse(actual, expected)
        else:
            _assert_close(actual, expected, name)
    # the cap is in effect: without it the output differs by far more than rounding
    assert np.abs(got[0] - _dense(q, k, v, do, causal, window)[0]).max() > 1e-3


@PROPERTY
@given(
    b=st.integers(1, 2), g=st.integers(1, 2), per_group=st.integers(1, 3),
    t_q=st.integers(1, 20), t_k=st.integers(1, 20), d=st.integers(1, 4),
    block_q=st.integers(1, 9), block_k=st.integers(1, 9),
    mask=st.sampled_from([(False, None), (True, None), (False, 1), (False, 3), (False, 8)]),
    seed=st.integers(0, 2**16),
)
def test_flash_equals_dense_property(b, g, per_group, t_q, t_k, d, block_q, block_k, mask, seed):
    causal, window = mask
    q, k, v, do = _inputs(seed, b, g * per_group, g, t_q, t_k, d)
    options = dict(causal=causal, window=window, block_q=block_q, block_k=block_k)
    forward, backward = FlashCounters(), FlashCounters()
    o, lse = flash_attention_forward(q, k, v, counters=forward, **options)
    grads = flash_attention_backward(do, q, k, v, o, lse, counters=backward, **options)
    ref_o, ref_lse, *ref_grads = _dense(q, k, v, do, causal, window)
    _assert_close(o, ref_o, "o")
    _assert_lse(lse, ref_lse)
    for name, actual, expected in zip(("dq", "dk", "dv"), grads, ref_grads):
        _assert_close(actual, expected, name)
    # Both passes visit exactly the tiles that hold a visible pair (see _tile_census below).
    census = _tile_census(t_q, t_k, block_q, block_k, causal, window)
    for counters in (forward, backward):
        assert (counters.score_pairs, counters.tiles_computed, counters.tiles_skipped) == census


def test_fully_masked_rows_give_zeros_not_nan():
    # T_q = 12 queries over T_k = 5 keys, aligned to the end: queries 0..6 sit before key 0.
    q, k, v, do = _inputs(3, 1, 4, 2, 12, 5, 3)
    for window in (None, 2):
        o, lse, dq, dk, dv = _flash(q, k, v, do, causal=True, window=window, block_q=4, block_k=2)
        for x in (o, lse, dq, dk, dv):
            assert not np.isnan(x).any()
        assert np.all(np.isneginf(lse[:, :, :7])) and np.all(np.isfinite(lse[:, :, 7:]))
        assert np.all(o[:, :, :7] == 0.0) and np.all(dq[:, :, :7] == 0.0)
        assert np.all(np.abs(o[:, :, 7:]).sum(axis=-1) > 0)
        ref_o, ref_lse, ref_dq, ref_dk, ref_dv = _dense(q, k, v, do, True, window)
        _assert_lse(lse, ref_lse)
        for name, actual, expected in (("o", o, ref_o), ("dq", dq, ref_dq), ("dk", dk, ref_dk),
                                       ("dv", dv, ref_dv)):
            _assert_close(actual, expected, name)


# ---- the merge is exact and order-free (F3) ------------------------------------------------------

def test_key_tiles_merged_in_any_order_give_the_same_output():
    """Split the keys into tiles, run flash on each tile alone (a "split-K" pass), and merge.

    A tile's (o_t, lse_t) is the state m = lse_t, l = 1, u = o_t: it has the same l e^m and
    u e^m as (m_t, l_t, u_t), which is all that a merge sees. Merged in any order, the tiles must
    give the one-pass output, and the logsumexp must come back too.
    """
    q, k, v, do = _inputs(5, 2, 4, 2, 11, 29, 4)
    whole_o, whole_lse = flash_attention_forward(q, k, v, block_q=4, block_k=8)
    cuts = [0, 3, 8, 16, 17, 29]
    states = []
    for j0, j1 in zip(cuts, cuts[1:]):
        o_t, lse_t = flash_attention_forward(q, k[:, :, j0:j1], v[:, :, j0:j1], block_q=4,
                                             block_k=8)
        states.append(OnlineSoftmaxState(lse_t, np.ones_like(lse_t), o_t))
    rng = np.random.default_rng(0)
    for _ in range(4):
        order = rng.permutation(len(states))
        merged = states[order[0]]
        for t in order[1:]:
            merged = online_softmax_merge(merged, states[t])
        _assert_close(online_softmax_result(merged), whole_o, f"order {order}")
        _assert_close(merged.m + np.log(merged.l), whole_lse, f"lse, order {order}")


def test_permuting_the_keys_changes_nothing():
    # Without a mask, attention does not depend on the order of the keys; a permutation puts other
    # keys together in each tile and merges the tiles in another order.
    q, k, v, do = _inputs(6, 1, 2, 2, 10, 21, 3)
    perm = np.random.default_rng(1).permutation(21)
    o, lse, dq, dk, dv = _flash(q, k, v, do, block_q=4, block_k=4)
    o_p, lse_p, dq_p, dk_p, dv_p = _flash(q, k[:, :, perm], v[:, :, perm], do, block_q=4,
                                          block_k=4)
    _assert_close(o_p, o, "o")
    _assert_close(lse_p, lse, "lse")
    _assert_close(dq_p, dq, "dq")
    _assert_close(dk_p, dk[:, :, perm], "dk")
    _assert_close(dv_p, dv[:, :, perm], "dv")


# ---- what the tiles cost (F5, A12) ---------------------------------------------------------------

def _tile_census(t_q, t_k, block_q, block_k, causal=False, window=None):
    """(pairs, tiles with a visible pair, tiles with none) read off the dense mask, tile by tile."""
    keep = visible(t_q, t_k, causal, window)
    pairs = computed = skipped = 0
    for i0 in range(0, t_q, block_q):
        for j0 in range(0, t_k, block_k):
            tile = keep[i0:i0 + block_q, j0:j0 + block_k]
            if tile.any():
                computed += 1
                pairs += tile.size
            else:
                skipped += 1
    return pairs, computed, skipped


def _counts(t_q, t_k, pass_, block_q=16, block_k=16, **options):
    q, k, v, do = _inputs(7, 1, 2, 1, t_q, t_k, 4)
    counters = FlashCounters()
    o, lse = flash_attention_forward(q, k, v, block_q=block_q, block_k=block_k, **options,
                                     counters=counters if pass_ == "forward" else None)
    if pass_ == "backward":
        flash_attention_backward(do, q, k, v, o, lse, block_q=block_q, block_k=block_k, **options,
                                 counters=counters)
    return counters


@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_no_mask_computes_every_pair(pass_):
    for t_q, t_k in ((37, 37), (5, 50), (1, 1)):
        c = _counts(t_q, t_k, pass_, block_q=8)
        assert c.score_pairs == t_q * t_k
        assert c.tiles_computed == math.ceil(t_q / 8) * math.ceil(t_k / 16)
        assert c.tiles_skipped == 0


@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_causal_skips_the_tiles_above_the_diagonal(pass_):
    for t, block_q, block_k in ((37, 8, 16), (64, 16, 16), (50, 16, 4)):
        c = _counts(t, t, pass_, block_q, block_k, causal=True)
        pairs, computed, skipped = _tile_census(t, t, block_q, block_k, causal=True)
        assert (c.score_pairs, c.tiles_computed, c.tiles_skipped) == (pairs, computed, skipped)
        assert c.score_pairs >= t * (t + 1) // 2  # every visible pair is computed
    # With square tiles that divide T: N = T/b tiles a side, N(N+1)/2 on or below the diagonal.
    n = 128 // 16
    c = _counts(128, 128, pass_, causal=True)
    assert c.tiles_computed == n * (n + 1) // 2 and c.tiles_skipped == n * (n - 1) // 2
    assert c.score_pairs == 16 * 16 * n * (n + 1) // 2


@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_window_computes_order_t_w_pairs(pass_):
    w, block_q, block_k = 6, 8, 16
    for t in (37, 64, 256):
        c = _counts(t, t, pass_, block_q, block_k, window=w)
        assert (c.score_pairs, c.tiles_computed, c.tiles_skipped) == _tile_census(
            t, t, block_q, block_k, window=w)
        # A query tile (at most block_q rows) sees an interval of at most block_q + w - 1 keys, and
        # the key tiles meeting an interval of length L hold at most L + 2 (block_k - 1) keys.
        assert c.score_pairs <= t * (w + block_q + 2 * block_k)
        assert c.score_pairs >= sum(min(i + 1, w) for i in range(t))  # the visible pairs
    assert c.tiles_skipped > c.tiles_computed  # at T = 256 most tiles are skipped


def test_forward_and_backward_visit_the_same_tiles():
    for t_q, t_k, causal, window in ((37, 37, True, None), (20, 9, True, 3), (5, 40, False, 7)):
        forward = _counts(t_q, t_k, "forward", 8, 4, causal=causal, window=window)
        backward = _counts(t_q, t_k, "backward", 8, 4, causal=causal, window=window)
        # the memory-traffic counts (F6) are the forward's only
        assert dataclasses.replace(forward, elements_read=0, elements_written=0) == backward


# ---- F6: data movement, dense against tiled ----

@pytest.mark.parametrize("b, h, g, t_q, t_k, d, d_v, block_q, block_k", [
    (1, 1, 1, 16, 16, 4, 4, 16, 16),  # one tile
    (2, 4, 2, 37, 37, 8, 8, 8, 16),  # GQA, lengths the blocks do not divide
    (1, 3, 1, 5, 50, 4, 6, 2, 7),  # MQA, more keys than queries, D_v != D
    (1, 2, 2, 50, 5, 3, 3, 16, 4),  # more queries than keys
])
def test_tiled_traffic_equals_the_forward_loop_counts_f6(b, h, g, t_q, t_k, d, d_v, block_q, block_k):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, h, t_q, d))
    k, v = rng.standard_normal((b, g, t_k, d)), rng.standard_normal((b, g, t_k, d_v))
    counters = FlashCounters()
    flash_attention_forward(q, k, v, block_q=block_q, block_k=block_k, counters=counters)
    for bytes_per_element in (1, 2):
        traffic = attention_memory_traffic(b, h, t_q, t_k, d, kv_heads=g, value_dim=d_v, tiled=True,
                                           block_q=block_q, bytes_per_element=bytes_per_element)
        assert traffic.read_bytes == bytes_per_element * counters.elements_read
        assert traffic.written_bytes == bytes_per_element * counters.elements_written
        assert traffic.total_bytes == traffic.read_bytes + traffic.written_bytes


def test_dense_traffic_by_hand_f6():
    # T_q = 2, T_k = 3, D = 4, D_v = 5, one byte per element. Read Q (8) and K (12), write S (6);
    # read S (6), write P (6); read P (6) and V (15), write O (10).
    traffic = attention_memory_traffic(1, 1, 2, 3, 4, value_dim=5, bytes_per_element=1)
    assert traffic == (8 + 12 + 6 + 6 + 15, 6 + 6 + 10)
    # tiled with one query tile: Q, K, V once; O and one logsumexp per row
    tiled = attention_memory_traffic(1, 1, 2, 3, 4, value_dim=5, tiled=True, bytes_per_element=1)
    assert tiled == (8 + 12 + 15, 10 + 2)


def test_dense_over_tiled_tends_to_2_block_q_over_d_f6():
    # leading terms: dense 4 B H T^2, tiled 2 B H T^2 D / B_q
    for block_q, d in ((128, 64), (64, 128), (16, 64)):
        ratios = [attention_memory_traffic(2, 4, t, t, d).total_bytes
                  / attention_memory_traffic(2, 4, t, t, d, tiled=True, block_q=block_q).total_bytes
                  for t in (2**14, 2**16)]
        assert abs(ratios[1] - 2 * block_q / d) < abs(ratios[0] - 2 * block_q / d)
        assert ratios[1] == pytest.approx(2 * block_q / d, rel=0.01)


def test_causal_mask_reads_fewer_key_tiles_than_the_unmasked_count_f6():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 64, 4)) for _ in range(3))
    counters = FlashCounters()
    flash_attention_forward(q, k, v, causal=True, block_q=16, block_k=16, counters=counters)
    full = attention_memory_traffic(1, 2, 64, 64, 4, tiled=True, block_q=16, bytes_per_element=1)
    # 4 query tiles read 1, 2, 3, 4 key tiles instead of 4 each: 10 of 16
    assert counters.elements_read == 2 * 64 * 4 + 10 * 2 * 16 * 8
    assert counters.elements_read < full.read_bytes
    assert counters.elements_written == full.written_bytes


def test_traffic_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="kv_heads = 3 must divide heads = 4"):
        attention_memory_traffic(1, 4, 8, 8, 2, kv_heads=3)
    with pytest.raises(ValueError, match="block_q"):
        attention_memory_traffic(1, 4, 8, 8, 2, tiled=True, block_q=0)
    with pytest.raises((TypeError, ValueError), match="t_q"):
        attention_memory_traffic(1, 4, 8.5, 8, 2)
    with pytest.raises((TypeError, ValueError), match="tiled"):
        attention_memory_traffic(1, 4, 8, 8, 2, tiled="yes")


def _largest_temporary(t, **options):
    q, k, v, do = _inputs(8, 2, 4, 2, t, t, 3, 5)
    counters = FlashCounters()
    _flash(q, k, v, do, counters=counters, block_q=16, block_k=8, **options)
    return counters.largest_temporary


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, 4)])
def test_largest_temporary_does_not_grow_with_t(causal, window):
    # B H (block_q block_k + block D) for B = 2, H = 4, blocks 16 x 8, D = 3, D_v = 5.
    bound = 2 * 4 * (16 * 8 + 16 * 5)
    sizes = [_largest_temporary(t, causal=causal, window=window) for t in (32, 128)]
    assert sizes[0] == sizes[1] <= bound
    assert sizes[1] < 2 * 4 * 128 * 128  # far below one score matrix per head


def _peak_bytes(fn):
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_no_score_matrix_is_allocated():
    """An independent measurement: tracemalloc sees NumPy's buffers. At T = 1024 one float64 score
    matrix is 8 MiB; the whole tiled forward and backward, outputs included (about 160 KiB of
    (T, D) arrays and 64 x 64 tiles of 32 KiB), peak under an eighth of that, while the dense pass,
    measured the same way, holds more than one."""
    t = 1024
    q, k, v, do = _inputs(9, 1, 1, 1, t, t, 4)
    matrix = t * t * 8

    def tiled():
        _flash(q, k, v, do, causal=True, block_q=64, block_k=64)

    def dense():
        o, cache = sdpa_forward(q, k, v, mask=causal_mask(t))
        sdpa_backward(do, cache)

    assert _peak_bytes(tiled) < matrix / 8
    assert _peak_bytes(dense) > matrix


# ---- float32 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [10, 11, 12])
def test_float32_stays_float32_and_is_as_accurate_as_dense_float32(seed):
    """The FlashAttention suite's rule: against a float64 reference, the tiled float32 error is at
    most twice the dense float32 error, plus the roundings that tiling adds and dense does not,
    counted to first order, each as ``u`` (2**-24) times the largest entry:

    * forward: each of the ``n_k`` merges rescales the running sums by a rounded exponential
      (within one ulp, ``2u``), so ``2 n_k u``;
    * backward: the weights are recomputed from a float32 logsumexp, off by up to ``u |lse|``,
      which scales a whole row of weights by that relative amount; and each of the ``n`` tiles
      added into an accumulator (key tiles for ``dq``, query tiles for ``dk`` and ``dv``) costs one
      rounding, so ``(max |lse| + n) u``.
    """
    t, block_q, block_k = 37, 8, 16
    n_q, n_k = math.ceil(t / block_q), math.ceil(t / block_k)
    q, k, v, do = _inputs(seed, 2, 4, 2, t, t, 8, dtype=np.float32)
    up = [x.astype(np.float64) for x in (q, k, v, do)]
    for causal, window in ((False, None), (True, None), (False, 5)):
        got = _flash(q, k, v, do, causal=causal, window=window, block_q=block_q, block_k=block_k)
        dense32 = _dense(q, k, v, do, causal, window)
        ref = _dense(*up, causal, window)
        lse_max = np.abs(ref[1][np.isfinite(ref[1])]).max()
        tiling = {"o": 2 * n_k, "lse": 2 * n_k, "dq": lse_max + n_k, "dk": lse_max + n_q,
                  "dv": lse_max + n_q}
        for name, actual, plain, exact in zip(("o", "lse", "dq", "dk", "dv"), got, dense32, ref):
            assert actual.dtype == np.float32, name
            live = np.isfinite(exact)
            float32_rule(f"float32 {name} causal={causal} window={window}", actual, exact, plain,
                         2, tiling[name] * U32 * max(1.0, np.abs(exact[live]).max()))


# ---- bad input -----------------------------------------------------------------------------------

def _good():
    return _inputs(11, 1, 4, 2, 6, 6, 3)[:3]


def test_bad_input_forward():
    q, k, v = _good()
    with pytest.raises(ValueError, match=r"k\.shape\[-1\] must be 3 .*q\.shape = \(1, 4, 6, 3\)"):
        flash_attention_forward(q, k[..., :2], v)
    with pytest.raises(ValueError, match=r"G = 3 .*k\.shape = \(1, 3, 6, 3\).* H = 4"):
        flash_attention_forward(q, np.zeros((1, 3, 6, 3)), np.zeros((1, 3, 6, 3)))
    with pytest.raises(ValueError, match=r"v must have .*k\.shape = \(1, 2, 6, 3\).*"
                                         r"v\.shape = \(1, 2, 5, 3\)"):
        flash_attention_forward(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match=r"k\.shape\[0\] must be 1 .*batch"):
        flash_attention_forward(q, np.zeros((2, 2, 6, 3)), np.zeros((2, 2, 6, 3)))
    with pytest.raises(ValueError, match=r"q must have 4 dimensions \(B, H, T_q, D\), "
                                         r"got shape \(4, 6, 3\)"):
        flash_attention_forward(q[0], k, v)
    with pytest.raises(TypeError, match=r"k must be a floating-point array, got dtype int64"):
        flash_attention_forward(q, k.astype(np.int64), v)
    for window in (0, -2):
        with pytest.raises(ValueError, match=rf"window must be an int >= 1, got {window}"):
            flash_attention_forward(q, k, v, window=window)
    with pytest.raises(TypeError, match=r"window must be an int, got 1.5"):
        flash_attention_forward(q, k, v, window=1.5)
    with pytest.raises(ValueError, match=r"block_k must be an int >= 1, got 0"):
        flash_attention_forward(q, k, v, block_k=0)
    with pytest.raises(TypeError, match=r"causal must be True or False"):
        flash_attention_forward(q, k, v, causal="yes")
    for softcap in (0.0, -30.0):
        with pytest.raises(ValueError, match=r"softcap must be a finite number > 0"):
            flash_attention_forward(q, k, v, softcap=softcap)


def test_bad_input_backward():
    q, k, v = _good()
    o, lse = flash_attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"do must have the output shape .*\(1, 4, 6, 3\).*"
                                         r"do\.shape = \(1, 4, 5, 3\)"):
        flash_attention_backward(o[:, :, :5], q, k, v, o, lse)
    with pytest.raises(ValueError, match=r"lse must have shape \(B, H, T_q\) = \(1, 4, 6\)"
                                         r".*\(1, 4, 6, 1\)"):
        flash_attention_backward(o, q, k, v, o, lse[..., None])
    with pytest.raises(TypeError, match=r"o must be a floating-point array"):
        flash_attention_backward(o, q, k, v, o.astype(np.int32), lse)
    with pytest.raises(ValueError, match=r"G = 3"):
        flash_attention_backward(o, q, np.zeros((1, 3, 6, 3)), np.zeros((1, 3, 6, 3)), o, lse)
