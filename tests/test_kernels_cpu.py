"""The C++ attention and decode kernels (refmath._C through refmath.kernels) against NumPy.

The float32 rule is the FlashAttention test suite's. For each output compute
* the float64 reference (dense attention: the whole score matrix, a mask built from the index rule),
* the same dense computation in plain float32 NumPy,
and require ``kernel error <= factor * (float32 NumPy error) + floor``, errors being the largest
absolute difference from the float64 reference, with factor 2 for forward outputs and 3 for
gradients (a kernel that sums in another order may be a little worse than NumPy, not a lot).

The floor: on some inputs NumPy is exact by coincidence (a single key: softmax gives exactly 1; in
the backward pass ``dP - delta`` subtracts two equal numbers computed the same way), so its error is
0 while any other summation order is not. The floor is ``4 u M`` with ``u = 2**-24``: four float32
roundings of ``M``, the largest sum of magnitudes that makes up one output entry (for
``o = sum_j p_j v_j`` it is ``sum_j p_j |v_j|``; for ``lse``, ``1 + |lse|``; for
``dS = P (dP - delta)`` the terms of both dot products, since their difference may be 0 while their
rounding is not). For the gradients ``M`` also carries the factor ``1 + max|lse|``: the backward
pass recomputes every weight as ``exp(s - lse)`` from the float32 logsumexp the forward returned,
whose own rounding (``u |lse|``, absolute) becomes a relative error ``u |lse|`` of each weight.
Dense NumPy never rounds a logsumexp, so it does not pay this; FlashAttention always does.

Each check prints its worst error as a fraction of its bound (``pytest -s``), and the module prints
the overall worst case at the end.
"""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refmath import kernels
from refmath.attention import gqa_head_map, sdpa_backward, sdpa_forward
from refmath.inference.decode import decode_attention
from refmath.inference.paged import PagedKVCache
from _support import float32_rule, visible

pytestmark = pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built")

U32 = 2.0**-24
FLOOR_ULPS = 4
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WORST = []  # (fraction of bound, label)


@pytest.fixture(scope="module", autouse=True, params=[16, 8], ids=["16 lanes", "8 lanes"])
def vector_lanes(request):
    """Every test once per compiled copy of the kernels: the 16-lane AVX-512 one (where the CPU has
    it; skipped elsewhere) and the 8-lane one (AVX2 or the baseline), which a CPU with AVX-512 would
    otherwise never run."""
    try:
        if kernels.cpu_vector_lanes(request.param) != request.param:
            pytest.skip("this CPU has no AVX-512: the 16-lane kernels cannot run here")
        yield request.param
    finally:
        kernels.cpu_vector_lanes(16)


@pytest.fixture(scope="module", autouse=True)
def report_worst_case():
    yield
    if WORST:
        fraction, label = max(WORST)
        print(f"\nworst kernel error over {len(WORST)} checks: {fraction:.2f} of its bound ({label})")


# ---- the dense references ------------------------------------------------------------------------

def dense(q, k, v, do, causal, window, scale, dtype):
    """(o, lse, dq, dk, dv) by dense attention in ``dtype``, key/value heads repeated per query head;
    in float64 also the magnitudes M of each output (see the module docstring) as a sixth item."""
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    h, g, t_q, t_k = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    mask = np.where(visible(t_q, t_k, causal, window), 0.0, -np.inf).astype(dtype)
    heads = gqa_head_map(h, g)
    o, cache = sdpa_forward(q, k[:, heads], v[:, heads], mask=mask, scale=scale)
    dq, dk_rep, dv_rep = sdpa_backward(do, cache)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for r in range(h):  # each query head's gradient goes to the key/value head it read
        dk[:, heads[r]] += dk_rep[:, r]
        dv[:, heads[r]] += dv_rep[:, r]
    scores = (q * dtype(scale)) @ np.swapaxes(k[:, heads], -1, -2) + mask
    m = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isneginf(m), 0, m)
    with np.errstate(divide="ignore"):
        lse = (m_safe + np.log(np.exp(scores - m_safe).sum(axis=-1, keepdims=True)))[..., 0]
    if dtype != np.float64:
        return o, lse, dq, dk, dv
    a = cache.a  # the attention weights (B, H, T_q, T_k)
    # dS = P (dP - delta) with dP = dO . v_j and delta = dO . O: its magnitude counts the terms of
    # both dot products, which is what their rounding scales with (their difference may be 0).
    dp = do @ np.swapaxes(v[:, heads], -1, -2)
    dp_terms = np.abs(do) @ np.swapaxes(np.abs(v[:, heads]), -1, -2)
    delta_terms = (np.abs(do) * np.abs(o)).sum(axis=-1, keepdims=True)
    ds_abs = a * (np.abs(dp - (do * o).sum(axis=-1, keepdims=True)) + dp_terms + delta_terms)
    mags = {"o": a @ np.abs(v[:, heads]), "dv": np.swapaxes(a, -1, -2) @ np.abs(do),
            "dq": scale * ds_abs @ np.abs(k[:, heads]),
            "dk": scale * np.swapaxes(ds_abs, -1, -2) @ np.abs(q)}
    return o, lse, dq, dk, dv, {name: np.abs(x).max(initial=0.0) for name, x in mags.items()}


def make_qkv(seed, b, h, g, t_q, t_k, d):
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((b, h, t_q, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, g, t_k, d)).astype(np.float32) for _ in range(2))
    return q, k, v, do


