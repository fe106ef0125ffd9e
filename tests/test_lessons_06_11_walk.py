"""What the student walk-through of lessons 06-09 and 11 found (issue 47, walkb), each a test:
wrong answers that a check accepted, a key that was not the root of the stated equation, and
answers readable in the student copy before their exercise.

The slips the walk-through found unnamed are planted in tests/test_lesson_slips.py (PLANTS).
"""
from pathlib import Path

import numpy as np
import pytest

from _support import run_lesson

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


# every test starts from no miss and lenient checks (conftest.py); ``said`` is its fixture
pytestmark = pytest.mark.usefixtures("fresh_misses")


# ---- 06.6: the gradient check compared the student's numbers with the student's ------------------

def test_06_6_a_copied_numerical_gradient_is_not_an_analytic_one(said):
    from refmath.gradcheck import numerical_gradient
    from refmath.models import transformer as tm

    config = tm.TRANSFORMER_TINY
    params = tm.init_params(config, seed=1)
    draw = np.random.default_rng(0)
    batch = {"src": draw.integers(2, 13, (2, 6)), "src_lengths": np.array([6, 4]),
             "tgt": draw.integers(2, 13, (2, 5))}

    def phi():
        return float(tm.forward(params, batch, config, train=True, rng=7)[0])

    _, cache = tm.forward(params, batch, config, train=True, rng=7)
    grads = tm.backward(cache)
    name = "encoder.layers.0.self_attn.w_q"
    coords_wq = np.array([237, 208, 141, 70])
    numeric = numerical_gradient(phi, params[name], coords_wq)
    analytic = grads[name].reshape(-1)[coords_wq]
    inputs = {"phi": phi, "params": params, "cache": cache, "coords_wq": coords_wq}
    assert said("06.6", (numeric, analytic), inputs, strict=True).startswith("right: ")
    copied = said("06.6", (numeric, numeric.copy()), inputs)
    assert copied.startswith("wrong: ") and "numerical gradient copied" in copied, copied
    # another tensor's gradient, or other coordinates, are wrong too
    other = grads["encoder.layers.0.self_attn.w_k"].reshape(-1)[coords_wq]
    assert said("06.6", (numeric, other), inputs).startswith("wrong: ")
    assert said("06.6", (..., ...), inputs).startswith("no answer yet: ")


# ---- 08.4: "your dK holds all of the per-head gradient" could not fail ---------------------------

def _run_planted(lesson, replacements, tmp_path):
    text = (NOTEBOOKS / lesson).read_text()
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    run = run_lesson(text, tmp_path, lesson)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


@pytest.mark.parametrize("slip", ["np.zeros((B, G, T, D))",
                                  "per_head.reshape(B, G, H // G, T, D).mean(axis=2)"])
def test_08_4_the_property_check_rejects_what_drops_gradient(slip, tmp_path):
    # the total of any attention dK is 0 (every row of dS sums to 0), so the old check, which
    # compared totals, said right to these; the per-position total over the heads is not 0
    stdout = _run_planted("08_modern_decoder_and_gqa.py", [(
        "dk_shared = per_head.reshape(B, G, H // G, T, D).sum(axis=2)", f"dk_shared = {slip}")],
        tmp_path)
    assert "wrong: your dK holds all of the per-head gradient: " in stdout, stdout


# ---- 11.3: the expanded computation passed as the absorbed decode --------------------------------

def _absorbed(q_c, q_r, c, k_r, w_uk, w_uv):
    from refmath.softmax import softmax_forward

    q_hat = np.einsum("hk,hck->hc", q_c, w_uk)
    scores = (q_hat @ c.T + q_r @ k_r.T) / np.sqrt(q_c.shape[-1] + q_r.shape[-1])
    return np.einsum("hc,hcv->hv", softmax_forward(scores)[0] @ c, w_uv)


