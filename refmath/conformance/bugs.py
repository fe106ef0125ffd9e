r"""Planted kernel bugs: each a small wrapper around a correct kernel, and the sweep must catch all.

A conformance suite is only as good as the bugs it catches, so here are the ones attention kernels
are known to ship with (several straight from public trackers), each planted into a correct
kernel: refmath's C++ kernels (:mod:`refmath.kernels`) or :func:`numpy_attention`, a plain NumPy
attention that passes the sweep in float32, bfloat16 and float16. :data:`BUGS` lists them with the
adapter they are run through and the dtypes; :func:`catch_table` runs each through the default sweep
and says which cases caught it. ``tests/test_conformance_bugs.py`` requires every one caught.

The mlir-air case (#1427) is :func:`causal_ignored`: a "causal" kernel that ignores the mask
passes ``allclose(atol=0.5)`` on inputs drawn from ``[0.5, 1]`` (every value is then within 0.5 of
every other, so any convex combination of ``v`` is) and fails the sweep at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from refmath import kernels
from refmath.attention import gqa_head_map

__all__ = ["numpy_attention", "in_order_decode", "causal_off_by_one", "top_left_alignment",
           "causal_ignored", "scale_one_over_d", "scale_ignored", "gqa_head_map_mod",
           "last_partial_tile_dropped", "window_one_short", "lse_base_2", "nan_swallowed_by_fmax",
           "nondeterministic_split", "softmax_without_max_fp16", "bf16_accumulator_decode",
           "decode_reads_one_past", "gqa_power_of_two_groups", "inner_stride_only_checked",
           "bf16_accumulator", "fp16_accumulator", "low_precision_tail_rows",
           "decode_lengths_ignored", "page_table_off_by_one", "stale_slot_read",
           "dv_wrong_transpose", "dq_missing_scale", "PlantedBug", "BUGS", "catch_table"]


# ---- correct kernels the bugs are planted in -----------------------------------------------------

def _visible(t_q, t_k, causal, window, alignment="bottom-right"):
    p = np.arange(t_q)[:, None] + (t_k - t_q if alignment == "bottom-right" else 0)
    j = np.arange(t_k)[None, :]
    keep = np.ones((t_q, t_k), dtype=bool)
    if causal or window is not None:
        keep &= j <= p
    if window is not None:
        keep &= j >= p - window + 1
    return keep


def _dense(q, k, v, visible, scale, clamp_with_fmax=False):
    """Attention in float32 NumPy with a boolean ``visible`` ``(T_q, T_k)`` (or broadcastable),
    rows with no visible key 0: ``(o, lse)``. ``clamp_with_fmax`` masks by ``fmax(s, -big)``, the
    bug of :func:`nan_swallowed_by_fmax`."""
    heads = gqa_head_map(q.shape[1], k.shape[1])
    q32, k32, v32 = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    s = (q32 @ np.swapaxes(k32[:, heads], -1, -2)) * np.float32(scale)
    if clamp_with_fmax:  # a hidden pair gets -big, and fmax(NaN, -big) = -big: NaN vanishes
        s = np.fmax(np.where(visible, s, np.float32(-3e38)), np.float32(-3e38))
        s = np.where(visible, s, -np.inf)
    else:
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0, m)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    p = e / np.where(l == 0, 1, l)
    vv = v32[:, heads]
    o = np.einsum("bhij,bhjd->bhid", p, np.where(np.isfinite(vv), vv, 0))
    bad = (visible.astype(np.float32) @ (~np.isfinite(vv)).astype(np.float32)) > 0
    o[np.broadcast_to(bad, o.shape)] = np.nan
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]
    return o.astype(np.float32), lse.astype(np.float32)


def numpy_attention(q, k, v, mask=None, scale=None):
    """A correct plain attention for the ``numpy`` adapter: the dtype of ``q`` in and out, scores
    and softmax in float32, the max subtracted; ``mask`` boolean, True where visible."""
    dtype = q.dtype
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    visible = np.ones((1, 1, q.shape[2], k.shape[2]), dtype=bool) if mask is None else mask
    o, _ = _dense(q, k, v, visible, scale)
    return o.astype(dtype)


def in_order_decode(q, k_cache, v_cache, lengths, scale=None, accumulator=np.float32):
    """A correct decode kernel for the ``refmath_decode`` adapter that walks its keys one after
    another: the softmax denominator and ``P V`` summed key by key in float32, as a simple loop
    does (BLAS's blocked sums are several times more accurate; the bound must not hold a kernel to
    them). ``accumulator``: the format the running ``P V`` sum is kept in."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    b_, h, d = q.shape
    heads = gqa_head_map(h, k_cache.shape[1])
    out = np.zeros((b_, h, d), dtype=np.float32)
    for b, n in enumerate(np.asarray(lengths)):
        if n == 0:
            continue
        k = k_cache[b, heads, :n].astype(np.float32)  # (H, n, D)
        v = v_cache[b, heads, :n].astype(np.float32)
        s = np.einsum("hd,hjd->hj", q[b].astype(np.float32), k) * np.float32(scale)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        l = np.cumsum(e, axis=1, dtype=np.float32)[:, -1:]  # key after key
        p = e / l
        acc = np.zeros((h, d), dtype=accumulator)
        for j in range(n):
            acc = (acc.astype(np.float32) + p[:, j:j + 1] * v[:, j]).astype(accumulator)
        out[b] = acc
    return out


