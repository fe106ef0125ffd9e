"""Mirror the lessons (``notebooks/[0-9]*.py``) into ``docs/lessons/`` so Sphinx renders them.

The site shows what a student works in: by default each mirrored lesson is its student copy
(:func:`refmath.lessons.student_copy`: exercises reduced to their ``answer = ...`` lines, questions
without their answers), passed through the same leak scan as ``python -m refmath lessons
student``. The instructor build, with the answers, is asked for by ``REFMATH_DOCS_ANSWERS=1``.

The lessons live outside the Sphinx source folder, and Sphinx only reads documents inside it. A
copy, rewritten only when its text changed, keeps file times steady, so an unchanged lesson is
neither re-read nor re-executed on the next build; a lesson deleted from ``notebooks/`` is deleted
here too. The set of lessons is whatever the glob finds: there is no list to keep.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

LESSON_GLOB = "[0-9]*.py"
# A check cell calls one of refmath.lessons' checks at its top level (its other lines define the
# check's reference, inputs and slips); a cell that only mentions a check in a comment is not one.
CHECK_CALL = re.compile(r"^(?:check|check_close|check_true|check_function)\(", re.MULTILINE)
# myst-nb renders a cell with this tag as its outputs alone (hide-input would keep the source in
# the page, folded away but readable in its HTML).
HIDDEN = "remove-input"
_TAGS = re.compile(r"\btags=(\[[^\]]*\])")


def lesson_sources(root: Path) -> list[Path]:
    """The lesson scripts in reading order (their names start with their number)."""
    return sorted((root / "notebooks").glob(LESSON_GLOB))


def write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` unless the file already holds it (a rewrite would trigger a re-read)."""
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def check_cells(text: str) -> list[int]:
    """The 0-based line numbers of the ``# %%`` headers of ``text``'s check cells (a py:percent
    lesson's code cells that call a check at their top level)."""
    lines = text.splitlines()
    headers = [n for n, line in enumerate(lines) if line.startswith("# %%")] + [len(lines)]
    return [start for start, end in zip(headers, headers[1:])
            if "[markdown]" not in lines[start] and "[md]" not in lines[start]
            and CHECK_CALL.search("\n".join(lines[start + 1:end]))]


def hide_check_cells(text: str) -> str:
    """``text`` (a py:percent lesson) with every check cell tagged ``remove-input``: the call stays
    in the notebook a student runs, the page shows only what it prints."""
    lines = text.splitlines(keepends=True)
    for n in check_cells(text):
        header = lines[n].rstrip("\n")
        found = _TAGS.search(header)
        if found is None:
            header += f" tags={json.dumps([HIDDEN])}"
        elif HIDDEN not in json.loads(found.group(1)):
            tags = json.dumps(json.loads(found.group(1)) + [HIDDEN])
            header = header[:found.start(1)] + tags + header[found.end(1):]
        lines[n] = header + "\n"
    return "".join(lines)


def mirror_lessons(root: Path, target: Path, answers: bool = False) -> list[Path]:
    """Copy every lesson into ``target`` (its student copy, check cells hidden, unless ``answers``),
    remove copies whose lesson is gone; return the copies. A solution line that would reach a student copy raises
    ``ValueError`` (the build stops) before anything is written."""
    from refmath.lessons import leaked_lines, student_copy

    sources = lesson_sources(root)
    texts, leaks = {}, []
    for source in sources:
        text = source.read_text(encoding="utf-8")
        if not answers:
            copy = student_copy(text, str(source))
            leaks += leaked_lines(text, copy, source.name)
            text = hide_check_cells(copy)
        texts[source.name] = text
    if leaks:
        raise ValueError("solution lines would reach the student site:\n  " + "\n  ".join(leaks))
    copies = []
    for name, text in texts.items():
        copy = target / name
        write_if_changed(copy, text)
        copies.append(copy)
    for stale in set(target.glob(LESSON_GLOB)) - set(copies):
        stale.unlink()
    return copies


def answers_wanted(environ) -> bool:
    """Whether the build is the instructor's (``REFMATH_DOCS_ANSWERS`` set to anything but ``0``)."""
    return environ.get("REFMATH_DOCS_ANSWERS", "") not in ("", "0")
