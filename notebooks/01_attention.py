# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
#   refmath:
#     figures: 3
#     ids: [A1, A2, A3, A4, A5, A6, A7, A8]
#     minutes: 75
# ---

# %% [markdown]
# # Lesson 1: attention, step by step
#
# Scaled dot-product attention on numbers small enough to check by hand, then its backward pass
# derived and computed by hand, masks and dropout included, then the same functions at full size.
# Every cell calls the library's own functions next to a hand computation, and checks that the
# two agree.
#
# **Prerequisites:** matrix products and broadcasting in NumPy; the softmax; the chain rule.
#
# **Goals:** compute queries, keys, values, scores, weights and outputs by hand; explain the
# $1/\sqrt{d_k}$ scale; write the softmax Jacobian; split attention into heads and across two
# sequences; derive the attention backward pass, see why masked entries get exactly zero
# gradient and why dropout's mask must be reused in the backward; check it all by central
# differences.
#
# **Catalogue IDs:** A1, A2, A3, A4, A5, A6, A7, A8
#
# **Duration:** 75 minutes

# %%
import time

import matplotlib.pyplot as plt
import numpy as np

from refmath.attention import causal_mask, mha_forward
from refmath.gradcheck import numerical_gradient, relative_error
from refmath.lessons import check, check_true
from refmath.softmax import softmax_forward

np.set_printoptions(precision=4, suppress=True)

# %% [markdown]
# ## A1: queries, keys and values are three views of the same tokens
#
# Three tokens, each a row of $X$ with $d = 4$ features. Three weight matrices, each
# $d \times d_k$, turn every row into a query, a key and a value:
#
# $$Q = X W_Q,\qquad K = X W_K,\qquad V = X W_V .$$

# %%
X = np.array([[1.0, 0.0, 1.0, 0.0],
              [0.0, 2.0, 0.0, 2.0],
              [1.0, 1.0, 1.0, 1.0]])
W_Q = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]) / 2
W_K = np.array([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
W_V = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
Q, K, V = X @ W_Q, X @ W_K, X @ W_V
print("Q =\n", Q, "\nK =\n", K, "\nV =\n", V)

# %% [markdown]
# ## A2: scores, softmax, weighted sum
#
# The score of query $i$ against key $j$ is $s_{ij} = q_i k_j^\top / \sqrt{d_k} + M_{ij}$, with
# $M_{ij}$ an additive mask (0 or $-\infty$); a softmax over $j$ turns each row of scores into
# weights that are positive and sum to one; the output row is the weighted sum of the value rows:
#
# $$a_{ij} = \frac{e^{s_{ij}}}{\sum_u e^{s_{iu}}},\qquad o_i = \sum_j a_{ij} v_j .$$

# %%
d_k = Q.shape[-1]
S = Q @ K.T / np.sqrt(d_k)
A = np.exp(S - S.max(axis=1, keepdims=True))
A /= A.sum(axis=1, keepdims=True)
O_by_hand = A @ V

print("scores =\n", S, "\nweights =\n", A, "\noutput =\n", O_by_hand)
np.testing.assert_allclose(A.sum(axis=1), 1.0)

# %% [markdown]
# A causal mask adds $-\infty$ to the scores of keys that lie in the future, so their weight is
# exactly zero: token $i$ only reads tokens $0, \dots, i$ ($e^{-\infty} = 0$, and every row keeps
# its own key, so no row is all $-\infty$).

# %%
mask = causal_mask(3)
S_causal = S + mask
A_causal_by_hand = np.exp(S_causal - S_causal.max(axis=1, keepdims=True))
A_causal_by_hand /= A_causal_by_hand.sum(axis=1, keepdims=True)
print("mask =\n", mask, "\ncausal weights =\n", A_causal_by_hand)

fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), layout="constrained")
for ax, weights, title in ((axes[0], A, "full"), (axes[1], A_causal_by_hand, "causal")):
    image = ax.imshow(weights, vmin=0, vmax=1, cmap="viridis")
    ax.set(title=f"{title} attention weights", xlabel="key j", ylabel="query i",
           xticks=range(3), yticks=range(3))
    for (i, j), w in np.ndenumerate(weights):
        ax.text(j, i, f"{w:.2f}", ha="center", va="center", color="white" if w < 0.5 else "black")
