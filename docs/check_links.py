"""Check every internal link of the built site: each href to a page of the site names a file
that exists and, when it has a ``#fragment``, an element with that id in that file.

Usage: python docs/check_links.py [docs/_build/html]

External links (http:, mailto: and the like) are not followed: the check runs offline. Exits 1 and
lists each broken link when there is one.
"""
from __future__ import annotations

import argparse
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class LinksAndIds(HTMLParser):
    """Collects the ids of a page and the targets of its links (href and src)."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        if tag in ("a", "link") and attrs.get("href"):
            self.links.append(attrs["href"])
        if tag in ("img", "script") and attrs.get("src"):
            self.links.append(attrs["src"])


def parse(page: Path) -> LinksAndIds:
    parser = LinksAndIds()
    parser.feed(page.read_text(encoding="utf-8", errors="replace"))
    return parser


def site_pages(site: Path) -> list[Path]:
    """The HTML pages Sphinx wrote; templates a theme ships under _static/ are not pages."""
    return [page for page in site.rglob("*.html") if "_static" not in page.relative_to(site).parts]


def broken_links(site: Path) -> list[str]:
    """Every internal link of every HTML page under ``site`` that does not resolve."""
    pages = {page.resolve(): parse(page) for page in site_pages(site)}
    broken = []
    for page, parsed in pages.items():
        for link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc:  # external (http:, mailto:, data:, //host)
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            where = f"{page.relative_to(site.resolve())}: {link}"
            if not target.exists():
                broken.append(f"{where} (no file {target.name})")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{where} (no id '{parts.fragment}')")
    return broken


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("site", nargs="?", default="docs/_build/html", type=Path,
                        help="the built HTML folder (default: docs/_build/html)")
    site = parser.parse_args(argv).site
    if not (site / "index.html").exists():
        print(f"no built site at {site} (build it first: python -m sphinx -W -b html docs {site})")
        return 1
    broken = broken_links(site)
    pages = len(site_pages(site))
    for line in broken:
        print("broken link:", line)
    print(f"{pages} pages checked, {len(broken)} broken internal links")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
