"""Command line: ``python -m refmath <command>``; ``python -m refmath --help`` lists the commands."""
from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import time


def _gradcheck(args: argparse.Namespace) -> int:
    from refmath.gradcheck import check_case
    from refmath.registry import all_cases

    cases = [c for c in all_cases() if fnmatch.fnmatch(c.op, args.op) or fnmatch.fnmatch(c.name, args.op)]
    if not cases:
        print(f"no op matches {args.op!r}", file=sys.stderr)
        return 2
    width = max(len(case.name) for case in cases)
    id_width = max(len(','.join(case.ids)) for case in cases)
    if args.list:
        for case in cases:
            print(f"{case.name:<{width}}  {','.join(case.ids)}")
        return 0

    print(f"{'op[input]':<{width}}  {'ids':<{id_width}} {'max rel err':>11} {'bound':>8}  result")
    failures, start = 0, time.perf_counter()
    for case in cases:
        result = check_case(case, seed=args.seed, max_coords=args.max_coords)
        failures += not result.passed
        worst = max(result.errors, key=result.errors.get) if result.errors else "-"
        verdict = "pass" if result.passed else f"FAIL (worst: {worst})"
        print(f"{case.name:<{width}}  {','.join(case.ids):<{id_width}} {result.max_error:>11.2e} "
              f"{case.bound:>8.0e}  {verdict}", flush=True)
    elapsed = time.perf_counter() - start
    print(f"{len(cases) - failures} passed, {failures} failed ({elapsed:.1f} s, float64, seed {args.seed})")
    return 1 if failures else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m refmath",
        description="refmath: Transformer and LLM equations as explicit NumPy with hand-derived gradients.",
    )
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)

    check = commands.add_parser(
        "gradcheck",
        help="check every op's hand-written gradient against central differences (float64)",
        description="Vector-Jacobian check of every registered op: the analytic gradient against "
        "five-point central differences of sum(f(x) * dout) for a random dout, in float64. "
        "Prints one row per op and input; exits with status 1 if any check fails.",
    )
    check.add_argument("--op", default="*", help="glob over op names, e.g. 'rope' or 'mha*' (default: all)")
    check.add_argument("--seed", type=int, default=0, help="seed for inputs, dout and sampling (default: 0)")
    check.add_argument("--max-coords", type=int, default=128,
                       help="coordinates checked per input before sampling kicks in (default: 128)")
    check.add_argument("--list", action="store_true", help="list the cases without running them")
    check.set_defaults(run=_gradcheck)

    from refmath.sizing import add_sizes_arguments

    sizes = commands.add_parser(
        "sizes",
        help="KV-cache, memory, parameter and FLOP sizes for a preset or a given shape",
        description="Sizes of the KV cache (MHA/GQA/MQA/MLA, optionally quantised), weights, "
        "inference and training memory, parameters and FLOPs, for a published preset or for "
        "explicit flags. Units are binary (KiB, MiB, GiB).",
    )
    add_sizes_arguments(sizes)

    from refmath.train import add_generate_arguments, add_train_arguments

    train = commands.add_parser(
        "train",
        help="train a model with its hand-written backward pass and AdamW",
        description="Train one of the four models on data generated on the fly (no download), "
        "with AdamW, warmup-cosine learning rate and gradient clipping; writes checkpoints, "
        "a loss curve and a summary to --out.",
    )
    add_train_arguments(train)

    generate = commands.add_parser(
        "generate",
        help="sample text from a trained checkpoint",
        description="Load a checkpoint written by 'train' and generate from a prompt "
        "(greedy, temperature, top-k, top-p; seeded).",
    )
    add_generate_arguments(generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader (e.g. `| head`) closed early; silence the flush at exit, as the Python docs advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
