"""Helpers shared by the kernel benchmarks: timing, peak memory, threads, a plain-text table, and
a paged copy of a KV cache."""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# Run as a script from anywhere: make the checkout's refmath importable without installing it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def call_seconds(fn, repeats: int, warmup: int = 1) -> list:
    """Seconds of each of ``repeats`` timed calls of ``fn``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best_ms(fn, repeats: int = 3, warmup: int = 1) -> float:
    """The fastest of ``repeats`` timed calls, in milliseconds, after ``warmup`` untimed ones.

    The minimum, not the mean: on a shared machine the noise only ever adds time."""
    return 1e3 * min(call_seconds(fn, repeats, warmup))


def interleaved_best_ms(fns: dict, repeats: int = 3, warmup: int = 1, median: bool = False,
                        before=None) -> dict:
    """Like :func:`best_ms` for several peers, timed in turns (a, b, c, a, b, c, ...) so that a
    burst of load elsewhere on the machine hits them all alike. ``median``: the median call
    instead of the fastest, for a machine whose load comes and goes (ratios of peers timed in the
    same turns then stay comparable). ``before``: called, untimed, before every timed call (to
    put every peer in the same cache state, say)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    pick = statistics.median if median else min
    return {name: 1e3 * pick(t) for name, t in times.items()}


def rotated_times(fns: dict, repeats: int = 5, warmup: int = 1, before=None,
                  clock=time.perf_counter) -> dict:
    """Seconds of each of ``repeats`` timed calls per peer, ``{name: [s, ...]}``. The peers take
    turns; the order of the turns rotates every other round and runs backwards in between (a b c,
    c b a, b c a, a c b, c a b, b a c, ...), so that no peer always runs first after the untimed
    ``before(name)`` (called before every timed call: an eviction, a wake-up of that peer's thread
    pool) or always after the same neighbour. (Rotation alone keeps the turns' cyclic order, so a
    peer followed the same neighbour in all rounds but one: whatever that neighbour left behind,
    a thread still spinning or its lines in the cache, fell on the same peer every time.)
    ``clock``: wall time by default; ``time.thread_time`` counts only the calling thread's CPU
    time, which a busy machine's preemptions leave out (valid only for calls that run on the
    calling thread)."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            if before is not None:
                before(name)
            fns[name]()
    times = {name: [] for name in names}
    for r in range(repeats):
        shift = r // 2 % len(names)
        order = names[shift:] + names[:shift]
        if r % 2:
            order.reverse()
        for name in order:
            if before is not None:
                before(name)
            start = clock()
            fns[name]()
            times[name].append(clock() - start)
    return times


def median_min_ms(seconds) -> tuple[float, float]:
    """``(median, minimum)`` in milliseconds: the median for a machine whose load comes and goes,
    the minimum for what the code can do when nothing else gets in its way."""
    return 1e3 * statistics.median(seconds), 1e3 * min(seconds)


def neutral_reader(mib: float):
    """An untimed eviction that warms nobody's threads: a single-threaded NumPy read of ``mib`` of
    other memory (None for 0). Reading with one peer's thread pool (refmath.kernels.stream_sum)
    would leave that pool's threads spinning and its caches primed for the call that follows."""
    import numpy as np

    other = np.ones(int(mib * 2**20) // 4, dtype=np.float32)
    if not other.size:
        return None
    return lambda: float(np.add.reduce(other))


def load_average() -> str:
    if not hasattr(os, "getloadavg"):
        return "load average unknown"
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _release_free_memory() -> None:
    """Hand memory that earlier calls freed back to the system (glibc), so that this call's
    allocations show up as resident-memory growth instead of reusing already resident pages."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_extra_bytes(fn) -> tuple[int | None, object]:
    """``(bytes, result)``: how far the process's resident memory peaked above its level before the
    call, measured by resetting the kernel's peak counter (Linux: /proc/self/clear_refs, VmHWM).
    It counts every page the call touches for the first time, the result included (to a page's
    precision); None where Linux's counters are missing or cannot be reset."""
    _release_free_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current VmRSS
    except OSError:
        return None, fn()
    before = _status_kib("VmRSS")
    result = fn()
    peak = _status_kib("VmHWM")
    if before is None or peak is None:
        return None, result
    return max(0, peak - before) * 1024, result


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> None:
    """A table with right-aligned columns; cells are printed with str()."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(title)
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def machine_line(threads: int) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} CPUs, {threads} thread(s) for every peer, load average {load:.1f} "
            f"(above the CPU count the figures are noisy)")


def choose_vector_width(narrow: bool) -> str:
    """Switch refmath's CPU kernels to their 8-lane copies if ``narrow``; say which copy runs."""
    from refmath import kernels

    kernels.cpu_vector_lanes(8 if narrow else 16)
    return f"refmath's CPU kernels run with {kernels.cpu_instructions()}"


def median(xs):
    return statistics.median(xs)


def paged_copy(k, v, page_size, rng, in_order=False):
    """The caches (1, G, T, D) cut into pages (n_pages, G, p, D) at random places in the pool
    (in_order: page i at place i)."""
    _, g, t, d = k.shape
    n = -(-t // page_size)
    # logical page i is physical page order[i]
    order = np.arange(n) if in_order else rng.permutation(n)
    k_pages = np.zeros((n, g, page_size, d), np.float32)
    v_pages = np.zeros_like(k_pages)
    for i in range(n):
        filled = min(page_size, t - i * page_size)
        k_pages[order[i], :, :filled] = k[0, :, i * page_size: i * page_size + filled]
        v_pages[order[i], :, :filled] = v[0, :, i * page_size: i * page_size + filled]
    return k_pages, v_pages, order[None, :].astype(np.int32)
