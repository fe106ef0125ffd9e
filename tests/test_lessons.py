"""refmath.lessons: the one-line verdicts of the lessons' exercise checks, their diagnoses, and
the student copies of the lessons with their leak scan."""
import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refmath.lessons import (
    Verdict,
    catalogued,
    check_close,
    check_function,
    check_true,
    leaked_lines,
    lesson_paths,
    student_copy,
)


ROOT = Path(__file__).resolve().parents[1]


# every test starts from no miss and lenient checks (conftest.py)
pytestmark = pytest.mark.usefixtures("fresh_misses")


def test_a_right_answer_says_right_and_returns_true(capsys):
    assert check_close("the row", [0.25, 0.5, 0.25], np.array([1, 2, 1]) / 4)
    assert capsys.readouterr().out.startswith("right: the row")


def test_a_wrong_answer_names_the_index_and_the_tolerance_not_the_expected_value(capsys):
    expected = np.array([[1.0, 2.0], [3.0, 4.0]])
    got = expected.copy()
    got[1, 0] = 3.5
    assert not check_close("dX", got, expected, rtol=1e-6, hint="the second term")
    out = capsys.readouterr().out
    assert out.startswith("wrong: dX: error 0.5 at index (1, 0)") and "the second term" not in out
    assert not check_close("dX", got, expected, rtol=1e-6, hint="the second term")
    assert "the second term" in capsys.readouterr().out  # the hint comes with the second miss
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
    # the same infinity is no error (an empty state's m = -inf), another one is
    assert check_close("m", [-np.inf, 1.0], [-np.inf, 1.0]).line == "right: m: max error 0"
    assert not check_close("m", [np.inf, 1.0], [-np.inf, 1.0])


def test_strict_mode_raises_on_a_wrong_answer(monkeypatch):
    monkeypatch.setenv("REFMATH_LESSONS_STRICT", "1")
    with pytest.raises(AssertionError, match="wrong: s: your answer is 2 times the expected value"):
        check_close("s", 2.0, 1.0)
    with pytest.raises(AssertionError, match="no answer yet: s"):
        check_close("s", ..., 1.0)
    with pytest.raises(AssertionError, match="rows must sum to one"):
        check_true("sums", False, "rows must sum to one")
    assert check_true("sums", True, "rows must sum to one")


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="name"):
        check_close("", 1.0, 1.0)
    with pytest.raises(ValueError, match="rtol"):
        check_close("x", 1.0, 1.0, rtol=-1)


def test_a_verdict_is_true_when_right_and_jupyter_shows_nothing_of_it(capsys):
    verdict = check_close("x", 1.0, 1.0)
    assert isinstance(verdict, Verdict) and verdict and verdict.line.startswith("right: x")
    # IPython calls _ipython_display_ instead of showing the value: the cell shows no True/False
    assert verdict._ipython_display_() is None
    assert not check_close("x", 2.0, 1.0) and "Verdict('wrong: x" in repr(check_close("x", 2.0, 1.0))


def test_a_scalar_gets_a_factor_that_names_a_slip_and_never_the_ratio(capsys):
    # a factor that names a slip (a forgotten 1/2, sqrt(d_k), a mean over 3 rows) is said exactly
    assert not check_close("the loss", 2.0 * 4.0 / 3.0, 4.0 / 3.0, rtol=1e-12)
    out = capsys.readouterr().out
    assert "your answer is 2 times the expected value" in out and "1.33" not in out
    assert "1/sqrt(8) times" in check_close("dQ", 0.3 / np.sqrt(8), 0.3).line
    assert "3/2 times" in check_close("n", 1.5 * 0.7, 0.7).line
    assert not check_close("the loss", -0.75, 0.75)
    assert "the sign is flipped" in capsys.readouterr().out
    # any other ratio only gets a bracket: 2.47 x 4/3 is "between 2 and 3", not "2.47"
    line = check_close("the loss", 2.47 * 4.0 / 3.0, 4.0 / 3.0, rtol=1e-12).line
    assert "too large by a factor between 2 and 3" in line and "2.4" not in line
    assert "too small by a factor between 1.5 and 2" in check_close("w", 0.659, 1.0).line
    # a near miss does not print "got/expected 1", nor the digits that would make it right
    near = check_close("the loss", 0.60502, 0.99**50, rtol=1e-12).line
    assert "too large by less than a factor 1.1, beyond the tolerance of 1e-12" in near
    assert "0.605" not in near


@pytest.mark.parametrize("rtol", [1e-12, 1e-6, 1e-3, 0.02, 0.09])
def test_no_wrong_scalar_verdict_lets_the_expected_value_be_recovered(rtol):
    """A wrong answer's verdict cannot be inverted into the expected value to the tolerance: for
    every ratio got/expected that is not a factor naming a slip (an integer, its reciprocal, a
    square root, p/q), a second expected value, further from the true one than a factor
    (1 + rtol) / (1 - rtol), gives the same student answer the very same line: no single guess lies
    within the tolerance of both, so the line does not give the expected value away."""
    from refmath.lessons.checks import _named_factor

    expected = 0.8137
    draw = np.random.default_rng(0)
    ratios = np.concatenate([[0.659, 1.0001, 0.995, 1.013, 1.3, 2.47, 37.2, 1e5, -0.4, -3.3],
                             np.exp(draw.uniform(-8, 8, 300)) * draw.choice([-1, 1], 300)])
    apart = (1 + rtol) / (1 - rtol) * 1.001
    for c in ratios:
        got = float(c * expected)
        verdict = check_close("x", got, expected, rtol=rtol)
        if verdict or _named_factor(c) is not None:
            continue
        assert "0.81" not in verdict.line, verdict.line
        others = [check_close("x", got, expected * f, rtol=rtol).line for f in (apart, 1 / apart)]
        assert verdict.line in others, (c, rtol, verdict.line, others)


