"""The documentation site's API pages cover the whole public API (without building the site).

docs/_ext/api_pages.py plans one page per row of the module table in docs/api.md and documents
each module with autodoc's automodule. Autodoc documents a module's functions and classes whose
``__module__`` is that module; these tests read the source files themselves to check that every
public module has a page and every public top-level function and class of it (those its
``__all__`` lists, where it has one) is one that autodoc will show there.
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


def public_definitions(module):
    """Names of the top-level ``def`` and ``class`` statements of a module's source, not private."""
    tree = ast.parse(Path(importlib.import_module(module).__file__).read_text(encoding="utf-8"))
    return [node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not node.name.startswith("_")]


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
def test_every_public_definition_is_shown_on_its_module_page(module):
    imported = importlib.import_module(module)
    listed = getattr(imported, "__all__", None)  # autodoc shows only these where there are some
    hidden = [name for name in public_definitions(module) if listed is None or name in listed
              if getattr(getattr(imported, name, None), "__module__", None) != module]
    assert not hidden, f"{module}: autodoc would not show {hidden} (not defined as {module}.<name>)"
    page = api_pages.render_page(next(p for p in PAGES if module in p.modules))
    assert f".. automodule:: {module}\n   :members:\n   :undoc-members:" in page
