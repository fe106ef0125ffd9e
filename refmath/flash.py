r"""FlashAttention in NumPy: exact attention computed tile by tile (catalogue F1-F6, A12).

Dense attention (:func:`refmath.attention.sdpa_forward`) builds the ``T_q x T_k`` score matrix,
softmaxes it and multiplies by ``V``. FlashAttention computes the same numbers without ever holding
that matrix. It rests on two facts:

* F1: attention is a ratio, :math:`o = \sum_j e^{s_j} v_j \big/ \sum_j e^{s_j}`, so a query row
  needs only the running numerator and denominator, not the whole row of weights.
* F2, F3: the statistics ``(m, l, u)`` of two disjoint sets of keys merge exactly
  (:func:`refmath.softmax.online_softmax_merge`), so the keys can be visited one tile at a time.

The forward pass loops over query tiles (``block_q`` rows) and, for each, over key/value tiles
(``block_k`` keys), folding every tile into the running state; it keeps the output and one number
per row, the logsumexp. The backward pass (FlashAttention-2) recomputes each tile's weights from
that logsumexp instead of storing them (F4). The arithmetic is the dense one,
:math:`O(B H T_q T_k D)`; what changes is memory: score-sized temporaries are
``block_q x block_k`` instead of ``T_q x T_k`` (F5). Tiles that the causal or sliding-window mask
hides entirely are skipped, which does save arithmetic: about half of it for causal attention, all
but :math:`O(T w)` pairs for a window of ``w`` (A12). What the tiling saves on a GPU is traffic to
slow memory: :func:`attention_memory_traffic` counts it for both forms (F6).

Layout: ``q`` is ``(B, H, T_q, D)``, ``k`` and ``v`` are ``(B, G, T_k, D)`` and ``(B, G, T_k, D_v)``
with ``G`` dividing ``H``; query head ``r`` reads key/value head ``r // (H/G)``
(:func:`refmath.attention.gqa_head_map`, A10). Inside the loops the query heads are viewed as
``(B, G, H/G, ...)`` so that each group meets its shared key/value head by broadcasting, with no
copy of ``K`` or ``V`` per query head.

Masks: query ``i`` sits at key position ``p_i = i + T_k - T_q`` (the queries are the last ``T_q``
positions, as in :func:`refmath.attention.causal_mask`). Causal: key ``j`` is visible iff
``j <= p_i``; sliding window ``w`` (A12, causal by definition): iff ``p_i - w + 1 <= j <= p_i``.
When ``T_q > T_k`` the first ``T_q - T_k`` queries sit before the first key and see nothing under
either mask; such a row (like any row with no visible key) has output 0, logsumexp ``-inf`` and zero
gradients.

The gradient-check registry holds these functions in its "attention execution" group (the cases
at the end of this file: tiles that do not divide the lengths, causal, sliding-window, GQA and MQA,
queries with no visible key, soft-capped scores), and ``tests/test_flash.py`` compares them with
the dense reference :func:`refmath.attention.sdpa_backward` to float64 rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from refmath._validate import check_axis, check_flag, check_int, check_ndim, check_real, float_array
from refmath.ffn import check_softcap
from refmath.registry import OpCase, register_case
from refmath.softmax import (
    online_softmax_block,
    online_softmax_empty,
    online_softmax_logsumexp,
    online_softmax_merge,
    online_softmax_result,
)

__all__ = ["FlashCounters", "flash_attention_forward", "MemoryTraffic", "attention_memory_traffic",
           "flash_attention_backward"]


@dataclass
class FlashCounters:
    """What a tiled pass did, filled in by :func:`flash_attention_forward` and
    :func:`flash_attention_backward` when passed one (catalogue F5).

    ``score_pairs`` and the tile counts are per batch entry and head (every one of them sees the
    same tiles); the total arithmetic is ``B * H`` times that. ``largest_temporary`` is the size, in
    elements and over all batch entries and heads together, of the largest array the tile loops
    create. The outputs and the per-row vectors (the logsumexp, and ``rowsum(dO * O)`` in backward)
    are not temporaries: they are the ``O(T)`` extra memory of F4.

    ``elements_read`` and ``elements_written`` count, over all batch entries and heads, the
    elements the forward pass loads from its inputs and stores into its outputs, as a GPU kernel
    moves them between slow memory and on-chip memory: a query tile once per query tile, a key and
    a value tile once for every query tile that visits it, an output tile and its logsumexp once
    (F6; :func:`attention_memory_traffic` gives the same count in closed form). The backward pass
    leaves them unchanged.

    Counts add up over calls (``largest_temporary`` keeps the maximum); use a fresh instance to
    read one call's figures.
    """

    score_pairs: int = 0  # (query, key) positions whose score was computed, masked ones included
    tiles_computed: int = 0  # (query tile, key tile) pairs visited
    tiles_skipped: int = 0  # pairs that the mask hides entirely, never touched
    largest_temporary: int = 0  # elements
    elements_read: int = 0  # forward: q, k, v tiles loaded, all batch entries and heads
    elements_written: int = 0  # forward: o and lse tiles stored, all batch entries and heads

    def note(self, *arrays) -> None:
        """Record the size of temporaries created by a tile step."""
        for a in arrays:
            if a is not None:
                self.largest_temporary = max(self.largest_temporary, int(np.size(a)))


# ---- which tiles the mask leaves visible -------------------------------------------------------

@dataclass(frozen=True)
class _Band:
    """The visible (query, key) pairs: for query ``i``, keys ``p_i - w + 1 .. p_i`` with
    ``p_i = i + offset`` (no lower end without a window, no upper end without causality)."""

    t_q: int
    t_k: int
    causal: bool
    window: int | None

    @property
    def offset(self) -> int:
        return self.t_k - self.t_q

    def keys_seen_by(self, i0: int, i1: int) -> tuple[int, int]:
        """The keys ``[lo, hi)`` seen by at least one query in ``i0 .. i1 - 1``.

        Each query's keys form an interval whose ends grow with ``i``, and consecutive intervals
        overlap, so their union is one interval: from the first query's lower end to the last
        query's upper end.
        """
        lo, hi = 0, self.t_k
        if self.causal:
            hi = min(hi, i1 - 1 + self.offset + 1)
        if self.window is not None:
            lo = max(lo, i0 + self.offset - self.window + 1)
        return lo, max(lo, hi)

    def queries_seeing(self, j0: int, j1: int) -> tuple[int, int]:
        """The queries ``[lo, hi)`` that see at least one key in ``j0 .. j1 - 1``.

        Key ``j`` is seen by the queries with ``j <= p_i <= j + w - 1``; again one interval.
        """
        lo, hi = 0, self.t_q
        if self.causal:
            lo = max(lo, j0 - self.offset)
        if self.window is not None:
            hi = min(hi, j1 - 1 + self.window - 1 - self.offset + 1)
        return lo, max(lo, hi)

    def tile_mask(self, i0: int, i1: int, j0: int, j1: int) -> np.ndarray | None:
        """Boolean ``(i1 - i0, j1 - j0)``: True where the key is visible; None when all of it is.

        Only tiles cut by the diagonal (or the window's lower edge) need a mask: for the others the
        check below proves, from the tile's corners, that every pair is visible.
        """
        first_row_sees_last_key = not self.causal or j1 - 1 <= i0 + self.offset
        last_row_sees_first_key = (self.window is None
                                   or j0 >= i1 - 1 + self.offset - self.window + 1)
        if first_row_sees_last_key and last_row_sees_first_key:
            return None
        pos = np.arange(i0, i1)[:, None] + self.offset
        j = np.arange(j0, j1)[None, :]
        visible = np.ones((i1 - i0, j1 - j0), dtype=bool)
        if self.causal:
            visible &= j <= pos
        if self.window is not None:
            visible &= j >= pos - self.window + 1
        return visible


def _tiles(lo: int, hi: int, block: int, total: int):
    """The tiles ``[t0, t1)`` of a length-``total`` axis cut every ``block``, that meet
    ``[lo, hi)``."""
    if hi <= lo:
        return []
    first = lo // block
    last = (hi - 1) // block
    return [(t * block, min((t + 1) * block, total)) for t in range(first, last + 1)]


def _n_tiles(total: int, block: int) -> int:
    return -(-total // block)


# ---- input checks --------------------------------------------------------------------------------

def _check_qkv(q, k, v):
    """Return ``(q, k, v)`` as float arrays after checking ranks, widths and head counts."""
    q = float_array("q", q)
    k = float_array("k", k)
    v = float_array("v", v)
    check_ndim("q", q, 4, "(B, H, T_q, D)")
    check_ndim("k", k, 4, "(B, G, T_k, D)")
    check_ndim("v", v, 4, "(B, G, T_k, D_v)")
    check_axis("k", k, -1, q.shape[-1], f"the head width D of q.shape = {q.shape}")
    check_axis("k", k, 0, q.shape[0], f"the batch size B of q.shape = {q.shape}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v must have the batch size, key/value heads and length (B, G, T_k) of k, "
            f"got k.shape = {k.shape} and v.shape = {v.shape}"
        )
    h, g = q.shape[1], k.shape[1]
    if g == 0 or h % g:
        raise ValueError(
            f"the key/value heads G = {g} (k.shape = {k.shape}) must divide the query heads "
            f"H = {h} (q.shape = {q.shape})"
        )
    return q, k, v


def _check_options(causal, window, scale, softcap, block_q, block_k, d):
    causal = check_flag("causal", causal)
    if window is not None:
        window = check_int("window", window, 1)
    block_q = check_int("block_q", block_q, 1)
    block_k = check_int("block_k", block_k, 1)
    # A plain float, not a NumPy float64 scalar, so that float32 inputs stay float32.
    scale = 1.0 / math.sqrt(d) if scale is None else check_real("scale", scale)
    softcap = None if softcap is None else check_softcap("softcap", softcap)
    # The sliding window is causal by definition (A12).
    return bool(causal) or window is not None, window, scale, softcap, block_q, block_k


def _grouped(x: np.ndarray, g: int) -> np.ndarray:
    """``(B, H, ...) -> (B, G, H/G, ...)``, a view: query heads ``u H/G .. (u+1) H/G - 1`` share
    key/value head ``u`` (the head map of A10), so they become axis 2 of group ``u``."""
    return x.reshape((x.shape[0], g, x.shape[1] // g) + x.shape[2:])


# ---- forward -------------------------------------------------------------------------------------

def flash_attention_forward(q, k, v, causal: bool = False, window: int | None = None,
                            scale: float | None = None, block_q: int = 16, block_k: int = 16,
                            counters: FlashCounters | None = None, softcap: float | None = None):
    r"""Exact attention, one ``block_q x block_k`` tile of scores at a time (catalogue F1-F5, A12).

    For each query tile, start from the empty state (``m = -inf, l = 0, u = 0``) and, for each key
    tile ``K_j, V_j`` that the mask does not hide entirely:

    .. math::
        S = \tau\, Q_i K_j^\top\ (+\,{-\infty}\text{ at hidden pairs}),\qquad
        \tilde m = \max_{\text{row}} S,\quad \tilde l = \operatorname{rowsum} e^{S - \tilde m},
        \quad \tilde u = e^{S - \tilde m} V_j \qquad\text{(F2)}

    .. math::
        m' = \max(m, \tilde m),\quad l' = e^{m - m'} l + e^{\tilde m - m'} \tilde l,\quad
        u' = e^{m - m'} u + e^{\tilde m - m'} \tilde u \qquad\text{(F3)}

    and at the end :math:`O_i = u / l` (F1) and :math:`\mathrm{lse}_i = m + \log l`. The factors
    :math:`e^{m - m'} \le 1` rescale what was accumulated against the old maximum so that no
    exponential ever exceeds 1. ``tau`` is ``scale``, :math:`1/\sqrt{D}` by default. With a
    ``softcap`` ``c`` each tile's scores are capped before the mask hides any of them,
    :math:`S = c \tanh(\tau Q_i K_j^\top / c)` (N19, as in :func:`refmath.attention.sdpa_forward`):
    the cap acts on one score at a time, so it changes nothing in the tiling.

    Why the logsumexp is returned: it is the one number per row that the backward pass needs to
    recompute any weight exactly, :math:`P_{ij} = e^{S_{ij} - \mathrm{lse}_i}`, so nothing of size
    ``T_q x T_k`` is stored between the passes (F4).

    Shapes: ``q`` ``(B, H, T_q, D)``, ``k`` ``(B, G, T_k, D)``, ``v`` ``(B, G, T_k, D_v)``, ``G``
    dividing ``H`` (GQA; ``G = H`` is MHA, ``G = 1`` MQA). ``causal`` masks keys after the query;
    ``window = w`` keeps only the last ``w`` keys up to the query (A12, causal by definition); the
    queries are aligned to the end of the keys (see the module docstring). Any lengths are allowed,
    including ones that the block sizes do not divide. ``counters`` (a :class:`FlashCounters`) is
    filled in if given.

    Returns ``(o, lse)``: ``o`` ``(B, H, T_q, D_v)`` equal to dense attention up to rounding, and
    ``lse`` ``(B, H, T_q)``, ``-inf`` for a row with no visible key (whose output is 0).
    """
    q, k, v = _check_qkv(q, k, v)
    causal, window, scale, softcap, block_q, block_k = _check_options(
        causal, window, scale, softcap, block_q, block_k, q.shape[-1])
    counters = FlashCounters() if counters is None else counters
    dtype = np.result_type(q, k, v)
    b, h, t_q, _ = q.shape
    g, t_k, d_v = k.shape[1], k.shape[2], v.shape[-1]
    band = _Band(t_q, t_k, causal, window)
    n_key_tiles = _n_tiles(t_k, block_k)

    # BEGIN SOLUTION
    qg = _grouped(q, g)  # (B, G, H/G, T_q, D)
    o = np.zeros((b, h, t_q, d_v), dtype=dtype)
    lse = np.full((b, h, t_q), -np.inf, dtype=dtype)
    og, lseg = _grouped(o, g), _grouped(lse, g)  # views: writing to them fills o and lse

    for i0, i1 in _tiles(0, t_q, block_q, t_q):
        q_i = qg[:, :, :, i0:i1]  # (B, G, H/G, bq, D)
        counters.elements_read += q_i.size
        state = online_softmax_empty(q_i.shape[:-1], d_v, dtype)
        key_tiles = _tiles(*band.keys_seen_by(i0, i1), block_k, t_k)
        counters.tiles_skipped += n_key_tiles - len(key_tiles)
        for j0, j1 in key_tiles:
            # Key/value head u, shaped to broadcast against the H/G query heads of its group.
            k_j = k[:, :, None, j0:j1]  # (B, G, 1, bk, D)
            v_j = v[:, :, None, None, j0:j1]  # (B, G, 1, 1, bk, D_v): a view, broadcast to every row
            counters.elements_read += k_j.size + v_j.size  # loaded again for every query tile
            s = (q_i @ np.swapaxes(k_j, -1, -2)) * scale  # (B, G, H/G, bq, bk)
            if softcap is not None:  # before the mask, which must stay -inf
                s = softcap * np.tanh(s / softcap)
            visible = band.tile_mask(i0, i1, j0, j1)
            if visible is not None:  # a tile cut by the mask's edge: hide its invisible pairs
                s = np.where(visible, s, -np.inf)
            tile = online_softmax_block(s, v_j)  # F2
            state = online_softmax_merge(state, tile)  # F3
            counters.tiles_computed += 1
            counters.score_pairs += (i1 - i0) * (j1 - j0)
            # the block computes weights exp(s - m) of the shape of s, and u of the shape of state.u
            counters.note(s, visible, tile.u, state.u)
        og[:, :, :, i0:i1] = online_softmax_result(state)  # F1: o = u / l, 0 if nothing was seen
        lseg[:, :, :, i0:i1] = online_softmax_logsumexp(state)
        counters.elements_written += og[:, :, :, i0:i1].size + lseg[:, :, :, i0:i1].size
    return o, lse
    # END SOLUTION


# ---- data movement (F6) --------------------------------------------------------------------------

class MemoryTraffic(NamedTuple):
    """Bytes an attention forward pass moves between slow memory (a GPU's HBM) and the chip."""

    read_bytes: int
    written_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.written_bytes


def attention_memory_traffic(batch: int, heads: int, t_q: int, t_k: int, head_dim: int, *,
                             kv_heads: int | None = None, value_dim: int | None = None,
                             tiled: bool = False, block_q: int = 16,
                             bytes_per_element: int = 4) -> MemoryTraffic:
    r"""Bytes read and written by one attention forward pass without a mask, dense or tiled (F6).

    With :math:`B` the batch, :math:`H` query heads, :math:`G` key/value heads, :math:`D` and
    :math:`D_v` the key and value widths, :math:`b` bytes per element.

    **Dense** (the standard implementation, FlashAttention paper's Algorithm 0): read :math:`Q, K`,
    write the scores :math:`S`; read :math:`S`, write the weights :math:`P = \operatorname{softmax}
    (S)`; read :math:`P` and :math:`V`, write :math:`O`. Two ``T_q x T_k`` matrices go out to slow
    memory and come back:

    .. math::
        R_{\text{dense}} = b\big[B H T_q D + B G T_k (D + D_v) + 2 B H T_q T_k\big],\qquad
        W_{\text{dense}} = b\big[2 B H T_q T_k + B H T_q D_v\big]

    **Tiled** (:func:`flash_attention_forward` with query tiles of ``block_q`` rows): each query
    tile is read once, and for each of the :math:`\lceil T_q / B_q \rceil` query tiles every key
    and value tile is read again; the output and one logsumexp per row are written once:

    .. math::
        R_{\text{tiled}} = b\big[B H T_q D + \lceil T_q/B_q \rceil\, B G T_k (D + D_v)\big],\qquad
        W_{\text{tiled}} = b\, B H T_q (D_v + 1)

    For :math:`T_q = T_k = T`, :math:`G = H`, :math:`D_v = D` the dense form moves
    :math:`4 B H T^2 + O(B H T D)` elements and the tiled one :math:`B H T D (2 + 2\lceil T/B_q
    \rceil) + B H T`: for long sequences the dense form moves about :math:`2 B_q / D` times as
    much, and the tiled form never stores anything of size :math:`T^2`. The saving therefore needs
    query tiles wider than :math:`D/2` rows; their size is limited by on-chip memory (the tile of
    :math:`Q`, its output and statistics must fit), which is why the re-reads of :math:`K` and
    :math:`V` do not vanish. The tiled count equals what
    :class:`FlashCounters` records (``elements_read``, ``elements_written``) in an unmasked
    :func:`flash_attention_forward` with that ``block_q``, whatever ``block_k``; a causal mask
    skips tiles and reads less.

    Returns a :class:`MemoryTraffic` (``read_bytes``, ``written_bytes``, ``total_bytes``).
    """
    batch = check_int("batch", batch, 1)
    heads = check_int("heads", heads, 1)
    t_q = check_int("t_q", t_q, 1)
    t_k = check_int("t_k", t_k, 1)
    head_dim = check_int("head_dim", head_dim, 1)
    kv_heads = heads if kv_heads is None else check_int("kv_heads", kv_heads, 1)
    value_dim = head_dim if value_dim is None else check_int("value_dim", value_dim, 1)
    tiled = check_flag("tiled", tiled)
    block_q = check_int("block_q", block_q, 1)
    bytes_per_element = check_int("bytes_per_element", bytes_per_element, 1)
    if heads % kv_heads:
        raise ValueError(f"kv_heads = {kv_heads} must divide heads = {heads}")
    queries, outputs = batch * heads * t_q * head_dim, batch * heads * t_q * value_dim
    keys_and_values = batch * kv_heads * t_k * (head_dim + value_dim)
    if tiled:
        read = queries + _n_tiles(t_q, block_q) * keys_and_values
        written = outputs + batch * heads * t_q  # o and the logsumexp
    else:
        scores = batch * heads * t_q * t_k
        read = queries + keys_and_values + 2 * scores  # S read by the softmax, P by P V
        written = 2 * scores + outputs  # S and P written out, then O
    return MemoryTraffic(read * bytes_per_element, written * bytes_per_element)


# ---- backward ------------------------------------------------------------------------------------

def flash_attention_backward(do, q, k, v, o, lse, causal: bool = False, window: int | None = None,
                             scale: float | None = None, block_q: int = 16, block_k: int = 16,
                             counters: FlashCounters | None = None, softcap: float | None = None):
    # BEGIN SOLUTION
    r"""Gradients of :func:`flash_attention_forward`, FlashAttention-2 style: returns
    ``(dq, dk, dv)`` (catalogue F4, A8).

    First, one number per query row:

    .. math::
        \delta_i = \sum_d dO_{id}\, O_{id}

    Then, for each key tile ``j`` (outer loop, accumulating :math:`dK_j, dV_j`) and each query tile
    ``i`` that sees it (inner loop, adding into :math:`dQ_i`), with the tile's weights recomputed
    from the saved logsumexp instead of stored:

    .. math::
        P = e^{\tau Q_i K_j^\top - \mathrm{lse}_i},\qquad dV_j \mathrel{+}= P^\top dO_i,\qquad
        dP = dO_i V_j^\top,\qquad dS = P \odot (dP - \delta_i)

    .. math::
        dQ_i \mathrel{+}= \tau\, dS\, K_j,\qquad dK_j \mathrel{+}= \tau\, dS^\top Q_i

    These are the dense formulas of A8 restricted to one tile. Two things make them local:

    * ``P`` needs the row's full normaliser, which only exists once every key tile has been seen.
      The saved :math:`\mathrm{lse}_i = \log \sum_j e^{S_{ij}}` is exactly that normaliser, so
      :math:`e^{S - \mathrm{lse}}` gives the final weights at once, tile by tile.
    * The softmax backward needs :math:`\sum_j P_{ij}\, dP_{ij}` over the whole row. Since
      :math:`dP_{ij} = dO_i \cdot v_j` and :math:`O_i = \sum_j P_{ij} v_j`,

      .. math::
          \sum_j P_{ij}\, dP_{ij} = dO_i \cdot \sum_j P_{ij} v_j = dO_i \cdot O_i = \delta_i ,

      a dot product of two ``D_v``-vectors that the forward pass already left behind.

    With a ``softcap`` ``c`` the tile recomputes its capped scores,
    :math:`S = c \tanh(R / c)` with :math:`R = \tau Q_i K_j^\top`, and the cap's slope enters
    between :math:`dS` and the scale (N19):

    .. math::
        dR = dS \odot \big(1 - \tanh^2(R / c)\big),\qquad dQ_i \mathrel{+}= \tau\, dR\, K_j,
        \qquad dK_j \mathrel{+}= \tau\, dR^\top Q_i

    (:math:`\delta_i` is unchanged: it comes from ``O`` and ``dO`` alone.)

    With GQA each key/value head receives the sum of the gradients of the ``H/G`` query heads that
    share it. Rows with no visible key have ``P = 0`` and contribute nothing.

    Arguments: ``do`` and ``o`` ``(B, H, T_q, D_v)``, ``lse`` ``(B, H, T_q)`` (both from the
    forward), ``q``, ``k``, ``v`` and the options as given to the forward. ``dq``, ``dk``, ``dv``
    have the shapes of ``q``, ``k``, ``v``.
    """
    # END SOLUTION
    q, k, v = _check_qkv(q, k, v)
    causal, window, scale, softcap, block_q, block_k = _check_options(
        causal, window, scale, softcap, block_q, block_k, q.shape[-1])
    do = float_array("do", do)
    o = float_array("o", o)
    lse = float_array("lse", lse)
    out_shape = q.shape[:3] + v.shape[-1:]
    for name, x in (("do", do), ("o", o)):
        if x.shape != out_shape:
            raise ValueError(
                f"{name} must have the output shape (B, H, T_q, D_v) = {out_shape} of "
                f"q.shape = {q.shape} and v.shape = {v.shape}, got {name}.shape = {x.shape}"
            )
    if lse.shape != q.shape[:3]:
        raise ValueError(
            f"lse must have shape (B, H, T_q) = {q.shape[:3]} from q.shape = {q.shape}, "
            f"got lse.shape = {lse.shape}"
        )
    counters = FlashCounters() if counters is None else counters
    dtype = np.result_type(q, k, v, do)
    g, t_q, t_k = k.shape[1], q.shape[2], k.shape[2]
    band = _Band(t_q, t_k, causal, window)
    n_query_tiles = _n_tiles(t_q, block_q)
    query_tiles = _tiles(0, t_q, block_q, t_q)

    # BEGIN SOLUTION
    qg, dog, og = _grouped(q, g), _grouped(do, g), _grouped(o, g)  # (B, G, H/G, T_q, .)
    # A row that saw no key has lse = -inf and all its scores -inf; +inf in its place makes
    # exp(S - lse) = 0 there instead of exp(-inf - (-inf)) = NaN.
    lse_safe = _grouped(np.where(np.isneginf(lse), np.inf, lse).astype(dtype, copy=False), g)

    # delta = rowsum(dO * O), one query tile at a time so that no (T_q, D_v)-sized product exists.
    delta = np.empty(lse_safe.shape, dtype=dtype)
    for i0, i1 in query_tiles:
        product = dog[:, :, :, i0:i1] * og[:, :, :, i0:i1]
        delta[:, :, :, i0:i1] = product.sum(axis=-1)
        counters.note(product)

    dq = np.zeros(qg.shape, dtype=dtype)
    dk = np.zeros(k.shape, dtype=dtype)
    dv = np.zeros(v.shape, dtype=dtype)
    for j0, j1 in _tiles(0, t_k, block_k, t_k):
        k_j = k[:, :, None, j0:j1]  # (B, G, 1, bk, D): shared by the group's query heads
        v_j = v[:, :, None, j0:j1]  # (B, G, 1, bk, D_v)
        dk_j = np.zeros(k[:, :, j0:j1].shape, dtype=dtype)  # (B, G, bk, D)
        dv_j = np.zeros(v[:, :, j0:j1].shape, dtype=dtype)  # (B, G, bk, D_v)
        tiles_i = _tiles(*band.queries_seeing(j0, j1), block_q, t_q)
        counters.tiles_skipped += n_query_tiles - len(tiles_i)
        for i0, i1 in tiles_i:
            q_i, do_i = qg[:, :, :, i0:i1], dog[:, :, :, i0:i1]  # (B, G, H/G, bq, .)
            s = (q_i @ np.swapaxes(k_j, -1, -2)) * scale  # (B, G, H/G, bq, bk)
            t = None
            if softcap is not None:  # the forward's capped scores, recomputed as they were
                t = np.tanh(s / softcap)
                s = softcap * t
            visible = band.tile_mask(i0, i1, j0, j1)
            if visible is not None:
                s = np.where(visible, s, -np.inf)
            p = np.exp(s - lse_safe[:, :, :, i0:i1, None])  # the final weights of these pairs
            # Sum over axis 2 (the H/G query heads of the group): their shared K/V head gets it all.
            dv_part = np.swapaxes(p, -1, -2) @ do_i  # (B, G, H/G, bk, D_v)
            dv_j += dv_part.sum(axis=2)
            dp = do_i @ np.swapaxes(v_j, -1, -2)  # (B, G, H/G, bq, bk)
            ds = p * (dp - delta[:, :, :, i0:i1, None])
            if t is not None:
                ds *= 1.0 - t * t  # through the cap: d(c tanh(r / c)) / dr
            dq_part = (ds @ k_j) * scale  # (B, G, H/G, bq, D)
            dq[:, :, :, i0:i1] += dq_part
            dk_part = np.swapaxes(ds, -1, -2) @ q_i  # (B, G, H/G, bk, D)
            dk_j += dk_part.sum(axis=2) * scale
            counters.tiles_computed += 1
            counters.score_pairs += (i1 - i0) * (j1 - j0)
            counters.note(s, t, visible, p, dv_part, dp, ds, dq_part, dk_part)
        dk[:, :, j0:j1] = dk_j
        dv[:, :, j0:j1] = dv_j
    return dq.reshape(q.shape), dk, dv
    # END SOLUTION


# ---- gradient-check cases ------------------------------------------------------------------------

def _flash_case_forward(q, k, v, **options):
    """``(o, cache)`` for the registry: the cache is what the backward takes besides ``do``."""
    o, lse = flash_attention_forward(q, k, v, **options)
    return o, (q, k, v, o, lse, options)


def _flash_case_backward(do, cache):
    q, k, v, o, lse, options = cache
    return flash_attention_backward(do, q, k, v, o, lse, **options)


def _flash_inputs(b, h, g, t_q, t_k, d, d_v, **options):
    def make(rng):
        return {"q": rng.standard_normal((b, h, t_q, d)), "k": rng.standard_normal((b, g, t_k, d)),
                "v": rng.standard_normal((b, g, t_k, d_v)), **options}
    return make


# Blocks of 2 and 3 that do not divide the lengths: every case has partial tiles, tiles cut by the
# mask's edge and (causal, window) tiles skipped whole.
for _label, _make in (
    ("MHA h=g=2, T=5, blocks 2x3", _flash_inputs(2, 2, 2, 5, 5, 3, 4, block_q=2, block_k=3)),
    ("GQA h=4 g=2 causal, T=7, blocks 3x2", _flash_inputs(1, 4, 2, 7, 7, 3, 3, causal=True,
                                                          block_q=3, block_k=2)),
    ("MQA h=3 g=1, window 3, T=6, blocks 2x2", _flash_inputs(2, 3, 1, 6, 6, 2, 3, window=3,
                                                             block_q=2, block_k=2)),
    ("causal T_q=5 > T_k=3: two queries see nothing", _flash_inputs(1, 2, 2, 5, 3, 3, 2, causal=True,
                                                                   block_q=2, block_k=2)),
    ("decode-style T_q=2 < T_k=7, scale 0.6", _flash_inputs(2, 2, 1, 2, 7, 4, 3, causal=True,
                                                            scale=0.6, block_q=4, block_k=3)),
    ("T=1, D=1", _flash_inputs(2, 2, 2, 1, 1, 1, 1)),
    # scores of std 0.9 sqrt(3) ~ 1.6 and a cap of 1.5: in tanh's bend, where a wrong slope shows
    ("GQA h=4 g=2, window 4, scale 0.9, softcap 1.5, T=7, blocks 3x2",
     _flash_inputs(1, 4, 2, 7, 7, 3, 3, window=4, scale=0.9, softcap=1.5, block_q=3, block_k=2)),
):
    register_case(OpCase("flash_attention", _label, ("F1", "F3", "F4", "A8"), _make,
                         _flash_case_forward, _flash_case_backward, ("q", "k", "v"),
                         group="attention execution", max_coords=8))
