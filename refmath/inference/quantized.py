r"""A quantised KV cache: a symmetric per-group quantiser, int4 packing, and decoding over it.

Catalogue K12. Each group of :math:`G` consecutive numbers along the last axis (the head width
:math:`d_h`) is stored as small integers and one scale:

.. math::
    s = \frac{\max_{i \in \text{group}} |x_i|}{q_{\max}},\qquad
    c_i = \operatorname{clip}\!\left(\operatorname{round}(x_i / s), -q_{\max}, q_{\max}\right),
    \qquad \hat x_i = s\, c_i

with :math:`q_{\max} = 2^{q-1} - 1` (127 for 8 bits, 7 for 4 bits). Rounding to the nearest
integer gives the error bound :math:`|x_i - \hat x_i| \le s/2`, half a quantisation step, for
every element of the group.

Three conventions a real cache also has to choose, made explicit here:

- **The stored scale is the one used.** The scale is rounded *up* to the storage dtype (float16 by
  default, as a cache would keep it; float32 on request), and the codes are computed with that
  stored value. Dequantisation then uses exactly the number the codes were made with, and because
  the stored scale is at least :math:`\max|x| / q_{\max}`, :math:`|x_i / s| \le q_{\max}`: the
  clip never cuts a value, so the :math:`s/2` bound holds for the stored :math:`s`.
- **A group of zeros** gets scale 0 and codes 0, so it dequantises to exactly 0. The division uses
  1 in place of a zero scale, so nothing is ever divided by zero. (Rounding up also means a tiny but
  non-zero group never gets a zero scale: it gets at least the smallest positive float16.)
- **4-bit packing**: two codes per byte, the element with the even index in the low nibble, the
  next one in the high nibble; each nibble is the code in 4-bit two's complement (-7 is ``0b1001``).
  Packing is per row of :math:`d_h` codes; an odd row gets a zero high nibble in its last byte.

Layout of the cache: ``(B, g, T, d_h)`` per layer, with ``g`` key/value heads, as in
:mod:`refmath.attention`; every appended position is kept (a sliding layer's window is not
applied to the storage here, as :class:`refmath.inference.kv_cache.KVCache` applies it). The payload and scale bytes match
:func:`refmath.sizing.quantized_kv_cache_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refmath._validate import check_axis, check_choice, check_int, check_min_ndim, check_ndim, float_array
from refmath.attention import causal_mask, gqa_head_map, sdpa_forward

__all__ = [
    "BITS", "SCALE_DTYPES", "q_max", "pack_int4", "unpack_int4", "QuantizedTensor", "quantize",
    "dequantize", "QuantizedKVCache", "decode_with_quantized_cache"
]

BITS = (4, 8)
SCALE_DTYPES = (np.float16, np.float32)


def q_max(bits: int) -> int:
    """Largest code magnitude of a symmetric ``bits``-bit quantiser: :math:`2^{q-1} - 1`."""
    return 2 ** (_check_bits(bits) - 1) - 1


def _check_bits(bits) -> int:
    return check_choice("bits", check_int("bits", bits), BITS)


def _check_group_size(group_size, head_dim: int, x_shape: tuple) -> int:
    group_size = check_int("group_size", group_size, 1)
    if head_dim % group_size:
        raise ValueError(
            f"group_size = {group_size} must divide head_dim = {head_dim}, the last axis of "
            f"x (x.shape = {x_shape})"
        )
    return group_size


def _check_scale_dtype(scale_dtype) -> np.dtype:
    try:
        dtype = np.dtype(scale_dtype)
    except TypeError:
        dtype = None
    if dtype not in [np.dtype(t) for t in SCALE_DTYPES]:
        raise ValueError(f"scale_dtype must be float16 or float32, got {scale_dtype!r}")
    return dtype


# ---- int4 packing ---------------------------------------------------------------------------------

def pack_int4(codes) -> np.ndarray:
    """Pack integer codes in ``[-8, 7]`` two per byte along the last axis (low nibble first).

    ``codes`` is ``(..., n)``; the result is ``uint8`` of shape ``(..., ceil(n / 2))``. Byte ``j``
    holds code ``2j`` in bits 0-3 and code ``2j + 1`` in bits 4-7, each as a 4-bit two's complement
    number; an odd ``n`` leaves the last high nibble 0. :func:`unpack_int4` inverts it.
    """
    codes = np.asarray(codes)
    if not np.issubdtype(codes.dtype, np.integer):
        raise TypeError(f"codes must be an integer array, got dtype {codes.dtype} with shape {codes.shape}")
    check_min_ndim("codes", codes, 1, "(..., n)")
    if codes.size and (codes.min() < -8 or codes.max() > 7):
        raise ValueError(
            f"codes must lie in [-8, 7] to fit a 4-bit nibble, got values in "
            f"[{codes.min()}, {codes.max()}] (shape {codes.shape})"
        )
    n = codes.shape[-1]
    if n % 2:
        codes = np.concatenate([codes, np.zeros(codes.shape[:-1] + (1,), codes.dtype)], axis=-1)
    # & 0xF keeps the low four bits of the two's complement integer: -7 -> 0b1001, 3 -> 0b0011.
    nibbles = (codes.astype(np.int16) & 0xF).astype(np.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed, n: int) -> np.ndarray:
    """Inverse of :func:`pack_int4`: ``uint8`` ``(..., ceil(n / 2))`` to ``int8`` codes ``(..., n)``."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"packed must be a uint8 array, got dtype {packed.dtype} with shape {packed.shape}")
    check_min_ndim("packed", packed, 1, "(..., bytes)")
    n = check_int("n", n, 0)
    check_axis("packed", packed, -1, -(-n // 2), f"n = {n} codes packed two per byte")
    nibbles = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.int8)
    nibbles[..., 0::2] = packed & 0xF
    nibbles[..., 1::2] = packed >> 4
    # A nibble of 8 or more has its sign bit set: subtract 16 to read it as two's complement.
    nibbles = np.where(nibbles >= 8, nibbles - 16, nibbles).astype(np.int8)
    return nibbles[..., :n]


# ---- the quantiser --------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A float array stored as per-group integer codes and scales (see the module docstring).

    ``data`` is the payload: ``int8`` codes of the array's shape for 8 bits, or ``uint8`` bytes of
    shape ``(..., ceil(d / 2))`` holding two 4-bit codes each. ``scales`` is ``(..., d / G)``, one
    per group, in float16 or float32. ``shape`` and ``dtype`` are those of the original array, which
    :func:`dequantize` returns.
    """

    data: np.ndarray
    scales: np.ndarray
    bits: int
    group_size: int
    shape: tuple
    dtype: np.dtype

    @property
    def q_max(self) -> int:
        return q_max(self.bits)

    @property
    def payload_bytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def scale_bytes(self) -> int:
        return int(self.scales.nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes stored: payload plus scales (a symmetric quantiser has no zero points)."""
        return self.payload_bytes + self.scale_bytes

    def codes(self) -> np.ndarray:
        """The integer codes :math:`c_i` as ``int8``, shape ``self.shape`` (unpacked for 4 bits)."""
        if self.bits == 4:
            return unpack_int4(self.data, self.shape[-1])
        return self.data

    def element_scales(self) -> np.ndarray:
        """The scale of each element's group, float64 of shape ``self.shape``: the step of ``x_i``."""
        return np.repeat(self.scales.astype(np.float64), self.group_size, axis=-1)


def quantize(x, bits: int = 8, group_size: int = 32, scale_dtype=np.float16) -> QuantizedTensor:
    r"""Symmetric per-group quantisation of ``x`` along its last axis (catalogue K12).

    .. math::
        s = \operatorname{up}\!\left(\frac{\max_{\text{group}} |x|}{q_{\max}}\right),\qquad
        c = \operatorname{clip}(\operatorname{round}(x / s), -q_{\max}, q_{\max})

    where :math:`\operatorname{up}` rounds to the next ``scale_dtype`` number at or above (so that
    the stored scale is the one the codes were made with, and no code is clipped). ``x`` is
    ``(..., d)`` with ``group_size`` dividing ``d``; ``bits`` is 8 (``int8`` codes) or 4 (two codes
    per byte, see :func:`pack_int4`). A group of zeros gets scale 0 and codes 0. Rounding is to the
    nearest integer, ties to even. Every element then satisfies :math:`|x_i - s c_i| \le s/2`
    (up to the float64 rounding of :math:`x_i / s`, at most :math:`2^{-53} |x_i|`).
    """
    x = float_array("x", x)
    check_min_ndim("x", x, 1, "(..., head_dim)")
    bits = _check_bits(bits)
    head_dim = x.shape[-1]
    group_size = _check_group_size(group_size, head_dim, x.shape)
    scale_dtype = _check_scale_dtype(scale_dtype)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"x must be finite to be quantised (x.shape = {x.shape})")
    qm = q_max(bits)

    groups = x.astype(np.float64).reshape(x.shape[:-1] + (head_dim // group_size, group_size))
    exact = np.max(np.abs(groups), axis=-1) / qm
    if exact.size and exact.max() > np.finfo(scale_dtype).max:
        raise ValueError(
            f"x has magnitudes up to {np.max(np.abs(x)):.6g}: the scale max|x| / {qm} overflows "
            f"{scale_dtype.name} (x.shape = {x.shape}); use scale_dtype=np.float32"
        )
    # Round the scale up to the storage dtype; it stays finite since exact <= the dtype's max.
    scales = exact.astype(scale_dtype)
    low = scales.astype(np.float64) < exact
    scales[low] = np.nextafter(scales[low], np.asarray(np.inf, scale_dtype))
    stored = scales.astype(np.float64)[..., None]
    codes = np.clip(np.rint(groups / np.where(stored == 0.0, 1.0, stored)), -qm, qm)
    codes = codes.astype(np.int8).reshape(x.shape)
    data = pack_int4(codes) if bits == 4 else codes
    return QuantizedTensor(data, scales, bits, group_size, tuple(x.shape), x.dtype)


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    r"""The values :math:`\hat x_i = s\, c_i`, in the dtype of the array that was quantised.

    The product is formed in float64; with float16 scales it is exact (11 + 7 significant bits),
    so a float32 result is exact too.
    """
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt must be a QuantizedTensor, got {type(qt).__name__}")
    return (qt.codes().astype(np.float64) * qt.element_scales()).astype(qt.dtype)


def _concat_tokens(a: QuantizedTensor | None, b: QuantizedTensor) -> QuantizedTensor:
    """Append ``b``'s tokens (axis -2) to ``a``: groups lie along the last axis, so the payload
    and the scales of different tokens are independent and simply concatenate."""
    if a is None:
        return b
    data = np.concatenate([a.data, b.data], axis=-2)
    scales = np.concatenate([a.scales, b.scales], axis=-2)
    shape = a.shape[:-2] + (a.shape[-2] + b.shape[-2], a.shape[-1])
    return QuantizedTensor(data, scales, a.bits, a.group_size, shape, a.dtype)


# ---- the cache ------------------------------------------------------------------------------------

class QuantizedKVCache:
    """A contiguous KV cache that stores each layer's keys and values quantised (catalogue K12).

    Each layer holds keys ``(B, g, T, d_k)`` and values ``(B, g, T, d_v)`` as two
    :class:`QuantizedTensor`; :meth:`append` quantises the new tokens and concatenates them along
    ``T`` (a serving cache would preallocate; concatenation keeps the reference short).
    :meth:`keys` and :meth:`values` return the dequantised arrays, in the dtype first appended.
    Since every token's groups have their own scales, appending never re-quantises old tokens.
    """

    def __init__(self, n_layers: int, bits: int = 8, group_size: int = 32, scale_dtype=np.float16):
        self.n_layers = check_int("n_layers", n_layers, 1)
        self.bits = _check_bits(bits)
        self.group_size = check_int("group_size", group_size, 1)
        self.scale_dtype = _check_scale_dtype(scale_dtype)
        self._k: list[QuantizedTensor | None] = [None] * self.n_layers
        self._v: list[QuantizedTensor | None] = [None] * self.n_layers

    def _layer(self, layer) -> int:
        return check_int("layer", layer, 0, self.n_layers - 1)

    def append(self, layer: int, k, v) -> None:
        """Quantise and store new keys ``(B, g, t, d_k)`` and values ``(B, g, t, d_v)``."""
        layer = self._layer(layer)
        k = float_array("k", k)
        v = float_array("v", v)
        check_ndim("k", k, 4, "(B, g, t, d_k)")
        check_ndim("v", v, 4, "(B, g, t, d_v)")
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(
                f"k and v must agree in (B, g, t), got k.shape = {k.shape} and v.shape = {v.shape}"
            )
        old = self._k[layer]
        if old is not None:
            stored_v = self._v[layer]
            if k.shape[:2] != old.shape[:2] or k.shape[3] != old.shape[3] or v.shape[3] != stored_v.shape[3]:
                raise ValueError(
                    f"layer {layer} holds keys {old.shape} and values {stored_v.shape}; new tokens "
                    f"must match them in B, g and width, got k.shape = {k.shape}, v.shape = {v.shape}"
                )
        qk = quantize(k, self.bits, self.group_size, self.scale_dtype)
        qv = quantize(v, self.bits, self.group_size, self.scale_dtype)
        self._k[layer] = _concat_tokens(old, qk)
        self._v[layer] = _concat_tokens(self._v[layer], qv)

    def quantized_keys(self, layer: int) -> QuantizedTensor:
        return self._stored(self._k, layer, "keys")

    def quantized_values(self, layer: int) -> QuantizedTensor:
        return self._stored(self._v, layer, "values")

    def _stored(self, store, layer, what) -> QuantizedTensor:
        layer = self._layer(layer)
        if store[layer] is None:
            raise ValueError(f"layer {layer} holds no {what} yet: append to it first")
        return store[layer]

    def keys(self, layer: int) -> np.ndarray:
        """Dequantised keys of ``layer``, ``(B, g, T, d_k)``."""
        return dequantize(self.quantized_keys(layer))

    def values(self, layer: int) -> np.ndarray:
        """Dequantised values of ``layer``, ``(B, g, T, d_v)``."""
        return dequantize(self.quantized_values(layer))

    def length(self, layer: int) -> int:
        """Tokens ``T`` stored in ``layer`` (0 before the first append)."""
        stored = self._k[self._layer(layer)]
        return 0 if stored is None else stored.shape[-2]

    def _all(self):
        return [t for t in self._k + self._v if t is not None]

    @property
    def payload_bytes(self) -> int:
        return sum(t.payload_bytes for t in self._all())

    @property
    def scale_bytes(self) -> int:
        return sum(t.scale_bytes for t in self._all())

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer: payload plus scales."""
        return self.payload_bytes + self.scale_bytes


def decode_with_quantized_cache(q, cache: QuantizedKVCache, layer: int, mask=None) -> np.ndarray:
    r"""Attention of new queries over a layer of the quantised cache (catalogue K12 with A2, A10).

    .. math:: O = \operatorname{softmax}\!\left(\frac{Q \hat K^\top}{\sqrt{d_k}} + M\right) \hat V

    with :math:`\hat K, \hat V` the dequantised cache. ``q`` is ``(B, h, t_q, d_k)`` with ``g``
    dividing ``h``: query head ``r`` reads key/value head :math:`\lfloor r / (h/g) \rfloor`
    (:func:`refmath.attention.gqa_head_map`). The queries are taken to be the last ``t_q`` of the
    ``T`` cached positions, so by default ``M`` is :func:`refmath.attention.causal_mask` ``(t_q, T)``
    (every key is visible when ``t_q = 1``); an explicit additive ``mask`` replaces it. K and V are
    dequantised in ``q``'s dtype. Returns ``O``, ``(B, h, t_q, d_v)``.
    """
    q = float_array("q", q)
    check_ndim("q", q, 4, "(B, h, t_q, d_k)")
    qk = cache.quantized_keys(layer)
    b, g, t, d_k = qk.shape
    check_axis("q", q, 0, b, f"the batch of the cached keys {qk.shape}")
    check_axis("q", q, 3, d_k, f"the key width of the cached keys {qk.shape}")
    h = q.shape[1]
    if h % g:
        raise ValueError(f"the cache's g = {g} key/value heads must divide q's h = {h} heads "
                         f"(q.shape = {q.shape}, keys {qk.shape})")
    heads = gqa_head_map(h, g)
    k = dequantize(qk).astype(q.dtype, copy=False)[:, heads]
    v = dequantize(cache.quantized_values(layer)).astype(q.dtype, copy=False)[:, heads]
    if mask is None:
        mask = causal_mask(q.shape[2], t, dtype=q.dtype)
    out, _ = sdpa_forward(q, k, v, mask=mask)
    return out
