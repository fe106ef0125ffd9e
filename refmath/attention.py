"""Scaled dot-product attention, its masks, and multi-head attention with shared key/value heads.

Layout: attention tensors are ``(..., T, D)`` with the heads, if any, among the leading dimensions
(``(B, H, T, D)`` in multi-head attention). A mask, broadcast against the ``(..., t_q, t_k)`` score
matrix, is either boolean (True where a query may attend to a key, as in PyTorch) or additive
(0 where a key is visible, ``-inf`` where it is not); the mask functions below build additive ones.

One module covers MHA, GQA and MQA: they differ only in ``g``, the number of key/value heads that
the ``h`` query heads share (catalogue A10), and cross-attention only in where keys and values come
from (A7).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from refmath._validate import (
    check_axis,
    check_broadcastable,
    check_choice,
    check_int,
    check_min_ndim,
    check_ndim,
    check_real,
    float_array,
    int_array,
)
from refmath.ffn import (SoftcapCache, check_softcap, matmul_rows, softcap_backward,
                         softcap_forward)
from refmath.kernels import BACKENDS
from refmath.registry import OpCase, register_case
from refmath.softmax import SoftmaxCache, softmax_backward, softmax_forward

__all__ = ["causal_mask", "padding_mask", "local_window_mask", "additive_mask", "SDPACache",
           "SoftcapSDPACache", "sdpa_forward", "sdpa_backward", "gqa_head_map", "split_heads",
           "merge_heads", "MHACache", "mha_forward", "mha_backward", "ATTENTION_BACKENDS",
           "CausalAttentionCache", "causal_attention_forward", "causal_attention_backward",
           "causal_attention_kv"]


# ---- masks ---------------------------------------------------------------------------------------

def _additive(allowed: np.ndarray, dtype) -> np.ndarray:
    """Turn a boolean 'visible' array into an additive mask of 0 and -inf."""
    return np.where(allowed, 0.0, -np.inf).astype(dtype)


def causal_mask(t_q: int, t_k: int | None = None, dtype=np.float64) -> np.ndarray:
    r"""Causal mask of shape ``(t_q, t_k)``: query ``i`` sees key ``j`` iff ``j <= i + t_k - t_q``.

    The queries are the last ``t_q`` positions of the ``t_k`` keys (0-based query ``i`` sits at
    position ``i + t_k - t_q``). With ``t_k = t_q`` this is the usual lower triangle; with
    ``t_q = 1`` (a decode step) the single query sees every key.
    """
    t_q = check_int("t_q", t_q, 1)
    t_k = t_q if t_k is None else check_int("t_k", t_k, 1)
    if t_k < t_q:
        raise ValueError(
            f"t_k must be at least t_q (the queries are the last t_q of the t_k keys), "
            f"got t_q = {t_q}, t_k = {t_k}"
        )
    i = np.arange(t_q)[:, None]
    j = np.arange(t_k)[None, :]
    return _additive(j <= i + (t_k - t_q), dtype)


def padding_mask(lengths, t_k: int, dtype=np.float64) -> np.ndarray:
    r"""Mask hiding the padding of each sequence: key ``j`` of sequence ``b`` is visible iff
    ``j < lengths[b]``.

    ``lengths`` is ``(B,)`` with entries in ``[0, t_k]``; the mask is ``(B, 1, 1, t_k)`` so that it
    broadcasts over heads and queries of ``(B, H, t_q, t_k)`` scores. A length of 0 masks every key:
    such a sequence's attention output is 0 (see :func:`refmath.softmax.softmax_forward`).
    """
    t_k = check_int("t_k", t_k, 1)
    lengths = int_array("lengths", lengths, t_k + 1)
    check_ndim("lengths", lengths, 1, "(B,)")
    visible = np.arange(t_k)[None, :] < lengths[:, None]
    return _additive(visible, dtype)[:, None, None, :]


def local_window_mask(t: int, window: int, dtype=np.float64) -> np.ndarray:
    r"""Sliding-window causal mask of shape ``(t, t)`` (catalogue A12).

    .. math::
        M_{ij} = 0 \text{ if } i - w + 1 \le j \le i,\ -\infty \text{ otherwise (0-based)}

    Each query sees itself and the ``w - 1`` keys before it, so there are
    :math:`\sum_i \min(i+1, w) = O(T w)` visible pairs instead of :math:`O(T^2)`. The mask only
    defines the function; saving the work needs a kernel that skips the hidden pairs.
    """
    t = check_int("t", t, 1)
    window = check_int("window", window, 1)
    i = np.arange(t)[:, None]
    j = np.arange(t)[None, :]
    return _additive((j <= i) & (j >= i - window + 1), dtype)


def _mask_error(mask: np.ndarray, what: str) -> ValueError | TypeError:
    """The one-line refusal of a mask that is neither boolean nor additive."""
    return (ValueError if mask.dtype.kind == "f" else TypeError)(
        f"mask must be boolean (True = may attend, as in PyTorch) or an additive float mask "
        f"(0 = may attend, -inf = may not), got {what} with shape {mask.shape}"
    )


def additive_mask(mask, dtype=np.float64) -> np.ndarray:
    """The additive form (0 or ``-inf``) of an attention mask given in either accepted form.

    A boolean mask (True = the query may attend to the key, PyTorch's convention) becomes 0 where
    True and ``-inf`` where False; an additive float mask is returned as it is, in ``dtype``. A
    float mask whose values are only 0 and 1 is refused: it is almost always a boolean mask from
    another library written as floats, and added to the scores it would not hide a single key
    (softmax ignores a uniform shift), so attention would silently see everything. Integer masks
    are refused for the same ambiguity.
    """
    if not isinstance(mask, np.ndarray):
        mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        return _additive(mask, dtype)
    if mask.dtype.kind != "f":
        raise _mask_error(mask, f"dtype {mask.dtype}")
    # Values only in {0, 1}, at least one of them 1: an all-zero mask is a valid "see everything".
    if np.any(mask == 1) and np.all((mask == 0) | (mask == 1)):
        raise _mask_error(mask, "a float mask whose values are only 0 and 1 (pass it as bool)")
    return mask.astype(dtype, copy=False)


# ---- scaled dot-product attention ----------------------------------------------------------------

def _check_broadcasts_to(name: str, x: np.ndarray, shape: tuple, target: str) -> None:
    """Require ``x`` to broadcast to exactly ``shape`` (it may not enlarge the target)."""
    check_broadcastable(name, x, shape, target)
    if np.broadcast_shapes(x.shape, shape) != tuple(shape):
        raise ValueError(
            f"{name} with shape {x.shape} would enlarge {target} with shape {shape}; "
            f"it must broadcast to {target}'s shape"
        )


class SDPACache(NamedTuple):
    q: np.ndarray  # (..., t_q, d_k)
    k: np.ndarray  # (..., t_k, d_k)
    v: np.ndarray  # (..., t_k, d_v)
    a: np.ndarray  # attention weights before dropout, (..., t_q, t_k)
    dropout_mask: np.ndarray | None  # multiplier on a, broadcastable to (..., t_q, t_k)
    scale: float


class SoftcapSDPACache(NamedTuple):
    """The cache of soft-capped attention (N19): the attention's own and the cap's. A type of its
    own rather than more fields of :class:`SDPACache`, whose six fields code may unpack."""

    attn: SDPACache  # q, k, v, the weights of the capped scores, dropout mask, scale
    capped: SoftcapCache  # tanh(tau q k^T / c), for the cap's slope in backward


def sdpa_forward(q, k, v, mask=None, dropout_mask=None, scale: float | None = None,
                 softcap: float | None = None):
    r"""Scaled dot-product attention (catalogue A2), with an optional logit cap (N19).

    .. math::
        S = \tau\, Q K^\top + M,\qquad A = \operatorname{softmax}_{\text{rows}}(S),
        \qquad O = (A \odot D)\, V

    Shapes: ``q`` is ``(..., t_q, d_k)``, ``k`` is ``(..., t_k, d_k)``, ``v`` is ``(..., t_k, d_v)``
    with the same leading dimensions; ``O`` is ``(..., t_q, d_v)``. ``mask`` (boolean, True = may
    attend, as in PyTorch; or additive ``M``, 0 or ``-inf``; see :func:`additive_mask`) and
    ``dropout_mask`` (``D``: 0 for dropped weights, ``1/(1-p)`` for kept ones) must
    broadcast to the ``(..., t_q, t_k)`` scores. ``scale`` is :math:`\tau`, by default
    :math:`1/\sqrt{d_k}` (Gemma's ``query_pre_attn_scalar`` ``s`` sets :math:`\tau = s^{-1/2}`).

    With ``softcap`` = ``c`` (Gemma 2's ``attn_logit_softcapping``) the scores are soft-capped
    before the mask is added (:func:`refmath.ffn.softcap_forward`):

    .. math::
        S = c \tanh\big(\tau\, Q K^\top / c\big) + M

    The order matters: capping after the mask would turn a hidden key's :math:`-\infty` into
    :math:`c \tanh(-\infty) = -c`, a finite score: the hidden key would get at least
    :math:`e^{-2c}` times the best key's weight instead of 0, and a query with no visible key would
    average every value instead of giving a zero row.

    Without dropout each output row is a convex combination of the visible values; a query with no
    visible key gets a zero row. Returns ``(O, cache)``: an :class:`SDPACache`, or with a cap a
    :class:`SoftcapSDPACache`.
    """
    q = float_array("q", q)
    k = float_array("k", k)
    v = float_array("v", v)
    check_min_ndim("q", q, 2, "(..., t_q, d_k)")
    check_min_ndim("k", k, 2, "(..., t_k, d_k)")
    check_min_ndim("v", v, 2, "(..., t_k, d_v)")
    check_axis("k", k, -1, q.shape[-1], f"the key width d_k of q.shape = {q.shape}")
    check_axis("v", v, -2, k.shape[-2], f"the number of keys t_k of k.shape = {k.shape}")
    for name, x in (("k", k), ("v", v)):
        if x.shape[:-2] != q.shape[:-2]:
            raise ValueError(
                f"q and {name} must have the same leading (batch, head) dimensions, "
                f"got q.shape = {q.shape} and {name}.shape = {x.shape}"
            )
    # A plain float, not a NumPy float64 scalar, so that float32 inputs stay float32.
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else check_real("scale", scale)
    softcap = None if softcap is None else check_softcap("softcap", softcap)
    # A boolean mask becomes its additive form here, so the equation below sees only 0 and -inf.
    mask = None if mask is None else additive_mask(mask, np.result_type(q, k))

    # BEGIN SOLUTION
    # (tau Q) K^T rather than tau (Q K^T): the same scores, scaling the (t_q, d_k) queries instead
    # of the larger (t_q, t_k) score matrix
    s = (q * scale) @ np.swapaxes(k, -1, -2)
    capped = None
    if softcap is not None:  # before the mask: c tanh(-inf / c) would be -c, not -inf
        s, capped = softcap_forward(s, softcap)
    if mask is not None:
        _check_broadcasts_to("mask", mask, s.shape, "the scores q k^T")
        s += mask.astype(s.dtype, copy=False)  # in place: s is a fresh (..., t_q, t_k) array
    a, _ = softmax_forward(s)
    weights = a
    if dropout_mask is not None:
        dropout_mask = float_array("dropout_mask", dropout_mask).astype(s.dtype, copy=False)
        _check_broadcasts_to("dropout_mask", dropout_mask, s.shape, "the scores q k^T")
        weights = a * dropout_mask
    cache = SDPACache(q, k, v, a, dropout_mask, scale)
    return weights @ v, (cache if capped is None else SoftcapSDPACache(cache, capped))
    # END SOLUTION


def sdpa_backward(dout, cache: SDPACache | SoftcapSDPACache):
    # BEGIN SOLUTION
    r"""Gradients of scaled dot-product attention: returns ``(dq, dk, dv)`` (catalogue A8).

    .. math::
        dV = (A \odot D)^\top dO,\quad dA = (dO\, V^\top) \odot D,\quad
        dS_{ij} = A_{ij}\Big(dA_{ij} - \sum_u A_{iu}\, dA_{iu}\Big),\quad
        dQ = \tau\, dS\, K,\quad dK = \tau\, dS^\top Q

    with :math:`\tau` the scale (:math:`1/\sqrt{d_k}` by default). Dropout enters through its mask
    ``D``, which is why the cache keeps it. A masked key has ``A = 0`` in every row, so its rows of
    ``dK`` and ``dV`` are exactly zero.

    With a logit cap ``c`` the scores were :math:`S = c \tanh(R / c) + M` with
    :math:`R = \tau Q K^\top`; one more step of the chain rule sits between the softmax and the
    scale (N19):

    .. math::
        dR = dS \odot \big(1 - \tanh^2(R / c)\big),\qquad dQ = \tau\, dR\, K,\quad
        dK = \tau\, dR^\top Q

    A masked entry has :math:`dS = 0`, so it stays 0.
    """
    capped = None
    if isinstance(cache, SoftcapSDPACache):
        cache, capped = cache
    q, k, v, a, dropout_mask, scale = cache
    weights = a if dropout_mask is None else a * dropout_mask
    dv = np.swapaxes(weights, -1, -2) @ dout
    da = dout @ np.swapaxes(v, -1, -2)
    if dropout_mask is not None:
        da = da * dropout_mask
    ds = softmax_backward(da, SoftmaxCache(a))
    if capped is not None:
        ds = softcap_backward(ds, capped)
    dq = (ds @ k) * scale
    dk = (np.swapaxes(ds, -1, -2) @ q) * scale
    return dq, dk, dv
    # END SOLUTION


# ---- multi-head attention: MHA, GQA, MQA, cross-attention, fused QKV -------------------------------

def gqa_head_map(h: int, g: int) -> np.ndarray:
    r"""The key/value head used by each query head (catalogue A10, 0-based).

    .. math::
        \pi(r) = \left\lfloor \frac{r}{h/g} \right\rfloor,\qquad r = 0, \dots, h-1

    so consecutive groups of ``h/g`` query heads share one key/value head. ``g = h`` is MHA (the
    identity map), ``g = 1`` is MQA (every head reads head 0). Returns an int array of length ``h``.
    """
    h = check_int("n_heads h", h, 1)
    g = check_int("n_kv_heads g", g, 1)
    if h % g:
        raise ValueError(f"n_kv_heads g = {g} must divide n_heads h = {h}")
    # BEGIN SOLUTION
    return np.arange(h) // (h // g)
    # END SOLUTION


_SEPARATE = ("w_q", "w_k", "w_v", "w_o")
_SEPARATE_BIASES = ("b_q", "b_k", "b_v", "b_o")
_FUSED = ("w_qkv", "w_o")
_FUSED_BIASES = ("b_qkv", "b_o")


def _check_mha_inputs(x, context):
    """Return ``(x, context, unbatched)`` with ``x`` as ``(B, T, d)`` and ``context`` as
    ``(B, S, d_ctx)`` (or None), adding a batch axis of 1 to unbatched input."""
    x = float_array("x", x)
    check_ndim("x", x, (2, 3), "(B, T, d) or (T, d)")
    unbatched = x.ndim == 2
    if context is not None:
        context = float_array("context", context)
        check_ndim("context", context, x.ndim, "(B, S, d_ctx), or (S, d_ctx) when x is (T, d)")
    if unbatched:
        x = x[None]
        context = None if context is None else context[None]
    if context is not None:
        check_axis("context", context, 0, x.shape[0], f"the batch size of x.shape = {x.shape}")
    return x, context, unbatched


def _check_params(params: dict, h: int, g: int, d: int, d_ctx: int, cross: bool):
    """Check the keys, dtypes and shapes of ``params``; return ``(params, d_h)`` with ``params`` a
    new dict of float arrays and ``d_h`` the head width read off the query weight."""
    fused = "w_qkv" in params
    if fused and cross:
        raise ValueError("params with a fused 'w_qkv' are for self-attention only; got a context")
    required, optional = (_FUSED, _FUSED_BIASES) if fused else (_SEPARATE, _SEPARATE_BIASES)
    missing = [key for key in required if key not in params]
    extra = sorted(set(params) - set(required) - set(optional))
    if missing:
        raise ValueError(f"params is missing {missing} (has {sorted(params)})")
    if extra:
        raise ValueError(f"params has unexpected keys {extra} (allowed: {list(required + optional)})")
    params = {key: float_array(f"params[{key!r}]", value) for key, value in params.items()}

    w_key, n_cols = ("w_qkv", h + 2 * g) if fused else ("w_q", h)
    w_in = params[w_key]
    if w_in.ndim != 2 or w_in.shape[0] != d or w_in.shape[1] % n_cols:
        raise ValueError(
            f"params[{w_key!r}] must have shape (d, {n_cols} * d_h) with d = {d} from x, "
            f"n_heads = {h}, n_kv_heads = {g}; got {w_in.shape}"
        )
    d_h = w_in.shape[1] // n_cols
    shapes = {"w_o": (h * d_h, d), "b_o": (d,)}
    if fused:
        shapes["b_qkv"] = (n_cols * d_h,)
    else:
        shapes.update(w_k=(d_ctx, g * d_h), w_v=(d_ctx, g * d_h), b_q=(h * d_h,), b_k=(g * d_h,),
                      b_v=(g * d_h,))
    for key, shape in shapes.items():
        if key in params and params[key].shape != shape:
            raise ValueError(
                f"params[{key!r}] must have shape {shape} (d = {d}, d_ctx = {d_ctx}, h = {h}, "
                f"g = {g}, d_h = {d_h}), got {params[key].shape}"
            )
    return params, d_h


def _linear(x, params, w: str, b: str):
    y = matmul_rows(x, params[w])
    return y + params[b] if b in params else y


def split_heads(x: np.ndarray, n: int) -> np.ndarray:
    """``(B, T, n * d_h) -> (B, n, T, d_h)``: head ``r`` owns columns ``r d_h .. (r+1) d_h - 1``."""
    b, t, width = x.shape
    return x.reshape(b, t, n, width // n).transpose(0, 2, 1, 3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """``(B, n, T, d_h) -> (B, T, n * d_h)``, the concatenation ``[O_1 ... O_n]``."""
    b, n, t, d_h = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, n * d_h)


class MHACache(NamedTuple):
    x: np.ndarray  # (B, T, d), batched even when the caller passed (T, d)
    context: np.ndarray | None  # (B, S, d_ctx) for cross-attention, None for self-attention
    params: dict
    n_heads: int
    n_kv_heads: int
    heads_out: np.ndarray  # [O_1 ... O_h], (B, T, h d_h): the input of the output projection
    attn: SDPACache  # per query head; k, v already repeated to h heads
    unbatched: bool


def mha_forward(x, params: dict, n_heads: int, n_kv_heads: int | None = None, context=None,
                mask=None, dropout_mask=None):
    r"""Multi-head attention with ``g`` shared key/value heads (catalogue A1, A6, A7, A9, A10).

    .. math::
        Q = X W_Q + b_Q,\quad K = Z W_K + b_K,\quad V = Z W_V + b_V \\
        O_r = \operatorname{softmax}\Big(\frac{Q_r K_{\pi(r)}^\top}{\sqrt{d_h}} + M\Big) V_{\pi(r)},
        \qquad Y = [O_1 \cdots O_h]\, W_O + b_O

    ``Z = X`` for self-attention, ``Z = context`` for cross-attention (queries from ``x``, keys and
    values from ``context``; scores are ``T x S``). ``pi`` is :func:`gqa_head_map`.

    Shapes: ``x`` ``(B, T, d)`` or ``(T, d)``; ``context`` ``(B, S, d_ctx)`` (or ``(S, d_ctx)``);
    ``params``: ``w_q`` ``(d, h d_h)``, ``w_k`` and ``w_v`` ``(d_ctx, g d_h)``, ``w_o``
    ``(h d_h, d)``, optional biases ``b_q``, ``b_k``, ``b_v``, ``b_o`` of the matching widths; or,
    for self-attention, the fused ``w_qkv = [W_Q W_K W_V]`` ``(d, (h + 2g) d_h)`` with optional
    ``b_qkv`` (A9), and ``w_o``, ``b_o``. ``mask`` and ``dropout_mask`` broadcast to the
    ``(B, h, T, S)`` weights (see :func:`sdpa_forward`). ``n_kv_heads`` defaults to ``n_heads``.

    Returns ``(Y, cache)`` with ``Y`` shaped like ``x``.
    """
    h = check_int("n_heads", n_heads, 1)
    g = h if n_kv_heads is None else check_int("n_kv_heads", n_kv_heads, 1)
    heads = gqa_head_map(h, g)
    x, context, unbatched = _check_mha_inputs(x, context)
    source = x if context is None else context  # Z: where keys and values come from
    params, d_h = _check_params(params, h, g, x.shape[-1], source.shape[-1], context is not None)

    # BEGIN SOLUTION
    # 1. Project (A1), with one matrix product when the weights are fused (A9).
    if "w_qkv" in params:
        qkv = _linear(x, params, "w_qkv", "b_qkv")
        q, k, v = np.split(qkv, [h * d_h, (h + g) * d_h], axis=-1)
    else:
        q = _linear(x, params, "w_q", "b_q")
        k = _linear(source, params, "w_k", "b_k")
        v = _linear(source, params, "w_v", "b_v")
    # 2. Split heads to (B, heads, T, d_h); query head r reads key/value head heads[r] (A10).
    qh, kh, vh = split_heads(q, h), split_heads(k, g), split_heads(v, g)
    # 3. Attention in every query head at once (A2).
    o, attn = sdpa_forward(qh, kh[:, heads], vh[:, heads], mask=mask, dropout_mask=dropout_mask)
    # 4. Concatenate the heads and project back to width d (A6).
    heads_out = merge_heads(o)
    y = _linear(heads_out, params, "w_o", "b_o")
    cache = MHACache(x, context, params, h, g, heads_out, attn, unbatched)
    return (y[0] if unbatched else y), cache
    # END SOLUTION


def _linear_grads(x, dy, grads, w: str, b: str, params) -> None:
    """Store ``dW = X^T dY`` and ``db = sum dY`` (summed over batch and tokens) in ``grads``."""
    grads[w] = x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])
    if b in params:
        grads[b] = dy.sum(axis=(0, 1))


def mha_backward(dout, cache: MHACache):
    # BEGIN SOLUTION
    r"""Gradients of :func:`mha_forward`: ``(dx, dparams)``, or ``(dx, dparams, dcontext)`` for
    cross-attention, with ``dparams`` keyed like ``params``.

    Backward runs the forward in reverse: the output projection (:math:`dW_O = H^\top dY`), the
    per-head attention backward (A8), then the key/value heads. A key/value head used by ``h/g``
    query heads receives the sum of their gradients: those query heads are the consecutive block
    ``u h/g .. (u+1) h/g - 1``, so a reshape to ``(B, g, h/g, S, d_h)`` and a sum does it. Finally
    :math:`dW_Q = X^\top dQ` and :math:`dX = dQ\, W_Q^\top` (+ the key and value terms when they
    also come from ``x``).
    """
    x, context, params, h, g, heads_out, attn, unbatched = cache
    dy = dout[None] if unbatched else dout
    grads: dict = {}
    _linear_grads(heads_out, dy, grads, "w_o", "b_o", params)
    do = split_heads(matmul_rows(dy, params["w_o"].T), h)
    dqh, dk_rep, dv_rep = sdpa_backward(do, attn)
    b, _, s, d_h = dk_rep.shape
    dq = merge_heads(dqh)
    dk = merge_heads(dk_rep.reshape(b, g, h // g, s, d_h).sum(axis=2))
    dv = merge_heads(dv_rep.reshape(b, g, h // g, s, d_h).sum(axis=2))

    if "w_qkv" in params:
        dqkv = np.concatenate([dq, dk, dv], axis=-1)
        _linear_grads(x, dqkv, grads, "w_qkv", "b_qkv", params)
        dx = matmul_rows(dqkv, params["w_qkv"].T)
    else:
        source = x if context is None else context
        _linear_grads(x, dq, grads, "w_q", "b_q", params)
        _linear_grads(source, dk, grads, "w_k", "b_k", params)
        _linear_grads(source, dv, grads, "w_v", "b_v", params)
        dx = matmul_rows(dq, params["w_q"].T)
        dsource = matmul_rows(dk, params["w_k"].T) + matmul_rows(dv, params["w_v"].T)
        if context is None:
            dx = dx + dsource
        else:
            return _unbatch(dx, unbatched), grads, _unbatch(dsource, unbatched)
    return _unbatch(dx, unbatched), grads
    # END SOLUTION


def _unbatch(x, unbatched: bool):
    return x[0] if unbatched else x


# ---- causal self-attention with shared key/value heads, on a backend ----------------------------

# Training and evaluation run the model in host memory, so their attention runs on the host too:
# "cuda" (a cache in GPU memory) is for inference, refmath.inference.kv_cache.
ATTENTION_BACKENDS = tuple(b for b in BACKENDS if b != "cuda")


class CausalAttentionCache(NamedTuple):
    backend: str
    n_kv_heads: int
    saved: tuple  # numpy: sdpa_forward's cache; cpu: (q, k, v, o, lse) for the kernel's backward
    window: int | None = None  # the sliding window the forward applied (the kernel's backward too)
    scale: float | None = None  # the score scale the forward applied (None: 1/sqrt(D))


def causal_attention_forward(q, k, v, backend: str = "numpy", window: int | None = None,
                             scale: float | None = None, softcap: float | None = None):
    r"""Causal self-attention of ``H`` query heads over ``G`` shared key/value heads (A2, A10).

    .. math::
        O_r = \operatorname{softmax}\big(\tau\, Q_r K_{\pi(r)}^\top + M_{\text{causal}}\big)
              V_{\pi(r)}

    with :math:`\tau` the ``scale``, :math:`1/\sqrt{D}` by default. With ``window`` = ``w``,
    :math:`M` is the sliding-window causal mask (A12, :func:`local_window_mask`): each query sees
    itself and the ``w - 1`` keys before it, on either backend (the kernel skips the tiles outside
    the band). With ``softcap`` = ``c`` the scores are :math:`c \tanh(\tau Q K^\top / c)` before
    the mask (N19, as in :func:`sdpa_forward`); only the reference has it, and the ``"cpu"``
    backend refuses it.

    ``q`` is ``(B, H, T, D)``, ``k`` and ``v`` ``(B, G, T, D)`` with ``G`` dividing ``H``; returns
    ``(O, cache)`` with ``O`` like ``q``. ``backend="numpy"`` is the reference
    (:func:`sdpa_forward` with the key/value heads read through :func:`gqa_head_map`);
    ``backend="cpu"`` is the FlashAttention kernel (:func:`refmath.kernels.flash_attention_forward`,
    F1-F4), which needs float32 and keeps only ``O`` and the row logsumexp for its backward.
    """
    check_choice("backend", backend, ATTENTION_BACKENDS)
    g = k.shape[1]
    if backend == "cpu":
        from refmath import kernels

        o, lse = kernels.flash_attention_forward(q, k, v, causal=True, window=window, scale=scale,
                                                 softcap=softcap)
        return o, CausalAttentionCache(backend, g, (q, k, v, o, lse), window, scale)
    heads = gqa_head_map(q.shape[1], g)
    t = q.shape[2]
    mask = (causal_mask(t, dtype=q.dtype) if window is None
            else local_window_mask(t, window, dtype=q.dtype))
    o, attn = sdpa_forward(q, k[:, heads], v[:, heads], mask=mask, scale=scale, softcap=softcap)
    return o, CausalAttentionCache(backend, g, attn, window, scale)


def causal_attention_backward(do, cache: CausalAttentionCache):
    r"""Gradients of :func:`causal_attention_forward`: ``(dq, dk, dv)`` (A8, F4).

    A key/value head shared by ``H/G`` query heads receives the sum of their gradients: those heads
    are the consecutive block ``u H/G .. (u+1) H/G - 1``, so a reshape and a sum over it does it.
    """
    if cache.backend == "cpu":
        from refmath import kernels

        return kernels.flash_attention_backward(do, *cache.saved, causal=True,
                                                window=cache.window, scale=cache.scale)
    dq, dk_repeated, dv_repeated = sdpa_backward(do, cache.saved)
    b, h, t, _ = dk_repeated.shape
    g = cache.n_kv_heads
    dk = dk_repeated.reshape(b, g, h // g, t, -1).sum(axis=2)
    dv = dv_repeated.reshape(b, g, h // g, t, -1).sum(axis=2)
    return dq, dk, dv


def causal_attention_kv(cache: CausalAttentionCache):
    """The ``(k, v)`` the attention read, each ``(B, G, T, D)``: the rows a KV cache stores."""
    if cache.backend == "cpu":
        return cache.saved[1], cache.saved[2]
    attn = cache.saved.attn if isinstance(cache.saved, SoftcapSDPACache) else cache.saved
    step = attn.q.shape[1] // cache.n_kv_heads  # query head u H/G holds kv head u
    return attn.k[:, ::step], attn.v[:, ::step]


# ---- gradient-check cases ------------------------------------------------------------------------

def _sdpa_inputs(lead, t_q, t_k, d_k, d_v, mask=None, keep_prob=None, scale=None, softcap=None):
    def make(rng):
        inputs = {
            "q": rng.standard_normal(lead + (t_q, d_k)),
            "k": rng.standard_normal(lead + (t_k, d_k)),
            "v": rng.standard_normal(lead + (t_k, d_v)),
        }
        if mask is not None:
            inputs["mask"] = mask
        if keep_prob is not None:
            keep = rng.random(lead + (t_q, t_k)) < keep_prob
            inputs["dropout_mask"] = keep / keep_prob
        if scale is not None:
            inputs["scale"] = scale
        if softcap is not None:
            inputs["softcap"] = softcap
        return inputs
    return make


_SDPA_IDS = ("A2", "A8")
for _label, _make in (
    ("no mask (2, 2, 3, 4) d_v=5", _sdpa_inputs((2, 2), 3, 3, 4, 5)),
    ("causal (1, 2, 4, 3)", _sdpa_inputs((1, 2), 4, 4, 3, 3, mask=causal_mask(4))),
    ("padding, lengths (4, 2)", _sdpa_inputs((2, 2), 3, 4, 3, 2, mask=padding_mask([4, 2], 4))),
    ("padding, one empty sequence", _sdpa_inputs((2, 1), 2, 3, 3, 2, mask=padding_mask([3, 0], 3))),
    ("causal with dropout mask p=0.3", _sdpa_inputs((2, 2), 4, 4, 3, 3, causal_mask(4), 0.7)),
    ("decode-style t_q=2 < t_k=5, scale 0.7", _sdpa_inputs((2,), 2, 5, 3, 4, causal_mask(2, 5),
                                                           scale=0.7)),
    ("3 leading axes (2, 1, 2, 4, 3), causal", _sdpa_inputs((2, 1, 2), 4, 4, 3, 3,
                                                            mask=causal_mask(4))),
    ("T = 1, one key", _sdpa_inputs((2, 2), 1, 1, 3, 2)),
    ("d_k = d_v = 1, causal", _sdpa_inputs((2,), 3, 3, 1, 1, mask=causal_mask(3))),
):
    register_case(OpCase("sdpa", _label, _SDPA_IDS, _make, sdpa_forward, sdpa_backward,
                         ("q", "k", "v")))
# Logit soft-capping (N19, Gemma 2). The scores have std about 1 (d_k = 3, the default scale) or
# 0.8 sqrt(3) ~ 1.4 (scale 0.8), against caps of 1 to 2: in tanh's bend, where the cap's slope
# 1 - tanh^2 is far from 1 and a backward that skipped it would be far off.
for _label, _make in (
    ("causal, softcap 1.5", _sdpa_inputs((2, 2), 4, 4, 3, 3, mask=causal_mask(4), softcap=1.5)),
    ("padding with one empty sequence, scale 0.8, softcap 2",
     _sdpa_inputs((2, 1), 2, 3, 3, 2, mask=padding_mask([3, 0], 3), scale=0.8, softcap=2.0)),
    ("causal with dropout mask p=0.3, softcap 1", _sdpa_inputs((2, 2), 4, 4, 3, 3, causal_mask(4),
                                                               0.7, softcap=1.0)),
    ("decode-style t_q=2 < t_k=5, no mask, softcap 1.5", _sdpa_inputs((2,), 2, 5, 3, 4,
                                                                      softcap=1.5)),
):
    register_case(OpCase("sdpa", _label, _SDPA_IDS + ("N19",), _make, sdpa_forward, sdpa_backward,
                         ("q", "k", "v")))


def _causal_attention_inputs(b, h, g, t, d, window=None, scale=None, softcap=None):
    def make(rng):
        return {"q": rng.standard_normal((b, h, t, d)), "k": rng.standard_normal((b, g, t, d)),
                "v": rng.standard_normal((b, g, t, d)), "window": window, "scale": scale,
                "softcap": softcap}
    return make


def _causal_attention_case_forward(q, k, v, window, scale, softcap):
    return causal_attention_forward(q, k, v, "numpy", window, scale, softcap)


# The training path's attention on the reference backend: GQA's summed key/value gradients under
# the sliding window, a scale of its own and the logit cap, together (Gemma 2's local layers).
register_case(OpCase("causal_attention", "GQA h=4 g=2, window 3, scale 0.8, softcap 1.5, T=5",
                     ("A2", "A8", "A10", "A12", "N19"),
                     _causal_attention_inputs(2, 4, 2, 5, 3, window=3, scale=0.8, softcap=1.5),
                     _causal_attention_case_forward, causal_attention_backward, ("q", "k", "v"),
                     group="attention execution"))


def _mha_case_forward(x, n_heads, n_kv_heads, context=None, mask=None, dropout_mask=None, **params):
    """Flat-keyword form of :func:`mha_forward` for the registry (parameters as keywords)."""
    return mha_forward(x, params, n_heads, n_kv_heads, context=context, mask=mask,
                       dropout_mask=dropout_mask)


def _mha_inputs(batch, t, d, h, g, d_h, biases=False, fused=False, ctx=None, mask=None,
                keep_prob=None):
    """``ctx = (S, d_ctx)`` makes a cross-attention case."""
    def make(rng):
        d_src = d if ctx is None else ctx[1]
        shapes = {"w_o": (h * d_h, d)}
        if fused:
            shapes["w_qkv"] = (d, (h + 2 * g) * d_h)
        else:
            shapes.update(w_q=(d, h * d_h), w_k=(d_src, g * d_h), w_v=(d_src, g * d_h))
        if biases:  # every bias but the key bias (see the note above the cases)
            for w in ("w_q", "w_v", "w_o"):
                if w in shapes:
                    shapes["b" + w[1:]] = (shapes[w][1],)
        inputs = {"x": rng.standard_normal(batch + (t, d)), "n_heads": h, "n_kv_heads": g}
        # Weights scaled by 1/sqrt(fan-in) keep the scores O(1), away from saturated softmaxes.
        for key, shape in shapes.items():
            std = 1.0 / math.sqrt(shape[0]) if key.startswith("w") else 0.5
            inputs[key] = std * rng.standard_normal(shape)
        if ctx is not None:
            inputs["context"] = rng.standard_normal(batch + ctx)
        if mask is not None:
            inputs["mask"] = mask
        if keep_prob is not None:
            s = t if ctx is None else ctx[0]
            keep = rng.random(batch + (h, t, s)) < keep_prob
            inputs["dropout_mask"] = keep / keep_prob
        return inputs
    return make


def _mha_case_backward(dout, cache):
    """The gradients by input name, for the registry: ``x``, ``context`` and the parameters."""
    dx, dparams, *dcontext = mha_backward(dout, cache)
    return {"x": dx, **dparams, **({"context": dcontext[0]} if dcontext else {})}


def _mha_case(label, ids, make, wrt):
    """Register an mha case; ``wrt`` names every array input but the masks."""
    register_case(OpCase("mha", label, ("A1", "A6", "A8") + ids, make, _mha_case_forward,
                         _mha_case_backward, wrt, max_coords=24))


# The cases carry no key bias b_k (nor b_qkv, whose key slice is b_k). b_k adds q_i . b_k to every
# score of row i, a shift that softmax ignores, so its gradient is exactly 0, and a relative-error
# check of it would compare rounding noise with rounding noise. test_attention checks that it
# vanishes, and that the fused form (b_qkv included) equals the separate one, gradients included.
_SEP = ("w_q", "w_k", "w_v", "w_o")
_BIASES = ("b_q", "b_v", "b_o")
_mha_case("MHA h=g=2 with biases", ("A10",), _mha_inputs((2,), 3, 6, 2, 2, 3, biases=True),
          ("x",) + _SEP + _BIASES)
_mha_case("GQA h=4 g=2 causal", ("A10",), _mha_inputs((2,), 4, 6, 4, 2, 2, mask=causal_mask(4)),
          ("x",) + _SEP)
_mha_case("MQA h=4 g=1 causal with dropout mask", ("A10",),
          _mha_inputs((1,), 4, 5, 4, 1, 2, mask=causal_mask(4), keep_prob=0.75), ("x",) + _SEP)
_mha_case("cross-attention h=2 g=2 with padding", ("A7",),
          _mha_inputs((2,), 3, 4, 2, 2, 2, biases=True, ctx=(5, 3), mask=padding_mask([5, 3], 5)),
          ("x", "context") + _SEP + _BIASES)
_mha_case("fused QKV h=4 g=2 causal with output bias", ("A9", "A10"),
          _mha_inputs((2,), 3, 5, 4, 2, 2, biases=True, fused=True, mask=causal_mask(3)),
          ("x", "w_qkv", "w_o", "b_o"))
_mha_case("unbatched (T, d) h=2 g=1", ("A10",), _mha_inputs((), 4, 5, 2, 1, 3), ("x",) + _SEP)
_mha_case("T = 1 h=2 g=1", ("A10",), _mha_inputs((2,), 1, 4, 2, 1, 2, mask=causal_mask(1)),
          ("x",) + _SEP)
_mha_case("h=g=1, d_h = 1", ("A10",), _mha_inputs((2,), 3, 3, 1, 1, 1, biases=True), ("x",) + _SEP + _BIASES)
