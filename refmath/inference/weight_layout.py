r"""Weights laid out for decoding: each matrix :math:`W` stored as the rows of :math:`W^\top`.

A decode step multiplies one row :math:`x` by every weight matrix, :math:`y_j = \sum_i x_i W_{ij}`:
two FLOPs per weight read, so the step runs at the speed the weights stream from memory (N5). How
fast they stream depends on how they lie in memory. refmath stores :math:`W` as ``(in, out)``
rows; :math:`y` then sums rows of :math:`W`, each scaled by one :math:`x_i`, and a thread walks a
few rows at once, each a short stream. Stored as the rows of :math:`W^\top` (``(out, in)``, the
layout of ``torch.nn.Linear``), each output :math:`y_j = x \cdot W^\top_j` is one dot product over
one contiguous row, and a thread reads its share of the matrix as a single forward stream.

:func:`decode_layout` makes that copy once; the matrices keep their shape and values (each is
:math:`W` itself, a transposed view of the :math:`W^\top` rows), so every function takes the new
parameters as it takes the old ones, and :func:`refmath.kernels.rows_matmul` reads them as dot
products. Measured with ``benchmarks/rows_matmul.py`` on a quiet 2-core Zen 4 (AVX-512; the record
of 2026-12-04 00:24), the products of 12 layers of a small Llama read 28 GB/s on one thread this
way (90% of the machine's read bandwidth), against 15 GB/s from ``(in, out)`` rows and 18 GB/s
for NumPy's BLAS; on two threads 33 GB/s (95%) against 26 GB/s for either.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from refmath._validate import float_array

__all__ = ["decode_layout", "in_decode_layout"]

# Multi-head latent attention's absorbed step reads these as (d_c, heads, d) blocks (a reshape,
# which a transposed layout would turn into a copy at every step), so they keep refmath's layout.
_RESHAPED = ("w_uk", "w_uv")


def _is_product_matrix(name: str, value) -> bool:
    """Whether the decode step multiplies rows by this parameter as a whole matrix: the 2-D weights
    (``...w_q``, ``...w_down``, ``lm_head``, ...), not the embedding tables (read a row at a time),
    the gains and biases, nor a mixture's stacked experts."""
    last = name.rsplit(".", 1)[-1]
    return (np.ndim(value) == 2 and (last.startswith("w") or last == "lm_head")
            and last not in _RESHAPED)


def decode_layout(params: Mapping, *, in_place: bool = False) -> dict:
    r"""A copy of ``params`` whose weight matrices are stored as the rows of :math:`W^\top`.

    Every 2-D weight matrix a decode step multiplies by (``w_q``, ``w_o``, ``w_gate``, ...,
    ``lm_head``) becomes ``np.ascontiguousarray(W.T).T``: the same values and shape ``(in,
    out)``, stored ``(out, in)``. Embedding tables, gains, biases, stacked experts and MLA's
    ``w_uk``/``w_uv`` are the same arrays as in ``params`` (not copied). The new matrices are
    copies: while both dicts are kept the matrices take twice their memory. With ``in_place=True``
    each entry of ``params`` (a dict) is replaced as soon as its copy is made, and ``params`` itself
    is returned: where nothing else holds the old matrices, the memory at any moment is then the
    parameters plus one matrix (what ``python -m refmath generate --backend cpu`` does). Results
    equal those of ``params`` up to the rounding of a sum taken in another order.

    :func:`refmath.inference.generate.generate` on ``backend="cpu"`` multiplies such parameters on
    :func:`refmath.kernels.rows_matmul` at every thread count (see the module's docstring for the
    measured speed).
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping of names to arrays, got {type(params).__name__}")
    if in_place and not isinstance(params, dict):
        raise TypeError(f"in_place=True replaces the entries of a dict, got {type(params).__name__}")
    out = params if in_place else {}
    for name in list(params):  # the names only: a list of the values would keep every old matrix
        value = params[name]
        if _is_product_matrix(name, value):
            value = np.ascontiguousarray(float_array(name, value).T).T
        out[name] = value  # in place, the old matrix is freed here, before the next copy
    return out


def in_decode_layout(params: Mapping) -> bool:
    """Whether every weight matrix of ``params`` (as :func:`decode_layout` picks them, at least one)
    is stored as the rows of its transpose."""
    if not isinstance(params, Mapping):
        return False
    matrices = [v for k, v in params.items() if _is_product_matrix(k, v)]
    return bool(matrices) and all(isinstance(w, np.ndarray) and w.T.flags.c_contiguous
                                  for w in matrices)
