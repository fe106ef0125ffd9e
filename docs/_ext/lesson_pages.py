"""Mirror the lessons (``notebooks/[0-9]*.py``) into ``docs/lessons/`` so Sphinx renders them.

The lessons live outside the Sphinx source folder, and Sphinx only reads documents inside it. A
copy, rewritten only when its text changed, keeps file times steady, so an unchanged lesson is
neither re-read nor re-executed on the next build; a lesson deleted from ``notebooks/`` is deleted
here too. The set of lessons is whatever the glob finds: there is no list to keep.
"""
from __future__ import annotations

from pathlib import Path

LESSON_GLOB = "[0-9]*.py"


def lesson_sources(root: Path) -> list[Path]:
    """The lesson scripts in reading order (their names start with their number)."""
    return sorted((root / "notebooks").glob(LESSON_GLOB))


def write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` unless the file already holds it (a rewrite would trigger a re-read)."""
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def mirror_lessons(root: Path, target: Path) -> list[Path]:
    """Copy every lesson into ``target``, remove copies whose lesson is gone; return the copies."""
    sources = lesson_sources(root)
    copies = []
    for source in sources:
        copy = target / source.name
        write_if_changed(copy, source.read_text(encoding="utf-8"))
        copies.append(copy)
    for stale in set(target.glob(LESSON_GLOB)) - set(copies):
        stale.unlink()
    return copies
