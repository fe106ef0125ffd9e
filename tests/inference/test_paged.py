"""The paged KV cache: page arithmetic (K10), prefix sharing with copy on write (K11), paged decode
against contiguous decode, the allocator's bookkeeping, and bad use that must change nothing."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refmath.inference.decode import decode_attention
from refmath.inference.paged import (
    OutOfPagesError,
    PageAllocator,
    PagedKVCache,
    page_and_offset,
    pages_needed,
)

PROPERTY = settings(max_examples=40, deadline=None)


def _tokens(rng, t, g, d, dtype=np.float64):
    k, v = rng.standard_normal((2, t, g, d)).astype(dtype)
    return k, v


def _snapshot(cache):
    """Everything a failed call must leave as it was: allocator, tables, lengths and storage."""
    alloc = cache.allocator
    return {
        "free": alloc.free_pages(),
        "refcounts": [alloc.refcount(i) for i in range(alloc.n_pages)],
        "tables": {s: (cache.page_table(s), cache.length(s)) for s in cache.seq_ids},
        "stats": (cache.pages_used, cache.pages_free, cache.tokens_stored, cache.waste_total),
        "k": cache.k_pages.copy(),
        "v": cache.v_pages.copy(),
    }


def _assert_unchanged(before, cache):
    after = _snapshot(cache)
    for key in ("free", "refcounts", "tables", "stats"):
        assert after[key] == before[key], key
    # The pool holds NaN in slots never written: NaN == NaN must count as unchanged.
    assert np.array_equal(after["k"], before["k"], equal_nan=True)
    assert np.array_equal(after["v"], before["v"], equal_nan=True)


def _blank_unused_slots(cache):
    """Fill every slot that holds no token of any sequence with NaN (freed pages keep old data)."""
    live = np.zeros((cache.allocator.n_pages, cache.page_size), dtype=bool)
    for s in cache.seq_ids:
        for j in range(cache.length(s)):
            live[cache.locate(s, j)] = True
    # A (page, slot, head, width) view of the (page, head, slot, width) pool: index by slot.
    cache.k_pages.transpose(0, 2, 1, 3)[~live] = np.nan
    cache.v_pages.transpose(0, 2, 1, 3)[~live] = np.nan


# ---- K10: page arithmetic ------------------------------------------------------------------------

@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_k10_position_maps_to_page_and_offset(p):
    for j in range(4 * p + 3):
        page, offset = page_and_offset(j, p)
        # The catalogue's 1-based position j1 = j + 1 sits at floor((j1 - 1)/p), (j1 - 1) mod p.
        j1 = j + 1
        assert (page, offset) == (math.floor((j1 - 1) / p), (j1 - 1) % p)
        # ...which is the one way to write j = page p + offset with 0 <= offset < p.
        assert page * p + offset == j and 0 <= offset < p


def test_k10_cache_stores_each_position_at_its_page_and_offset():
    rng = np.random.default_rng(0)
    cache = PagedKVCache(8, 3, 2, 4)
    cache.add_sequence("a")
    k, v = _tokens(rng, 10, 2, 4)
    cache.append("a", k[:4], v[:4])
    cache.append("a", k[4:], v[4:])
    table = cache.page_table("a")
    for j in range(10):
        page, offset = cache.locate("a", j)
        assert (page, offset) == (table[j // 3], j % 3)
        np.testing.assert_array_equal(cache.k_pages[page, :, offset], k[j])
        np.testing.assert_array_equal(cache.v_pages[page, :, offset], v[j])


@pytest.mark.parametrize("p", [1, 3, 4])
def test_k10_a_sequence_of_t_tokens_holds_ceil_t_over_p_pages_and_wastes_under_p(p):
    cache = PagedKVCache(16, p, 1, 2)
    rng = np.random.default_rng(p)
    for t in range(0, 13):
        cache.add_sequence(t)
        cache.append(t, *_tokens(rng, t, 1, 2))
        assert pages_needed(t, p) == math.ceil(t / p)
        assert len(cache.page_table(t)) == math.ceil(t / p)
        assert cache.waste(t) == math.ceil(t / p) * p - t
        assert 0 <= cache.waste(t) < p
        cache.free_sequence(t)
    assert cache.pages_used == 0


def test_statistics_of_several_sequences():
    rng = np.random.default_rng(1)
    cache = PagedKVCache(10, 4, 1, 2)
    for s, t in (("a", 5), ("b", 8), ("c", 1)):
        cache.add_sequence(s)
        cache.append(s, *_tokens(rng, t, 1, 2))
    # pages: ceil(5/4) + ceil(8/4) + ceil(1/4) = 2 + 2 + 1
    assert (cache.pages_used, cache.pages_free) == (5, 5)
    assert cache.tokens_stored == 14
    assert [cache.waste(s) for s in "abc"] == [3, 0, 3]
    assert cache.waste_total == 6


# ---- storage and gather --------------------------------------------------------------------------

def test_gather_returns_exactly_the_tokens_appended():
    rng = np.random.default_rng(2)
    cache = PagedKVCache(20, 3, 2, 3)
    expected = {}
    for s in ("x", "y", "z"):
        cache.add_sequence(s)
        expected[s] = ([], [])
    # Interleaved appends of 1..4 tokens, so each sequence's pages are not adjacent in the pool.
    for step, count in enumerate([2, 4, 1, 3, 3, 1, 4, 2, 2]):
        s = "xyz"[step % 3]
        k, v = _tokens(rng, count, 2, 3)
        cache.append(s, k, v)
        expected[s][0].append(k)
        expected[s][1].append(v)
    for s, (ks, vs) in expected.items():
        k, v = cache.gather(s)
        assert k.shape == v.shape == (sum(len(x) for x in ks), 2, 3)
        np.testing.assert_array_equal(k, np.concatenate(ks))
        np.testing.assert_array_equal(v, np.concatenate(vs))


def test_page_table_array_is_int32_padded_with_minus_one():
    rng = np.random.default_rng(3)
    cache = PagedKVCache(10, 2, 1, 1)
    for s, t in (("a", 5), ("b", 0), ("c", 2)):
        cache.add_sequence(s)
        cache.append(s, *_tokens(rng, t, 1, 1))
    tables, lengths = cache.page_table_array(["c", "a", "b"])
    assert tables.dtype == np.int32 and lengths.dtype == np.int32
    assert tables.shape == (3, 3)  # the longest table: ceil(5/2) = 3 pages
    np.testing.assert_array_equal(tables[0], cache.page_table("c") + [-1, -1])
    np.testing.assert_array_equal(tables[1], cache.page_table("a"))
    np.testing.assert_array_equal(tables[2], [-1, -1, -1])
    np.testing.assert_array_equal(lengths, [2, 5, 0])


def test_allocator_hands_out_pages_in_order_then_reuses_the_last_freed():
    alloc = PageAllocator(4, 2)
    assert [alloc.allocate() for _ in range(3)] == [0, 1, 2]
    assert (alloc.n_used, alloc.n_free) == (3, 1)
    assert alloc.incref(1) == 2
    assert alloc.decref(1) == 1 and alloc.refcount(1) == 1  # still held once: not freed
    assert alloc.decref(1) == 0
    assert alloc.decref(0) == 0
    assert alloc.free_pages() == [0, 1, 3]
    assert alloc.allocate() == 0  # the most recently freed page comes back first
    assert (alloc.n_used, alloc.n_free) == (2, 2)


# ---- paged decode equals contiguous decode -------------------------------------------------------

def _scrambled_cache(rng, lengths, p, g, d, dtype=np.float64):
    """A cache whose page tables are out of pool order. First one-token sequences take every page
    and are freed in a random order, which scrambles the free list; then the sequences' appends
    interleave, with a scratch sequence taking and returning pages in between."""
    n_pages = sum(pages_needed(t, p) for t in lengths) + 2
    cache = PagedKVCache(n_pages, p, g, d, dtype)
    for i in range(n_pages):
        cache.add_sequence(("filler", i))
        cache.append(("filler", i), *_tokens(rng, 1, g, d, dtype))
    for i in rng.permutation(n_pages):
        cache.free_sequence(("filler", int(i)))
    written = [0] * len(lengths)
    for s in range(len(lengths)):
        cache.add_sequence(s)
    step = 0
    while written != list(lengths):
        s = step % len(lengths)
        n = min(int(rng.integers(1, p + 2)), lengths[s] - written[s])
        if step % 3 == 0:
            cache.add_sequence("scratch")
            cache.append("scratch", *_tokens(rng, int(rng.integers(1, 2 * p)), g, d, dtype))
        cache.append(s, *_tokens(rng, n, g, d, dtype))
        if step % 3 == 0:
            cache.free_sequence("scratch")
        written[s] += n
        step += 1
    return cache


def _contiguous(cache, seq_ids):
    """The sequences gathered into a contiguous (B, g, T_max, d) cache, padded with NaN: slots past
    a sequence's length must never be read."""
    t_max = max(cache.length(s) for s in seq_ids)
    shape = (len(seq_ids), cache.n_kv_heads, t_max, cache.head_dim)
    k, v = np.full(shape, np.nan, cache.dtype), np.full(shape, np.nan, cache.dtype)
    for b, s in enumerate(seq_ids):
        t = cache.length(s)
        k_s, v_s = cache.gather(s)  # (t, g, d)
        k[b, :, :t], v[b, :, :t] = k_s.transpose(1, 0, 2), v_s.transpose(1, 0, 2)
    return k, v, np.array([cache.length(s) for s in seq_ids])


