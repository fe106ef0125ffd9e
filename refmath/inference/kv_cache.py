r"""A contiguous KV cache: prefill a prompt once, then decode one token per step (K1-K5, K8, K9).

Why a cache is exact (K1). With fixed parameters and no dropout, the representation of position
:math:`i` at every depth depends only on tokens :math:`1..i`: embeddings are per token, causal
attention reads positions :math:`\le i`, and norms and FFNs act on one row at a time. So the keys
and values of earlier positions never change when a token is appended, and can be kept.

Decode step (K2). A new token at (0-based) position :math:`t` passes through every layer as one
row; each layer appends its key and value and attends with the new query only:

.. math::
    K_{0:t} = \begin{bmatrix} K_{0:t-1} \\ k_t \end{bmatrix},\quad
    V_{0:t} = \begin{bmatrix} V_{0:t-1} \\ v_t \end{bmatrix},\qquad
    o_t = \operatorname{softmax}\Big(\frac{q_t K_{0:t}^\top}{\sqrt{d_k}}\Big) V_{0:t}

Old queries are not needed: :math:`o_t` contains none of them. With RoPE (K3) the cache holds keys
already rotated at their own positions and the new query and key are rotated at position ``t``; with
learned positions (GPT) the new token's embedding gets row ``t`` of the position table.

Cost (K4, K5). :class:`PairCounts` counts the query-key pairs each attention call evaluates.
Prefill of ``P`` tokens: ``P^2`` scores of which ``P(P+1)/2`` are causal (visible) pairs, i.e.
:math:`O(P^2)`; a decode step with ``t`` cached positions: ``t`` pairs, :math:`O(t h d_h)` work per
layer. Generating ``N`` positions from one prompt token by recomputing the prefix every step costs
:math:`\sum_t t^2 = N(N+1)(2N+1)/6` scores, with the cache :math:`\sum_t t = N(N+1)/2`.

Sliding layers (A12). A layer whose queries see only the last ``w`` positions keeps only those:
its keys and values are a ring of ``w`` rows, position ``j`` in row ``j mod w``, so a model whose
layers slide windows :math:`w_l` (Mistral's every layer, Gemma 2's every other one, Gemma 3's five
of six) caches :math:`\sum_l 2 B g d_h b \min(T, w_l)` bytes instead of :math:`2 B L T g d_h b`.
A decode step reads the ring as it is (a sum over keys does not care about their order);
several new rows at once are attended over the window's rows laid out in position order
(:func:`_ring_attention`). The paged and quantised caches (:mod:`refmath.inference.paged`,
:mod:`refmath.inference.quantized`) keep every position they are given.

MLA (K8, K9). The :class:`LatentCache` keeps, per layer and token, only the latent :math:`c_j`
(width :math:`d_c`) and the shared rotated key :math:`k^R_j` (width :math:`d_R`). Decode uses the
absorbed form by default: per head :math:`\hat q_r = q^C_r W_{UK,r}^\top`, so
:math:`q^C_r (k^C_{j,r})^\top = \hat q_r c_j^\top`, and the value sum factors as
:math:`\sum_j a_{j,r} v_{j,r} = (\sum_j a_{j,r} c_j) W_{UV,r}`: the historical keys and values are
never expanded. ``mla_path="expanded"`` recomputes :math:`k^C = c W_{UK}` and :math:`v = c W_{UV}`
from the cached latents instead; both give the same numbers up to rounding.

Models: every decoder-only model of :data:`refmath.models.MODELS` (``"gpt"``, ``"llama"``,
``"mla"``), passed as its module or its name. The model owns its inference step: ``cache_spec``
(which cache, of which shapes), ``embed``, ``cached_layer`` (one layer on the new rows, its
attention step reading and extending the layer's cache through a :class:`_Slot`) and ``head``.
This module keeps the caches, the slot and the prefill and decode loops; these forwards are for
inference only (no dropout, no backward).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import NamedTuple

import numpy as np

from refmath._validate import check_choice, check_int, check_ndim, int_array
from refmath.attention import causal_mask, local_window_mask, sdpa_forward
from refmath import kernels
from refmath.fast.products import blas_products, check_products
from refmath.inference.compiled_step import CompiledLayers, compiled_layers
from refmath.inference.decode import decode_attention
from refmath.kernels import BACKENDS
from refmath.inference.sampling import token_picker
from refmath.models import DECODER_ONLY, MODELS, check_config, model_module, model_name
from refmath.models.common import SplitParams
from refmath.models.params import check_param_dict
from refmath.models.batch import check_tokens

__all__ = [
    "PairCounts", "KVCache", "LatentCache", "empty_cache", "prefill", "decode_step", "Generation",
    "generate_cached", "generate_naive", "sliding_next_logits"
]

MLA_PATHS = ("absorbed", "expanded")


# ---- counting query-key pairs (K4, K5) -----------------------------------------------------------


@dataclass
class PairCounts:
    r"""Query-key pairs evaluated by attention, per layer, for ONE sequence and ONE query head.

    - ``scores[l]``: entries of the score matrix :math:`q K^\top` computed at layer ``l``, summed
      over calls: ``t_q * t_k`` per call. The NumPy reference computes the masked upper triangle of
      a causal prefill too, so a prefill of ``P`` tokens adds ``P^2``.
    - ``visible[l]``: of those, the pairs the causal mask leaves visible (key position <= query
      position), the work of a kernel that skips masked pairs: ``P(P+1)/2`` for a prefill.

    A decode step with ``t`` positions in the cache (the new one included) adds ``t`` to both, or
    ``min(t, w)`` in a layer that keeps only its window of ``w`` (the keys it reads); a chunk of
    ``n`` rows added to such a layer computes ``n`` times the rows of its scratch block. Every
    query head and every sequence of a batch evaluates the same pairs, so the totals over a batch of
    ``B`` and ``h`` heads are ``B h`` times these.
    """

    scores: list
    visible: list

    @classmethod
    def zeros(cls, n_layers: int) -> PairCounts:
        return cls([0] * n_layers, [0] * n_layers)

    def record(self, layer: int, mask: np.ndarray) -> None:
        """Count one attention call at ``layer`` whose additive mask is ``mask`` ``(t_q, t_k)``."""
        self.scores[layer] += mask.size
        self.visible[layer] += int(np.count_nonzero(mask == 0))

    def record_step(self, layer: int, keys: int, visible: int) -> None:
        """Count one decode step at ``layer``: one query scored against ``keys`` keys, of which it
        sees ``visible``; what :meth:`record` counts of that step's one-row mask, without building
        the row."""
        self.scores[layer] += keys
        self.visible[layer] += visible

    def add(self, other: PairCounts) -> None:
        """Add ``other``'s counts to these, layer by layer."""
        self.scores = [a + b for a, b in zip(self.scores, other.scores)]
        self.visible = [a + b for a, b in zip(self.visible, other.visible)]


