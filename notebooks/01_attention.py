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
# # Lesson 1: attention, step by step
#
# This lesson walks through scaled dot-product attention on numbers small enough to check by
# hand (catalogue IDs A1-A8), then runs the same functions at full size. Every cell calls the
# library's own functions next to a hand computation, and asserts that the two agree.

# %%
import time

import matplotlib.pyplot as plt
import numpy as np

from refmath.attention import causal_mask, mha_forward, sdpa_backward, sdpa_forward
from refmath.gradcheck import numerical_gradient
from refmath.softmax import softmax_forward, softmax_jacobian

np.set_printoptions(precision=4, suppress=True)

# %% [markdown]
# ## A1: queries, keys and values are three views of the same tokens
#
# Three tokens, each a row of `X` with `d = 4` features. Three weight matrices, each `d x d_k`,
# turn every row into a query, a key and a value: `Q = X W_Q`, `K = X W_K`, `V = X W_V`.

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
# The score of query `i` against key `j` is `q_i . k_j / sqrt(d_k)`; a softmax over `j` turns the
# scores of each row into weights that are positive and sum to one; the output row is the
# weighted sum of the value rows.

# %%
d_k = Q.shape[-1]
S = Q @ K.T / np.sqrt(d_k)
A = np.exp(S - S.max(axis=1, keepdims=True))
A /= A.sum(axis=1, keepdims=True)
O_by_hand = A @ V

O, cache = sdpa_forward(Q, K, V)
print("scores =\n", S, "\nweights =\n", A, "\noutput =\n", O)
np.testing.assert_allclose(O, O_by_hand, rtol=1e-14)
np.testing.assert_allclose(cache.a.sum(axis=1), 1.0)

# %% [markdown]
# A causal mask adds `-inf` to the scores of keys that lie in the future, so their weight is
# exactly zero: token `i` only reads tokens `0..i`.

# %%
mask = causal_mask(3)
O_causal, cache_causal = sdpa_forward(Q, K, V, mask=mask)
print("mask =\n", mask, "\ncausal weights =\n", cache_causal.a)

fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), layout="constrained")
for ax, weights, title in ((axes[0], cache.a, "full"), (axes[1], cache_causal.a, "causal")):
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
# Scores `(0, log 2, 0)` exponentiate to `(1, 2, 1)`, so the weights are `(1/4, 1/2, 1/4)`.
# With values `(1, 0), (0, 2), (3, 0)` the output is `(1/4 + 3/4, 1) = (1, 1)`. Masking the third
# key leaves `(1, 2)`, renormalised to `(1/3, 2/3, 0)`.
#
# To get exactly these scores from `sdpa_forward`, take `d_k = 1`, scale 1, the query `q = 1` and
# the keys `k = (0, log 2, 0)`.

# %%
q = np.array([[1.0]])
k = np.array([[0.0], [np.log(2.0)], [0.0]])
v = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
o, c = sdpa_forward(q, k, v, scale=1.0)
print("weights", c.a, "output", o)
np.testing.assert_allclose(c.a, [[0.25, 0.5, 0.25]], rtol=1e-15)
np.testing.assert_allclose(o, [[1.0, 1.0]], rtol=1e-15)

o_masked, c_masked = sdpa_forward(q, k, v, mask=np.array([[0.0, 0.0, -np.inf]]), scale=1.0)
print("masked weights", c_masked.a)
np.testing.assert_allclose(c_masked.a, [[1 / 3, 2 / 3, 0.0]], rtol=1e-15)

# %% [markdown]
# ## A4: why divide by sqrt(d_k)
#
# If the coordinates of `q` and `k` are independent with mean 0 and variance 1, then `q . k` is a
# sum of `d_k` products of variance 1 each: its variance is `d_k`. Without the scale, scores
# spread out as `d_k` grows and the softmax saturates towards a one-hot row, whose gradient is
# nearly zero (see A5). Dividing by `sqrt(d_k)` brings the variance back to 1.

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
ax.plot(widths, [largest_weight(d, False) for d in widths], "o-", label="q.k")
ax.plot(widths, [largest_weight(d, True) for d in widths], "s-", label="q.k / sqrt(d_k)")
ax.set(xscale="log", xlabel="d_k", ylabel="mean largest weight (32 keys)",
       title="softmax saturates without the scale")
ax.legend()
plt.show()

# %% [markdown]
# ## A5: the softmax Jacobian
#
# `da_j / ds_u = a_j (delta_ju - a_u)`, that is `diag(a) - a a^T`. Each column sums to zero
# (the weights always sum to one) and, for a nearly one-hot row, every entry is nearly zero.

# %%
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
# ## A6 and A7: several heads, and attention across two sequences
#
# Multi-head attention splits the projected width into `h` heads of width `d_h`, attends in each
# head separately, concatenates the head outputs and mixes them with `W_O` (`h d_h x d`).
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
# In cross-attention the queries come from one sequence (`m` rows, e.g. the decoder) and the keys
# and values from another (`n` rows, the encoder output): the score matrix is `m x n`.

# %%
m, n = 3, 6
decoder_states, encoder_states = rng.standard_normal((1, m, d)), rng.standard_normal((1, n, d))
y_cross, cache_cross = mha_forward(decoder_states, params, n_heads=h, context=encoder_states)
cross_weights = cache_cross.attn.a[0]  # (h, m, n)
print("cross-attention output", y_cross.shape, "weights per head", cross_weights.shape)

fig, axes = plt.subplots(1, h, figsize=(8, 2.8), layout="constrained")
for r, ax in enumerate(axes):
    ax.imshow(cross_weights[r], vmin=0, vmax=1, cmap="viridis")
    ax.set(title=f"head {r}: {m} x {n}", xlabel="encoder position", ylabel="decoder position")
plt.show()

# %% [markdown]
# ## A8: the backward pass, by hand
#
# With `A` the weights and `dO` the gradient arriving at the output:
# `dV = A^T dO`, `dA = dO V^T`, `dS_ij = A_ij (dA_ij - sum_u A_iu dA_iu)`,
# `dQ = dS K / sqrt(d_k)` and `dK = dS^T Q / sqrt(d_k)`.

# %%
dO = rng.standard_normal(O.shape)
dV = A.T @ dO
dA = dO @ V.T
dS = A * (dA - np.sum(A * dA, axis=1, keepdims=True))
dQ, dK = dS @ K / np.sqrt(d_k), dS.T @ Q / np.sqrt(d_k)

dq, dk, dv = sdpa_backward(dO, cache)
for name, mine, library in (("dQ", dQ, dq), ("dK", dK, dk), ("dV", dV, dv)):
    np.testing.assert_allclose(mine, library, rtol=1e-12, atol=1e-15)
    print(name, "by hand equals sdpa_backward")

# and both equal central differences of sum(O * dO):
numeric_dQ = numerical_gradient(lambda: float(np.sum(sdpa_forward(Q, K, V)[0] * dO)), Q, np.arange(Q.size))
np.testing.assert_allclose(dq.ravel(), numeric_dQ, rtol=1e-8, atol=1e-12)

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
