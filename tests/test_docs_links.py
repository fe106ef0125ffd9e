"""docs/check_links.py finds the internal links of a built site that lead nowhere."""
import importlib.util
import re
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


# ---- the README's links, as GitHub resolves them (no site build needed) ----------------------

def _github_anchor(heading: str) -> str:
    """GitHub's id for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(markdown: str) -> set[str]:
    in_code, anchors = False, set()
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            anchors.add(_github_anchor(line.lstrip("#")))
    return anchors


def test_every_link_of_the_readme_resolves():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(links) >= 20
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):  # external: not followed offline
            continue
        path, _, fragment = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        if not target.exists():
            broken.append(f"{link} (no file {path})")
        elif fragment and fragment not in _anchors(target.read_text(encoding="utf-8")):
            broken.append(f"{link} (no heading #{fragment} in {path or 'README.md'})")
    assert not broken, broken
    for start in ("students", "instructors", "kernel-engineers"):  # the three paths in
        assert f"(docs/start/{start}.md)" in readme
    assert "(CHANGELOG.md)" in readme and "(benchmarks/README.md)" in readme


def test_the_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) < 300
