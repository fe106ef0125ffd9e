r"""Weights in fewer bytes: bfloat16, float16 and 8-bit Q8_0 blocks, each rounded and restored
explicitly (catalogue W1, W2).

A decode step at batch 1 reads every weight once and does two FLOPs with it, so its time is the
time to stream the weights (K13): 2 bytes a weight instead of float32's 4 halve that time's bound,
and Q8_0's 34 bytes per 32 weights (8.5 bits a weight) nearly quarter it. The product itself stays
in float32: the stored weights are turned back into the float32 numbers they stand for and summed
in float32 (:func:`refmath.kernels.format_rows_matmul` does it compiled, reading the stored bytes).

A matrix is stored as ``(n, k)``: ``n`` outputs, each a row of ``k`` weights along the inputs (a
``Linear``'s weight, the transpose of refmath's ``(in, out)`` parameters), so that each output is a
dot product over one row, and a Q8_0 block holds 32 consecutive weights of one row.

Formats (:data:`FORMATS`):

- ``"bf16"``: bfloat16, float32's sign and 8-bit exponent with 7 stored mantissa bits (8
  significant bits), kept as ``uint16`` bit patterns (NumPy has no bfloat16 type): the top half
  of the float32, rounded to nearest with ties to even.
- ``"f16"``: IEEE float16 (``np.float16``): 11 significant bits, 5-bit exponent, largest finite
  65504, subnormals below :math:`2^{-14}` spaced :math:`2^{-24}`; rounded to nearest, ties to even.
- ``"q8_0"``: llama.cpp's ``block_q8_0``, byte for byte: each block of 32 weights one float16 scale
  ``d`` then 32 ``int8`` codes ``qs`` (the structured dtype :data:`Q8_0_BLOCK`, 34 bytes). The
  rounding follows llama.cpp's reference quantiser (``quantize_row_q8_0_ref``), in float32:

  .. math::
      d = \mathrm{fl}\Big(\frac{\max_{i \in \text{block}} |w_i|}{127}\Big),\qquad
      q_i = \operatorname{round}\big(\mathrm{fl}(w_i \cdot \mathrm{fl}(1/d))\big),\qquad
      \tilde d = \mathrm{f16}(d),\qquad \tilde w_i = q_i\, \tilde d

  with ``round`` to nearest, ties away from zero (C's ``roundf``), :math:`q_i = 0` for a block of
  zeros (:math:`d = 0`), and the codes made with the float32 :math:`d` while the float16
  :math:`\tilde d` is stored and used to restore them.

W1, the rounding of bf16 and f16 (unit roundoff :math:`u_p = 2^{-p}` for :math:`p` significant
bits: :math:`u = 2^{-8}` for bf16, :math:`2^{-11}` for f16):

.. math::
    |\tilde w - w| \le u_p\, |w| \quad\text{(normal range)},\qquad
    |\tilde w - w| \le 2^{-25} \quad\text{(f16 below } 2^{-14}\text{)}

W2, the rounding of Q8_0, per weight of a block with float32 scale :math:`d` (for :math:`d` in
float16's normal range, :math:`d \ge 2^{-14}`):

.. math::
    |\tilde w_i - w_i| \le \big(\tfrac12 + 2^{-16} + 127 \cdot 2^{-11}\big)\, d \le 0.5621\, d

Derivation: :math:`\mathrm{fl}(w_i \cdot \mathrm{fl}(1/d)) = (w_i/d)(1 + \theta)` with
:math:`|\theta| \le 2u + u^2` (:math:`u = 2^{-24}`), and :math:`|w_i / d| \le 127 (1 + 2u)`
since :math:`d \ge (\max|w| / 127)(1 - u)`, so the rounded argument is within
:math:`255 u < 2^{-16}` of :math:`w_i / d` and :math:`|q_i - w_i/d| \le \tfrac12 + 2^{-16}` (which
also keeps :math:`|q_i| \le 127`). Storing the scale in float16 moves it by
:math:`|\tilde d - d| \le 2^{-11} d`, which :math:`|q_i| \le 127` multiplies:
:math:`|w_i - q_i \tilde d| \le |w_i - q_i d| + |q_i|\,|d - \tilde d|`. Below float16's normal range
the scale's error is at most :math:`2^{-25}` absolute, and the bound gains :math:`127 \cdot 2^{-25}`
(:func:`rounding_bound` computes both cases). The quantisers refuse weights whose format cannot
hold them (non-finite weights; f16 beyond 65504; a Q8_0 scale beyond float16's range, a block
whose largest weight exceeds :math:`127 \cdot 65504`) rather than store infinities.

The product with the restored weights. Every restored weight is exactly a float32 (at most 8, 11 or
:math:`7 + 11 = 18` significant bits), so ``x @ w~.T`` summed in float32 in any order (the compiled
kernel's vector lanes and chunks included) has the error bound of a float32 dot product of length
:math:`k` [Higham, *Accuracy and Stability of Numerical Algorithms*, 3.1]:

.. math::
    |\hat y_{rj} - (x \tilde W^\top)_{rj}| \le \gamma_k \sum_i |x_{ri}|\, |\tilde w_{ji}|,\qquad
    \gamma_k = \frac{k u}{1 - k u}

and against the float32 weights the rounding adds :math:`\sum_i |x_{ri}|\, |\tilde w_{ji} - w_{ji}|`
(:func:`product_error_bound` returns both terms).
"""
from __future__ import annotations

