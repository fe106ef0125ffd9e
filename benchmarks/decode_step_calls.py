"""Python calls in one cached decode step of each decoder, and the share made inside input checks.

A decode step at these widths costs what Python costs: every function call. This counts the calls
one step of `python -m refmath generate`'s cached path makes (refmath.inference.generate.generate
with the KV cache, NumPy backend), C functions included, as the difference between generating
1 + N tokens and 1 token divided by N, and how many of them run inside refmath/_validate.py (the
checks and the NumPy calls they make). Counts, not timings: they do not depend on the machine's
load, so they compare two versions of the code exactly.

    python benchmarks/decode_step_calls.py --tokens 20
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from _common import print_table

from refmath import train
from refmath.data import make_task
from refmath.inference.generate import generate
from refmath.models import DECODER_ONLY, model_module

CHECKS = "_validate.py"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=20, help="decode steps to average over")
    parser.add_argument("--models", nargs="+", choices=DECODER_ONLY, default=list(DECODER_ONLY))
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error("--tokens must be positive")
    return args


def count_calls(run) -> tuple[int, int]:
    """``(calls, calls inside input checks)`` that ``run()`` makes, C functions included."""
    state = {"calls": 0, "checks": 0, "depth": 0}

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            state["calls"] += 1
            entering = event == "call" and frame.f_code.co_filename.endswith(CHECKS)
            if state["depth"] or entering:
                state["checks"] += 1
            state["depth"] += entering
        elif event == "return" and frame.f_code.co_filename.endswith(CHECKS):
            state["depth"] -= 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return state["calls"], state["checks"]


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = []
    for name in args.models:
        config = train.default_config(name, make_task(train.recipe(name).task))
        params = model_module(name).init_params(config, 0, np.float32)
        prompt = np.array([1, 2, 3])

        def run(n):
            return lambda: generate(name, params, config, prompt, n, greedy=True)

        run(2)()  # imports and first-call costs out of the way
        one, many = count_calls(run(1)), count_calls(run(1 + args.tokens))
        calls, checks = ((b - a) / args.tokens for a, b in zip(one, many))
        rows.append([name, f"{calls:.0f}", f"{checks:.0f}", f"{checks / calls:.0%}"])
    print(f"calls per decode step, averaged over {args.tokens} steps (float32, NumPy backend)")
    print_table(["model", "calls", "in input checks", "share"], rows)


if __name__ == "__main__":
    main()
