r"""A paged KV cache: fixed-size pages, page tables, reference counts and copy on write (K10, K11).

A contiguous KV cache reserves ``T_max`` slots per sequence up front. Paging instead cuts the cache
into pages of ``p`` token slots taken from one shared pool, and gives each sequence a *page table*:
the list of the physical pages that hold its logical pages 0, 1, 2, ... A sequence of ``T`` tokens
holds

.. math::
    n_\text{pages} = \left\lceil \frac{T}{p} \right\rceil

pages, and only its last page can be partly empty, so it wastes fewer than ``p`` slots (K10).

Positions are 0-based in code. Token ``j`` (0-based) lives in logical page ``j // p`` at offset
``j % p``. The catalogue counts positions from 1: its token :math:`j \in \{1, \dots, T\}` lives at
page :math:`\lfloor (j-1)/p \rfloor`, offset :math:`(j-1) \bmod p`, which is the same slot, because
the 1-based position ``j`` is the 0-based position ``j - 1``.

Paging changes *where* keys and values live, never their values: :meth:`PagedKVCache.decode` walks
a sequence's pages one by one, merging per-page softmax statistics with the online-softmax merge
(F3, :func:`refmath.inference.decode.paged_decode_attention`), and equals attention over a
contiguous cache (:func:`refmath.inference.decode.decode_attention`) up to rounding.

Prefix sharing (K11): :meth:`PagedKVCache.fork` gives a new sequence the pages of an existing one,
so a shared prompt is stored once. The pages are reference-counted, and a sequence that appends to
a shared, partly filled last page first copies it (copy on write). Sharing is only correct when the
two sequences would have computed the same keys and values: the same tokens at the same positions,
the same model parameters and the same settings (positional encoding, precision, ...). The cache
stores numbers and cannot check any of that; it is the caller's responsibility. A common *suffix*
after different earlier text is not shareable: its keys and values depend on everything before it.

The pool keeps every position appended to a sequence: a layer that slides a window needs only its
last ``w`` (the contiguous :class:`refmath.inference.kv_cache.KVCache` keeps only those), and a
caller here would free the pages that fall out of the window itself.

Every method checks its input before it changes anything, so a call that raises leaves the
allocator and the cache exactly as they were.
"""
from __future__ import annotations

import numpy as np

from refmath._validate import check_axis, check_int, check_ndim, float_array
from refmath.inference.decode import paged_decode_attention

__all__ = ["OutOfPagesError", "page_and_offset", "pages_needed", "PageAllocator", "PagedKVCache"]


class OutOfPagesError(RuntimeError):
    """Raised when an allocation needs more pages than the pool has free.

    A serving system catches it to pause or evict a sequence; it is a separate class so that it
    can be caught without also catching programming errors.
    """


def page_and_offset(j: int, page_size: int) -> tuple[int, int]:
    r"""The logical page and the offset in it of the 0-based position ``j`` (catalogue K10).

    .. math::
        \text{page} = \lfloor j / p \rfloor,\qquad \text{offset} = j \bmod p

    This is the catalogue's 1-based rule :math:`\lfloor (j'-1)/p \rfloor,\ (j'-1) \bmod p` with
    :math:`j' = j + 1`.
    """
    j = check_int("position j", j, 0)
    page_size = check_int("page_size", page_size, 1)
    return j // page_size, j % page_size


