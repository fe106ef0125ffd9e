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
# # Assignment: attention, forward and backward
#
# You write five functions of `refmath/attention.py`:
#
# | function | what it computes | catalogue |
# |---|---|---|
# | `sdpa_forward(q, k, v, mask, dropout_mask, scale)` | scaled dot-product attention | A2 |
# | `sdpa_backward(dout, cache)` | `(dq, dk, dv)` | A8 |
# | `gqa_head_map(h, g)` | the key/value head each query head reads | A10 |
# | `mha_forward(x, params, n_heads, n_kv_heads, context, mask, dropout_mask)` | multi-head attention | A1, A6, A7, A9, A10 |
# | `mha_backward(dout, cache)` | `(dx, dparams)` or `(dx, dparams, dcontext)` | |
#
# The input checks at the top of each forward are written for you; the stub
# `raise NotImplementedError` marks where your code goes. Read each function's docstring for its
# shapes, and the cache classes (`SDPACache`, `MHACache`) for what the forward must store.
#
# Run the public tests with `python -m pytest -q tests`. The hidden tests compare with an
# independent implementation in float64 with a relative tolerance of about 1e-11, and they time
# the backward passes on inputs large enough that a gradient by finite differences cannot finish.
# A correct analytic gradient passes easily.

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

from refmath.attention import causal_mask
from refmath.softmax import softmax_backward, softmax_forward

# %% [markdown]
# ## 1. The forward pass
#
# For queries $Q$ (`t_q x d_k`), keys $K$ (`t_k x d_k`) and values $V$ (`t_k x d_v`):
#
# $$S = \tau\, Q K^\top + M,\qquad A = \operatorname{softmax}_\text{rows}(S),\qquad O = (A \odot D) V$$
#
# with $\tau = 1/\sqrt{d_k}$ unless `scale` is given, $M$ the additive mask (0 or $-\infty$) and
# $D$ the dropout multiplier (0 or $1/(1-p)$; `None` means no dropout). Leading dimensions
# (batch, heads) are carried along: use `np.swapaxes(k, -1, -2)` rather than `k.T`.
#
# Use the library's `softmax_forward`: it is stable (subtracts the row maximum) and gives a row
# whose entries are all $-\infty$ a zero row, which is the contract for a query that sees no key.
# Keep the dtype: a float32 input must give a float32 output.
#
# What the backward pass needs goes into `SDPACache(q, k, v, a, dropout_mask, scale)`; `a` is the
# attention matrix *before* dropout.

# %%
q = np.array([[1.0, 0.0], [0.0, 1.0]])
k = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
print("causal mask for 2 queries over 3 keys:\n", causal_mask(2, 3))

# %% [markdown]
# ## 2. The backward pass, one node at a time
#
# Walk the graph $Q, K \to S \to A \to O \leftarrow V$ backwards. You are given $dO$, the gradient
# of the loss with respect to $O$, with the shape of $O$.
#
# 1. $O = W V$ with $W = A \odot D$ is a matrix product: what are $dW$ and $dV$? Check the shapes.
# 2. Through the dropout multiplier: $dA = dW \odot D$.
# 3. Through the softmax of each row: the Jacobian of $a = \operatorname{softmax}(s)$ is
#    $\operatorname{diag}(a) - a a^\top$. Multiply it by the row $da$ and simplify; or use
#    `softmax_backward(da, SoftmaxCache(a))` from `refmath.softmax`, whose derivation you can read.
# 4. Through $S = \tau Q K^\top$: two more matrix products (the mask is a constant).
#
# Check on the example below that the Jacobian-vector product needs no `t_k x t_k` matrix.

# %%
s = np.array([[0.5, -1.0, 2.0]])
a, cache = softmax_forward(s)
jacobian = np.diag(a[0]) - np.outer(a[0], a[0])
da = np.array([[1.0, 0.0, -1.0]])
print("Jacobian times da:", da @ jacobian, "  softmax_backward:", softmax_backward(da, cache))

# %% [markdown]
# **Question.** A key that is masked for every query gets which gradient $dK$, $dV$, and why?
# (The hidden tests check it.)
#
# <!-- BEGIN SOLUTION -->
# Its column of A is exactly zero, so every term of dV and dK that involves it has a factor
# a_ij = 0: both rows are exactly zero.
# <!-- END SOLUTION -->

# %% [markdown]
# ## 3. Grouped key/value heads (GQA)
#
# With `h` query heads and `g` key/value heads (`g` divides `h`), query head `r` reads key/value
# head $\pi(r) = \lfloor r / (h/g) \rfloor$: consecutive blocks of `h/g` query heads share one.
# `g = h` is ordinary multi-head attention, `g = 1` is multi-query attention.
#
# In the backward pass, a key/value head that served `h/g` query heads receives the *sum* of their
# gradients. The sum over a block of consecutive heads is one reshape and one `sum`.

# %% [markdown]
# ## 4. Multi-head attention
#
# $$Q = X W_Q + b_Q,\quad K = Z W_K + b_K,\quad V = Z W_V + b_V,\qquad
#   O_r = \operatorname{softmax}\Big(\frac{Q_r K_{\pi(r)}^\top}{\sqrt{d_h}} + M\Big) V_{\pi(r)},\qquad
#   Y = [O_1 \cdots O_h] W_O + b_O$$
#
# with $Z = X$ (self-attention) or the `context` (cross-attention). The helpers `_linear`,
# `split_heads`, `merge_heads` and `_linear_grads` are given; `params` may hold a fused
# `w_qkv = [W_Q W_K W_V]` instead of the three matrices (split its output with `np.split`).
# The backward pass runs the forward in reverse; for self-attention, $dX$ collects the gradient of
# all three projections.
#
# **Question.** How many floats does `MHACache` keep for `B = 8`, `T = 1024`, `h = 16`, `g = 4`,
# `d_h = 64`, `d = 1024`, and which array dominates?
#
# <!-- BEGIN SOLUTION -->
# The attention weights, B h T T = 8 * 16 * 1024 * 1024 = 134M floats, dominate; x and heads_out
# are B T d = 8M each, and q, k, v repeated to h heads B h T d_h = 8M each.
# <!-- END SOLUTION -->
