"""``python -m refmath lessons student --out DIR``: the answer-free copies of the lessons
(:func:`refmath.lessons.write_student_copies`)."""
from __future__ import annotations

import argparse

from refmath.commands import CommandError

__all__ = ["HELP", "DESCRIPTION", "add_arguments", "run"]

HELP = "the lessons: 'student --out DIR' writes their answer-free copies"
DESCRIPTION = (
    "The step-through lessons: 'student --out DIR' writes the copies a student works in, with the "
    "answers removed. They ship with refmath, so an installed wheel is enough: no checkout, and "
    "no answer key, is needed.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: the action ``student --out DIR [--from DIR]``."""
    actions = parser.add_subparsers(dest="action", metavar="action", required=True)
    student = actions.add_parser(
        "student",
        help="write the answer-free student copies of the lessons",
        description="Write the student copy of every lesson into --out: each exercise keeps its "
        "'answer = ...' lines and loses its solution (its check then says 'no answer yet'), each "
        "question loses its answer. A leak scan compares every line written with the solution "
        "lines; if any would be written, nothing is. Open the copies with 'jupyter lab DIR'.",
    )
    student.add_argument("--out", required=True, metavar="DIR",
                         help="folder to write the copies into (created if needed; refused if "
                         "it holds anything, unless --force)")
    student.add_argument("--force", action="store_true",
                         help="write into a folder that is not empty, overwriting lessons of the "
                         "same name there")
    student.add_argument("--from", dest="source", default=None, metavar="DIR",
                         help="make the copies from the instructor lessons in DIR (answers "
                         "inside) instead of writing the ones shipped with refmath")
    student.set_defaults(subparser=student)


def run(args: argparse.Namespace) -> int:
    """Write the student copies and say where."""
    from refmath.lessons import lesson_paths, write_student_copies

    try:
        lessons = lesson_paths(args.source) if args.source is not None else None
        written = write_student_copies(args.out, lessons, force=args.force)
    except OSError as err:
        raise CommandError(str(err)) from None
    print(f"wrote {len(written)} student lessons to {args.out} (open them with: jupyter lab {args.out})")
    return 0