fig.colorbar(image, ax=axes, shrink=0.8)
plt.show()

# %% [markdown]
# ## A3: a worked example to check by hand
#
# Scores $(0, \log 2, 0)$ exponentiate to $(1, 2, 1)$, so the weights are $(1/4, 1/2, 1/4)$.
# With values $(1, 0), (0, 2), (3, 0)$ the output is $(1/4 + 3/4,\ 1) = (1, 1)$. Masking the third
# key leaves $(1, 2)$, renormalised to $(1/3, 2/3, 0)$.
#
# To get exactly these scores, take $d_k = 1$, scale 1, the query $q = 1$ and the keys
# $k = (0, \log 2, 0)$ (after exercise 01.2, the library's `sdpa_forward` computes this example
# too).

# %%
q = np.array([[1.0]])
k = np.array([[0.0], [np.log(2.0)], [0.0]])
v = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
e3 = np.exp(q @ k.T)  # scale 1: the scores are q k^T themselves
w3 = e3 / e3.sum(axis=1, keepdims=True)
print("weights", w3, "output", w3 @ v)
np.testing.assert_allclose(w3, [[0.25, 0.5, 0.25]], rtol=1e-15)
np.testing.assert_allclose(w3 @ v, [[1.0, 1.0]], rtol=1e-15)

# %% tags=["exercise"]
# Exercise 01.1: the output row of the masked example (third key masked), by hand, from the
# masked weights (1/3, 2/3, 0) and the values v above.
o_masked_by_hand = ...
# BEGIN SOLUTION
o_masked_by_hand = np.array([[1 / 3 * 1 + 2 / 3 * 0, 1 / 3 * 0 + 2 / 3 * 2]])
# END SOLUTION

# %%
check("01.1", o_masked_by_hand)

# %%
# After the exercise: the mask applied to the exponentials, as a kernel applies it.
e3_masked = e3 * np.array([[1.0, 1.0, 0.0]])  # e^(s - inf) = 0 for the masked third key
w3_masked = e3_masked / e3_masked.sum(axis=1, keepdims=True)
print("masked weights", w3_masked)
np.testing.assert_allclose(w3_masked, [[1 / 3, 2 / 3, 0.0]], rtol=1e-15)

# %% [markdown]
# ## A4: why divide by $\sqrt{d_k}$
#
# If the coordinates of $q$ and $k$ are independent with mean 0 and variance 1, then
# $q k^\top = \sum_{c=1}^{d_k} q_c k_c$ is a sum of $d_k$ products of variance 1 each: its
# variance is $d_k$. Without the scale, scores spread out as $d_k$ grows and the softmax
# saturates towards a one-hot row, whose gradient is nearly zero (see A5). Dividing by
# $\sqrt{d_k}$ brings the variance back to 1.

# %%
rng = np.random.default_rng(0)
dims = [4, 16, 64, 256]
for d in dims:
    qs, ks = rng.standard_normal((20000, d)), rng.standard_normal((20000, d))
    dots = np.einsum("nd,nd->n", qs, ks)
    print(f"d_k = {d:4d}: Var(q.k) = {dots.var():8.2f}   Var(q.k / sqrt(d_k)) = {(dots / np.sqrt(d)).var():.3f}")


def largest_weight(d, scaled, rows=2000, keys=32):
    scores = np.einsum("rd,rkd->rk", rng.standard_normal((rows, d)), rng.standard_normal((rows, keys, d)))
    a, _ = softmax_forward(scores / np.sqrt(d) if scaled else scores)
    return a.max(axis=1).mean()


