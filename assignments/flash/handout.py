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
# # Assignment: FlashAttention in NumPy
#
# You write:
#
# | function | file | catalogue |
# |---|---|---|
# | `online_softmax_merge(a, b)` | `refmath/softmax.py` | F2, F3 |
# | `flash_attention_forward(q, k, v, causal, window, scale, block_q, block_k)` (after the checks) | `refmath/flash.py` | F1-F5, A12 |
# | `flash_attention_backward(do, q, k, v, o, lse, ...)` (after the checks) | `refmath/flash.py` | F4 |
#
# Given: `online_softmax_block`, `online_softmax_empty`, `online_softmax_result`,
# `online_softmax_logsumexp` (in `refmath/softmax.py`), and the mask geometry in `refmath/flash.py`:
# `_tiles`, `_Band.keys_seen_by`, `_Band.queries_seeing`, `_Band.tile_mask`, `_grouped` (read the
# module docstring: query `i` sits at key position `i + T_k - T_q`). Filling in `counters` is
# optional; no test reads it.
#
# Public tests: `python -m pytest -q tests`. The hidden tests compare with dense attention and its
# autograd on lengths that the blocks do not divide, with GQA, causal and sliding-window masks, and
# the grader reads from the kernel the peak resident memory of all the test's processes while both
# passes run at T = 8192: it must stay below a quarter of one T x T score matrix.

# %% [markdown]
# **What is graded, and what is refused.** Only the functions listed above are taken from the files
# you submit, each on its own: everything else in those files is ignored, and they run in a module
# of their own beside the given code, which they cannot rebind. Put any helper and any import inside
# the function that uses it. A function is refused (graded as the starter, with a note saying why)
# when it holds code that would run as it is defined (a decorator; a default value other than a
# literal or a name; an annotation that calls something), or when its body reaches past its own
# values: it sets or deletes an attribute of anything but its parameters and its own variables, uses
# a dunder attribute (`__dict__`, `__globals__`...), `globals`, `vars`, `getattr`, `setattr`,
# `delattr`, `exec`, `eval`, `compile` or `__import__`, or imports `sys`, `gc`, `ctypes`, `inspect`,
# `importlib`, `builtins`, `types`, `pickle` or the like. Submit plain UTF-8 files (no links), each
# at most 1 MiB.

# %%
import numpy as np

from refmath.softmax import online_softmax_block, online_softmax_logsumexp, online_softmax_result

# %% [markdown]
# ## 1. The state of a set of keys, and merging two of them
#
# For one query row and a set of keys with scores $s_j$ and values $v_j$:
# $m = \max_j s_j$, $l = \sum_j e^{s_j - m}$, $u = \sum_j e^{s_j - m} v_j$, and the attention output
# is $u / l$. Two disjoint sets $A$, $B$ have the union's state with $m = \max(m_A, m_B)$; rescale
# each side's $l$ and $u$ from its own maximum to the new one.
#
# The empty set has $m = -\infty$, $l = 0$, $u = 0$. Merging must keep it the identity, and merging
# two empty states must give an empty state, with no NaN from $-\infty - (-\infty)$.
#
# **Question.** Why is no exponential in the merge ever larger than 1?
#
# <!-- BEGIN SOLUTION -->
# Each factor is exp(m_side - m) with m the larger of the two maxima, so its exponent is <= 0.
# <!-- END SOLUTION -->

# %%
scores = np.array([[1.0, 3.0, -2.0]])
values = np.eye(3)
state = online_softmax_block(scores, values)
print("m, l, u:", state.m, state.l, state.u, " output:", online_softmax_result(state),
      " lse:", online_softmax_logsumexp(state))

# %% [markdown]
# ## 2. The tiled forward
#
# For each query tile `i0:i1` (`_tiles(0, T_q, block_q, T_q)`): start from the empty state; for each
# key tile `j0:j1` in `_tiles(*band.keys_seen_by(i0, i1), block_k, T_k)` compute the tile's scores
# (scaled), hide the invisible pairs where `band.tile_mask` returns a mask, take the tile's state
# with `online_softmax_block` and merge it in. At the end of the key loop, write the tile's output
# and logsumexp. With GQA, view the queries as `(B, G, H/G, T_q, D)` (`_grouped(q, g)`) and give the
# key tile an axis of length 1 so that it broadcasts over the `H/G` heads of its group.
#
# Nothing of size `T_q x T_k` may exist at any time: that is the point, and a hidden test measures it.

# %% [markdown]
# ## 3. The tiled backward
#
# Start from the dense backward (A8): with $P$ the weights, $dV = P^\top dO$, $dP = dO\, V^\top$,
# $dS = P \odot (dP - \text{rowsum}(P \odot dP))$, $dQ = \tau\, dS\, K$, $dK = \tau\, dS^\top Q$.
# Two obstacles stop you from doing this tile by tile; resolve both:
#
# 1. $P_{ij}$ needs the full row's normaliser. Which of the forward's outputs gives it exactly?
# 2. The row sum $\sum_j P_{ij}\, dP_{ij}$ runs over every key. Rewrite it with $O_i$ and $dO_i$.
#
# Then loop over key tiles (accumulating $dK_j$, $dV_j$) and, inside, over the query tiles that see
# them (adding into $dQ_i$). A row with no visible key has $\mathrm{lse} = -\infty$: make its
# weights 0, not NaN. With GQA, a key/value head receives the sum over the `H/G` query heads of its
# group.
#
# <!-- BEGIN SOLUTION -->
# 1. lse: P_ij = exp(tau q_i k_j - lse_i). 2. sum_j P_ij dP_ij = dO_i . sum_j P_ij v_j = dO_i . O_i.
# <!-- END SOLUTION -->
