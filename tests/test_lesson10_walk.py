"""What the student walk-through of lesson 10 found (issue 47, walkb), each a test: a property
check that accepted a wrong answer, and answers readable in the student copy before their check.

The slips the walk-through found unnamed are planted in tests/test_lesson_slips.py (PLANTS).
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LESSON = "10_decode_cost.py"


def _said(number, answer, inputs, capsys, strict=False):
    """The verdict line ``check(number, answer)`` prints from a namespace holding ``inputs``."""
    from refmath.lessons import check

    os.environ["REFMATH_LESSONS_STRICT"] = "1" if strict else "0"
    capsys.readouterr()
    exec("check(number, answer)", {**inputs, "check": check, "number": number, "answer": answer})
    return capsys.readouterr().out.strip()


@pytest.fixture(autouse=True)
def _fresh_misses(monkeypatch):
    import refmath.lessons.checks

    monkeypatch.setattr(refmath.lessons.checks, "_MISSES", {})
    monkeypatch.setenv("REFMATH_LESSONS_STRICT", "0")


# ---- 10.5: "error at most half a step" passed the x_hat of a wrong scale ---------------------------

def test_10_5c_the_error_of_a_wrong_scale_is_wrong(capsys):
    x = np.array([3.5, -1.2, 0.3, 2.0])
    s = 3.5 / 7  # by hand: max |x| / q_max, q_max = 7 for 4 bits
    right = np.abs(x - s * np.clip(np.round(x / s), -7, 7))
    assert _said("10.5c", right, {"x": x}, capsys, strict=True).startswith("right: ")
    # the walk's answer: 10.5a's slip s = max |x| / 8 carried into x_hat; its errors all lie
    # within half of the right step, so the old check_true (|x - x_hat| <= 0.25) said right
    s8 = 3.5 / 8
    x_hat_8 = s8 * np.round(x / s8)
    assert np.all(np.abs(x - x_hat_8) <= s / 2)
    said = _said("10.5c", np.abs(x - x_hat_8), {"x": x}, capsys)
    assert said.startswith("wrong: ") and "max |x| / 8" in said, said
    said = _said("10.5b", x_hat_8, {"x": x}, capsys)
    assert said.startswith("wrong: ") and "max |x| / 8" in said, said
    assert _said("10.5c", ..., {"x": x}, capsys).startswith("no answer yet: ")


def test_10_5_no_half_step_literal_in_the_copy():
    # the old check cell held s / 2 = 0.25 for this x, which gives 10.5a's s = 0.5 away
    from refmath.lessons import student_copy

    student = student_copy((NOTEBOOKS / LESSON).read_text(), LESSON)
    assert "0.25" not in student
