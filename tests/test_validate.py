"""The shared checks of scalar options, and the options the issue found accepting anything."""
import numpy as np
import pytest

from refmath._validate import check_choice, check_flag, check_int, check_real
from refmath.ffn import gelu_forward
from refmath.norms import layernorm_forward, rmsnorm_forward
from refmath.optim import Adam


def test_check_int():
    assert check_int("n", np.int64(3), 1) == 3 and type(check_int("n", np.int64(3))) is int
    with pytest.raises(TypeError, match=r"^n must be an int, got True of type bool$"):
        check_int("n", True)
    with pytest.raises(TypeError, match=r"^n must be an int, got 2.0 of type float$"):
        check_int("n", 2.0)
    with pytest.raises(ValueError, match=r"^n must be an int >= 1, got 0$"):
        check_int("n", 0, 1)
    with pytest.raises(ValueError, match=r"^n must be an int in \[0, 4\], got 5$"):
        check_int("n", 5, 0, 4)


def test_check_real():
    assert check_real("p", 1, 0, 1) == 1.0
    with pytest.raises(TypeError, match=r"^p must be a number, got '0.1' of type str$"):
        check_real("p", "0.1")
    with pytest.raises(TypeError, match=r"^p must be a number, got False of type bool$"):
        check_real("p", False)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=rf"^p must be a finite number, got {bad}$"):
            check_real("p", bad)
    with pytest.raises(ValueError, match=r"^p must be a finite number in \[0, 1\), got 1$"):
        check_real("p", 1, 0, 1, high_open=True)
    with pytest.raises(ValueError, match=r"^eps must be a finite number > 0, got 0$"):
        check_real("eps", 0, 0, low_open=True)
    with pytest.raises(ValueError, match=r"^lr must be a finite number <= 1e-05, got 0.1$"):
        check_real("lr", 0.1, None, 1e-5)


def test_check_flag_and_choice():
    assert check_flag("causal", np.bool_(True)) is True
    with pytest.raises(TypeError, match=r"^causal must be True or False, got 1 of type int$"):
        check_flag("causal", 1)
    assert check_choice("mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"^mode must be one of 'a', 'b', got 'c'$"):
        check_choice("mode", "c", ("a", "b"))
    with pytest.raises(ValueError, match=r"^mode must be one of 'a', 'b', got \['a'\]$"):
        check_choice("mode", ["a"], ("a", "b"))  # unhashable: refused, not a TypeError from `in`


def test_gelu_takes_pytorchs_spellings_and_nothing_else():
    x = np.linspace(-3, 3, 7)
    exact, _ = gelu_forward(x, approximate=False)
    tanh, _ = gelu_forward(x, approximate=True)
    np.testing.assert_array_equal(gelu_forward(x, approximate="none")[0], exact)
    np.testing.assert_array_equal(gelu_forward(x, approximate="tanh")[0], tanh)
    with pytest.raises(ValueError, match=r"approximate must be one of 'none', 'tanh', got 'exact'"):
        gelu_forward(x, approximate="exact")
    for bad in (2, 1, None, 0.5):
        with pytest.raises(TypeError, match=rf"approximate must be False, True, 'none' or 'tanh', got {bad}"):
            gelu_forward(x, approximate=bad)


def test_norm_and_optimiser_eps():
    x = np.arange(6.0).reshape(2, 3)
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0, got -1"):
        layernorm_forward(x, np.ones(3), np.zeros(3), eps=-1)
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0, got nan"):
        rmsnorm_forward(x, np.ones(3), eps=float("nan"))
    with pytest.raises(ValueError, match=r"eps must be a finite number > 0, got 0"):
        Adam(0.1, eps=0)
    with pytest.raises(TypeError, match=r"betas must be a pair \(beta1, beta2\), got 0.9"):
        Adam(0.1, betas=0.9)
