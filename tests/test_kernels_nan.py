"""NaN in gives NaN out: the C++ kernels against a float64 reference, entry by entry (issue 9).

A NaN placed anywhere in the inputs must make exactly those outputs NaN that depend on it, and no
others:

* attention: a NaN in ``q_i`` or in the key ``k_j`` of a pair that query ``i`` sees makes the
  scores of row ``i`` NaN, so its weights, its output row, its logsumexp and its gradients; a NaN
  in ``v_j[d]`` that row ``i`` sees makes ``o_i[d]`` NaN (and, through ``delta_i = dO_i . O_i``,
  row ``i``'s gradients); a NaN in ``dO_i`` reaches ``dV`` of the keys row ``i`` sees and, through
  ``delta_i``, row ``i``'s ``dS``. A NaN in a key or value that no query sees changes nothing: a
  masked pair contributes nothing, not ``0 * NaN``.
* decode: a NaN in ``q`` or in a key within the sequence's length makes its output row NaN; in a
  value, that column; anything past the length, or in a page the table does not reach, is never read.

The reference here is dense attention in float64 that sums over the visible pairs only (``np.where``
on every product with a masked factor, never a multiplication by a zero weight), so it states that
rule directly. Only the pattern of NaNs is compared; the values are the other kernel tests' business.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refmath import kernels
from refmath.attention import gqa_head_map
from refmath.inference.decode import decode_attention
from _support import visible

pytestmark = pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built")

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True, params=[16, 8], ids=["16 lanes", "8 lanes"])
def vector_lanes(request):
    """Both compiled copies of the kernels, as in test_kernels_cpu.py."""
    try:
        if kernels.cpu_vector_lanes(request.param) != request.param:
            pytest.skip("this CPU has no AVX-512: the 16-lane kernels cannot run here")
        yield request.param
    finally:
        kernels.cpu_vector_lanes(16)


def masked_sum(vis, products, axis):
    """The sum over ``axis`` of ``products`` (..., t_q, t_k, D) over the visible pairs only."""
    return np.where(vis[..., None], products, 0.0).sum(axis=axis)


def attention_reference(q, k, v, do, causal, window, scale):
    """(o, lse, dq, dk, dv) in float64, each product of a masked pair left out rather than zeroed."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    h, g, t_q, t_k = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    heads = gqa_head_map(h, g)
    kk, vv = k[:, heads], v[:, heads]  # (B, H, T_k, D)
    vis = visible(t_q, t_k, causal, window or None)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = np.where(vis, scale * np.einsum("bhid,bhjd->bhij", q, kk), -np.inf)
        m = s.max(axis=-1, keepdims=True)  # NaN if any visible score is NaN
        m = np.where(np.isneginf(m), 0.0, m)
        e = np.where(vis, np.exp(s - m), 0.0)
        total = e.sum(axis=-1, keepdims=True)
        a = np.where(vis, e / np.where(total == 0, 1.0, total), 0.0)
        o = masked_sum(vis, a[..., None] * vv[:, :, None], axis=-2)
        lse = np.where(total[..., 0] == 0, -np.inf, m[..., 0] + np.log(total[..., 0]))
        dv_rep = masked_sum(vis, a[..., None] * do[:, :, :, None], axis=-3)
        dp = np.where(vis, np.einsum("bhid,bhjd->bhij", do, vv), 0.0)
        delta = np.einsum("bhid,bhid->bhi", do, o)[..., None]
        ds = np.where(vis, a * (dp - delta), 0.0)
        dq = scale * masked_sum(vis, ds[..., None] * kk[:, :, None], axis=-2)
        dk_rep = scale * masked_sum(vis, ds[..., None] * q[:, :, :, None], axis=-3)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for r in range(h):
        dk[:, heads[r]] += dk_rep[:, r]
        dv[:, heads[r]] += dv_rep[:, r]
    return o, lse, dq, dk, dv


def decode_nan_reference(q, k, v, lengths, scale):
    """(B, H, D) in float64: refmath's decode over each sequence's first lengths[b] keys
    (contiguous caches). It never reads a slot past a length, so a NaN there changes nothing."""
    with np.errstate(invalid="ignore", over="ignore"):
        return decode_attention(*(np.asarray(x, dtype=np.float64) for x in (q, k, v)), lengths, scale)


