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


# ---- the exercises reworked to make the student derive (issue 47, round three) ----------------------
#
# Each right answer below is written by hand, as a student would derive it, and each slip as a
# student with it would write it: the right one is accepted, every slip rejected with its name.

def _judged(number, right, slips, **inputs):
    assert _line(number, right, **inputs).startswith("right: "), _line(number, right, **inputs)
    for words, wrong in slips.items():
        said = _line(number, wrong, **inputs)
        assert said.startswith("wrong: ") and "looks like: " in said and words in said, (words, said)


def test_03_5_the_tokens_that_fit_are_worked_out_from_the_model_card():
    per_token = 2 * 40 * 8 * (5120 // 40) * 2  # K and V, layers, kv heads, d_h = d / h, bytes
    _judged("03.5", 24 * 2**30 // (8 * per_token), {
        "the factor 2 for K and V forgotten": 24 * 2**30 // (8 * per_token // 2),
        "rounded up": -(-24 * 2**30 // (8 * per_token)),
        "not rounded down": 24 * 2**30 / (8 * per_token),
        "the 40 query heads cached": 24 * 2**30 // (8 * 2 * 40 * 40 * 128 * 2),
        "d_h taken as the width d": 24 * 2**30 // (8 * 2 * 40 * 8 * 5120 * 2),
        "GiB read as 10^9 bytes": 24 * 10**9 // (8 * per_token),
        "or 1 byte per element": 24 * 2**30 // (8 * 2 * 40 * 8 * 128 * 1)})


def test_06_3_the_gradient_of_the_smoothed_loss_is_derived_not_the_target_copied():
    z, y = np.array([[2.0, 1.0, 0.0, 0.0, -1.0]]), np.array([0])
    p = np.exp(z[0]) / np.exp(z[0]).sum()
    q = np.array([0.9, 0.025, 0.025, 0.025, 0.025])  # 1 - eps on y, eps / (V - 1) elsewhere
    _judged("06.3", p - q, {"target q itself, not the gradient": q,
                            "the smoothing left out": p - np.eye(5)[0],
                            "refmath's target": p - (0.9 * np.eye(5)[0] + 0.02)}, z=z, y=y)
    # z has shape (1, 5): a gradient of its shape is the same answer, and its slips are named too
    _judged("06.3", (p - q)[None], {"target q itself, not the gradient": q[None]}, z=z, y=y)
    assert "shape" in _line("06.3", (p - q)[:4], z=z, y=y)


def test_07_5_rows_of_a_stream_take_context_plus_one_tokens():
    stream = np.array([5, 17, 3, 3, 9, 0, 21, 4, 11, 2, 30, 7, 16, 25])
    starts, context = np.array([2, 7, 8]), 4
    rows = np.stack([stream[s:s + context + 1] for s in starts])
    inputs = dict(stream=stream, starts=starts, context=context)
    _judged("07.5", (rows[:, :-1], rows[:, 1:]), {
        "shifted the wrong way": (rows[:, 1:], rows[:, :-1]),
        "not shifted": (rows[:, :-1], rows[:, :-1]),
        "the targets one token back": (rows[:, :-1], np.stack([stream[s - 1:s + 3] for s in starts])),
        "the first inputs repeat as targets": (
            rows[:, :-1], np.stack([np.r_[stream[s + 1:s + 4], stream[s + 3]] for s in starts])),
        "the starts read as 1-based": (np.stack([stream[s - 1:s + 3] for s in starts]),
                                       np.stack([stream[s:s + 4] for s in starts]))},
        **inputs)


def test_08_5_and_08_7_slips_are_named():
    _judged("08.5a", 2 * 2 * 32 * 128 * 8192, {  # q k^T and A V: h d_h t multiply-adds each
        "half of it": 2 * 32 * 128 * 8192, "the g key/value heads": 2 * 2 * 8 * 128 * 8192})
    _judged("08.5b", 2 * 8192 * 8 * 128 * 2, {
        "the factor 2 for K and V forgotten": 8192 * 8 * 128 * 2,
        "MHA's cache": 2 * 8192 * 32 * 128 * 2, "one token's keys and values": 2 * 8 * 128 * 2})
    weights, per_token = 2 * 4096**2 + 2 * 4096 * 1024, 2 * 8 * 128 * 2
    _judged("08.5c", 2 * weights / per_token, {
        "counted in numbers": weights / per_token,
        "the factor 2 for K and V left out": 2 * weights / (per_token / 2),
        "MHA's cache per token": 2 * weights / (2 * 32 * 128 * 2)})
    dots = np.array([0.0, 50.0, 100.0, 200.0])
    mask = np.array([0.0, 0.0, 0.0, -np.inf])
    _judged("08.7a", 50 * np.tanh(dots / 2 / 50) + mask, {
        "the mask added before the cap": 50 * np.tanh((dots / 2 + mask) / 50),
        "no 1/sqrt(d_k) scale": 50 * np.tanh(dots / 50) + mask,
        "the cap before the scale": 50 * np.tanh(dots / 50) / 2 + mask,
        "the scale 1/sqrt(8), RoPE's factor s": 50 * np.tanh(dots / np.sqrt(8) / 50) + mask,
        "the mask not applied": 50 * np.tanh(dots / 2 / 50)}, dots=dots)
    # a masked score written as any large finite number is one slip, named as such
    for finite in (-1e9, -1e30, -np.finfo(np.float64).max, -1e4):
        capped = 50 * np.tanh(dots / 2 / 50)
        capped[3] = finite
        said = _line("08.7a", capped, dots=dots)
        assert said.startswith("wrong: ") and "not a large finite number" in said, (finite, said)
    # ... and a finite value above -1e4 is only wrong (it is no stand-in for -inf)
    capped[3] = -100.0
    assert "looks like" not in _line("08.7a", capped, dots=dots)
    slope = (1 - np.tanh(dots / 100) ** 2) / 2 * np.array([1, 1, 1, 0])
    _judged("08.7b", slope, {
        "the 1/sqrt(d_k) of the chain rule left out": 2 * slope,
        "the masked key's slope taken as the cap's": (1 - np.tanh(dots / 100) ** 2) / 2,
        "an extra 1/c": slope / 50}, dots=dots)
    omega = 500.0 ** (-np.arange(4) / 4)
    turns = 32 * omega / (2 * np.pi)  # L / lambda
    gamma = (turns - 1) / (4 - 1)
    llama3 = np.where(turns > 4, omega, np.where(turns < 1, omega / 8,
                                                 (1 - gamma) * omega / 8 + gamma * omega))
    _judged("08.6", llama3, {"rounded to 4 decimals": np.round(llama3, 4)})


def test_01_6_asks_the_keys_gradient_and_names_dq_for_it():
    """01.6: dS from A8's equations, dK derived from S = Q K^T / sqrt(d_k) (A8 shows neither dQ nor dK)."""
    from refmath.attention import causal_mask, sdpa_forward

    X = np.array([[1.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    Q = X @ (np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]) / 2)
    K = X @ np.array([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    V = X @ np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    dO = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, -1.0]])
    _, cache = sdpa_forward(Q, K, V)
    _, cache_causal = sdpa_forward(Q, K, V, mask=causal_mask(3))
    A = cache_causal.a
    dA = dO @ V.T
    dS = A * (dA - np.sum(A * dA, axis=1, keepdims=True))
    inputs = dict(dO=dO, cache_causal=cache_causal, cache=cache)
    _judged("01.6", dS.T @ Q / np.sqrt(2), {
        "without the transpose of dS": dS @ Q / np.sqrt(2),
        "scale 1/sqrt(d_k) missing from dK": dS.T @ Q,
        "dQ's formula": dS @ K / np.sqrt(2)}, **inputs)


def test_04_3_rows_swapped_and_the_constants_left_out_are_named():
    """Round four: the rows swapped differ by under 1e-3 (read as a rounding before), and the two
    normalising constants of the derivation, sqrt(2/pi) and phi's 1/sqrt(2 pi)."""
    from math import erf

    u = np.array([0.0, 1.0, -2.0])
    big_phi = np.array([0.5 * (1 + erf(z / np.sqrt(2))) for z in u])
    phi = np.exp(-u**2 / 2) / np.sqrt(2 * np.pi)
    t = np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3))
    inner = 1 + 3 * 0.044715 * u**2
    exact = big_phi + u * phi
    tanh = 0.5 * (1 + t) + 0.5 * u * (1 - t**2) * np.sqrt(2 / np.pi) * inner
    _judged("04.3", np.stack([exact, tanh]), {
        "the rows swapped": np.stack([tanh, exact]),
        "the factor sqrt(2/pi) of the inner derivative left out":
            np.stack([exact, 0.5 * (1 + t) + 0.5 * u * (1 - t**2) * inner]),
        "phi(u) without its 1/sqrt(2 pi)": np.stack([big_phi + u * np.exp(-u**2 / 2), tanh])},
        points=u)


def test_02_3_gamma_in_dgamma_only_is_named():
    """Round four: gamma multiplied into dgamma alone (dbeta right) is the slip of g = gamma dy
    read as the gradient of gamma."""
    rng = np.random.default_rng(5)
    xs, upstream = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    gamma, beta = 1 + rng.standard_normal(5) / 4, rng.standard_normal(5)
    xhat = (xs - xs.mean(1, keepdims=True)) / np.sqrt(xs.var(1, keepdims=True) + 1e-5)
    inputs = dict(upstream=upstream, xs=xs, gamma=gamma, beta=beta)
    _judged("02.3", np.stack([(upstream * xhat).sum(0), upstream.sum(0)]), {
        "gamma multiplied into dgamma": np.stack([(gamma * upstream * xhat).sum(0), upstream.sum(0)]),
        "g = gamma dy used for dy": np.stack([(gamma * upstream * xhat).sum(0),
                                               (gamma * upstream).sum(0)])}, **inputs)


def test_01_6_the_keys_gradient_is_not_shown_before_its_check():
    """Round four: A8 printed dK = dS^T Q / sqrt(d_k) right above 01.6; the lesson now shows dV,
    dA and dS only, and dQ and dK are derived from S = Q K^T / sqrt(d_k)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "notebooks" / "01_attention.py").read_text()
    a8 = text[text.index("## A8"):text.index('check("01.6"')]
    a8 = a8[:a8.rindex("# BEGIN SOLUTION")]  # up to 01.6's solution, which the student lacks
    assert "dS_{ij} = A_{ij}" in a8
    for shown in ("dS^\\top Q", "dS\\, K", "dS.T @ Q", "dS_causal.T"):
        assert shown not in a8, shown
