"""The catalogue page's helpers (docs/_ext): reading the tables, finding lesson sections, turning
the shared catalogue's plain-text formulas into LaTeX. The build itself (``-W``) checks that every
generated link resolves; these check the rules it relies on."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
pytest.importorskip("myst_parser", reason="the catalogue page needs the 'docs' extra (myst-parser)")

from ascii_math import ascii_to_latex, markdown_with_math  # noqa: E402
from catalogue_page import (docstring_math, ids_in_heading, read_catalogue,  # noqa: E402
                            read_shared_statements, render_catalogue, split_row)


def test_a_pipe_inside_backticks_is_not_a_cell_border():
    assert split_row("| L1 | factorisation `p(y|x)` | notes |") == ["L1", "factorisation `p(y|x)`", "notes"]


@pytest.mark.parametrize("heading, ids", [
    ("A1: queries, keys and values", {"A1"}),
    ("N1-N3: the worked example", {"N1", "N2", "N3"}),
    ("O3, O4, O7: weight decay", {"O3", "O4", "O7"}),
    ("S1 and S2: memory for serving", {"S1", "S2"}),
    ("Every decoder learns", set()),
])
def test_lesson_headings_name_their_ids_with_ranges_expanded(heading, ids):
    assert ids_in_heading(heading) == ids


@pytest.mark.parametrize("ascii, latex", [
    ("q k^T / sqrt(d_k)", r"q k^T / \sqrt{d_k}"),
    ("sqrt(mean(x^2) + eps)", r"\sqrt{\text{mean}(x^2) + \epsilon}"),
    ("s_ij = a_ij", "s_{ij} = a_{ij}"),
    ("q^C k^C^T", "q^C k^{C}{}^T"),
    ("m_hat = g", r"\hat{m} = g"),
    ("T x T", r"T \times T"),
    ("sum_j e^{s_j}", r"\sum_j e^{s_j}"),
])
def test_plain_text_formulas_become_latex(ascii, latex):
    assert ascii_to_latex(ascii) == latex


def test_prose_keeps_its_words_and_gains_inline_maths():
    assert markdown_with_math("RMSNorm `x / sqrt(d)`; no bias") == r"RMSNorm $x / \sqrt{d}$; no bias"


def test_docstring_equation_is_taken_only_from_a_docstring_that_names_the_id():
    assert r"\gamma" in docstring_math("refmath.norms.layernorm_forward", "N1")
    assert docstring_math("refmath.norms.layernorm_forward", "A1") is None


def test_without_the_shared_catalogue_each_entry_still_has_its_description_and_links(tmp_path):
    assert read_shared_statements(tmp_path / "absent" / "EQUATIONS.md") == {}
    rows = read_catalogue((ROOT / "docs" / "equations.md").read_text(encoding="utf-8"))
    (row,) = [r for r in rows if r.eq_id == "N1"]
    page = render_catalogue([row], {}, ROOT)
    assert f"## N1: {row.what}" in page
    assert "{py:obj}`norms.layernorm_forward <refmath.norms.layernorm_forward>`" in page
    assert f"(lessons/{Path(row.lessons[0]).name}#" in page  # the section of the lesson, by anchor
