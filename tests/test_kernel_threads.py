"""The C++ kernels' thread count (refmath.kernels.set_cpu_threads, generate --threads) and the wait
policy of their OpenMP threads (refmath.kernels.OPENMP_WAIT)."""
import argparse
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from refmath import kernels

pytestmark = pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built")


def product_team(threads) -> int:
    """The threads that ran a row product large enough to be shared (a million multiply-adds)."""
    x = np.ones((1, 1024), np.float32)
    w = np.ones((1024, 1024), np.float32)
    with kernels.cpu_thread_limit(threads):
        kernels.rows_matmul(x, w)
        kernels.rows_matmul(x, w.T)  # the dot-product layout too
    return kernels.cpu_last_team()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_setting_reaches_the_kernels(threads):
    # 3 is more than this machine may have cores: the team follows the setting, not the cores.
    assert product_team(threads) == threads
    x = np.ones(1 << 20, np.float32)
    with kernels.cpu_thread_limit(threads):
        assert kernels.cpu_threads() == threads
        assert kernels.stream_sum(x) == x.size
        assert kernels.cpu_last_team() == threads


def test_decode_attention_follows_the_setting():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 64), dtype=np.float32)
    k = rng.standard_normal((1, 2, 2048, 64), dtype=np.float32)
    for threads in (1, 3):
        with kernels.cpu_thread_limit(threads):
            kernels.decode(q, k, k, np.array([2048]))
            assert kernels.cpu_last_team() == threads


def test_the_limit_is_restored_and_none_leaves_openmp_its_count():
    own = kernels.cpu_threads()
    with kernels.cpu_thread_limit(3):
        with kernels.cpu_thread_limit(None):
            assert kernels.cpu_threads() == 3
        assert kernels.set_cpu_threads(2) == 3
        assert kernels.cpu_threads() == 2
    assert kernels.cpu_threads() == own
    assert kernels.set_cpu_threads(None) is None


def test_the_setting_holds_in_other_python_threads():
    # A process-wide count, unlike omp_set_num_threads, which sets the calling thread's only.
    import threading

    seen = []
    with kernels.cpu_thread_limit(3):
        worker = threading.Thread(target=lambda: seen.append(product_team(None)))
        worker.start()
        worker.join()
    assert seen == [3]


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), (2.0, TypeError),
                                        (True, TypeError), ("2", TypeError)])
def test_bad_thread_counts_are_refused(bad, error):
    with pytest.raises(error, match="threads"):
        kernels.set_cpu_threads(bad)
    with pytest.raises(error, match="threads"):
        with kernels.cpu_thread_limit(bad):
            pass


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_generate_threads_sets_the_kernels_count(threads):
    from refmath.commands import generate

    own = kernels.cpu_threads()
    args = argparse.Namespace(threads=threads, no_cache=False)
    with generate._threads(args, {"w": np.zeros((4, 4))}, 3, 5):
        assert kernels.cpu_threads() == (own if threads is None else threads)
        if threads is not None:
            assert product_team(None) == threads
    assert kernels.cpu_threads() == own


def openmp_spin(env_extra: dict, code: str) -> tuple[int, str]:
    """(spin count, stdout) of a fresh Python that runs ``code``, the spin count being how long
    libgomp's idle threads spin before they sleep (0: they sleep at once, the passive policy), as
    the runtime prints it when it loads with OMP_DISPLAY_ENV=VERBOSE."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    env.update(OMP_DISPLAY_ENV="VERBOSE", **env_extra)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", run.stderr)
    if found is None:
        pytest.skip("this OpenMP runtime does not print its spin count (not libgomp)")
    return int(found.group(1)), run.stdout


def test_the_kernels_threads_wait_passively_by_default():
    spin, out = openmp_spin({}, "import os, refmath.kernels as k; "
                                "print(k.OPENMP_WAIT); print(os.environ.get('OMP_WAIT_POLICY'))")
    assert spin == 0
    policy, after = out.split("\n")[:2]
    assert policy.startswith("passive")
    assert after == "None"  # the environment is put back after the load


def test_a_wait_policy_the_user_chose_is_kept():
    spin, out = openmp_spin({"OMP_WAIT_POLICY": "active"},
                            "import refmath.kernels as k; print(k.OPENMP_WAIT)")
    assert spin > 0
    assert "OMP_WAIT_POLICY=active" in out


def test_a_runtime_loaded_before_is_reported_as_such():
    # By another library, before refmath.kernels: its wait policy was read then, and stays.
    spin, out = openmp_spin({}, "import ctypes; ctypes.CDLL('libgomp.so.1'); "
                                "import refmath.kernels as k; print(k.OPENMP_WAIT)")
    assert spin > 0
    assert out.startswith("the OpenMP runtime's own")


def test_build_info_says_how_the_threads_wait():
    assert kernels.build_info()["openmp_wait"] == kernels.OPENMP_WAIT