# ---- the bugs --------------------------------------------------------------------------------------

def causal_off_by_one(q, k, v, causal=False, window=None, scale=None):
    """``j < i`` where ``j <= i`` is meant: the diagonal is hidden (one query row too many is
    given to the kernel, so every query sits one position early)."""
    if not (causal or window):
        return kernels.flash_attention_forward(q, k, v, causal, window, scale)
    pad = np.concatenate([q, np.zeros_like(q[:, :, :1])], axis=2)
    o, lse = kernels.flash_attention_forward(pad, k, v, causal, window, scale)
    return np.ascontiguousarray(o[:, :, :-1]), np.ascontiguousarray(lse[:, :, :-1])


def top_left_alignment(q, k, v, causal=False, window=None, scale=None):
    """Causal with query ``i`` at key position ``i`` (PyTorch's ``is_causal``) where the
    convention is bottom-right (``i + T_k - T_q``): wrong whenever ``T_q != T_k``."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _dense(q, k, v, _visible(q.shape[2], k.shape[2], causal, window, "top-left"), scale)


def causal_ignored(q, k, v, causal=False, window=None, scale=None):
    """The mask is never applied (mlir-air #1427): every query sees every key."""
    return kernels.flash_attention_forward(q, k, v, False, None, scale)


def scale_one_over_d(q, k, v, causal=False, window=None, scale=None):
    """Scores scaled by ``1/D`` instead of ``1/sqrt(D)``."""
    return kernels.flash_attention_forward(q, k, v, causal, window, 1.0 / q.shape[-1])


def scale_ignored(q, k, v, causal=False, window=None, scale=None):
    """The ``scale`` argument is dropped: always ``1/sqrt(D)``."""
    return kernels.flash_attention_forward(q, k, v, causal, window, None)


def gqa_head_map_mod(q, k, v, causal=False, window=None, scale=None):
    """Query head ``r`` reads key/value head ``r % G`` instead of ``r // (H/G)``."""
    h, g = q.shape[1], k.shape[1]
    heads = np.arange(h) % g
    return kernels.flash_attention_forward(q, np.ascontiguousarray(k[:, heads]),
                                           np.ascontiguousarray(v[:, heads]), causal, window, scale)


def last_partial_tile_dropped(q, k, v, causal=False, window=None, scale=None):
    """The loop over key tiles of 64 stops at the last full tile: keys past it are never seen."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    t_k = k.shape[2]
    keep = _visible(q.shape[2], t_k, causal, window)
    if t_k > 64:
        keep = keep & (np.arange(t_k) < (t_k // 64) * 64)[None, :]
    return _dense(q, k, v, keep, scale)


def window_one_short(q, k, v, causal=False, window=None, scale=None):
    """A sliding window of ``w`` keys that keeps ``w - 1``."""
    if window is not None and window > 1:
        window -= 1
    return kernels.flash_attention_forward(q, k, v, causal, window, scale)


def lse_base_2(q, k, v, causal=False, window=None, scale=None):
    """The log-sum-exp returned in base 2 (as kernels that use ``exp2`` keep it) where the natural
    log is expected."""
    o, lse = kernels.flash_attention_forward(q, k, v, causal, window, scale)
    return o, lse / np.float32(math.log(2))


def nan_swallowed_by_fmax(q, k, v, causal=False, window=None, scale=None):
    """The mask applied as ``fmax(s, -big)``: ``fmax`` returns the other operand for NaN, so a NaN
    score becomes a masked one and the row comes back finite."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _dense(q, k, v, _visible(q.shape[2], k.shape[2], causal, window), scale,
                  clamp_with_fmax=True)


