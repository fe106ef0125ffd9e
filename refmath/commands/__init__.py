"""The command line: ``python -m refmath <command>``; ``python -m refmath --help`` lists them.

One module per command, each with the same parts: ``HELP`` (its line in the list of commands),
``DESCRIPTION`` (the top of its ``--help``), ``add_arguments(parser)`` and ``run(args) -> int``,
the exit status. :data:`COMMANDS` names them once, in the order ``--help`` lists them.

One error format for all of them: a command that cannot do what it was asked raises
:class:`CommandError`, and :func:`main` prints ``refmath <command>: <message>`` on stderr and exits
with the error's status (2, bad input, unless it says otherwise). The library's own refusals of bad
input, ``ValueError`` and ``TypeError``, are reported the same way with status 2. Mistakes in the
flags themselves (an unknown flag, a missing argument) are argparse's, printed with the usage of
the command that was given, as argparse prints them.

Ctrl-C stops any command with one line, ``refmath <command>: interrupted``, and exit status 130
(128 + SIGINT, what a shell reports for a process the signal ended), never a traceback. ``train``
says more itself: the step it stopped at and where its checkpoint is.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

__all__ = ["CommandError", "build_parser", "main"]

PROG = "python -m refmath"
COMMANDS = ("gradcheck", "sizes", "train", "generate", "convert", "assignments", "lessons",
            "conformance")


class CommandError(Exception):
    """What stops a command, said in one line; ``status`` is its exit status (2: bad input)."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; each sets ``run`` (its function) and ``subparser`` (its own
    parser, for usage errors found after parsing)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="refmath: Transformer and LLM equations as explicit NumPy with hand-derived gradients.",
    )
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        sub = commands.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run, subparser=sub)
    return parser


INTERRUPTED = 130  # 128 + SIGINT


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` (default ``sys.argv[1:]``) and return its exit status."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Anywhere: while the command modules import (NumPy takes a moment), parse or run.
        command = next((a for a in (sys.argv[1:] if argv is None else argv) if a in COMMANDS), None)
        print(f"refmath{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return INTERRUPTED


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Say it with the usage of the command that was given (e.g. 'gradcheck --bogus'), not the
        # top-level one.
        args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.run(args)
    except CommandError as err:
        print(f"refmath {args.command}: {err}", file=sys.stderr)
        return err.status
    except (ValueError, TypeError) as err:
        print(f"refmath {args.command}: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader (e.g. `| head`) closed early; silence the flush at exit, as the Python docs advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
