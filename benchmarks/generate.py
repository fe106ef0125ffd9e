"""Tokens per second of `python -m refmath generate` for each decoder: recomputation against the KV
cache on each backend (K2, K4).

Each decoder of `python -m refmath train`'s defaults (float32, random weights: the speed does not
depend on training) continues a 1-token prompt by N greedy tokens three ways: recomputing the
whole prefix at every step (`--no-cache`), and decoding with the KV cache with attention in NumPy
or in the C++ kernels (`--backend cpu`). The table gives tokens per second (best of a few runs,
interleaved) and each figure as a ratio to the recomputation. Nothing is asserted: the figures
belong to the machine. At these widths (64) most of a decode step is the model's other matrix
products and Python's cost per op; attention is a small share, so the two backends are close
(the kernels run calls this small on one thread). On a busy machine, OPENBLAS_NUM_THREADS=1 keeps
NumPy's matrix products from waiting for each other's threads.

    OPENBLAS_NUM_THREADS=1 python benchmarks/generate.py --tokens 63
"""
from __future__ import annotations

import argparse

import numpy as np
from _common import interleaved_best_ms

from refmath import kernels, train
from refmath.models import DECODER_ONLY, model_module
from refmath.data import make_task
from refmath.inference.generate import generate


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=63,
                        help="tokens to generate (the default models hold 64 positions)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (the best is shown)")
    parser.add_argument("--models", nargs="+", choices=DECODER_ONLY,
                        default=list(DECODER_ONLY))
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ways = {"recompute": dict(cache=False), "cache numpy": dict(backend="numpy")}
    if kernels.cpu_available():
        ways["cache cpu"] = dict(backend="cpu")
    if kernels.cuda_available():
        ways["cache cuda"] = dict(backend="cuda")
    print(f"{args.tokens} greedy tokens from a 1-token prompt, float32, tokens/s (x recompute)")
    print(f"{'model':<8}" + "".join(f"{way:>22}" for way in ways))
    for name in args.models:
        task = make_task(train.recipe(name).task)
        config = train.default_config(name, task)
        params = model_module(name).init_params(config, 0, dtype=np.float32)

        def run(options):
            return lambda: generate(name, params, config, np.array([1]), args.tokens, greedy=True,
                                    **options)

        timed = {way: run(options) for way, options in ways.items()}
        times = interleaved_best_ms(timed, repeats=args.repeats)
        base = times["recompute"]
        cells = [f"{1e3 * args.tokens / times[way]:>12.0f} ({base / times[way]:4.1f}x)"
                 if way in times else f"{'-':>22}" for way in ways]
        print(f"{name:<8}" + "".join(f"{cell:>22}" for cell in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
