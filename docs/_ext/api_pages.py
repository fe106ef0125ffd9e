"""The API reference: one page per row of the module table in ``docs/api.md``, in its order.

Each page documents its modules (a package brings all its public submodules): the module's
docstring, then one autodoc entry for each name of its ``__all__``, in that order, and nothing
else. So ``__all__`` is the one list of what a module offers: a name added there appears in the
docs by itself, and a public module without one stops the build. A public module that no row
names still gets documented, on a last page of other modules; ``tests/test_docs.py`` checks that
every public module lands on some page and that each page shows exactly its modules' ``__all__``.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from typing import NamedTuple

from lesson_pages import write_if_changed


# A value whose repr is longer than this is shown without it (its entry says where it is defined).
LONGEST_VALUE = 200


class ApiPage(NamedTuple):
    slug: str              # file name under docs/api/
    title: str
    summary: str           # the table's description of the group (markdown)
    modules: list[str]     # dotted module names, in the order documented


def public_modules(package: str = "refmath") -> list[str]:
    """Every importable module of the package whose dotted name has no part starting with ``_``."""
    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            names.append(info.name)
    return names


def table_groups(api_page: str) -> list[tuple[list[str], str]]:
    """The module table of ``docs/api.md`` as (module names, description) pairs: each row whose
    first cell names ``refmath`` modules (linked to their page or not)."""
    groups = []
    for line in api_page.splitlines():
        if not line.startswith("| "):
            continue
        first, _, description = line.strip().strip("|").partition("|")
        names = re.findall(r"`(refmath[\w.]*)`", first)
        if names:
            groups.append((names, description.strip()))
    return groups


def plan_pages(api_page: str, modules: list[str]) -> list[ApiPage]:
    """The API pages: the table's groups, each module with its submodules, then the rest."""
    pages, placed = [], set()
    for names, summary in table_groups(api_page):
        members = [m for m in modules if any(m == n or m.startswith(n + ".") for n in names)]
        members = [m for m in members if m not in placed]
        placed.update(members)
        slug = "-".join(n.removeprefix("refmath.") for n in names)
        pages.append(ApiPage(slug, ", ".join(names), summary, members))
    rest = [m for m in modules if m not in placed and m != "refmath"]
    if rest:
        pages.append(ApiPage("other", "Other modules",
                             "Public modules that the table does not list.", rest))
    return pages


def public_names(module: str) -> list[str]:
    """What ``module`` offers: its ``__all__``, in order. A package without one offers only its
    submodules (nothing of its own); any other module without one is an error, since the pages
    would otherwise have to guess which of its names a user is meant to call."""
    imported = importlib.import_module(module)
    names = getattr(imported, "__all__", None)
    if names is None and hasattr(imported, "__path__"):
        return []
    if names is None:
        raise ValueError(f"{module} has no __all__: every public module lists what it offers there, "
                         f"and its API entry shows exactly those names")
    return list(names)


def entry(module: str, name: str) -> list[str]:
    """The autodoc directive for one name of ``module``: a class with its members (a NamedTuple's
    fields, a dataclass's attributes, the methods), a function, or a value (whose repr is shown
    only when it is short: a table such as ``MODELS`` is read in its source)."""
    obj = getattr(importlib.import_module(module), name)
    if inspect.isclass(obj):
        return [f".. autoclass:: {module}.{name}", "   :members:", "   :undoc-members:", ""]
    if callable(obj):
        return [f".. autofunction:: {module}.{name}", ""]
    short = len(repr(obj)) <= LONGEST_VALUE
    return [f".. autodata:: {module}.{name}"] + ([] if short else ["   :no-value:"]) + [""]


def render_page(page: ApiPage) -> str:
    """A page of each module's docstring followed by an entry for each name of its ``__all__``."""
    out = [f"# {page.title}", "", page.summary, ""]
    for module in page.modules:
        if len(page.modules) > 1:
            out += [f"## `{module}`", ""]
        out += ["```{eval-rst}", f".. automodule:: {module}", ""]
        for name in public_names(module):
            out += entry(module, name)
        out += ["```", ""]
    return "\n".join(out)


def documented_names(page_text: str) -> dict[str, list[str]]:
    """``{module: [name, ...]}`` as a rendered page documents them, read back from its
    directives."""
    found: dict[str, list[str]] = {}
    for kind, dotted in re.findall(r"^\.\. auto(module|class|function|data):: ([\w.]+)$", page_text,
                                   re.MULTILINE):
        if kind == "module":
            found[dotted] = []
        else:
            module, _, name = dotted.rpartition(".")
            found.setdefault(module, []).append(name)
    return found


def type_docstring_only(obj, lines: list[str]) -> bool:
    """Whether ``lines`` are only the docstring of ``obj``'s type (``dict``'s, ``int``'s), which
    autodoc shows for a value that has no comment of its own."""
    own = inspect.getdoc(type(obj)) or ""
    return bool(lines) and " ".join(" ".join(lines).split()) == " ".join(own.split())


def render_index(pages: list[ApiPage]) -> str:
    """The toctree of the API pages (the table in ``docs/api.md`` links them), and a line for the
    page of modules the table does not list, if there is one."""
    out = ["```{toctree}", ":hidden:", ""] + [f"api/{p.slug}" for p in pages] + ["```", ""]
    out += [f"[{p.title}](api/{p.slug}.md): {p.summary}" for p in pages if p.slug == "other"]
    return "\n".join(out) + "\n"


def write_api_pages(root: Path, folder: Path, index: Path) -> list[ApiPage]:
    """Write one page per group into ``folder`` and the index fragment into ``index``."""
    pages = plan_pages((root / "docs" / "api.md").read_text(encoding="utf-8"), public_modules())
    for page in pages:
        write_if_changed(folder / f"{page.slug}.md", render_page(page))
    for stale in set(folder.glob("*.md")) - {folder / f"{p.slug}.md" for p in pages}:
        stale.unlink()
    write_if_changed(index, render_index(pages))
    return pages
