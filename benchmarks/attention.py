"""Causal attention on the CPU: refmath's C++ FlashAttention kernel against its peers.

Peers, in the same process, float32, on the same number of threads (OpenMP's for refmath,
torch.set_num_threads for PyTorch, and NumPy's BLAS as it is):
* refmath.kernels.flash_attention_forward / _backward (the C++ kernel, csrc/flash_cpu.cpp);
* torch.nn.functional.scaled_dot_product_attention(is_causal=True) on CPU tensors (forward, and
  its backward by autograd);
* the dense NumPy reference refmath.attention.sdpa_forward with a causal mask (forward only). It
  holds the whole T x T score matrix, so it is skipped (with the reason printed) where its
  temporaries would pass --dense-limit-gib. It is timed on its own, after the other two: its
  allocations and frees of hundreds of MiB, and its BLAS threads, slow down whatever runs next to
  or right after them (by up to 1.5x for both kernels on a 2-core machine), so it is kept out of
  the turns in which refmath and PyTorch are timed against each other.

Shapes: B = 1, H = 8, D = 64 (change with --heads/--dim), T from --lengths. "speed vs torch" is
torch's time over refmath's (above 1: refmath is faster). "extra memory" is the peak growth of the
process's resident memory during one forward call beyond its output o (Linux only): for refmath the
logsumexp and the per-thread tiles, O(T); for the dense reference the score matrices, O(T^2).

    python benchmarks/attention.py
    python benchmarks/attention.py --lengths 512 1024 --repeats 5 --no-backward
    OMP_NUM_THREADS=1 python benchmarks/attention.py   # every peer on one thread

Nothing is asserted: the figures depend on the machine (and on its load, printed first).
"""
from __future__ import annotations

import argparse

import numpy as np
from _common import (best_ms, choose_vector_width, fmt_bytes, interleaved_best_ms, machine_line,
                     peak_extra_bytes, print_table)

from refmath import kernels
from refmath.attention import causal_mask, sdpa_forward

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - the benchmark still runs without its torch column
    torch = None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192],
                        help="sequence lengths T")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64, help="head width D")
    parser.add_argument("--narrow", action="store_true",
                        help="run refmath's 8-lane (AVX2) kernels even where the CPU has AVX-512")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per peer (best kept)")
    parser.add_argument("--dense-limit-gib", type=float, default=2.0,
                        help="skip the dense NumPy reference when its T x T temporaries would pass this")
    parser.add_argument("--no-backward", action="store_true", help="time the forward pass only")
    return parser.parse_args(argv)


def dense_bytes(b, h, t) -> int:
    # sdpa_forward holds the scores, their exponentials and the weights at once (float32), and the
    # causal mask (T x T) besides.
    return 3 * b * h * t * t * 4 + t * t * 4


def main(argv=None):
    args = parse_args(argv)
    if not kernels.cpu_available():
        raise SystemExit("refmath._C is not built: run pip install -e . first")
    threads = kernels.cpu_threads()
    if torch is not None:
        torch.set_num_threads(threads)
    print(machine_line(threads))
    print(choose_vector_width(args.narrow))
    b, h, d = 1, args.heads, args.dim
    rng = np.random.default_rng(0)
    rows, notes = [], []
    for t in args.lengths:
        q, k, v, do = (rng.standard_normal((b, h, t, d)).astype(np.float32) for _ in range(4))
        peers = {"refmath": lambda: kernels.flash_attention_forward(q, k, v, causal=True)}
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
            peers["torch"] = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        fwd = interleaved_best_ms(peers, args.repeats)
        extra, (o, lse) = peak_extra_bytes(peers["refmath"])
        extra = None if extra is None else max(0, extra - o.nbytes)
        dense_ok = dense_bytes(b, h, t) <= args.dense_limit_gib * 2**30
        dense_extra = None
        if dense_ok:
            mask = causal_mask(t, dtype=np.float32)
            dense = lambda: sdpa_forward(q, k, v, mask=mask)  # noqa: E731
            fwd["numpy dense"] = best_ms(dense, args.repeats)
            dense_extra, (o_dense, _) = peak_extra_bytes(dense)
            dense_extra = None if dense_extra is None else max(0, dense_extra - o_dense.nbytes)
            del o_dense
        else:
            notes.append(f"T={t}: dense NumPy skipped, its temporaries need "
                         f"{fmt_bytes(dense_bytes(b, h, t))} > --dense-limit-gib {args.dense_limit_gib}")
        row = [t, f"{fwd['refmath']:.1f}"]
        row += [f"{fwd['torch']:.1f}", f"{fwd['torch'] / fwd['refmath']:.2f}"] if torch else ["-", "-"]
        row += [f"{fwd['numpy dense']:.1f}" if dense_ok else "skipped", fmt_bytes(extra),
                fmt_bytes(dense_extra) if dense_ok else "-"]
        if not args.no_backward:
            bwd = {"refmath": lambda: kernels.flash_attention_backward(do, q, k, v, o, lse, causal=True)}
            if torch is not None:
                gq, gk, gv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
                out = F.scaled_dot_product_attention(gq, gk, gv, is_causal=True)
                tdo = torch.from_numpy(do)
                bwd["torch"] = lambda: out.backward(tdo, retain_graph=True)
            times = interleaved_best_ms(bwd, args.repeats)
            row += [f"{times['refmath']:.1f}"]
            row += [f"{times['torch']:.1f}", f"{times['torch'] / times['refmath']:.2f}"] if torch else ["-", "-"]
        rows.append(row)
        print(f"  T={t} done", flush=True)
    headers = ["T", "refmath fwd ms", "torch fwd ms", "speed vs torch", "numpy dense ms",
               "refmath extra mem", "dense extra mem"]
    if not args.no_backward:
        headers += ["refmath bwd ms", "torch bwd ms", "bwd speed vs torch"]
    print()
    print_table(headers, rows, title=f"causal attention, B={b} H={h} D={d}, float32, {threads} thread(s)")
    for note in notes:
        print(note)
    flops = [4 * b * h * t * t * d / 2 for t in args.lengths]  # causal: half of QK^T and PV
    print("refmath forward GFLOP/s: " + ", ".join(
        f"T={t}: {f / (float(r[1]) * 1e-3) / 1e9:.1f}" for t, f, r in zip(args.lengths, flops, rows)))


if __name__ == "__main__":
    main()