fig, ax = plt.subplots(figsize=(5, 3))
widths = [1, 2, 4, 8, 16, 32, 64, 128, 256]
ax.plot(widths, [largest_weight(d, False) for d in widths], "o-", label=r"$q k^\top$")
ax.plot(widths, [largest_weight(d, True) for d in widths], "s-", label=r"$q k^\top / \sqrt{d_k}$")
ax.set(xscale="log", xlabel=r"$d_k$", ylabel="mean largest weight (32 keys)",
       title="softmax saturates without the scale")
ax.legend()
plt.show()

# %% [markdown]
# **Your turn: the whole forward pass.** With A2's equation and A4's scale, attention is a few
# lines of NumPy, and those lines are where the most common slip of all lives: a forgotten
# $1/\sqrt{d_k}$. Nothing is given here but the equation,
#
# $$O = \operatorname{softmax}\Big(\frac{Q K^\top}{\sqrt{d_k}} + M\Big) V,$$
#
# with the softmax along each row (over the keys) and $M$ additive: 0 where query $i$ may look at
# key $j$, $-\infty$ where it may not.

# %% tags=["exercise"]
# Exercise 01.2: write attention's forward pass. Q is (m, d_k), K (n, d_k), V (n, d_v), mask an
# (m, n) additive mask or None. Return O, (m, d_v). Write the softmax yourself (subtract each
# row's largest score before exp, as A2 does). The check calls it on three inputs (no mask, a
# causal mask, a cross-attention with a masked key) and compares with refmath's sdpa_forward;
# calling sdpa_forward or mha_forward is refused.
def my_attention(Q, K, V, mask=None):
    O = ...
    # BEGIN SOLUTION
    scores = Q @ K.T / np.sqrt(Q.shape[-1])
    if mask is not None:
        scores = scores + mask
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    O = (e / e.sum(axis=-1, keepdims=True)) @ V
    # END SOLUTION
    return O


# %%
from refmath.attention import sdpa_forward

check("01.2", my_attention)

# %% [markdown]
# That is the library's `sdpa_forward`, which returns the output and a cache for the backward pass
# (the weights `cache.a` among it). On the examples above it gives the numbers computed by hand:

# %%
O, cache = sdpa_forward(Q, K, V)
O_causal, cache_causal = sdpa_forward(Q, K, V, mask=mask)
np.testing.assert_allclose(O, O_by_hand, rtol=1e-14)
np.testing.assert_allclose(cache_causal.a, A_causal_by_hand, rtol=1e-14)
o, c = sdpa_forward(q, k, v, scale=1.0)
np.testing.assert_allclose(c.a, w3, rtol=1e-15)
print("sdpa_forward's output:\n", O, "\ncausal weights:\n", cache_causal.a)

# %% [markdown]
# ## A5: the softmax Jacobian
#
# $$\frac{\partial a_j}{\partial s_u} = a_j(\delta_{ju} - a_u),\qquad\text{that is}\qquad
# J = \operatorname{diag}(a) - a\,a^\top$$
#
# with $a$ written as a column, as the catalogue and `refmath.softmax.softmax_jacobian` write it:
# $a\,a^\top$ is the outer product (`np.outer(a, a)`), $J_{ju} = \partial a_j / \partial s_u$. (For
# the row vectors of the rest of the lesson the same matrix is $a^\top a$.) Each column sums to
# zero (the weights always sum to one) and, for a nearly one-hot row, every entry is nearly zero.

# %% tags=["exercise"]
# Exercise 01.3: the softmax Jacobian of the A3 weights a = (1/4, 1/2, 1/4), from the formula
# diag(a) - a a^T (a as a column: an outer product), as a 3 x 3 array.
jacobian_a3 = ...
# BEGIN SOLUTION
a3 = np.array([0.25, 0.5, 0.25])
jacobian_a3 = np.diag(a3) - np.outer(a3, a3)
# END SOLUTION

