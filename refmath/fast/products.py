r"""How a decode step multiplies its few rows by the weights: NumPy's BLAS, or the C++ rows kernel.

A decode step at batch ``B`` multiplies ``B`` rows by every weight matrix of the model (N5): the
time is the time to stream the weights, and BLAS, built for large products, streams them no faster
than a plain loop over the rows. :func:`kernel_products` sends a few float32 rows to
:func:`refmath.kernels.rows_matmul_many`, which reads each weight once on the C++ kernels' OpenMP
threads (the threads the attention kernel of ``backend="cpu"`` uses too); :func:`blas_products`
is :func:`refmath.ffn.matmul_rows_many`, NumPy's product. Both compute
:math:`y_j = x W_j` for each matrix :math:`W_j`, the same sums rounded in another order.

Both have the signature of :func:`refmath.ffn.matmul_rows_many`, ``(x, ws) -> [x @ w for w in ws]``,
and are what the models' cached steps take as ``matmul=`` (:mod:`refmath.models.contract`) and the
KV cache's steps as ``products=`` (:func:`refmath.inference.kv_cache.decode_step`). Nothing here
is held between calls: a caller names the one it wants.
"""
from __future__ import annotations

import math

import numpy as np

from refmath import kernels
from refmath.ffn import matmul_rows_many

__all__ = ["blas_products", "kernel_products", "few_enough_rows", "check_products"]

# Products of at most this many float32 rows run on refmath.kernels.rows_matmul instead of BLAS;
# up to the second count where every matrix is stored as the rows of its transpose
# (refmath.inference.weight_layout.decode_layout), whose dot products BLAS reads slowly: at 8 rows,
# 12 small-Llama layers took the kernel 50 ms and BLAS 75 ms on one thread of a 2-core Zen 4, 24
# and 41 ms on two (at 16 rows BLAS was faster).
_KERNEL_ROWS_MAX = 4
_KERNEL_ROWS_MAX_TRANSPOSED = 8

# NumPy's products: the reference ops' own.
blas_products = matmul_rows_many


def few_enough_rows(rows: int, ws) -> bool:
    """Whether ``rows`` rows times the matrices ``ws`` go to the kernel in
    :func:`kernel_products` (the layout is looked at only past the plain limit: a decode step's one
    row never pays for it)."""
    return rows <= _KERNEL_ROWS_MAX or (rows <= _KERNEL_ROWS_MAX_TRANSPOSED and
                                        all(w.T.flags.c_contiguous for w in ws))


def kernel_products(x, ws) -> list:
    """``[x @ w for w in ws]`` as :func:`refmath.ffn.matmul_rows_many` computes it, except that a
    few float32 rows (up to 4, or 8 for matrices in
    :func:`refmath.inference.weight_layout.decode_layout`, :func:`few_enough_rows`) times float32
    matrices go to :func:`refmath.kernels.rows_matmul_many` in one call for all of ``ws`` (e.g. a
    layer's Q, K and V projections: one pass of the kernel's threads over the three matrices).
    Anything else is BLAS's.

    Measured with ``benchmarks/generate.py --products both`` on a 2-core AVX2 machine, generation
    on these products made 1.03-1.12x BLAS's tokens/s on 2 threads and 0.89-0.99x on 1, which is
    why :func:`refmath.inference.generate.generate` takes them on ``backend="cpu"`` with two or
    more threads, or for weights in the decode layout."""
    rows = math.prod(x.shape[:-1])  # not -1: that cannot be resolved when d_in is 0
    if not (x.dtype == np.float32 and all(w.dtype == np.float32 for w in ws)
            and few_enough_rows(rows, ws)):
        return matmul_rows_many(x, ws)
    ys = kernels.rows_matmul_many(x.reshape(rows, x.shape[-1]), ws)
    return [y.reshape(x.shape[:-1] + (w.shape[1],)) for y, w in zip(ys, ws)]


def check_products(products):
    """``products`` as the KV cache's steps take it: None (the caller names none) or a function
    with :func:`refmath.ffn.matmul_rows_many`'s signature; anything else raises ``TypeError``."""
    if products is not None and not callable(products):
        raise TypeError(f"products must be None or a function (x, ws) -> [x @ w for w in ws], "
                        f"such as refmath.fast.products.kernel_products; got "
                        f"{type(products).__name__} {products!r}")
    return products
