# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Assignment: the online-softmax step of a tiled attention forward, in C++
#
# You write one C++ function:
#
# | function | file | catalogue |
# |---|---|---|
# | `online_softmax_tile(q, k, v, visible, rows, cols, d, dv, scale, m, l, acc)` | `csrc/teaching/flash_tile.cpp` | F1-F3 |
#
# Given: its contract in `csrc/teaching/flash_tile.h`, and `csrc/teaching/flash_forward_module.cpp`,
# a pybind11 module whose `flash_forward(q, k, v, causal, block_q, block_k, scale)` loops over
# query tiles and key tiles, builds the causal mask of the tiles that cross the diagonal, calls your
# function for every pair and writes `o = acc / l` and `lse = m + log l` at the end.
# `refmath.teaching_kernel.build()` compiles your file (under a second), links it with the given
# half (compiled once, about ten seconds) and imports the module.
#
# Only the function `online_softmax_tile` is taken from the file you submit: anything else you add
# to it (a helper function, an include) is not graded, so write helpers as lambdas inside it. The
# includes at the top of the file (`<algorithm>`, `<cmath>`, `<limits>`, `<vector>`) are there for
# you.
#
# Public tests: `python -m pytest -q tests`. The hidden tests use lengths the tiles do not divide,
# batches of heads, `T_q != T_k` with causal masking, rows that see no key, scores in the hundreds
# and a float32 error bound: your worst error may be twice that of a plain float32 NumPy attention,
# plus one float32 rounding.

# %% [markdown]
# ## 1. The state of a query row
#
# For one query row and the keys folded so far, with scaled scores $s_j = \tau\, q \cdot k_j$:
# $m = \max_j s_j$, $l = \sum_j e^{s_j - m}$, $\mathrm{acc} = \sum_j e^{s_j - m} v_j$. The output is
# $\mathrm{acc} / l$ and the logsumexp $m + \log l$, the same whatever order the keys came in.
#
# Folding in a tile of keys with maximum $\tilde m$: the new maximum is $m' = \max(m, \tilde m)$;
# what was folded so far is rescaled by $e^{m - m'}$ (at most 1); each new key adds $e^{s_j - m'}$
# to $l$ and $e^{s_j - m'} v_j$ to $\mathrm{acc}$. Every exponent is at most 0, so nothing
# overflows, however large the scores.
#
# Before the first tile $m = -\infty$, $l = 0$, $\mathrm{acc} = 0$. A row that sees no key of a tile
# (all of its `visible` entries are 0) must keep its state exactly: $-\infty - (-\infty)$ is NaN.
#
# **Question.** A row has seen no key at all after the last tile. What do the given module's `o`
# and `lse` say about it, and why is that the right answer?
#
# <!-- BEGIN SOLUTION -->
# l = 0, so the module writes o = 0 and lse = -inf: the softmax over an empty set of keys has no
# weights, so the output is the empty sum 0 and log(sum of no exponentials) = log 0 = -inf.
# <!-- END SOLUTION -->

# %%
import numpy as np

# The state after two tiles of one row, in NumPy: the C++ does the same per row.
scores = np.array([1.0, 3.0, -2.0, 0.5])
values = np.eye(4)
m, l, acc = -np.inf, 0.0, np.zeros(4)
for tile in (slice(0, 2), slice(2, 4)):
    m_new = max(m, scores[tile].max())
    rescale = np.exp(m - m_new)
    p = np.exp(scores[tile] - m_new)
    m, l, acc = m_new, l * rescale + p.sum(), acc * rescale + p @ values[tile]
weights = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
print("tiled:", acc / l, " dense:", weights, " lse:", m + np.log(l))

# %% [markdown]
# ## 2. Build and run
#
# ```bash
# python -m refmath.teaching_kernel     # build, then compare with NumPy on a few shapes
# python -m pytest -q tests
# ```
#
# A compiler error is printed in full, and in the grader's feedback too. Until you write the
# function the module builds, and `flash_forward` raises `RuntimeError: online_softmax_tile: see
# the handout kernel (handout.py)`.

# %%
from refmath.teaching_kernel import build

kernel = build()
q, k, v = (np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32) for _ in range(3))
try:
    o, lse = kernel.flash_forward(q, k, v, True, 2, 2)
    print("o:", o.shape, "lse:", lse)
except RuntimeError as error:
    print("not written yet:", error)