# %%
check("01.3", jacobian_a3)

# %% [markdown]
# The library's `softmax_jacobian` is that formula: central differences agree with it, and on a
# nearly one-hot row every entry is nearly zero.

# %%
from refmath.softmax import softmax_jacobian

s = np.array([0.5, -1.0, 2.0])
a, _ = softmax_forward(s)
J = softmax_jacobian(a)
J_numeric = np.stack([
    numerical_gradient(lambda: softmax_forward(s)[0][j], s, np.arange(3)) for j in range(3)
])
print("formula:\n", J, "\ncentral differences:\n", J_numeric)
np.testing.assert_allclose(J, J_numeric, atol=1e-12)
print("saturated row:\n", softmax_jacobian(softmax_forward(np.array([0.0, 20.0, 0.0]))[0]))

# %% [markdown]
# A backward pass never builds $J$: for an upstream gradient $da$ (a row), the gradient of the
# scores is the row-vector product
#
# $$ds_u = \sum_j da_j\, J_{ju}.$$
#
# Put the entries of $J$ from the formula above into that sum and split it in two: the
# $\delta_{ju}$ keeps one term of the sum, and the other term holds a sum over $j$ that does not
# depend on $u$, one number per row. Written that way, $ds$ needs no $n \times n$ matrix: an
# elementwise product, one sum per row, and a broadcast. That one line is
# `refmath.softmax.softmax_backward`, the function every attention backward in this library calls.
# Derive it on paper, then write it, for rows with any number of leading axes (a batch of heads of
# queries) and with masked entries (where $a = 0$). (Check your line on the A3 row: with
# $da = (1, 0, 0)$, $ds$ must be the first row of the Jacobian of 01.3.)

# %% tags=["exercise"]
# Exercise 01.4: write the softmax backward from the line you derived. `cache.a` is the softmax
# output a, of shape (..., n) (0 at masked entries and on fully masked rows); `dout` has the same
# shape. Return dx, the product dout J of every row, without building J. The check runs your function as the backward
# of the library's softmax_forward: a gradient check (central differences) on five cases, up to
# 4-D, masked rows included, and a comparison with softmax_backward (and with torch, if installed).
def my_softmax_backward(dout, cache):
    dx = ...
    # BEGIN SOLUTION
    a = cache.a
    row_mean = np.sum(a * dout, axis=-1, keepdims=True)  # <a, dout>, one per row
    dx = a * (dout - row_mean)
    # END SOLUTION
    return dx


# %%
check("01.4", my_softmax_backward)

# %% [markdown]
# ## A6 and A7: several heads, and attention across two sequences
#
# Multi-head attention splits the projected width into $h$ heads of width $d_h$, attends in each
# head separately, concatenates the head outputs and mixes them with $W_O$ ($h d_h \times d$):
#
# $$\mathrm{MHA}(X) = [O_1 \cdots O_h]\, W_O,\qquad O_r = \operatorname{attention}(X W_Q^{(r)},
# X W_K^{(r)}, X W_V^{(r)}).$$
#
# `mha_forward` does exactly that; here it is against a loop over heads.

# %%
T, d, h = 5, 8, 2
d_h = d // h
x = rng.standard_normal((1, T, d))
params = {name: rng.standard_normal(shape) / np.sqrt(d)
          for name, shape in (("w_q", (d, d)), ("w_k", (d, d)), ("w_v", (d, d)), ("w_o", (d, d)))}
y, _ = mha_forward(x, params, n_heads=h)

heads = []
for r in range(h):
    cols = slice(r * d_h, (r + 1) * d_h)
    o_r, _ = sdpa_forward(x[0] @ params["w_q"][:, cols], x[0] @ params["w_k"][:, cols],
                          x[0] @ params["w_v"][:, cols])
    heads.append(o_r)
y_by_hand = np.concatenate(heads, axis=-1) @ params["w_o"]
np.testing.assert_allclose(y[0], y_by_hand, rtol=1e-12)
print("multi-head output matches the per-head loop; shape", y.shape)

