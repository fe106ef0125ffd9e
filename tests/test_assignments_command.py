"""What an instructor meets at the terminal: the grader's summary, ``assignments build``'s --out
and the time limits. None of it runs student code, so neither torch nor a sandbox is needed."""
from __future__ import annotations

import re

import pytest

from refmath.assignments import manifest as manifests
from refmath.assignments.grade import summary, with_time_limit
from refmath.commands import main

FEEDBACK = ("sdpa_backward, inputs (2, 3, 5, 4), (2, 3, 5, 4), (2, 3, 5, 4): dq relative error "
            "3.1e-04 against the tolerance 1e-11 of PyTorch autograd in float64")


def _results(output: str) -> dict:
    return {"score": 0, "max_score": 2, "execution_time": 1.5, "output": "Attention: 0 / 2",
            "extra_data": {"sandbox": "bwrap"},
            "tests": [{"name": "sdpa_backward_plain", "score": 0, "max_score": 2,
                       "output": output + "\nsecond line"}]}


@pytest.mark.parametrize("width", [40, 60, 100])
def test_the_summary_wraps_feedback_between_words_and_keeps_its_end(width):
    text = summary(_results(FEEDBACK), width=width)
    feedback = text.splitlines()[1:-1]
    assert " ".join(line.strip() for line in feedback) == FEEDBACK  # nothing lost, nothing cut
    assert all(line.startswith(" " * 11) and len(line) <= width for line in feedback)


def test_a_single_long_word_is_kept_whole():
    word = "x" * 150
    assert word in summary(_results(word)).splitlines()[1]


def test_time_limits_are_set_up_or_down():
    limits = manifests.load("attention").limits
    assert (with_time_limit(limits, 2).wall_s, with_time_limit(limits, 2).cpu_s) == (2, 2)
    assert with_time_limit(limits, 300).wall_s == 300 and with_time_limit(limits, 300).cpu_s == 300
    assert with_time_limit(limits, None) == limits
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="time limit"):
            with_time_limit(limits, bad)


def test_grade_refuses_a_time_limit_that_is_no_time(capsys):
    assert main(["assignments", "grade", "attention", ".", "--time-limit", "0"]) == 2
    assert re.fullmatch(r"refmath assignments: --time-limit must be [^\n]*> 0, got 0.0\n",
                        capsys.readouterr().err)


def test_build_refuses_a_folder_that_holds_files_unless_force(tmp_path, capsys):
    out = tmp_path / "release"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert main(["assignments", "build", "attention", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not empty: give --force" in err and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert main(["assignments", "build", "attention", "--out", str(out), "--force"]) == 0
    assert {"student", "autograder", "notes.txt"} == {p.name for p in out.iterdir()}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["assignments", "build", "attention", "--out", str(empty)]) == 0


def test_list_says_each_assignments_time_limits(capsys):
    assert main(["assignments", "list"]) == 0
    out = capsys.readouterr().out
    for name in manifests.names():
        limits = manifests.load(name).limits
        assert f"within {limits.wall_s:g} s wall-clock, {limits.cpu_s:g} s CPU)" in \
            next(line for line in out.splitlines() if line.startswith(f"{name}: "))
