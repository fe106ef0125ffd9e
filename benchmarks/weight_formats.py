"""A few rows times a weight matrix stored as float32, bf16, f16 or Q8_0: the time of each product
against a plain read of the bytes its format stores, and its error against the float32 product.

For each --shape n k, a random float32 matrix (n outputs of k inputs, a Linear's weight) is
rounded to each format by refmath.weight_formats, and --rows rows of x are multiplied by it:
float32 by refmath.kernels.rows_matmul (the matrix read as the rows of W^T, the decode layout),
the others by refmath.kernels.format_rows_matmul, both summing in float32. Each format's
reference (benchmarks/_bandwidth.py) is a plain read of exactly the bytes the format stores, with
stream_sum on the same threads (--threads sets the kernels' count). Every timed call, products and reads alike, starts after an
untimed one-thread NumPy read of --evict-mib of other memory (default 1.5 times the last-level
cache), so each finds its bytes in memory; the sides take turns in rotating order.

Columns: median and fastest ms, the bytes per second of the median, that as a fraction of the
format's own read ("of read"), the time over float32's ("time / f32"), and the largest error
against the float64 product with the float32 weights, relative to the largest |x| |W|^T.

    python benchmarks/weight_formats.py
    python benchmarks/weight_formats.py --shape 4096 4096 --shape 11008 4096 --rows 1 4
    python benchmarks/weight_formats.py --threads 1 2
    python benchmarks/weight_formats.py --quick

Nothing is asserted: the figures belong to the machine and its load (printed first and last).
"""
from __future__ import annotations

import argparse

import numpy as np
from _bandwidth import ReadReference, default_evict_mib
from _common import load_average, median_min_ms, neutral_reader, print_table, rotated_times

from refmath import kernels
from refmath import weight_formats as wf

FORMATS = ("f32",) + wf.FORMATS


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=2, action="append", metavar=("N", "K"),
                        help="outputs and inputs of the matrix (repeatable; default 4096 4096)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="rows of x")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per side")
    parser.add_argument("--evict-mib", type=float, default=None,
                        help="memory read before every timed call (default: 1.5 times the "
                             "last-level cache; 0: warm)")
    parser.add_argument("--threads", type=int, nargs="+", default=[None],
                        help="kernel thread counts to run at (default: the kernels' own count)")
    parser.add_argument("--quick", action="store_true", help="a small matrix, 3 calls per side")
    args = parser.parse_args(argv)
    if args.quick:
        args.shape, args.repeats = [[256, 1024]], 3
    args.shape = args.shape or [[4096, 4096]]
    if args.repeats < 1 or min(args.rows) < 1 or min(min(s) for s in args.shape) < 1:
        parser.error("--repeats, --rows and --shape must be positive")
    if any(t is not None and t < 1 for t in args.threads):
        parser.error("--threads must be positive")
    if any(k % wf.BLOCK for _, k in args.shape):
        parser.error(f"K must be a multiple of {wf.BLOCK} (whole Q8_0 blocks)")
    if args.evict_mib is None:
        args.evict_mib = default_evict_mib()
    return args


def run_shape(n: int, k: int, m: int, args, rows: list) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    scale = float((np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T).max())
    stored = {"f32": w, **{f: wf.quantize(w, f) for f in wf.FORMATS}}
    sides, errors, nbytes = {}, {}, {}
    for fmt, s in stored.items():
        product = ((lambda: kernels.rows_matmul(x, w.T)) if fmt == "f32" else
                   (lambda s=s, fmt=fmt: kernels.format_rows_matmul(x, s, fmt)))
        errors[fmt] = float(np.abs(product() - exact).max()) / scale
        sides[fmt] = product
        nbytes[fmt] = s.nbytes
        sides[f"read {fmt}"] = ReadReference(s.nbytes, evict_mib=0).read  # before() evicts
    evict = neutral_reader(args.evict_mib)
    times = rotated_times(sides, args.repeats, before=lambda name: evict and evict())
    ms = {name: median_min_ms(t) for name, t in times.items()}
    for fmt in FORMATS:
        med, low = ms[fmt]
        rate = nbytes[fmt] / (med * 1e-3)
        rows.append([f"{n} x {k}", m, kernels.cpu_threads(), fmt, f"{nbytes[fmt] / 2**20:.1f}", f"{med:.3f}", f"{low:.3f}",
                     f"{rate / 1e9:.1f}", f"{100 * ms['read ' + fmt][0] / med:.0f}%",
                     f"{med / ms['f32'][0]:.2f}", f"{errors[fmt]:.1e}"])


def main(argv=None) -> int:
    args = parse_args(argv)
    if not kernels.cpu_available():
        raise SystemExit("refmath._C is not built: run pip install -e . first")
    print(f"{load_average()}; OpenMP wait policy: {kernels.OPENMP_WAIT}; "
          f"{kernels.cpu_instructions()}")
    rows = []
    for threads in args.threads:
        with kernels.cpu_thread_limit(threads):
            for n, k in args.shape:
                for m in args.rows:
                    run_shape(n, k, m, args, rows)
    print_table(["matrix", "rows", "threads", "format", "MiB", "median ms", "min ms", "GB/s", "of read",
                 "time / f32", "error"], rows,
                title=f"{args.repeats} calls per side in rotating turns, each after an untimed "
                      f"read of {args.evict_mib:g} MiB of other memory by NumPy on one thread; "
                      "'of read': a plain read of the format's bytes (same turns) over the "
                      "product's time, from the medians; error: largest |y - x W^T| (float64, "
                      "float32 weights) over the largest |x| |W|^T")
    print(load_average() + " at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