import numpy as np

from refmath._validate import check_choice, check_ndim, float_array

__all__ = ["FORMATS", "Q8_0_BLOCK", "BLOCK", "STORED_DTYPES", "bytes_per_weight", "to_bf16",
           "from_bf16", "to_f16", "from_f16", "quantize_q8_0", "dequantize_q8_0", "quantize",
           "dequantize", "rows_product", "rounding_bound", "gamma", "product_error_bound"]

FORMATS = ("bf16", "f16", "q8_0")
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])  # llama.cpp's block_q8_0, 34 bytes
BLOCK = 32  # weights per Q8_0 block
STORED_DTYPES = {"bf16": np.dtype(np.uint16), "f16": np.dtype(np.float16), "q8_0": Q8_0_BLOCK}
U32 = 2.0 ** -24  # float32's unit roundoff
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "f16": 2.0 ** -11}
F16_MAX = 65504.0
F16_TINY = 2.0 ** -14  # the smallest normal float16
Q8_0_FACTOR = 0.5 + 2.0 ** -16 + 127 * 2.0 ** -11  # W2's bound on |w~ - w| in units of d


def bytes_per_weight(fmt: str) -> float:
    """Bytes a weight takes in ``fmt`` (float32's is 4): 2 for bf16 and f16, 34/32 for Q8_0."""
    check_choice("fmt", fmt, FORMATS + ("f32",))
    return {"f32": 4.0, "bf16": 2.0, "f16": 2.0, "q8_0": Q8_0_BLOCK.itemsize / BLOCK}[fmt]


def _weights(w) -> np.ndarray:
    """``w`` as a finite 2-D float32 array ``(n, k)``."""
    w = float_array("w", w)
    if w.dtype.type is not np.float32:
        raise TypeError(f"w must be float32 (the weights are rounded from float32), got dtype "
                        f"{w.dtype} with shape {w.shape}; convert with .astype(np.float32)")
    check_ndim("w", w, 2, "(n, k): n outputs of k inputs")
    finite = np.isfinite(w)
    if not np.all(finite):
        raise ValueError(f"w must be finite to be stored in a narrower format, got "
                         f"{int(w.size - finite.sum())} non-finite entries in shape {w.shape}")
    return w


def to_bf16(w) -> np.ndarray:
    """float32 ``(n, k)`` to bfloat16 bit patterns (``uint16``), rounded to nearest, ties to even:
    add ``0x7fff`` plus the lowest kept bit to the float32's bits, keep the top 16 (W1)."""
    w = _weights(w)
    bits = np.ascontiguousarray(w).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    if np.any((rounded & 0x7F80) == 0x7F80):  # rounded up past float32's largest: infinity
        raise ValueError(f"w holds values that round to infinity in bf16 (|w| >= "
                         f"{(2 - 2 ** -8) * 2.0 ** 127:.6g}), shape "
                         f"{w.shape}")
    return rounded.astype(np.uint16)


def from_bf16(bits) -> np.ndarray:
    """bfloat16 bit patterns to the float32 numbers they stand for (exactly: the bits on top)."""
    bits = _stored("bits", bits, "bf16")
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_f16(w) -> np.ndarray:
    """float32 ``(n, k)`` to ``np.float16``, rounded to nearest, ties to even (W1); weights beyond
    float16's largest finite value, 65504, are refused."""
    w = _weights(w)
    big = np.abs(w) > F16_MAX
    if np.any(big):
        raise ValueError(f"w holds values beyond float16's range (|w| <= {F16_MAX:g}), e.g. "
                         f"{float(w[big][0])!r}, in shape {w.shape}")
    with np.errstate(over="ignore"):
        h = w.astype(np.float16)
    if not np.all(np.isfinite(h)):  # between 65504 and 65520 a value still rounds to infinity
        raise ValueError(f"w holds values that round to infinity in float16, shape {w.shape}")
    return h