def test_an_array_that_is_a_multiple_gets_the_factor():
    expected = np.array([[0.5, -1.0], [0.0, 2.0]])
    assert "times 1/8" in check_close("dV", expected / 8, expected).line
    assert "sign is flipped everywhere" in check_close("dV", -expected, expected).line
    assert "too small by a factor between 1.1 and 1.25" in check_close("dV", expected / 1.17,
                                                                        expected).line


def test_a_printed_rounding_is_right_to_the_printed_precision_and_not_accepted():
    theta = np.array([1.0, -2.0]) - 0.1 * np.array([0.3, -0.1]) / (np.array([0.3, 0.1]) + 1e-8)
    verdict = check_close("theta", [0.9, -1.9], theta, rtol=1e-12)
    assert not verdict and verdict.line.startswith("almost: theta: right to 1 decimal only; "
                                                   "keep full precision")
    assert "right to 3 decimals only" in check_close("x log2 e", 4.328, 3 * np.log2(np.e), rtol=1e-12).line
    # a coarse rounding (0.6 for 0.605) is not a copied print but a wrong answer
    assert check_close("w", 0.6, 0.99**50, rtol=1e-12).line.startswith("wrong: w: too small by")
    # small entries printed to 4 decimals keep 2 significant digits: 0.0012 for 0.00118 is 1.7% off
    # (the 0.5% that a coarse rounding is held to), and is a copied print all the same; so is an
    # array whose small entries are printed with the large one's decimals
    for got, want in ((0.0012, 0.00118), ([0.5123, 0.0012, 0.0], [0.51234, 0.00118, 3e-5]),
                      ([0.33, 0.67], [1 / 3, 2 / 3])):
        verdict = check_close("g", got, want, rtol=1e-12)
        assert not verdict and verdict.line.startswith("almost: g: right to "), (got, verdict.line)
    # ...but never a single significant digit (0.001 for 0.00118), a whole number (2 heads for
    # 2.25, 12 for 12.4), one decimal off by more than 0.5% (1.2 for 1.18), or beyond half a step
    for got, want in ((0.001, 0.00118), (2.0, 2.25), (12.0, 12.4), (1.2, 1.18), (0.0013, 0.00118)):
        line = check_close("g", got, want, rtol=1e-12).line
        assert line.startswith("wrong: g: "), (got, line)


def test_a_known_slip_is_named_before_anything_else(capsys):
    expected = np.array([1.0, 2.0, 3.0])
    slips = {"the mean instead of the sum": expected / 3, "one row only": lambda: expected[:1]}
    assert check_close("dbeta", expected / 3, expected, slips=slips).line == \
        "wrong: dbeta: looks like: the mean instead of the sum"
    assert check_close("dbeta", [1.0], expected, slips=slips).line == \
        "wrong: dbeta: looks like: one row only"  # a slip may have another shape
    broken = {"cannot be computed": lambda: 1 / 0}  # such a slip is skipped, not an error
    # a slip copied from a print, rounded: the slip is named, then the rounding; the rounded right
    # answer is still only almost, never the slip
    thirds = np.array([1.0, 2.0]) / 3
    assert check_close("p", [0.111, 0.222], thirds, slips={"a third of it": thirds / 3}).line == \
        "wrong: p: looks like: a third of it; rounded as well, to 3 decimals"
    assert check_close("p", [0.333, 0.667], thirds, slips={"a third of it": thirds / 3}).line.startswith(
        "almost: p: right to 3 decimals only")
    assert "error 1 at index (2,)" in check_close("dbeta", [1.0, 2.0, 4.0], expected, slips=broken).line


def test_strict_mode_refuses_a_slip_the_check_cannot_tell_apart(monkeypatch):
    monkeypatch.setenv("REFMATH_LESSONS_STRICT", "1")
    expected = np.array([1.0, 0.0])
    with pytest.raises(AssertionError, match="passes as the right answer"):
        check_close("x", expected, expected, slips={"the sign flipped": -expected * 0 + expected})
    with pytest.raises(AssertionError, match="is reported as"):
        check_close("x", expected, expected, slips={"doubled": 2 * expected, "twice": 2 * expected})
    assert check_close("x", expected, expected, slips={"doubled": 2 * expected})
    with pytest.raises(AssertionError, match="the slip 'broken' cannot be computed"):
        check_close("x", expected, expected, slips={"broken": lambda: 1 / 0})


def test_a_catalogued_slip_runs_the_library_with_the_mistake():
    from refmath.norms import rmsnorm_backward, rmsnorm_forward

    x, dy = np.array([2.0, 4.0, 6.0, 8.0]), np.array([1.0, 0.0, 0.0, 0.0])
    _, cache = rmsnorm_forward(x, np.ones(4), eps=0.0)
    slip = catalogued("rmsnorm: r^2 instead of r^3", lambda: rmsnorm_backward(dy, cache)[0])
    (label, value), = slip.items()
    assert label.startswith("rmsnorm: r^2 instead of r^3 (")
    wrong = dy / np.sqrt(30) - x * np.mean(dy * x) / 30  # r^2 where r^3 belongs
    np.testing.assert_allclose(value(), wrong, rtol=1e-13)
    np.testing.assert_allclose(rmsnorm_backward(dy, cache)[0],  # the mistake is undone after
                               dy / np.sqrt(30) - x * np.mean(dy * x) / 30**1.5, rtol=1e-13)
    with pytest.raises(ValueError, match="no mistake named"):
        catalogued("not a mistake", lambda: 0)