def pages_needed(n_tokens: int, page_size: int) -> int:
    r"""Pages needed for ``n_tokens`` tokens: :math:`\lceil T / p \rceil` (catalogue K10)."""
    n_tokens = check_int("n_tokens", n_tokens, 0)
    page_size = check_int("page_size", page_size, 1)
    return -(-n_tokens // page_size)  # ceiling division in integers, exact for any size


# ---- the page allocator --------------------------------------------------------------------------

class PageAllocator:
    """A fixed pool of ``n_pages`` physical page ids with a free list and reference counts.

    The allocator knows nothing of keys and values: it only hands out page ids and counts how many
    page tables hold each one. A page is *free* when its count is 0 and *used* otherwise; freeing
    (``decref``) the last reference returns the page to the free list.

    The free list is a stack: the most recently freed page is handed out next. A fresh pool hands
    out pages 0, 1, 2, ... in order; after some frees the order is scrambled, which is exactly what
    the page tables exist for.
    """

    def __init__(self, n_pages: int, page_size: int):
        self.n_pages = check_int("n_pages", n_pages, 1)
        self.page_size = check_int("page_size", page_size, 1)
        self._refcount = [0] * self.n_pages
        self._free = list(range(self.n_pages - 1, -1, -1))  # pop() takes from the end: page 0 first

    # -- statistics --

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_pages - len(self._free)

    def free_pages(self) -> list[int]:
        """A copy of the free list, in the order pages will be handed out (next one first)."""
        return self._free[::-1]

    def refcount(self, page: int) -> int:
        """How many page tables hold ``page`` (0 for a free page)."""
        return self._refcount[self._check_page(page)]

    # -- allocation --

    def _check_page(self, page) -> int:
        return check_int("page", page, 0, self.n_pages - 1)

    def allocate(self) -> int:
        """Take a free page, set its reference count to 1 and return its id.

        Raises :class:`OutOfPagesError` (changing nothing) when no page is free.
        """
        if not self._free:
            raise OutOfPagesError(f"no free page: all {self.n_pages} pages are in use")
        page = self._free.pop()
        self._refcount[page] = 1
        return page

    def incref(self, page: int) -> int:
        """Add a reference to a used page (one more page table holds it); returns the new count."""
        page = self._check_page(page)
        if self._refcount[page] == 0:
            raise ValueError(f"page {page} is free: only a used page can gain a reference")
        self._refcount[page] += 1
        return self._refcount[page]

    def decref(self, page: int) -> int:
        """Drop one reference to ``page`` (free it); returns the remaining count.

        When the count reaches 0 the page goes back on the free list. Its contents are left as they
        are: the next owner overwrites the slots it uses and never reads the others. Freeing a page
        that is already free raises ``ValueError`` naming the page.
        """
        page = self._check_page(page)
        if self._refcount[page] == 0:
            raise ValueError(f"page {page} is already free (double free)")
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            self._free.append(page)
        return self._refcount[page]


# ---- the paged cache -----------------------------------------------------------------------------

class PagedKVCache:
    r"""Keys and values of many sequences of one attention layer, stored in pages (K10, K11).

    Storage: ``k_pages`` and ``v_pages``, each shaped ``(n_pages, g, p, d)`` (page, key/value head,
    slot, head width). Slot ``s`` of head ``u`` in physical page ``P`` holds the key
    ``k_pages[P, u, s]``.

    Why the heads come before the slots: a decode kernel gives one thread block to one (sequence,
    key/value head) pair, so that the ``h/g`` query heads of a GQA group reuse every key it loads.
    For each page it reads the ``p x d`` keys of one head; with this layout that tile is one
    contiguous run of ``p d`` numbers (unit-stride, fully coalesced loads), whereas with
    ``(n_pages, p, g, d)`` it would be ``p`` runs of ``d`` numbers with gaps of ``(g-1) d`` between
    them. The price is paid on the write: appending a token writes ``g`` runs of ``d`` numbers
    instead of one run of ``g d``, but a token is written once and then read at every later step.

    Per sequence the cache keeps a page table (physical page ids, logical page order) and a length.
    The pool starts filled with NaN, so that reading a slot that was never written shows up at once
    instead of passing for a plausible number.
    """

    def __init__(self, n_pages: int, page_size: int, n_kv_heads: int, head_dim: int,
                 dtype=np.float64):
        self.allocator = PageAllocator(n_pages, page_size)
        self.page_size = self.allocator.page_size
        self.n_kv_heads = check_int("n_kv_heads", n_kv_heads, 1)
        self.head_dim = check_int("head_dim", head_dim, 1)
        self.dtype = np.dtype(dtype)
        if not np.issubdtype(self.dtype, np.floating):
            raise TypeError(f"dtype must be a floating-point type, got {self.dtype}")
        shape = (self.allocator.n_pages, self.n_kv_heads, self.page_size, self.head_dim)
        self.k_pages = np.full(shape, np.nan, dtype=self.dtype)
        self.v_pages = np.full(shape, np.nan, dtype=self.dtype)
        self._tables: dict = {}  # seq_id -> list of physical page ids, logical order
        self._lengths: dict = {}  # seq_id -> number of tokens stored

    # -- sequences --

    def _check_seq(self, seq_id):
        if seq_id not in self._tables:
            raise ValueError(
                f"unknown sequence id {seq_id!r} (the cache holds {len(self._tables)} sequences)")
        return seq_id

    def _check_new(self, seq_id):
        if seq_id in self._tables:
            raise ValueError(f"sequence id {seq_id!r} already exists")
        return seq_id

    @property
    def seq_ids(self) -> list:
        return list(self._tables)

    def add_sequence(self, seq_id) -> None:
        """Start an empty sequence (no pages: a page is taken on the first append)."""
        self._check_new(seq_id)
        self._tables[seq_id] = []
        self._lengths[seq_id] = 0

    def length(self, seq_id) -> int:
        return self._lengths[self._check_seq(seq_id)]

    def page_table(self, seq_id) -> list[int]:
        """A copy of the sequence's page table: physical page ids in logical order."""
        return list(self._tables[self._check_seq(seq_id)])

    def locate(self, seq_id, j: int) -> tuple[int, int]:
        """The physical page and the slot holding the 0-based position ``j`` of ``seq_id`` (K10)."""
        length = self.length(seq_id)
        j = check_int("j", j)
        if not 0 <= j < length:
            raise IndexError(
                f"position {j} is past the end of sequence {seq_id!r} of length {length}")
        logical, offset = page_and_offset(j, self.page_size)
        return self._tables[seq_id][logical], offset

    def token(self, seq_id, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the key and value of position ``j``, each ``(g, d)``."""
        page, offset = self.locate(seq_id, j)
        return self.k_pages[page, :, offset].copy(), self.v_pages[page, :, offset].copy()

    # -- writing --

    def _check_kv(self, k, v) -> tuple[np.ndarray, np.ndarray]:
        k = float_array("k", k)
        v = float_array("v", v)
        g, d = self.n_kv_heads, self.head_dim
        check_ndim("k", k, 3, "(t, g, d)")
        check_ndim("v", v, 3, "(t, g, d)")
        check_axis("k", k, 1, g, f"the cache's n_kv_heads = {g}")
        check_axis("k", k, 2, d, f"the cache's head_dim = {d}")
        check_axis("v", v, 0, k.shape[0], f"the number of new tokens t in k.shape = {k.shape}")
        check_axis("v", v, 1, g, f"the cache's n_kv_heads = {g}")
        check_axis("v", v, 2, d, f"the cache's head_dim = {d}")
        for name, x in (("k", k), ("v", v)):
            # No silent cast: float64 into a float32 cache would round, float32 into a float64
            # cache would pretend to a precision it does not have.
            if x.dtype != self.dtype:
                raise TypeError(f"{name} has dtype {x.dtype} but the cache stores {self.dtype}")
        return k, v

    def _needs_copy_on_write(self, seq_id) -> bool:
        """True when the last page is partly filled and shared: the next append must copy it."""
        # BEGIN SOLUTION
        table, length = self._tables[seq_id], self._lengths[seq_id]
        return length % self.page_size != 0 and self.allocator.refcount(table[-1]) > 1
        # END SOLUTION

    def pages_to_append(self, seq_id, n_tokens: int) -> int:
        """How many free pages appending ``n_tokens`` tokens to ``seq_id`` would take."""
        length = self.length(seq_id)
        n_tokens = check_int("n_tokens", n_tokens, 0)
        new = pages_needed(length + n_tokens, self.page_size) - len(self._tables[seq_id])
        copy = 1 if n_tokens and self._needs_copy_on_write(seq_id) else 0
        return new + copy

    def append(self, seq_id, k, v) -> None:
        """Append ``t`` tokens: ``k`` and ``v`` are ``(t, g, d)`` in the cache's dtype.

        Pages are taken on demand. When the sequence's last page is partly filled and shared with
        another sequence (after :meth:`fork`), it is first replaced by a private copy of its filled
        slots (copy on write), so the other sequence never sees these tokens. Full shared pages are
        never written again and stay shared.

        Everything is checked, including that enough pages are free, before anything is written:
        a failed append changes nothing.
        """
        self._check_seq(seq_id)
        k, v = self._check_kv(k, v)
        t = k.shape[0]
        need = self.pages_to_append(seq_id, t)
        if need > self.allocator.n_free:
            raise OutOfPagesError(
                f"appending {t} tokens to sequence {seq_id!r} needs {need} free pages, "
                f"but only {self.allocator.n_free} of {self.allocator.n_pages} are free"
            )
        if t == 0:
            return
        # BEGIN SOLUTION
        table, length = self._tables[seq_id], self._lengths[seq_id]

        if self._needs_copy_on_write(seq_id):
            shared = table[-1]
            private = self.allocator.allocate()
            filled = length % self.page_size  # only these slots belong to the sequence
            self.k_pages[private, :, :filled] = self.k_pages[shared, :, :filled]
            self.v_pages[private, :, :filled] = self.v_pages[shared, :, :filled]
            table[-1] = private
            self.allocator.decref(shared)  # still held by the other sequence(s)

        for i in range(t):
            logical, offset = page_and_offset(length + i, self.page_size)
            if logical == len(table):
                table.append(self.allocator.allocate())
            self.k_pages[table[logical], :, offset] = k[i]
            self.v_pages[table[logical], :, offset] = v[i]
        self._lengths[seq_id] = length + t
        # END SOLUTION

    def fork(self, parent_id, child_id) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares all its pages (K11).

        No key or value is copied: the child's page table is a copy of the parent's and every page
        gains a reference. The two then diverge through copy on write in :meth:`append`.

        Only fork when the child's cached prefix really is the parent's: the same tokens at the same
        positions, under the same parameters and settings. The cache cannot check this.
        """
        self._check_seq(parent_id)
        self._check_new(child_id)
        # BEGIN SOLUTION
        for page in self._tables[parent_id]:
            self.allocator.incref(page)
        self._tables[child_id] = list(self._tables[parent_id])
        self._lengths[child_id] = self._lengths[parent_id]
        # END SOLUTION

    def free_sequence(self, seq_id) -> None:
        """Forget ``seq_id`` and drop its reference to each of its pages (shared pages survive)."""
        self._check_seq(seq_id)
        for page in self._tables.pop(seq_id):
            self.allocator.decref(page)
        del self._lengths[seq_id]

    # -- reading --

    def gather(self, seq_id) -> tuple[np.ndarray, np.ndarray]:
        """The sequence's keys and values as contiguous ``(T, g, d)`` arrays, in position order.

        This copies the whole sequence; :meth:`decode` reads the pages in place instead.
        """
        table, length = self._tables[self._check_seq(seq_id)], self._lengths[seq_id]
        shape = (len(table) * self.page_size, self.n_kv_heads, self.head_dim)
        # (pages, g, p, d) -> (pages, p, g, d) -> (pages * p, g, d), then drop the unused slots
        k = self.k_pages[table].transpose(0, 2, 1, 3).reshape(shape)[:length]
        v = self.v_pages[table].transpose(0, 2, 1, 3).reshape(shape)[:length]
        return k, v

    def page_table_array(self, seq_ids) -> tuple[np.ndarray, np.ndarray]:
        """Page tables and lengths in the form a kernel takes.

        Returns ``(tables, lengths)``: ``tables`` is int32 ``(n_seqs, max_pages)``, row ``b`` the
        page table of ``seq_ids[b]`` padded with -1; ``lengths`` is int32 ``(n_seqs,)``.
        """
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self._check_seq(seq_id)
        width = max((len(self._tables[s]) for s in seq_ids), default=0)
        tables = np.full((len(seq_ids), width), -1, dtype=np.int32)
        for b, seq_id in enumerate(seq_ids):
            tables[b, :len(self._tables[seq_id])] = self._tables[seq_id]
        lengths = np.array([self._lengths[s] for s in seq_ids], dtype=np.int32)
        return tables, lengths

    def decode(self, q, seq_ids, scale: float | None = None, backend: str = "numpy") -> np.ndarray:
        r"""One decode step: the query ``q`` ``(n_seqs, h, d)`` of each sequence of ``seq_ids``
        attends to every token that sequence holds (K10, A10). ``h`` must be a multiple of the
        cache's ``g`` key/value heads; ``scale`` defaults to :math:`1/\sqrt d`. Returns
        ``(n_seqs, h, d)``.

        The page tables and lengths of :meth:`page_table_array` go to
        :func:`refmath.inference.decode.paged_decode_attention` with ``backend`` (``"numpy"``, the
        reference that reads one page at a time; ``"cpu"``, the C++ kernel, for a float32 cache).
        """
        tables, lengths = self.page_table_array(seq_ids)
        return paged_decode_attention(q, self.k_pages, self.v_pages, tables, lengths, scale=scale,
                                      backend=backend)

    # -- statistics --

    @property
    def pages_used(self) -> int:
        return self.allocator.n_used

    @property
    def pages_free(self) -> int:
        return self.allocator.n_free

    @property
    def tokens_stored(self) -> int:
        """The sum of the sequence lengths: a shared prefix counts once per sequence holding it."""
        return sum(self._lengths.values())

    def waste(self, seq_id) -> int:
        """Unused slots in the sequence's last page: ``n_pages p - T``, always below ``p`` (K10)."""
        return len(self._tables[self._check_seq(seq_id)]) * self.page_size - self._lengths[seq_id]

    @property
    def waste_total(self) -> int:
        """The sum of :meth:`waste` over all sequences."""
        return sum(self.waste(s) for s in self._tables)


# ---- decoding ------------------------------------------------------------------------------------