@pytest.mark.parametrize("h, g", [(6, 2), (4, 4), (4, 1)])  # GQA, MHA, MQA
def test_paged_decode_equals_contiguous_decode(h, g):
    rng = np.random.default_rng(h * 10 + g)
    lengths, p, d = [7, 1, 12, 0, 5, 9], 4, 3
    cache = _scrambled_cache(rng, lengths, p, g, d)
    tables = [cache.page_table(s) for s in range(len(lengths))]
    assert any(t != sorted(t) for t in tables), "the page tables should not be in pool order"
    _blank_unused_slots(cache)
    assert np.isnan(cache.k_pages).any() and np.isnan(cache.v_pages).any()

    seqs = [2, 0, 5, 3, 1, 4]
    q = rng.standard_normal((len(seqs), h, d))
    out = cache.decode(q, seqs)
    k, v, lens = _contiguous(cache, seqs)
    ref = decode_attention(q, k, v, lens)
    assert out.shape == (len(seqs), h, d) and np.isfinite(out).all()
    # Paging reorders the sums (page by page, F3 merges), so rounding differs. Each entry's error is
    # a few ulps of the largest |v|, not of the entry itself, hence atol on that scale.
    np.testing.assert_allclose(out, ref, rtol=1e-13, atol=1e-13 * np.nanmax(np.abs(v)))
    np.testing.assert_array_equal(out[seqs.index(3)], 0.0)  # the empty sequence sees no key