def test_check_true_of_an_answer_waits_for_the_answer(capsys):
    assert check_true("positive", lambda a: a > 0, "must be positive", of=...).line.startswith(
        "no answer yet: positive")
    assert check_true("positive", lambda a: a > 0, "must be positive", of=2.0)
    raised = check_true("a row", lambda a: a.shape == (2,), "a row of two", of=3.0)
    assert not raised and "a row of two (checking your answer raised AttributeError" in raised.line
    with pytest.raises(TypeError, match="condition must be a function"):
        check_true("positive", True, "must be positive", of=2.0)


# ---- student copies ---------------------------------------------------------------------------------

LESSONS = lesson_paths()


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_no_solution_line_reaches_the_student_copy(path):
    from refmath.solutions import find_regions

    text = path.read_text()
    copy = student_copy(text, str(path))
    assert find_regions(copy) == [], f"{path.name}: a solution marker is left in the student copy"
    assert leaked_lines(text, copy, path.name) == []
    # The scan is not blind: any solution line put back into the copy is found.
    from refmath.solutions import region_lines

    secret = max(region_lines(text, find_regions(text)), key=len)
    planted = copy.replace("# your code here", secret, 1)
    assert leaked_lines(text, planted, path.name), f"{path.name}: a planted {secret!r} is not found"


def test_a_give_away_printed_before_an_exercise_is_gone():
    """The values lesson 05 asked for were printed just before the exercises; lesson 12's hint
    gave 3 log2 e. The prints now follow the checks."""
    text = (LESSONS[0].parent / "05_losses_and_optimisers.py").read_text()
    assert text.index('print(f"step {step}: m_hat') > text.index('check("05.5"')
    assert "0.99**50" not in text
    assert text.index('after 50 steps {path[-1]') > text.index('check("05.8"')
    assert "4.328" not in (LESSONS[0].parent / "12_from_equation_to_kernel.py").read_text()


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "refmath", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_the_lessons_command_writes_every_student_copy(tmp_path):
    run = _cli("lessons", "student", "--out", str(tmp_path / "student"))
    assert run.returncode == 0, run.stderr
    written = sorted(p.name for p in (tmp_path / "student").iterdir())
    assert written == [p.name for p in LESSONS]
    for path in LESSONS:
        copy = (tmp_path / "student" / path.name).read_text()
        assert copy == student_copy(path.read_text(), str(path))
        assert "# BEGIN SOLUTION" not in copy and "<!-- BEGIN SOLUTION -->" not in copy
    assert "jupyter lab" in run.stdout


def test_the_lessons_command_explains_itself_and_its_errors(tmp_path):
    assert "answer-free" in _cli("lessons", "--help").stdout
    helped = " ".join(_cli("lessons", "student", "--help").stdout.split())
    assert "--out DIR" in helped and "no answer yet" in helped
    afile = tmp_path / "a_file"
    afile.write_text("")
    for args, says in [(("lessons", "student", "--out", str(afile)), "is a file, not a folder"),
                       (("lessons", "student", "--out", str(tmp_path / "o"), "--from", str(tmp_path)),
                        "no lesson"),
                       (("lessons", "student", "--out", str(LESSONS[0].parent)),
                        "is the folder of the instructor lessons"),
                       (("lessons", "student"), "--out"),
                       (("lessons", "teacher"), "invalid choice")]:
        run = _cli(*args)
        assert run.returncode == 2 and says in run.stderr, (args, run.stderr)
        assert len(run.stderr.strip().splitlines()[-1]) > 0 and "Traceback" not in run.stderr
    assert not (tmp_path / "o").exists()


def test_the_lessons_command_refuses_a_folder_that_holds_work_unless_forced(tmp_path):
    """A student's edited lessons are not overwritten by a second run."""
    out = tmp_path / "student"
    out.mkdir()
    mine = out / LESSONS[0].name
    mine.write_text("my answers")
    run = _cli("lessons", "student", "--out", str(out))
    assert run.returncode == 2 and "is not empty" in run.stderr and "--force" in run.stderr
    assert mine.read_text() == "my answers" and [p.name for p in out.iterdir()] == [mine.name]
    run = _cli("lessons", "student", "--out", str(out), "--force")
    assert run.returncode == 0, run.stderr
    assert mine.read_text() == student_copy(LESSONS[0].read_text(), str(LESSONS[0]))


def test_the_packaged_student_copies_are_the_lessons_of_today():
    """The copies shipped in the package are made from notebooks/ as they are now, one per lesson."""
    from refmath.lessons import packaged_copies

    shipped = packaged_copies()
    assert sorted(shipped) == [p.name for p in LESSONS], \
        "refresh them: python -c 'import refmath.lessons as l; l.refresh_packaged_copies()'"
    stale = [p.name for p in LESSONS if shipped[p.name] != student_copy(p.read_text(), str(p))]
    assert not stale, (f"packaged student copies out of date: {stale}; refresh them: "
                       "python -c 'import refmath.lessons as l; l.refresh_packaged_copies()'")