def assert_same_nans(label, kernel, ref):
    kernel, ref = np.asarray(kernel), np.asarray(ref)
    got, want = np.isnan(kernel), np.isnan(ref)
    if not np.array_equal(got, want):
        extra, missing = np.argwhere(got & ~want), np.argwhere(want & ~got)
        raise AssertionError(
            f"{label}: {len(extra)} NaN where the reference is not (first {extra[:3].tolist()}), "
            f"{len(missing)} missing NaN (first {missing[:3].tolist()})")


def put_nan(rng, x):
    flat = x.reshape(-1)
    flat[rng.integers(flat.size)] = np.nan


@st.composite
def attention_cases(draw):
    g = draw(st.sampled_from([1, 2]))
    h = g * draw(st.sampled_from([1, 2]))
    # lengths around the CPU kernel's 128-row tiles, so that masks cut tiles in both directions
    t_q = draw(st.sampled_from([1, 5, 17, 130, 200]))
    t_k = draw(st.sampled_from([1, 6, 17, 129, 200]))
    d = draw(st.sampled_from([3, 8, 16]))
    mask = draw(st.sampled_from(["none", "causal", "window"]))
    window = draw(st.integers(1, 40)) if mask == "window" else 0
    where = draw(st.sampled_from(["q", "k", "v", "do"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return (1, h, g, t_q, t_k, d, mask != "none", window, where, seed)


@FUZZ
@given(attention_cases(), st.sampled_from([1, 2]))
def test_attention_nan_pattern_matches_the_reference(case, schedule):
    b, h, g, t_q, t_k, d, causal, window, where, seed = case
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, t_q, d)).astype(np.float32)
    k = rng.standard_normal((b, g, t_k, d)).astype(np.float32)
    v = rng.standard_normal((b, g, t_k, d)).astype(np.float32)
    do = rng.standard_normal((b, h, t_q, d)).astype(np.float32)
    put_nan(rng, {"q": q, "k": k, "v": v, "do": do}[where])
    scale = d**-0.5
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = attention_reference(q, k, v, do, causal, window, scale)
    o, lse = kernels.flash_attention_forward(q, k, v, causal=causal, window=window or None)
    label = f"NaN in {where}, B{b} H{h} G{g} Tq{t_q} Tk{t_k} D{d} causal={causal} window={window}"
    assert_same_nans(f"o ({label})", o, o_ref)
    assert_same_nans(f"lse ({label})", lse, lse_ref)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref), err_msg=label)
    kernels._C.set_backward_schedule(schedule)  # both schedules must agree on NaN too
    try:
        dq, dk, dv = kernels.flash_attention_backward(do, q, k, v, o, lse, causal=causal,
                                                      window=window or None)
    finally:
        kernels._C.set_backward_schedule(0)
    for name, got, ref in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        assert_same_nans(f"{name} ({label}, schedule {schedule})", got, ref)


def test_attention_masked_nan_key_and_value_do_not_leak():
    """The cases a random placement finds only now and then: a NaN key and a NaN value that the
    causal mask hides from every earlier query of the same tile, and a NaN query row that sees
    nothing at all (T_q > T_k)."""
    rng = np.random.default_rng(0)
    t, d = 140, 16  # one tile of 128 queries and keys, cut by the causal mask, and a second one
    q, k, v, do = (rng.standard_normal((1, 1, t, d)).astype(np.float32) for _ in range(4))
    k_nan = k.copy()
    k_nan[0, 0, 70, 3] = np.nan  # queries 70 .. 139 see it
    o, lse = kernels.flash_attention_forward(q, k_nan, v, causal=True)
    assert np.isfinite(o[0, 0, :70]).all() and np.isfinite(lse[0, 0, :70]).all()
    assert np.isnan(o[0, 0, 70:]).all() and np.isnan(lse[0, 0, 70:]).all()
    dq, dk, dv = kernels.flash_attention_backward(do, q, k_nan, v, o, lse, causal=True)
    assert np.isfinite(dq[0, 0, :70]).all() and np.isnan(dq[0, 0, 70:]).all()
    v_nan = v.copy()
    v_nan[0, 0, 100, 5] = np.nan  # column 5 of queries 100 .. 139
    o, lse = kernels.flash_attention_forward(q, k, v_nan, causal=True)
    assert np.isfinite(o[0, 0, :100]).all() and np.isfinite(lse).all()
    assert np.isnan(o[0, 0, 100:, 5]).all() and np.isfinite(np.delete(o[0, 0, 100:], 5, axis=1)).all()
    dq, dk, dv = kernels.flash_attention_backward(do, q, k, v_nan, o, lse, causal=True)
    assert np.isfinite(dq[0, 0, :100]).all() and np.isnan(dq[0, 0, 100:]).all()
    assert np.isfinite(dv).all()  # dV = P^T dO does not involve v
    q2 = rng.standard_normal((1, 1, 8, d)).astype(np.float32)
    q2[0, 0, 0, 0] = np.nan  # query 0 sits before the first of 5 keys: it sees nothing
    o2, lse2 = kernels.flash_attention_forward(q2, k[:, :, :5], v[:, :, :5], causal=True)
    assert (o2[0, 0, 0] == 0).all() and lse2[0, 0, 0] == -np.inf