# ---- the caches ----------------------------------------------------------------------------------


def _array_module(backend: str):
    """Where a cache for ``backend`` keeps its arrays. ``"numpy"`` and ``"cpu"`` read host memory;
    ``"cuda"`` keeps the cache in GPU memory (CuPy), so a decode step moves only the new rows'
    keys and values and the queries there, and the attention output back."""
    if backend != "cuda":
        return np
    import cupy  # present wherever a "cuda" cache was made: empty_cache checked

    return cupy


class _Contiguous:
    """What both caches share: a capacity ``max_len`` (positions), a fill level ``length``, the
    pair counts, and arrays in the memory of the backend that attends over them."""

    length: int
    counts: PairCounts

    def __post_init__(self):  # the dataclasses below call it after their __init__
        if self.counts is None:
            self.counts = PairCounts.zeros(self.n_layers)

    def _arrays(self) -> tuple:
        raise NotImplementedError  # abstract: each cache lists its own arrays

    @property
    def xp(self):
        """The array module of the cache's memory: NumPy, or CuPy for ``backend="cuda"``."""
        return _array_module(self.backend)

    def to_host(self, x) -> np.ndarray:
        """``x``, an array in the cache's memory, as a NumPy array (a copy from the GPU)."""
        return x.get() if self.backend == "cuda" else x

    @property
    def dtype(self) -> np.dtype:
        return self._arrays()[0].dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated storage (every row, filled or not)."""
        return sum(a.nbytes for a in self._arrays())


@dataclass(eq=False)
class KVCache(_Contiguous):
    r"""Contiguous KV cache of a GPT or M3 decoder, for up to ``max_len`` positions (K2, K6).

    ``keys[l]`` and ``values[l]`` are layer ``l``'s ``(B, g, rows, d_h)`` blocks, allocated once:
    ``g`` key/value heads (``g = h`` for MHA and GPT, fewer for GQA/MQA: the query heads of a group
    share one stored head). A layer that attends to every earlier position has ``rows = max_len``
    and keeps position ``j`` in row ``j``. A layer that slides a window ``w < max_len`` (A12) has
    ``rows = w`` (:meth:`ring_size`): none of its queries reads a key more than ``w - 1``
    positions back, so it keeps only the last ``w`` positions, as a ring, position ``j`` in row
    ``j mod w``, each new position overwriting the one ``w`` before it (:func:`_ring_attention`).
    Keys are stored after RoPE, rotated at their own positions (K3). ``nbytes`` is
    :math:`\sum_l 2 B g d_h b \min(T_{\max}, w_l)`, which is :math:`2 B L T_{\max} g d_h b` when no
    layer slides (:func:`refmath.sizing.kv_cache_bytes`; per layer
    :func:`refmath.sizing.cache_bytes_by_layer`).

    The cache is mutable: prefill and decode write into it and advance ``length``. ``backend``
    says who computes attention over it: ``"numpy"`` (the reference), ``"cpu"`` (the C++ kernels,
    for a float32 cache: FlashAttention for a prefill,
    :func:`refmath.inference.decode.decode_attention` for a decode step) or ``"cuda"`` (the CUDA
    kernels, the same calls; ``keys`` and ``values`` are then CuPy arrays in GPU memory, while the
    rest of the model runs in NumPy on the host).
    """

    keys: tuple
    values: tuple
    max_len: int
    length: int = 0
    counts: PairCounts = field(default=None)
    backend: str = "numpy"  # who attends over it: see refmath.inference.decode

    def __post_init__(self):
        self.keys, self.values = tuple(self.keys), tuple(self.values)
        self.max_len = check_int("max_len", self.max_len, 1)
        if not self.keys or len(self.keys) != len(self.values):
            raise ValueError(f"KVCache needs one key and one value block per layer, got "
                             f"{len(self.keys)} key and {len(self.values)} value block(s)")
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
                raise ValueError(f"layer {layer}'s keys {k.shape} and values {v.shape} must be "
                                 f"(B, g, rows, d) blocks with the same B, g and rows")
            if not 1 <= k.shape[2] <= self.max_len or k.shape[:2] != self.keys[0].shape[:2]:
                raise ValueError(f"layer {layer}'s keys {k.shape} must have the B and g of layer "
                                 f"0's {self.keys[0].shape} and 1..max_len = {self.max_len} rows")
        super().__post_init__()

    def _arrays(self) -> tuple:
        return self.keys + self.values

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    def ring_size(self, i: int) -> int | None:
        """The window ``w`` whose last positions layer ``i`` keeps in a ring of ``w`` rows, or None
        where the layer keeps every position (its rows are ``max_len``)."""
        rows = self.keys[i].shape[2]
        return rows if rows < self.max_len else None

    def first_kept(self, i: int) -> int:
        """The oldest position layer ``i`` still holds: 0, or ``length - w`` for a ring once more
        than ``w`` positions have passed."""
        w = self.ring_size(i)
        return 0 if w is None else max(0, self.length - w)

    def layer(self, i: int):
        """Layer ``i``'s kept ``(k, v)`` in position order, each ``(B, g, n, d_h)``: positions
        ``first_kept(i) .. length - 1``. Views of the cache, except for a ring that has wrapped
        (then a copy, its rows put back in position order)."""
        k, v, w = self.keys[i], self.values[i], self.ring_size(i)
        if w is None or self.length <= w:
            return k[:, :, :self.length], v[:, :, :self.length]
        order = self.xp.asarray(np.arange(self.length - w, self.length) % w)
        return k[:, :, order], v[:, :, order]


@dataclass(eq=False)
class LatentCache(_Contiguous):
    r"""MLA cache (K9): per layer and token, only the latent ``c_j`` and the rotated shared key
    ``k^R_j``.

    ``rows`` is ``(L, B, max_len, d_c + d_R)``, row ``j`` of a layer being :math:`[c_j\ k^R_j]`:
    no head axis, because every head's content key and value are up-projections of the same
    ``c_j`` and the rotary key is shared by all heads. ``latents`` (``(L, B, max_len, d_c)``) and
    ``rope_keys`` (``(L, B, max_len, d_R)``) are views of its two parts. One array, because the
    absorbed decode attends with the key :math:`[c_j\ k^R_j]`, which is then a stored row as it is
    (see :meth:`_Slot.attend_latent`). ``nbytes`` is :math:`B L T_{\max} (d_c + d_R) b`
    (:func:`refmath.sizing.mla_cache_bytes`). ``backend`` is as in :class:`KVCache`.
    """

    rows: np.ndarray
    d_c: int
    length: int = 0
    counts: PairCounts = field(default=None)
    backend: str = "numpy"  # who attends over it: see refmath.inference.decode

    def _arrays(self) -> tuple:
        return (self.rows,)

    @property
    def n_layers(self) -> int:
        return self.rows.shape[0]

    @property
    def batch(self) -> int:
        return self.rows.shape[1]

    @property
    def latents(self) -> np.ndarray:
        """The latents :math:`c_j`, ``(L, B, max_len, d_c)`` (a view of ``rows``)."""
        return self.rows[..., :self.d_c]

    @property
    def rope_keys(self) -> np.ndarray:
        """The rotated shared keys :math:`k^R_j`, ``(L, B, max_len, d_R)`` (a view of ``rows``)."""
        return self.rows[..., self.d_c:]

    @property
    def max_len(self) -> int:
        return self.rows.shape[2]

    def layer(self, i: int):
        """Layer ``i``'s filled ``(c, k_r)``: ``(B, length, d_c)`` and ``(B, length, d_R)``."""
        return self.latents[i, :, :self.length], self.rope_keys[i, :, :self.length]


