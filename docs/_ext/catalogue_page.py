"""The catalogue page: every ID of ``docs/equations.md`` with its equation, code, tests and lesson.

``docs/equations.md`` stays the single source (``tests/test_catalogue.py`` reads it too); this
module only renders it. Each ID gets

* a heading of its ID and its "What" cell, whose formulas the cell writes as ``$...$`` inline maths
  (MyST's dollarmath renders them, so the headings set their formulas as the bodies do); the
  label ``(a5)=`` above each heading is the entry's anchor, ``catalogue.html#a5``, whatever the
  heading says;
* its statement from the shared catalogue (``../shared/EQUATIONS.md`` beside the checkout), its
  plain-text formulas turned into LaTeX, or this project's one-line description when the shared
  catalogue is absent;
* the equation as the code states it: the first ``.. math::`` block of a listed function whose
  docstring names the ID;
* a link to each function's API entry, the tests as text, and a link to the lesson section whose
  heading names the ID (or to the lesson itself).
"""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import NamedTuple

from myst_parser.slugs import github_slugify

from ascii_math import markdown_with_math
from lesson_pages import write_if_changed

ID = re.compile(r"[A-Z]\d+")
ID_RANGE = re.compile(r"([A-Z])(\d+)-(?:[A-Z])?(\d+)")


class CatalogueRow(NamedTuple):
    eq_id: str
    what: str
    code: list[str]       # dotted names
    tests: list[str]      # path::test_name
    lessons: list[str]    # notebooks/NN_name.py
    later: bool           # listed under "Left for later" (then `what` is the reason too)
    reason: str


def split_row(line: str) -> list[str]:
    """The cells of a markdown table row; a ``|`` inside backticks (``p(y|x)``) is not a border."""
    cells, cell, in_code = [], [], False
    for char in line.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append("".join(cell).strip())
            cell = []
        else:
            cell.append(char)
    return cells + ["".join(cell).strip()]


def _section(page: str, title: str) -> str:
    start = page.index(f"## {title}")
    end = page.find("\n## ", start + 1)
    return page[start:] if end < 0 else page[start:end]


def _table_rows(text: str) -> list[list[str]]:
    return [split_row(line) for line in text.splitlines() if re.match(r"^\|\s*[A-Z]\d+\s*\|", line)]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def read_catalogue(page: str) -> list[CatalogueRow]:
    """The rows of docs/equations.md: covered IDs first, then those left for later."""
    rows = [CatalogueRow(c[0], c[1], _ticked(c[2]), _ticked(c[3]), _ticked(c[4]), False, "")
            for c in _table_rows(_section(page, "Covered"))]
    rows += [CatalogueRow(c[0], c[1], [], [], [], True, c[2])
             for c in _table_rows(_section(page, "Left for later"))]
    return rows


def read_shared_statements(path: Path) -> dict[str, str]:
    """ID -> the shared catalogue's "What" cell; empty when the shared folder is absent."""
    if not path.exists():
        return {}
    return {cells[0]: cells[1] for cells in _table_rows(path.read_text(encoding="utf-8"))}


def ids_in_heading(heading: str) -> set[str]:
    """The catalogue IDs a lesson heading names, ranges expanded: "N1-N3: ..." -> {N1, N2, N3}."""
    found = set(ID.findall(heading.split(":")[0]))
    for letter, first, last in ID_RANGE.findall(heading.split(":")[0]):
        found |= {f"{letter}{n}" for n in range(int(first), int(last) + 1)}
    return found


def lesson_sections(lesson: Path) -> dict[str, str]:
    """ID -> the anchor (MyST's GitHub-style slug) of the first lesson heading that names it."""
    anchors: dict[str, str] = {}
    for heading in re.findall(r"^# #{1,6} (.+)$", lesson.read_text(encoding="utf-8"), re.MULTILINE):
        for eq_id in ids_in_heading(heading):
            # MyST slugs a heading's text without its inline maths ($...$) and backticks.
            text = re.sub(r"\$[^$]*\$", "", heading).replace("`", "")
            anchors.setdefault(eq_id, github_slugify(text))
    return anchors


def docstring_math(dotted: str, eq_id: str) -> str | None:
    """The first ``.. math::`` block of the object's docstring, if the docstring names ``eq_id``."""
    module, _, name = dotted.rpartition(".")
    doc = inspect.getdoc(getattr(importlib.import_module(module), name)) or ""
    if not re.search(rf"\b{eq_id}\b", doc):
        return None
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == ".. math::":
            block = []
            for body in lines[i + 1:]:
                if body.strip() and not body.startswith(" "):
                    break
                if not body.strip().startswith(":"):  # an option such as :label:
                    block.append(body.strip())
            return "\n".join(block).strip() or None
    return None


def _code_link(dotted: str) -> str:
    return f"{{py:obj}}`{dotted.removeprefix('refmath.')} <{dotted}>`"


def _lesson_link(lesson: str, eq_id: str, root: Path) -> str:
    path = root / lesson
    name = Path(lesson).name
    anchor = lesson_sections(path).get(eq_id) if path.exists() else None
    target = f"lessons/{name}" + (f"#{anchor}" if anchor else "")
    return f"[{Path(lesson).stem}]({target})"


def heading(row: CatalogueRow) -> list[str]:
    """The label and the heading of an entry: ``(a5)=`` and ``## A5: softmax Jacobian $...$``.

    A ``$`` left open, or a formula that begins or ends with a space (which MyST's dollarmath does
    not take for maths), would print the LaTeX as text: ``ValueError`` naming the ID."""
    where = f"docs/equations.md, {row.eq_id}: the What cell {row.what!r}"
    if row.what.count("$") % 2:
        raise ValueError(f"{where} leaves a $ unclosed")
    for formula in re.findall(r"\$([^$]*)\$", row.what):
        if not formula.strip() or formula != formula.strip():
            raise ValueError(f"{where} has the formula ${formula}$, empty or with a space inside "
                             "its $ signs, which MyST does not render as maths")
    return [f"({row.eq_id.lower()})=", f"## {row.eq_id}: {row.what}"]


def render_catalogue(rows: list[CatalogueRow], shared: dict[str, str], root: Path) -> str:
    """The MyST markdown of the catalogue entries, one section per ID."""
    out = []
    for row in rows:
        out += [*heading(row), ""]
        if row.eq_id in shared:
            out += [markdown_with_math(shared[row.eq_id]), ""]
        if row.later:
            out += [f"*Not implemented yet:* {row.reason}.", ""]
            continue
        for dotted in row.code:
            tex = docstring_math(dotted, row.eq_id)
            if tex:
                out += [f"As {_code_link(dotted)} computes it:", "", "```{math}", tex, "```", ""]
                break
        out += ["- Code: " + ", ".join(_code_link(d) for d in row.code)]
        out += ["- Tests: " + ", ".join(f"`{t}`" for t in row.tests)]
        out += ["- Lesson: " + ", ".join(_lesson_link(l, row.eq_id, root) for l in row.lessons), ""]
    return "\n".join(out)


def write_catalogue(root: Path, target: Path) -> None:
    """Render docs/equations.md (and the shared catalogue, when present) into ``target``."""
    rows = read_catalogue((root / "docs" / "equations.md").read_text(encoding="utf-8"))
    shared = read_shared_statements(root.parent / "shared" / "EQUATIONS.md")
    write_if_changed(target, render_catalogue(rows, shared, root))