def test_the_student_route_needs_no_checkout(tmp_path):
    """What a wheel holds (setuptools' build_py of a copy of the checkout: the modules and the
    package data, no compiled module) writes the student lessons with no checkout on the path,
    and nothing it writes holds an answer."""
    pytest.importorskip("setuptools", minversion="77")
    pytest.importorskip("pybind11")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if files.returncode != 0:
        pytest.skip("not a git checkout: nothing to build from")
    copy = tmp_path / "checkout"
    for rel in filter(None, files.stdout.split("\0")):
        if (ROOT / rel).is_file():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, copy / rel)
    lib = tmp_path / "lib"
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)],
                           cwd=copy, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "REFMATH_CUDA": "0"})
    assert built.returncode == 0, built.stdout + built.stderr
    assert not (lib / "notebooks").exists() and (lib / "refmath" / "student_lessons").is_dir()

    out, home = tmp_path / "my lessons", tmp_path / "home"
    home.mkdir()
    # The checkout's own folder (the editable install's .pth entry) leaves the path; a virtual
    # environment inside the checkout (.venv, where CI keeps NumPy) stays.
    script = (f"import os, sys, runpy\n"
              f"sys.path[:] = [{str(lib)!r}] + [p for p in sys.path if p and "
              f"os.path.realpath(p) != {os.path.realpath(ROOT)!r}]\n"
              f"sys.argv = ['refmath', 'lessons', 'student', '--out', {str(out)!r}]\n"
              f"import refmath\n"
              f"assert refmath.__file__.startswith({str(lib)!r}), refmath.__file__\n"
              f"runpy.run_module('refmath', run_name='__main__')\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=home, capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in out.iterdir()) == [p.name for p in LESSONS]
    for path in LESSONS:
        written = (out / path.name).read_text()
        assert written == student_copy(path.read_text(), str(path))
        assert leaked_lines(path.read_text(), written, path.name) == []
        assert "BEGIN SOLUTION" not in written


# ---- write-the-function exercises -------------------------------------------------------------------

def _softmax_backward_by_hand(dout, cache):
    a = cache.a
    return a * (dout - np.sum(a * dout, axis=-1, keepdims=True))


def test_a_right_backward_passes_the_gradient_check_and_agrees_with_the_library(capsys):
    from refmath.softmax import softmax_backward

    verdict = check_function("your softmax backward", _softmax_backward_by_hand, softmax_backward,
                             case="softmax[rows*")
    assert verdict and verdict.line.startswith(
        "right: your softmax backward: passes the gradient check on 1 case (largest error")
    assert "agrees with refmath's softmax_backward on 1 input" in verdict.line
    assert capsys.readouterr().out.strip() == verdict.line


def test_an_unwritten_function_has_no_answer_yet():
    from refmath.softmax import softmax_backward

    def stub(dout, cache):
        dx = ...
        return dx

    def raises(dout, cache):
        raise NotImplementedError("write this part")

    def half_written(x):
        m, l = x, ...
        return m, l

    for func in (stub, raises, ..., None):
        line = check_function("f", func, softmax_backward, case="softmax[rows*").line
        assert line.startswith("no answer yet: f"), line
    assert check_function("f", half_written, lambda x: (x, x), inputs=[(1.0,)]).line.startswith(
        "no answer yet: f")


def _layernorm_backward_by_hand(dout, cache):
    """The student's own LayerNorm backward (the checks refuse the library's, called or not)."""
    xhat, rstd, gamma = cache
    rows = tuple(range(dout.ndim - 1))
    g = dout * gamma
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
    return dx, np.sum(dout * xhat, axis=rows), np.sum(dout, axis=rows)


def test_a_wrong_backward_names_its_slip_and_the_failing_gradient_check():
    from refmath.norms import layernorm_backward

    slips = {**catalogued("layernorm: dbeta averaged over rows", layernorm_backward),
             **catalogued("layernorm: gamma left out of dx", layernorm_backward)}

    def averaged(dout, cache):
        dx, dgamma, dbeta = _layernorm_backward_by_hand(dout, cache)
        return dx, dgamma, dbeta / 3  # the case has 3 rows: the mean is the sum / 3

    verdict = check_function("LN", averaged, layernorm_backward, case="layernorm[rows (3, 8)]",
                             slips=slips)
    assert not verdict
    assert verdict.line.startswith("wrong: LN: looks like: layernorm: dbeta averaged over rows (")
    assert "the gradient check fails on layernorm[rows (3, 8)]: dbeta has relative error" in verdict.line
    # without the slip the diagnosis is the ratio of the output that differs
    plain = check_function("LN", averaged, layernorm_backward, case="layernorm[rows (3, 8)]").line
    assert "dbeta on layernorm[rows (3, 8)]: your answer is the expected one times 1/3" in plain


def test_a_function_that_raises_or_returns_the_wrong_kind_is_wrong_and_says_where():
    from refmath.norms import layernorm_backward

    def two_d_only(dout, cache):
        if dout.ndim != 2:
            raise IndexError("only (N, d)")
        return _layernorm_backward_by_hand(dout, cache)

    line = check_function("LN", two_d_only, layernorm_backward,
                          case=["layernorm[rows*", "layernorm[one row*"]).line
    assert line == ("wrong: LN: your function raised IndexError: only (N, d) "
                    "(on layernorm[one row (6,)])"), line
    line = check_function("LN", lambda d, c: _layernorm_backward_by_hand(d, c)[:2], layernorm_backward,
                          case="layernorm[rows*").line
    assert line.startswith("wrong: LN: your function returns the wrong gradients: ") and \
        "dx, dgamma, dbeta" in line


def test_a_forward_function_is_called_on_copies_and_its_named_outputs_compared():
    from refmath.softmax import online_softmax_block, online_softmax_merge

    rng = np.random.default_rng(0)
    pairs = [(online_softmax_block(rng.standard_normal((2, 3)), rng.standard_normal((3, 2))),
              online_softmax_block(rng.standard_normal((2, 4)), rng.standard_normal((4, 2))))]

    def unrescaled(a, b):
        a.u[...] = 0.0  # an update in place reaches neither the reference nor the next call
        return type(a)(np.maximum(a.m, b.m), a.l + b.l, b.u)

    def unrescaled_slip(a, b):
        return type(a)(np.maximum(a.m, b.m), a.l + b.l, a.u + b.u)

    def merge_by_hand(a, b):
        m = np.maximum(a.m, b.m)
        alpha, beta = np.exp(a.m - m), np.exp(b.m - m)  # the pairs' m are finite
        return type(a)(m, alpha * a.l + beta * b.l, alpha[..., None] * a.u + beta[..., None] * b.u)

    assert check_function("merge", merge_by_hand, online_softmax_merge, inputs=pairs)
    line = check_function("merge", unrescaled, online_softmax_merge, inputs=pairs).line
    assert line.startswith("wrong: merge: l on input 1: "), line
    line = check_function("merge", unrescaled_slip, online_softmax_merge, inputs=lambda: pairs,
                          slips={"no rescaling": unrescaled_slip}).line
    assert line == "wrong: merge: looks like: no rescaling"


def test_the_torch_oracle_is_used_where_torch_is_there_and_skipped_where_not(monkeypatch):
    from refmath.softmax import softmax_backward

    def torch_softmax(x):
        import torch
        return torch.softmax(x, -1)

    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        line = check_function("f", _softmax_backward_by_hand, softmax_backward,
                              case="softmax[rows*", oracle=torch_softmax).line
        assert "agrees with refmath's softmax_backward and torch autograd" in line
        # the oracle is independent: a reference that is wrong disagrees with it
        wrong = check_function("f", _softmax_backward_by_hand, lambda d, c: _softmax_backward_by_hand(d, c),
                               case="softmax[rows*", oracle=lambda x: 2 * torch_softmax(x)).line
        assert wrong.startswith("wrong: f: against torch, dx on softmax[rows (3, 7)]: ") and \
            "times 1/2" in wrong
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    line = check_function("f", _softmax_backward_by_hand, softmax_backward, case="softmax[rows*",
                          oracle=torch_softmax).line
    assert line.startswith("right: f: ") and line.endswith("torch is not installed: its check is skipped")

    def torch_doubling(x):  # a forward oracle that needs torch: skipped, not an error
        import torch
        return torch.tensor(x).mul(2).numpy()

    line = check_function("double", lambda x: 2 * x, lambda x: x + x, inputs=[(np.arange(3.0),)],
                          oracle=torch_doubling, oracle_name="torch's mul",
                          reference_name="the sum x + x").line
    assert line == ("right: double: agrees with the sum x + x on 1 input; torch is not installed: "
                    "its check is skipped")


def test_strict_mode_refuses_a_function_slip_the_check_cannot_tell_apart(monkeypatch):
    from refmath.softmax import softmax_backward

    monkeypatch.setenv("REFMATH_LESSONS_STRICT", "1")
    with pytest.raises(AssertionError, match="passes as the right function"):
        check_function("f", _softmax_backward_by_hand, softmax_backward, case="softmax[rows*",
                       slips={"the same": _softmax_backward_by_hand})
    doubled = {"doubled": lambda d, c: 2 * _softmax_backward_by_hand(d, c),
               "twice": lambda d, c: _softmax_backward_by_hand(d, c) * 2}
    with pytest.raises(AssertionError, match="the slip 'twice' is reported as 'doubled'"):
        check_function("f", _softmax_backward_by_hand, softmax_backward, case="softmax[rows*",
                       slips=doubled)
    with pytest.raises(AssertionError, match="wrong: f: looks like: doubled"):
        check_function("f", doubled["doubled"], softmax_backward, case="softmax[rows*",
                       slips={"doubled": doubled["doubled"]})


def test_check_function_refuses_bad_arguments():
    from refmath.softmax import softmax_backward

    with pytest.raises(ValueError, match="exactly one of case= .* and inputs="):
        check_function("f", softmax_backward, softmax_backward)
    with pytest.raises(ValueError, match="matches no op case"):
        check_function("f", softmax_backward, softmax_backward, case="no such op*")
    with pytest.raises(TypeError, match="slips must be a mapping"):
        check_function("f", softmax_backward, softmax_backward, case="softmax*", slips={"x": 1})
    assert check_function("f", 3, softmax_backward, case="softmax[rows*").line == \
        "wrong: f: not a function but a int"


# ---- the library refused as an answer -----------------------------------------------------------------

def test_the_library_function_itself_is_refused_as_the_answer(capsys):
    """``my_softmax_backward = softmax_backward`` was accepted: the check now names the library
    function and asks for the student's own."""
    import functools

    from refmath import softmax
    from refmath.softmax import softmax_backward

    def calls_it(dout, cache):
        return softmax_backward(dout, cache)

    def calls_it_by_another_name(dout, cache):
        return getattr(softmax, "softmax_" + "backward")(dout * 1.0, cache)

    @functools.wraps(softmax_backward)
    def wraps_it(dout, cache):
        return softmax_backward(dout, cache)

    for func, verb in [(softmax_backward, "is"), (calls_it, "calls"), (lambda d, c: softmax_backward(d, c), "calls"),
                       (calls_it_by_another_name, "calls"), (wraps_it, "wraps"),
                       (functools.partial(softmax_backward), "is")]:
        verdict = check_function("your softmax backward", func, softmax_backward, case="softmax[rows*")
        assert not verdict
        assert verdict.line == (f"wrong: your softmax backward: this {verb} "
                                "refmath.softmax.softmax_backward: write it yourself"), verdict.line
    # the student's own code still passes, at full speed of its own
    assert check_function("your softmax backward", _softmax_backward_by_hand, softmax_backward,
                          case="softmax[rows*")


def test_a_lessons_own_reference_refuses_the_library_functions_it_is_made_of(capsys):
    """A forward exercise's reference written in the lesson (an optimiser step through the
    library's AdamW) refuses the AdamW the student could call; the NumPy the student writes is
    accepted, and so is a refmath function the reference does not use."""
    from refmath.optim import AdamW
    from refmath.softmax import softmax_forward

    def library_step(theta, grad):
        params = {"w": theta.copy()}
        AdamW(lr=0.1, weight_decay=0.1).step(params, {"w": grad})
        return params["w"]

    def by_hand(theta, grad):
        softmax_forward(np.zeros(2))  # harmless: not what the exercise asks for
        return (1 - 0.1 * 0.1) * theta - 0.1 * grad / (np.abs(grad) + 1e-8)

    def through_the_library(theta, grad):
        return library_step(theta, grad)

    inputs = [(np.array([1.0, -2.0]), np.array([0.3, -0.1]))]
    assert check_function("your AdamW step", by_hand, library_step, inputs=inputs, rtol=1e-12)
    verdict = check_function("your AdamW step", through_the_library, library_step, inputs=inputs)
    assert verdict.line == ("wrong: your AdamW step: this calls refmath.optim.Optimizer.step: "
                            "write it yourself"), verdict.line  # AdamW's step is its base's
    # refuse= adds a function the reference does not call
    verdict = check_function("your AdamW step", by_hand, library_step, inputs=inputs,
                             refuse=(softmax_forward,))
    assert "this calls refmath.softmax.softmax_forward" in verdict.line


# ---- exercises by number, hints rationed ---------------------------------------------------------

def test_a_numbered_check_computes_its_expected_value_from_the_lessons_inputs(capsys):
    """check("05.1", answer) reads the lesson's logits and targets from the caller, computes the
    expected gradient in refmath.lessons, and names a slip on the first miss with the section to
    reread; the formula comes on the second miss, or from hint()."""
    from refmath.lessons import check, hint
    from refmath.softmax import softmax_forward

    logits = np.array([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 0.5, 0.0]])
    targets = np.array([0, 2, 1])
    p = softmax_forward(logits)[0]
    assert check("05.1", ...).line.startswith("no answer yet: dloss/dlogits")
    assert check("05.1", (p - np.eye(4)[targets]) / 3)
    first = check("05.1", p - np.eye(4)[targets]).line
    assert "looks like: not divided by the number of positions" in first
    assert "reread the section 'L2, L3" in first and "p - onehot" not in first
    second = check("05.1", p - np.eye(4)[targets]).line
    assert "p - onehot(target), divided by the number of positions" in second
    hint("05.3")
    assert capsys.readouterr().out.splitlines()[-1].startswith("hint: the last row of dlogits (sum): p - y")
    with pytest.raises(ValueError, match="no exercise numbered '05.99'"):
        check("05.99", 1.0)
    del logits
    with pytest.raises(NameError, match="reads the lesson's logits"):
        check("05.1", p)


