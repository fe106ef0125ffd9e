"""Two or more builds of refmath's compiled module, loaded side by side in one process, timed in
paired turns on the stored-format products or the decode kernels: how a kernel change is measured
on a machine whose speed moves from minute to minute.

Each BUILD is a source tree with its compiled module built in place (``python setup.py
build_ext --inplace``, e.g. a ``git worktree`` of the commit before a change). Each module is
loaded under its own name, so the builds run the same calls on the same arrays in the same turns,
whose order changes every round (``_common.rotated_times``); a slower or faster minute of the
machine then falls on every build alike, and the ratio of each build's time to the first build's
is taken round by round (its median printed as "paired").

``--workload formats`` (the default), two workloads per stored format:

* memory: one matrix product after another over a small Llama's layer matrices (24 layers of
  2048 x 768, 768 x 2048 and 768 x 768), 1 row of x: about twice the last-level cache, read from
  memory, as a decode step reads them; beside it a plain read of the same bytes (stream_sum);
* cache: the first layer's three matrices, 20 times over, timed per pass (in the caches).

``--workload decode``: one decode step (B = 1, H = 32, G = 8, D = 128, float32) over a contiguous
cache of ``--context`` keys and over the same keys in pages (``--page-size``, 16) scattered through
a pool (_common.paged_copy, the page table a random permutation), beside a plain read of the
same bytes (stream_sum) and a plain read of the pages in the page table's order (stream_sum_rows,
the paged decode's floor). Each call reads K and V once (256 MiB at the default 32k keys),
several times a server's last-level cache, so it starts cold without an eviction; the largest
difference of each build's output from build [0]'s is printed, so a change that moves the bits
shows it.

One thread by default (--threads 1). With more, each build's piece team keeps its own helper
threads, which spin for 0.1 ms after a call before they sleep, and the OpenMP runtime the builds
share waits passively (load_builds): at 2 threads on a 2-core Zen 4 VM two identical builds then
timed 1.00x of each other in the decode workload.

    python benchmarks/paired_builds.py ../before .
    python benchmarks/paired_builds.py ../before . --rounds 11 --lanes 8 --formats q8_0
    python benchmarks/paired_builds.py ../before . --workload decode --context 131072

Nothing is asserted: the figures belong to the machine and its load (printed first and last).
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import statistics
import sys

import numpy as np
from _common import load_average, paged_copy, rotated_times

LAYER = [(2048, 768), (768, 2048), (768, 768)]
LAYERS = 24
CACHE_PASSES = 20
DECODE_HEADS, DECODE_KV_HEADS, DECODE_DIM = 32, 8, 128


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", metavar="BUILD",
                        help="source trees with refmath/_C*.so built in place; the first is the "
                             "baseline every ratio is taken against")
    parser.add_argument("--rounds", type=int, default=9, help="paired rounds (default 9)")
    parser.add_argument("--threads", type=int, default=1, help="kernel threads (default 1)")
    parser.add_argument("--lanes", type=int, choices=(8, 16), default=None,
                        help="vector lanes for every build (default: the widest the CPU has)")
    parser.add_argument("--workload", choices=("formats", "decode"), default="formats",
                        help="formats: the stored-format products; decode: the decode kernels, "
                             "contiguous and paged (default formats)")
    parser.add_argument("--formats", default="bf16,f16,q8_0",
                        help="comma-separated stored formats (default bf16,f16,q8_0)")
    parser.add_argument("--context", type=int, default=32768,
                        help="decode: cached keys T, a multiple of --page-size (default 32768)")
    parser.add_argument("--page-size", type=int, default=16,
                        help="decode: slots per page (default 16)")
    args = parser.parse_args(argv)
    if len(args.builds) < 2:
        parser.error("give at least two builds to compare")
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads must be at least 1")
    if args.page_size < 1 or args.context < args.page_size or args.context % args.page_size:
        parser.error(f"--context ({args.context}) must be a positive multiple of --page-size "
                     f"({args.page_size})")
    return args


def compiled_file(tree: str) -> str:
    """The compiled module built in place in one source tree."""
    found = sorted(glob.glob(os.path.join(tree, "refmath", "_C*.so")))
    if not found:
        raise SystemExit(f"{tree}: no refmath/_C*.so; build it in place first "
                         f"(python setup.py build_ext --inplace)")
    return found[0]


def load_build(path: str, index: int):
    """The compiled module at ``path``, under a name of its own."""
    spec = importlib.util.spec_from_file_location(f"build{index}._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def load_builds(files: list) -> tuple[list, str]:
    """The builds' modules, and the OpenMP wait policy they run with: passive, as refmath.kernels
    sets it, unless the environment chooses one. The plain reads (build [0]'s stream_sum) run on
    OpenMP threads, and a thread still spinning after its turn slows the turn after it: at 2
    threads, in turns that rotated without reversing (so build [0]'s first turn always came after
    the reads), build [0]'s contiguous decode took 1.19-1.35x the time of the same code in the two
    builds beside it, and 1.00x with the wait passive (2-core Zen 4 VM)."""
    chosen = [f"{name}={os.environ[name]}" for name in WAIT_VARIABLES if os.environ.get(name)]
    if chosen:
        return [load_build(f, i) for i, f in enumerate(files)], ", ".join(chosen)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read once, when the first build loads the runtime
    try:
        return [load_build(f, i) for i, f in enumerate(files)], "OMP_WAIT_POLICY=passive"
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


def paired(times: list, i: int, what: str) -> float:
    """The median over rounds of build [0]'s time over build [i]'s, for the timings ``what``."""
    return statistics.median(np.array(times[0][what]) / np.array(times[i][what]))


def time_formats(builds, args) -> None:
    """The stored-format products, from memory and in the caches (--workload formats)."""
    from refmath import weight_formats as wf  # the NumPy side only: rounding to each format

    print(f"memory: {LAYERS} layers of {LAYER} in turn, 1 row of x; cache: the first layer's 3 "
          f"matrices, {CACHE_PASSES} passes")
    rng = np.random.default_rng(0)
    shapes = LAYER * LAYERS
    xs = {k: rng.standard_normal((1, k), dtype=np.float32) for k in {s[1] for s in shapes}}
    outs = [np.empty((1, n), np.float32) for n, _ in shapes]
    for fmt in args.formats.split(","):
        if fmt not in wf.FORMATS:
            raise SystemExit(f"unknown format {fmt!r}; choose from {wf.FORMATS}")
        mats = [wf.quantize(rng.standard_normal(s, dtype=np.float32), fmt) for s in shapes]
        nbytes = sum(m.nbytes for m in mats)
        cache_bytes = sum(m.nbytes for m in mats[:len(LAYER)])
        plain = np.ones(nbytes // 4, np.float32)

        def products(module, count):
            for m, (_, k), out in zip(mats[:count], shapes, outs):
                module.format_rows_matmul(xs[k], m, fmt, out)

        def cache_passes(module):
            for _ in range(CACHE_PASSES):
                products(module, len(LAYER))

        sides = {}
        for i, module in enumerate(builds):
            sides[f"memory {i}"] = lambda module=module: products(module, len(mats))
            sides[f"cache {i}"] = lambda module=module: cache_passes(module)
        # The read through the first build's module: importing refmath.kernels (and with it
        # _bandwidth.ReadReference) would load a third copy of the module under its own name.
        sides["read"] = lambda: builds[0].stream_sum(plain)
        seconds = rotated_times(sides, args.rounds)
        times = [{"memory": seconds[f"memory {i}"],
                  "cache": [s / CACHE_PASSES for s in seconds[f"cache {i}"]]}
                 for i in range(len(builds))]
        read = statistics.median(seconds["read"])
        print(f"\n{fmt}: {nbytes / 2**20:.0f} MiB from memory, plain read "
              f"{nbytes / read / 1e9:.1f} GB/s (median of {args.rounds})")
        for i, t in enumerate(times):
            mem, cache = statistics.median(t["memory"]), statistics.median(t["cache"])
            line = (f"  [{i}] memory {nbytes / mem / 1e9:5.1f} GB/s ({read / mem:4.0%} of the "
                    f"read), cache {cache_bytes / cache / 1e9:5.1f} GB/s")
            if i > 0:
                line += (f"; paired x{paired(times, i, 'memory'):.3f} memory, "
                         f"x{paired(times, i, 'cache'):.3f} cache")
            print(line, flush=True)


def time_decode(builds, args) -> None:
    """One decode step, contiguous and paged, beside the plain reads (--workload decode)."""
    h, g, d, t = DECODE_HEADS, DECODE_KV_HEADS, DECODE_DIM, args.context
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, h, d), dtype=np.float32)
    k = rng.standard_normal((1, g, t, d), dtype=np.float32)
    v = rng.standard_normal((1, g, t, d), dtype=np.float32)
    lengths = np.array([t], np.int32)
    k_pages, v_pages, table = paged_copy(k, v, args.page_size, rng)
    scale = 1.0 / np.sqrt(d)
    nbytes = k.nbytes + v.nbytes
    print(f"decode: B=1 H={h} G={g} D={d}, T={t}, float32, {nbytes / 2**20:.0f} MiB of K and V; "
          f"paged: pages of {args.page_size} scattered through the pool; read: stream_sum of K "
          f"and V; read paged: stream_sum_rows of the pools in the page table's order")

    sides, outputs = {}, []
    for i, module in enumerate(builds):
        sides[f"contiguous {i}"] = lambda m=module: m.decode(q, k, v, lengths, scale, 0)
        sides[f"paged {i}"] = lambda m=module: m.paged_decode(
            q, k_pages, v_pages, table, lengths, scale, 0)
        outputs.append((sides[f"contiguous {i}"](), sides[f"paged {i}"]()))
    pool_rows = [pool.reshape(len(k_pages), -1) for pool in (k_pages, v_pages)]
    sides["read"] = lambda: (builds[0].stream_sum(k), builds[0].stream_sum(v))
    sides["read paged"] = lambda: [builds[0].stream_sum_rows(rows, table[0]) for rows in pool_rows]
    seconds = rotated_times(sides, args.rounds)
    read = statistics.median(seconds["read"])
    read_paged = statistics.median(seconds["read paged"])
    print(f"\nplain read {nbytes / read / 1e9:.1f} GB/s, of the pages in table order "
          f"{nbytes / read_paged / 1e9:.1f} GB/s ({read_paged / read:.3f}x the time; medians of "
          f"{args.rounds})")
    times = [{w: seconds[f"{w} {i}"] for w in ("contiguous", "paged")}
             for i in range(len(builds))]
    for i, tm in enumerate(times):
        whole, pages = (statistics.median(tm[w]) for w in ("contiguous", "paged"))
        line = (f"  [{i}] contiguous {nbytes / whole / 1e9:5.1f} GB/s ({read / whole:4.0%} of the "
                f"read), paged {nbytes / pages / 1e9:5.1f} GB/s ({read_paged / pages:4.0%} of the "
                f"paged read), paged / contiguous {pages / whole:.3f}x")
        if i > 0:
            diff = max(float(np.abs(a - b).max()) for a, b in zip(outputs[0], outputs[i]))
            line += (f"; paired x{paired(times, i, 'contiguous'):.3f} contiguous, "
                     f"x{paired(times, i, 'paged'):.3f} paged; largest difference from [0]'s "
                     f"output {diff:.1e}")
        print(line, flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    files = [compiled_file(tree) for tree in args.builds]
    for i, f in enumerate(files):
        for j in range(i):
            if os.path.samefile(f, files[j]):  # the loader would hand back build j's module
                raise SystemExit(f"{args.builds[i]}: its compiled module is the same file as "
                                 f"build [{j}]'s; copy the tree to time a build twice")
    builds, wait = load_builds(files)
    for module in builds:
        module.set_threads(args.threads)
        if args.lanes is not None:
            module.set_wide_vectors(args.lanes == 16)
    print(f"{load_average()}; {args.threads} thread(s), OpenMP wait: {wait}; "
          f"{builds[0].vector_lanes()} lanes; builds: " +
          ", ".join(f"[{i}] {os.path.abspath(t)}" for i, t in enumerate(args.builds)))
    print(f"{args.rounds} paired rounds, the turns' order rotated and reversed in turn; paired: "
          f"the median over rounds of build [0]'s time over this build's (above 1: faster than "
          f"[0])")
    if args.workload == "decode":
        time_decode(builds, args)
    else:
        time_formats(builds, args)
    print(f"\n{load_average()} at the end")


if __name__ == "__main__":
    sys.exit(main())