# %% [markdown]
# In cross-attention the queries come from one sequence ($m$ rows, e.g. the decoder) and the keys
# and values from another ($n$ rows, the encoder output): $Q = Y W_Q$, $K = Z W_K$, $V = Z W_V$,
# and the score matrix is $m \times n$.

# %%
m, n = 3, 6
decoder_states, encoder_states = rng.standard_normal((1, m, d)), rng.standard_normal((1, n, d))
y_cross, cache_cross = mha_forward(decoder_states, params, n_heads=h, context=encoder_states)
cross_weights = cache_cross.attn.a[0]  # (h, m, n)
print("cross-attention output", y_cross.shape, "weights per head", cross_weights.shape)

fig, axes = plt.subplots(1, h, figsize=(8, 2.8), layout="constrained")
for r, ax in enumerate(axes):
    image = ax.imshow(cross_weights[r], vmin=0, vmax=1, cmap="viridis")
    ax.set(title=f"head {r}: {m} x {n}", xlabel="encoder position", ylabel="decoder position")
fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
plt.show()

# %% [markdown]
# **Heads have no fixed roles.** Nothing in the equation says what head $r$ does: every head has
# the same form, and only its learned weights differ. Studies of trained models find heads that
# seem to follow syntax or copy tokens, but that describes one trained model, not the architecture;
# the equation does not even fix which head is "first": swap two heads' column blocks in $W_Q$,
# $W_K$, $W_V$ and the matching row blocks of $W_O$, and the layer computes the same function.

# %% tags=["exercise"]
# Exercise 01.5: build `params_swapped`, the parameters above with heads 0 and 1 exchanged (the
# column blocks of w_q, w_k and w_v, and the row blocks of w_o). The check runs mha_forward on it.
params_swapped = ...
# BEGIN SOLUTION
order = np.r_[d_h:2 * d_h, 0:d_h]  # head 1's columns first, then head 0's
params_swapped = {"w_q": params["w_q"][:, order], "w_k": params["w_k"][:, order],
                  "w_v": params["w_v"][:, order], "w_o": params["w_o"][order, :]}
# END SOLUTION

# %%
check("01.5", params_swapped)

# %%
# The swapped layer is the same function: the same output to rounding.
if params_swapped is not ...:
    y_swapped, _ = mha_forward(x, params_swapped, n_heads=h)
    print("largest difference from the original output:", float(np.abs(y_swapped - y).max()))

# %% [markdown]
# ## A8: the backward pass, by hand
#
# Let $dO$ be the gradient of the loss arriving at the output $O = AV$. The chain rule, one
# product at a time:
#
# $$dV = A^\top dO,\qquad dA = dO\, V^\top,\qquad
# dS_{ij} = A_{ij}\Big(dA_{ij} - \sum_u A_{iu}\, dA_{iu}\Big).$$
#
# The first two are the rule for a product $Y = XW$, $dX = dY\, W^\top$ and $dW = X^\top dY$,
# applied to $O = AV$; the third is the softmax Jacobian of A5 applied to each row, your 01.4
# line: $\sum_u A_{iu} dA_{iu}$ is the mean of $dA$ under the row's weights. The last step, from
# $dS$ back to the queries and the keys through $S = QK^\top/\sqrt{d_k}$, is yours to derive
# with the same rule (mind the transpose of $K$ and the scale). No code of this lesson computes
# these yet: the next two exercises are yours to write, with the upstream gradient

# %%
dO = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, -1.0]])

# %% [markdown]
# **Masked entries.** With the causal mask, $s_{ij} = -\infty$ above the diagonal, so
# $A_{ij} = 0$ there, and $dS_{ij} = A_{ij}(\dots) = 0$ exactly: a masked pair passes no gradient
# to the query or the key. The mask itself is a constant and gets no gradient. A key that every
# query masks gets zero rows in $dK$ and $dV$.

