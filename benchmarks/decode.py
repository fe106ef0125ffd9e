"""One decode step on the CPU: refmath's C++ decode kernels against the memory bandwidth and PyTorch.

A decode step reads every cached key and value once, so its speed is best read as bandwidth: bytes
of K and V read per second, next to what this machine can read at all. The ceiling is measured in
the same run by refmath.kernels.stream_sum, a C++ loop that sums a float32 array with every OpenMP thread:
a plain streaming read, nothing else. It runs twice: once over --probe-gib (far larger than the
caches of the CPU) for the header, and once per context over the very K and V arrays being decoded,
timed in turns with the peers. The second is the ceiling each row is compared with ("of read"):
benchmarks/_bandwidth.py's reference, a plain read of exactly the K and V arrays being decoded,
from the same place, the same cache state (below), on the same threads, under the same load from
the rest of the machine.

Peers, float32, on the same number of threads:
* refmath.kernels.decode: contiguous caches (B, G, T, D), split-K chosen automatically;
* refmath.kernels.paged_decode: the same keys and values in pages of --page-size slots (one peer
  per size given), the page table a random permutation of the pool (so consecutive pages are not
  neighbours in memory); with --pages-in-order, beside it, the same sizes with page i at place i of
  the pool (the same code reading a pool that happens to be one run), which tells what the paging
  costs from what the scattered placement costs;
* read p=N: stream_sum of the paged pools alone, page after page in the page table's order (the
  next page requested while one is read; benchmarks/_bandwidth.py's reference with the page
  table's order): what this machine reads of that placement when nothing else is done, the paged
  peer's own floor, beside the contiguous one; the ratio table shows the paged kernel against it;
* torch grouped, the peer at its best: torch.nn.functional.scaled_dot_product_attention with the
  query regrouped as (B, G, H/G, D), the H/G query heads of a key/value head taking the place of
  query positions, against the contiguous caches: one matrix product per group, no copy of K and V;
* torch enable_gqa: the same call on q (B, H, 1, D) with enable_gqa=True, PyTorch's own GQA form,
  which torch 2.13 runs several times slower; shown beside the best form, not instead of it.
Before timing, every peer's output is checked against refmath's (printed: largest difference).

Shapes: B = 1, H = 32 query heads, G = 8 key/value heads, D = 128, contexts from --contexts.

Fairness: every timed call starts from the same state, whoever runs it.
* Caches: an untimed read of --evict-mib of other memory runs before every timed call, so each
  finds K and V out of the CPU's caches, as a model's decode step finds a layer's cache (every
  other layer's was read since). The default is 1.5 times the last-level cache this CPU reports
  (Linux's /sys/devices/system/cpu/cpu0/cache; 128 MiB where it reports none): enough to push
  everything out of it, and no more, so the read itself stays short. The reader is neutral
  (--evict-by numpy, the default): one thread, NumPy's own reduction, nobody's thread pool.
  --evict-by stream_sum is the old eviction, refmath's multi-threaded stream_sum, which leaves
  refmath's OpenMP threads spinning and hot for the call that follows (kept to show what it
  changed); --evict-mib 0 times them warm.
* Thread pools and first-call costs: refmath's kernels and torch each have an OpenMP pool of their
  own. With --pools calls (the default) every timed call is preceded, before the eviction, by an
  untimed call of that same peer: its own thread pool, its own allocations and code were the last
  to run, as in a model's step, where the previous layer made the same call, and no peer gains from
  another's warm-up. --pools awake wakes each pool instead, after the eviction, by a tiny parallel
  call on it (refmath: stream_sum of 256 KiB; torch: a sum of 256 KiB); --pools asleep does
  neither.
* Order: the peers take turns, in an order that rotates every other round and runs backwards
  in between (_common.rotated_times); every peer's median and minimum are printed, and the
  ratios use the medians (minima beside them).

    python benchmarks/decode.py
    python benchmarks/decode.py --quick             # one short context, a few calls (seconds)
    python benchmarks/decode.py --contexts 4096 32768 --repeats 10
    OMP_NUM_THREADS=1 python benchmarks/decode.py   # every peer on one thread
    OMP_WAIT_POLICY=passive python benchmarks/decode.py  # a machine other jobs keep busy
    OMP_NUM_THREADS=1 python benchmarks/decode.py --clock thread  # CPU time, on a busy machine

On a machine whose other jobs keep the cores busy, OpenMP's spinning waits let a thread that lost
its core hold up the other at every barrier, which costs refmath's many short parallel regions
more than torch's. refmath.kernels loads the OpenMP runtime with OMP_WAIT_POLICY=passive unless
the environment sets a policy (the header prints which), and torch, loaded after it here, shares
that runtime: OMP_WAIT_POLICY=active python benchmarks/decode.py times both spinning.

--clock thread times each call by the CPU time of the calling thread (time.thread_time) instead
of the wall clock: on one thread every peer runs on the calling thread, and the time the operating
system gives the core to other processes is then left out of every figure (what they take of the
memory bandwidth and the shared cache is not). Only on one thread: the other threads' time would
be missing.

Nothing is asserted: the figures depend on the machine (and on its load, printed first).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from _common import (best_ms, choose_vector_width, load_average, machine_line, median_min_ms,
                     neutral_reader, paged_copy, print_table, rotated_times)
from _bandwidth import ReadReference, last_level_cache_bytes

from refmath import kernels

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - the benchmark still runs without its torch column
    torch = None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072],
                        help="context lengths T (cached tokens)")
    parser.add_argument("--heads", type=int, default=32, help="query heads H")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads G")
    parser.add_argument("--dim", type=int, default=128, help="head width D")
    parser.add_argument("--page-size", type=int, nargs="+", default=[16],
                        help="slots per page; one paged peer per size")
    parser.add_argument("--pages-in-order", action="store_true",
                        help="also time each page size with the pages in order in the pool, "
                             "besides the random placement")
    parser.add_argument("--narrow", action="store_true",
                        help="run refmath's 8-lane (AVX2) kernels even where the CPU has AVX-512")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed calls per peer (median and minimum printed)")
    parser.add_argument("--probe-gib", type=float, default=1.0, help="size of the bandwidth probe")
    parser.add_argument("--evict-mib", type=float, default=None,
                        help="memory read before every timed call, so each starts with a cold "
                             "cache (0: none; default: 1.5 times the last-level cache)")
    parser.add_argument("--evict-by", choices=("numpy", "stream_sum"), default="numpy",
                        help="the eviction's reader: numpy, one thread, nobody's pool (neutral); "
                             "stream_sum, refmath's own threads (the old form, for comparison)")
    parser.add_argument("--pools", choices=("calls", "awake", "asleep"), default="calls",
                        help="calls: an untimed call of the same peer before the eviction; "
                             "awake: wake each peer's own thread pool with a tiny call after the "
                             "eviction; asleep: neither")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="wall: wall-clock time; thread: the CPU time of the calling thread "
                             "(one thread only), which leaves out the time other processes hold "
                             "the core")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of a few seconds: T = 4096, 3 calls, a 256 MiB probe")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.repeats, args.probe_gib = [4096], 3, 0.25
    if args.repeats < 1 or any(t < 1 for t in args.contexts):
        parser.error("--repeats and --contexts must be positive")
    if any(p < 1 for p in args.page_size):
        parser.error("--page-size must be positive")
    args.page_size = list(dict.fromkeys(args.page_size))  # each size once, in the order given
    if args.evict_mib is None:
        llc = last_level_cache_bytes()
        args.evict_mib = 1.5 * llc / 2**20 if llc else 128.0
    if args.evict_mib < 0:
        parser.error("--evict-mib must be >= 0")
    if args.heads % args.kv_heads:
        parser.error("--kv-heads must divide --heads")
    if args.clock == "thread" and kernels.cpu_threads() != 1:
        parser.error(f"--clock thread times the calling thread alone: run on one thread "
                     f"(OMP_NUM_THREADS=1), not {kernels.cpu_threads()}")
    return args


def read_bandwidth(gib: float, repeats: int) -> float:
    """Bytes per second of a multi-threaded streaming read (refmath.kernels.stream_sum)."""
    x = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    ms = best_ms(lambda: kernels.stream_sum(x), repeats)
    return x.nbytes / (ms * 1e-3)


LABELS = {"read": "read (stream_sum)", "contiguous": "refmath contiguous",
          "torch grouped": "torch grouped (best)", "torch enable_gqa": "torch enable_gqa"}


def paged_name(page_size: int, in_order: bool = False) -> str:
    return f"refmath paged p={page_size}" + (" in order" if in_order else "")


def paged_read_name(page_size: int) -> str:
    return f"read p={page_size} (stream_sum)"


def page_orders(args) -> tuple:
    """The placements of each page size: scattered, and with --pages-in-order in order too."""
    return (False, True) if args.pages_in_order else (False,)


def paged_names(args) -> list[str]:
    """Every paged peer of the run, in the order of the table."""
    return [paged_name(p, o) for p in args.page_size for o in page_orders(args)]


def before_each(args, peers):
    """The untimed work before every timed call of peer ``name``: with --pools calls, the same
    peer's own call; the eviction; with --pools awake, a tiny call that wakes its pool."""
    if args.evict_by == "stream_sum":
        other = np.ones(int(args.evict_mib * 2**20) // 4, dtype=np.float32)
        evict = (lambda: kernels.stream_sum(other)) if other.size else None
    else:
        evict = neutral_reader(args.evict_mib)
    small = np.ones(2**16, np.float32)  # 256 KiB: wakes a pool, evicts nothing that matters
    small_t = torch.from_numpy(small) if torch is not None else None

    def before(name):
        if args.pools == "calls":
            peers[name]()
        if evict is not None:
            evict()
        if args.pools == "awake":
            if not name.startswith("torch"):
                kernels.stream_sum(small)
            else:
                small_t.sum()
    return before


def main(argv=None):
    args = parse_args(argv)
    if not kernels.cpu_available():
        raise SystemExit("refmath._C is not built: run pip install -e . first")
    threads = kernels.cpu_threads()
    if torch is not None:
        torch.set_num_threads(threads)
    print(machine_line(threads))
    print(f"{load_average()}; OpenMP wait policy: {kernels.OPENMP_WAIT}")
    print(choose_vector_width(args.narrow))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)" if torch is not None
          else "torch is not installed: its columns are missing")
    bandwidth = read_bandwidth(args.probe_gib, 3)
    print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s (refmath.kernels.stream_sum over "
          f"{args.probe_gib:g} GiB, {threads} thread(s), best of 3)")
    h, g, d = args.heads, args.kv_heads, args.dim
    rng = np.random.default_rng(0)
    peers = {}  # the calls of the context being timed (before_each reads it)
    before = before_each(args, peers)
    rows, ratio_rows = [], []
    for t in args.contexts:
        q = rng.standard_normal((1, h, d)).astype(np.float32)
        k, v = (rng.standard_normal((1, g, t, d)).astype(np.float32) for _ in range(2))
        lengths = np.array([t])
        peers.clear()
        # the reference's own eviction is off: before() evicts ahead of every peer alike
        peers["read"] = ReadReference(arrays=(k, v), evict_mib=0).read
        peers["contiguous"] = lambda: kernels.decode(q, k, v, lengths)
        outputs = {}
        for p in args.page_size:
            for in_order in page_orders(args):
                pages = paged_copy(k, v, p, rng, in_order)
                peers[paged_name(p, in_order)] = outputs[paged_name(p, in_order)] = (
                    lambda pages=pages: kernels.paged_decode(q, *pages, lengths))
                if not in_order:
                    k_pages, v_pages, table = pages
                    peers[paged_read_name(p)] = ReadReference(
                        arrays=(k_pages, v_pages), order=table[0], evict_mib=0).read
        if torch is not None:
            tk, tv = torch.from_numpy(k), torch.from_numpy(v)
            tq_gqa = torch.from_numpy(q)[:, :, None]                    # (1, H, 1, D)
            tq_grouped = torch.from_numpy(q).view(1, g, h // g, d)     # (1, G, H/G, D)
            peers["torch grouped"] = lambda: F.scaled_dot_product_attention(tq_grouped, tk, tv)
            peers["torch enable_gqa"] = lambda: F.scaled_dot_product_attention(
                tq_gqa, tk, tv, enable_gqa=True)
            outputs["torch grouped"] = lambda: peers["torch grouped"]().reshape(1, h, d).numpy()
            outputs["torch enable_gqa"] = lambda: peers["torch enable_gqa"]()[:, :, 0].numpy()
        ours = np.asarray(peers["contiguous"]())
        worst = max(float(np.abs(np.asarray(f()) - ours).max()) for f in outputs.values())
        if worst > 1e-4:
            raise SystemExit(f"T={t}: the peers disagree with refmath's decode by {worst:.1e}")
        times = rotated_times(peers, args.repeats, before=before,
                              clock=time.thread_time if args.clock == "thread" else time.perf_counter)
        ms = {name: median_min_ms(s) for name, s in times.items()}
        kv_bytes = k.nbytes + v.nbytes
        ceiling = kv_bytes / (ms["read"][0] * 1e-3)
        for name, (med, low) in ms.items():
            rate = kv_bytes / (med * 1e-3)
            vs = ("-" if name.startswith("read") else
                  f"{med / ms['contiguous'][0]:.2f} ({low / ms['contiguous'][1]:.2f})")
            rows.append([t, LABELS.get(name, name), f"{med:.2f}", f"{low:.2f}", f"{rate / 1e9:.1f}",
                         f"{100 * rate / ceiling:.0f}%", vs])
        ratio = [t, f"{kv_bytes / 2**20:.0f}"]
        for name in paged_names(args):
            paged = ms[name]
            ratio.append(f"{paged[0] / ms['contiguous'][0]:.2f} ({paged[1] / ms['contiguous'][1]:.2f})")
        for p in args.page_size:  # the paged kernel against its floor, the read of its pages
            floor = ms[paged_read_name(p)]
            ratio.append(f"{ms[paged_name(p)][0] / floor[0]:.2f} ({ms[paged_name(p)][1] / floor[1]:.2f})")
        for p in args.page_size:  # what the scattered placement costs a plain read
            read_p = ms[paged_read_name(p)]
            ratio.append(f"{read_p[0] / ms['read'][0]:.2f} ({read_p[1] / ms['read'][1]:.2f})")
        for name in ("torch grouped", "torch enable_gqa"):
            ratio.append(f"{ms[name][0] / ms['contiguous'][0]:.2f} ({ms[name][1] / ms['contiguous'][1]:.2f})"
                         if name in ms else "-")
        ratio_rows.append(ratio)
        print(f"  T={t} done (largest difference from refmath's output {worst:.1e})", flush=True)
        peers.clear()
        outputs.clear()
        del k, v
    print()
    evicted = (f"each after an untimed read of {args.evict_mib:g} MiB of other memory by "
               + ("NumPy on one thread (neutral)" if args.evict_by == "numpy"
                  else "refmath's stream_sum on its own threads (the old, non-neutral eviction)")
               if args.evict_mib else "warm cache")
    pools = {"calls": "each timed call preceded, before the eviction, by an untimed call of the "
                      "same peer",
             "awake": "each peer's thread pool woken by a tiny call of its own just before",
             "asleep": "thread pools not woken"}[args.pools]
    print_table(["T", "peer", "median ms", "min ms", "GB/s", "of read", "time / refmath"], rows,
                title=f"decode, B=1 H={h} G={g} D={d}, float32, page sizes "
                      f"{', '.join(map(str, args.page_size))}, {threads} thread(s); "
                      f"{args.repeats} calls per peer in rotating turns, {evicted}; {pools}; "
                      + ("times: CPU time of the calling thread. " if args.clock == "thread"
                         else "times: wall clock. ") +
                      "GB/s and 'of read' from the median; 'of read': of the stream_sum row (the "
                      "same K and V, same turns); time / refmath: median (minimum) over refmath "
                      "contiguous's")
    print()
    paged_columns = [f"{name.removeprefix('refmath ')} / contiguous" for name in paged_names(args)]
    floor_columns = [f"paged p={p} / read p={p}" for p in args.page_size]
    read_columns = [f"read p={p} / read" for p in args.page_size]
    print_table(["T", "K+V MiB", *paged_columns, *floor_columns, *read_columns,
                 "torch grouped / refmath", "torch enable_gqa / refmath"], ratio_rows,
                title="time ratios, median (minimum); above 1 refmath's contiguous decode is faster "
                      "(torch grouped is torch at its best); paged p=N / read p=N: the paged "
                      "kernel over a plain read of its scattered pages (its floor); read p=N / "
                      "read: the time a plain read of the scattered pages takes over the time of "
                      "one of the caches")
    print(load_average() + " at the end")


if __name__ == "__main__":
    main()
