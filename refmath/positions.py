"""Position information: fixed sinusoids, a learned table, and rotary embeddings (RoPE).

Positions are 0-based token indices along the sequence axis, which is the second-to-last axis of
every input here: ``x`` is ``(..., T, d)``.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from refmath._validate import check_choice, check_int, check_min_ndim, check_ndim, check_real, float_array
from refmath.registry import OpCase, register_case


def _check_base(base) -> float:
    # b > 1: the frequencies b^{-2r/d} then fall from 1 towards 1/b, as the design intends
    return check_real("base", base, 1.0, low_open=True)


def rope_angles(positions, d_k: int, base: float = 10000.0) -> np.ndarray:
    r"""Rotation angles :math:`\theta_{p,r} = p\,\omega_r` with :math:`\omega_r = b^{-2r/d_k}`.

    ``positions`` is a 1-D array of ``T`` positions; returns float64 ``(T, d_k/2)``, one column per
    coordinate pair ``(2r, 2r+1)``. The same angles give the sinusoidal table (catalogue N8), where
    :math:`p / b^{2r/d}` is written as a division. Frequencies fall geometrically from 1 (pair 0,
    one radian per token) to nearly :math:`1/b` (the last pair, wavelength ~ :math:`2\pi b` tokens).
    """
    d_k = check_int("d_k", d_k, 2)
    if d_k % 2:
        raise ValueError(f"d_k must be a positive even integer, got {d_k}")
    pair = np.arange(d_k // 2, dtype=np.float64)
    divisor = _check_base(base) ** (2.0 * pair / d_k)  # b^{2r/d_k}
    return np.asarray(positions, dtype=np.float64)[:, None] / divisor[None, :]


def sinusoidal_positions(t: int, d: int, base: float = 10000.0, dtype=np.float64) -> np.ndarray:
    r"""Fixed sinusoidal position table of the original Transformer (catalogue N8).

    .. math::
        P_{i,2r} = \sin\!\big(i / b^{2r/d}\big),\qquad P_{i,2r+1} = \cos\!\big(i / b^{2r/d}\big)

    with :math:`b` = ``base`` = 10000. The model input is :math:`\sqrt d\,E[a_i] + P_i`
    (``embedding_forward(..., scale_by_sqrt_d=True)`` plus this table). Nothing here is learned, so
    there is no backward.

    Shapes: returns ``(t, d)`` in ``dtype`` (computed in float64); ``d`` must be even.
    """
    t = check_int("t", t, 0)
    d = int(d)
    if d <= 0 or d % 2:
        raise ValueError(f"d must be a positive even integer (sin/cos pairs), got {d}")
    angles = rope_angles(np.arange(t), d, base)
    table = np.empty((t, d), dtype=np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles)
    return table.astype(dtype)


# ---- learned absolute positions (N9) -------------------------------------------------------------


class LearnedPositionsCache(NamedTuple):
    table_shape: tuple
    rows: slice  # the table rows that were added
    dtype: np.dtype


def learned_positions_forward(x, table, offset: int = 0):
    r"""Add learned absolute position vectors, GPT style (catalogue N9).

    .. math::
        y_{\ldots,t} = x_{\ldots,t} + P[\text{offset} + t],\qquad t = 0, \ldots, T-1

    ``x`` is usually the token embeddings :math:`E[a]`; ``offset`` is the position of the first row
    (non-zero when decoding after a cached prefix). The table has a fixed number of rows, the longest
    context the model can address.

    Shapes: ``x`` ``(..., T, d)``, ``table`` ``(T_max, d)``; needs ``offset + T <= T_max``.
    Returns ``(y, cache)`` with ``y`` of the shape of ``x``.
    """
    x = float_array("x", x)
    table = float_array("table", table)
    check_min_ndim("x", x, 2, "(..., T, d)")
    check_ndim("table", table, 2, "(T_max, d)")
    offset = check_int("offset", offset, 0)
    if table.shape[1] != x.shape[-1]:
        raise ValueError(
            f"table.shape[1] must equal x.shape[-1] (d), got x.shape = {x.shape} and "
            f"table.shape = {table.shape}"
        )
    t = x.shape[-2]
    if offset + t > table.shape[0]:
        raise ValueError(
            f"positions {offset}..{offset + t - 1} (offset={offset}, x.shape = {x.shape}) run past "
            f"the {table.shape[0]} rows of table (table.shape = {table.shape})"
        )
    rows = slice(offset, offset + t)
    return x + table[rows], LearnedPositionsCache(table.shape, rows, table.dtype)


def learned_positions_backward(dout, cache: LearnedPositionsCache):
    r"""Gradients of the learned-position add: returns ``(dx, dtable)``.

    :math:`dx = dy`; row :math:`\text{offset}+t` of ``dtable`` is :math:`dy_{\ldots,t}` summed over
    the leading (batch) dimensions, and rows that were not used get zero.
    """
    table_shape, rows, dtype = cache
    dtable = np.zeros(table_shape, dtype=dtype)
    dtable[rows] = dout.reshape(-1, *dout.shape[-2:]).sum(axis=0)
    return dout, dtable


# ---- rotary position embedding (N10) -------------------------------------------------------------


ROPE_LAYOUTS = ("interleaved", "half")


class RoPECache(NamedTuple):
    cos: np.ndarray  # (T, d_k/2), cos of each pair's angle, in x's dtype
    sin: np.ndarray  # (T, d_k/2)
    layout: str = "interleaved"


def _pair_slots(d_k: int, layout: str):
    """Where the two coordinates of pair ``r`` sit: ``(2r, 2r+1)`` interleaved, ``(r, r + d_k/2)``
    in halves."""
    if layout == "interleaved":
        return slice(0, None, 2), slice(1, None, 2)
    return slice(0, d_k // 2), slice(d_k // 2, None)


def _rotate_pairs(x, cos, sin, layout: str):
    """Rotate each coordinate pair by the angle whose cos/sin are given (row-vector form)."""
    # BEGIN SOLUTION
    first, second = _pair_slots(x.shape[-1], layout)
    a, b = x[..., first], x[..., second]
    out = np.empty_like(x)
    out[..., first] = a * cos - b * sin
    out[..., second] = a * sin + b * cos
    return out
    # END SOLUTION


def rope_forward(x, offset: int = 0, base: float = 10000.0, positions=None,
                 layout: str = "interleaved"):
    r"""Rotary position embedding (catalogue N10), applied to queries or keys.

    Each coordinate pair :math:`(x_{2r}, x_{2r+1})` of the row at position :math:`p` is rotated by
    the angle :math:`p\,\omega_r`, :math:`\omega_r = b^{-2r/d_k}` (row vector times the transposed
    rotation matrix):

    .. math::
        \tilde x = x\,R(p\,\omega)^\top:\qquad
        \tilde x_{2r} = x_{2r}\cos\theta - x_{2r+1}\sin\theta,\quad
        \tilde x_{2r+1} = x_{2r}\sin\theta + x_{2r+1}\cos\theta

    Because rotations compose, :math:`\tilde q_i \tilde k_j^\top = q_i R((j-i)\omega) k_j^\top`:
    the score sees only the offset ``j - i``. Rotate queries and keys only; values are never
    rotated.

    ``layout`` says which coordinates form pair ``r``: ``"interleaved"`` (the default, the
    RoFormer paper's and the original LLaMA code's) rotates :math:`(x_{2r}, x_{2r+1})`;
    ``"half"`` (Hugging Face's Llama, GPT-NeoX) rotates :math:`(x_r, x_{r + d_k/2})`. The two are the
    same function up to a fixed permutation of the coordinates, so a model trained with one runs
    with the other once its query and key projection columns are permuted alike. The position of row ``t`` is ``offset + t`` (``offset`` is the number of tokens already
    in the cache when decoding), or ``positions[t]`` when an explicit integer array of length ``T``
    is given (then ``offset`` must stay 0).

    Shapes: ``x`` ``(..., T, d_k)`` with ``d_k`` even (e.g. ``(B, H, T, d_k)``). Returns
    ``(x_rotated, cache)`` with the shape and dtype of ``x``.
    """
    x = float_array("x", x)
    check_min_ndim("x", x, 2, "(..., T, d_k)")
    t, d_k = x.shape[-2], x.shape[-1]
    if d_k % 2:
        raise ValueError(
            f"x.shape[-1] (d_k) must be even for RoPE's coordinate pairs, got x.shape = {x.shape}"
        )
    offset = check_int("offset", offset, 0)
    check_choice("layout", layout, ROPE_LAYOUTS)
    if positions is None:
        positions = np.arange(offset, offset + t)
    else:
        if offset:
            raise ValueError(f"give either offset or positions, not both (offset={offset})")
        positions = np.asarray(positions)
        if not np.issubdtype(positions.dtype, np.integer):
            raise TypeError(f"positions must be an integer array, got dtype {positions.dtype} "
                            f"with shape {positions.shape}")
        if positions.shape != (t,):
            raise ValueError(f"positions must have shape ({t},) to match x.shape = {x.shape}, "
                             f"got positions.shape = {positions.shape}")
        if positions.size and positions.min() < 0:
            raise ValueError(f"positions must be non-negative, got minimum {positions.min()}")
    # BEGIN SOLUTION
    angles = rope_angles(positions, d_k, base)
    cos, sin = np.cos(angles).astype(x.dtype), np.sin(angles).astype(x.dtype)
    return _rotate_pairs(x, cos, sin, layout), RoPECache(cos, sin, layout)
    # END SOLUTION


def rope_backward(dout, cache: RoPECache):
    # BEGIN SOLUTION
    r"""Gradient of RoPE: returns ``dx``.

    The forward map is the orthogonal matrix :math:`R^\top` acting on each pair, so its transpose is
    its inverse: the gradient is ``dout`` rotated by the negative angle,
    :math:`dx = dy\,R(p\,\omega)`.
    """
    return _rotate_pairs(dout, cache.cos, -cache.sin, cache.layout)
    # END SOLUTION


# ---- gradient-check cases ------------------------------------------------------------------------

def _learned_inputs(shape, t_max, offset):
    def make(rng):
        return {"x": rng.standard_normal(shape), "table": rng.standard_normal((t_max, shape[-1])),
                "offset": offset}
    return make


register_case(OpCase("learned_positions", "(4, 3) in 6 rows", ("N9",), _learned_inputs((4, 3), 6, 0),
                     learned_positions_forward, learned_positions_backward, ("x", "table")))
register_case(OpCase("learned_positions", "batch (2, 3, 4) offset 2 in 7 rows", ("N9",),
                     _learned_inputs((2, 3, 4), 7, 2),
                     learned_positions_forward, learned_positions_backward, ("x", "table")))
# dtable sums over every leading axis
register_case(OpCase("learned_positions", "3 leading axes (2, 1, 2, 3, 4) offset 1", ("N9",),
                     _learned_inputs((2, 1, 2, 3, 4), 5, 1),
                     learned_positions_forward, learned_positions_backward, ("x", "table")))
register_case(OpCase("learned_positions", "T = 1, d = 1, last row", ("N9",), _learned_inputs((2, 1, 1), 4, 3),
                     learned_positions_forward, learned_positions_backward, ("x", "table")))


def _rope_inputs(shape, **extra):
    def make(rng):
        return {"x": rng.standard_normal(shape), **extra}
    return make


register_case(OpCase("rope", "(5, 6)", ("N10",), _rope_inputs((5, 6)),
                     rope_forward, rope_backward, ("x",)))
register_case(OpCase("rope", "(B, H, T, d_k) = (2, 2, 3, 4) offset 7", ("N10",),
                     _rope_inputs((2, 2, 3, 4), offset=7), rope_forward, rope_backward, ("x",)))
register_case(OpCase("rope", "explicit positions, base 100", ("N10",),
                     _rope_inputs((2, 4, 6), positions=np.array([0, 3, 4, 11]), base=100.0),
                     rope_forward, rope_backward, ("x",)))
register_case(OpCase("rope", "3 leading axes (2, 1, 2, 3, 4) offset 2", ("N10",),
                     _rope_inputs((2, 1, 2, 3, 4), offset=2), rope_forward, rope_backward, ("x",)))
register_case(OpCase("rope", "T = 1, d_k = 2, offset 5", ("N10",), _rope_inputs((2, 1, 2), offset=5),
                     rope_forward, rope_backward, ("x",)))