# %% tags=["exercise"]
# Exercise 01.6: dS and then the keys' gradient dK of the causal attention of A2 (the causal
# weights `A_causal`, dO above, and Q, K, V of A1): dS from the equations of A8, dK derived from
# S = Q K^T / sqrt(d_k). Which rows and columns of dS does a key's gradient collect?
A_causal = cache_causal.a
dS_causal = ...
dK_causal = ...
# BEGIN SOLUTION
dA_causal = dO @ V.T
dS_causal = A_causal * (dA_causal - np.sum(A_causal * dA_causal, axis=1, keepdims=True))
dK_causal = dS_causal.T @ Q / np.sqrt(d_k)
# END SOLUTION

# %%
check("01.6", dK_causal)

# %%
check_true("dS is zero above the diagonal", lambda ds: np.all(np.triu(ds, 1) == 0.0),
           "A_ij = 0 at a masked pair, and dS_ij carries the factor A_ij", of=dS_causal)

# %% [markdown]
# **Dropout.** In training, attention dropout multiplies the weights by a random mask $D$ (0 for a
# dropped weight, $1/(1-p)$ for a kept one):
#
# $$O = (A \odot D)\,V .$$
#
# The forward pass now has one more step between the softmax and the product with $V$: call its
# output $B = A \odot D$. The backward goes through it by the chain rule, with the *same* $D$ the
# forward drew, which is why the cache keeps the mask: $O = BV$ gives $dV$ and $dB$ as A8 gave them
# for $O = AV$, and an elementwise product by a constant passes its gradient through the same
# product. From $dA$ on, the softmax is A8's, and $dQ$ comes from $dS$ the way your $dK$ of 01.6
# did. Below, $p = 1/2$: the mask holds 0 and 2.

# %%
D = np.array([[2.0, 0.0, 0.0],
              [0.0, 2.0, 0.0],
              [2.0, 2.0, 0.0]])  # the mask drawn in the forward pass
O_drop, cache_drop = sdpa_forward(Q, K, V, mask=mask, dropout_mask=D)
print("output with dropout:\n", O_drop)

# %% tags=["exercise"]
# Exercise 01.7: dV and dQ of the causal attention with dropout mask D (dO as before), from the
# chain rule through B = A * D: derive dV and dA first, then dS as in A8, and dQ from
# S = Q K^T / sqrt(d_k) as you derived dK in 01.6.
# Give them as one array: np.concatenate([dV_drop, dQ_drop]).
dV_dQ_dropout = ...
# BEGIN SOLUTION
A_c = cache_drop.a  # the weights before dropout
dV_drop = (A_c * D).T @ dO
dA_drop = (dO @ V.T) * D
dS_drop = A_c * (dA_drop - np.sum(A_c * dA_drop, axis=1, keepdims=True))
dQ_drop = dS_drop @ K / np.sqrt(d_k)
dV_dQ_dropout = np.concatenate([dV_drop, dQ_drop])
# END SOLUTION

# %%
check("01.7", dV_dQ_dropout)

# %% [markdown]
# The library's `sdpa_backward` computes these gradients from the cache of the forward pass. The
# equations of A8 without a mask, on the example of A1-A2, give its numbers:

# %%
from refmath.attention import sdpa_backward

dV = A.T @ dO
dA = dO @ V.T
dS = A * (dA - np.sum(A * dA, axis=1, keepdims=True))
dQ, dK = dS @ K / np.sqrt(d_k), dS.T @ Q / np.sqrt(d_k)
dq, dk, dv = sdpa_backward(dO, cache)
for name, mine, library in (("dQ", dQ, dq), ("dK", dK, dk), ("dV", dV, dv)):
    np.testing.assert_allclose(mine, library, rtol=1e-12, atol=1e-15)
    print(name, "by hand equals sdpa_backward")

