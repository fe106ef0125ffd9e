"""The documentation site's API pages cover the whole public API (without building the site).

docs/_ext/api_pages.py plans one page per row of the module table in docs/api.md and documents
each module there: its docstring, then one autodoc entry per name of its ``__all__``. These tests
walk the source files themselves to check that every public module has a page, read each rendered
page back to check that it documents exactly its modules' ``__all__`` (a public name is never left
out, nothing else is shown, and a listed name that is gone fails), and check that every object the
catalogue and the other pages link to is one of those names.
"""
import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
api_pages = importlib.import_module("api_pages")

API_PAGE = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
PAGES = api_pages.plan_pages(API_PAGE, api_pages.public_modules())
DOCUMENTED = {module: page.slug for page in PAGES for module in page.modules}


def source_modules():
    """Public modules found by walking refmath/ on disk, independently of the importer."""
    names = []
    for path in sorted((ROOT / "refmath").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts[1:]):
            names.append(".".join(parts))
    return names


def declared_all(module):
    """The literal ``__all__`` of a module's source (None where it has none), read without the
    importer that the pages use."""
    tree = ast.parse(Path(importlib.import_module(module).__file__).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    return None


RENDERED = {}
for _page in PAGES:
    for _module, _names in api_pages.documented_names(api_pages.render_page(_page)).items():
        RENDERED[_module] = _names


def test_every_public_module_has_an_api_page():
    missing = [m for m in source_modules() if m != "refmath" and m not in DOCUMENTED]
    assert not missing, f"public modules on no API page: {missing}"


def test_table_groups_become_pages_in_order_and_each_row_links_its_page():
    groups = api_pages.table_groups(API_PAGE)
    assert len(groups) >= 20
    assert [p.title for p in PAGES[:len(groups)]] == [", ".join(names) for names, _ in groups]
    for page in PAGES[:len(groups)]:
        assert f"](api/{page.slug}.md) |" in API_PAGE, f"the row of {page.title} links no api/{page.slug}.md"


def test_the_site_reads_no_text_of_the_readme():
    """The README is the repository's front door; the site has its own pages (the API table, the
    instructors' guide, the changelog from CHANGELOG.md), so editing the README cannot break it."""
    docs = ROOT / "docs"
    sources = [p for p in docs.rglob("*") if p.suffix in (".md", ".py", ".sh")
               and not p.relative_to(docs).parts[0].startswith("_build")
               and p.relative_to(docs).parts[0] not in ("_generated", "api", "lessons", "jupyter_execute")]
    readers = [str(p.relative_to(ROOT)) for p in sources
               if re.search(r"\.\./README\.md|\"README\.md\"|'README\.md'", p.read_text(encoding="utf-8"))]
    assert not readers, f"these read the README: {readers}"


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_each_module_page_shows_exactly_its_all(module):
    listed = declared_all(module) or []  # a package without one offers only its submodules
    assert RENDERED.get(module) == listed, (
        f"{module}: the API page shows {RENDERED.get(module)}, its __all__ lists {listed}")
    gone = [name for name in listed if not hasattr(importlib.import_module(module), name)]
    assert not gone, f"{module}.__all__ lists names it does not have: {gone}"


def test_a_page_shows_nothing_but_the_all(monkeypatch):
    page = api_pages.ApiPage("softmax", "refmath.softmax", "", ["refmath.softmax"])
    monkeypatch.setattr(importlib.import_module("refmath.softmax"), "__all__", ["softmax_forward"])
    assert api_pages.documented_names(api_pages.render_page(page)) == {
        "refmath.softmax": ["softmax_forward"]}


def test_a_module_without_all_stops_the_pages(monkeypatch):
    monkeypatch.delattr(importlib.import_module("refmath.softmax"), "__all__")
    with pytest.raises(ValueError, match="refmath.softmax has no __all__"):
        api_pages.public_names("refmath.softmax")


def linked_objects():
    """The dotted names the catalogue lists as code and the pages link with ``{py:...}`` roles."""
    docs = ROOT / "docs"
    names = set(re.findall(r"`(refmath\.[\w.]+)`", (docs / "equations.md").read_text(encoding="utf-8")))
    for page in docs.glob("*.md"):
        names |= set(re.findall(r"\{py:(?:func|class|obj|data|meth|attr)\}`(?:[^`<]*<)?(refmath[\w.]+)>?`",
                                page.read_text(encoding="utf-8")))
    return sorted(names)


def test_the_catalogue_and_pages_link_only_documented_objects():
    links = linked_objects()
    assert len(links) > 100, links  # the catalogue's code column is read
    undocumented = []
    for dotted in links:
        if dotted in RENDERED:
            continue  # a module
        owner, _, name = dotted.rpartition(".")
        while owner and owner not in RENDERED:  # a method or field: refmath.optim.AdamW.step
            owner, _, name = owner.rpartition(".")
        if name not in RENDERED.get(owner, []):
            undocumented.append(dotted)
    assert not undocumented, f"linked but on no API page (add them to their module's __all__): {undocumented}"


def test_a_value_shows_its_own_comment_not_its_types_docstring():
    table = {"a": 1}
    assert api_pages.type_docstring_only(table, (dict.__doc__ or "").splitlines())
    assert not api_pages.type_docstring_only(table, ["The models by name."])
    assert not api_pages.type_docstring_only(table, [])


def test_a_long_value_is_shown_without_its_repr():
    assert api_pages.entry("refmath.models", "MODELS") == [
        ".. autodata:: refmath.models.MODELS", "   :no-value:", ""]
    assert api_pages.entry("refmath.attention", "ATTENTION_BACKENDS") == [
        ".. autodata:: refmath.attention.ATTENTION_BACKENDS", ""]
