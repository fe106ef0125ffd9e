"""The BLAS thread policy (refmath._threads) and the --threads flag of train and generate."""
import os

import numpy as np
import pytest

threadpoolctl = pytest.importorskip("threadpoolctl")

from refmath import _threads, train as T  # noqa: E402
from refmath.commands import main  # noqa: E402
from refmath.models.gpt import GPTConfig  # noqa: E402


def blas_threads_now() -> int:
    return max(p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas")


@pytest.fixture
def no_thread_variables(monkeypatch):
    for name in _threads.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_small_products_get_one_thread_and_large_ones_every_core(no_thread_variables):
    assert _threads.choose_blas_threads(_threads.SMALL_PRODUCT - 1) == 1
    assert _threads.choose_blas_threads(_threads.SMALL_PRODUCT) == _threads.available_cores()
    assert _threads.choose_blas_threads(1 << 40, threads=3) == 3
    params = {"w": np.zeros((64, 256)), "b": np.zeros(10 ** 6), "e": np.zeros((10, 64))}
    assert _threads.largest_product(2048, params) == 2048 * 64 * 256  # 1-D arrays are no product


def test_a_thread_count_in_the_environment_is_kept(monkeypatch, no_thread_variables):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert _threads.choose_blas_threads(1 << 40) is None
    assert _threads.choose_blas_threads(10, threads=4) == 4


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                        (True, TypeError)])
def test_bad_thread_counts_are_refused(bad, error):
    with pytest.raises(error, match="threads"):
        _threads.choose_blas_threads(10, threads=bad)
    with pytest.raises(error, match="threads"):
        T.train("gpt", "unused", steps=1, threads=bad)


def _threads_during_steps(monkeypatch, tmp_path, **kwargs):
    seen = []
    step = T._train_step

    def recording_step(run):
        seen.append(blas_threads_now())
        return step(run)
    monkeypatch.setattr(T, "_train_step", recording_step)
    config = GPTConfig(vocab_size=32, max_seq_len=16, n_layers=1, d_model=16, n_heads=2, d_ff=32)
    T.train("gpt", tmp_path / "run", steps=2, batch_size=4, eval_every=2, config=config,
            task={"name": "chars", "seq_len": 16, "n_sentences": 300}, out=open(os.devnull, "w"),
            **kwargs)
    return seen


def test_train_runs_small_models_on_one_blas_thread(monkeypatch, tmp_path, no_thread_variables):
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        assert _threads_during_steps(monkeypatch, tmp_path) == [1, 1]
        assert blas_threads_now() == 2  # restored afterwards


def test_threads_overrides_the_choice(monkeypatch, tmp_path, no_thread_variables):
    if _threads.available_cores() < 2 or blas_threads_now() < 2:
        pytest.skip("one core: no second thread to ask for")
    assert _threads_during_steps(monkeypatch, tmp_path, threads=2) == [2, 2]


def test_the_commands_take_threads(tmp_path, capsys):
    assert main(["train", "--model", "gpt", "--threads", "0", "--out", str(tmp_path / "r")]) == 2
    assert "--threads must be an int >= 1" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path), "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