def check_attention(b, h, g, t_q, t_k, d, causal, window, seed=0, scale=None):
    label = f"B={b} H={h} G={g} Tq={t_q} Tk={t_k} D={d} causal={causal} window={window}"
    q, k, v, do = make_qkv(seed, b, h, g, t_q, t_k, d)
    tau = 1.0 / math.sqrt(d) if scale is None else scale
    o, lse = kernels.flash_attention_forward(q, k, v, causal=causal, window=window, scale=scale)
    dq, dk, dv = kernels.flash_attention_backward(do, q, k, v, o, lse, causal=causal, window=window,
                                                  scale=scale)
    assert o.dtype == lse.dtype == dq.dtype == dk.dtype == dv.dtype == np.float32
    assert o.shape == q.shape and lse.shape == q.shape[:3]
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    ref = dense(q, k, v, do, causal, window, tau, np.float64)
    f32 = dense(q, k, v, do, causal, window, tau, np.float32)
    mags = ref[5]
    lse_size = 1.0 + np.abs(ref[1][np.isfinite(ref[1])]).max(initial=0.0)
    for name, out, r, n, factor, magnitude in [
        ("o", o, ref[0], f32[0], 2, mags["o"]),
        ("lse", lse, ref[1], f32[1], 2, lse_size),
        ("dq", dq, ref[2], f32[2], 3, lse_size * mags["dq"]),
        ("dk", dk, ref[3], f32[3], 3, lse_size * mags["dk"]),
        ("dv", dv, ref[4], f32[4], 3, lse_size * mags["dv"]),
    ]:
        float32_rule(f"{name} {label}", out, r, n, factor, FLOOR_ULPS * U32 * magnitude, WORST)
    return o, lse


# ---- flash attention over a grid -----------------------------------------------------------------

def attention_grid(n_cases=28, seed=5):
    """A fixed sample of T x D x ratio x mask, every value of each axis present, batch > 1 except
    for the long T = 1000 cases (kept to B*H small)."""
    rng = np.random.default_rng(seed)
    lengths, dims, ratios, masks = [1, 7, 64, 100], [32, 64, 128], [1, 4, 8], ["none", "causal", "window"]
    cases = set()
    for i in range(n_cases):
        t = lengths[i % len(lengths)] if i < 12 else int(rng.choice(lengths))
        cases.add((t, dims[i % 3] if i < 12 else int(rng.choice(dims)),
                   ratios[i % 3] if i < 9 else int(rng.choice(ratios)),
                   masks[i % 3] if i < 9 else str(rng.choice(masks))))
    out = [pytest.param(2, r * (2 if r < 8 else 1), 2 if r < 8 else 1, t, t, d, m,
                        id=f"T{t}-D{d}-r{r}-{m}") for t, d, r, m in sorted(cases)]
    out += [pytest.param(1, r, 1, 1000, 1000, d, m, id=f"T1000-D{d}-r{r}-{m}")
            for d, r, m in [(64, 1, "causal"), (128, 4, "window"), (32, 8, "none")]]
    return out