# ---- attention against the cache -----------------------------------------------------------------


def _cached_attention(cache: KVCache, layer: int, q, k, v, offset: int,
                      window: int | None = None, scale: float | None = None,
                      softcap: float | None = None):
    """Append ``k``, ``v`` ``(B, g, n, d_h)`` at positions ``offset..offset+n-1`` of ``layer`` and
    attend with ``q`` ``(B, h, n, d_h)`` over every filled position. Returns ``(B, h, n, d_h)``.

    The layer keeps every position: its block ``cache.keys[layer]`` is ``(B, g, T_max, d_h)``,
    position ``j`` in row ``j`` (a sliding layer that keeps only its window goes through
    :func:`_ring_attention`, which lays the rows out this way and calls this function).

    With a sliding ``window`` (A12) each query sees only itself and the ``window - 1`` positions
    before it: the last rows of :func:`refmath.attention.local_window_mask`, and a decode step
    reads only the last ``window`` cached rows. On the ``"cpu"`` and ``"cuda"`` backends a prefill
    is :func:`refmath.kernels.flash_attention_forward` with the same ``window``.

    ``scale`` is the score scale (``1/sqrt(d_h)`` by default) and ``softcap`` the logit cap
    of :func:`refmath.attention.sdpa_forward` (N19), on the ``"numpy"`` backend only: the kernels
    refuse a cap.

    The ``n`` new queries are the last ``n`` of the ``t = offset + n`` positions, so the causal mask
    is ``causal_mask(n, t)``: for a decode step (``n = 1``) every cached key is visible, and the
    step is :func:`refmath.inference.decode.decode_attention` over the layer's ``(B, g, T_max,
    d_h)`` block, on the cache's backend.
    """
    # BEGIN SOLUTION
    b, h, n, d_h = q.shape
    g, t = k.shape[1], offset + n
    xp = cache.xp  # the cache's memory: NumPy, or CuPy on backend="cuda"
    block_k, block_v = cache.keys[layer], cache.values[layer]
    block_k[:, :, offset:t] = xp.asarray(k)
    block_v[:, :, offset:t] = xp.asarray(v)
    if n == 1:  # the one new query sees every cached key, or the last `window` of them
        cache.counts.record_step(layer, t, t if window is None else min(t, window))
    if n == 1 and window is not None and t > window:
        # the window's rows only, copied contiguous for the kernel (the reference reads the view)
        first = t - window
        keys, values = block_k[:, :, first:t], block_v[:, :, first:t]
        if cache.backend != "numpy":
            keys, values = xp.ascontiguousarray(keys), xp.ascontiguousarray(values)
        o = decode_attention(xp.asarray(q[:, :, 0]), keys, values, np.full(b, window),
                             scale=scale, backend=cache.backend, softcap=softcap)
        return cache.to_host(o)[:, :, None]
    if n == 1:
        o = decode_attention(xp.asarray(q[:, :, 0]), block_k, block_v, np.full(b, t),
                             scale=scale, backend=cache.backend, softcap=softcap)
        return cache.to_host(o)[:, :, None]
    if window is None:
        mask = causal_mask(n, t, dtype=q.dtype)
    else:
        mask = local_window_mask(t, window, dtype=q.dtype)[offset:]
    cache.counts.record(layer, mask)
    keys, values = block_k[:, :, :t], block_v[:, :, :t]
    if cache.backend != "numpy":  # the kernel reads (B, g, t, d_h) blocks
        o, _ = kernels.flash_attention_forward(xp.asarray(q), xp.ascontiguousarray(keys),
                                               xp.ascontiguousarray(values), causal=True,
                                               window=window, scale=scale, softcap=softcap)
        return cache.to_host(o)
    keys, values = cache.to_host(keys), cache.to_host(values)
    # GQA: the h/g query heads of group u read stored head u (refmath.attention.gqa_head_map), so
    # group the queries as (B, g, h/g, n, d_h) and broadcast each stored head to its group: the
    # g stored heads are read, never copied h/g times.
    q = q.reshape(b, g, h // g, n, d_h)
    keys = np.broadcast_to(keys[:, :, None], (b, g, h // g, t, d_h))
    values = np.broadcast_to(values[:, :, None], (b, g, h // g, t, values.shape[-1]))
    o, _ = sdpa_forward(q, keys, values, mask=mask, scale=scale, softcap=softcap)
    return o.reshape(b, h, n, -1)
    # END SOLUTION


def _ring_attention(cache: KVCache, layer: int, q, k, v, offset: int, window: int,
                    scale: float | None = None, softcap: float | None = None):
    r""":func:`_cached_attention` for a layer that keeps only its last ``w = window`` positions,
    in a ring of ``w`` rows: position ``j`` lives in row ``j mod w``. Same arguments and result.

    A decode step (``n = 1``, the new position ``t - 1 = offset``) overwrites the row of position
    ``offset - w``, the one key its query no longer sees, and the query reads every filled row:
    positions :math:`\max(0, t - w) .. t - 1`, ``min(t, w)`` of them. They sit in the ring out of
    position order, which changes nothing: the softmax and the weighted sum of the values are sums
    over the keys, and each key was rotated at its own position when it was stored (K3). So the
    step is :func:`refmath.inference.decode.decode_attention` over the ring as it is, without a
    copy, on any backend.

    Several new rows (a prefill, or a chunk that extends the cache) need masks by position: the
    query at ``offset + i`` sees positions back to ``offset + i - w + 1``, and writing the chunk
    into the ring first would overwrite keys that its earlier queries still read. So the kept
    positions from :math:`p_0 = \max(0, 	ext{offset} - w + 1)` on (the oldest any new query sees)
    are laid out in position order in a scratch block of ``t - p_0`` rows, the chunk is attended
    there as by a layer that keeps every position (:func:`_cached_attention` at offset
    ``offset - p_0``, whose window mask :math:`0 \le i - j < w` depends on position differences
    only, so it is the mask from position :math:`p_0` on), and then the newest
    ``min(n, w)`` rows go into the ring.
    """
    b, n = q.shape[0], q.shape[2]
    t, xp = offset + n, cache.xp
    ring_k, ring_v = cache.keys[layer], cache.values[layer]
    w = ring_k.shape[2]
    if window != w:
        raise ValueError(f"layer {layer} of the cache keeps the last {w} positions (a sliding "
                         f"window of {w}); its attention was called with window = {window}")
    if n == 1:
        ring_k[:, :, offset % w] = xp.asarray(k[:, :, 0])
        ring_v[:, :, offset % w] = xp.asarray(v[:, :, 0])
        seen = min(t, w)
        cache.counts.record_step(layer, seen, seen)  # one query, every key it reads visible
        o = decode_attention(xp.asarray(q[:, :, 0]), ring_k, ring_v, np.full(b, seen),
                             scale=scale, backend=cache.backend, softcap=softcap)
        return cache.to_host(o)[:, :, None]
    first = max(0, offset - w + 1)
    block = KVCache((xp.zeros(ring_k.shape[:2] + (t - first, ring_k.shape[3]), ring_k.dtype),),
                    (xp.zeros(ring_v.shape[:2] + (t - first, ring_v.shape[3]), ring_v.dtype),),
                    max_len=t - first, counts=PairCounts.zeros(1), backend=cache.backend)
    if offset > first:  # the kept positions first..offset-1, from their ring rows
        rows = xp.asarray(np.arange(first, offset) % w)
        block.keys[0][:, :, :offset - first] = ring_k[:, :, rows]
        block.values[0][:, :, :offset - first] = ring_v[:, :, rows]
    o = _cached_attention(block, 0, q, k, v, offset - first, window, scale, softcap)
    cache.counts.scores[layer] += block.counts.scores[0]
    cache.counts.visible[layer] += block.counts.visible[0]
    kept = min(n, w)  # positions t - kept .. t - 1: the block's last rows
    rows = xp.asarray(np.arange(t - kept, t) % w)
    ring_k[:, :, rows] = block.keys[0][:, :, -kept:]
    ring_v[:, :, rows] = block.values[0][:, :, -kept:]
    return o


class _Slot(NamedTuple):
    """One layer of a cache, as the models' cached attention steps use it."""

    cache: object  # a KVCache or a LatentCache
    layer: int

    def attend(self, q, k, v, offset: int, window: int | None = None, scale: float | None = None,
               softcap: float | None = None):
        """KVCache: append ``k``, ``v`` at ``offset..`` and attend with ``q`` (see
        :func:`_cached_attention`, and :func:`_ring_attention` for a layer that keeps only its
        window)."""
        if self.cache.ring_size(self.layer) is not None:
            return _ring_attention(self.cache, self.layer, q, k, v, offset, window, scale, softcap)
        return _cached_attention(self.cache, self.layer, q, k, v, offset, window, scale, softcap)

    def store(self, c, k_r, offset: int):
        """LatentCache: append the latents ``c`` and rotary keys ``k_r`` ``(B, n, .)`` at
        ``offset..``; returns every filled row of both, ``(B, offset + n, .)``."""
        t, xp = offset + c.shape[1], self.cache.xp
        self.cache.latents[self.layer, :, offset:t] = xp.asarray(c)
        self.cache.rope_keys[self.layer, :, offset:t] = xp.asarray(k_r)
        return self.cache.latents[self.layer, :, :t], self.cache.rope_keys[self.layer, :, :t]

    def attend_latent(self, q, offset: int, scale: float):
        r"""LatentCache: the absorbed MLA attention of the ``n`` newest positions over the filled
        rows, after :meth:`store`. ``q`` is :math:`[\hat q_r\ q^R_r]` ``(B, h, n, d_c + d_R)``;
        returns :math:`\sum_j a_{j,r} c_j`, ``(B, h, n, d_c)``.

        Every head reads the one stored row :math:`[c_j\ k^R_j]` as its key (MQA with ``g = 1``)
        and its first ``d_c`` entries as its value. The kernels take keys and values of one width,
        so on ``backend="cpu"`` the row is passed as both and the last ``d_R`` output columns (the
        weighted rotary keys) are dropped: the same numbers, no copy of the cache.
        """
        cache, d_c, xp = self.cache, self.cache.d_c, self.cache.xp
        b, h, n, _ = q.shape
        t = offset + n
        rows = cache.rows[self.layer][:, None]  # (B, 1, max_len, d_c + d_R)
        if cache.backend != "numpy" and n == 1:
            o = decode_attention(xp.asarray(q[:, :, 0]), rows, rows, np.full(b, t), scale=scale,
                                 backend=cache.backend)
            return cache.to_host(o[:, :, None, :d_c])
        if cache.backend != "numpy":  # the kernel reads a contiguous (B, 1, t, d_c + d_R) block
            filled = xp.ascontiguousarray(rows[:, :, :t])
            o, _ = kernels.flash_attention_forward(xp.asarray(q), filled, filled, causal=True,
                                                   scale=scale)
            return cache.to_host(o[..., :d_c])
        keys = np.broadcast_to(rows[:, :, :t], (b, h, t, rows.shape[-1]))
        o, _ = sdpa_forward(q, keys, keys[..., :d_c], mask=causal_mask(n, t, dtype=q.dtype),
                            scale=scale)
        return o

    def record(self, mask) -> None:
        """Count the query-key pairs of one attention call (its additive ``mask``)."""
        self.cache.counts.record(self.layer, mask)


# ---- which model ---------------------------------------------------------------------------------

# The cache class of each kind a model's cache_spec names (refmath.models.common.CacheSpec).
_CACHE_TYPES = {"kv": KVCache, "latent": LatentCache}


def _model(model, config) -> ModuleType:
    """The module of ``model`` (a decoder-only model module or its name in
    :data:`refmath.models.MODELS`), with ``config`` checked to be its configuration."""
    if isinstance(model, ModuleType):
        name = next((n for n in DECODER_ONLY if MODELS[n].module == model.__name__), None)
        if name is None:
            raise ValueError(f"model {model.__name__} has no KV-cache decoding here; the "
                             f"decoder-only models are {[MODELS[n].module for n in DECODER_ONLY]}")
    elif model in DECODER_ONLY:
        name = model
    else:
        raise ValueError(f"model must be one of {', '.join(DECODER_ONLY)} (the decoder-only models "
                         f"of refmath.models.MODELS) or its module, got {model!r}")
    module = model_module(name)  # checked against refmath.models.contract on first use
    check_config(name, config)  # exactly its class: a subclass's extra fields would go unread
    return module


def _check_mla_path(mla_path) -> None:
    check_choice("mla_path", mla_path, MLA_PATHS)


# ---- the public functions ------------------------------------------------------------------------


def empty_cache(model, config, batch: int = 1, dtype=np.float64, max_len: int | None = None,
                backend: str = "numpy"):
    """A zeroed cache for ``batch`` sequences of up to ``max_len`` positions (default
    ``config.max_seq_len``): a :class:`KVCache` for GPT and the M3 decoder, a :class:`LatentCache`
    for MLA. All memory is allocated here, once: in host memory, or on the GPU for
    ``backend="cuda"``. ``backend`` (``"numpy"``, ``"cpu"`` or ``"cuda"``, see :class:`KVCache`)
    computes attention over it; the kernels take float32 caches."""
    module = _model(model, config)
    batch = check_int("batch", batch, 1)
    max_len = config.max_seq_len if max_len is None else check_int("max_len", max_len, 1,
                                                                    config.max_seq_len)
    dtype = np.dtype(dtype)
    if not np.issubdtype(dtype, np.floating):
        raise TypeError(f"dtype must be a floating-point type, got {dtype}")
    _check_cache_backend(backend, dtype)
    spec = module.cache_spec(config, int(batch), int(max_len))
    xp = _array_module(backend)
    arrays = [xp.zeros(shape, dtype) for shape in _array_shapes(spec)]
    if spec.kind == "kv":
        layers = len(arrays) // 2  # every layer's keys, then every layer's values
        cache = KVCache(tuple(arrays[:layers]), tuple(arrays[layers:]), max_len=int(max_len))
    else:
        cache = LatentCache(*arrays, d_c=spec.latent_width)
    if backend != "numpy":
        cache.backend = backend
    return cache


def _array_shapes(spec) -> tuple:
    """The shapes of a cache's arrays in the order of its ``_arrays()``: a KV cache's blocks layer
    by layer (keys, then values; a sliding layer's of its window's rows), a latent cache's one
    array."""
    if spec.kind == "kv":
        keys, values = spec.layer_shapes()
        return keys + values
    return spec.shapes


def _check_cache_backend(backend, dtype: np.dtype) -> None:
    check_choice("backend", backend, BACKENDS)
    if backend != "numpy" and dtype != np.float32:
        raise TypeError(f"backend={backend!r} runs the compiled kernels, which take float32 caches: "
                        f"use float32 parameters (the cache takes their dtype), got {dtype}")
    if backend == "cuda" and not kernels.cuda_available():
        raise ValueError(f"backend='cuda' keeps the cache on a GPU, and none can be used here: "
                         f"{kernels.cuda_build_info()}")


def _forward_rows(module, params, config, cache, tokens: np.ndarray, mla_path,
                  products=None) -> np.ndarray:
    """Run ``tokens`` ``(B, n)`` at positions ``cache.length ..`` through every layer of the model
    ``module`` (its ``embed``, ``cached_layer`` and ``head``), extending the cache; returns the
    logits ``(B, n, V)``. ``length`` advances once every layer is written. ``products`` (None:
    :func:`refmath.fast.products.blas_products`) computes every product of the layers and the
    head, as their ``matmul``."""
    matmul = blas_products if products is None else products
    offset, n = cache.length, tokens.shape[1]
    # mla_path chooses how a latent cache is read, so only the models that keep one take it
    options = {"mla_path": mla_path} if isinstance(cache, LatentCache) else {}
    if options and mla_path == "expanded" and cache.backend != "numpy":
        raise ValueError(f"mla_path='expanded' needs backend='numpy': its keys (width d_k + d_R) and "
                         f"values (width d_v) differ in width, which the kernels do not take; the "
                         f"cache's backend is {cache.backend!r} (mla_path='absorbed' runs on it)")
    if offset + n > cache.max_len:
        limit = f"max_seq_len = {config.max_seq_len}"
        if cache.max_len < config.max_seq_len:
            limit = f"its max_len = {cache.max_len} (the model's {limit})"
        raise ValueError(f"the cache holds {offset} positions and is limited to {limit}: {n} more "
                         f"token(s) would need positions up to {offset + n - 1} (0-based)")
    x = module.embed(params, tokens, config, offset)
    for layer in range(config.n_layers):
        x = module.cached_layer(x, params, layer, config, _Slot(cache, layer), offset,
                                matmul=matmul, **options)
    cache.length = offset + n
    return module.head(params, x, config, matmul=matmul)


def prefill(model, params, config, prompt_ids, all_logits: bool = False,
            mla_path: str = "absorbed", max_len: int | None = None, backend: str = "numpy",
            products=None):
    r"""Run a prompt of ``P`` tokens in one causal pass and keep every layer's keys and values (K5).

    ``prompt_ids``: int ``(B, P)`` (or ``(P,)`` for one sequence) with ``1 <= P <= max_seq_len``.
    Attention is the full causal ``P x P`` pass (``P(P+1)/2`` visible pairs per head and layer).
    Returns ``(logits, cache)``: the last position's logits ``(B, V)`` (they give the first
    generated token), or every position's ``(B, P, V)`` with ``all_logits=True`` (``(V,)`` and
    ``(P, V)`` for 1-D input), in the parameters' dtype; ``cache`` has ``length = P`` and room for
    ``max_len`` positions (default ``config.max_seq_len``). ``mla_path`` (MLA only, see
    :func:`decode_step`) picks the absorbed or expanded attention. ``backend`` chooses who
    computes attention, now and in later decode steps: ``"numpy"``, ``"cpu"`` (the C++ kernels) or
    ``"cuda"`` (the CUDA kernels, the cache in GPU memory); the kernels need float32 parameters,
    and for MLA the absorbed path. ``products``: how the layers' and the head's products are
    computed, :func:`refmath.fast.products.blas_products` (None, the default) or
    :func:`~refmath.fast.products.kernel_products` (a few float32 rows on the C++ rows kernel).
    """
    module = _model(model, config)
    _check_mla_path(mla_path)
    check_products(products)
    dtype = check_param_dict(params, module.param_shapes(config))
    prompt = np.asarray(prompt_ids)
    unbatched = prompt.ndim == 1
    tokens = check_tokens("prompt_ids", prompt[None] if unbatched else prompt, config)
    cache = empty_cache(module, config, tokens.shape[0], dtype, max_len, backend)
    logits = _forward_rows(module, params, config, cache, tokens, mla_path, products)
    logits = logits if all_logits else logits[:, -1]
    return (logits[0] if unbatched else logits), cache


def decode_step(model, params, config, cache, token_id, mla_path: str = "absorbed",
                products=None) -> np.ndarray:
    r"""Feed one token per sequence at position ``t = cache.length`` and return its logits (K2, K3).

    Each layer computes the new row's query, key and value, appends the key and value to the cache
    and attends with the one query over positions ``0..t``:
    :math:`o_t = \operatorname{softmax}(q_t K_{0:t}^\top/\sqrt{d_k}) V_{0:t}`, ``t + 1`` pairs per
    head and layer. RoPE models rotate the new query and key at position ``t``; GPT adds row ``t``
    of its position table. For MLA, ``mla_path="absorbed"`` (default) scores against the cached
    latents directly (K8), ``"expanded"`` up-projects them to per-head keys and values first.

    ``token_id``: an int (then ``cache.batch`` must be 1 and the logits are ``(V,)``) or int
    ``(B,)``. The cache is updated in place (``length`` grows by one). Raises ``ValueError`` when
    the cache is full (``max_seq_len`` positions) or an id is outside ``[0, vocab_size)``.
    ``products``: how the step's products are computed, as in :func:`prefill`.
    """
    module = _model(model, config)
    _check_mla_path(mla_path)
    check_products(products)
    dtype = check_param_dict(params, module.param_shapes(config))
    _check_cache(cache, module, config, dtype)
    ids = np.asarray(token_id)
    unbatched = ids.ndim == 0
    ids = int_array("token_id", ids, config.vocab_size)
    if unbatched:
        ids = ids.reshape(1)
    check_ndim("token_id", ids, 1, "(B,), one token per sequence")
    if ids.shape[0] != cache.batch:
        raise ValueError(f"token_id has {ids.shape[0]} token(s) (shape {ids.shape}) but the cache "
                         f"holds B = {cache.batch} sequence(s)")
    logits = _step(module, params, config, cache, ids, mla_path, products=products)
    return logits[0] if unbatched else logits


def _step(module, params, config, cache, ids: np.ndarray, mla_path,
          layers: CompiledLayers | None = None, products=None) -> np.ndarray:
    """One decode step past the door's checks: ``ids`` ``(B,)``, the logits ``(B, V)``. The
    generators check the model, the parameters and the cache once, at their prefill, and then
    step with this: the ids they feed are their own picks. With ``layers`` (their
    :func:`refmath.inference.compiled_step.compiled_layers`), a step it runs with ``products``
    (:meth:`~refmath.inference.compiled_step.CompiledLayers.runs`) goes through it."""
    if layers is not None and isinstance(cache, KVCache) and layers.runs(cache, products):
        return layers.step(cache, ids, products)
    return _forward_rows(module, params, config, cache, ids[:, None], mla_path, products)[:, 0]


def _compiled_layers(module, params, config, backend: str, stored=None,
                     weights: str = "f32") -> CompiledLayers | None:
    """The generators' compiled decode layers: on ``backend="cpu"`` only."""
    if backend != "cpu":
        return None
    return compiled_layers(module, params, config, stored, weights)


def _check_cache(cache, module, config, dtype) -> None:
    """The cache must be of the model's kind, sized for its config and in the parameters' dtype."""
    cache_type = _CACHE_TYPES[module.cache_spec(config, 1, 1).kind]
    if not isinstance(cache, cache_type):
        raise TypeError(f"model {model_name(module)!r} decodes with a {cache_type.__name__}, got "
                        f"{type(cache).__name__}")
    have = tuple(a.shape for a in cache._arrays())
    want = _array_shapes(module.cache_spec(config, cache.batch, cache.max_len))
    if have != want or cache.max_len > config.max_seq_len:
        raise ValueError(f"the cache's arrays have shapes {have}, which do not fit the config: "
                         f"expected {want} with max_len <= max_seq_len = {config.max_seq_len}")
    if cache.dtype != dtype:
        raise TypeError(f"the cache is {cache.dtype} but params are {dtype}")


# ---- generation: the same tokens with or without the cache ---------------------------------------


class Generation(NamedTuple):
    tokens: np.ndarray  # (B, P + n): the prompt, then the generated ids ((P + n,) for a 1-D prompt)
    logits: np.ndarray  # (B, n, V): the logits each generated id was drawn from ((n, V))
    counts: PairCounts  # query-key pairs evaluated, per sequence, query head and layer


def _generation_loop(model, params, config, prompt_ids, max_new_tokens, sampling, next_logits):
    """Shared by both generators: checks, then ``max_new_tokens`` picks from ``next_logits``."""
    module = _model(model, config)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    prompt = np.asarray(prompt_ids)
    unbatched = prompt.ndim == 1
    tokens = check_tokens("prompt_ids", prompt[None] if unbatched else prompt, config)
    needed = tokens.shape[1] + max_new_tokens - 1  # the last new token is sampled, never fed
    if needed > config.max_seq_len:
        raise ValueError(f"a prompt of {tokens.shape[1]} tokens plus {max_new_tokens} new ones "
                         f"needs {needed} positions, more than max_seq_len = {config.max_seq_len}")
    # the same picker, with the same use of the random stream (one uniform number per row and
    # step, rows in order), as generate's, so that a seed gives the tokens generate gives
    pick = token_picker(**sampling)
    counts = PairCounts.zeros(config.n_layers)
    steps = []
    for step in range(max_new_tokens):
        z = next_logits(module, tokens, step, counts)
        steps.append(z)
        new = np.array([pick(row) for row in z], dtype=tokens.dtype)
        tokens = np.concatenate([tokens, new[:, None]], axis=1)
    logits = np.stack(steps, axis=1)
    if unbatched:
        tokens, logits = tokens[0], logits[0]
    return Generation(tokens, logits, counts)


def generate_cached(model, params, config, prompt_ids, max_new_tokens: int, *,
                    greedy: bool = False, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None, seed=0, mla_path: str = "absorbed",
                    backend: str = "numpy", products=None) -> Generation:
    r"""Generate with the KV cache: one :func:`prefill`, then one :func:`decode_step` per new token
    but the last (which is only sampled) (K2, K4).

    Arguments as in :func:`refmath.inference.generate.generate` (``prompt_ids`` ``(P,)`` or
    ``(B, P)``; greedy, or sampling with temperature, top-k, top-p and ``seed``), except that the
    ``P + max_new_tokens - 1`` fed positions must fit in ``max_seq_len`` (no sliding window) and
    there is no ``eos_id``. Returns a :class:`Generation`; from a 1-token prompt, processing
    ``N = max_new_tokens`` positions evaluates :math:`\sum_{t=1}^N t = N(N+1)/2` pairs.
    ``backend`` (see :func:`prefill`) chooses who computes attention; the backends give the same
    greedy tokens unless two logits lie within float32 rounding of each other; ``products`` (see
    :func:`prefill`) how the products are computed. On ``"cpu"`` with
    :func:`refmath.fast.products.kernel_products`, the decode steps of refmath's decoder and of
    GPT run every layer in one compiled call (:mod:`refmath.inference.compiled_step`).
    """
    _check_mla_path(mla_path)
    check_products(products)
    sampling = dict(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    params = _split_once(params)
    state = {}

    def next_logits(module, tokens, step, counts):
        if step == 0:
            z, state["cache"] = prefill(module, params, config, tokens, mla_path=mla_path,
                                        backend=backend, products=products)
            state["layers"] = _compiled_layers(module, params, config, backend)
        else:
            z = _step(module, params, config, state["cache"], tokens[:, -1], mla_path,
                      state["layers"], products)
        if step == max_new_tokens - 1:
            counts.add(state["cache"].counts)
        return z

    return _generation_loop(model, params, config, prompt_ids, max_new_tokens, sampling,
                            next_logits)


def generate_naive(model, params, config, prompt_ids, max_new_tokens: int, *,
                   greedy: bool = False, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None, seed=0, mla_path: str = "absorbed") -> Generation:
    r"""Generate by naive regeneration: every step recomputes the whole prefix from scratch (a fresh
    :func:`prefill` of ``P``, ``P + 1``, ... tokens) and keeps its last logits (K4).

    Same arguments, tokens and logits (up to rounding) as :func:`generate_cached`; only the cost
    differs: from a 1-token prompt, ``N`` steps evaluate :math:`\sum_{t=1}^N t^2 =
    N(N+1)(2N+1)/6` scores per sequence, head and layer (``counts``).
    """
    _check_mla_path(mla_path)
    sampling = dict(greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    def next_logits(module, tokens, step, counts):
        z, fresh = prefill(module, params, config, tokens, mla_path=mla_path)
        counts.add(fresh.counts)
        return z

    return _generation_loop(model, params, config, prompt_ids, max_new_tokens, sampling,
                            next_logits)


def _split_once(params):
    """The parameters as a generator steps with them: a :class:`SplitParams` snapshot, so that each
    layer's split is made once per call rather than once per token (anything but a mapping is
    left for the parameter check to refuse)."""
    return SplitParams(params) if isinstance(params, Mapping) else params


def sliding_next_logits(model, params, config, window: int, backend: str = "numpy", stored=None,
                        weights: str = "f32", products=None):
    """``next_logits(tokens)`` for a decoding loop that feeds at most the last ``window`` tokens
    (:func:`refmath.inference.generate.generate`): the logits ``(B, V)`` of the token after each
    row of ``tokens`` ``(B, T)``. One decode step while the cache holds every token but the newest;
    a fresh :func:`prefill` of the last ``window`` tokens otherwise (the first call, and every call
    once the window slides, since then the positions of every kept token change, and whenever the
    model's ``cache_stale(config, length, 1)`` says a length-dependent rope scaling changed its
    frequencies, which invalidates the cached keys). The model and the parameters are checked at
    each prefill, not at each step. ``stored`` and ``weights``: the layers' matrices in a narrower
    format for the compiled decode step, ``params`` then being what they stand for (see
    :func:`refmath.inference.compiled_step.compiled_layers`). ``products``: how the products are
    computed, as in :func:`prefill`."""
    module = _model(model, config)
    check_products(products)
    params = _split_once(params)
    state = {"cache": None}

    def next_logits(tokens):
        cache = state["cache"]
        if (cache is not None and cache.length == tokens.shape[1] - 1 < window
                and not module.cache_stale(config, cache.length, 1)):
            return _step(module, params, config, cache, tokens[:, -1], "absorbed",
                         state["layers"], products)
        z, state["cache"] = prefill(module, params, config, tokens[:, -window:], backend=backend,
                                    products=products)
        if "layers" not in state:  # the parameters are checked by this first prefill
            state["layers"] = _compiled_layers(module, params, config, backend, stored, weights)
        return z

    return next_logits
