"""refmath.malloc: the process keeps its freed memory, and nothing else changes."""
import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_the_settings_take_effect_and_results_do_not_change():
    # In a child process: the setting is process-wide and must not leak into the test run.
    code = ("import numpy as np\n"
            "from refmath.malloc import retain_freed_memory\n"
            "before = np.tanh(np.arange(1e6, dtype=np.float32) / 1e5)\n"
            "ok = retain_freed_memory()\n"
            "after = np.tanh(np.arange(1e6, dtype=np.float32) / 1e5)\n"
            "print(ok, np.array_equal(before, after))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]

