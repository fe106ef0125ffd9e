"""refmath.lessons: the one-line verdicts of the lessons' exercise checks."""
import numpy as np
import pytest

from refmath.lessons import check_close, check_true


@pytest.fixture(autouse=True)
def lenient(monkeypatch):
    monkeypatch.delenv("REFMATH_LESSONS_STRICT", raising=False)


def test_a_right_answer_says_right_and_returns_true(capsys):
    assert check_close("the row", [0.25, 0.5, 0.25], np.array([1, 2, 1]) / 4)
    assert capsys.readouterr().out.startswith("right: the row")


def test_a_wrong_answer_names_the_index_and_the_tolerance_not_the_expected_value(capsys):
    expected = np.array([[1.0, 2.0], [3.0, 4.0]])
    got = expected.copy()
    got[1, 0] = 3.5
    assert not check_close("dX", got, expected, rtol=1e-6, hint="the second term")
    out = capsys.readouterr().out
    assert out.startswith("wrong: dX: error 0.5 at index (1, 0)") and "the second term" in out
    assert "3.0" not in out and "[[" not in out


def test_shape_nan_and_unanswered_are_each_explained(capsys):
    assert not check_close("y", np.zeros(3), np.zeros((3, 1)))
    assert "shape (3,), expected (3, 1)" in capsys.readouterr().out
    assert not check_close("y", [np.nan, 1.0], [0.0, 1.0])
    assert "NaN where a number is expected" in capsys.readouterr().out
    assert not check_close("y", ..., lambda: 1 / 0)  # the expected value is never computed
    assert "no answer yet" in capsys.readouterr().out


def test_nan_expected_where_nan_is_given_is_right():
    assert check_close("masked row", [np.nan, 2.0], [np.nan, 2.0])


def test_strict_mode_raises_on_a_wrong_answer(monkeypatch):
    monkeypatch.setenv("REFMATH_LESSONS_STRICT", "1")
    with pytest.raises(AssertionError, match="wrong: s: error 1"):
        check_close("s", 2.0, 1.0)
    with pytest.raises(AssertionError, match="rows must sum to one"):
        check_true("sums", False, "rows must sum to one")
    assert check_true("sums", True, "rows must sum to one")


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="name"):
        check_close("", 1.0, 1.0)
    with pytest.raises(ValueError, match="rtol"):
        check_close("x", 1.0, 1.0, rtol=-1)


def test_a_stripped_lesson_runs_and_says_no_answer_yet(tmp_path):
    """The student version of a lesson runs to the end; each check reports the missing answer."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from refmath.solutions import find_regions, strip_notebook

    lesson = Path(__file__).resolve().parents[1] / "notebooks" / "05_losses_and_optimisers.py"
    student = strip_notebook(lesson.read_text(), str(lesson))
    assert find_regions(student) == [] and "# your code here" in student
    script = tmp_path / "lesson.py"
    script.write_text(student)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "MPLBACKEND": "Agg",
                                            "REFMATH_LESSONS_STRICT": "0"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("no answer yet") >= 3
