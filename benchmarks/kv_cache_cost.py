"""Naive regeneration against KV-cached decoding: query-key pairs and wall time (K4, K5).

For each N, a small float32 GPT generates N positions from a 1-token prompt twice: once recomputing
the whole prefix at every step, once with the KV cache (prefill, then one decode step per token).
The pair counts come from the instrumented attention (per sequence, query head and layer) and are
printed next to the formulas N(N+1)(2N+1)/6 and N(N+1)/2; the times are the best of a few runs.
Nothing is asserted about time: the figures depend on the machine. At these small sizes a fixed
Python cost per step (a few dozen op calls) is a large part of both times, so the time ratio stays
well below the pair ratio and grows with N and the width; on a busy machine, set
OPENBLAS_NUM_THREADS=1 (or your BLAS's equivalent) for steadier figures.

    python benchmarks/kv_cache_cost.py --lengths 16 32 64 128 --plot kv_cost.png
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from refmath.inference.kv_cache import generate_cached, generate_naive
from refmath.models import gpt


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 32, 64, 128],
                        help="numbers N of positions to generate (from a 1-token prompt)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per N (best is shown)")
    parser.add_argument("--layers", type=int, default=2, help="GPT layers")
    parser.add_argument("--d-model", type=int, default=64, help="GPT width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the parameters and prompt")
    parser.add_argument("--plot", metavar="PATH", help="save a PNG of pairs and times against N")
    args = parser.parse_args(argv)
    if min(args.lengths) < 1 or args.repeats < 1:
        parser.error("--lengths and --repeats must be positive")
    return args


def best_time(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure(args):
    config = gpt.GPTConfig(vocab_size=args.vocab, max_seq_len=max(args.lengths),
                           n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                           dropout=0.0)
    params = gpt.init_params(config, args.seed, dtype=np.float32)
    prompt = np.random.default_rng(args.seed).integers(0, args.vocab, (1, 1))
    rows = []
    for n in sorted(set(args.lengths)):
        runs = []
        for generator in (generate_naive, generate_cached):
            def run(generator=generator):
                return generator(gpt, params, config, prompt, n, greedy=True)
            out = run()
            runs.append((out.counts.scores[0], best_time(run, args.repeats), out.tokens))
        (naive, t_naive, tok_naive), (cached, t_cached, tok_cached) = runs
        formulas_hold = naive == n * (n + 1) * (2 * n + 1) // 6 and cached == n * (n + 1) // 2
        rows.append(dict(n=n, naive=naive, cached=cached, t_naive=t_naive, t_cached=t_cached,
                         formulas=formulas_hold, same=bool(np.array_equal(tok_naive, tok_cached))))
    return config, rows


def print_table(config, rows, out=sys.stdout):
    print(f"GPT float32: L={config.n_layers}, d={config.d_model}, h={config.n_heads}, "
          f"V={config.vocab_size}; greedy, 1-token prompt; pairs per sequence, head and layer",
          file=out)
    header = (f"{'N':>6} {'naive pairs':>12} {'cached pairs':>13} {'ratio':>7} {'formulas':>9} "
              f"{'naive ms':>10} {'cached ms':>10} {'speedup':>8} {'same tokens':>12}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        print(f"{r['n']:>6} {r['naive']:>12} {r['cached']:>13} {r['naive'] / r['cached']:>7.1f} "
              f"{'ok' if r['formulas'] else 'WRONG':>9} {1e3 * r['t_naive']:>10.2f} "
              f"{1e3 * r['t_cached']:>10.2f} {r['t_naive'] / r['t_cached']:>8.1f} "
              f"{'yes' if r['same'] else 'NO':>12}", file=out)
    print("naive: sum t^2 = N(N+1)(2N+1)/6 scores (O(N^3)); cached: sum t = N(N+1)/2 (O(N^2))",
          file=out)


def save_plot(path, config, rows) -> None:
    """Pairs and times against N on log-log axes; matplotlib is imported only here (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = [r["n"] for r in rows]
    fig = Figure(figsize=(10, 4.2))
    FigureCanvasAgg(fig)
    pairs, times = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    pairs.plot(n, [r["naive"] for r in rows], "o-", label="naive regeneration: N(N+1)(2N+1)/6")
    pairs.plot(n, [r["cached"] for r in rows], "s-", label="KV cache: N(N+1)/2")
    pairs.set_ylabel("query-key pairs (per sequence, head, layer)")
    times.plot(n, [1e3 * r["t_naive"] for r in rows], "o-", label="naive regeneration")
    times.plot(n, [1e3 * r["t_cached"] for r in rows], "s-", label="KV cache")
    times.set_ylabel("wall time (ms, best of runs)")
    for ax in (pairs, times):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("generated positions N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"GPT float32, L={config.n_layers}, d={config.d_model}, h={config.n_heads}")
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    config, rows = measure(args)
    print_table(config, rows)
    if args.plot:
        try:
            save_plot(args.plot, config, rows)
        except ImportError:
            print("kv_cache_cost: --plot needs matplotlib (pip install matplotlib)",
                  file=sys.stderr)
            return 1
        print(f"plot saved to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