_CALLS = [0]


def nondeterministic_split(q, k, v, causal=False, window=None, scale=None):
    """Split-K by a count that changes from call to call (as a split chosen by the free cores
    does): the two parts are merged exactly (F3) but rounded differently each time."""
    if causal or window is not None or k.shape[2] < 2:
        return kernels.flash_attention_forward(q, k, v, causal, window, scale)
    _CALLS[0] += 1
    cut = 1 + (_CALLS[0] * 37) % (k.shape[2] - 1)
    parts = [kernels.flash_attention_forward(q, np.ascontiguousarray(k[:, :, a:b]),
                                             np.ascontiguousarray(v[:, :, a:b]), False, None, scale)
             for a, b in ((0, cut), (cut, k.shape[2]))]
    (o1, l1), (o2, l2) = parts
    lse = np.logaddexp(l1, l2)
    o = o1 * np.exp(l1 - lse)[..., None] + o2 * np.exp(l2 - lse)[..., None]
    return o.astype(np.float32), lse.astype(np.float32)


def softmax_without_max_fp16(q, k, v, mask=None, scale=None):
    """The softmax as ``exp(s) / sum exp(s)`` in float16, without subtracting the row max: any
    score above ``log(65504) = 11.1`` overflows to inf, and inf / inf is NaN (catalogue S4)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    heads = gqa_head_map(q.shape[1], k.shape[1])
    s = ((q.astype(np.float32) @ np.swapaxes(k[:, heads].astype(np.float32), -1, -2))
         * np.float32(scale)).astype(np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(s)  # float16
        if mask is not None:
            e = np.where(mask, e, np.float16(0))
        l = e.astype(np.float32).sum(axis=-1, keepdims=True)
        p = (e.astype(np.float32) / np.where(l == 0, 1, l)).astype(np.float16)
        o = p.astype(np.float32) @ v[:, heads].astype(np.float32)
    return o.astype(q.dtype)


def bf16_accumulator_decode(q, k_cache, v_cache, lengths, scale=None):
    """The running ``P V`` sum of :func:`in_order_decode` kept in bfloat16: every add rounds it to
    8 bits, and the error grows with the number of keys."""
    from refmath.conformance.precision import numpy_dtype

    return in_order_decode(q, k_cache, v_cache, lengths, scale, numpy_dtype("bfloat16"))


def decode_reads_one_past(q, k_cache, v_cache, lengths, scale=None):
    """Each sequence reads one slot past its length (``<=`` for ``<``): what that slot holds, NaN
    or a previous sequence's finite data, enters the output."""
    longer = np.minimum(np.asarray(lengths) + 1, k_cache.shape[2])
    return kernels.decode(q, k_cache, v_cache, longer, scale=scale)


