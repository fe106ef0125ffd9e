"""``python -m refmath gradcheck``: every registered hand-written gradient against central
differences (:mod:`refmath.gradcheck`, the cases of :mod:`refmath.registry`)."""
from __future__ import annotations

import argparse
import fnmatch
import textwrap
import time

from refmath.commands import CommandError

__all__ = ["HELP", "DESCRIPTION", "add_arguments", "run"]

HELP = ("check every hand-written gradient (ops, attention execution, models) against central "
        "differences (float64), and the optimisers and schedules against independent computations")
DESCRIPTION = (
    "Check every registered hand-written gradient: the single-equation ops, attention as it is "
    "executed (the FlashAttention reference, RoPE and MLA attention) and the whole models' "
    "parameter gradients. Ops are checked as vector-Jacobian products: the analytic gradient "
    "against five-point central differences of sum(f(x) * dout) for a random dout, in float64; "
    "models against differences of their loss. Prints one row per case with the largest and the "
    "median error and the bound derived from the stencil's own error. Optimisers and schedules "
    "have no gradient to check: the 'optimisers' group runs SGD, Adam, AdamW, clipping and the "
    "schedules against recurrences written from the equations in float64, the catalogue's worked "
    "examples (O2, O4, O7) and, where torch is installed, torch.optim, over several steps, with "
    "weight decay on and off and in parameter groups (refmath.mistakes.optimiser_checks). Exits "
    "with status 1 if any check fails.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: ``--op``, ``--seed``, ``--max-coords``, ``--list``."""
    parser.add_argument("--op", default="*",
                        help="glob over op names, e.g. 'rope' or 'mha*', or 'optimisers' for the "
                        "optimiser group alone (default: all)")
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
    optimisers = _optimiser_checks_wanted(args.op)
    if not cases and not optimisers:
        names = sorted({c.op for c in every})
        raise CommandError(f"no case matches --op {args.op!r}; known names: {', '.join(names)}, "
                           f"{OPTIMISER_GROUP} (a glob such as 'mha*' or 'layernorm[*' also works)")
    id_width = max([len(','.join(case.ids)) for case in cases] + [3])
    groups = [(g, [c for c in cases if c.group == g]) for g in GROUPS]
    if args.list:
        width = _name_width(cases, ROW_CHARS - 2 - id_width)
        for group, members in groups:
            if members:
                print(f"# {group}")
            for case in members:
                print(_row(case.name, width, ','.join(case.ids)))
        if optimisers:
            print(f"# {OPTIMISER_GROUP}")
            for name in _run_optimiser_checks():
                print(name)
        return 0

    # The ids, the numbers and "result" take id_width + 37 characters; the name gets the rest.
    width = _name_width(cases, ROW_CHARS - 37 - id_width)
    print(f"{'case':<{width}}  {'ids':<{id_width}} {'max err':>8} {'median':>8} {'bound':>8}  result")
    failures, start = 0, time.perf_counter()
    for group, members in groups:
        if not members:
            continue
        print(f"# {group}")
        for case in members:
            ids = f"{','.join(case.ids):<{id_width}}"
            try:
                result = check(case, seed=args.seed, max_coords=args.max_coords)
            except Exception as error:  # a backward that raises is a failed check, not the end
                failures += 1
                print(_row(case.name, width, f"{ids} {'-':>8} {'-':>8} {'-':>8}  FAIL",
                           f"raised {type(error).__name__}: {error}"), flush=True)
                continue
            failures += not result.passed
            detail = None if result.passed else f"worst: {result.worst}"
            if result.problem:
                detail = result.problem
            print(_row(case.name, width, f"{ids} {result.max_error:>8.1e} {result.typical:>8.1e} "
                       f"{result.bound:>8.1e}  {'pass' if result.passed else 'FAIL'}", detail),
                  flush=True)
    if optimisers:
        print(f"# {OPTIMISER_GROUP} (catalogue O1-O7, against independent computations in float64)")
        results = _run_optimiser_checks()
        own = max(len(name) for name in results)
        for name, passed in results.items():
            failures += not passed
            print(_row(name, min(own, ROW_CHARS - 6), 'pass' if passed else 'FAIL'), flush=True)
    elapsed = time.perf_counter() - start
    total = len(cases) + (len(results) if optimisers else 0)
    print(f"{total - failures} passed, {failures} failed ({elapsed:.1f} s, float64, seed {args.seed})")
    print("err = |a - n| / max(|a| + |n|, median); bound = the stencil's own error "
          "(refmath.gradcheck)")
    return 1 if failures else 0


OPTIMISER_GROUP = "optimisers"
ROW_CHARS = 100  # the widest row printed: a long case name wraps inside its column


def _name_width(cases, room: int) -> int:
    """The name column: as wide as the longest name, but no wider than ``room``."""
    return max(4, min(max([len(case.name) for case in cases] + [4]), room))


def _row(name: str, width: int, columns: str, detail: str | None = None) -> str:
    """One case's row: ``name`` wrapped inside its ``width`` (continuation lines indented by
    two), ``columns`` beside its first line, and a failure's ``detail`` on indented lines below."""
    lines = textwrap.wrap(name, width, subsequent_indent="  ", break_on_hyphens=False) or [""]
    lines[0] = f"{lines[0]:<{width}}  {columns}"
    if detail:
        lines += textwrap.wrap(f"({detail})", ROW_CHARS, initial_indent="    ",
                               subsequent_indent="    ")
    return "\n".join(lines)


def _run_optimiser_checks() -> dict[str, bool]:
    """``{check: passed}``, a check that raises counted as failed."""
    from refmath.mistakes import optimiser_checks

    try:
        return optimiser_checks()
    except Exception as error:  # an optimiser that raises fails its group, it does not end the run
        return {f"optimiser checks (raised {type(error).__name__}: {error})": False}


def _optimiser_checks_wanted(pattern: str) -> bool:
    """Whether ``--op`` selects the optimiser group: a glob that matches its name ('*',
    'optim*', 'optimisers')."""
    return fnmatch.fnmatch(OPTIMISER_GROUP, pattern)
