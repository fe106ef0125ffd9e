"""Position information: fixed sinusoids, a learned table, and rotary embeddings (RoPE).

Positions are 0-based token indices along the sequence axis, which is the second-to-last axis of
every input here: ``x`` is ``(..., T, d)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from refmath._validate import (as_dataclass, check_choice, check_flag, check_int, check_min_ndim,
                               check_ndim, check_real, float_array)
from refmath.registry import OpCase, register_case

__all__ = ["rope_angles", "sinusoidal_positions", "LearnedPositionsCache",
           "learned_positions_forward", "learned_positions_backward", "RopeScaling",
           "as_rope_scaling", "yarn_mscale", "rope_inv_freq", "rope_frequencies_change",
           "rope_softmax_scale", "ROPE_LAYOUTS", "RoPECache", "rope_forward", "rope_backward"]


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


# ---- context extension: RoPE's frequencies rescaled (N13-N17) ------------------------------------

ROPE_SCALING_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope")
# The rules whose frequencies depend on the current sequence length: keys cached at a shorter
# length were rotated with other frequencies, so growing past the threshold invalidates them (K3).
LENGTH_DEPENDENT = ("dynamic", "longrope")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    r"""A context-extension rule for RoPE's frequencies (N13-N17), as Hugging Face's
    ``rope_parameters`` name them.

    ``rope_type``: ``"linear"`` (position interpolation), ``"dynamic"`` (dynamic NTK),
    ``"llama3"`` (Llama 3.1's frequency-wise rule), ``"yarn"`` or ``"longrope"`` (Phi-3).
    ``factor`` :math:`s > 0` is the context stretch; ``original_max_seq_len`` :math:`L` the context
    the model was pretrained at (needed by every rule but ``"linear"``). ``low_freq_factor``,
    ``high_freq_factor``: Llama 3.1's band edges :math:`\alpha < \beta`. ``beta_fast``,
    ``beta_slow``, ``truncate``: YaRN's ramp (in rotations over :math:`L`); ``mscale``,
    ``mscale_all_dim``: DeepSeek's temperature terms; ``attention_factor``: an explicit
    :math:`m` (YaRN, LongRoPE). ``short_factor``, ``long_factor``: LongRoPE's per-pair divisors
    (``d_k/2`` each). A dict with these keys converts (``RopeScaling(**d)``), so configurations that
    hold one round-trip through JSON.
    """

    rope_type: str
    factor: float = 1.0
    original_max_seq_len: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    short_factor: tuple | None = None
    long_factor: tuple | None = None

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)

        check_choice("rope_scaling.rope_type", self.rope_type, ROPE_SCALING_TYPES)
        put("factor", check_real("rope_scaling.factor", self.factor, 0.0, low_open=True))
        if self.original_max_seq_len is not None:
            put("original_max_seq_len",
                check_int("rope_scaling.original_max_seq_len", self.original_max_seq_len, 1))
        elif self.rope_type != "linear":
            raise ValueError(f"rope_scaling.original_max_seq_len (the pretrained context) is "
                             f"needed by rope_type {self.rope_type!r}")
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            put(name, check_real(f"rope_scaling.{name}", getattr(self, name), 0.0, low_open=True))
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, name) is not None:
                put(name, check_real(f"rope_scaling.{name}", getattr(self, name), 0.0))
        put("truncate", check_flag("rope_scaling.truncate", self.truncate))
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"rope_scaling.high_freq_factor = {self.high_freq_factor} must exceed "
                             f"low_freq_factor = {self.low_freq_factor}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                put(name, tuple(check_real(f"rope_scaling.{name}[{i}]", v, 0.0, low_open=True)
                                for i, v in enumerate(value)))
            elif self.rope_type == "longrope":
                raise ValueError(f"rope_scaling.{name} is needed by rope_type 'longrope'")

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies change with the current sequence length (dynamic, LongRoPE)."""
        return self.rope_type in LENGTH_DEPENDENT


def as_rope_scaling(value, name: str = "rope_scaling") -> RopeScaling | None:
    """``value`` as a :class:`RopeScaling`: one already, a dict of its fields, or None."""
    return as_dataclass(value, RopeScaling, name)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    r"""YaRN's magnitude :math:`\mu(s) = 0.1\,\mu \ln s + 1` for :math:`s > 1`, else 1 (N16)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(d_k: int, base: float = 10000.0, scaling=None, seq_len: int | None = None):
    r"""RoPE's frequencies :math:`\omega'_r` under a context-extension rule, and the attention
    factor :math:`m` that multiplies the rotated queries and keys (N10, N13-N17).

    With :math:`\omega_r = b^{-2r/d_k}`, wavelength :math:`\lambda_r = 2\pi/\omega_r`, stretch
    :math:`s` = ``factor`` and pretrained context :math:`L`:

    - none (N10): :math:`\omega'_r = \omega_r`, :math:`m = 1`;
    - ``linear``, position interpolation (N13): :math:`\omega'_r = \omega_r / s`: position
      :math:`p` is rotated as :math:`p/s` was, so :math:`sL` positions span the trained angles;
    - ``dynamic`` NTK (N14): the base grows with the current length :math:`\ell` =
      ``max(seq_len, L)``, :math:`b' = b\,(s\ell/L - (s - 1))^{d_k/(d_k-2)}`, :math:`\omega'_r =
      b'^{-2r/d_k}`; equal to :math:`\omega` up to :math:`\ell = L`, and the fastest pair
      (:math:`r = 0`) is never slowed;
    - ``llama3`` (N15): :math:`\omega'_r = \omega_r` where :math:`\lambda_r < L/\beta`,
      :math:`\omega_r / s` where :math:`\lambda_r > L/\alpha`, and between them
      :math:`(1-\gamma_r)\,\omega_r/s + \gamma_r\,\omega_r` with
      :math:`\gamma_r = (L/\lambda_r - \alpha)/(\beta - \alpha)`;
    - ``yarn`` (N16): pair :math:`r` turns :math:`L/\lambda_r` times over the pretrained context;
      pairs with more than :math:`\beta_{\text{fast}}` turns keep :math:`\omega_r`, pairs with fewer
      than :math:`\beta_{\text{slow}}` are interpolated to :math:`\omega_r/s`, and a linear ramp
      :math:`\gamma_r = \operatorname{clip}((r - r_{\text{lo}})/(r_{\text{hi}} - r_{\text{lo}}), 0,
      1)` between the pair indices :math:`r(n) = d_k \ln(L/(2\pi n)) / (2\ln b)` of
      :math:`n = \beta_{\text{fast}}` and :math:`n = \beta_{\text{slow}}` (floored and ceiled with
      ``truncate``) gives :math:`\omega'_r = (1 - \gamma_r)\,\omega_r + \gamma_r\,\omega_r/s`;
      the temperature :math:`m = 0.1\ln s + 1`, or with DeepSeek's terms
      :math:`m = \mu(s; \text{mscale}) / \mu(s; \text{mscale\_all\_dim})`
      (:func:`yarn_mscale`), unless ``attention_factor`` gives it;
    - ``longrope`` (N17): :math:`\omega'_r = \omega_r / f_r` with :math:`f` = ``long_factor``
      once ``seq_len`` exceeds :math:`L`, ``short_factor`` otherwise;
      :math:`m = \sqrt{1 + \ln s / \ln L}` (1 for :math:`s \le 1`) unless ``attention_factor``.

    ``seq_len`` (the length of the sequence being run, positions ``0..seq_len-1``) matters only to
    the length-dependent rules, ``dynamic`` and ``longrope``; for them a cache of keys rotated at
    one length is invalid at a length whose frequencies differ (see
    :func:`rope_frequencies_change`). Computed in float64. Returns ``(inv_freq (d_k/2,), m)``.

    Worked example (``d_k = 4``, ``b = 10000``, so :math:`\omega = (1, 0.01)`, :math:`\lambda =
    (2\pi, 200\pi)`): ``linear`` with :math:`s = 4` gives :math:`(0.25, 0.0025)`; ``llama3``
    with :math:`s = 8`, :math:`\alpha = 1`, :math:`\beta = 4`, :math:`L = 64` keeps pair 0
    (:math:`2\pi < 16`) and divides pair 1 (:math:`200\pi > 64`): :math:`(1, 0.00125)`.
    """
    d_k = check_int("d_k", d_k, 2)
    if d_k % 2:
        raise ValueError(f"d_k must be a positive even integer, got {d_k}")
    base = _check_base(base)
    scaling = as_rope_scaling(scaling)
    if seq_len is not None:
        seq_len = check_int("seq_len", seq_len, 0)
    exponent = np.arange(0, d_k, 2, dtype=np.float64) / d_k  # 2r / d_k
    omega = 1.0 / base ** exponent
    if scaling is None:
        return omega, 1.0
    s, kind, L = scaling.factor, scaling.rope_type, scaling.original_max_seq_len
    if kind == "linear":
        return omega / s, 1.0
    if kind == "dynamic":
        length = L if seq_len is None else max(seq_len, L)
        stretched = base * (s * length / L - (s - 1)) ** (d_k / (d_k - 2))
        return 1.0 / stretched ** exponent, 1.0
    if kind == "llama3":
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelength = 2 * math.pi / omega
        gamma = (L / wavelength - low) / (high - low)
        smooth = (1 - gamma) * omega / s + gamma * omega
        return np.where(wavelength < L / high, omega,
                        np.where(wavelength > L / low, omega / s, smooth)), 1.0
    if kind == "yarn":
        def pair_of(turns):  # the (fractional) pair index that turns `turns` times over L
            return d_k * math.log(L / (turns * 2 * math.pi)) / (2 * math.log(base))
        lo, hi = pair_of(scaling.beta_fast), pair_of(scaling.beta_slow)
        if scaling.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d_k - 1)
        if lo == hi:
            hi += 0.001  # a step, not a ramp (as Hugging Face's reference does)
        gamma = np.clip((np.arange(d_k // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
        inv_freq = (1 - gamma) * omega + gamma * omega / s
        m = scaling.attention_factor
        if m is None:
            if scaling.mscale and scaling.mscale_all_dim:
                m = yarn_mscale(s, scaling.mscale) / yarn_mscale(s, scaling.mscale_all_dim)
            else:
                m = yarn_mscale(s)
        return inv_freq, float(m)
    # longrope
    factors = scaling.long_factor if seq_len is not None and seq_len > L else scaling.short_factor
    if len(factors) != d_k // 2:
        raise ValueError(f"rope_scaling's {'long' if factors is scaling.long_factor else 'short'}"
                         f"_factor has {len(factors)} entries; d_k = {d_k} needs {d_k // 2}")
    m = scaling.attention_factor
    if m is None:
        m = 1.0 if s <= 1 else math.sqrt(1 + math.log(s) / math.log(L))
    return omega / np.asarray(factors, dtype=np.float64), float(m)


def rope_frequencies_change(scaling, length: int, new_length: int) -> bool:
    """Whether growing a sequence from ``length`` to ``new_length`` tokens changes the frequencies
    of a length-dependent rule, so that keys cached rotated at ``length`` are stale (K3).

    Dynamic NTK's frequencies are the same at every length up to :math:`L` and differ at every
    length past it; LongRoPE's switch from ``short_factor`` to ``long_factor`` once the length
    passes :math:`L`. The other rules never invalidate a cache.
    """
    scaling = as_rope_scaling(scaling)
    if scaling is None or not scaling.length_dependent or length == 0 or new_length == length:
        return False
    L = scaling.original_max_seq_len
    if scaling.rope_type == "dynamic":
        return new_length > L
    return (length > L) != (new_length > L)


def rope_softmax_scale(d_k: int, scaling=None) -> float:
    r"""The softmax scale :math:`1/\sqrt{d_k}`, with DeepSeek's YaRN correction (N16): where a
    ``yarn`` rule has ``mscale_all_dim``, the scale is multiplied by
    :math:`\mu(s; \text{mscale\_all\_dim})^2` (:func:`yarn_mscale`), the temperature of every score
    coordinate, rotary or not; in DeepSeek-V2/V3 (``mscale = mscale_all_dim``) this is the whole
    temperature, since then :math:`m = 1` in :func:`rope_inv_freq`."""
    d_k = check_int("d_k", d_k, 1)
    scaling = as_rope_scaling(scaling)
    scale = 1.0 / math.sqrt(d_k)
    if scaling is not None and scaling.rope_type == "yarn" and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


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
                 layout: str = "interleaved", inv_freq=None, attention_factor: float = 1.0):
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

    ``inv_freq`` (optional, ``(d_k/2,)``) replaces the frequencies :math:`\omega_r` by precomputed
    ones, such as a context-extension rule's (:func:`rope_inv_freq`, N13-N17; ``base`` is then
    unused); ``attention_factor`` :math:`m` multiplies the rotation,
    :math:`\tilde x = m\,x\,R(p\,\omega)^\top` (YaRN's temperature, N16: applied to queries and
    keys it scales every score by :math:`m^2`). The defaults are the plain rotation.

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
    if inv_freq is not None:
        inv_freq = np.asarray(inv_freq, dtype=np.float64)
        if inv_freq.shape != (d_k // 2,):
            raise ValueError(f"inv_freq must have shape ({d_k // 2},) (d_k/2 for x.shape = "
                             f"{x.shape}), got inv_freq.shape = {inv_freq.shape}")
    attention_factor = check_real("attention_factor", attention_factor, 0.0, low_open=True)
    # BEGIN SOLUTION
    if inv_freq is None:
        angles = rope_angles(positions, d_k, base)
    else:
        angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    if attention_factor != 1.0:
        cos, sin = attention_factor * cos, attention_factor * sin
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    return _rotate_pairs(x, cos, sin, layout), RoPECache(cos, sin, layout)
    # END SOLUTION


def rope_backward(dout, cache: RoPECache):
    # BEGIN SOLUTION
    r"""Gradient of RoPE: returns ``dx``.

    The forward map is the orthogonal matrix :math:`R^\top` acting on each pair, so its transpose is
    its inverse: the gradient is ``dout`` rotated by the negative angle,
    :math:`dx = dy\,R(p\,\omega)` (times :math:`m` with an ``attention_factor``, which the cached
    cos and sin already carry).
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
# context extension: the same rotation at rescaled frequencies, times YaRN's / LongRoPE's factor m
_SCALED = {
    "linear s=4 (N13)": dict(rope_type="linear", factor=4.0),
    "dynamic NTK s=2, L=4, length 7 (N14)": dict(rope_type="dynamic", factor=2.0,
                                                 original_max_seq_len=4),
    "llama3 s=8, L=16 (N15)": dict(rope_type="llama3", factor=8.0, original_max_seq_len=16),
    "yarn s=4, L=16, m = 0.1 ln 4 + 1 (N16)": dict(rope_type="yarn", factor=4.0,
                                                   original_max_seq_len=16),
    "longrope, long factors (N17)": dict(rope_type="longrope", factor=4.0, original_max_seq_len=4,
                                         short_factor=(1.0, 1.5, 2.0), long_factor=(1.0, 3.0, 7.5)),
}
for _label, _scaling in _SCALED.items():
    _freq, _m = rope_inv_freq(6, 100.0, _scaling, seq_len=7)
    register_case(OpCase("rope", _label, ("N10", _label[-4:-1]),
                         _rope_inputs((2, 7, 6), inv_freq=_freq, attention_factor=_m),
                         rope_forward, rope_backward, ("x",)))
