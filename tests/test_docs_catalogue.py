"""The catalogue page's helpers (docs/_ext): reading the tables, finding lesson sections, turning
the shared catalogue's plain-text formulas into LaTeX. The build itself (``-W``) checks that every
generated link resolves; these check the rules it relies on."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))
pytest.importorskip("myst_parser", reason="the catalogue page needs the 'docs' extra (myst-parser)")

from ascii_math import ascii_to_latex, markdown_with_math, plain_text_formulas  # noqa: E402
from catalogue_page import (docstring_math, heading, ids_in_heading, read_catalogue,  # noqa: E402
                            read_shared_statements, render_catalogue, split_row)

ROWS = read_catalogue((ROOT / "docs" / "equations.md").read_text(encoding="utf-8"))


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


@pytest.mark.parametrize("what", [
    "softmax Jacobian a_j (delta_ju - a_u)", "Var(q k^T) = d_k, hence the 1/sqrt(d_k) scale",
    "cross-attention, m x n scores", "paging: ceil(T/p) pages, position j at page j // p, offset j % p",
    "empty blocks carried as m = -inf", "AdamW mixed-precision training memory 16P",
    "position interpolation: `omega'_r = omega_r / s`", "time per token >= bytes / bandwidth",
])
def test_a_formula_written_in_plain_text_is_found(what):
    assert plain_text_formulas(what), what


@pytest.mark.parametrize("what", [
    r"softmax Jacobian $a_j (\delta_{ju} - a_u)$", r"rule of thumb $2P$ plus about 20%",
    'SFT loss over answer tokens only, as their sum (`reduction="sum"`) or mean',
    "DeepSeek's `mscale_all_dim` softmax-scale correction", "LongRoPE (Phi-3): per-pair divisors",
    "symmetric int8/int4 quantiser with per-group scales",
])
def test_inline_maths_code_and_names_are_not_plain_text_formulas(what):
    assert plain_text_formulas(what) == []


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.eq_id)
def test_every_heading_sets_its_formulas_as_maths(row):
    """The "What" cells are the catalogue page's headings: each formula in them is ``$...$``
    maths that MyST renders (none left in plain text, none with a $ unclosed)."""
    assert plain_text_formulas(row.what) == [], \
        f"{row.eq_id}: write the formulas of its What cell as $...$ maths: {row.what!r}"
    assert heading(row)[1] == f"## {row.eq_id}: {row.what}"


def test_a_heading_keeps_its_anchor_and_refuses_maths_that_would_print_as_text():
    (a5,) = [r for r in ROWS if r.eq_id == "A5"]
    assert heading(a5) == ["(a5)=", r"## A5: softmax Jacobian $a_j (\delta_{ju} - a_u)$"]
    # the label, not the heading's text, is the anchor that links use: catalogue.html#a5
    assert "(a5)=\n## A5: softmax Jacobian $" in render_catalogue([a5], {}, ROOT)
    with pytest.raises(ValueError, match=r"A5: the What cell .* leaves a \$ unclosed"):
        heading(a5._replace(what="softmax Jacobian $a_j"))
    with pytest.raises(ValueError, match="A5: .* with a space inside its \\$ signs"):
        heading(a5._replace(what="softmax Jacobian $ a_j$"))


def test_docstring_equation_is_taken_only_from_a_docstring_that_names_the_id():
    assert r"\gamma" in docstring_math("refmath.norms.layernorm_forward", "N1")
    assert docstring_math("refmath.norms.layernorm_forward", "A1") is None


def test_without_the_shared_catalogue_each_entry_still_has_its_description_and_links(tmp_path):
    assert read_shared_statements(tmp_path / "absent" / "EQUATIONS.md") == {}
    (row,) = [r for r in ROWS if r.eq_id == "N1"]
    page = render_catalogue([row], {}, ROOT)
    assert f"## N1: {row.what}" in page
    assert "{py:obj}`norms.layernorm_forward <refmath.norms.layernorm_forward>`" in page
    assert f"(lessons/{Path(row.lessons[0]).name}#" in page  # the section of the lesson, by anchor
