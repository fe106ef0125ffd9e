"""Solution regions: find them, strip them, and list their lines for the leak check.

A solution is the reference code itself, fenced by two comment lines, each alone on its line at any
indentation (the nbgrader/otter-grader convention):

- Python: ``# BEGIN SOLUTION`` ... ``# END SOLUTION`` around the lines a student writes;
- Markdown answers in py:percent files (lessons, handouts): ``# <!-- BEGIN SOLUTION -->`` ...
  ``# <!-- END SOLUTION -->``, HTML comments, so a rendered lesson shows nothing of them;
- C++ (the kernel assignment's ``csrc/teaching``): ``// BEGIN SOLUTION`` ... ``// END SOLUTION``.

Markers are comments: the reference runs unchanged. Stripping a Python region replaces it by one
statement at the marker's indentation (``raise NotImplementedError(...)`` for a library function);
stripping a Markdown region replaces it by a prompt line. Regions do not nest.

A docstring that would give the answer away (a backward's gradient formula) sits inside a region:
either the region of the whole body, or a region of its own holding only the docstring, which the
build replaces by a one-line docstring pointing to the handout (so the input checks that follow
the docstring stay in the student's copy). The handout states the task instead.
"""
from __future__ import annotations

import ast
from typing import Callable, NamedTuple

__all__ = ["Region", "normalise", "find_regions", "region_lines", "strip_regions",
           "default_replacement", "is_docstring_region", "strip_all", "strip_notebook",
           "function_regions"]

PY_BEGIN, PY_END = "# BEGIN SOLUTION", "# END SOLUTION"
MD_BEGIN, MD_END = "# <!-- BEGIN SOLUTION -->", "# <!-- END SOLUTION -->"
CPP_BEGIN, CPP_END = "// BEGIN SOLUTION", "// END SOLUTION"
MARKERS = {PY_BEGIN: ("python", "begin"), PY_END: ("python", "end"),
           MD_BEGIN: ("markdown", "begin"), MD_END: ("markdown", "end"),
           CPP_BEGIN: ("cpp", "begin"), CPP_END: ("cpp", "end")}

MARKDOWN_PROMPT = "# *Your answer here.*"


class Region(NamedTuple):
    """One solution region: the 0-based line numbers of its two markers (the region is the lines
    strictly between them), the marker's indentation and the kind (``python`` or ``markdown``)."""

    begin: int
    end: int
    indent: str
    kind: str


def normalise(line: str) -> str:
    """A line with its whitespace collapsed: what the leak check compares."""
    return " ".join(line.split())


def find_regions(text: str, where: str = "<text>") -> list[Region]:
    """The solution regions of ``text`` in order. An unmatched, nested or mixed marker raises
    ``ValueError`` naming ``where`` and the line."""
    regions: list[Region] = []
    open_at: tuple[int, str, str] | None = None
    for number, line in enumerate(text.splitlines()):
        marker = MARKERS.get(line.strip())
        if marker is None:
            continue
        kind, role = marker
        if role == "begin":
            if open_at is not None:
                raise ValueError(f"{where}:{number + 1}: {line.strip()!r} inside the region opened "
                                 f"at line {open_at[0] + 1}; regions do not nest")
            open_at = (number, line[: len(line) - len(line.lstrip())], kind)
        else:
            if open_at is None:
                raise ValueError(f"{where}:{number + 1}: {line.strip()!r} without a BEGIN before it")
            if open_at[2] != kind:
                raise ValueError(f"{where}:{number + 1}: a {kind} END closes the {open_at[2]} region "
                                 f"opened at line {open_at[0] + 1}")
            regions.append(Region(open_at[0], number, open_at[1], kind))
            open_at = None
    if open_at is not None:
        raise ValueError(f"{where}:{open_at[0] + 1}: solution region never closed (no END marker)")
    return regions


def region_lines(text: str, regions: list[Region]) -> list[str]:
    """The normalised, non-empty lines strictly inside ``regions``."""
    lines = text.splitlines()
    return [normalise(line) for r in regions for line in lines[r.begin + 1: r.end] if line.strip()]


def strip_regions(text: str, regions: list[Region],
                  replacement: Callable[[Region], list[str]]) -> str:
    """``text`` with each of ``regions`` (markers included) replaced by ``replacement(region)``."""
    lines = text.splitlines()
    out: list[str] = []
    at = 0
    for region in sorted(regions):
        out += lines[at:region.begin]
        out += replacement(region)
        at = region.end + 1
    out += lines[at:]
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def default_replacement(region: Region) -> list[str]:
    """A Python region becomes ``raise NotImplementedError`` at its indentation; a Markdown region
    becomes a prompt line."""
    if region.kind == "markdown":
        return [MARKDOWN_PROMPT]
    return [f'{region.indent}raise NotImplementedError("write this part: see the handout")']


def is_docstring_region(text: str, region: Region) -> bool:
    """Whether ``region`` holds nothing but a string literal: a docstring that gives the answer
    away, fenced on its own so that the input checks after it stay in the student's copy."""
    inner = "\n".join(line[len(region.indent):] if line.startswith(region.indent) else line.strip()
                      for line in text.splitlines()[region.begin + 1: region.end])
    try:
        body = ast.parse(inner).body
    except SyntaxError:
        return False
    return (len(body) == 1 and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str))


def strip_all(text: str, where: str = "<text>") -> str:
    """``text`` (Python or a py:percent notebook) with every region replaced by its default stub."""
    return strip_regions(text, find_regions(text, where), default_replacement)


def lesson_replacement(region: Region) -> list[str]:
    """In a lesson, the code before a region (``answer = ...``) stays, so a code region becomes a
    comment where the student writes, and the check cell after it says "no answer yet"; a
    Markdown answer becomes a prompt line."""
    if region.kind == "markdown":
        return [MARKDOWN_PROMPT]
    return [f"{region.indent}# your code here"]


def strip_notebook(text: str, where: str = "<text>") -> str:
    """The student version of a lesson (a py:percent script): every answer region replaced by
    :func:`lesson_replacement`."""
    return strip_regions(text, find_regions(text, where), lesson_replacement)


def enclosing_functions(text: str, regions: list[Region], where: str = "<text>") -> list[str]:
    """For each Python region, the qualified name (``Adam._update``, ``sdpa_backward``) of the
    innermost function that holds it; ``""`` for a region at module level."""
    tree = ast.parse(text, filename=where)
    spans: list[tuple[int, int, str]] = []  # (first line, last line, qualified name), 0-based

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    spans.append((child.lineno - 1, child.end_lineno - 1, name))
                visit(child, name + ".")
    visit(tree, "")
    names = []
    for region in regions:
        # end_lineno is the last statement: a trailing END comment lies after it, so test BEGIN only
        holders = [s for s in spans if s[0] < region.begin <= s[1]]
        # the innermost holder starts last
        names.append(max(holders)[2] if holders else "")
    return names




def function_regions(text: str, where: str = "<text>") -> dict[str, list[Region]]:
    """The Python regions of ``text`` grouped by the function that holds them."""
    regions = [r for r in find_regions(text, where) if r.kind == "python"]
    grouped: dict[str, list[Region]] = {}
    for region, name in zip(regions, enclosing_functions(text, regions, where)):
        grouped.setdefault(name, []).append(region)
    return grouped
