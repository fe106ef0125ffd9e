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
# # Assignment: losses and optimisers
#
# You write:
#
# | function | file | catalogue |
# |---|---|---|
# | `cross_entropy_forward` (after the input checks) | `refmath/losses.py` | L2, L4, L5 |
# | `cross_entropy_backward` | `refmath/losses.py` | L3 |
# | `Adam.corrected_moments`, `Adam._update` | `refmath/optim.py` | O1, O2, O3, O4 |
# | `warmup_cosine` (after the input checks) | `refmath/optim.py` | O6 |
#
# The docstrings of `cross_entropy_forward`, `Adam`, `AdamW` and `warmup_cosine` state the
# equations; `CrossEntropyCache` says what the backward receives. `AdamW` is `Adam` with the class
# attribute `decoupled = True`: your `_update` serves both.
#
# Public tests: `python -m pytest -q tests`. The hidden tests compare with PyTorch's
# `cross_entropy`, `Adam`, `AdamW` and `CosineAnnealingLR` in float64: the optimisers over 300
# steps of a least-squares problem, so a small error in the update compounds and shows.

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

from refmath.softmax import log_softmax_forward

# %% [markdown]
# ## 1. Cross-entropy, ignore index and label smoothing
#
# The counted tokens $C$ are those whose target is not `ignore_index` and whose `loss_mask` is 1
# (the input checks compute `counted` for you). With $\log p = \operatorname{log\,softmax}(z)$ (use
# the library's `log_softmax_forward`, which is stable) and $n = |C|$:
#
# $$\ell = \frac1n \sum_{t \in C} \Big[-(1-\varepsilon)\log p_{t,a_t} - \frac{\varepsilon}{V}\sum_v \log p_{t,v}\Big]$$
#
# An uncounted target may be `-100`: replace it by a valid index before you index with it, and
# make sure nothing of an uncounted row reaches the sum (not even `0 * inf`). With $n = 0$ the
# loss is 0. The loss is a 0-d array of the logits' dtype.
#
# For the backward, derive $\partial \ell_t / \partial z_t$ for one counted token: write the
# smoothed target distribution $q_t$ and show that the gradient is the difference of two
# distributions. Uncounted rows get 0; `dout` is the scalar upstream gradient.
#
# **Question.** Why does the gradient of a row sum to zero over the vocabulary?
#
# <!-- BEGIN SOLUTION -->
# It is (p - q) / n, and both p and q are probability distributions over the vocabulary: each
# sums to one, so their difference sums to zero.
# <!-- END SOLUTION -->

# %%
z = np.array([[2.0, 0.0, -1.0]])
logp, _ = log_softmax_forward(z)
print("log p =", logp, " sum of p =", np.exp(logp).sum())

# %% [markdown]
# ## 2. Adam, Adam with L2, AdamW
#
# Per parameter, with the moments `m`, `v` starting at zero (they live in
# `self.state["m"][name]`, `self.state["v"][name]`; `setdefault` creates them on the first step)
# and `self.step_count` the step number $s$ (already incremented when `_update` runs):
#
# * Adam with L2 (O3): the decay enters the gradient, $g' = g + \lambda \theta$, before the moments.
# * AdamW (O4): the moments see the data gradient only; the decay multiplies $\theta$ by
#   $1 - \eta\lambda$ before the Adam step.
# * Bias correction (O2): `corrected_moments` divides $m_s$ by $1 - \beta_1^s$ and $v_s$ by
#   $1 - \beta_2^s$.
#
# Update `p` **in place** (`p -= ...`): the caller's parameter dict holds the arrays.
#
# **Question.** For a constant gradient $g$, what are $m_s$ and $\hat m_s$?
#
# <!-- BEGIN SOLUTION -->
# m_s = (1 - beta1^s) g, a geometric sum; so m_hat_s = g exactly, at every step.
# <!-- END SOLUTION -->

# %% [markdown]
# ## 3. Warmup, then cosine
#
# A linear ramp from 0 at step 0 to `max_lr` at step `warmup`, then half a cosine from `max_lr` to
# `min_lr` at step `total`, and `min_lr` after. Check your function at the three corners
# (`warmup`, the midpoint, `total`) by hand before the tests do.