def test_a_set_of_parameters_is_checked_by_name_and_shape_before_its_numbers():
    """07.7, a dict of parameters compared through flat_parameters: a key renamed where it sorts
    as the right one did, or a (1, n) row for an (n,) vector, holds the right numbers in the right
    positions and was taken as right; a key missing or added was only a length. Each is wrong now,
    and the verdict names the key."""
    from refmath.lessons import check
    from refmath.optim import AdamW

    draw = np.random.default_rng(0)
    before = {"tok_emb": draw.standard_normal((5, 4)), "layers.0.attn.w_q": draw.standard_normal((4, 4)),
              "layers.0.ffn.b1": draw.standard_normal(8), "layers.0.ffn.b2": draw.standard_normal(4),
              "ln_f.beta": draw.standard_normal(4), "ln_f.gamma": draw.standard_normal(4)}
    stepped = {name: value.copy() for name, value in before.items()}
    AdamW(lr=0.1, weight_decay=0.5).step(stepped, {n: np.zeros_like(v) for n, v in stepped.items()})
    assert check("07.7", stepped)
    assert check("07.7", dict(reversed(stepped.items())))  # the order of the keys is free
    name = "wrong: parameters after one AdamW step: "
    for answer, words in (
            ({("ln_f.bias" if k == "ln_f.beta" else k): v for k, v in stepped.items()},
             "missing: ln_f.beta; unexpected: ln_f.bias"),
            ({**stepped, "layers.0.ffn.b1": stepped["layers.0.ffn.b1"][None]},
             "layers.0.ffn.b1 has shape (1, 8), expected (8,)"),
            ({**stepped, "layers.0.ffn.b1": stepped["layers.0.ffn.b1"][None],
              "layers.0.ffn.b2": stepped["layers.0.ffn.b2"][:, None]},
             "layers.0.ffn.b1 has shape (1, 8), expected (8,) (1 more parameter of another shape"),
            ({k: v for k, v in stepped.items() if k != "ln_f.beta"}, "missing: ln_f.beta"),
            ({**stepped, "extra": np.zeros(3)}, "unexpected: extra"),
            ({k: v for k, v in stepped.items() if not k.startswith("l")},
             "missing: layers.0.attn.w_q, layers.0.ffn.b1, layers.0.ffn.b2, ln_f.beta and 1 more"),
            (np.concatenate([v.ravel() for v in stepped.values()]), "not what the exercise asks "
             "for (TypeError: flat_parameters: expected a dict of arrays by parameter name")):
        line = check("07.7", answer).line
        assert line.startswith(name + words), line
    # the numbers are still compared, and the wrong one named by its parameter
    line = check("07.7", {**stepped, "tok_emb": stepped["tok_emb"] + 1e-3 * (np.arange(20) == 6).reshape(5, 4)}).line
    assert line.startswith(name + "error 0.001 at tok_emb[1, 2]"), line