@st.composite
def decode_cases(draw):
    g = draw(st.sampled_from([1, 2]))
    h = g * draw(st.sampled_from([1, 3, 4]))
    d = draw(st.sampled_from([5, 16, 24]))
    b = draw(st.integers(1, 3))
    t_max = draw(st.sampled_from([1, 40, 700]))
    lengths = draw(st.lists(st.integers(0, t_max), min_size=b, max_size=b))
    splits = draw(st.sampled_from([0, 1, 3, 16]))
    where = draw(st.sampled_from(["q", "k", "v"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return b, h, g, d, t_max, np.array(lengths), splits, where, seed


@FUZZ
@given(decode_cases())
def test_decode_nan_pattern_matches_the_reference(case):
    b, h, g, d, t_max, lengths, splits, where, seed = case
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    k = rng.standard_normal((b, g, t_max, d)).astype(np.float32)
    v = rng.standard_normal((b, g, t_max, d)).astype(np.float32)
    put_nan(rng, {"q": q, "k": k, "v": v}[where])
    ref = decode_nan_reference(q, k, v, lengths, d**-0.5)
    out = kernels.decode(q, k, v, lengths, splits=splits or None)
    assert_same_nans(f"decode, NaN in {where}, lengths {lengths.tolist()}, splits {splits}", out, ref)


@FUZZ
@given(decode_cases(), st.sampled_from([1, 7, 16]))
def test_paged_decode_nan_pattern_matches_the_reference(case, page_size):
    b, h, g, d, t_max, lengths, splits, where, seed = case
    rng = np.random.default_rng(seed)
    max_pages = -(-t_max // page_size)
    n_pages = b * max_pages + 2  # two pages no sequence reads
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    k_pages = rng.standard_normal((n_pages, g, page_size, d)).astype(np.float32)
    v_pages = rng.standard_normal((n_pages, g, page_size, d)).astype(np.float32)
    table = rng.permutation(n_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    put_nan(rng, {"q": q, "k": k_pages, "v": v_pages}[where])
    # The contiguous caches the table describes (slots past max_pages * page_size dropped).
    k = k_pages[table].transpose(0, 2, 1, 3, 4).reshape(b, g, -1, d)[:, :, :t_max]
    v = v_pages[table].transpose(0, 2, 1, 3, 4).reshape(b, g, -1, d)[:, :, :t_max]
    ref = decode_nan_reference(q, k, v, lengths, d**-0.5)
    out = kernels.paged_decode(q, k_pages, v_pages, table, lengths, splits=splits or None)
    assert_same_nans(f"paged decode, NaN in {where}, lengths {lengths.tolist()}, page size "
                     f"{page_size}, splits {splits}", out, ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_rows_nan_row_is_nan(dtype):
    x = np.array([[np.nan, -np.inf, -np.inf], [np.nan, 1.0, 2.0], [-np.inf, -np.inf, -np.inf],
                  [0.0, 1.0, 2.0]], dtype=dtype)
    y = kernels.softmax_rows(x)
    assert np.isnan(y[:2]).all(), y
    assert (y[2] == 0).all() and np.isfinite(y[3]).all()
