"""The piece team (csrc/piece_team.h) that shares the decode step's products and attention among
the kernels' threads: the calling thread and helpers take pieces of a call as they come, so the
result must not depend on who took what, on calls made at once from several Python threads (one of
them then runs alone), or on a fork (the child starts a team of its own)."""
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from refmath import kernels, weight_formats

pytestmark = pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built")


def calls():
    """Three kernels that share their pieces, each large enough to use more than one thread, as
    functions of no argument returning their output: the same bits on any thread count."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1024), dtype=np.float32)
    rows = rng.standard_normal((768, 1024), dtype=np.float32)  # W^T: the decode layout
    stored = weight_formats.quantize(rows, "q8_0")
    q = rng.standard_normal((1, 8, 64), dtype=np.float32)
    k = rng.standard_normal((1, 2, 2048, 64), dtype=np.float32)
    v = rng.standard_normal((1, 2, 2048, 64), dtype=np.float32)
    return {"rows_matmul": lambda: kernels.rows_matmul(x, rows.T),
            "format_rows_matmul": lambda: kernels.format_rows_matmul(x, stored, "q8_0"),
            # the splits given, so that they do not follow the thread count
            "decode": lambda: kernels.decode(q, k, v, np.array([2048]), splits=4)}


def test_calls_from_several_python_threads_give_one_threads_bits():
    fns = calls()
    with kernels.cpu_thread_limit(1):
        expected = {name: fn() for name, fn in fns.items()}
    failures = []

    def worker(seed):
        order = np.random.default_rng(seed).permutation(list(fns) * 20)
        for name in order:
            got = fns[name]()
            if not np.array_equal(got, expected[name]):
                failures.append((seed, name, float(np.abs(got - expected[name]).max())))

    with kernels.cpu_thread_limit(2):
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a kernel call did not return"
    assert failures == []


@pytest.mark.parametrize("threads", [2, 3])
def test_every_piece_is_done_once_whoever_takes_it(threads):
    # Each setting cuts the work its own way (4 pieces a thread per product); on a 2-core machine
    # 3 becomes at most 2 taking part (cpu_last_usable_threads). Helpers are sometimes late and
    # the caller takes their pieces; repeated calls give them every chance to take some.
    fns = calls()
    with kernels.cpu_thread_limit(1):
        expected = {name: fn() for name, fn in fns.items()}
    with kernels.cpu_thread_limit(threads):
        for _ in range(50):
            for name, fn in fns.items():
                np.testing.assert_array_equal(fn(), expected[name], err_msg=name)


FORK_CHILD = """
import os, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_piece_team import calls
from refmath import kernels

fns = calls()
with kernels.cpu_thread_limit(1):
    expected = {name: fn() for name, fn in fns.items()}
with kernels.cpu_thread_limit(2):
    fns["rows_matmul"]()  # the parent's helpers exist before the fork
    pid = os.fork()
    if pid == 0:  # the child: its calls must finish and agree; it reports by exit status
        status = 1
        try:
            status = 0 if all(np.array_equal(fn(), expected[name])
                              for name, fn in fns.items()) else 2
        finally:
            os._exit(status)
    for _ in range(600):  # up to 60 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            sys.exit(os.waitstatus_to_exitcode(status))
        time.sleep(0.1)
    os.kill(pid, 9)
    sys.exit("the forked child's kernel calls did not return")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_has_a_team_of_its_own():
    # In a fresh interpreter, so that no other library's threads (JAX's, in the full suite) are
    # forked along with it.
    run = subprocess.run([sys.executable, "-c", FORK_CHILD, os.path.dirname(__file__)],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="no /proc/loadavg to count from")
def test_fewer_threads_take_part_beside_busy_processes():
    # As many busy processes as the machine has cores: none is free, so one thread runs each call
    # (after two counts 10 ms apart), and the results stay the same bits.
    fns = calls()
    with kernels.cpu_thread_limit(1):
        expected = {name: fn() for name, fn in fns.items()}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)  # every one of them started and spinning
        with kernels.cpu_thread_limit(2):
            used = []
            for _ in range(4):
                for name, fn in fns.items():
                    np.testing.assert_array_equal(fn(), expected[name], err_msg=name)
                used.append(kernels.cpu_last_usable_threads())
                time.sleep(0.02)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert used[-2:] == [1, 1], used


def test_the_team_under_thread_sanitizer(tmp_path):
    # csrc/piece_team.cpp alone, with tests/piece_team_stress.cpp's callers: every piece run once,
    # in range, and no data race that ThreadSanitizer sees (it exits non-zero on one).
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ to build the stress test with")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(os.path.join(root, "csrc", "piece_team.cpp")):
        pytest.skip("the C++ sources are not beside these tests (an installed copy)")
    binary = str(tmp_path / "stress")
    build = subprocess.run([compiler, "-std=c++17", "-O1", "-g", "-fsanitize=thread", "-pthread",
                            "-I", os.path.join(root, "csrc"),
                            os.path.join(root, "tests", "piece_team_stress.cpp"),
                            os.path.join(root, "csrc", "piece_team.cpp"), "-o", binary],
                           capture_output=True, text=True)
    if build.returncode != 0:
        if "tsan" in build.stderr.lower() or "sanitize" in build.stderr.lower():
            pytest.skip(f"this g++ cannot build with ThreadSanitizer: {build.stderr[-300:]}")
        pytest.fail(build.stderr)
    # Without a preloaded runtime (tests/run_sanitized.sh preloads AddressSanitizer's, which
    # cannot share a process with ThreadSanitizer's).
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    run = subprocess.run([binary], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("ok"), run.stdout
