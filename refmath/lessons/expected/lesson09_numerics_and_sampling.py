r"""Lesson 9, numerics and sampling at inference time (``notebooks/09_numerics_and_sampling.py``):
the expected value and the known slips of each exercise, computed from the library and from the
lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


@exercise("09.1", "stable softmax rows", "the section 'A11: the stable softmax, and a row with "
          "nothing to attend to'", "a row of -inf gives zeros, not NaN",
          uses=("rows",), rtol=1e-14, atol=1e-300)
def _stable_rows(rows):
    from refmath.softmax import softmax_forward

    right = softmax_forward(rows)[0]
    return right, {"NaN for the fully masked row: its max is -inf, and -inf - (-inf) is NaN":
                   np.where(np.isneginf(rows).all(axis=1, keepdims=True), np.nan, right)}


# The key is the root of the equation the exercise states, at the tolerance of a closed form.
# (float16 itself breaks a little later, near 10.6836: it rounds x, each exponential and the sum
# to 11 bits, and a sum rounds to inf only from 65520 on. The lesson shows that after the check;
# the exercise asks for the equation's root, which a grid read off the figure does not give.)
@exercise("09.2", "x where the float16 sum overflows", "the section 'S4: why half precision "
          "needs the shift'", "e^x (1 + e^-1 + e^-2) = 65504: take the log of both sides",
          rtol=1e-12)
def _x_sum_overflows():
    x = float(np.log(65504.0) - np.log(1 + np.exp(-1.0) + np.exp(-2.0)))
    return x, {"where e^x alone overflows: the other two terms of the sum count too":
               np.log(65504.0), "log2 taken for ln": x / np.log(2.0),
               "read off the figure, whose grid steps by 0.1: solve the equation instead":
                   float(np.ceil(x * 10) / 10)}


@exercise("09.3", "visible pairs, T = 10, w = 4", "the section 'A12: a sliding window'",
          "w (w + 1) / 2 for the first w rows, then w for each of the T - w others", rtol=0.0)
def _window_pairs():
    from refmath.attention import local_window_mask

    return int(np.count_nonzero(local_window_mask(10, 4) == 0)), {
        "T w: the first w - 1 rows see fewer than w keys": 10 * 4,
        "w (w - 1) / 2 for the first rows: row t of the first w sees t + 1 keys, itself included, "
        "so they see 1 + 2 + ... + w": 4 * 3 // 2 + (10 - 4) * 4,
        "the causal count T (T + 1) / 2: the window hides the older keys": 10 * 11 // 2}


@exercise("09.4", "top-p, p = 0.6", "the section 'L7: picking the next token'",
          "sort, keep a token while the mass before it is below p, renormalise",
          uses=("pi4",), rtol=1e-14)
def _top_p_by_hand(pi):
    from refmath.inference.sampling import top_p_filter

    kept = top_p_filter(pi, 0.6)
    return kept, {"the kept probabilities not renormalised to sum to one":
                  np.where(kept > 0, pi, 0.0),
                  "only the most likely token: top-p keeps tokens until their mass reaches p":
                      np.eye(len(pi))[int(np.argmax(pi))],
                  "left in sorted order, not put back at their tokens":
                      np.sort(kept)[::-1]}


def _without_the_crossing_token(probs, p):
    """A slip: the least probable kept token (the one whose mass reaches p) dropped as well,
    leaving nothing (0 / 0) when the first token alone reaches p."""
    from refmath.inference.sampling import top_p_filter

    kept = top_p_filter(probs, p) > 0
    kept[np.flatnonzero(kept)[np.argmin(probs[kept])]] = False
    with np.errstate(invalid="ignore"):
        return np.where(kept, probs, 0.0) / np.where(kept, probs, 0.0).sum()


@function_exercise("09.5", "your top-p filter", "the section 'L7: picking the next token'",
                   "sort, keep while the mass before is below p, renormalise, unsort",
                   uses=("pi", "pi4"))
def _top_p_filter(pi, pi4):
    from refmath.inference.sampling import top_p_filter

    top_p_inputs = [(pi, 0.8), (pi4, 0.6), (np.array([0.5, 0.3, 0.2]), 0.8),
                    (np.array([0.05, 0.7, 0.25]), 0.5), (np.array([0.125, 0.375, 0.5]), 1.0)]
    return dict(
        reference=top_p_filter, inputs=top_p_inputs, rtol=1e-14,
        slips={"the kept probabilities not renormalised to sum to one": lambda probs, p:
                   np.where(top_p_filter(probs, p) > 0, probs, 0.0),
               "the token whose mass crosses p dropped: it is the one that reaches p":
                   _without_the_crossing_token,
               "a token whose preceding mass equals p kept: the test is mass before < p, "
               "not <=": lambda probs, p: top_p_filter(probs, min(np.nextafter(p, 2.0), 1.0)),
               "left in sorted order, not put back at their tokens": lambda probs, p:
                   np.sort(top_p_filter(probs, p))[::-1]})
