"""What the student walk-through of lessons 01-05 found (issue 47, walk-reports/walka.md), checked
exercise by exercise as the lessons check them, ``check("NN.k", answer)``: each planted wrong
answer of the report is rejected and named, and the right answer, written by hand, accepted."""
import warnings

import numpy as np
import pytest

from _support import verdict_line


# every test starts from no miss and lenient checks (conftest.py)
pytestmark = pytest.mark.usefixtures("fresh_misses")


def _line(number, answer, **inputs):
    """The verdict line of ``check(number, answer)`` called from a namespace holding the lesson's
    ``inputs``."""
    return verdict_line(number, answer, inputs)


def test_02_5_one_block_short_is_named_without_the_answer():
    stream0 = np.random.default_rng(0).standard_normal(16)
    stream0 /= np.sqrt(np.mean(stream0**2))  # RMS 1, as the lesson's
    from refmath.norms import rmsnorm_forward

    stream = stream0.copy()
    for _ in range(7):  # one block too few
        stream = stream + rmsnorm_forward(stream, np.ones(16), eps=1e-6)[0]
    line = _line("02.5", float(np.sqrt(np.mean(stream**2))), stream0=stream0)
    assert line.startswith("wrong: ") and "one block too few" in line, line
    assert "9" not in line and "8" not in line.split("looks like")[1], line


def test_03_1_merges_two_states_whose_scores_are_not_given():
    from refmath.softmax import OnlineSoftmaxState

    c = OnlineSoftmaxState(m=np.float64(2.0), l=np.float64(1.5), u=np.array([0.5, -1.0]))
    d = OnlineSoftmaxState(m=np.float64(3.5), l=np.float64(1.25), u=np.array([2.0, 0.25]))
    right = (3.5, np.exp(2.0 - 3.5) * 1.5 + 1.25)
    assert _line("03.1", right, state_c=c, state_d=d).startswith("right: ")
    assert "neither rescaled" in _line("03.1", (3.5, 2.75), state_c=c, state_d=d)


@pytest.mark.parametrize("number, right", [
    ("04.7", lambda: np.array([3 * np.cos(2) - 4 * np.sin(2), 3 * np.sin(2) + 4 * np.cos(2),
                               np.cos(0.02), np.sin(0.02)])),
    ("04.8", lambda: np.array([np.cos(2), -np.sin(2), np.sin(0.02), np.cos(0.02)]))])
def test_04_7_and_04_8_take_the_row_as_four_numbers(number, right):
    """The prompt says "the row x = (3, 4, 1, 0)": a (4,) answer is judged by its values, like a
    (1, 4) one, so that a slip is named on the first try, not a shape."""
    assert _line(number, right()).startswith("right: ")
    assert _line(number, right()[None]).startswith("right: ")
    if number == "04.7":  # turned by -theta, as a 1-D row
        wrong = np.array([3 * np.cos(2) + 4 * np.sin(2), -3 * np.sin(2) + 4 * np.cos(2),
                          np.cos(0.02), -np.sin(0.02)])
        assert "the wrong way" in _line(number, wrong)
    assert "shape" in _line(number, right()[:3])


def test_05_7_adam_with_l2_is_named():
    def adam_with_l2(theta, g, m, v, s, lr, betas, eps, weight_decay):
        b1, b2 = betas
        g = g + weight_decay * theta  # L2: the decay's gradient enters the moments
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        return theta - lr * (m / (1 - b1**s)) / (np.sqrt(v / (1 - b2**s)) + eps), m, v

    line = _line("05.7", adam_with_l2)
    assert line.startswith("wrong: your AdamW step: looks like: Adam + L2"), line


def test_01_2_prints_no_warning_of_its_own():
    """The column-softmax slip is evaluated on a cross-attention with a padded key: it used to
    print two RuntimeWarnings (0 / 0) on every run, right answer or wrong."""
    def my_attention(Q, K, V, mask=None):
        scores = Q @ K.T / np.sqrt(Q.shape[-1]) + (0.0 if mask is None else mask)
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)) @ V

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _line("01.2", my_attention).startswith("right: ")


def test_write_the_function_checks_hold_their_hint_and_slips():
    """A write-the-function exercise is one call in its lesson: the hint comes from the table, on
    the second miss."""
    def forgot_the_scale(Q, K, V, mask=None):
        scores = Q @ K.T + (0.0 if mask is None else mask)
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)) @ V

    first = _line("01.2", forgot_the_scale)
    assert "scale missing from the scores" in first and "a second try" in first
    assert "softmax along axis -1" in _line("01.2", forgot_the_scale)


def test_03_4_without_the_q_k_v_o_traffic_is_named():
    """The probe of the report: the dense bytes of S and P alone, 2 * 4 * 12 * 2048^2."""
    assert "S and P only" in _line("03.4", 2 * 4 * 12 * 2048**2)
    assert _line("03.4", 2 * (4 * 12 * 2048**2 + 4 * 12 * 2048 * 64)).startswith("right: ")


def test_05_4_the_upstream_gradient_left_out_is_named():
    def without_dout(dout, cache):
        onehot = np.eye(cache.probs.shape[-1])[cache.targets]
        per_token = cache.probs - onehot
        if cache.reduction == "mean":
            per_token = per_token / max(cache.n_counted, 1)
        return np.where(cache.counted[..., None], per_token, 0.0)

    assert "the upstream gradient dout left out" in _line("05.4", without_dout)
