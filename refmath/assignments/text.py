"""Text that came from a submission, made safe to show: on a terminal, in a CSV, in feedback.

A student controls the names of their files and folders, what their code prints, and the class
name and message of anything it raises. Any of these can hold control characters (an escape
sequence that retitles the instructor's terminal, moves the cursor over the real total, or a
carriage return that overwrites a line), Unicode format characters (a right-to-left override that
reverses what follows) or a leading ``=`` that a spreadsheet runs as a formula. Every such string
passes through :func:`clean` before it is stored in results or printed, and through
:func:`csv_cell` before it is written to a CSV.
"""
from __future__ import annotations

import unicodedata

__all__ = ["clean", "clean_lines", "csv_cell"]

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\n")


def clean(text, limit: int | None = None) -> str:
    """``text`` (anything: it is ``str()``-ed) with every control, format, surrogate, private-use
    and unassigned character (Unicode category C) but the tab shown as its Python escape, so that
    nothing in it acts on the screen that shows it; cut to ``limit`` characters if given."""
    text = str(text)
    out = "".join(c if c == "\t" or unicodedata.category(c)[0] != "C" else repr(c)[1:-1]
                  for c in text)
    return out if limit is None or len(out) <= limit else out[:limit] + "..."


def clean_lines(text: str) -> str:
    """:func:`clean` on each line, the line breaks kept (feedback of several lines)."""
    return "\n".join(clean(line) for line in str(text).split("\n"))


def csv_cell(value):
    """A CSV cell of ``value``: numbers as they are; text cleaned, and with a leading quote where
    a spreadsheet would read it as a formula (OWASP's rule for CSV injection)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    text = clean(value)
    return "'" + text if text.startswith(FORMULA_STARTS) else text