def test_paged_decode_with_an_explicit_scale_and_float32():
    rng = np.random.default_rng(7)
    lengths, p, g, d, h = [6, 3, 10], 4, 1, 5, 2
    cache64 = _scrambled_cache(np.random.default_rng(8), lengths, p, g, d)
    cache32 = _scrambled_cache(np.random.default_rng(8), lengths, p, g, d, np.float32)
    # The same operations give the same page tables; give the float32 pool the float64 tokens.
    assert [cache32.page_table(s) for s in range(3)] == [cache64.page_table(s) for s in range(3)]
    cache32.k_pages[:], cache32.v_pages[:] = cache64.k_pages, cache64.v_pages
    _blank_unused_slots(cache32)
    seqs = [0, 1, 2]
    q = rng.standard_normal((3, h, d))
    k, v, lens = _contiguous(cache64, seqs)
    ref = decode_attention(q, k, v, lens, scale=0.3)
    np.testing.assert_allclose(cache64.decode(q, seqs, scale=0.3), ref,
                               rtol=1e-13, atol=1e-13 * np.nanmax(np.abs(v)))
    # float32 in, float32 out; the keys, values and query were rounded to float32 (relative 6e-8)
    # and the sums carry a few more float32 roundings, so 1e-5 of the value scale is ample.
    out32 = cache32.decode(q.astype(np.float32), seqs, scale=0.3)
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32, ref, rtol=0, atol=1e-5 * np.nanmax(np.abs(v)))