@pytest.mark.parametrize("b, h, g, t_q, t_k, d, mask", attention_grid())
def test_flash_attention_matches_the_float64_reference(b, h, g, t_q, t_k, d, mask):
    window = {"none": None, "causal": None, "window": max(1, t_k // 3)}[mask]
    check_attention(b, h, g, t_q, t_k, d, causal=mask != "none", window=window)


@pytest.mark.parametrize("t_q, t_k, causal, window", [
    (7, 100, True, None),   # queries are the last 7 positions of 100 keys
    (100, 7, True, None),   # the first 93 queries sit before every key: o = 0, lse = -inf
    (100, 64, True, 5),     # a narrow window that some rows see nothing through
    (64, 129, False, None),  # one key past a key tile's edge (tiles of 128 keys)
    (65, 130, True, 1),     # window 1: each query sees one key
    (3, 0, False, None),    # no keys at all
    (0, 5, True, None),     # no queries
])
def test_flash_attention_uneven_lengths_and_empty_rows(t_q, t_k, causal, window):
    o, lse = check_attention(2, 4, 2, t_q, t_k, 32, causal, window, seed=t_q + t_k)
    if t_q > t_k and causal:  # rows before the first key
        np.testing.assert_array_equal(o[:, :, : t_q - t_k], 0.0)
        assert np.isneginf(lse[:, :, : t_q - t_k]).all()


@pytest.mark.parametrize("b, h, g, t_q, t_k, d, causal, window", [
    (1, 6, 3, 300, 300, 40, True, 50),    # GQA, a window that starts key tiles mid-tile
    (2, 4, 1, 90, 260, 24, True, None),   # MQA, queries at the end of three key tiles
    (1, 2, 2, 130, 130, 17, False, None),
])
def test_flash_backward_one_and_two_pass_schedules_give_the_same_bits(b, h, g, t_q, t_k, d, causal,
                                                                      window):
    # Which schedule runs depends on the thread count; forcing each makes both run on any machine,
    # and their equality is what makes the result independent of the thread count.
    q, k, v, do = make_qkv(11, b, h, g, t_q, t_k, d)
    o, lse = kernels.flash_attention_forward(q, k, v, causal=causal, window=window)
    grads = {}
    try:
        for schedule in (1, 2):
            kernels._C.set_backward_schedule(schedule)
            grads[schedule] = kernels.flash_attention_backward(do, q, k, v, o, lse, causal=causal,
                                                               window=window)
    finally:
        kernels._C.set_backward_schedule(0)
    for one, two in zip(grads[1], grads[2]):
        np.testing.assert_array_equal(one, two)
    check_attention(b, h, g, t_q, t_k, d, causal, window, seed=11)  # and the automatic one is right
    with pytest.raises(ValueError, match="backward schedule"):
        kernels._C.set_backward_schedule(3)


def test_flash_attention_custom_scale_and_gqa_head_map():
    check_attention(2, 8, 2, 33, 40, 16, True, None, seed=3, scale=0.7)
    # GQA equals MHA with each key/value head repeated for its query heads (A10).
    q, k, v, _ = make_qkv(4, 1, 6, 3, 20, 20, 8)
    o, lse = kernels.flash_attention_forward(q, k, v, causal=True)
    heads = gqa_head_map(6, 3)
    o_rep, lse_rep = kernels.flash_attention_forward(q, np.ascontiguousarray(k[:, heads]),
                                                     np.ascontiguousarray(v[:, heads]), causal=True)
    np.testing.assert_array_equal(o, o_rep)
    np.testing.assert_array_equal(lse, lse_rep)


def test_flash_attention_refuses_a_cuda_version_for_numpy_arrays():
    # The CPU has one kernel: a version asked of it would be silently ignored.
    q = np.ones((1, 1, 2, 4), np.float32)
    with pytest.raises(ValueError, match=r"version='v2' picks one of the CUDA kernels, for CuPy "
                                         r"arrays; NumPy arrays run on the CPU's one kernel"):
        kernels.flash_attention_forward(q, q, q, version="v2")


def test_flash_attention_copies_non_contiguous_input():
    q, k, v, _ = make_qkv(6, 1, 2, 2, 30, 30, 16)
    wide = np.stack([q, q], axis=-1).reshape(q.shape[:-1] + (-1,))[..., ::2]  # a strided view of q
    np.testing.assert_array_equal(wide, q)
    o_view, _ = kernels.flash_attention_forward(wide, k, v.astype(">f4"), causal=True)
    o, _ = kernels.flash_attention_forward(q, k, v, causal=True)
    np.testing.assert_array_equal(o_view, o)


# ---- decode over contiguous and paged caches -----------------------------------------------------

def check_decode(label, out, q, k, v, lengths, scale):
    assert out.dtype == np.float32 and out.shape == q.shape
    assert np.isfinite(out).all(), f"{label}: NaN or inf leaked into the output"
    # The reference is refmath's decode in float64, and the plain computation the same in float32;
    # M = max sum_j p_j |v_j| (see the module docstring) is that decode with |v| for the values.
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    ref = decode_attention(q64, k64, v64, lengths, scale)
    magnitude = float(decode_attention(q64, k64, np.abs(v64), lengths, scale).max(initial=0.0))
    f32 = decode_attention(*(np.asarray(x, dtype=np.float32) for x in (q, k, v)), lengths, scale)
    bound = float32_rule(label, out, ref, f32, 2, FLOOR_ULPS * U32 * magnitude, WORST)
    np.testing.assert_array_equal(out[np.asarray(lengths) == 0], 0.0)
    return bound


def make_cache(seed, b, h, g, t_max, d, lengths):
    """q and contiguous caches whose slots past each length hold NaN (they must never be read)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, g, t_max, d)).astype(np.float32) for _ in range(2))
    for i, n in enumerate(lengths):
        k[i, :, n:] = np.nan
        v[i, :, n:] = np.nan
    return q, k, v


@pytest.mark.parametrize("h, g, d, lengths", [
    (4, 4, 32, [1, 7, 64]),
    (8, 2, 64, [100, 0, 1000]),
    (8, 1, 128, [1000, 999]),
    (16, 2, 64, [2000]),  # one long sequence: the automatic split
])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_decode_matches_the_reference(h, g, d, lengths, splits):
    t_max = max(lengths) + 3
    q, k, v = make_cache(sum(lengths) + h, len(lengths), h, g, t_max, d, lengths)
    scale = 1.0 / math.sqrt(d)
    out = kernels.decode(q, k, v, np.array(lengths), splits=splits)
    check_decode(f"decode H={h} G={g} D={d} lengths={lengths} splits={splits}", out, q, k, v,
                 lengths, scale)


def build_paged(seed, h, g, d, page_size, prompt, extra, n_pages=64):
    """A PagedKVCache (float32, NaN in unused slots) holding four sequences: 'a' and 'b' appended in
    turns (interleaved, so their page tables are not in order), 'c' forked from 'a' (sharing its
    pages) and extended, 'e' empty; a freed sequence in between scrambles the free list.

    Returns (q, cache, page tables, lengths, k, v) with k and v the sequences gathered into
    contiguous (B, g, T_max, d) caches for the reference (NaN past each length)."""
    rng = np.random.default_rng(seed)
    cache = PagedKVCache(n_pages, page_size, g, d, dtype=np.float32)

    def new(t):
        return rng.standard_normal((t, g, d)).astype(np.float32)

    for s in ("a", "b", "tmp", "e"):
        cache.add_sequence(s)
    for step in range(0, prompt, 5):
        for s in ("tmp", "a", "b"):
            t = min(5, prompt - step)
            cache.append(s, new(t), new(t))
    cache.free_sequence("tmp")
    cache.fork("a", "c")
    cache.append("c", new(extra), new(extra))
    cache.append("b", new(extra + 3), new(extra + 3))
    seq_ids = ["a", "b", "c", "e"]
    tables, lengths = cache.page_table_array(seq_ids)
    t_max = int(lengths.max())
    k = np.full((len(seq_ids), g, t_max, d), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    for i, s in enumerate(seq_ids):
        ks, vs = cache.gather(s)  # (T, g, d)
        k[i, :, : len(ks)] = ks.transpose(1, 0, 2)
        v[i, :, : len(vs)] = vs.transpose(1, 0, 2)
    q = rng.standard_normal((len(seq_ids), h, d)).astype(np.float32)
    return q, cache, tables, lengths, k, v


@pytest.mark.parametrize("h, g, d, page_size, prompt, extra", [
    (4, 2, 32, 16, 40, 9),
    (8, 1, 64, 4, 23, 1),
    (8, 8, 128, 16, 130, 20),
    # A paged work item takes 2 key/value heads together (up to 8 in the code's bound): 5 sets of 2,
    # 12 sets of 2, and 2 sets and a last one of a single head.
    (20, 10, 32, 8, 50, 5),
    (48, 24, 16, 4, 30, 3),
    (10, 5, 32, 16, 37, 4),
])
def test_paged_decode_permuted_shared_pages_and_nan_slots(h, g, d, page_size, prompt, extra):
    q, cache, tables, lengths, k, v = build_paged(h * d + prompt, h, g, d, page_size, prompt, extra)
    used = tables[tables >= 0]
    assert len(np.unique(used)) < len(used), "the fork should share pages between sequences"
    assert (np.diff(tables[1][tables[1] >= 0]) != 1).any(), "the page table should not be in order"
    assert np.isnan(cache.k_pages).any(), "unused slots should hold NaN"
    scale = 1.0 / math.sqrt(d)
    results, bounds = {}, {}
    for splits in (1, 3, None, 1000):
        out = kernels.paged_decode(q, cache.k_pages, cache.v_pages, tables, lengths, splits=splits)
        label = f"paged H={h} G={g} D={d} p={page_size} lengths={lengths.tolist()} splits={splits}"
        bounds[splits] = check_decode(label, out, q, k, v, lengths, scale)
        results[splits] = out
    # Splitting changes only the order of the sums: 1 and 3 splits agree within their two bounds.
    assert np.abs(results[3] - results[1]).max() <= bounds[1] + bounds[3]
    # The contiguous kernel on the gathered caches (NaN past each length, never read) agrees too.
    contiguous = kernels.decode(q, k, v, lengths, splits=3)
    bound = check_decode("contiguous copy of the pages", contiguous, q, k, v, lengths, scale)
    assert np.abs(contiguous - results[3]).max() <= bound + bounds[3]


def test_paged_decode_more_splits_than_pages_and_empty_sequences():
    rng = np.random.default_rng(11)
    g, d, p = 2, 16, 8
    k_pages = np.full((10, g, p, d), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    lengths = np.array([0, 3, 8, 17])  # no page, part of one, exactly one, three pages
    table = np.full((4, 5), -1, np.int32)
    table[1, 0], table[2, 0], table[3, :3] = 7, 2, [9, 0, 4]
    for b, n in enumerate(lengths):
        for j in range(n):
            page, slot = table[b, j // p], j % p
            k_pages[page, :, slot] = rng.standard_normal((g, d))
            v_pages[page, :, slot] = rng.standard_normal((g, d))
    q = rng.standard_normal((4, 4, d)).astype(np.float32)
    k = np.zeros((4, g, 17, d), np.float32)
    v = np.zeros_like(k)
    for b, n in enumerate(lengths):
        for j in range(n):
            k[b, :, j], v[b, :, j] = k_pages[table[b, j // p], :, j % p], v_pages[table[b, j // p], :, j % p]
    for splits in (1, 2, 3, 5, 50):
        out = kernels.paged_decode(q, k_pages, v_pages, table, lengths, splits=splits)
        check_decode(f"paged empty splits={splits}", out, q, k, v, lengths, 1 / math.sqrt(d))


def shuffled_pages(k, v, lengths, page_size, rng, spare_pages, spare_columns=0):
    """The first ``lengths[b]`` keys of contiguous caches (B, G, T, D) copied into a pool of pages in
    a random order, with ``spare_pages`` unused pages and ``spare_columns`` unused page-table
    columns; every slot not copied into holds NaN (it must never be read). Returns (k_pages,
    v_pages, page_table)."""
    g, d = k.shape[1], k.shape[3]
    n_logical = [-(-n // page_size) for n in lengths]
    n_pages = sum(n_logical) + spare_pages
    order = rng.permutation(n_pages)
    k_pages = np.full((n_pages, g, page_size, d), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    table = np.full((len(lengths), max(n_logical) + spare_columns), -1, np.int32)
    used = 0
    for b, n in enumerate(lengths):
        for i in range(n_logical[b]):
            page, filled = order[used], min(page_size, n - i * page_size)
            used += 1
            table[b, i] = page
            k_pages[page, :, :filled] = k[b, :, i * page_size: i * page_size + filled]
            v_pages[page, :, :filled] = v[b, :, i * page_size: i * page_size + filled]
    return k_pages, v_pages, table


def natural_pages(k, v, page_size):
    """Contiguous caches (B, G, T, D), T a multiple of page_size, cut into pages in their own order:
    sequence b's page i is pool page b * (T / page_size) + i."""
    b, g, t, d = k.shape
    per = t // page_size

    def cut(x):
        return np.ascontiguousarray(
            x.reshape(b, g, per, page_size, d).transpose(0, 2, 1, 3, 4).reshape(b * per, g, page_size, d))

    table = (np.arange(b)[:, None] * per + np.arange(per)[None, :]).astype(np.int32)
    return cut(k), cut(v), table


# The kernels fold keys 16 at a time (kBlock in decode_cpu.cpp) in register tiles of 2, 4 or 8 keys
# and 8 or 16 lanes of D; each case below leaves a remainder somewhere: a length that is not a
# whole block, a single key, a last split of 1-3 keys (241-243 keys in 16 splits: 15 of 16 keys and
# one of 1-3; 13, 17, 21 keys in 4 splits: 4+4+4+1, 5+5+5+2, 6+6+6+3), widths that leave 8 lanes or
# single columns, and pages of sizes that are not multiples of 16 (a block gathers keys from two
# pages), each against the float64 reference.
@pytest.mark.parametrize("lengths, splits", [
    ([1], None), ([1], 1), ([1, 2, 3], 3), ([17, 31, 33], None), ([15, 16, 47], 2),
    ([241, 242, 243], 16), ([13, 17, 21], 4), ([1025, 1026, 1027], None), ([513, 1], 2),
])
@pytest.mark.parametrize("h, g, d", [(8, 2, 128), (12, 3, 40), (4, 4, 20), (32, 8, 7)])
def test_decode_remainders_of_blocks_tiles_and_splits(lengths, splits, h, g, d):
    t_max = max(lengths) + 2
    q, k, v = make_cache(sum(lengths) * 7 + h + d, len(lengths), h, g, t_max, d, lengths)
    scale = 1.0 / math.sqrt(d)
    out = kernels.decode(q, k, v, np.array(lengths), splits=splits)
    check_decode(f"remainder decode H={h} G={g} D={d} lengths={lengths} splits={splits}", out, q, k,
                 v, lengths, scale)


@pytest.mark.parametrize("page_size", [1, 3, 7, 12, 20, 24, 33])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_paged_decode_page_sizes_that_are_not_a_multiple_of_the_block(page_size, splits):
    rng = np.random.default_rng(page_size * 10 + (splits or 0))
    h, g, d = 8, 2, 72  # 72 = 64 + 8: a 16-lane tile, then one of 8 lanes
    lengths = [1, page_size, page_size + 1, 3 * page_size + 2, 100]
    t_max = max(lengths)
    q, k, v = make_cache(page_size, len(lengths), h, g, t_max, d, lengths)
    k_pages, v_pages, table = shuffled_pages(k, v, lengths, page_size, rng, spare_pages=3)
    out = kernels.paged_decode(q, k_pages, v_pages, table, np.array(lengths), splits=splits)
    check_decode(f"paged p={page_size} lengths={lengths} splits={splits}", out, q, k, v, lengths,
                 1.0 / math.sqrt(d))


# Pages in their natural order hold the same keys, in the same order, as the contiguous cache, and
# both kernels fold the same 16-key blocks with the same arithmetic (a paged block gathers its keys
# across page boundaries, so the page size does not change the blocks). Where the splits start at
# the same keys (one split; or s splits of a length that is s whole runs of pages: the contiguous
# split of ceil(n / s) keys is then the paged split of ceil(pages / s) pages), the partial results
# and their merge are the same too, so the outputs must be equal to the bit, not merely within the
# float32 bound.
@pytest.mark.parametrize("page_size, pages_per_split, splits", [
    (16, 4, 1), (16, 16, 4), (16, 7, 3), (12, 10, 4), (20, 3, 5), (1, 40, 2), (48, 2, 3),
])
@pytest.mark.parametrize("h, g, d", [(32, 8, 128), (6, 2, 40)])
def test_paged_decode_in_natural_page_order_is_bit_equal_to_contiguous(page_size, pages_per_split,
                                                                       splits, h, g, d):
    t = splits * pages_per_split * page_size
    rng = np.random.default_rng(t + h + d)
    q = rng.standard_normal((2, h, d)).astype(np.float32)
    k, v = (rng.standard_normal((2, g, t, d)).astype(np.float32) for _ in range(2))
    k_pages, v_pages, table = natural_pages(k, v, page_size)
    lengths = np.array([t, t])
    contiguous = kernels.decode(q, k, v, lengths, splits=splits)
    paged = kernels.paged_decode(q, k_pages, v_pages, table, lengths, splits=splits)
    np.testing.assert_array_equal(paged, contiguous)
    # One split, any length (a last page part-filled): the same blocks again.
    short = np.array([t - 1, max(1, t - page_size - 2)])
    np.testing.assert_array_equal(kernels.paged_decode(q, k_pages, v_pages, table, short, splits=1),
                                  kernels.decode(q, k, v, short, splits=1))
    check_decode(f"natural pages p={page_size} splits={splits}", paged, q, k, v, lengths,
                 1.0 / math.sqrt(d))


def test_decode_with_every_length_zero_and_empty_batch():
    q, k, v = make_cache(1, 3, 4, 2, 5, 8, [0, 0, 0])
    np.testing.assert_array_equal(kernels.decode(q, k, v, [0, 0, 0]), 0.0)
    empty = kernels.decode(q[:0], k[:0], v[:0], np.zeros(0, int))
    assert empty.shape == (0, 4, 8)


# ---- property tests: random shapes, and bad input that must raise, never crash -------------------

@FUZZ
@given(b=st.integers(1, 2), g=st.integers(1, 3), ratio=st.sampled_from([1, 2, 4]),
       t_q=st.integers(0, 70), t_k=st.integers(0, 70), d=st.integers(1, 20),
       mask=st.sampled_from(["none", "causal", "window"]), window=st.integers(1, 80),
       seed=st.integers(0, 2**31))
def test_fuzz_random_attention_shapes(b, g, ratio, t_q, t_k, d, mask, window, seed):
    check_attention(b, g * ratio, g, t_q, t_k, d, causal=mask != "none",
                    window=window if mask == "window" else None, seed=seed)


@FUZZ
@given(h_ratio=st.sampled_from([1, 3, 4]), g=st.integers(1, 3), d=st.integers(1, 40),
       lengths=st.lists(st.integers(0, 300), min_size=1, max_size=3),
       page_size=st.integers(1, 20), splits=st.one_of(st.none(), st.integers(1, 9)),
       seed=st.integers(0, 2**31))
def test_fuzz_random_decode_shapes(h_ratio, g, d, lengths, page_size, splits, seed):
    h = g * h_ratio
    t_max = max(lengths) + 1
    q, k, v = make_cache(seed, len(lengths), h, g, t_max, d, lengths)
    scale = 1.0 / math.sqrt(d)
    out = kernels.decode(q, k, v, lengths, splits=splits)
    check_decode(f"fuzz decode {lengths}", out, q, k, v, lengths, scale)
    # The same context in pages: a shuffled pool, padding pages filled with NaN.
    k_pages, v_pages, table = shuffled_pages(k, v, lengths, page_size, np.random.default_rng(seed),
                                             spare_pages=2, spare_columns=1)
    paged = kernels.paged_decode(q, k_pages, v_pages, table, lengths, splits=splits)
    check_decode(f"fuzz paged {lengths} p={page_size}", paged, q, k, v, lengths, scale)


def _bad_attention_inputs(kind, rng):
    q = rng.standard_normal((2, 4, 9, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 9, 8)).astype(np.float32)
    v = k.copy()
    return {
        "float64 q": (dict(q=q.astype(np.float64), k=k, v=v), TypeError),
        "int k": (dict(q=q, k=k.astype(np.int32), v=v), TypeError),
        "float16 v": (dict(q=q, k=k, v=v.astype(np.float16)), TypeError),
        "rank 3 q": (dict(q=q[0], k=k, v=v), ValueError),
        "G does not divide H": (dict(q=q, k=k[:, :1].repeat(3, axis=1), v=v[:, :1].repeat(3, axis=1)),
                                ValueError),
        "no kv heads": (dict(q=q, k=k[:, :0], v=v[:, :0]), ValueError),
        "k and v differ": (dict(q=q, k=k, v=v[:, :, :5]), ValueError),
        "batch differs": (dict(q=q, k=k[:1], v=v[:1]), ValueError),
        "D differs": (dict(q=q, k=k[..., :5], v=v[..., :5]), ValueError),
        "D = 0": (dict(q=q[..., :0], k=k[..., :0], v=v[..., :0]), ValueError),
        "window 0": (dict(q=q, k=k, v=v, window=0), ValueError),
        "window -3": (dict(q=q, k=k, v=v, window=-3), ValueError),
        "window True": (dict(q=q, k=k, v=v, window=True), TypeError),  # a flag is not a size
        "causal 1": (dict(q=q, k=k, v=v, causal=1), TypeError),
        "scale nan": (dict(q=q, k=k, v=v, scale=float("nan")), ValueError),
        "scale str": (dict(q=q, k=k, v=v, scale="1"), TypeError),
        "version 2": (dict(q=q, k=k, v=v, version=2), TypeError),
        "q GPU-looking": (dict(q=_FakeGpu(q), k=k, v=v), TypeError),
    }[kind]


class _FakeGpu:
    """An object that claims to live on a GPU: mixing it with NumPy arrays must be refused."""
    __cuda_array_interface__ = {}

    def __init__(self, x):
        self.x = x


@FUZZ
@given(kind=st.sampled_from(["float64 q", "int k", "float16 v", "rank 3 q", "G does not divide H",
                             "no kv heads", "k and v differ", "batch differs", "D differs", "D = 0",
                             "window 0", "window -3", "window True", "causal 1", "scale nan",
                             "scale str", "version 2", "q GPU-looking"]),
       seed=st.integers(0, 2**31))
def test_fuzz_bad_attention_input_raises(kind, seed):
    kwargs, error = _bad_attention_inputs(kind, np.random.default_rng(seed))
    with pytest.raises(error):
        kernels.flash_attention_forward(**kwargs)


@FUZZ
@given(kind=st.sampled_from(["negative length", "length past T_max", "float lengths", "lengths shape",
                             "page id too large", "page id -1 needed", "length past the table",
                             "page table float", "page table rank", "splits 0", "splits -1",
                             "float64 cache", "zero-slot pages", "G does not divide H",
                             "table batch"]),
       seed=st.integers(0, 2**31))
def test_fuzz_bad_decode_input_raises(kind, seed):
    rng = np.random.default_rng(seed)
    b, h, g, d, p, t_max = 2, 4, 2, 8, 4, 12
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    kc = rng.standard_normal((b, g, t_max, d)).astype(np.float32)
    pages = rng.standard_normal((6, g, p, d)).astype(np.float32)
    table = np.array([[0, 1, 2], [3, 4, -1]], np.int32)
    lengths = np.array([10, 5])
    call = "paged"
    if kind == "negative length":
        lengths, call = np.array([-1, 5]), "both"
    elif kind == "length past T_max":
        lengths, call = np.array([t_max + 1, 5]), "contiguous"
    elif kind == "float lengths":
        lengths, call = np.array([1.0, 2.0]), "both"
    elif kind == "lengths shape":
        lengths, call = np.array([1, 2, 3]), "both"
    elif kind == "page id too large":
        table = table.copy(); table[0, 2] = 6
    elif kind == "page id -1 needed":
        lengths = np.array([10, 9])  # sequence 1 needs its third page, which is -1
    elif kind == "length past the table":
        lengths = np.array([13, 5])
    elif kind == "page table float":
        table = table.astype(np.float32)
    elif kind == "page table rank":
        table = table[0]
    elif kind == "splits 0":
        call = "both"
    elif kind == "splits -1":
        call = "both"
    elif kind == "float64 cache":
        kc, pages, call = kc.astype(np.float64), pages.astype(np.float64), "both"
    elif kind == "zero-slot pages":
        pages, lengths = pages[:, :, :0], np.array([0, 0])
    elif kind == "G does not divide H":
        kc, pages, call = kc[:, :1].repeat(3, axis=1), pages[:, :1].repeat(3, axis=1), "both"
    elif kind == "table batch":
        table = table[:1]
    splits = {"splits 0": 0, "splits -1": -1}.get(kind)
    error = TypeError if kind in ("float lengths", "page table float", "float64 cache") else ValueError
    if call in ("contiguous", "both"):
        with pytest.raises(error):
            kernels.decode(q, kc, kc, lengths, splits=splits)
    if call in ("paged", "both"):
        with pytest.raises(error):
            kernels.paged_decode(q, pages, pages, table, lengths, splits=splits)



def test_lengths_narrow_to_int32_once_at_the_door_or_are_refused():
    """The compiled kernels read lengths as int32, like the page table. kernels.py narrows them
    once, after the range check, and refuses a length that int32 cannot hold rather than wrap it
    (2**31 would become -2**31). A table of 2**21 + 1 pages of 1024 slots admits such a length."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 4)).astype(np.float32)
    pages = rng.standard_normal((1, 1, 1024, 4)).astype(np.float32)
    table = np.zeros((1, 2**21 + 1), np.int32)  # max_pages * page_size = 2**31 + 1024
    with pytest.raises(ValueError, match=r"lengths must fit in int32 .* lengths\[0\] = 2147483648"):
        kernels.paged_decode(q, pages, pages, table, np.array([2**31], np.int64))
    # In range, an int64 or uint16 array reaches the kernel as int32 and decodes as usual.
    kc = rng.standard_normal((1, 1, 6, 4)).astype(np.float32)
    for dtype in (np.int64, np.uint16, np.int8):
        o = kernels.decode(q, kc, kc, np.array([5], dtype))
        np.testing.assert_array_equal(o, kernels.decode(q, kc, kc, np.array([5], np.int32)))

# ---- the C++ side checks again ------------------------------------------------------------------

def test_binding_refuses_what_kernels_py_would_have_caught():
    """Called directly, refmath._C still checks layout, dtype, lengths and page ids before any work
    (std::invalid_argument becomes ValueError)."""
    c = kernels._C
    q = np.zeros((1, 2, 4, 8), np.float32)
    k = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        c.flash_forward(np.zeros((1, 2, 4, 16), np.float32)[..., ::2], k, k, False, 0, 1.0)
    with pytest.raises(TypeError, match="float32"):
        c.flash_forward(q.astype(np.float64), k, k, False, 0, 1.0)
    with pytest.raises(ValueError, match="divide"):
        c.flash_forward(np.zeros((1, 3, 4, 8), np.float32), np.zeros((1, 2, 4, 8), np.float32),
                        np.zeros((1, 2, 4, 8), np.float32), False, 0, 1.0)
    with pytest.raises(ValueError, match="window"):
        c.flash_forward(q, k, k, True, -1, 1.0)
    with pytest.raises(ValueError, match="lse"):
        c.flash_backward(q, q, k, k, q, np.zeros((1, 2, 5), np.float32), False, 0, 1.0)
    qd = np.zeros((2, 2, 8), np.float32)
    cache = np.zeros((2, 1, 6, 8), np.float32)
    with pytest.raises(ValueError, match="lengths"):
        c.decode(qd, cache, cache, np.array([7, 0], np.int32), 1.0, 0)
    with pytest.raises(ValueError, match="lengths"):
        c.decode(qd, cache, cache, np.array([-1, 0], np.int32), 1.0, 0)
    with pytest.raises(TypeError, match="int32"):  # lengths are int32 in every compiled kernel
        c.decode(qd, cache, cache, np.array([1, 0], np.int64), 1.0, 0)
    pages = np.zeros((3, 1, 4, 8), np.float32)
    table = np.array([[0, 1], [2, -1]], np.int32)
    with pytest.raises(ValueError, match=r"page_table\[1, 1\]"):
        c.paged_decode(qd, pages, pages, table, np.array([8, 5], np.int32), 1.0, 0)
    with pytest.raises(ValueError, match="page_table"):
        c.paged_decode(qd, pages, pages, np.array([[0, 3], [2, -1]], np.int32),
                       np.array([8, 1], np.int32), 1.0, 0)
    with pytest.raises(ValueError, match="lengths"):
        c.paged_decode(qd, pages, pages, table, np.array([9, 1], np.int32), 1.0, 0)
    with pytest.raises(ValueError, match="splits"):
        c.decode(qd, cache, cache, np.array([1, 0], np.int32), 1.0, -2)


def _zeros(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)


@pytest.mark.parametrize("call, match", [
    # zero key/value heads, with and without query heads (H / G on the C++ side)
    (lambda c: c.flash_forward(_zeros(1, 0, 4, 8), _zeros(1, 0, 4, 8), _zeros(1, 0, 4, 8), False, 0,
                               1.0), "kv_heads = 0"),
    (lambda c: c.flash_forward(_zeros(1, 2, 4, 8), _zeros(1, 0, 4, 8), _zeros(1, 0, 4, 8), True, 0,
                               1.0), "kv_heads = 0"),
    (lambda c: c.flash_backward(_zeros(1, 0, 4, 8), _zeros(1, 0, 4, 8), _zeros(1, 0, 4, 8),
                                _zeros(1, 0, 4, 8), _zeros(1, 0, 4, 8), _zeros(1, 0, 4), False, 0,
                                1.0), "kv_heads = 0"),
    (lambda c: c.decode(_zeros(1, 0, 8), _zeros(1, 0, 4, 8), _zeros(1, 0, 4, 8),
                        np.array([2], np.int32), 1.0, 0), "kv_heads = 0"),
    (lambda c: c.paged_decode(_zeros(1, 0, 8), _zeros(2, 0, 4, 8), _zeros(2, 0, 4, 8),
                              np.zeros((1, 1), np.int32), np.array([2], np.int32), 1.0, 0),
     "kv_heads = 0"),
    # heads that G does not divide
    (lambda c: c.decode(_zeros(1, 3, 8), _zeros(1, 2, 4, 8), _zeros(1, 2, 4, 8),
                        np.array([2], np.int32), 1.0, 0), "divide heads = 3"),
    # zero head width, zero page size, negative options
    (lambda c: c.flash_forward(_zeros(1, 1, 4, 0), _zeros(1, 1, 4, 0), _zeros(1, 1, 4, 0), False, 0,
                               1.0), "head_dim"),
    (lambda c: c.decode(_zeros(1, 1, 0), _zeros(1, 1, 4, 0), _zeros(1, 1, 4, 0),
                        np.array([2], np.int32), 1.0, 0), "head_dim"),
    (lambda c: c.paged_decode(_zeros(1, 1, 8), _zeros(2, 1, 0, 8), _zeros(2, 1, 0, 8),
                              np.zeros((1, 1), np.int32), np.array([0], np.int32), 1.0, 0),
     "page_size"),
    (lambda c: c.flash_forward(_zeros(1, 1, 4, 8), _zeros(1, 1, 4, 8), _zeros(1, 1, 4, 8), True,
                               -5, 1.0), "window"),
    (lambda c: c.paged_decode(_zeros(1, 1, 8), _zeros(2, 1, 4, 8), _zeros(2, 1, 4, 8),
                              np.zeros((1, 1), np.int32), np.array([2], np.int32), 1.0, -1),
     "splits"),
    (lambda c: c.decode(_zeros(1, 1, 8), _zeros(1, 1, 4, 8), _zeros(1, 1, 4, 8),
                        np.array([2], np.int32), float("nan"), 0), "scale"),
    (lambda c: c.set_backward_schedule(-1), "schedule"),
], ids=["fwd H0 G0", "fwd G0", "bwd H0 G0", "decode G0", "paged G0", "decode G!|H", "fwd D0",
        "decode D0", "paged page_size 0", "window -5", "splits -1", "scale NaN", "schedule -1"])
def test_binding_refuses_zero_heads_widths_and_negative_options(call, match):
    """Every compiled entry point refuses sizes and options it cannot run with (issue 15: the CUDA
    side divided by G = 0); called directly, not through refmath.kernels."""
    with pytest.raises(ValueError, match=match):
        call(kernels._C)


def test_binding_runs_empty_shapes():
    """Zero batch, zero query heads (with G >= 1) and zero lengths are work of size 0, not errors."""
    c = kernels._C
    o, lse = c.flash_forward(_zeros(0, 2, 4, 8), _zeros(0, 1, 4, 8), _zeros(0, 1, 4, 8), True, 0, 1.0)
    assert o.shape == (0, 2, 4, 8) and lse.shape == (0, 2, 4)
    o, lse = c.flash_forward(_zeros(1, 0, 4, 8), _zeros(1, 1, 4, 8), _zeros(1, 1, 4, 8), True, 0, 1.0)
    assert o.shape == (1, 0, 4, 8)
    o, lse = c.flash_forward(_zeros(1, 1, 3, 8), _zeros(1, 1, 0, 8), _zeros(1, 1, 0, 8), False, 0, 1.0)
    assert (o == 0).all() and (lse == -np.inf).all()
    assert c.decode(_zeros(1, 0, 8), _zeros(1, 1, 4, 8), _zeros(1, 1, 4, 8), np.array([2], np.int32),
                    1.0, 0).shape == (1, 0, 8)
    assert (c.paged_decode(_zeros(1, 2, 8), _zeros(0, 1, 4, 8), _zeros(0, 1, 4, 8),
                           np.zeros((1, 0), np.int32), np.array([0], np.int32), 1.0, 0) == 0).all()


def test_kernels_release_the_gil():
    """Two Python threads running a kernel at once finish together, not one after the other: the GIL
    is released while the C++ code runs (checked by the result, not by timing)."""
    import threading

    q, k, v, _ = make_qkv(0, 1, 4, 2, 300, 300, 32)
    expected, _ = kernels.flash_attention_forward(q, k, v, causal=True)
    results = [None] * 4

    def work(i):
        results[i] = kernels.flash_attention_forward(q, k, v, causal=True)[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        np.testing.assert_array_equal(r, expected)
