r"""Attention of one new query per sequence over a KV cache: where the reference meets the kernels.

A decode step (catalogue K2) attends with each sequence's newest query over the keys and values
its cache holds:

.. math::
    o_{b,r} = \operatorname{softmax}\big(\tau\, q_{b,r} K_{b,\pi(r)}[{:}L_b]^\top\big)\,
    V_{b,\pi(r)}[{:}L_b]

with ``pi`` the GQA head map (A10), ``tau`` the scale (:math:`1/\sqrt D` by default) and ``L_b``
the number of positions sequence ``b`` has cached. A ``softcap`` ``c`` (N19, Gemma 2) replaces each
score ``s`` by :math:`c \tanh(s / c)` before the softmax; only the reference has it, and the
kernels refuse it. The cache is either contiguous,
``(B, G, T_max, D)`` per layer (the layout of :class:`refmath.inference.kv_cache.KVCache` and of
the compiled kernels), or paged: a pool ``(n_pages, G, p, D)`` and a page table (K10).

Each function takes a ``backend``:

- ``"numpy"`` (the default): the reference, in this file;
- ``"cpu"``: the C++ kernel (:func:`refmath.kernels.decode`, :func:`refmath.kernels.paged_decode`),
  float32 NumPy arrays;
- ``"cuda"``: the CUDA kernel, on CuPy arrays.

All three take the same arguments and return the same thing, so the kernel tests compare backends
directly. Slots past a sequence's length are never read by any backend, whatever they hold.
"""
from __future__ import annotations

import math

import numpy as np

from refmath._validate import (check_axis, check_choice, check_ndim, check_real, check_same_shape,
                               float_array, int_array)
from refmath.attention import gqa_head_map, sdpa_forward
from refmath.ffn import check_softcap
from refmath.kernels import BACKENDS
from refmath.softmax import (online_softmax_block, online_softmax_empty, online_softmax_merge,
                             online_softmax_result)

__all__ = ["decode_attention", "paged_decode_attention"]



def _check_backend(backend: str, **arrays) -> None:
    check_choice("backend", backend, BACKENDS)
    on_gpu = [name for name, x in arrays.items() if type(x).__module__.startswith("cupy")]
    if backend == "cuda" and len(on_gpu) < len(arrays):
        host = sorted(set(arrays) - set(on_gpu))
        raise TypeError(f"backend='cuda' needs CuPy arrays; {', '.join(host)} are on the host")
    if backend != "cuda" and on_gpu:
        raise TypeError(f"backend={backend!r} needs NumPy arrays; {', '.join(on_gpu)} are CuPy "
                        f"arrays (use backend='cuda')")


def _check_query(q, kv_name: str, kv) -> None:
    check_ndim("q", q, 3, "(B, H, D)")
    check_axis(kv_name, kv, 3, q.shape[2], f"the head width D of q.shape = {q.shape}")
    h, g = q.shape[1], kv.shape[1]
    if g == 0 or h % g:
        raise ValueError(f"the key/value heads G = {g} of {kv_name}.shape = {kv.shape} must divide "
                         f"the query heads H = {h} of q.shape = {q.shape}")


def _scale(scale, d: int) -> float:
    # a plain float keeps float32 inputs float32
    return 1.0 / math.sqrt(d) if scale is None else check_real("scale", scale)


def decode_attention(q, k_cache, v_cache, lengths, scale: float | None = None,
                     backend: str = "numpy", softcap: float | None = None):
    r"""One decode step over contiguous caches (catalogue K2, A10; the module docstring has the
    equation).

    ``q`` is ``(B, H, D)``; ``k_cache`` and ``v_cache`` are ``(B, G, T_max, D)`` with ``G``
    dividing ``H``; ``lengths`` holds ``B`` integers in ``[0, T_max]`` (a length of 0 gives
    ``o = 0``). ``scale`` is :math:`\tau`; ``softcap`` (a number above 0, or None) caps the
    scores, on ``backend="numpy"`` only. Returns ``(B, H, D)``.

    The reference runs :func:`refmath.attention.sdpa_forward` over each sequence's first ``L_b``
    keys, read through the GQA head map (no copy of the shared heads).
    """
    _check_backend(backend, q=q, k_cache=k_cache, v_cache=v_cache)
    if backend != "numpy":
        from refmath import kernels

        return kernels.decode(q, k_cache, v_cache, lengths, scale=scale, softcap=softcap)
    q, k_cache, v_cache = (float_array(n, x) for n, x in
                           (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)))
    check_ndim("k_cache", k_cache, 4, "(B, G, T_max, D)")
    check_same_shape("k_cache", k_cache, "v_cache", v_cache)
    _check_query(q, "k_cache", k_cache)
    check_axis("k_cache", k_cache, 0, q.shape[0], f"the batch size B of q.shape = {q.shape}")
    lengths = int_array("lengths", lengths, k_cache.shape[2] + 1)
    check_ndim("lengths", lengths, 1, "(B,)")
    check_axis("lengths", lengths, 0, q.shape[0], f"the batch size B of q.shape = {q.shape}")
    scale = _scale(scale, q.shape[-1])
    heads = gqa_head_map(q.shape[1], k_cache.shape[1])

    out = np.empty(q.shape, dtype=np.result_type(q, k_cache, v_cache))
    for b, length in enumerate(lengths):
        k = k_cache[b, heads, :length]  # (H, L_b, D): query head r reads key head pi(r)
        v = v_cache[b, heads, :length]
        out[b] = sdpa_forward(q[b][:, None, :], k, v, scale=scale, softcap=softcap)[0][:, 0]
    return out


