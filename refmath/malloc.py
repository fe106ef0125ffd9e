"""Keep freed memory in the process, so that NumPy's large temporaries do not page-fault.

NumPy takes every array from ``malloc``. With glibc's defaults, a block of more than a few
hundred KiB is mapped fresh from the kernel and unmapped when freed (and the top of the heap is
trimmed back to the kernel), so the next array of that size faults on each of its 4 KiB pages while
the kernel zeroes them. A training step allocates and frees arrays of megabytes all the time (the
FFN's hidden activations of the GPT benchmark are 8 MiB each): measured on the benchmark of
``benchmarks/train_step.py``, those faults were about 30% of the forward pass's CPU time. PyTorch
avoids them with a caching allocator; raising glibc's mapping and trimming thresholds gives NumPy
the same reuse, at the price of a process that holds on to its peak memory.

This changes the whole process, so the library never does it on import: the training command
(``python -m refmath train``) and the training benchmark call :func:`retain_freed_memory` at start.
"""
from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["retain_freed_memory"]

# mallopt() parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses a mapping threshold above 32 MiB on 64-bit systems (HEAP_MAX_SIZE / 2).
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
_TRIM_THRESHOLD = 1 << 30


def retain_freed_memory() -> bool:
    """Ask glibc's ``malloc`` to serve blocks up to 32 MiB from its heap and to keep up to 1 GiB of
    freed memory there for reuse, instead of returning it to the kernel.

    Returns True when the settings took effect, False where there is no glibc (macOS, musl): there
    the allocator's own defaults stay, and only speed differs, never a result.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
