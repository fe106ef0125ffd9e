"""docs/check_links.py finds the internal links of a built site that lead nowhere."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_links", ROOT / "docs" / "check_links.py")
check_links = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_links)


def test_missing_pages_and_anchors_are_reported_and_good_links_are_not(tmp_path):
    (tmp_path / "_static").mkdir()
    (tmp_path / "_static" / "site.css").write_text("")
    (tmp_path / "_static" / "template.html").write_text('<a href="{{ pathto(x) }}">a template</a>')
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "page.html").write_text('<h2 id="refmath.f">f</h2><a href="../index.html#top">up</a>')
    (tmp_path / "index.html").write_text(
        '<div id="top"></div>'
        '<link href="_static/site.css">'
        '<a href="api/page.html#refmath.f">good anchor</a>'
        '<a href="api/page.html#refmath.g">missing anchor</a>'
        '<a href="gone.html">missing page</a>'
        '<a href="#top">same page</a>'
        '<a href="https://example.org/#x">external</a>'
        '<a href="api/">a folder, meaning its index.html</a>')

    broken = check_links.broken_links(tmp_path)

    assert sorted(broken) == [
        "index.html: api/ (no file index.html)",
        "index.html: api/page.html#refmath.g (no id 'refmath.g')",
        "index.html: gone.html (no file gone.html)",
    ]
