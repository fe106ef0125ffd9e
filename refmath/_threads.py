"""How many BLAS threads a run uses: chosen from the size of its matrix products.

A product of ``m x k`` by ``k x n`` costs ``m k n`` multiply-adds. OpenBLAS splits one product over
its threads and then keeps them spinning, waiting for the next; between two products NumPy's
element-wise work runs on one core. So for small products the extra threads mostly compete with
that work (and, on a busy machine, with the other processes) and a step gets slower, several times
slower at a load above the number of cores. Large products divide well, and every core helps.

:func:`choose_blas_threads` takes the largest product of one step: one thread below
:data:`SMALL_PRODUCT` multiply-adds (the per-token products of decoding, the small batches of
``train``), else the cores this process may run on. :func:`blas_threads` applies a choice with
threadpoolctl for the length of a ``with`` block. A thread count set in the environment
(``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ...) is left as it is unless a count is given.
"""
from __future__ import annotations

import contextlib
import os

from refmath._validate import check_int

# Below this many multiply-adds per product one thread is the faster choice for a whole run (on 2
# shared cores, train --model gpt's largest product, 32 x 64 rows by 64 x 256, is 33.5 million).
SMALL_PRODUCT = 1 << 26
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                    "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def largest_product(rows: int, params: dict) -> int:
    """Multiply-adds of the largest product ``rows x k`` by ``k x n`` over the 2-D parameters."""
    widest = max((p.size for p in params.values() if getattr(p, "ndim", 0) == 2), default=0)
    return int(rows) * int(widest)


def choose_blas_threads(macs: int, threads: int | None = None) -> int | None:
    """BLAS threads for products of at most ``macs`` multiply-adds: ``threads`` when given; None
    (leave the pools alone) when a thread count is set in the environment; 1 below
    :data:`SMALL_PRODUCT`; else :func:`available_cores`."""
    if threads is not None:
        return check_int("threads", threads, 1)
    if any(os.environ.get(name) for name in THREAD_VARIABLES):
        return None
    return 1 if macs < SMALL_PRODUCT else available_cores()


@contextlib.contextmanager
def blas_threads(count: int | None):
    """Run the ``with`` block with ``count`` BLAS threads (None: as they are). Without
    threadpoolctl installed the pools are left as they are."""
    if count is None:
        yield
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=count, user_api="blas"):
        yield
