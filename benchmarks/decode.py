"""One decode step on the CPU: refmath's C++ decode kernels against the memory bandwidth and PyTorch.

A decode step reads every cached key and value once, so its speed is best read as bandwidth: bytes
of K and V read per second, next to what this machine can read at all. The ceiling is measured in
the same run by refmath.kernels.stream_sum, a C++ loop that sums a float32 array with every OpenMP thread:
a plain streaming read, nothing else. It runs twice: once over --probe-gib (far larger than the
caches of the CPU) for the header, and once per context over the very K and V arrays being decoded,
timed in turns with the peers. The second is the ceiling each row is compared with ("of bw"): it
reads the same bytes from the same place, from the same cache state (below), under the same load
from the rest of the machine.

Peers, float32, on the same number of threads:
* refmath.kernels.decode: contiguous caches (B, G, T, D), split-K chosen automatically;
* refmath.kernels.paged_decode: the same keys and values in pages of --page-size slots, the page
  table a random permutation of the pool (so consecutive pages are not neighbours in memory);
* torch.nn.functional.scaled_dot_product_attention on q (B, H, 1, D) and the contiguous caches with
  enable_gqa=True (PyTorch's own GQA, no repeated copy of K and V made by us).

Shapes: B = 1, H = 32 query heads, G = 8 key/value heads, D = 128, contexts from --contexts.

Caches: by default every timed call starts from a cold cache: an untimed stream_sum over
--evict-mib of other memory runs before it. That is the state a model's decode step finds a
layer's cache in (every other layer's cache was read since), and it keeps the peers' order from
mattering: without it, a short context (32 MiB at 4096, the size of a server's last-level cache)
is still partly cached from the peer timed just before, over the same arrays for the contiguous
decode and the bandwidth probe, but not for the paged copy. --evict-mib 0 times them warm.

    python benchmarks/decode.py
    python benchmarks/decode.py --contexts 4096 32768 --repeats 10
    OMP_NUM_THREADS=1 python benchmarks/decode.py   # every peer on one thread

Nothing is asserted: the figures depend on the machine (and on its load, printed first).
"""
from __future__ import annotations

import argparse

import numpy as np
from _common import best_ms, choose_vector_width, interleaved_best_ms, machine_line, print_table

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
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--narrow", action="store_true",
                        help="run refmath's 8-lane (AVX2) kernels even where the CPU has AVX-512")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per peer (best kept)")
    parser.add_argument("--median", action="store_true",
                        help="keep the median call of each peer instead of the best (a loaded machine)")
    parser.add_argument("--probe-gib", type=float, default=1.0, help="size of the bandwidth probe")
    parser.add_argument("--evict-mib", type=float, default=128.0,
                        help="memory read before every timed call, so each starts with a cold "
                             "cache (0: none)")
    return parser.parse_args(argv)


def read_bandwidth(gib: float, repeats: int) -> float:
    """Bytes per second of a multi-threaded streaming read (refmath.kernels.stream_sum)."""
    x = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    ms = best_ms(lambda: kernels.stream_sum(x), repeats)
    return x.nbytes / (ms * 1e-3)


def paged_copy(k, v, page_size, rng):
    """The caches (1, G, T, D) cut into pages (n_pages, G, p, D) at random places in the pool."""
    _, g, t, d = k.shape
    n = -(-t // page_size)
    order = rng.permutation(n)  # logical page i lives in physical page order[i]
    k_pages = np.zeros((n, g, page_size, d), np.float32)
    v_pages = np.zeros_like(k_pages)
    for i in range(n):
        filled = min(page_size, t - i * page_size)
        k_pages[order[i], :, :filled] = k[0, :, i * page_size: i * page_size + filled]
        v_pages[order[i], :, :filled] = v[0, :, i * page_size: i * page_size + filled]
    return k_pages, v_pages, order[None, :].astype(np.int32)


def main(argv=None):
    args = parse_args(argv)
    if not kernels.cpu_available():
        raise SystemExit("refmath._C is not built: run pip install -e . first")
    threads = kernels.cpu_threads()
    if torch is not None:
        torch.set_num_threads(threads)
    print(machine_line(threads))
    print(choose_vector_width(args.narrow))
    bandwidth = read_bandwidth(args.probe_gib, args.repeats)
    print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s (refmath.kernels.stream_sum over "
          f"{args.probe_gib:g} GiB, {threads} thread(s))")
    h, g, d, p = args.heads, args.kv_heads, args.dim, args.page_size
    rng = np.random.default_rng(0)
    other = np.ones(int(args.evict_mib * 2**20) // 4, dtype=np.float32)
    evict = (lambda: kernels.stream_sum(other)) if other.size else None
    rows = []
    for t in args.contexts:
        q = rng.standard_normal((1, h, d)).astype(np.float32)
        k, v = (rng.standard_normal((1, g, t, d)).astype(np.float32) for _ in range(2))
        lengths = np.array([t])
        k_pages, v_pages, table = paged_copy(k, v, p, rng)
        peers = {
            "read": lambda: (kernels.stream_sum(k), kernels.stream_sum(v)),
            "contiguous": lambda: kernels.decode(q, k, v, lengths),
            "paged": lambda: kernels.paged_decode(q, k_pages, v_pages, table, lengths),
        }
        if torch is not None:
            tq, tk, tv = torch.from_numpy(q)[:, :, None], torch.from_numpy(k), torch.from_numpy(v)
            peers["torch"] = lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        ms = interleaved_best_ms(peers, args.repeats, median=args.median, before=evict)
        kv_bytes = k.nbytes + v.nbytes
        ceiling = kv_bytes / (ms["read"] * 1e-3)
        row = [t, f"{kv_bytes / 2**20:.0f}", f"{ceiling / 1e9:.1f}"]
        for name in ("contiguous", "paged", "torch"):
            if name not in ms:
                row += ["-", "-", "-"]
                continue
            rate = kv_bytes / (ms[name] * 1e-3)
            row += [f"{ms[name]:.2f}", f"{rate / 1e9:.1f}", f"{100 * rate / ceiling:.0f}%"]
        row.append(f"{ms['contiguous'] / ms['paged']:.2f}")
        row.append(f"{ms['torch'] / ms['contiguous']:.2f}" if "torch" in ms else "-")
        rows.append(row)
        print(f"  T={t} done", flush=True)
        del k, v, k_pages, v_pages
    print()
    print_table(["T", "K+V MiB", "read GB/s", "refmath ms", "GB/s", "of bw", "paged ms", "GB/s",
                 "of bw", "torch ms", "GB/s", "of bw", "paged vs contiguous", "speed vs torch"], rows,
                title=f"decode, B=1 H={h} G={g} D={d}, float32, page size {p}, {threads} thread(s); "
                      "'of bw': of 'read GB/s', stream_sum over the same K and V in the same turns; "
                      f"{'median' if args.median else 'best'} of {args.repeats} calls, "
                      + (f"each after reading {args.evict_mib:g} MiB of other memory (cold cache)"
                         if evict else "warm cache"))


if __name__ == "__main__":
    main()
