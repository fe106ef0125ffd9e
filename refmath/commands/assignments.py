"""``python -m refmath assignments list | build | grade``: the course assignments of
:mod:`refmath.assignments`."""
from __future__ import annotations

import argparse
import os

from refmath.assignments import manifest as manifests
from refmath.commands import CommandError

__all__ = ["HELP", "DESCRIPTION", "add_arguments", "run"]

HELP = "course assignments: list, build the student and autograder trees, grade"
DESCRIPTION = (
    "Course assignments built from the reference: 'list' them, 'build NAME --out DIR' the "
    "student tree and autograder bundle, 'grade NAME SUBMISSION' or '--batch DIR'.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: ``--root`` and the actions ``list``, ``build``, ``grade``."""
    parser.add_argument("--root", default=None,
                        help="the folder of assignment folders (default: assignments/ beside the "
                        "refmath package)")
    actions = parser.add_subparsers(dest="action", metavar="action", required=True)

    listing = actions.add_parser("list", help="each assignment, its functions and points",
                                 description="List each assignment with its points, number of "
                                 "hidden tests and the functions students write.")
    listing.set_defaults(subparser=listing)

    build = actions.add_parser(
        "build", help="write the student tree and the autograder bundle",
        description="Write OUT/student (refmath with the assignment's functions stubbed, the "
        "handout, public tests) and OUT/autograder (hidden tests, grading entry point, "
        "gradescope.zip). Nothing is written if any line of a solution would be.")
    build.add_argument("name", help="the assignment (see 'list')")
    build.add_argument("--out", required=True,
                       help="output folder; one that already holds files is refused unless "
                       "--force")
    build.add_argument("--force", action="store_true",
                       help="replace the student/ and autograder/ of an --out that is not empty")
    build.set_defaults(subparser=build)

    grade = actions.add_parser(
        "grade", help="grade one submission or a folder of them",
        description="Run each hidden test on the submission in its own sandbox (bubblewrap where "
        "it runs, else, as root, a uid of its own) and print a summary; --out writes "
        "Gradescope's results.json. --batch grades every sub-folder of DIR and writes a CSV of "
        "scores. Where no sandbox can be made, grading stops with the reason.")
    grade.add_argument("name", help="the assignment (see 'list')")
    grade.add_argument("submission", nargs="?", help="a folder holding the submitted files")
    grade.add_argument("--out", help="write results.json here")
    grade.add_argument("--batch", metavar="DIR", help="grade every sub-folder of DIR")
    grade.add_argument("--csv", help="with --batch: write the scores here")
    grade.add_argument("--only", metavar="GLOB",
                       help="grade only the hidden tests whose names match (see the manifest)")
    grade.add_argument("--jobs", type=int, default=1, metavar="N",
                       help="run N hidden tests at once, each in its own process (default 1)")
    grade.add_argument("--time-limit", type=float, default=None, metavar="S",
                       help="set each hidden test's wall-clock and CPU limits to S seconds "
                       "(default: the manifest's [limits], else 30 s wall-clock and 20 s CPU); "
                       "each test runs separately, so code that never returns costs every test "
                       "that calls it its limit")
    grade.add_argument("--no-sandbox", action="store_true",
                       help="run the student code without a sandbox (limits only), for code you "
                       "trust; results.json records it")
    grade.set_defaults(subparser=grade)


def run(args: argparse.Namespace) -> int:
    """Run the action; a sandbox that cannot be made (``RuntimeError``) stops it with status 2."""
    action = {"list": _list, "build": _build, "grade": _grade}[args.action]
    try:
        return action(args)
    except RuntimeError as error:
        raise CommandError(str(error)) from None


def _src_root() -> str:
    """Where the ``refmath`` package being run lives: the library the student tree is built from,
    or, in an autograder bundle, the stubbed copy submissions are laid over."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _list(args) -> int:
    names = manifests.names(args.root)
    if not names:
        raise CommandError(f"no assignments under {args.root or manifests.default_root()}", status=1)
    for name in names:
        m = manifests.load(name, args.root)
        print(f"{name}: {m.title} ({m.total_points:g} points, {len(m.points)} hidden tests; each "
              f"within {m.limits.wall_s:g} s wall-clock, {m.limits.cpu_s:g} s CPU)")
        for file, functions in m.functions.items():
            print(f"    {file}: {', '.join(functions)}")
    return 0


def _build(args) -> int:
    from refmath.assignments.build import LeakError, build

    m = manifests.load(args.name, args.root)
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.force:
        raise CommandError(f"--out {args.out} is not empty: give --force to replace its student/ "
                           f"and autograder/, or choose another folder")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CommandError(f"--out {args.out} is a file, not a folder")
    try:
        counts = build(m, args.out, _src_root())
    except LeakError as error:
        raise CommandError(f"build {args.name}: leak check failed: {error}", status=1) from None
    print(f"built {args.name}: {os.path.join(args.out, 'student')} ({counts['student']} files), "
          f"{os.path.join(args.out, 'autograder')} ({counts['autograder']} files, gradescope.zip); "
          f"leak check passed")
    return 0


def _grade(args) -> int:
    from refmath.assignments.grade import grade, grade_batch, summary, with_time_limit, write_results
    from refmath.assignments.sandbox import Sandbox

    m = manifests.load(args.name, args.root)
    if args.time_limit is not None and not 0 < args.time_limit < float("inf"):
        raise CommandError(f"--time-limit must be a finite number of seconds > 0, got "
                           f"{args.time_limit}")
    limits = with_time_limit(m.limits, args.time_limit)
    sandbox = Sandbox("none") if args.no_sandbox else None
    if args.batch:
        if args.submission or args.out:
            args.subparser.error("give either SUBMISSION (with --out) or --batch DIR (with --csv)")
        if not args.csv:
            args.subparser.error("--batch needs --csv PATH")
        rows = grade_batch(m, args.batch, args.csv, _src_root(), limits, only=args.only,
                           jobs=args.jobs, sandbox=sandbox)
        for row in rows:
            print(f"{row['submission']}: {row['score']:g} / {row['max_score']:g}")
        print(f"wrote {args.csv}")
        return 0
    if not args.submission:
        args.subparser.error("give a SUBMISSION directory or --batch DIR")
    results = grade(m, args.submission, _src_root(), limits, only=args.only, jobs=args.jobs,
                    sandbox=sandbox)
    print(summary(results))
    if args.out:
        write_results(results, args.out)
    return 0
