"""The bandwidth reference of the decode and generation benchmarks: a plain sequential read of
exactly the bytes an operation must read, in the same process, in the same turns as the
operation, on the same threads, from cold caches. Every decode and generation figure is printed
as a fraction of it.

* What is read: the operation's own arrays where the benchmark has them (a decode step: its K and
  V caches), else one float32 buffer of exactly the operation's byte count (a generated token: the
  weights it reads plus the KV cache read per token on average), allocated and touched once
  before any timing, so that no page is first faulted in during a timed read.
* How: refmath.kernels.stream_sum, every OpenMP thread of the kernels (refmath.kernels
  .cpu_threads(), which --threads sets) reading one contiguous stretch front to back into vector
  accumulators: a read, and nothing else.
* Scattered pages: with ``order`` (a paged cache's page-table row), each array is a pool of pages
  ``(n_pages, ...)`` read page after page in that order (the next page requested while one is
  read), the read a paged decode must make of that placement and nothing else: the floor a paged
  kernel is shown against, beside the plain read of the same bytes in one run.
* Cold: before each timed read, and untimed, a single-threaded NumPy read of other memory, 1.5
  times the last-level cache this CPU reports (Linux's /sys/devices/system/cpu/cpu0/cache; 128
  MiB where it reports none, --evict-mib to choose), so the read finds its bytes in memory rather
  than in a cache, as a decode step finds a layer's weights and cache (every other layer's were
  read since). An operation whose bytes fit in the caches (a tiny model's weights, a short
  context) may then run from warm caches where the reference cannot: above 100%, and that is why.
* The fraction: the reference's seconds over the operation's (for tokens, over the seconds per
  token), the operation's bytes per second over the reference's: 100% is an operation that runs
  as fast as a plain read of its bytes.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from _common import neutral_reader

from refmath import kernels


def last_level_cache_bytes() -> int | None:
    """The largest cache this CPU reports (Linux sysfs; the level-3 cache its core shares), or
    None where there is no such report."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        if text[-1:].upper() in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1].upper()])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=None)


def default_evict_mib() -> float:
    """1.5 times the last-level cache, or 128 MiB where the CPU reports none."""
    llc = last_level_cache_bytes()
    return 1.5 * llc / 2**20 if llc else 128.0


class ReadReference:
    """A plain read of ``nbytes`` (a buffer of that many bytes, rounded up to whole floats) or of
    ``arrays`` (float32, each read front to back in turn; with ``order``, each a pool of pages
    read page ``order[0]``, ``order[1]``, ... in turn, only those pages counted), with an eviction
    of ``evict_mib`` MiB before each timed read (None: :func:`default_evict_mib`; 0: warm)."""

    def __init__(self, nbytes: int | None = None, arrays=None, evict_mib: float | None = None,
                 order=None):
        if (nbytes is None) == (arrays is None):
            raise ValueError("give the reference either nbytes or arrays")
        if order is not None and arrays is None:
            raise ValueError("order reads pages of the arrays given: give arrays with it")
        if arrays is None:
            arrays = [np.ones(max(1, -(-int(nbytes) // 4)), np.float32)]
        self.arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays]
        self.order = None if order is None else np.ascontiguousarray(order, dtype=np.int32)
        self.nbytes = (sum(a.nbytes for a in self.arrays) if self.order is None else
                       sum(a[0].nbytes * len(self.order) for a in self.arrays))
        self.evict_mib = default_evict_mib() if evict_mib is None else float(evict_mib)
        self.evict = neutral_reader(self.evict_mib)
        self.read()  # every page touched once, untimed

    def read(self) -> None:
        for a in self.arrays:
            kernels.stream_sum(a, self.order)

    def seconds(self) -> float:
        """One cold read: the eviction (untimed), then the timed read."""
        if self.evict is not None:
            self.evict()
        start = time.perf_counter()
        self.read()
        return time.perf_counter() - start

    def describe(self) -> str:
        cold = (f"after an untimed one-thread NumPy read of {self.evict_mib:g} MiB of other memory"
                if self.evict is not None else "warm (no eviction)")
        pages = "" if self.order is None else f" (pages in the order of a page table of {len(self.order)})"
        return (f"read reference: stream_sum of exactly the {self.nbytes / 2**20:.1f} MiB the "
                f"operation reads{pages}, on {kernels.cpu_threads()} thread(s), each read {cold}")
