"""``python -m refmath gradcheck``: every registered hand-written gradient against central
differences (:mod:`refmath.gradcheck`, the cases of :mod:`refmath.registry`)."""
from __future__ import annotations

import argparse
import fnmatch
import time

from refmath.commands import CommandError

HELP = ("check every hand-written gradient (ops, attention execution, models) against central "
        "differences (float64)")
DESCRIPTION = (
    "Check every registered hand-written gradient: the single-equation ops, attention as it is "
    "executed (the FlashAttention reference, RoPE and MLA attention) and the whole models' "
    "parameter gradients. Ops are checked as vector-Jacobian products: the analytic gradient "
    "against five-point central differences of sum(f(x) * dout) for a random dout, in float64; "
    "models against differences of their loss. Prints one row per case with the largest and the "
    "median error and the bound derived from the stencil's own error; exits with status 1 if any "
    "check fails.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: ``--op``, ``--seed``, ``--max-coords``, ``--list``."""
    parser.add_argument("--op", default="*", help="glob over op names, e.g. 'rope' or 'mha*' (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed for inputs, dout and sampling (default: 0)")
    parser.add_argument("--max-coords", type=int, default=128,
                        help="coordinates checked per input before sampling kicks in (default: 128; "
                        "models sample at most 4 per parameter array)")
    parser.add_argument("--list", action="store_true", help="list the cases without running them")


def run(args: argparse.Namespace) -> int:
    """Print one row per case; 1 if any check fails."""
    from refmath.gradcheck import all_cases, check
    from refmath.registry import GROUPS

    if args.max_coords < 1:  # a check of 0 coordinates would check nothing and report "passed"
        raise CommandError(f"--max-coords must be at least 1, got {args.max_coords}")
    every = all_cases(group=None)
    cases = [c for c in every if fnmatch.fnmatch(c.op, args.op) or fnmatch.fnmatch(c.name, args.op)]
    if not cases:
        names = sorted({c.op for c in every})
        raise CommandError(f"no case matches --op {args.op!r}; known names: {', '.join(names)} "
                           "(a glob such as 'mha*' or 'layernorm[*' also works)")
    width = max(len(case.name) for case in cases)
    id_width = max(len(','.join(case.ids)) for case in cases)
    groups = [(g, [c for c in cases if c.group == g]) for g in GROUPS]
    if args.list:
        for group, members in groups:
            if members:
                print(f"# {group}")
            for case in members:
                print(f"{case.name:<{width}}  {','.join(case.ids)}")
        return 0

    print(f"{'case':<{width}}  {'ids':<{id_width}} {'max err':>8} {'median':>8} {'bound':>8}  result")
    failures, start = 0, time.perf_counter()
    for group, members in groups:
        if not members:
            continue
        print(f"# {group}")
        for case in members:
            try:
                result = check(case, seed=args.seed, max_coords=args.max_coords)
            except Exception as error:  # a backward that raises is a failed check, not the end
                failures += 1
                print(f"{case.name:<{width}}  {','.join(case.ids):<{id_width}} {'-':>8} {'-':>8} "
                      f"{'-':>8}  FAIL (raised {type(error).__name__}: {error})", flush=True)
                continue
            failures += not result.passed
            verdict = "pass" if result.passed else f"FAIL (worst: {result.worst})"
            if result.problem:
                verdict = f"FAIL ({result.problem})"
            print(f"{case.name:<{width}}  {','.join(case.ids):<{id_width}} {result.max_error:>8.1e} "
                  f"{result.typical:>8.1e} {result.bound:>8.1e}  {verdict}", flush=True)
    elapsed = time.perf_counter() - start
    print(f"{len(cases) - failures} passed, {failures} failed ({elapsed:.1f} s, float64, seed {args.seed}); "
          "err = |a - n| / max(|a| + |n|, median), bound = the stencil's own error (refmath.gradcheck)")
    return 1 if failures else 0
