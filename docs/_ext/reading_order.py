"""The students' reading order: every lesson with its goals, prerequisites and class time.

Read from each lesson's own header (its first cell's title, ``**Goals:**`` and
``**Prerequisites:**`` lines, and the ``refmath: minutes:`` of its metadata, which
``tests/test_notebooks.py`` checks), so a lesson added, renumbered or rewritten changes the table
with no edit here.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import jupytext

from lesson_pages import write_if_changed


class LessonSummary(NamedTuple):
    name: str  # file name, e.g. 01_attention.py
    title: str
    goals: str
    prerequisites: str
    minutes: int


def _header_line(header: str, label: str) -> str:
    # The line and its continuation lines, up to the next bold label or a blank line.
    match = re.search(rf"\*\*{label}:\*\*(.*?)(?=\n\*\*|\n\s*\n|\Z)", header, re.DOTALL)
    return " ".join(match.group(1).split()) if match else ""


def summarise(lesson: Path) -> LessonSummary:
    notebook = jupytext.read(lesson)
    header = notebook.cells[0].source
    title = header.splitlines()[0].lstrip("#").strip()
    return LessonSummary(lesson.name, title, _header_line(header, "Goals"),
                         _header_line(header, "Prerequisites"),
                         notebook.metadata.get("refmath", {}).get("minutes", 0))


def render_reading_order(lessons: list[Path]) -> str:
    out = ["| lesson | goals | prerequisites | time |", "|---|---|---|---|"]
    for summary in map(summarise, lessons):
        out.append(f"| [{summary.title}](../lessons/{summary.name}) | {summary.goals} "
                   f"| {summary.prerequisites} | {summary.minutes} min |")
    return "\n".join(out) + "\n"


def write_reading_order(lessons: list[Path], target: Path) -> None:
    write_if_changed(target, render_reading_order(lessons))
