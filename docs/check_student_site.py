"""Check the built student site for answers: no line of a lesson's solutions may reach its page.

Usage: python docs/check_student_site.py [--site docs/_build/html]

Each lesson page's text (its code cells, outputs and prose, as the browser shows them) goes through
the lessons' leak scan (:func:`refmath.lessons.leaked_lines`) against the instructor's lesson in
``notebooks/``. Run on the default build, which shows the student copies; the instructor build
(``REFMATH_DOCS_ANSWERS=1``) shows the answers on purpose. Exit status 0 when no page leaks, 1 when
one does, 2 when the site has no lesson pages.
"""
from __future__ import annotations

import argparse
import html.parser
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from refmath.lessons import leaked_lines  # noqa: E402  (after the path: the checkout's refmath)


class _Text(html.parser.HTMLParser):
    """The text of a page as a reader sees it, line breaks kept (code keeps its lines)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self._skip = [], 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in ("p", "div", "br", "li", "tr", "pre", "h1", "h2", "h3", "h4"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def page_text(path: Path) -> str:
    parser = _Text()
    parser.feed(path.read_text(encoding="utf-8"))
    return "".join(parser.parts)


def leaks(site: Path) -> tuple[int, list[str]]:
    """``(pages checked, leaked lines)`` of the lesson pages under ``site``."""
    pages = sorted((site / "lessons").glob("*.html"))
    found = []
    for page in pages:
        lesson = ROOT / "notebooks" / f"{page.stem}.py"
        if lesson.exists():
            found += leaked_lines(lesson.read_text(encoding="utf-8"), page_text(page),
                                  where=str(page.relative_to(site)))
    return len(pages), found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=ROOT / "docs" / "_build" / "html")
    args = parser.parse_args(argv)
    checked, found = leaks(args.site)
    if not checked:
        print(f"no lesson pages under {args.site}/lessons", file=sys.stderr)
        return 2
    for line in found:
        print(f"LEAK {line}")
    print(f"{checked} lesson pages checked, {len(found)} solution lines found on them")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
