"""benchmarks/paired_builds.py: two builds of the compiled module loaded side by side.

Two copies of this session's own compiled module stand in for the builds before and after a
change: they hold the same code, so every output of the second must equal the first's bit for bit,
and the script must say so (a largest difference of 0). A tiny context keeps it to a second."""
from __future__ import annotations

import os
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


def _run(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_decode_workload_times_both_builds_and_finds_their_outputs_equal(tmp_path):
    before, after = _two_builds(tmp_path)
    done = _run(before, after, "--workload", "decode", "--context", "64", "--rounds", "1")
    assert done.returncode == 0, done.stderr
    assert "[0] contiguous" in done.stdout
    line = next(row for row in done.stdout.splitlines() if row.lstrip().startswith("[1]"))
    assert re.search(r"paired x[0-9.]+ contiguous, x[0-9.]+ paged", line), line
    assert line.endswith("largest difference from [0]'s output 0.0e+00"), line


def test_the_builds_wait_passively_unless_the_environment_chooses(tmp_path):
    """At 2 threads an OpenMP thread of the plain reads left spinning after its turn slowed the
    turn after it (build [0]'s, 1.19-1.35x): the builds load with a passive wait."""
    before, after = _two_builds(tmp_path)
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    args = (before, after, "--workload", "decode", "--context", "64", "--rounds", "1",
            "--threads", "2")
    done = _run(*args, env=env)
    assert done.returncode == 0, done.stderr
    assert "2 thread(s), OpenMP wait: OMP_WAIT_POLICY=passive;" in done.stdout.splitlines()[0]
    done = _run(*args, env={**env, "OMP_WAIT_POLICY": "active"})
    assert done.returncode == 0, done.stderr
    assert "OpenMP wait: OMP_WAIT_POLICY=active;" in done.stdout.splitlines()[0]


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