def test_the_fused_and_the_swapped_parameters_are_checked_by_name_and_shape_too():
    """08.2 and 01.5 compare a dict of weights as 07.7 does: a reshaped w_qkv, a key added or a
    key renamed is wrong, named; the right dict in any key order is right."""
    from refmath.lessons import check

    draw = np.random.default_rng(1)
    d, h, g, d_h = 4, 2, 1, 2
    separate = {"w_q": draw.standard_normal((d, h * d_h)), "w_k": draw.standard_normal((d, g * d_h)),
                "w_v": draw.standard_normal((d, g * d_h)), "w_o": draw.standard_normal((h * d_h, d))}
    w_qkv = np.concatenate([separate["w_q"], separate["w_k"], separate["w_v"]], axis=1)
    fused = {"w_qkv": w_qkv, "w_o": separate["w_o"]}
    assert check("08.2", fused) and check("08.2", {"w_o": separate["w_o"], "w_qkv": w_qkv})
    name = "wrong: the fused parameters: "
    for answer, words in (({"w_qkv": w_qkv.reshape(8, 4), "w_o": separate["w_o"]},
                           "w_qkv has shape (8, 4), expected (4, 8)"),
                          ({**fused, "b_qkv": np.zeros(8)}, "unexpected: b_qkv"),
                          ({"w_qkv_t": w_qkv, "w_o": separate["w_o"]},
                           "missing: w_qkv; unexpected: w_qkv_t")):
        line = check("08.2", answer).line
        assert line.startswith(name + words), line

    d = 8
    params = {k: draw.standard_normal((d, d)) for k in ("w_q", "w_k", "w_v", "w_o")}
    d_h = 4
    order = np.r_[d_h:2 * d_h, 0:d_h]
    swapped = {**{k: params[k][:, order] for k in ("w_q", "w_k", "w_v")}, "w_o": params["w_o"][order]}
    assert check("01.5", swapped)
    line = check("01.5", {**swapped, "b_q": np.zeros(d)}).line
    assert line.startswith("wrong: the parameters with heads 0 and 1 swapped: unexpected: b_q"), line