def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, scale: float | None = None,
                           backend: str = "numpy", softcap: float | None = None):
    r"""One decode step over a paged cache (catalogue K10, A10, F2, F3): :func:`decode_attention`
    with each sequence's keys and values found through its page table.

    ``k_pages`` and ``v_pages`` are the pool ``(n_pages, G, p, D)``; ``page_table`` is
    ``(B, max_pages)``, row ``b`` the physical pages of sequence ``b`` in logical order (entries
    past the pages its length needs may hold anything, e.g. -1); token ``j`` of sequence ``b`` is
    slot ``j % p`` of page ``page_table[b, j // p]``. ``q``, ``lengths``, ``scale``, ``softcap``
    and the result are as in :func:`decode_attention`.
    :meth:`refmath.inference.paged.PagedKVCache.decode` builds the table from a cache.

    The reference reads the pool the way a kernel does: one page at a time, each giving block
    statistics ``(m, l, u)`` (F2) merged into a running state (F3), ``o = u / l`` at the end, never
    building a contiguous ``K``. Only the filled slots of a sequence's last page are read.
    """
    _check_backend(backend, q=q, k_pages=k_pages, v_pages=v_pages)
    if backend != "numpy":
        from refmath import kernels

        return kernels.paged_decode(q, k_pages, v_pages, page_table, lengths, scale=scale,
                                    softcap=softcap)
    q, k_pages, v_pages = (float_array(n, x) for n, x in
                           (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)))
    check_ndim("k_pages", k_pages, 4, "(n_pages, G, page_size, D)")
    check_same_shape("k_pages", k_pages, "v_pages", v_pages)
    _check_query(q, "k_pages", k_pages)
    n_pages, _, page_size, _ = k_pages.shape
    table = np.asarray(page_table)
    if not np.issubdtype(table.dtype, np.integer):
        raise TypeError(f"page_table must be an integer array, got dtype {table.dtype} with shape "
                        f"{table.shape}")
    check_ndim("page_table", table, 2, "(B, max_pages)")
    check_axis("page_table", table, 0, q.shape[0], f"the batch size B of q.shape = {q.shape}")
    lengths = int_array("lengths", lengths, table.shape[1] * page_size + 1)
    check_ndim("lengths", lengths, 1, "(B,)")
    check_axis("lengths", lengths, 0, q.shape[0], f"the batch size B of q.shape = {q.shape}")
    scale = _scale(scale, q.shape[-1])
    softcap = None if softcap is None else check_softcap("softcap", softcap)
    h, d = q.shape[1], q.shape[2]
    heads = gqa_head_map(h, k_pages.shape[1])

    out = np.empty(q.shape, dtype=np.result_type(q, k_pages, v_pages))
    for b, length in enumerate(lengths):
        state = online_softmax_empty(h, d, out.dtype)
        for i in range(-(-int(length) // page_size)):
            page = table[b, i]
            if not 0 <= page < n_pages:
                raise ValueError(f"page_table[{b}, {i}] = {page} is not a page id in [0, n_pages = "
                                 f"{n_pages}), but sequence {b} of length {length} reads it")
            n = min(page_size, int(length) - i * page_size)  # filled slots of this page
            k = k_pages[page, :, :n][heads]  # (H, n, D)
            v = v_pages[page, :, :n][heads]
            scores = (k @ q[b][:, :, None])[:, :, 0] * scale  # (H, n)
            if softcap is not None:  # each score on its own, so page by page is the same
                scores = softcap * np.tanh(scores / softcap)
            state = online_softmax_merge(state, online_softmax_block(scores, v))
        out[b] = online_softmax_result(state)
    return out