# ---- K11: prefix sharing, reference counts, copy on write ----------------------------------------

def test_k11_fork_shares_pages_and_copy_on_write_protects_the_parent():
    rng = np.random.default_rng(4)
    cache = PagedKVCache(8, 4, 2, 3)
    cache.add_sequence("parent")
    k, v = _tokens(rng, 6, 2, 3)  # pages: one full (4 tokens), one partial (2 of 4)
    cache.append("parent", k, v)
    used = cache.pages_used
    cache.fork("parent", "child")
    shared = cache.page_table("parent")
    assert cache.page_table("child") == shared and cache.length("child") == 6
    assert [cache.allocator.refcount(pg) for pg in shared] == [2, 2]
    assert cache.pages_used == used  # forking copies nothing
    # Appending no tokens writes nothing, so it must not copy the shared page either.
    before = _snapshot(cache)
    cache.append("child", np.zeros((0, 2, 3)), np.zeros((0, 2, 3)))
    _assert_unchanged(before, cache)

    k_new, v_new = _tokens(rng, 1, 2, 3)
    cache.append("child", k_new, v_new)
    child = cache.page_table("child")
    assert child[0] == shared[0]  # the full page stays shared
    assert child[1] != shared[1]  # the partial last page was copied before the write
    assert [cache.allocator.refcount(pg) for pg in shared] == [2, 1]
    assert cache.allocator.refcount(child[1]) == 1
    assert cache.pages_used == used + 1
    # The parent's tokens are untouched; the child has the shared prefix plus its own token.
    np.testing.assert_array_equal(cache.gather("parent")[0], k)
    np.testing.assert_array_equal(cache.gather("parent")[1], v)
    np.testing.assert_array_equal(cache.gather("child")[0], np.concatenate([k, k_new]))
    np.testing.assert_array_equal(cache.gather("child")[1], np.concatenate([v, v_new]))

    # Freeing the parent keeps the page the child still holds.
    cache.free_sequence("parent")
    assert cache.allocator.refcount(shared[0]) == 1
    assert cache.allocator.refcount(shared[1]) == 0 and shared[1] in cache.allocator.free_pages()
    np.testing.assert_array_equal(cache.gather("child")[0], np.concatenate([k, k_new]))
    assert cache.pages_used == 2


def test_k11_parent_appending_after_fork_also_copies_and_full_pages_need_no_copy():
    rng = np.random.default_rng(5)
    cache = PagedKVCache(8, 2, 1, 2)
    cache.add_sequence("a")
    k, v = _tokens(rng, 4, 1, 2)  # exactly two full pages
    cache.append("a", k, v)
    cache.fork("a", "b")
    cache.append("a", *_tokens(rng, 1, 1, 2))
    # The last shared page was full: a new page is taken, nothing copied, both pages stay shared.
    assert cache.page_table("a")[:2] == cache.page_table("b")
    assert [cache.allocator.refcount(pg) for pg in cache.page_table("b")] == [2, 2]
    # Now b forks a (3 pages, the last one partial) and the *parent* appends: the parent copies.
    cache.fork("a", "c")
    before_c = cache.gather("c")
    cache.append("a", *_tokens(rng, 1, 1, 2))
    assert cache.page_table("a")[2] != cache.page_table("c")[2]
    np.testing.assert_array_equal(cache.gather("c")[0], before_c[0])
    np.testing.assert_array_equal(cache.gather("a")[0][:5], before_c[0])


# ---- bad use raises and changes nothing ----------------------------------------------------------

@pytest.fixture
def full_cache():
    """Pool of 5 pages of 2 slots: 'a' holds 3 tokens (2 pages), 'b' holds 4 (2 pages); 1 free."""
    rng = np.random.default_rng(6)
    cache = PagedKVCache(5, 2, 2, 3)
    for s, t in (("a", 3), ("b", 4)):
        cache.add_sequence(s)
        cache.append(s, *_tokens(rng, t, 2, 3))
    return cache


