"""What the student walk-through of lessons 06-09 and 11 found (issue 47, walkb), each a test:
wrong answers that a check accepted, a key that was not the root of the stated equation, and
answers readable in the student copy before their exercise.

The slips the walk-through found unnamed are planted in tests/test_lesson_slips.py (PLANTS).
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _said(number, answer, inputs, capsys, strict=False):
    """The verdict line ``check(number, answer)`` prints from a namespace holding ``inputs``."""
    from refmath.lessons import check

    os.environ["REFMATH_LESSONS_STRICT"] = "1" if strict else "0"
    capsys.readouterr()
    exec("check(number, answer)", {**inputs, "check": check, "number": number, "answer": answer})
    return capsys.readouterr().out.strip()


@pytest.fixture(autouse=True)
def _fresh_misses(monkeypatch):
    import refmath.lessons.checks

    monkeypatch.setattr(refmath.lessons.checks, "_MISSES", {})
    monkeypatch.setenv("REFMATH_LESSONS_STRICT", "0")


# ---- 06.6: the gradient check compared the student's numbers with the student's ------------------

def test_06_6_a_copied_numerical_gradient_is_not_an_analytic_one(capsys):
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
    assert _said("06.6", (numeric, analytic), inputs, capsys, strict=True).startswith("right: ")
    copied = _said("06.6", (numeric, numeric.copy()), inputs, capsys)
    assert copied.startswith("wrong: ") and "numerical gradient copied" in copied, copied
    # another tensor's gradient, or other coordinates, are wrong too
    other = grads["encoder.layers.0.self_attn.w_k"].reshape(-1)[coords_wq]
    assert _said("06.6", (numeric, other), inputs, capsys).startswith("wrong: ")
    assert _said("06.6", (..., ...), inputs, capsys).startswith("no answer yet: ")


# ---- 08.4: "your dK holds all of the per-head gradient" could not fail ---------------------------

def _run_planted(lesson, replacements, tmp_path):
    text = (NOTEBOOKS / lesson).read_text()
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    script = tmp_path / lesson
    script.write_text(text)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "MPLBACKEND": "Agg",
                                            "OPENBLAS_NUM_THREADS": "1",
                                            "REFMATH_LESSONS_STRICT": "0"})
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
