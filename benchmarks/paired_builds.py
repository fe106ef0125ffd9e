"""Two or more builds of refmath's compiled module, loaded side by side in one process, timed in
paired turns on the stored-format products: how a kernel change is measured on a machine whose
speed moves from minute to minute.

Each BUILD is a source tree with its compiled module built in place (``python setup.py
build_ext --inplace``, e.g. a ``git worktree`` of the commit before a change). Each module is
loaded under its own name, so the builds run the same calls on the same arrays in the same turns,
whose order rotates every round (``_common.rotated_times``); a slower or faster minute of the
machine then falls on every build alike, and the ratio of each build's time to the first build's
is taken round by round (its median printed as "paired"). Two workloads per format:

* memory: one matrix product after another over a small Llama's layer matrices (24 layers of
  2048 x 768, 768 x 2048 and 768 x 768), 1 row of x: about twice the last-level cache, read from
  memory, as a decode step reads them; beside it a plain read of the same bytes (stream_sum);
* cache: the first layer's three matrices, 20 times over, timed per pass (in the caches).

One thread only (--threads 1 is the default): each build's piece team keeps its own helper
threads, and a helper still spinning after its build's turn would slow the next build's.

    python benchmarks/paired_builds.py ../before .
    python benchmarks/paired_builds.py ../before . --rounds 11 --lanes 8 --formats q8_0

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
from _common import load_average, rotated_times

LAYER = [(2048, 768), (768, 2048), (768, 768)]
LAYERS = 24
CACHE_PASSES = 20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", metavar="BUILD",
                        help="source trees with refmath/_C*.so built in place; the first is the "
                             "baseline every ratio is taken against")
    parser.add_argument("--rounds", type=int, default=9, help="paired rounds (default 9)")
    parser.add_argument("--threads", type=int, default=1, help="kernel threads (default 1)")
    parser.add_argument("--lanes", type=int, choices=(8, 16), default=None,
                        help="vector lanes for every build (default: the widest the CPU has)")
    parser.add_argument("--formats", default="bf16,f16,q8_0",
                        help="comma-separated stored formats (default bf16,f16,q8_0)")
    args = parser.parse_args(argv)
    if len(args.builds) < 2:
        parser.error("give at least two builds to compare")
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads must be at least 1")
    return args


def load_build(tree: str, index: int):
    """The compiled module of one source tree, under a name of its own."""
    found = sorted(glob.glob(os.path.join(tree, "refmath", "_C*.so")))
    if not found:
        raise SystemExit(f"{tree}: no refmath/_C*.so; build it in place first "
                         f"(python setup.py build_ext --inplace)")
    spec = importlib.util.spec_from_file_location(f"build{index}._C", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    args = parse_args(argv)
    builds = [load_build(tree, i) for i, tree in enumerate(args.builds)]
    for module in builds:
        module.set_threads(args.threads)
        if args.lanes is not None:
            module.set_wide_vectors(args.lanes == 16)
    from refmath import weight_formats as wf  # the NumPy side only: rounding to each format

    print(f"{load_average()}; {args.threads} thread(s); "
          f"{builds[0].vector_lanes()} lanes; builds: " +
          ", ".join(f"[{i}] {os.path.abspath(t)}" for i, t in enumerate(args.builds)))
    print(f"{args.rounds} paired rounds, the turns' order rotating every round; memory: "
          f"{LAYERS} layers of {LAYER} in turn, 1 row of x; cache: the first layer's 3 matrices, "
          f"{CACHE_PASSES} passes; paired: the median over rounds of build [0]'s time over this "
          f"build's (above 1: faster than [0])")
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
                paired = [statistics.median(np.array(times[0][w]) / np.array(t[w]))
                          for w in ("memory", "cache")]
                line += f"; paired x{paired[0]:.3f} memory, x{paired[1]:.3f} cache"
            print(line, flush=True)
    print(f"\n{load_average()} at the end")


if __name__ == "__main__":
    sys.exit(main())