def from_f16(h) -> np.ndarray:
    """float16 to float32 (exact)."""
    return _stored("h", h, "f16").astype(np.float32)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C's ``roundf`` of float32 ``v``: to nearest, ties away from zero. NumPy's ``round`` ties to
    even, and ``v + 0.5`` in float32 rounds up 0.49999997 to 1, so the sum is taken in float64,
    where every float32 plus a half is exact."""
    v = v.astype(np.float64)
    return np.trunc(v + np.copysign(0.5, v))


def quantize_q8_0(w) -> np.ndarray:
    """float32 ``(n, k)``, ``k`` a multiple of 32, to ``(n, k / 32)`` Q8_0 blocks (W2), as
    llama.cpp's reference quantiser makes them: see the module's docstring."""
    w = _weights(w)
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"q8_0 stores rows of whole {BLOCK}-weight blocks: w's rows must have a "
                         f"multiple of {BLOCK} weights, got w.shape = {w.shape}")
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    amax = np.abs(blocks).max(axis=2)
    d = amax / np.float32(127)  # float32, as in the reference
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    with np.errstate(over="ignore"):  # an overflow is refused just below, with its numbers
        d16 = d.astype(np.float16)
    if not np.all(np.isfinite(d16)):
        raise ValueError(f"w has a block whose scale max|w| / 127 exceeds float16's range (max|w| "
                         f"<= {127 * F16_MAX:g}), largest |w| = {float(amax.max()):g}, shape "
                         f"{w.shape}")
    out = np.empty((n, k // BLOCK), Q8_0_BLOCK)
    out["d"] = d16
    out["qs"] = _round_half_away(blocks * inv[:, :, None]).astype(np.int8)
    return out


def dequantize_q8_0(blocks) -> np.ndarray:
    """``(n, k / 32)`` Q8_0 blocks to float32 ``(n, k)``: each code times its block's float16 scale
    (exact in float32)."""
    blocks = _stored("blocks", blocks, "q8_0")
    n, nb = blocks.shape
    w = blocks["qs"].astype(np.float32) * blocks["d"].astype(np.float32)[:, :, None]
    return w.reshape(n, nb * BLOCK)


def quantize(w, fmt: str) -> np.ndarray:
    """float32 ``(n, k)`` weights stored in ``fmt`` (one of :data:`FORMATS`)."""
    check_choice("fmt", fmt, FORMATS)
    return {"bf16": to_bf16, "f16": to_f16, "q8_0": quantize_q8_0}[fmt](w)


def dequantize(stored, fmt: str) -> np.ndarray:
    """The float32 ``(n, k)`` weights that ``stored`` (in ``fmt``) stands for."""
    check_choice("fmt", fmt, FORMATS)
    return {"bf16": from_bf16, "f16": from_f16, "q8_0": dequantize_q8_0}[fmt](stored)


def rows_product(x, stored, fmt: str) -> np.ndarray:
    """The reference product: ``x`` ``(m, k)`` float32 times the transpose of the restored
    weights, ``x @ dequantize(stored, fmt).T``, in float32, ``(m, n)``."""
    x = float_array("x", x)
    check_ndim("x", x, 2, "(m, k)")
    w = dequantize(stored, fmt)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x.shape = {x.shape} does not fit weights of {w.shape[1]} inputs a row "
                         f"(stored {fmt} of shape {np.shape(stored)})")
    return x.astype(np.float32) @ w.T


def rounding_bound(w, fmt: str) -> np.ndarray:
    """W1 and W2: the largest ``|dequantize(quantize(w)) - w|`` allowed per weight, float64."""
    w = _weights(w).astype(np.float64)
    check_choice("fmt", fmt, FORMATS)
    if fmt == "q8_0":
        n, k = w.shape
        if k % BLOCK:
            raise ValueError(f"q8_0 rows hold whole {BLOCK}-weight blocks, got w.shape = {w.shape}")
        amax = np.abs(w.reshape(n, k // BLOCK, BLOCK)).max(axis=2)
        d = (amax / 127) * (1 + U32)  # the float32 scale is at most this
        bound = Q8_0_FACTOR * d + np.where(d < F16_TINY, 127 * 2.0 ** -25, 0.0)
        return np.repeat(bound, BLOCK, axis=1)
    u = UNIT_ROUNDOFF[fmt]
    bound = u * np.abs(w)
    if fmt == "f16":
        bound = np.where(np.abs(w) < F16_TINY, 2.0 ** -25, bound)
    else:  # bf16 keeps float32's exponents: below its normal range a half-step of 2^-133
        bound = np.maximum(bound, 2.0 ** -134)
    return bound


def gamma(k: int) -> float:
    """:math:`\\gamma_k = k u / (1 - k u)` for float32's :math:`u = 2^{-24}`."""
    return k * U32 / (1 - k * U32)


def product_error_bound(x, stored, fmt: str, w=None) -> np.ndarray:
    """The bound on ``|y - x @ dequantize(stored).T|`` of a float32 product of the restored
    weights, :math:`\\gamma_k |x|\\,|\\tilde W|^\\top`; with the float32 weights ``w`` it was made
    from, the bound on ``|y - x @ w.T|``, which adds :math:`|x|\\, \\text{rounding\\_bound}^\\top`."""
    x = np.abs(float_array("x", x).astype(np.float64))
    restored = np.abs(dequantize(stored, fmt).astype(np.float64))
    bound = gamma(x.shape[1]) * (x @ restored.T)
    if w is not None:
        bound = bound + x @ rounding_bound(w, fmt).T
    return bound


def _stored(name: str, a, fmt: str) -> np.ndarray:
    """``a`` checked as weights stored in ``fmt``: its dtype and two dimensions."""
    a = np.asarray(a)
    want = STORED_DTYPES[fmt]
    if a.dtype != want:
        raise TypeError(f"{name} in format {fmt} must have dtype {want}, got dtype {a.dtype} with "
                        f"shape {a.shape}")
    check_ndim(name, a, 2, "(n, k)" if fmt != "q8_0" else "(n, k / 32) blocks")
    return a
