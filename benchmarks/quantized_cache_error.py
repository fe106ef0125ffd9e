"""How much a quantised KV cache (catalogue K12) changes attention, and what it saves.

For random queries and cached keys/values, the script quantises K and V with the symmetric
per-group quantiser of :mod:`refmath.inference.quantized` and prints, for each bit width and group
size, the relative error (Frobenius norm of the change over the norm of the exact result) of

- the scores ``Q K^T / sqrt(d)`` with K quantised,
- the attention outputs with only K, only V, and both quantised,

next to the bytes per token (all layers, keys and values, scales included) and the effective bits
per cached number. Two kinds of keys: plain Gaussian, and Gaussian with a few outlier channels
(real keys have channels whose magnitude is many times the rest; one such channel inflates the
scale of its whole group, which smaller groups contain). Everything is float64 NumPy; no timing.

    PYTHONPATH=. python benchmarks/quantized_cache_error.py --help
"""
from __future__ import annotations

import argparse

import numpy as np

from refmath.attention import sdpa_forward
from refmath.inference.quantized import dequantize, quantize
from refmath.sizing import kv_cache_bytes_per_token, quantized_kv_cache_bytes

GROUP_SIZES = (16, 32, 64, 128)
BITS = (8, 4)


def _rel(approx, exact) -> float:
    return float(np.linalg.norm(approx - exact) / np.linalg.norm(exact))


def make_data(rng, heads, queries, tokens, head_dim, outliers, outlier_scale):
    """Gaussian q, k, v of shape (1, heads, t, head_dim); ``outliers`` channels of k (the same in
    every head and token, as in real models) are multiplied by ``outlier_scale``."""
    q = rng.standard_normal((1, heads, queries, head_dim))
    k = rng.standard_normal((1, heads, tokens, head_dim))
    v = rng.standard_normal((1, heads, tokens, head_dim))
    if outliers:
        channels = rng.choice(head_dim, size=outliers, replace=False)
        k[..., channels] *= outlier_scale
    return q, k, v


def measure(q, k, v, bits, group_size, scale_dtype):
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    out = sdpa_forward(q, k, v)[0]
    kh = dequantize(quantize(k, bits, group_size, scale_dtype))
    vh = dequantize(quantize(v, bits, group_size, scale_dtype))
    return {
        "scores": _rel(q @ np.swapaxes(kh, -1, -2) / np.sqrt(q.shape[-1]), scores),
        "out K": _rel(sdpa_forward(q, kh, v)[0], out),
        "out V": _rel(sdpa_forward(q, k, vh)[0], out),
        "out K+V": _rel(sdpa_forward(q, kh, vh)[0], out),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--layers", type=int, default=32, help="layers L (for bytes per token)")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads g")
    parser.add_argument("--head-dim", type=int, default=128,
                        help="head width d_h; the group sizes that do not divide it are skipped")
    parser.add_argument("--tokens", type=int, default=1024, help="cached tokens T per head")
    parser.add_argument("--queries", type=int, default=16, help="queries per head")
    parser.add_argument("--outliers", type=int, default=4, help="outlier channels of K")
    parser.add_argument("--outlier-scale", type=float, default=20.0,
                        help="factor on the outlier channels of K")
    parser.add_argument("--scale-dtype", choices=("float16", "float32"), default="float16",
                        help="storage of the per-group scales")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    scale_dtype = np.dtype(args.scale_dtype)
    d = args.head_dim
    groups = [gs for gs in GROUP_SIZES if d % gs == 0]
    fp16 = kv_cache_bytes_per_token(args.layers, args.kv_heads, d, 2)
    print(f"Quantised KV cache (K12): relative errors ||approx - exact||_F / ||exact||_F, float64")
    print(f"  {args.kv_heads} heads x {args.tokens} cached tokens x {args.queries} queries, "
          f"d_h={d}; outlier K: {args.outliers} channels x {args.outlier_scale:g}; "
          f"scales in {scale_dtype.name}; seed {args.seed}")
    print(f"  bytes per token: one sequence, L={args.layers} layers, g={args.kv_heads}, keys and "
          f"values, scales included; fp16 cache: {fp16} B/token (16 bits per number)\n")
    header = (f"{'keys':<9} {'bits':>4} {'G':>4} {'B/token':>8} {'bits/num':>8} {'vs fp16':>7} "
              f"{'scores':>9} {'out K':>9} {'out V':>9} {'out K+V':>9}")
    print(header)
    print("-" * len(header))
    scale_bytes = scale_dtype.itemsize
    for kind, outliers in (("gaussian", 0), ("outlier", args.outliers)):
        rng = np.random.default_rng(args.seed)
        q, k, v = make_data(rng, args.kv_heads, args.queries, args.tokens, d, outliers,
                            args.outlier_scale)
        for bits in BITS:
            for gs in groups:
                size = quantized_kv_cache_bytes(1, args.layers, 1, args.kv_heads, d, bits, gs,
                                                scale_bytes).total
                per_number = 8 * size / (2 * args.layers * args.kv_heads * d)
                err = measure(q, k, v, bits, gs, scale_dtype)
                print(f"{kind:<9} {bits:>4} {gs:>4} {size:>8} {per_number:>8.3f} "
                      f"{fp16 / size:>6.2f}x {err['scores']:>9.2e} {err['out K']:>9.2e} "
                      f"{err['out V']:>9.2e} {err['out K+V']:>9.2e}")
        print()
    print("scores: K quantised; out K / out V / out K+V: attention output with that part quantised.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