def test_adam_without_eps_is_named_not_taken_for_a_copied_print(capsys):
    from refmath.lessons import check

    line = check("05.5", np.array([1.0, -2.0]) - 0.1 * np.sign([0.3, -0.1])).line
    assert "looks like: eps left out of the denominator" in line and "decimals only" not in line


def test_the_adamw_step_exercise_refuses_the_library_and_takes_a_step_written_out(capsys):
    """Exercise 05.7 (a whole AdamW step): refmath's own step, handed in or called, is refused;
    the step written from the equations is right."""
    from refmath.lessons import check
    from refmath.lessons.expected.lesson05_losses_and_optimisers import _library_adamw_step

    def calls_adamw(theta, g, m, v, s, lr, betas, eps, weight_decay):
        from refmath.optim import AdamW

        optimiser = AdamW(lr, betas, eps, weight_decay=weight_decay, decay_of=lambda n: weight_decay)
        optimiser.state["m"]["w"], optimiser.state["v"]["w"] = m.copy(), v.copy()
        optimiser.step_count = s - 1
        params = {"w": theta.copy()}
        optimiser.step(params, {"w": g})
        return params["w"], optimiser.state["m"]["w"], optimiser.state["v"]["w"]

    def written_out(theta, g, m, v, s, lr, betas, eps, weight_decay):
        (b1, b2) = betas
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        step = lr * (m / (1 - b1**s)) / (np.sqrt(v / (1 - b2**s)) + eps)
        return (1 - lr * weight_decay) * theta - step, m, v

    assert "write it yourself" in check("05.7", _library_adamw_step).line
    line = check("05.7", calls_adamw).line
    assert line.startswith("wrong: your AdamW step: this calls refmath.optim.") and \
        line.endswith("write it yourself"), line
    assert check("05.7", written_out), capsys.readouterr().out
    assert check("05.7", ...).line.startswith("no answer yet")


