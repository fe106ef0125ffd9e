"""benchmarks/paired_builds.py: two builds of the compiled module loaded side by side.

Two copies of this session's own compiled module stand in for the builds before and after a
change: they hold the same code, so every output of the second must equal the first's bit for bit,
and the script must say so (a largest difference of 0). A tiny context keeps it to a second."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from refmath import kernels

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "paired_builds.py"

pytestmark = [
    pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built"),
    pytest.mark.skipif(not SCRIPT.exists(), reason="no benchmarks/ beside the tests"),
]


def _two_builds(tmp_path):
    import refmath._C as compiled

    trees = []
    for name in ("before", "after"):
        package = tmp_path / name / "refmath"
        package.mkdir(parents=True)
        shutil.copy(compiled.__file__, package)
        trees.append(str(tmp_path / name))
    return trees


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


def test_decode_workload_times_both_builds_and_finds_their_outputs_equal(tmp_path):
    before, after = _two_builds(tmp_path)
    done = _run(before, after, "--workload", "decode", "--context", "64", "--rounds", "1")
    assert done.returncode == 0, done.stderr
    assert "[0] contiguous" in done.stdout
    line = next(row for row in done.stdout.splitlines() if row.lstrip().startswith("[1]"))
    assert re.search(r"paired x[0-9.]+ contiguous, x[0-9.]+ paged", line), line
    assert line.endswith("largest difference from [0]'s output 0.0e+00"), line


def test_the_same_compiled_file_twice_is_refused_by_name(tmp_path):
    before, _ = _two_builds(tmp_path)
    done = _run(before, before, "--workload", "decode", "--context", "64")
    assert done.returncode != 0
    assert "same file as build [0]'s" in done.stderr


def test_a_context_off_the_page_size_is_refused(tmp_path):
    before, after = _two_builds(tmp_path)
    done = _run(before, after, "--workload", "decode", "--context", "100")
    assert done.returncode == 2
    assert "--context (100) must be a positive multiple of --page-size (16)" in done.stderr
