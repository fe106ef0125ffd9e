"""The recorded benchmark runs (``benchmarks/results/*.md``, written by ``benchmarks/record.py``),
newest first, for the kernels page. Each record carries its own date, machine and command."""
from __future__ import annotations

import re
from pathlib import Path

from lesson_pages import write_if_changed


def render_records(root: Path) -> str:
    """Every record with its headings moved two levels down, under the page's own section."""
    records = sorted((root / "benchmarks" / "results").glob("*.md"), reverse=True)
    if not records:
        return "No benchmark run has been recorded in `benchmarks/results/`.\n"
    parts = [re.sub(r"^(#+) ", r"\1## ", record.read_text(encoding="utf-8"), flags=re.MULTILINE)
             for record in records]
    return "\n".join(parts)


def write_records(root: Path, target: Path) -> None:
    write_if_changed(target, render_records(root))