def _expanded(q_c, q_r, c, k_r, w_uk, w_uv):
    """The check cell's reference, copied into the student's function (the walk-through's)."""
    from refmath.softmax import softmax_forward

    keys = np.einsum("tc,hck->htk", c, w_uk)
    values = np.einsum("tc,hcv->htv", c, w_uv)
    scale = 1 / np.sqrt(q_c.shape[-1] + q_r.shape[-1])
    scores = scale * (np.einsum("hk,htk->ht", q_c, keys) + q_r @ k_r.T)
    return np.einsum("ht,htv->hv", softmax_forward(scores)[0], values)


def _per_head_loop(q_c, q_r, c, k_r, w_uk, w_uv):
    from refmath.softmax import softmax_forward

    out = []
    for r in range(len(q_c)):
        keys, values = c @ w_uk[r], c @ w_uv[r]
        scores = (keys @ q_c[r] + k_r @ q_r[r]) / np.sqrt(q_c.shape[-1] + q_r.shape[-1])
        out.append(softmax_forward(scores)[0] @ values)
    return np.stack(out)


def test_11_3_the_expanded_computation_does_not_pass_as_the_absorbed_one(said):
    assert said("11.3b", _absorbed, {}, strict=True).startswith("right: ")
    for expanded in (_expanded, _per_head_loop):
        line = said("11.3b", expanded, {})
        assert line.startswith("wrong: ") and "looks like: keys c W_UK or values c W_UV" in line, line
    assert said("11.3b", lambda *a: ..., {}).startswith("no answer yet: ")
    # ...and the three compute the same values (why 11.3's value check alone accepted them)
    draw = np.random.default_rng(1)
    args = [draw.standard_normal(s) for s in ((3, 5), (3, 2), (6, 7), (6, 2), (3, 7, 5), (3, 7, 4))]
    np.testing.assert_allclose(_expanded(*args), _absorbed(*args), rtol=1e-12)
    np.testing.assert_allclose(_per_head_loop(*args), _absorbed(*args), rtol=1e-12)



# ---- 11.4c and 11.6: derived, not transcribed ------------------------------------------------
#
# 11.4 asked for MHA / MLA right under the counts' formulas, and 11.6 for 2P x 1.2 and 16P at
# P = 1000 right under those two formulas: each answer was the text above, in code. Now 11.4c
# solves 2 g d_h = d_c + d_R for g, 11.6a solves the rule of thumb for P, and 11.6b changes a
# term of the 16 bytes. Each right answer, worked by hand, is accepted; each slip named.

@pytest.mark.parametrize("number, right, slips", [
    # DeepSeek-V2: d_c = 512, d_R = 64, d_h = 128, h = 128
    ("11.4c", (512 + 64) / (2 * 128), {
        "the factor 2 forgotten": (512 + 64) / 128,
        "the rotary key left out": 512 / (2 * 128),
        "the ratio MHA / MLA": 2 * 128 * 128 / (512 + 64),
        # g = 2.25 rounded to whole heads: down it was "the rotary key left out" alone (512 / 256
        # is 2 too), up it was "4/3 times the expected value"; each now says g need not be whole
        "g rounded down to whole heads (g need not be whole here), or the rotary key left out": 2,
        "g rounded up to whole heads (g need not be whole here)": 3}),
    ("11.6a", 80e9 / 2.4, {
        "the 20% allowance forgotten": 80e9 / 2,
        "80 GiB (2^30 bytes), not 80 GB": 80 * 2**30 / 2.4,
        "the allowance taken off, not added": 80e9 / 1.6,
        "1 byte a parameter": 80e9 / 1.2,
        # the count in billions, as it is said aloud: it was "too small by more than a factor 1e+09"
        "P given in billions": 33.333333333}),
    ("11.6b", 12 * 1000, {
        "the fp32 moments, as in the 16 P above": 16 * 1000,
        "m and v counted as one moment": 10 * 1000,
        "the fp32 master copy dropped as well": 8 * 1000}),
])
def test_11_4c_and_11_6_are_derived_and_their_slips_named(number, right, slips, said):
    assert said(number, right, {}, strict=True).startswith("right: ")
    for words, answer in slips.items():
        line = said(number, answer, {})
        assert line.startswith("wrong: ") and "looks like: " in line and words in line, (words, line)
    if number == "11.6a":  # a whole number of parameters, rounded down, is the same answer
        assert said(number, 33_333_333_333, {}).startswith("right: ")
        # in billions and rounded as printed: the slip first, then the rounding
        line = said(number, 33.33, {})
        assert "looks like: P given in billions" in line and "rounded as well, to 2 decimals" in line, line


