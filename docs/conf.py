"""Sphinx configuration of refmath's documentation site.

Build: ``python -m sphinx -W -b html docs docs/_build/html`` from the repository root (the ``docs``
extra installs what it needs). Before reading any page, ``generate_pages`` writes what is derived
from the repository: the lessons mirrored from ``notebooks/``, the API pages grouped as the table
of ``api.md`` groups the modules, the equation catalogue from ``docs/equations.md``, the kernel
headers, the recorded benchmark runs, the changelog from ``CHANGELOG.md`` and the BibTeX entry.
Those files are build outputs (``.gitignore`` lists them): edit their sources instead. No page
reads the README, which is the repository's front door and changes on its own.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(ROOT), str(DOCS / "_ext")]

import refmath  # noqa: E402  (after the path is set: the checkout's refmath, not another install)
from api_pages import type_docstring_only, write_api_pages  # noqa: E402
from benchmark_records import write_records  # noqa: E402
from catalogue_page import write_catalogue  # noqa: E402
from changelog_page import write_changelog  # noqa: E402
from citation_page import write_bibtex  # noqa: E402
from kernel_ladder import write_ladder  # noqa: E402
from field_comments import field_comments  # noqa: E402
from lesson_pages import answers_wanted, mirror_lessons  # noqa: E402
from reading_order import write_reading_order  # noqa: E402
from sphinx.util import logging  # noqa: E402

# The default site is the students': lessons without their answers. REFMATH_DOCS_ANSWERS=1 builds
# the instructor's site, with them, and says so in every page's title.
ANSWERS = answers_wanted(os.environ)

project = "refmath"
author = "The refmath developers"
copyright = "The refmath developers, MIT licence"
release = version = refmath.__version__

extensions = [
    "myst_nb",                    # MyST markdown pages and the executed lessons
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",     # MathJax served from _static: the site works offline
]

# Pages only: the extensions, this file and the checker scripts are not documents, and
# equations.md is rendered as the generated catalogue page instead of as a raw table.
exclude_patterns = ["_build", "_ext", "_generated", "jupyter_execute", "*.py", "equations.md",
                    "screenshots"]

# The lessons are py:percent scripts; jupytext turns them into notebooks for myst-nb.
nb_custom_formats = {".py": ["jupytext.reads", {"fmt": "py:percent"}]}
nb_execution_mode = "cache"           # re-execute a lesson only when its text changed
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True    # a lesson that fails fails the build
nb_execution_in_temp = True           # lessons that write files write them in a temporary folder
nb_merge_streams = True
# The kernel inherits this: figures drawn by plt.show() become PNG outputs (under Agg, which a
# headless shell may have set, they would be dropped silently).
os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3              # lesson sections are linked from the catalogue by anchor

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True      # dtype=np.float64 as written, not <class 'numpy.float64'>
napoleon_google_docstring = False     # docstrings are reStructuredText; only NumPy-style sections
napoleon_numpy_docstring = True       # would be rewritten, and the library has none today

# MathJax draws \top as a thin bar that all but vanishes at 1x: the transpose is an upright T
mathjax3_config = {"tex": {"macros": {"top": r"{\mathsf{T}}"}}}

html_theme = "pydata_sphinx_theme"
html_static_path = ["_static"]
html_css_files = ["refmath.css"]
html_title = "refmath (instructor build, with answers)" if ANSWERS else "refmath"
html_theme_options = {
    "navigation_with_keys": False,
    "header_links_before_dropdown": 8,
    "show_toc_level": 2,
    "footer_start": ["copyright"],
    "footer_end": [],
}
# Single pages have no section to navigate: without the empty left sidebar, their wide tables and
# kernel headers get the room. The lessons and the API pages keep it (it lists their siblings).
html_sidebars = {page: [] for page in ("index", "start/*", "install", "commands", "lessons",
                                       "gradcheck", "hf", "architecture", "catalogue", "api",
                                       "layout", "kernels", "security", "changelog", "cite")}


def generate_pages(app, config):
    """Write the derived pages before Sphinx looks for documents."""
    generated = DOCS / "_generated"
    lessons = mirror_lessons(ROOT, DOCS / "lessons", answers=ANSWERS)
    write_reading_order(lessons, generated / "reading_order.md")
    write_api_pages(ROOT, DOCS / "api", generated / "api_index.md")
    write_catalogue(ROOT, generated / "catalogue.md")
    write_ladder(ROOT, generated / "kernel_ladder.md")
    write_records(ROOT, generated / "benchmark_records.md")
    write_changelog(ROOT, generated / "changelog.md")
    write_bibtex(ROOT, generated / "citation.bib")


def warn_on_missing_catalogue_link(app, env, node, contnode):
    """A catalogue entry that names a function the API pages do not document is a build error."""
    if node.get("refdoc") == "catalogue" and node.get("refdomain") == "py":
        logging.getLogger(__name__).warning(
            "catalogue: %s is not documented on any API page", node["reftarget"], location=node)


def describe_named_tuple_fields(app, what, name, obj, options, lines):
    """A NamedTuple's field says what its source comment says (``q: np.ndarray  # (..., t_q, d_k)``)
    instead of autodoc's "Alias for field number 0"."""
    if what != "attribute" or not lines or not lines[0].startswith("Alias for field number"):
        return
    owner_name, _, field = name.rpartition(".")
    module_name, _, class_name = owner_name.rpartition(".")
    comments = field_comments(module_name, class_name)
    if field in comments:
        lines[:] = [comments[field]]


def drop_type_docstrings(app, what, name, obj, options, lines):
    """A value's entry (``MODELS``, ``PRESETS``) shows its own comment or nothing, never the
    docstring of its type (``dict``'s) that autodoc falls back to."""
    if what == "data" and type_docstring_only(obj, lines):
        lines[:] = []


def setup(app):
    app.connect("config-inited", generate_pages)
    app.connect("autodoc-process-docstring", describe_named_tuple_fields)
    app.connect("autodoc-process-docstring", drop_type_docstrings)
    app.connect("missing-reference", warn_on_missing_catalogue_link)
