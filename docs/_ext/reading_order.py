"""The students' reading order: every lesson with its goal and an estimate of the time it takes.

Read from the lessons themselves (title, first paragraph, amount of text and code), so a lesson
added, renumbered or lengthened changes the table with no edit here.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import NamedTuple

from lesson_pages import write_if_changed

# A technical text read with care, and a cell read, run and its output looked at.
WORDS_PER_MINUTE = 150
MINUTES_PER_CODE_CELL = 1


class LessonSummary(NamedTuple):
    name: str       # file name, e.g. 01_attention.py
    title: str
    goal: str       # the paragraph under the title
    words: int      # words of markdown
    code_cells: int

    @property
    def minutes(self) -> int:
        """Estimated time, rounded up to five minutes."""
        raw = self.words / WORDS_PER_MINUTE + self.code_cells * MINUTES_PER_CODE_CELL
        return 5 * math.ceil(raw / 5)


def _cells(text: str) -> list[tuple[bool, str]]:
    """(is_markdown, body) for each ``# %%`` cell; markdown bodies lose their leading ``# ``."""
    cells = []
    for chunk in re.split(r"^# %%", text, flags=re.MULTILINE)[1:]:
        header, _, body = chunk.partition("\n")
        markdown = "[markdown]" in header
        if markdown:
            body = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#")
                             for line in body.splitlines())
        cells.append((markdown, body.strip()))
    return cells


def summarise(lesson: Path) -> LessonSummary:
    cells = _cells(lesson.read_text(encoding="utf-8"))
    markdown = [body for is_md, body in cells if is_md]
    first = markdown[0].splitlines() if markdown else [lesson.stem]
    title = first[0].lstrip("#").strip()
    paragraphs = "\n".join(first[1:]).strip().split("\n\n")
    goal = " ".join(paragraphs[0].split()) if paragraphs and paragraphs[0] else ""
    words = sum(len(body.split()) for body in markdown)
    code_cells = sum(1 for is_md, body in cells if not is_md and body)
    return LessonSummary(lesson.name, title, goal, words, code_cells)


def render_reading_order(lessons: list[Path]) -> str:
    out = ["| lesson | what it teaches | time |", "|---|---|---|"]
    for summary in map(summarise, lessons):
        out.append(f"| [{summary.title}](../lessons/{summary.name}) | {summary.goal} "
                   f"| about {summary.minutes} min |")
    return "\n".join(out) + "\n"


def write_reading_order(lessons: list[Path], target: Path) -> None:
    write_if_changed(target, render_reading_order(lessons))