# ---- 09.2: the key is the root of the equation the exercise states -------------------------------

def test_09_2_the_key_is_the_root_of_the_stated_equation(said):
    root = np.log(65504) - np.log(1 + np.exp(-1) + np.exp(-2))
    assert abs(np.exp(root) * (1 + np.exp(-1) + np.exp(-2)) - 65504) < 1e-9
    line = said("09.2", root, {}, strict=True)
    assert line.startswith("right: ") and line.endswith("max error 0"), line
    assert said("09.2", np.log(65504 / (1 + np.exp(-1) + np.exp(-2))), {}).startswith("right: ")
    for read_off in (10.7, 10.68, 10.6836):  # the figure's grid, 4 digits, float16's own break
        assert not said("09.2", read_off, {}).startswith("right: "), read_off


# ---- answers readable in the student copy before their exercise's check ---------------------------

# (lesson, the exercise's check call, text that gives its answer away)
BEFORE_THE_CHECK = [
    ("06_encoder_decoder.py", 'check("06.4"', r"\epsilon V / (V - 1)"),
    ("06_encoder_decoder.py", 'check("06.7"', "(4, 1)"),
    ("08_modern_decoder_and_gqa.py", 'check("08.3"', "(5, 4)"),
    ("07_gpt.py", 'check("07.4"', "gpt.forward(params, batch, gpt_config)"),
]


@pytest.mark.parametrize("lesson,call,answer", BEFORE_THE_CHECK)
def test_the_student_copy_holds_no_answer_before_its_check(lesson, call, answer):
    from refmath.lessons import student_copy

    student = student_copy((NOTEBOOKS / lesson).read_text(), lesson)
    assert student.count(call) == 1
    assert answer not in student[:student.index(call)], f"{lesson}: {answer!r} before {call}"


@pytest.mark.parametrize("lesson,literal", [
    ("06_encoder_decoder.py", "[4.0, 1.0]"),  # 06.7's property check held the answer's row
    ("11_latent_attention_and_memory.py", "62 + 1 + 15"),  # 11.5a's answer, below its exercise
])
def test_no_answer_as_a_literal_below_its_exercise(lesson, literal):
    from refmath.lessons import student_copy

    assert literal not in student_copy((NOTEBOOKS / lesson).read_text(), lesson)


# ---- nor anywhere in the student copy's text or output: the student site executes the copies ----

# An expected value that a copy prints by coincidence, not as the answer: an untrained model's loss
# is close to ln V, and lesson 7's training curves start there, as the mean of its prefix losses does.
COINCIDENCES = {("07_gpt.py", "mean of the prefix losses")}


@pytest.mark.parametrize("lesson", ["06_encoder_decoder.py", "07_gpt.py",
                                    "08_modern_decoder_and_gqa.py", "09_numerics_and_sampling.py",
                                    "11_latent_attention_and_memory.py"])
def test_no_expected_value_anywhere_in_an_unanswered_copy(lesson, tmp_path):
    """test_notebooks scans what a student reads before each check; the student site shows the
    whole executed copy at once, so a print after a check must wait for the answer too."""
    import json

    from refmath.lessons import RECORD, student_copy
    from test_notebooks import _gives_away

    text = student_copy((NOTEBOOKS / lesson).read_text(), lesson)
    records = tmp_path / "expected.jsonl"
    run = run_lesson(text, tmp_path, lesson, **{RECORD: str(records)})
    assert run.returncode == 0, run.stderr[-2000:]
    recorded = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(recorded) >= 4
    shown = [(r["name"], _gives_away(r["value"], run.stdout) or _gives_away(r["value"], text))
             for r in recorded if (lesson, r["name"]) not in COINCIDENCES]
    assert not [s for s in shown if s[1]], shown
