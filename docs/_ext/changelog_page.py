"""The changelog page: the body of ``CHANGELOG.md`` at the repository's top, its only copy."""
from __future__ import annotations

from pathlib import Path

from lesson_pages import write_if_changed


def changelog_body(changelog: str) -> str:
    """``CHANGELOG.md`` without its ``# Changelog`` title (the page has its own)."""
    first, _, rest = changelog.lstrip().partition("\n")
    if not first.startswith("# "):
        raise ValueError("CHANGELOG.md must open with its '# Changelog' title")
    return rest.strip() + "\n"


def write_changelog(root: Path, target: Path) -> None:
    write_if_changed(target, changelog_body((root / "CHANGELOG.md").read_text(encoding="utf-8")))