CHECK_CALLS = ("check", "check_close", "check_true", "check_function")
ONE_CALL = ("check", "check_function")
# check cells in the student copies that are not one check(...) or check_function(...) call;
# this number may only go down (a check converted to a numbered exercise lowers it)
CHECK_CELLS_NOT_ONE_CALL = 8


def _called(node) -> str | None:
    """The name a call calls (``check`` for ``check(...)`` and ``lessons.check(...)``)."""
    return getattr(node.func, "id", getattr(node.func, "attr", None)) if isinstance(node, ast.Call) else None


def _check_cells_not_one_call(text: str) -> int:
    """The code cells of ``text`` that call a check but are not exactly one check(...) or
    check_function(...) call: a check_close or check_true, or a check beside other statements
    (a slip's helper function, a loop), each of which shows code the student should not need."""
    count = 0
    for cell in text.split("\n# %%")[1:]:
        header, _, body = cell.partition("\n")
        if header.lstrip().startswith("[markdown]"):
            continue
        try:
            tree = ast.parse(body)
        except SyntaxError:
            continue
        calls = {_called(n) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        if not calls & set(CHECK_CALLS):
            continue
        # the import of the reference a check compares with (imported there, after the exercise,
        # so that the student copy holds no library answer before the attempt) computes nothing
        body = [n for n in tree.body if not isinstance(n, ast.ImportFrom)]
        single = (len(body) == 1 and isinstance(body[0], ast.Expr)
                  and _called(body[0].value) in ONE_CALL)
        count += not single
    return count


def _check_cells_giving_away(text: str) -> list[str]:
    """The check cells of ``text`` whose source shows what a check should keep to itself: a
    ``hint=`` (often the formula), ``slips=`` (the wrong answers, one edit from the right one), a
    function defined there (a slip, or the reference computation), or a direct
    ``check_function(...)`` (whose arguments carry all of these). A ``check_true``'s condition on
    the answer (a shape, a sign) is a property, not an answer, and is counted by the ratchet below
    instead. Each cell found is one line of the list."""
    found = []
    for cell in text.split("\n# %%")[1:]:
        header, _, body = cell.partition("\n")
        if header.lstrip().startswith("[markdown]") or "exercise" in header:
            continue
        try:
            tree = ast.parse(body)
        except SyntaxError:
            continue
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _called(n) in CHECK_CALLS]
        if not calls:
            continue
        shown = sorted({f"{k.arg}=" for c in calls for k in c.keywords if k.arg in ("hint", "slips")}
                       | {"check_function(...)" for c in calls if _called(c) == "check_function"}
                       | {"def" for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
                       | {"a lambda among its slips" for c in calls for k in c.keywords
                          if k.arg == "slips" and any(isinstance(n, ast.Lambda) for n in ast.walk(k))})
        if shown:
            found.append(f"{body.strip().splitlines()[0][:60]!r}: {', '.join(shown)}")
    return found


def test_no_check_cell_shows_a_hint_a_slip_or_the_reference():
    """A write-the-function exercise's check cell is one call, check("05.4", my_function), like a
    value exercise's: its hint, slips and reference live in refmath.lessons.expected, where the
    student's copy does not show them before the attempt."""
    from refmath.lessons import packaged_copies

    found = {name: _check_cells_giving_away(text) for name, text in packaged_copies().items()}
    too_many = {name: cells for name, cells in found.items()
                if cells}
    assert not too_many, too_many
    # the scan sees each way a check cell can give the answer away
    assert _check_cells_giving_away('\n# %%\ncheck("05.4", f)\n') == []
    assert _check_cells_giving_away('\n# %%\nfrom refmath.ffn import g\n\ncheck("05.4", f)\n') == []
    for shown in ('check_close("x", x, 1, hint="p - y")', 'check_close("x", x, 1, slips={"a": 2})',
                  'def slip(a):\n    return a\ncheck("05.4", f)',
                  'check_function("f", f, g, case="gelu[*")'):
        assert len(_check_cells_giving_away(f"\n# %%\n{shown}\n")) == 1, shown
    assert _check_cells_giving_away('\n# %%\ncheck_true("x", lambda d: d > 0, "why", of=x)\n') == []


def test_check_cells_are_one_numbered_call_a_ratchet():
    """A check cell shows the student one call, check("05.3", answer), whose expected value is
    computed in refmath.lessons; a check_close whose expected computation is in the cell is
    counted, and the count may not grow."""
    from refmath.lessons import packaged_copies

    per_lesson = {name: _check_cells_not_one_call(text)
                  for name, text in sorted(packaged_copies().items())}
    left = {name: n for name, n in per_lesson.items() if n}
    print("check cells that are not one check(...) call:", left)
    total = sum(per_lesson.values())
    assert total <= CHECK_CELLS_NOT_ONE_CALL, (
        f"{total} check cells are not one check(...)/check_function(...) call "
        f"(at most {CHECK_CELLS_NOT_ONE_CALL}): {left}")
    assert _check_cells_not_one_call('# %%\ncheck("05.1", x)\n\n# %%\ncheck_close("a", x, 1)\n') == 1
    assert _check_cells_not_one_call('# %%\nfrom refmath.ffn import gelu_backward\n\n'
                                     'check_function("f", f, gelu_backward, case="gelu[*")\n') == 0
