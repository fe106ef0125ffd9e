"""The lessons on the documentation site: the student copies by default, the answers only in the
instructor build (``REFMATH_DOCS_ANSWERS=1``), and the leak scan before anything is written.

These tests need no Sphinx: ``docs/_ext/lesson_pages.py`` is what ``docs/conf.py`` calls to put
the lessons where Sphinx reads them.
"""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import lesson_pages  # noqa: E402

from refmath import lessons  # noqa: E402
from refmath.solutions import find_regions  # noqa: E402


def test_the_default_site_shows_the_student_copies(tmp_path):
    copies = lesson_pages.mirror_lessons(ROOT, tmp_path)
    sources = lesson_pages.lesson_sources(ROOT)
    assert [c.name for c in copies] == [s.name for s in sources] and len(copies) >= 14
    for source, copy in zip(sources, copies):
        text, shown = source.read_text(), copy.read_text()
        assert shown == lesson_pages.hide_check_cells(lessons.student_copy(text, str(source)))
        assert find_regions(shown) == [] and "# BEGIN SOLUTION" not in shown
        assert lessons.leaked_lines(text, shown, source.name) == []


def test_the_instructor_build_shows_the_answers(tmp_path):
    copies = lesson_pages.mirror_lessons(ROOT, tmp_path, answers=True)
    for source, copy in zip(lesson_pages.lesson_sources(ROOT), copies):
        assert copy.read_text() == source.read_text()


@pytest.mark.parametrize("value, wanted", [(None, False), ("", False), ("0", False), ("1", True),
                                           ("yes", True)])
def test_the_switch_is_one_environment_variable(value, wanted):
    environ = {} if value is None else {"REFMATH_DOCS_ANSWERS": value}
    assert lesson_pages.answers_wanted(environ) is wanted


def test_a_solution_line_that_would_reach_the_site_stops_the_build(tmp_path, monkeypatch):
    # A stripping that leaves the answers in (the identity) must be caught, with nothing written.
    monkeypatch.setattr(lessons, "student_copy", lambda text, where="": text)
    with pytest.raises(ValueError, match="solution lines would reach the student site"):
        lesson_pages.mirror_lessons(ROOT, tmp_path / "site")
    assert not (tmp_path / "site").exists()


def test_the_built_student_site_is_scanned_for_answers(tmp_path):
    # docs/check_student_site.py reads the built pages: an answer that reached a page's code cell
    # (split into highlighted spans, as Pygments writes it) is found; the student page is clean
    sys.path.insert(0, str(ROOT / "docs"))
    import check_student_site

    lesson = ROOT / "notebooks" / "04_ffn_and_positions.py"
    regions = find_regions(lesson.read_text(encoding="utf-8"), str(lesson))
    secret = next(line for line in lesson.read_text(encoding="utf-8").splitlines()[
        regions[0].begin + 1:regions[0].end] if len(line.strip()) > 20).strip()
    pages = tmp_path / "lessons"
    pages.mkdir()
    student = lessons.student_copy(lesson.read_text(encoding="utf-8"), str(lesson))
    (pages / lesson.with_suffix(".html").name).write_text(
        "<html><body><pre>" + student.replace("<", "&lt;") + "</pre></body></html>")
    assert check_student_site.leaks(tmp_path) == (1, [])
    spans = "".join(f"<span class=\"n\">{part}</span> " for part in secret.replace("<", "&lt;").split())
    (pages / lesson.with_suffix(".html").name).write_text(
        f"<html><body><div class=\"highlight\"><pre>{spans}</pre></div></body></html>")
    checked, found = check_student_site.leaks(tmp_path)
    assert checked == 1 and len(found) == 1 and secret.split()[0] in found[0]


def test_every_check_cell_of_the_student_site_is_hidden_and_nothing_else(tmp_path):
    # myst-nb renders a cell tagged remove-input as its outputs only: the verdict, not the check's
    # expected value or slips. Read as myst-nb reads them (jupytext), every code cell that calls a
    # check carries the tag, no other cell does, and the student copy is otherwise unchanged.
    jupytext = pytest.importorskip("jupytext", reason="the lessons need the 'dev' extra (jupytext)")
    hidden = 0
    for source, copy in zip(lesson_pages.lesson_sources(ROOT),
                            lesson_pages.mirror_lessons(ROOT, tmp_path)):
        for cell in jupytext.read(copy).cells:
            tagged = lesson_pages.HIDDEN in cell.metadata.get("tags", [])
            calls = cell.cell_type == "code" and bool(lesson_pages.CHECK_CALL.search(cell.source))
            assert tagged == calls, f"{source.name}: cell {cell.source[:60]!r}: tagged {tagged}"
            hidden += tagged
        student = lessons.student_copy(source.read_text(), str(source))
        assert copy.read_text().replace(', "remove-input"', "").replace(
            ' tags=["remove-input"]', "") == student
    calls = sum(len(lesson_pages.CHECK_CALL.findall(s.read_text()))
                for s in lesson_pages.lesson_sources(ROOT))
    print(f"{hidden} check cells hidden, {calls} check calls in them")
    assert hidden >= 16 and calls >= hidden


def test_a_tag_is_added_to_the_tags_a_check_cell_has():
    text = ('# %% tags=["exercise"]\nx = ...\n\n# %%\ncheck("01.1", x)\n\n# %% [markdown]\n'
            '# check("01.1", x) in prose\n\n# %% tags=["extra"]\n# check(x) in a comment\n'
            'def f():\n    check_true("y", True, "why")\n\n# %% tags=["keep"]\n'
            'check_function("f", f, g, inputs=[()])\n')
    hidden = lesson_pages.hide_check_cells(text)
    assert hidden.splitlines()[3] == '# %% tags=["remove-input"]'
    assert '# %% tags=["keep", "remove-input"]' in hidden
    assert hidden.count("remove-input") == 2 and lesson_pages.hide_check_cells(hidden) == hidden


def test_the_built_student_site_shows_no_check_source(tmp_path):
    # a check call in a page's code cell (highlighted spans, as Pygments writes it) is found; the
    # verdict it prints, in the cell's output, and a check named in the prose are not
    sys.path.insert(0, str(ROOT / "docs"))
    import check_student_site

    pages = tmp_path / "lessons"
    pages.mkdir()
    cell = ('<div class="cell docutils container"><div class="cell_input docutils container">'
            '<div class="highlight-ipython3 notranslate"><div class="highlight"><pre>{code}</pre>'
            '</div></div></div><div class="cell_output docutils container"><div class="output '
            'stream highlight-myst-ansi notranslate"><div class="highlight"><pre>'
            'no answer yet: the masked output</pre></div></div></div></div>')
    call = ('<span class="n">check</span><span class="p">(</span><span class="s2">"01.1"</span>'
            '<span class="p">,</span> <span class="n">o_masked</span><span class="p">)</span>')
    prose = "<p>The check, <code>check(\"01.1\", answer)</code>, says no answer yet.</p>"
    page = pages / "01_attention.html"
    page.write_text(f"<html><body>{prose}{cell.format(code='x = 1')}</body></html>")
    assert check_student_site.shown_checks(tmp_path) == (1, [])
    shown = cell.format(code="x = 1\n" + call)
    page.write_text(f"<html><body>{prose}{shown}</body></html>")
    assert check_student_site.shown_checks(tmp_path) == (
        1, ['lessons/01_attention.html: check("01.1", o_masked)'])
