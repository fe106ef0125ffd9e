"""benchmarks/read_order.sh: the C++ loops that read a decode's K and V in two orders.

One round is built and run (about two seconds, 512 MiB of memory): the script must compile with the
machine's compiler and print each of its five loops once, with a positive rate and a range that
holds the median for each of its two rates of multiply-adds per read."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "read_order.sh"
LOOPS = ("memory, no requests", "memory + level-1 loads, no requests", "tiles, no requests",
         "memory, requests", "tiles, requests")

pytestmark = [
    pytest.mark.skipif(not SCRIPT.exists(), reason="no benchmarks/ beside the tests"),
    pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                       reason="no C++ compiler"),
]


def test_one_round_prints_every_loop():
    run = subprocess.run(["bash", str(SCRIPT), "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "1 rounds" in run.stdout.splitlines()[0]
    for name in LOOPS:
        line = next((ln for ln in run.stdout.splitlines() if ln.strip().startswith(name + " ")),
                    None)
        assert line is not None, f"no line for {name!r} in:\n{run.stdout}"
        figures = [float(x) for x in re.findall(r"\d+\.\d+", line[len(name) + 3:])]
        assert len(figures) == 6, line
        for median, low, high in (figures[:3], figures[3:]):
            assert 0 < low <= median <= high, line
