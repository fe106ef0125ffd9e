"""Check the built student site for answers: no line of a lesson's solutions may reach its page,
and no check cell's source either.

Usage: python docs/check_student_site.py [--site docs/_build/html]

Each lesson page's text (its code cells, outputs and prose, as the browser shows them) goes through
the lessons' leak scan (:func:`refmath.lessons.leaked_lines`) against the instructor's lesson in
``notebooks/``. Each page's code cells (myst-nb's ``cell_input`` blocks, not their outputs) must
call no check: a check cell computes its expected value and its slips, so the student site shows
what it prints and not its source (``docs/_ext/lesson_pages.py`` tags it ``remove-input``). Run on the default build, which shows the student copies; the instructor build
(``REFMATH_DOCS_ANSWERS=1``) shows the answers on purpose. Exit status 0 when no page leaks, 1 when
one does, 2 when the site has no lesson pages.
"""
from __future__ import annotations

import argparse
import html.parser
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "docs" / "_ext")]

from lesson_pages import CHECK_CALL  # noqa: E402
from refmath.lessons import leaked_lines  # noqa: E402  (after the path: the checkout's refmath)


class _Text(html.parser.HTMLParser):
    """The text of a page as a reader sees it, line breaks kept (code keeps its lines)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self._skip = [], 0
        # the code of the page's code cells: myst-nb puts each cell's source in a
        # <div class="cell_input ...">; the depth counts the divs open inside the current one
        self.code, self._input_depth = [], 0

    def handle_starttag(self, tag, attrs):
        if tag == "div" and self._input_depth:
            self._input_depth += 1
        elif tag == "div" and "cell_input" in (dict(attrs).get("class") or "").split():
            self._input_depth = 1
            self.code.append("\n")
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in ("p", "div", "br", "li", "tr", "pre", "h1", "h2", "h3", "h4"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1
        elif tag == "div" and self._input_depth:
            self._input_depth -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)
            if self._input_depth:
                self.code.append(data)


def _parsed(path: Path) -> _Text:
    parser = _Text()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def page_text(path: Path) -> str:
    return "".join(_parsed(path).parts)


def shown_checks(site: Path) -> tuple[int, list[str]]:
    """``(pages checked, check calls shown)``: each line of a lesson page's code cells that calls a
    check, as ``"page: line"``."""
    pages = sorted((site / "lessons").glob("*.html"))
    found = []
    for page in pages:
        code = "".join(_parsed(page).code)
        found += [f"{page.relative_to(site)}: {line.strip()}" for line in code.splitlines()
                  if CHECK_CALL.match(line.strip())]
    return len(pages), found


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
    _, checks = shown_checks(args.site)
    for line in checks:
        print(f"CHECK SOURCE {line}")
    print(f"{checked} lesson pages checked, {len(found)} solution lines and {len(checks)} check "
          "calls found on them")
    return 1 if found or checks else 0


if __name__ == "__main__":
    sys.exit(main())