def _fails(cache, error, match, call, *args):
    before = _snapshot(cache)
    with pytest.raises(error, match=match):
        call(*args)
    _assert_unchanged(before, cache)


def test_reading_past_the_end_or_an_unknown_sequence_raises(full_cache):
    c = full_cache
    _fails(c, IndexError, "position 3 is past the end of sequence 'a' of length 3",
           c.locate, "a", 3)
    _fails(c, IndexError, "position -1", c.token, "b", -1)
    for call, args in ((c.append, ("zz", np.zeros((1, 2, 3)), np.zeros((1, 2, 3)))),
                       (c.gather, ("zz",)), (c.fork, ("zz", "new")), (c.free_sequence, ("zz",)),
                       (c.page_table_array, (["a", "zz"],)), (c.waste, ("zz",)),
                       (c.decode, (np.zeros((1, 2, 3)), ["zz"]))):
        _fails(c, ValueError, "unknown sequence id 'zz'", call, *args)
    _fails(c, ValueError, "sequence id 'b' already exists", c.fork, "a", "b")
    _fails(c, ValueError, "sequence id 'a' already exists", c.add_sequence, "a")


def test_freeing_twice_and_page_ids_out_of_range_raise(full_cache):
    c = full_cache
    c.free_sequence("a")
    _fails(c, ValueError, "unknown sequence id 'a'", c.free_sequence, "a")
    free_page = c.allocator.free_pages()[0]
    _fails(c, ValueError, f"page {free_page} is already free", c.allocator.decref, free_page)
    _fails(c, ValueError, f"page {free_page} is free", c.allocator.incref, free_page)
    _fails(c, ValueError, r"page must be an int in \[0, 4\], got 5", c.allocator.decref, 5)
    _fails(c, ValueError, r"page must be an int in \[0, 4\], got -1", c.allocator.incref, -1)
    _fails(c, TypeError, "page must be an int, got 1.0", c.allocator.refcount, 1.0)


def test_running_out_of_pages_fails_before_writing_anything(full_cache):
    c = full_cache
    rng = np.random.default_rng(9)
    # 'a' has 1 free slot in its last page and the pool 1 free page: room for exactly 3 tokens.
    _fails(c, OutOfPagesError, "needs 2 free pages, but only 1 of 5", c.append, "a",
           *_tokens(rng, 4, 2, 3))
    c.append("a", *_tokens(rng, 3, 2, 3))
    assert c.pages_free == 0
    _fails(c, OutOfPagesError, "no free page", c.allocator.allocate)
    _fails(c, OutOfPagesError, "needs 1 free pages", c.append, "b", *_tokens(rng, 1, 2, 3))
    # A fork is free of charge, but copy on write then needs a page that is not there.
    c.free_sequence("b")
    c.add_sequence("d")
    c.append("d", *_tokens(rng, 3, 2, 3))  # 2 pages, the last one partial
    c.fork("d", "e")
    assert c.pages_free == 0
    _fails(c, OutOfPagesError, "needs 1 free pages", c.append, "e", *_tokens(rng, 1, 2, 3))


def test_keys_and_values_of_the_wrong_shape_or_dtype_raise(full_cache):
    c = full_cache
    good = np.zeros((2, 2, 3))
    for k, v, error, match in (
        (np.zeros((2, 3)), good, ValueError, r"k must have 3 dimensions \(t, g, d\)"),
        (np.zeros((2, 1, 3)), good, ValueError, r"k.shape\[1\] must be 2 to match .* n_kv_heads"),
        (good, np.zeros((2, 2, 4)), ValueError, r"v.shape\[2\] must be 3 to match .* head_dim"),
        (good, np.zeros((3, 2, 3)), ValueError, r"v.shape\[0\] must be 2"),
        (good.astype(np.float32), good, TypeError, "k has dtype float32 but the cache stores"),
        (good, good.astype(np.int64), TypeError, "v must be a floating-point array"),
    ):
        _fails(c, error, match, c.append, "a", k, v)


