"""The changelog page: the README's "Changelog" section, which stays its only copy."""
from __future__ import annotations

from pathlib import Path

from lesson_pages import write_if_changed


def changelog_section(readme: str) -> str:
    """The body of the README's "## Changelog" section (without its heading)."""
    start = readme.index("## Changelog")
    end = readme.find("\n## ", start + 1)
    body = readme[start:] if end < 0 else readme[start:end]
    return body.partition("\n")[2].strip() + "\n"


def write_changelog(root: Path, target: Path) -> None:
    write_if_changed(target, changelog_section((root / "README.md").read_text(encoding="utf-8")))
