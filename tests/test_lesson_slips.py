"""Planted mistakes: typical slips written into a lesson's answers are rejected and named.

Each plant edits one line of an exercise's solution (the answer a student with that slip would
write), the lesson runs with the plants in place, and the check after each planted exercise must
print ``wrong: NAME: looks like: SLIP``, naming the slip; the checks of the other exercises still
say right. A slip's value comes from the check itself (``refmath.lessons.check_close``'s
``slips``, many of them the catalogued mistakes of ``refmath.mistakes`` applied to the library),
so this test confirms that the student's way of making the slip and the check's way agree.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

# lesson -> [(solution text, the slip written instead, the check's name, words of the slip's name)]
PLANTS = {
    "01_attention.py": [
        ("np.array([[1 / 3 * 1 + 2 / 3 * 0, 1 / 3 * 0 + 2 / 3 * 2]])",
         "np.array([[0.25 * 1 + 0.5 * 0, 0.25 * 0 + 0.5 * 2]])",
         "the masked output", "not renormalised"),
        ("jacobian_a3 = np.diag(a3) - np.outer(a3, a3)", "jacobian_a3 = np.diag(a3) - a3 @ a3",
         "the Jacobian of (1/4, 1/2, 1/4)", "inner product"),
        ("dQ_causal = dS_causal @ K / np.sqrt(d_k)", "dQ_causal = dS_causal @ K",
         "dQ (causal)", "scale missing from dQ"),
        ("dA_drop = (dO @ V.T) * D", "dA_drop = dO @ V.T",
         "(dV, dQ) with dropout", "dropout mask ignored in dA"),
    ],
    "02_normalisation.py": [
        ("dx_layernorm = (direct + through_mean + through_sigma) / sigma",
         "dx_layernorm = (direct + through_mean) / sigma", "LayerNorm dx", "variance path dropped"),
        ("dx_rmsnorm = r * dy - r**3 * x * np.mean(dy * x)",
         "dx_rmsnorm = r * dy - r**2 * x * np.mean(dy * x)", "RMSNorm dx", "r^2 instead of r^3"),
        ("dgamma_dbeta = np.stack([np.sum(upstream * xhat_batch, axis=0), np.sum(upstream, axis=0)])",
         "dgamma_dbeta = np.stack([np.sum(upstream * xhat_batch, axis=0), np.mean(upstream, axis=0)])",
         "(dgamma, dbeta)", "dbeta averaged over rows"),
    ],
    "03_flash_and_kv_cache.py": [
        ("merged_m_l = (m_merged, np.exp(a.m - m_merged) * a.l + np.exp(b.m - m_merged) * b.l)",
         "merged_m_l = (m_merged, a.l + b.l)", "(m, l) of the merge", "without rescaling"),
        ("dS_small = P_small * (do_small[0, 0] @ v_small[0, 0].T - delta)",
         "dS_small = P_small * (do_small[0, 0] @ v_small[0, 0].T)",
         "dQ from the logsumexp", "delta = rowsum(dO * O) left out"),
        ("cache_bytes = 2 * 8 * 40 * 4096 * 8 * 128 * 2", "cache_bytes = 8 * 40 * 4096 * 8 * 128 * 2",
         "the cache bytes", "a 2 for K and V"),
    ],
    "04_ffn_and_positions.py": [
        ("back = -np.array([2.0, 2.0 / 100])", "back = np.array([2.0, 2.0 / 100])",
         "RoPE dx", "forward rotation used in backward"),
    ],
    "05_losses_and_optimisers.py": [
        ("dlogits_by_hand = (p - np.eye(4)[targets]) / 3", "dlogits_by_hand = p - np.eye(4)[targets]",
         "dloss/dlogits", "not divided by the number of positions"),
        ("sft_sum_by_hand = -np.sum(answer_mask * np.log(sft_p[np.arange(6), sft_targets]))",
         "sft_sum_by_hand = -np.sum(answer_mask * np.log(sft_p[np.arange(6), sft_targets])) / 3",
         "the summed SFT loss", "the mean over the answer tokens"),
        ("m_hat1, v_hat1 = (1 - 0.9) * g1 / (1 - 0.9), (1 - 0.999) * g1**2 / (1 - 0.999)",
         "m_hat1, v_hat1 = (1 - 0.9) * g1, (1 - 0.999) * g1**2",
         "theta after one Adam step", "bias correction missing"),
        ("adamw_after_50 = (1 - 0.1 * 0.1) ** 50", "adamw_after_50 = (1 - 0.1 * 0.1) ** 49",
         "AdamW's weight after 50 steps", "(n - 1): one step too few"),
        ("adamw_after_50 = (1 - 0.1 * 0.1) ** 50", "adamw_after_50 = (1 - 0.1) ** 50",
         "AdamW's weight after 50 steps", "decay not scaled by the learning rate"),
    ],
    "08_modern_decoder_and_gqa.py": [
        ("dk_shared = per_head.reshape(B, G, H // G, T, D).sum(axis=2)",
         "dk_shared = per_head.reshape(B, G, H // G, T, D).mean(axis=2)",
         "dK of the shared heads", "the mean over the sharing query heads"),
        ("dk_shared = per_head.reshape(B, G, H // G, T, D).sum(axis=2)",
         "dk_shared = per_head[:, ::2]",
         "dK of the shared heads", "one query head's copy only"),
    ],
}

# Checks that judge a property of the same answer as the named check.
ALSO = {"RoPE dx": ("rotating your dx forward gives dy back",),
        "RMSNorm dx": ("your RMSNorm dx is orthogonal to x",),
        "dK of the shared heads": ("your dK holds all of the per-head gradient",)}


def _run(text, tmp_path, name):
    script = tmp_path / name
    script.write_text(text)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "MPLBACKEND": "Agg",
                                             "OPENBLAS_NUM_THREADS": "1",
                                             "REFMATH_LESSONS_STRICT": "0"})


def _rounds(plants):
    """The plants in runs of one plant per exercise check (two slips of one answer go in
    separate runs)."""
    rounds = []
    for plant in plants:
        for batch in rounds:
            if all(p[2] != plant[2] for p in batch):
                batch.append(plant)
                break
        else:
            rounds.append([plant])
    return rounds


@pytest.mark.parametrize("lesson", sorted(PLANTS))
def test_planted_slips_are_rejected_and_named(lesson, tmp_path):
    original = (NOTEBOOKS / lesson).read_text()
    for batch in _rounds(PLANTS[lesson]):
        text = original
        for right, slip, _, _ in batch:
            assert text.count(right) == 1, f"{lesson}: the solution line {right!r} has changed"
            text = text.replace(right, slip)
        run = _run(text, tmp_path, lesson)
        assert run.returncode == 0, f"{lesson}: the planted lesson fails:\n{run.stderr[-2000:]}"
        verdicts = [line for line in run.stdout.splitlines()
                    if line.startswith(("right: ", "wrong: ", "almost: ", "no answer yet: "))]
        for _, slip, check, words in batch:
            said = [v for v in verdicts if v.startswith(f"wrong: {check}: ")]
            assert said, f"{lesson}: planting {slip!r}, check {check!r} did not say wrong: {verdicts}"
            assert "looks like: " in said[0] and words in said[0], \
                f"{lesson}: planting {slip!r}, the check said {said[0]!r}, not the slip {words!r}"
        # a property check of the same answer (check_true(..., of=answer)) may say wrong as well
        judged = {check for _, _, check, _ in batch} | {c for plant in batch for c in ALSO.get(plant[2], ())}
        others = [v for v in verdicts if not any(v.startswith(f"wrong: {c}: ") for c in judged)]
        assert all(v.startswith("right: ") for v in others), \
            f"{lesson}: checks of unplanted exercises that are not right: " \
            f"{[v for v in others if not v.startswith('right: ')]}"


def test_every_lesson_with_plants_has_at_least_one_per_covered_exercise():
    # Lessons 01-03 and 05 carry three slips or more; 04 and 08 have one exercise each with slips.
    for lesson, plants in PLANTS.items():
        wanted = 3 if lesson[:2] in ("01", "02", "03", "05") else 1
        assert len(plants) >= wanted, lesson