def test_decode_input_errors(full_cache):
    c = full_cache
    q = np.zeros((1, 2, 3))
    _fails(c, ValueError, "must divide the query heads", c.decode, np.zeros((1, 3, 3)), ["a"])
    _fails(c, ValueError, r"page_table.shape\[0\] must be 1", c.decode, q, ["a", "b"])
    _fails(c, ValueError, "backend must be one of 'numpy', 'cpu', 'cuda', got 'gpu'",
           c.decode, q, ["a"], None, "gpu")


# ---- random operation sequences keep the invariants (property) -----------------------------------

N_PAGES, P, G, D = 7, 3, 2, 2

# (operation, which live sequence, how many tokens). Appends are drawn most often: they are what
# fills the small pool and meets shared partial pages.
OPS = st.lists(
    st.tuples(st.sampled_from(["add", "append", "append", "append", "fork", "fork", "free"]),
              st.integers(0, 99), st.integers(0, 5)),
    min_size=10,
    max_size=40,
)


def _check_invariants(cache, model):
    alloc = cache.allocator
    free = alloc.free_pages()
    assert len(set(free)) == len(free), "a page is on the free list twice"
    holders = np.zeros(N_PAGES, dtype=int)
    for s in cache.seq_ids:
        for page in cache.page_table(s):
            holders[page] += 1
    for page in range(N_PAGES):
        # Every page is either free or held, and its count is the number of tables holding it.
        assert alloc.refcount(page) == holders[page]
        assert (page in free) == (holders[page] == 0)
    assert alloc.n_free + alloc.n_used == N_PAGES
    assert cache.pages_used == np.count_nonzero(holders)
    assert sorted(cache.seq_ids) == sorted(model)
    for s, values in model.items():
        k, v = cache.gather(s)
        expected = np.array(values, dtype=np.float64).reshape(-1, 1, 1) + _HEAD_OFFSETS
        np.testing.assert_array_equal(k, expected)
        np.testing.assert_array_equal(v, -expected)
        assert len(cache.page_table(s)) == pages_needed(len(values), P)
        assert 0 <= cache.waste(s) < P


# Token number n is stored as k = n + (offsets that tell heads and widths apart), v = -k: exact.
_HEAD_OFFSETS = np.arange(G * D, dtype=np.float64).reshape(G, D) / 8


@PROPERTY
@given(OPS)
def test_random_operations_keep_the_invariants(ops):
    cache = PagedKVCache(N_PAGES, P, G, D)
    model: dict[int, list[float]] = {}  # seq id -> the token numbers it holds, in order
    next_seq, next_token = 0, 0
    for op, pick, count in ops:
        live = sorted(model)
        if op == "add":
            cache.add_sequence(next_seq)
            model[next_seq] = []
            next_seq += 1
        elif not live:
            continue
        elif op == "append":
            s = live[pick % len(live)]
            values = list(range(next_token, next_token + count))
            k = np.array(values, dtype=np.float64).reshape(-1, 1, 1) + _HEAD_OFFSETS
            # Pages this append needs, worked out from the tables: new pages, plus one copy when
            # the last page is partly filled and another sequence holds it too.
            length, table = len(model[s]), cache.page_table(s)
            shared_last = bool(table) and any(
                table[-1] in cache.page_table(o) for o in live if o != s)
            need = pages_needed(length + count, P) - pages_needed(length, P)
            need += int(count > 0 and length % P != 0 and shared_last)
            if need > cache.pages_free:
                before = _snapshot(cache)
                with pytest.raises(OutOfPagesError):
                    cache.append(s, k, -k)
                _assert_unchanged(before, cache)
            else:
                cache.append(s, k, -k)
                model[s] += values
                next_token += count
        elif op == "fork":
            parent = live[pick % len(live)]
            cache.fork(parent, next_seq)
            model[next_seq] = list(model[parent])
            next_seq += 1
        elif op == "free":
            s = live[pick % len(live)]
            cache.free_sequence(s)
            del model[s]
        _check_invariants(cache, model)
    assert cache.tokens_stored == sum(len(v) for v in model.values())
