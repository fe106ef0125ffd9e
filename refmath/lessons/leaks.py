"""The scans that prove a student copy gives nothing away: no line of a solution region reaches
it (:func:`leaked_lines`), and, under the test suite's ``REFMATH_LESSONS_RECORD``, every check
records the value it expects, so that a scan of the unanswered copy can look for it in every cell
printed or written before the check (:func:`record_expected`)."""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from refmath import solutions

__all__ = ["leaked_lines", "record_expected", "RECORD", "RECORD_MARK"]


# As in the assignments' leak check: a solution line shorter than this ("else:", "return dx") says
# nothing and occurs everywhere; one at least SHORTEST_QUOTED long also leaks inside a longer line.
SHORTEST_SECRET = 10


SHORTEST_QUOTED = 20
RECORD = "REFMATH_LESSONS_RECORD"
RECORD_MARK = "\x1erefmath-check "


def record_expected(name: str, expected: Any) -> None:
    """Under ``REFMATH_LESSONS_RECORD=FILE`` (set by the test that scans the student copies), add
    the check's expected value to FILE as a JSON line, with the line of the lesson that called the
    check, and print a marker so that the scan knows what was printed before it. Nothing happens
    otherwise: a student never sees either."""
    path = os.environ.get(RECORD, "")
    if not path:
        return
    import json
    import sys

    frame, line = sys._getframe(1), None
    while frame is not None:  # the first frame outside refmath: the lesson's own line
        if not frame.f_globals.get("__name__", "").startswith("refmath"):
            line = frame.f_lineno
            break
        frame = frame.f_back
    try:
        value = np.asarray(expected() if callable(expected) else expected,
                           dtype=np.float64).ravel().tolist()
    except Exception:  # a value the unanswered copy cannot compute yet: nothing to look for
        value = None
    sys.stdout.flush()
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps({"name": name, "line": line, "value": value}) + "\n")
    print(f"{RECORD_MARK}{name}", flush=True)


def leaked_lines(instructor: str, student: str, where: str = "<lesson>") -> list[str]:
    """The lines of ``student`` that are, or quote, a line of one of ``instructor``'s solution
    regions, compared normalised: empty when nothing leaks. Each entry is ``"where:line: text"``.

    As in the assignments' leak check (``refmath.assignments.build``), a solution line counts only
    when it gives something away: at least 10 characters long, and not a line the lesson shows
    outside its regions anyway (``with open(path, "rb") as f:`` taught before an exercise, or a
    function that restates the answer after its check); a line of 20 characters or more also
    leaks when quoted inside a longer line, unless the lesson's own text quotes it too.
    """
    regions = solutions.find_regions(instructor, where)
    inside = {n for r in regions for n in range(r.begin, r.end + 1)}
    public = {solutions.normalise(line) for n, line in enumerate(instructor.splitlines())
              if n not in inside}
    public_text = "\n".join(public)
    secrets = {line for line in solutions.region_lines(instructor, regions)
               if len(line) >= SHORTEST_SECRET} - public
    quoted = [s for s in secrets if len(s) >= SHORTEST_QUOTED and s not in public_text]
    found = []
    for number, line in enumerate(student.splitlines(), 1):
        flat = solutions.normalise(line)
        if flat in secrets or any(s in flat for s in quoted):
            found.append(f"{where}:{number}: {line.strip()}")
    return found
