"""What the student walk-through of lesson 10 found (issue 47, walkb), each a test: a property
check that accepted a wrong answer, and answers readable in the student copy before their check.

The slips the walk-through found unnamed are planted in tests/test_lesson_slips.py (PLANTS).
"""
import os
from pathlib import Path

import numpy as np
import pytest

from _support import run_lesson

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LESSON = "10_decode_cost.py"


# every test starts from no miss and lenient checks (conftest.py); ``said`` is its fixture
pytestmark = pytest.mark.usefixtures("fresh_misses")


# ---- 10.5: "error at most half a step" passed the x_hat of a wrong scale -------------------

def test_10_5c_the_error_of_a_wrong_scale_is_wrong(said):
    x = np.array([3.5, -1.2, 0.3, 2.0])
    s = 3.5 / 7  # by hand: max |x| / q_max, q_max = 7 for 4 bits
    right = np.abs(x - s * np.clip(np.round(x / s), -7, 7))
    assert said("10.5c", right, {"x": x}, strict=True).startswith("right: ")
    # the walk's answer: 10.5a's slip s = max |x| / 8 carried into x_hat; its errors all lie
    # within half of the right step, so the old check_true (|x - x_hat| <= 0.25) said right
    s8 = 3.5 / 8
    x_hat_8 = s8 * np.round(x / s8)
    assert np.all(np.abs(x - x_hat_8) <= s / 2)
    line = said("10.5c", np.abs(x - x_hat_8), {"x": x})
    assert line.startswith("wrong: ") and "max |x| / 8" in line, line
    line = said("10.5b", x_hat_8, {"x": x})
    assert line.startswith("wrong: ") and "max |x| / 8" in line, line
    assert said("10.5c", ..., {"x": x}).startswith("no answer yet: ")


def test_10_5_no_half_step_literal_in_the_copy():
    # the old check cell held s / 2 = 0.25 for this x, which gives 10.5a's s = 0.5 away
    from refmath.lessons import student_copy

    student = student_copy((NOTEBOOKS / LESSON).read_text(), LESSON)
    assert "0.25" not in student


# ---- answers at hand before their check: 10.3's cache, 10.4's traffic ---------------------

def _namespace_before(number, tmp_path):
    """The student copy's variables when its run reaches ``check("number", ...)``: every cell
    above it executed, as a student running the lesson in order has them."""
    from refmath.lessons import student_copy

    student = student_copy((NOTEBOOKS / LESSON).read_text(), LESSON)
    call = f'check("{number}"'
    assert student.count(call) == 1
    namespace = {"__name__": "__main__"}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(student[:student.index(call)], LESSON, "exec"), namespace)
    finally:
        os.chdir(cwd)
    return namespace


def test_10_3_and_10_4_no_variable_holds_their_answer(tmp_path, monkeypatch):
    # walkb answered 10.3 with two more decode steps on the cache of the cell above (after a
    # prefill of 5 and one step, or the 6 tokens of 10.1's cell: either reaches 5 + 3 tokens), and
    # 10.4 with step.total_bytes / 2e12, step computed above the exercise
    from refmath.inference.kv_cache import KVCache
    from refmath.sizing import StepTraffic

    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = _namespace_before("10.4", tmp_path)
    caches = [name for name, value in namespace.items() if isinstance(value, KVCache)]
    traffic = [name for name, value in namespace.items() if isinstance(value, StepTraffic)]
    assert not caches and not traffic, (caches, traffic)


# (the exercise's check call, text of the copy that gives its answer away)
BEFORE_THE_CHECK = [
    ('check("10.4"', "step = decode_step_traffic"),
    ('check("10.4"', "format_bytes(step.weight_bytes)"),
    ('check("10.3"', "P = 5\n"),
]


@pytest.mark.parametrize("call,answer", BEFORE_THE_CHECK)
def test_the_student_copy_holds_no_answer_before_its_check(call, answer):
    from refmath.lessons import student_copy

    student = student_copy((NOTEBOOKS / LESSON).read_text(), LESSON)
    assert student.count(call) == 1
    assert answer not in student[:student.index(call)], f"{answer!r} before {call}"


# ---- nor anywhere in the copy's text or output: the student site executes the copies -----------

def test_no_expected_value_anywhere_in_an_unanswered_copy(tmp_path):
    """test_notebooks scans what a student reads before each check; the student site shows the
    whole executed copy at once (every cell's output but the checks'), so a print after a check
    must wait for the answer too."""
    import json

    from refmath.lessons import RECORD, student_copy
    from test_notebooks import _gives_away

    text = student_copy((NOTEBOOKS / LESSON).read_text(), LESSON)
    records = tmp_path / "expected.jsonl"
    run = run_lesson(text, tmp_path, LESSON, **{RECORD: str(records)})
    assert run.returncode == 0, run.stderr[-2000:]
    recorded = [json.loads(line) for line in records.read_text().splitlines()]
    assert {r["name"] for r in recorded} >= {
        "cached keys of layer 0", "visible pairs after a prefill of 5 and 3 steps",
        "lower bound on time per token", "scale", "x_hat",
        "the error |x - x_hat|, at most half a step", "weight bytes a token reads in Q8_0",
        "the bound in tokens/s in Q8_0"}
    shown = [(r["name"], _gives_away(r["value"], run.stdout) or _gives_away(r["value"], text))
             for r in recorded]
    assert not [s for s in shown if s[1]], shown
    # 10.4's bytes over the live bandwidth (printed beside it) give 10.4's answer to 2-3 digits
    assert "on this machine: at least" not in run.stdout


# ---- text -------------------------------------------------------------------------------------

def test_10_no_prose_line_over_100_characters():
    # walkb: one markdown line of the K13 section was left unwrapped by an edit (135 characters)
    long = [n for n, line in enumerate((NOTEBOOKS / LESSON).read_text().splitlines(), 1)
            if line.startswith("# ") and len(line) > 100]
    assert not long, long


def test_10_5_the_quantiser_module_is_not_at_hand_before_its_check():
    # walkb reached quantize/dequantize through the module of QuantizedKVCache, imported in the
    # first cell; it is now imported after 10.5's checks, with quantize and dequantize
    from refmath.lessons import student_copy

    student = student_copy((NOTEBOOKS / LESSON).read_text(), LESSON)
    assert "refmath.inference.quantized" not in student[:student.index('check("10.5c"')]
