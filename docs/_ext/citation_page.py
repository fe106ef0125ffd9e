"""The "how to cite" page's BibTeX entry, derived from ``CITATION.cff`` so the two cannot differ."""
from __future__ import annotations

from pathlib import Path

import yaml

from lesson_pages import write_if_changed


def bibtex_from_cff(cff: dict) -> str:
    """A BibTeX ``@software`` entry with the title, authors, version and licence of the CFF file."""
    authors = " and ".join(
        "{" + a["name"] + "}" if "name" in a else f"{a['family-names']}, {a['given-names']}"
        for a in cff["authors"])
    fields = {"title": "{" + cff["title"] + "}", "author": authors, "version": cff.get("version"),
              "license": cff.get("license"), "url": cff.get("repository-code") or cff.get("url")}
    body = ",\n".join(f"  {key} = {{{value}}}" for key, value in fields.items() if value)
    return f"@software{{refmath,\n{body}\n}}\n"


def write_bibtex(root: Path, target: Path) -> None:
    cff = yaml.safe_load((root / "CITATION.cff").read_text(encoding="utf-8"))
    write_if_changed(target, bibtex_from_cff(cff))
