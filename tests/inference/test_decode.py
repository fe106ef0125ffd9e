"""Attention over a cache, one function per layout with a backend: the backends agree.

The "cpu" backend is held to the kernel tests' rule: its error against a float64 reference is at
most twice that of NumPy's float32 computation of the same thing, plus a few float32 ulps of the
output's magnitude.
"""
import numpy as np
import pytest

from refmath import kernels
from refmath.attention import sdpa_forward
from refmath.inference.decode import decode_attention, paged_decode_attention
from _support import float32_rule

needs_cpu_kernels = pytest.mark.skipif(not kernels.cpu_available(),
                                       reason="the C++ module refmath._C is not built")
U32 = np.finfo(np.float32).eps


def _cache(seed, lengths, h, g, d, t_max):
    """q (B, H, D) and contiguous caches (B, G, T_max, D) whose unused slots hold NaN."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((len(lengths), h, d))
    k, v = rng.standard_normal((2, len(lengths), g, t_max, d))
    for b, n in enumerate(lengths):
        k[b, :, n:] = v[b, :, n:] = np.nan
    return q, k, v


def _paged(k, v, lengths, page_size, seed):
    """The same caches cut into pages of a shuffled pool, and the page table that finds them."""
    b, g, t_max, d = k.shape
    per_seq = -(-t_max // page_size)
    n_pages = b * per_seq
    order = np.random.default_rng(seed).permutation(n_pages)  # pages scattered over the pool
    k_pages = np.full((n_pages, g, page_size, d), np.nan, dtype=k.dtype)
    v_pages = np.full((n_pages, g, page_size, d), np.nan, dtype=v.dtype)
    table = np.full((b, per_seq), -1)
    for s, n in enumerate(lengths):
        for i in range(-(-n // page_size)):
            page, lo, hi = order[s * per_seq + i], i * page_size, min(n, (i + 1) * page_size)
            table[s, i] = page
            k_pages[page, :, :hi - lo] = k[s, :, lo:hi]
            v_pages[page, :, :hi - lo] = v[s, :, lo:hi]
    return k_pages, v_pages, table


SHAPES = [  # lengths, H, G, D
    ([5, 0, 17], 4, 4, 8),  # MHA, one empty sequence
    ([33, 1], 6, 2, 16),  # GQA
    ([64], 8, 1, 32),  # MQA
]


@pytest.mark.parametrize("lengths, h, g, d", SHAPES)
def test_paged_reference_equals_the_contiguous_reference(lengths, h, g, d):
    q, k, v = _cache(1, lengths, h, g, d, max(lengths) + 3)
    out = decode_attention(q, k, v, lengths)
    assert np.isfinite(out).all()  # the NaN slots past each length were never read
    np.testing.assert_array_equal(out[np.asarray(lengths) == 0], 0.0)
    for page_size in (1, 4, 16):
        paged = paged_decode_attention(q, *_paged(k, v, lengths, page_size, seed=2), lengths)
        np.testing.assert_allclose(paged, out, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("lengths, h, g, d", SHAPES)
def test_a_softcap_caps_each_score_contiguous_and_paged_alike_n19(lengths, h, g, d):
    # scale 1 makes the raw scores (std sqrt(D)) large against the cap of 2: the cap is in effect
    q, k, v = _cache(8, lengths, h, g, d, max(lengths) + 3)
    out = decode_attention(q, k, v, lengths, scale=1.0, softcap=2.0)
    for b, n in enumerate(lengths):  # sequence by sequence: dense attention with the same cap
        heads = np.arange(h) // (h // g)
        want = sdpa_forward(q[b][:, None], k[b, heads, :n], v[b, heads, :n], scale=1.0,
                            softcap=2.0)[0][:, 0]
        np.testing.assert_allclose(out[b], want, rtol=1e-13, atol=1e-15)
    assert np.abs(out - decode_attention(q, k, v, lengths, scale=1.0)).max() > 1e-2
    for page_size in (1, 4):
        paged = paged_decode_attention(q, *_paged(k, v, lengths, page_size, seed=9), lengths,
                                       scale=1.0, softcap=2.0)
        np.testing.assert_allclose(paged, out, rtol=1e-12, atol=1e-14)


def test_the_kernels_refuse_a_softcap_in_one_line():
    q, k, v = (x.astype(np.float32) for x in _cache(10, [3], 2, 1, 4, 4))
    k_pages, v_pages, table = _paged(k, v, [3], 2, seed=11)
    message = (r"^softcap = 30.0 is not supported on backend='cpu' \(the compiled kernels do not "
               r"cap scores\); use backend='numpy'$")
    with pytest.raises(ValueError, match=message):
        decode_attention(q, k, v, [3], backend="cpu", softcap=30.0)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(q, k_pages, v_pages, table, [3], backend="cpu", softcap=30.0)
    with pytest.raises(ValueError, match=r"softcap must be a finite number > 0, got 0"):
        paged_decode_attention(q, k_pages, v_pages, table, [3], softcap=0)


@needs_cpu_kernels
@pytest.mark.parametrize("lengths, h, g, d", SHAPES)
def test_the_cpu_backend_matches_the_reference(lengths, h, g, d):
    q, k, v = _cache(3, lengths, h, g, d, max(lengths) + 3)
    ref64 = decode_attention(q, k, v, lengths)
    f32 = [x.astype(np.float32) for x in (q, k, v)]
    numpy32 = decode_attention(*f32, lengths)
    floor = 4 * U32 * np.abs(ref64).max()
    float32_rule("cpu backend, contiguous", decode_attention(*f32, lengths, backend="cpu"), ref64,
                 numpy32, 2, floor)
    k_pages, v_pages, table = _paged(*f32[1:], lengths, 4, seed=4)
    paged32 = paged_decode_attention(f32[0], k_pages, v_pages, table, lengths, backend="cpu")
    float32_rule("cpu backend, paged", paged32, ref64, numpy32, 2, floor)


def test_a_page_table_entry_a_length_needs_must_be_a_page():
    q, k, v = _cache(5, [6], 2, 1, 4, 8)
    k_pages, v_pages, table = _paged(k, v, [6], 4, seed=6)
    table[0, 1] = k_pages.shape[0]
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] = 2 is not a page id in \[0, n_pages = 2\)"):
        paged_decode_attention(q, k_pages, v_pages, table, [6])


def test_bad_backends_and_arrays_name_the_argument():
    q, k, v = _cache(7, [3], 2, 2, 4, 4)
    with pytest.raises(ValueError, match="backend must be one of 'numpy', 'cpu', 'cuda', got 'gpu'"):
        decode_attention(q, k, v, [3], backend="gpu")
    with pytest.raises(TypeError, match="backend='cuda' needs CuPy arrays; k_cache, q, v_cache are on the host"):
        decode_attention(q, k, v, [3], backend="cuda")
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 5\), got values in \[9, 9\]"):
        decode_attention(q, k, v, [9])
    with pytest.raises(ValueError, match=r"G = 2 of k_cache.shape = \(1, 2, 4, 4\) must divide the query heads H = 3"):
        decode_attention(q[:, :1].repeat(3, axis=1), k, v, [3])
