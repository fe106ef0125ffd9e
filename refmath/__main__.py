"""Command line: ``python -m refmath <command>``; ``python -m refmath --help`` lists the commands."""
from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import time


def _gradcheck(args: argparse.Namespace) -> int:
    from refmath.gradcheck import check
    from refmath.registry import GROUPS, all_cases

    if args.max_coords < 1:  # a check of 0 coordinates would check nothing and report "passed"
        print(f"python -m refmath gradcheck: error: --max-coords must be at least 1, got "
              f"{args.max_coords}", file=sys.stderr)
        return 2
    every = all_cases(group=None)
    cases = [c for c in every if fnmatch.fnmatch(c.op, args.op) or fnmatch.fnmatch(c.name, args.op)]
    if not cases:
        names = sorted({c.op for c in every})
        print(f"no case matches --op {args.op!r}; known names: {', '.join(names)} "
              "(a glob such as 'mha*' or 'layernorm[*' also works)", file=sys.stderr)
        return 2
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m refmath",
        description="refmath: Transformer and LLM equations as explicit NumPy with hand-derived gradients.",
    )
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)

    check = commands.add_parser(
        "gradcheck",
        help="check every hand-written gradient (ops, attention execution, models) against "
        "central differences (float64)",
        description="Check every registered hand-written gradient: the single-equation ops, "
        "attention as it is executed (the FlashAttention reference, RoPE and MLA attention) and the "
        "whole models' parameter gradients. Ops are checked as vector-Jacobian products: the analytic "
        "gradient against five-point central differences of sum(f(x) * dout) for a random dout, in "
        "float64; models against differences of their loss. Prints one row per case with the largest "
        "and the median error and the bound derived from the stencil's own error; exits with status "
        "1 if any check fails.",
    )
    check.add_argument("--op", default="*", help="glob over op names, e.g. 'rope' or 'mha*' (default: all)")
    check.add_argument("--seed", type=int, default=0, help="seed for inputs, dout and sampling (default: 0)")
    check.add_argument("--max-coords", type=int, default=128,
                       help="coordinates checked per input before sampling kicks in (default: 128; "
                       "models sample at most 4 per parameter array)")
    check.add_argument("--list", action="store_true", help="list the cases without running them")
    check.set_defaults(run=_gradcheck, subparser=check)

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
        help="sample text from a trained checkpoint or a Hugging Face model directory",
        description="Load a checkpoint written by 'train' (--checkpoint) or a Hugging Face model "
        "directory (--hf) and generate from a prompt (greedy, temperature, top-k, top-p; seeded).",
    )
    add_generate_arguments(generate)

    from refmath.hf_cli import add_convert_arguments

    convert = commands.add_parser(
        "convert",
        help="write a trained model as a Hugging Face model directory",
        description="Write the model of a 'train' run directory as a Hugging Face model directory "
        "(config.json and model.safetensors) that transformers loads: GPT as gpt2 or openai-gpt, "
        "the modern decoder as llama, MLA as a dense deepseek_v3. Needs the safetensors package.",
    )
    add_convert_arguments(convert)

    from refmath.assignments.cli import add_assignments_arguments, run_assignments

    assignments = commands.add_parser(
        "assignments",
        help="course assignments: list, build the student and autograder trees, grade",
        description="Course assignments built from the reference: 'list' them, 'build NAME --out "
        "DIR' the student tree and autograder bundle, 'grade NAME SUBMISSION' or '--batch DIR'.",
    )
    add_assignments_arguments(assignments)
    assignments.set_defaults(run=run_assignments, subparser=assignments)

    from refmath.lessons import add_lessons_arguments, run_lessons

    lessons = commands.add_parser(
        "lessons",
        help="the lessons: 'student --out DIR' writes their answer-free copies",
        description="The step-through lessons of notebooks/: 'student --out DIR' writes the copies "
        "a student works in, with the answers removed and the leak scan passed.",
    )
    add_lessons_arguments(lessons)
    lessons.set_defaults(run=run_lessons, subparser=lessons)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Say it with the usage of the command that was given (e.g. 'gradcheck --bogus'), not the
        # top-level one.
        getattr(args, "subparser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.run(args)
    except BrokenPipeError:
        # The reader (e.g. `| head`) closed early; silence the flush at exit, as the Python docs advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
