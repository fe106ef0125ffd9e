"""A decode step's weight products at batch 1: refmath.kernels.rows_matmul against NumPy's BLAS,
both against the machine's read bandwidth.

Every decode step multiplies one row by every weight matrix of the model: two FLOPs per weight
read, so the products run at the speed the weights stream from memory. The script builds the
matrices of --layers layers of the small Llama shape of benchmarks/generate.py (width 768, query
768, key and value 256 each, SwiGLU 2048: 7 matrices, 6.3M float32 weights per layer; about 290
MiB for 12 layers, far more than the last-level cache, so every pass reads memory) and times one
pass over all of them, as a decode step makes it:

* rows_matmul, grouped: one call per layer's Q/K/V, output, gate/up and down products (what a
  decode step on backend="cpu" does: refmath.fast.products.kernel_products);
* rows_matmul, one call per matrix;
* NumPy's BLAS (np.matmul into a preallocated output), one call per matrix.

--layout says how the matrices lie in memory: "stored" as refmath stores W, (in, out) rows;
"decode" as refmath.inference.weight_layout.decode_layout keeps them, the rows of W^T (torch's
(out, in), read by rows_matmul as one dot product per output); "both" (the default) times every
peer on each.

Each figure is the bytes of weights over the time of a pass, as GB/s and as a fraction of the read
bandwidth measured in the same run (refmath.kernels.stream_sum, the same threads); median and
fastest of --repeats passes. The peers run in blocks of passes (an untimed pass, then timed ones),
the order of the blocks rotating, with a pause before each block: OpenMP's threads and the BLAS
library's each keep spinning for a while after their last call, and a pass timed while the other
pool spins fights it for the cores (on 2 cores either side then loses most of its speed).

    python benchmarks/rows_matmul.py --threads 1 2
    python benchmarks/rows_matmul.py --threads 2 --layout decode
    python benchmarks/rows_matmul.py --quick
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from _common import call_seconds, load_average, median_min_ms

from refmath import kernels

# (k, n) of one layer's matrices, in a decode step's order: q, k, v, o, gate, up, down
LAYER = [(768, 768), (768, 256), (768, 256), (768, 768), (768, 2048), (768, 2048), (2048, 768)]
GROUPS = [(0, 1, 2), (3,), (4, 5), (6,)]  # the products a decode step makes in one call each


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=15, help="timed passes of each peer")
    parser.add_argument("--block", type=int, default=5, help="timed passes per block")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="thread counts (BLAS and OpenMP alike; default: as started)")
    parser.add_argument("--layout", choices=("stored", "decode", "both"), default="both",
                        help="the matrices as (in, out) rows, as the rows of W^T, or both")
    parser.add_argument("--quick", action="store_true", help="2 layers, 3 repeats: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.repeats, args.block = 2, 3, 3
    if min(args.layers, args.repeats, args.block) < 1 or (args.threads and min(args.threads) < 1):
        parser.error("--layers, --repeats, --block and --threads must be positive")
    return args


def read_bandwidth() -> float:
    """Bytes per second of refmath.kernels.stream_sum over 512 MiB (fastest of 3)."""
    x = np.ones(2**27, dtype=np.float32)
    return x.nbytes / min(timed_block(lambda: kernels.stream_sum(x), 3))


def timed_block(fn, passes: int, pause: float = 0.05) -> list:
    """Seconds of ``passes`` timed calls of ``fn`` after a pause (the other pool's threads stop
    spinning) and one untimed call (this pool's threads wake up)."""
    time.sleep(pause)
    return call_seconds(fn, passes, warmup=1)


def blocked_times(fns: dict, repeats: int, block: int) -> dict:
    """``{name: [seconds, ...]}``, ``repeats`` passes each, in blocks of ``block`` whose order
    rotates (a b c, b c a, ...)."""
    names, times = list(fns), {name: [] for name in fns}
    r = 0
    while min(len(t) for t in times.values()) < repeats:
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name] += timed_block(fns[name], min(block, repeats - len(times[name])) or 1)
        r += 1
    return {name: t[:repeats] for name, t in times.items()}


LAYOUTS = {"stored": "(in, out) rows", "decode": "W^T rows"}


def peers(layers: int, layouts: tuple):
    """The peers on each layout: ``({name: pass}, bytes of weights per pass)``."""
    rng = np.random.default_rng(0)
    stored = [[rng.standard_normal(shape, dtype=np.float32) for shape in LAYER]
              for _ in range(layers)]
    outs = [[np.empty((1, n), np.float32) for _, n in LAYER] for _ in range(layers)]
    xs = {k: rng.standard_normal((1, k), dtype=np.float32) for k in {k for k, _ in LAYER}}
    fns = {}
    for layout in layouts:
        ws = stored if layout == "stored" else [[np.ascontiguousarray(w.T).T for w in layer]
                                                for layer in stored]

        def grouped(ws=ws):
            for w, o in zip(ws, outs):
                for group in GROUPS:
                    kernels.rows_matmul_many(xs[w[group[0]].shape[0]], [w[j] for j in group],
                                             [o[j] for j in group])

        def one_call_each(ws=ws):
            for w, o in zip(ws, outs):
                for wj, oj in zip(w, o):
                    kernels.rows_matmul(xs[wj.shape[0]], wj, oj)

        def blas(ws=ws):
            for w, o in zip(ws, outs):
                for wj, oj in zip(w, o):
                    np.matmul(xs[wj.shape[0]], wj, out=oj)

        where = f", {LAYOUTS[layout]}"
        fns.update({"rows_matmul, grouped" + where: grouped,
                    "rows_matmul, one call each" + where: one_call_each,
                    "NumPy BLAS" + where: blas})
    nbytes = sum(wj.nbytes for w in stored for wj in w)
    return fns, nbytes


def run(layers: int, repeats: int, block: int, layouts: tuple) -> None:
    bandwidth = read_bandwidth()
    fns, nbytes = peers(layers, layouts)
    times = blocked_times(fns, repeats, block)
    print(f"  read bandwidth {bandwidth / 1e9:.1f} GB/s; {layers} layers, "
          f"{nbytes / 2**20:.0f} MiB of weights per pass")
    for name, seconds in times.items():
        median, fastest = median_min_ms(seconds)
        rate, top = nbytes / median * 1e3, nbytes / fastest * 1e3
        print(f"  {name:44s} {median:7.2f} ms ({fastest:6.2f})  {rate / 1e9:5.1f} GB/s "
              f"({top / 1e9:5.1f})  {rate / bandwidth:4.0%} of read ({top / bandwidth:4.0%})")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not kernels.cpu_available():
        raise SystemExit("refmath._C is not built: pip install -e . first")
    from threadpoolctl import threadpool_limits

    print(f"{load_average()}; refmath's CPU kernels: {kernels.cpu_vector_lanes()} float32 lanes")
    print("median ms per pass (fastest); GB/s of weights; fraction of the read bandwidth")
    for threads in args.threads or [None]:
        with threadpool_limits(limits=threads):
            print(f"threads: {threads or 'as started'} (OpenMP {kernels.cpu_threads()})")
            run(args.layers, args.repeats, args.block,
                tuple(LAYOUTS) if args.layout == "both" else (args.layout,))
    print(f"{load_average()} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
