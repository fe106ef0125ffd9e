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
# # Assignment: normalisation, the feed-forward block and rotary positions
#
# You write:
#
# | function | file | returns | catalogue |
# |---|---|---|---|
# | `layernorm_backward(dout, cache)` | `refmath/norms.py` | `(dx, dgamma, dbeta)` | N1 |
# | `rmsnorm_backward(dout, cache)` | `refmath/norms.py` | `(dx, dgamma)` | N2 |
# | `gelu_backward(dout, cache)`, the exact branch | `refmath/ffn.py` | `dx` | N6 |
# | `swiglu_backward(dout, cache)` | `refmath/ffn.py` | `(dx, dw_gate, dw_up, dw_down)` | N7 |
# | `_rotate_pairs`, `rope_forward`, `rope_backward` | `refmath/positions.py` | | N10 |
#
# The forwards of LayerNorm, RMSNorm, GELU and SwiGLU are given: read them, and their caches
# (`LayerNormCache`, `RMSNormCache`, `GELUCache`, `SwiGLUCache`), to see what your backward receives.
# Leading dimensions are rows: `x` is `(..., d)` and `dgamma` sums over every leading axis.
#
# Public tests: `python -m pytest -q tests`. The hidden tests compare with an independent
# implementation in float64 at a relative tolerance of about 1e-11, check that float32 stays
# float32, and time the backwards on inputs where finite differences cannot finish.

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

from refmath.norms import layernorm_forward, rmsnorm_forward
from refmath.positions import rope_angles

# %% [markdown]
# ## 1. LayerNorm backward
#
# $$\mu = \tfrac1d \textstyle\sum_k x_k,\quad \sigma^2 = \tfrac1d \sum_k (x_k - \mu)^2,\quad
#   \hat x = (x - \mu)/\sqrt{\sigma^2 + \epsilon},\quad y = \gamma \odot \hat x + \beta$$
#
# `dgamma` and `dbeta` are sums over the rows. For `dx`, write $g = \gamma \odot dy$ (the gradient
# reaching $\hat x$) and differentiate $\hat x_j$ with respect to $x_i$: it has three terms, from
# the numerator, from $\mu$ and from $\sigma$. Show that $\partial\sigma/\partial x_i = \hat x_i / d$
# and collect the terms into a form with two means over the features. Vectorise it over rows with
# `keepdims=True`.
#
# **Question.** What is `dx.sum(axis=-1)` for any `dout`, and why?
#
# <!-- BEGIN SOLUTION -->
# Zero: LayerNorm's output does not change when a constant is added to every feature of a row,
# so the gradient is orthogonal to the all-ones vector.
# <!-- END SOLUTION -->

# %%
x = np.array([[1.0, 2.0, 4.0]])
y, cache = layernorm_forward(x, np.ones(3), np.zeros(3))
print("xhat:", cache.xhat, " rstd:", cache.rstd)

# %% [markdown]
# ## 2. RMSNorm backward
#
# $$r = \big(\tfrac1d \textstyle\sum_k x_k^2 + \epsilon\big)^{-1/2},\qquad y = \gamma \odot x\, r$$
#
# No mean is removed. Differentiate $r$ with respect to $x_i$ first ($\partial r / \partial x_i$
# is a multiple of $r^3 x_i$), then apply the product rule to $x_j r$.

# %% [markdown]
# ## 3. GELU (exact) and SwiGLU
#
# $\operatorname{GELU}(x) = x\,\Phi(x)$ with $\Phi$ the standard normal CDF; the cache holds
# $\Phi(x)$ as `gate`. Its derivative needs the density $\varphi(x) = e^{-x^2/2}/\sqrt{2\pi}$
# (`_INV_SQRT_2PI` is $1/\sqrt{2\pi}$). Only the exact branch is yours: the tanh form is given.
#
# SwiGLU: $F(x) = [\operatorname{SiLU}(x W_g) \odot (x W_u)] W_d$. Name the intermediates as the
# cache does (`gate` is the SiLU cache of $x W_g$, `up` is $x W_u$, `hidden` the product) and go
# backwards through $W_d$, the elementwise product, the SiLU (`silu_backward` is given) and the two
# input projections. $x$ feeds two branches: its gradient is the sum of both.

# %% [markdown]
# ## 4. RoPE, forward and backward
#
# Each coordinate pair of the row at position $p$ is rotated by $\theta = p\,\omega_r$,
# $\omega_r = b^{-2r/d_k}$ (`rope_angles(positions, d_k, base)` gives all the $\theta$):
#
# $$\tilde x_{2r} = x_{2r}\cos\theta - x_{2r+1}\sin\theta,\qquad
#   \tilde x_{2r+1} = x_{2r}\sin\theta + x_{2r+1}\cos\theta$$
#
# `_rotate_pairs(x, cos, sin, layout)` applies that rotation to every pair; `_pair_slots` says
# where the two coordinates of pair `r` sit in each layout. `rope_forward` computes the angles
# of the positions, their cos and sin in `x`'s dtype, rotates, and stores `RoPECache(cos, sin,
# layout)`.
#
# **Question.** The forward is linear in $x$ with an orthogonal matrix. What is its backward?
#
# <!-- BEGIN SOLUTION -->
# The transpose of a rotation is the rotation by the opposite angle: the backward rotates dout by
# -theta, i.e. the same pair rotation with sin negated.
# <!-- END SOLUTION -->

# %%
print("angles of positions 0..3 for d_k = 4:\n", rope_angles(np.arange(4), 4))