def gqa_power_of_two_groups(q, k, v, causal=False, window=None, scale=None):
    """The group size ``H / G`` rounded down to a power of two (a shift where a division is
    meant): right for ratios 1, 2, 4, 8; for 3, 6 or 7 query heads read the wrong key/value head."""
    h, g = q.shape[1], k.shape[1]
    group = 1 << ((h // g).bit_length() - 1)
    heads = np.minimum(np.arange(h) // group, g - 1)
    return kernels.flash_attention_forward(q, np.ascontiguousarray(k[:, heads]),
                                           np.ascontiguousarray(v[:, heads]), causal, window, scale)


def _as_if_contiguous(x):
    """``x`` read from its first element as if C-contiguous, as a kernel that takes the data
    pointer and the shape does."""
    strides = tuple(int(np.prod(x.shape[i + 1:])) * x.itemsize for i in range(x.ndim))
    return np.lib.stride_tricks.as_strided(x, x.shape, strides).copy()


def inner_stride_only_checked(q, k, v, causal=False, window=None, scale=None):
    """Contiguity checked by the last axis's stride alone: an array whose head width is contiguous
    is taken as wholly contiguous. Right for ``(B, H, T, D)`` arrays and for arrays whose last axis
    is strided (copied first), wrong for the ``(B, T, H, D).transpose(1, 2)`` view models pass."""
    fixed = []
    for x in (q, k, v):
        if x.strides[-1] != x.itemsize:
            x = np.ascontiguousarray(x)
        fixed.append(_as_if_contiguous(x))
    return kernels.flash_attention_forward(*fixed, causal, window, scale)


def _accumulate_in_dtype(q, k, v, mask, scale, rows):
    """:func:`numpy_attention` with ``P V`` summed key by key in the inputs' own dtype in the
    query rows ``rows`` (a slice), in float32 elsewhere."""
    dtype = q.dtype
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    o = numpy_attention(q, k, v, mask, scale).astype(np.float32)
    visible = np.ones((1, 1, q.shape[2], k.shape[2]), dtype=bool) if mask is None else mask
    heads = gqa_head_map(q.shape[1], k.shape[1])
    s = (q.astype(np.float32) @ np.swapaxes(k[:, heads].astype(np.float32), -1, -2)) * np.float32(scale)
    s = np.where(visible, s, -np.inf)[:, :, rows]
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isneginf(m), 0, m))
    p = e / np.maximum(e.sum(axis=-1, keepdims=True), np.float32(1e-30))
    vv = v[:, heads].astype(np.float32)
    acc = np.zeros(p.shape[:3] + (v.shape[-1],), dtype=dtype)
    for j in range(k.shape[2]):
        acc = (acc.astype(np.float32) + p[..., j:j + 1] * vv[:, :, None, j]).astype(dtype)
    o[:, :, rows] = acc.astype(np.float32)
    return o.astype(dtype)


def bf16_accumulator(q, k, v, mask=None, scale=None):
    """``P V`` summed in bfloat16, key by key (an accumulator in the inputs' format, not
    float32): the error grows with the number of keys, several ulps past a few dozen."""
    return _accumulate_in_dtype(q, k, v, mask, scale, slice(None))


def fp16_accumulator(q, k, v, mask=None, scale=None):
    """``P V`` summed in float16, key by key: as :func:`bf16_accumulator`, in float16."""
    return _accumulate_in_dtype(q, k, v, mask, scale, slice(None))


def low_precision_tail_rows(q, k, v, mask=None, scale=None):
    """The query rows past the last full tile of 64 (a remainder path) sum ``P V`` in the inputs'
    format, every other row in float32: an error of a few ulps in a few rows, under the
    output-wide tolerance; only the row-by-row rule sees it."""
    t = q.shape[2]
    return _accumulate_in_dtype(q, k, v, mask, scale, slice((t // 64) * 64 if t > 64 else t, t))


# ---- the bugs of the decode contracts --------------------------------------------------------------

def decode_lengths_ignored(q, k_cache, v_cache, lengths, scale=None):
    """Every sequence attends to the whole cache: the per-sequence lengths (the padding of a
    batch of unequal sequences) are ignored."""
    full = np.full_like(np.asarray(lengths), k_cache.shape[2])
    return kernels.decode(q, k_cache, v_cache, full, scale=scale)


def page_table_off_by_one(q, k_pages, v_pages, page_table, lengths, scale=None):
    """Each logical page read from the physical page after the one the table names."""
    table = (np.asarray(page_table) + 1) % k_pages.shape[0]
    return kernels.paged_decode(q, k_pages, v_pages, table, lengths, scale=scale)


def stale_slot_read(q, k_pages, v_pages, page_table, lengths, scale=None):
    """One slot past the length read (``<=`` for ``<``): a stale or unwritten slot of the last
    page, which vLLM's tests fill with NaN (vLLM #641)."""
    cap = page_table.shape[1] * k_pages.shape[2]
    longer = np.minimum(np.asarray(lengths) + 1, cap)
    return kernels.paged_decode(q, k_pages, v_pages, page_table, longer, scale=scale)


def _weights(q, k, lse, causal, window, scale):
    heads = gqa_head_map(q.shape[1], k.shape[1])
    s = (q @ np.swapaxes(k[:, heads], -1, -2)) * np.float32(scale)
    keep = _visible(q.shape[2], k.shape[2], causal, window)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(keep, np.exp(s - np.where(np.isfinite(lse), lse, 0)[..., None]), 0)


def dv_wrong_transpose(do, q, k, v, o, lse, causal=False, window=None, scale=None):
    """``dV = P dO`` where ``P^T dO`` is meant (the shapes agree when ``T_q = T_k``)."""
    dq, dk, dv = kernels.flash_attention_backward(do, q, k, v, o, lse, causal, window, scale)
    if q.shape[2] != k.shape[2]:
        return dq, dk, dv
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    p = _weights(q, k, lse, causal, window, scale)
    wrong = p @ do  # (B, H, T, D)
    g = k.shape[1]
    dv = wrong.reshape(q.shape[0], g, q.shape[1] // g, *wrong.shape[2:]).sum(axis=2)
    return dq, dk, dv.astype(np.float32)


def dq_missing_scale(do, q, k, v, o, lse, causal=False, window=None, scale=None):
    """``dQ = dS K`` without the factor ``tau``."""
    dq, dk, dv = kernels.flash_attention_backward(do, q, k, v, o, lse, causal, window, scale)
    tau = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return (dq / np.float32(tau)).astype(np.float32), dk, dv


@dataclass(frozen=True)
class PlantedBug:
    """One bug: its function, the adapter it is run through, the dtypes, and what it gets wrong."""

    name: str
    fn: object
    adapter: str
    dtypes: tuple = ("float32",)

    @property
    def what(self) -> str:
        return " ".join(self.fn.__doc__.split()).split(": ")[0].split(". ")[0]


BUGS = (
    PlantedBug("causal off by one", causal_off_by_one, "refmath"),
    PlantedBug("top-left instead of bottom-right", top_left_alignment, "refmath"),
    PlantedBug("causal mask ignored (mlir-air #1427)", causal_ignored, "refmath"),
    PlantedBug("scale 1/d", scale_one_over_d, "refmath"),
    PlantedBug("scale argument ignored", scale_ignored, "refmath"),
    PlantedBug("GQA head map h % G", gqa_head_map_mod, "refmath"),
    PlantedBug("softmax without max subtraction, fp16", softmax_without_max_fp16, "numpy",
               ("float16",)),
    PlantedBug("last partial tile dropped", last_partial_tile_dropped, "refmath"),
    PlantedBug("window one key short", window_one_short, "refmath"),
    PlantedBug("lse in base 2", lse_base_2, "refmath"),
    PlantedBug("NaN swallowed by fmax", nan_swallowed_by_fmax, "refmath"),
    PlantedBug("nondeterministic split reduction", nondeterministic_split, "refmath"),
    PlantedBug("padding lengths ignored (decode)", decode_lengths_ignored, "refmath_decode"),
    PlantedBug("page table read off by one page", page_table_off_by_one, "refmath_paged"),
    PlantedBug("stale slot past the length read", stale_slot_read, "refmath_paged"),
    PlantedBug("dV with the wrong transpose", dv_wrong_transpose, "refmath_backward"),
    PlantedBug("dq missing the scale", dq_missing_scale, "refmath_backward"),
    PlantedBug("GQA group size rounded to a power of two", gqa_power_of_two_groups, "refmath"),
    PlantedBug("contiguity judged by the last stride", inner_stride_only_checked, "refmath"),
    PlantedBug("P V accumulated in bfloat16", bf16_accumulator, "numpy", ("bfloat16",)),
    PlantedBug("P V accumulated in float16", fp16_accumulator, "numpy", ("float16",)),
    PlantedBug("low-precision accumulator in the tail rows", low_precision_tail_rows, "numpy",
               ("bfloat16", "float16")),
    PlantedBug("decode reads one slot past the length", decode_reads_one_past, "refmath_decode"),
    PlantedBug("decode P V accumulated in bfloat16", bf16_accumulator_decode, "refmath_decode"),
)


def catch_table(quick: bool = False, bugs=BUGS) -> list[dict]:
    """Run every bug through the sweep: per bug, the cases that ran, the cases that caught it, and
    the first catch's reason."""
    from refmath.conformance.run import check_attention

    out = []
    for bug in bugs:
        results = check_attention(bug.fn, bug.adapter, quick=quick, dtypes=bug.dtypes)
        ran = [r for r in results if r.status != "skip"]
        caught = [r for r in ran if r.status == "fail"]
        out.append({"bug": bug.name, "adapter": bug.adapter, "ran": len(ran), "caught": len(caught),
                    "caught_by": [r.case.id for r in caught],
                    "first_reason": caught[0].reason if caught else ""})
    return out