# %% [markdown]
# Finally, central differences (`refmath.gradcheck.numerical_gradient`, float64) of
# $\sum O \odot dO$ with the mask and the dropout mask held fixed agree with `sdpa_backward` for
# all three inputs:

# %%
analytic = dict(zip("QKV", sdpa_backward(dO, cache_drop)))
for name, array in (("Q", Q), ("K", K), ("V", V)):
    numeric = numerical_gradient(
        lambda: float(np.sum(sdpa_forward(Q, K, V, mask=mask, dropout_mask=D)[0] * dO)), array,
        np.arange(array.size)).reshape(array.shape)
    error = float(relative_error(analytic[name], numeric).max())
    print(f"d{name}: largest relative error against central differences {error:.1e}")
    assert error < 1e-7

# %% [markdown] tags=["question"]
# **Question.** A student's backward pass draws a *fresh* dropout mask instead of reusing the
# forward's. The training loss still goes down for a while. What is wrong with the gradient, and
# would a gradient check with dropout on catch it?
#
# <!-- BEGIN SOLUTION -->
# The forward computed $O = (A \odot D)V$; the gradient of that function involves $D$. With a
# fresh mask $D'$ the backward returns the gradient of $(A \odot D')V$, a different function:
# it credits weights that were dropped (and so had no effect on the loss) and ignores weights
# that were used, so the step is not a descent direction for the loss that was computed, only
# something correlated with one. A gradient check catches it at once, provided it holds the mask
# fixed as above: central differences of the forward with mask $D$ do not match a backward that
# used $D'$.
# <!-- END SOLUTION -->

# %% [markdown]
# ## The same equation at full size
#
# The functions above are the same ones an engineer uses as an oracle for a kernel. At `T = 1024`
# with 8 heads the score matrix alone holds 8 million numbers per batch element: that quadratic
# memory is what FlashAttention avoids (catalogue F4).

# %%
B, H, T, D = 1, 8, 1024, 64
q, k, v = (rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(3))
start = time.perf_counter()
o, c = sdpa_forward(q, k, v, mask=causal_mask(T, dtype=np.float32))
elapsed = time.perf_counter() - start
print(f"causal attention, B={B} H={H} T={T} D={D} float32: {elapsed * 1e3:.0f} ms, "
      f"weights array {c.a.nbytes / 2**20:.0f} MiB")

# %% [markdown]
# The cached weights alone take 32 MiB here; the backward pass needs them (or must recompute
# them, lesson 3).
#
# ## Exercises
#
# 1. Give the key projection a bias $b_K$. Show that it adds the same number $q_i b_K^\top$ to
#    every score of row $i$, so the softmax ignores it and $db_K = 0$; check with `mha_forward` and
#    `mha_backward`.
# 2. Compute $dK$ by hand for the masked A3 example ($d_k = 1$, third key masked). Which row is
#    zero, and why?
# 3. Derive $dW_Q$, $dW_K$, $dW_V$ from $dQ$, $dK$, $dV$ and check them against `mha_backward`
#    on a one-head example.
# 4. Repeat the A4 experiment with keys whose coordinates have variance 4. What scale would keep
#    the scores at unit variance?
# 5. With dropout rate $p$, show that $\mathbb E[(A \odot D)] = A$ when kept weights are scaled by
#    $1/(1-p)$. What would go wrong at evaluation time without that scaling?
#
# ## References
#
# - Bahdanau, Cho and Bengio (2015), *Neural Machine Translation by Jointly Learning to Align and
#   Translate* (attention between two sequences).
# - Vaswani et al. (2017), *Attention Is All You Need* (scaled dot-product and multi-head
#   attention, the $1/\sqrt{d_k}$ argument).
# - Srivastava et al. (2014), *Dropout: A Simple Way to Prevent Neural Networks from Overfitting*.
# - Bridle (1990), *Probabilistic Interpretation of Feedforward Classification Network Outputs,
#   with Relationships to Statistical Pattern Recognition* (the softmax).
