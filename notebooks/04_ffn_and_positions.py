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
#     ids: [N5, N6, N7, N8, N10]
#     minutes: 50
# ---

# %% [markdown]
# # Lesson 4: the feed-forward block and where tokens sit
#
# Attention mixes tokens; the position-wise feed-forward network transforms each token on its
# own. Attention alone cannot tell positions apart, so the model is told where every token is:
# by adding a table of sines, or by rotating queries and keys (RoPE). This lesson writes each
# formula, computes it by hand on small numbers, and derives the backward passes of GELU,
# SwiGLU and RoPE.
#
# **Prerequisites:** lesson 1 (gradient checks by central differences); lesson 2 (backward
# passes of elementwise and row-wise maps); rotations in the plane.
#
# **Goals:** see why the FFN needs its nonlinearity; write exact and tanh GELU and their
# derivatives; find where a SiLU "gate" leaves $[0, 1]$; derive the SwiGLU backward; explain the
# $8d/3$ width and why rounding it adds
# parameters; compute a RoPE rotation by hand, show that scores depend on the offset only, and
# that the RoPE backward is the inverse rotation; relate the two pair layouts used in practice.
#
# **Catalogue IDs:** N5, N6, N7, N8, N10
#
# **Duration:** 50 minutes

# %%
import matplotlib.pyplot as plt
import numpy as np

from refmath.ffn import (
    ffn_forward,
    gelu_forward,
    silu_forward,
    standard_normal_cdf,
    swiglu_forward,
)
from refmath.gradcheck import numerical_gradient, relative_error
from refmath.lessons import check, check_true
from refmath.positions import rope_angles, sinusoidal_positions

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)


def largest_relative_error(analytic, function, x):
    """Five-point central differences of the scalar function() w.r.t. every entry of x."""
    numeric = numerical_gradient(function, x, np.arange(x.size)).reshape(x.shape)
    return float(relative_error(analytic, numeric).max())


# %% [markdown]
# ## N5: without a nonlinearity, two layers are one
#
# $$\mathrm{FFN}(x) = \mathrm{ReLU}(x W_1 + b_1)\, W_2 + b_2 .$$
#
# Drop the ReLU and the two affine maps collapse into one,
# $x\,(W_1 W_2) + (b_1 W_2 + b_2)$: the hidden width buys nothing. The nonlinearity is what makes
# it useful.

# %%
d, d_f = 4, 16
x = rng.standard_normal((3, d))
w1, b1 = rng.standard_normal((d, d_f)), rng.standard_normal(d_f)
w2, b2 = rng.standard_normal((d_f, d)), rng.standard_normal(d)
linear_only, _ = ffn_forward(x, w1, b1, w2, b2, activation="identity")
np.testing.assert_allclose(linear_only, x @ (w1 @ w2) + (b1 @ w2 + b2), rtol=1e-12)
relu_ffn, _ = ffn_forward(x, w1, b1, w2, b2, activation="relu")
print("identity FFN equals one affine map; the ReLU FFN differs from it by",
      np.abs(relu_ffn - linear_only).max())

# %% [markdown]
# ## N6: GELU, its tanh approximation, and SiLU
#
# GELU weighs its input by the probability that a standard normal variable lies below it:
#
# $$\mathrm{GELU}(u) = u\,\Phi(u) = \tfrac12\, u\,\big(1 + \operatorname{erf}(u/\sqrt2)\big).$$
#
# GPT and GPT-2 used a tanh approximation of it, which avoids the error function:
#
# $$\mathrm{GELU}_{\tanh}(u) = \tfrac12\, u\,\Big(1 + \tanh\big(\sqrt{2/\pi}\,(u + 0.044715\,u^3)
# \big)\Big).$$
#
# SiLU is $u\,\sigma(u)$ with the logistic sigmoid $\sigma$. All three are smooth relatives of
# ReLU that let a little negative signal through.

# %%
u = np.linspace(-4, 4, 401)
exact, _ = gelu_forward(u)
tanh_form, _ = gelu_forward(u, approximate=True)
silu, _ = silu_forward(u)
by_formula = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))
np.testing.assert_allclose(tanh_form, by_formula, rtol=1e-13, atol=1e-15)
print(f"largest gap between exact and tanh GELU on [-4, 4]: {np.abs(exact - tanh_form).max():.2e}")

fig, ax = plt.subplots(figsize=(5, 3.2), layout="constrained")
ax.plot(u, np.maximum(u, 0), "k:", label="ReLU")
ax.plot(u, exact, label=r"GELU, $u\,\Phi(u)$")
ax.plot(u, tanh_form, "--", label="GELU (tanh)")
ax.plot(u, silu, label=r"SiLU, $u\,\sigma(u)$")
ax.set(xlabel="u", ylabel="activation", title="smooth relatives of ReLU")
ax.legend()
plt.show()

# %% [markdown]
# **A gate is not a probability.** SwiGLU (N7, below) calls $\mathrm{SiLU}(x W_g)$ its *gate*,
# but unlike the sigmoid inside it, SiLU is not confined to $[0, 1]$: it is negative for every
# $u < 0$ and grows without bound for $u > 0$, so the gated product can amplify a feature as
# well as damp or flip it. Since $\sigma(-u) = 1 - \sigma(u)$,
#
# $$\mathrm{SiLU}(u) - \mathrm{SiLU}(-u) = u\,\sigma(u) + u\,(1 - \sigma(u)) = u ,$$
#
# so the curve's two branches differ by exactly the line $u$: the point where SiLU crosses 1 and
# the point of its minimum mirror each other.

# %% tags=["exercise"]
# Exercises 04.1 and 04.2: the u > 0 where SiLU(u) = 1, to 1e-9 (bisection on silu_forward over [0, 4] is
# enough), and the smallest value SiLU takes anywhere (use the identity above).
u_one = ...
silu_min = ...
# BEGIN SOLUTION
low, high = 0.0, 4.0
while high - low > 1e-12:
    middle = (low + high) / 2
    low, high = (middle, high) if silu_forward(np.array(middle))[0] < 1 else (low, middle)
u_one = (low + high) / 2
silu_min = 1 - u_one  # SiLU(-u_one) = SiLU(u_one) - u_one, at the minimum's place -u_one
# END SOLUTION

# %%
check("04.1", u_one)

# %%
check("04.2", silu_min)

# %% [markdown] tags=["question"]
# **Question.** In SwiGLU the gate multiplies the up-projection feature by feature. What can a
# gate value of 2.9 (SiLU(3)) or a negative one (SiLU(-1)) do to a feature that a sigmoid gate
# cannot?
#
# <!-- BEGIN SOLUTION -->
# A sigmoid gate lies in $(0, 1)$: it can only pass a feature through partly, never enlarge it or
# change its sign. A SiLU gate of 2.9 amplifies the feature almost threefold, and a negative gate
# flips its sign (by at most 0.28 of its size), so the "gate" is a learned, input-dependent scale,
# not a probability of letting the feature through.
# <!-- END SOLUTION -->

# %% [markdown]
# **The GELU backward.** Both forms are elementwise, so the backward multiplies the upstream
# gradient by the derivative, and the derivatives are yours to take. The two forward passes:
#
# $$\mathrm{GELU}(u) = u\,\Phi(u),\qquad
# \mathrm{GELU}_{\tanh}(u) = \tfrac12\, u\,(1 + t),\quad
# t = \tanh\big(\sqrt{2/\pi}\,(u + 0.044715\,u^3)\big),$$
#
# and the facts you need: $\Phi' = \varphi$, the standard normal density
# $\varphi(u) = e^{-u^2/2} / \sqrt{2\pi}$, and $\tanh' = 1 - \tanh^2$. Each form is a product
# of $u$ and a function of $u$; the tanh form's inner function is itself a composition (the chain
# rule, twice).

# %% tags=["exercise"]
# Exercise 04.3: differentiate both GELU forms above, and give their derivatives at u = (0, 1, -2)
# as an array of shape (2, 3): first row exact, second row tanh. (standard_normal_cdf is imported
# for Phi.)
points = np.array([0.0, 1.0, -2.0])
gelu_derivatives = ...
# BEGIN SOLUTION
density = np.exp(-points**2 / 2) / np.sqrt(2 * np.pi)
t = np.tanh(np.sqrt(2 / np.pi) * (points + 0.044715 * points**3))
gelu_derivatives = np.stack([
    standard_normal_cdf(points) + points * density,
    0.5 * (1 + t) + 0.5 * points * (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * points**2),
])
# END SOLUTION

# %%
check("04.3", gelu_derivatives)

# %% [markdown]
# Your two derivatives are the whole of the GELU backward; the next exercise puts them in a
# function, with the cache of the forward pass holding $\Phi(x)$ or $t$ already.

# %% tags=["exercise"]
# Exercise 04.4: write the GELU backward for both forms. `cache` is the GELUCache of gelu_forward:
# `cache.x` (any shape), `cache.approximate` (True for the tanh form) and `cache.gate`, which holds
# Phi(x) for the exact form and t = tanh(sqrt(2/pi) (x + 0.044715 x^3)) for the tanh form. Return
# dx = dout * GELU'(x). The check runs it as the backward of gelu_forward under the gradient check
# (both forms, 2-D and 5-D inputs), and compares it with gelu_backward (and torch's gelu).
def my_gelu_backward(dout, cache):
    dx = ...
    # BEGIN SOLUTION
    x, gate = cache.x, cache.gate
    if cache.approximate:
        dt = (1 - gate**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x**2)  # d t / d x
        derivative = 0.5 * (1 + gate) + 0.5 * x * dt
    else:
        derivative = gate + x * np.exp(-x**2 / 2) / np.sqrt(2 * np.pi)
    dx = dout * derivative
    # END SOLUTION
    return dx


# %%
from refmath.ffn import gelu_backward

check("04.4", my_gelu_backward)

# %% [markdown]
# The library's `gelu_backward` passes the same check, both forms, on random inputs:

# %%
for form in (False, True):
    upstream = rng.standard_normal(7)
    xs = rng.standard_normal(7)
    analytic = gelu_backward(upstream, gelu_forward(xs, approximate=form)[1])
    error = largest_relative_error(
        analytic, lambda: float(np.sum(gelu_forward(xs, approximate=form)[0] * upstream)), xs)
    print(f"GELU ({'tanh' if form else 'exact'}) backward against central differences: {error:.1e}")
    assert error < 1e-8

# %% [markdown]
# ## N7: SwiGLU, its backward, and its width
#
# SwiGLU multiplies two projections of the input, one passed through SiLU:
#
# $$F(x) = \big[\mathrm{SiLU}(x W_g) \odot (x W_u)\big]\, W_d .$$
#
# **Backward.** Name the pieces $g = x W_g$, $u = x W_u$, $s = \mathrm{SiLU}(g)$,
# $m = s \odot u$. Going back through each product:
#
# $$dm = dy\, W_d^\top,\quad du = dm \odot s,\quad ds = dm \odot u,\quad
# dg = ds \odot \mathrm{SiLU}'(g),\quad dx = dg\, W_g^\top + du\, W_u^\top ,$$
#
# with $\mathrm{SiLU}'(g) = \sigma(g)\,\big(1 + g\,(1 - \sigma(g))\big)$, and each weight
# gradient its input transposed times its output gradient: $dW_d = m^\top dy$,
# $dW_g = x^\top dg$, $dW_u = x^\top du$. The input gets two terms because it feeds two
# projections.

# %%
d, d_f = 3, 4
xs = rng.standard_normal((2, d))
w_gate, w_up, w_down = (rng.standard_normal(shape) for shape in ((d, d_f), (d, d_f), (d_f, d)))
y, swiglu_cache = swiglu_forward(xs, w_gate, w_up, w_down)
dy = rng.standard_normal(y.shape)

# %% tags=["exercise"]
# Exercise 04.5: dx of SwiGLU for xs, the three weights and the upstream gradient dy above, from the
# equations (the sigmoid is 1 / (1 + exp(-g))).
dx_swiglu = ...
# BEGIN SOLUTION
g_pre, u_pre = xs @ w_gate, xs @ w_up
sig = 1 / (1 + np.exp(-g_pre))
s_act = g_pre * sig
dm = dy @ w_down.T
dg = dm * u_pre * sig * (1 + g_pre * (1 - sig))
dx_swiglu = dg @ w_gate.T + (dm * s_act) @ w_up.T
# END SOLUTION

# %%
check("04.5", dx_swiglu)

# %%
from refmath.ffn import swiglu_backward

names = ("x", "w_gate", "w_up", "w_down")
arrays = dict(zip(names, (xs, w_gate, w_up, w_down)))
for name, analytic in zip(names, swiglu_backward(dy, swiglu_cache)):
    error = largest_relative_error(
        analytic, lambda: float(np.sum(swiglu_forward(xs, w_gate, w_up, w_down)[0] * dy)),
        arrays[name])
    print(f"d{name}: largest relative error against central differences {error:.1e}")
    assert error < 1e-8

# %% [markdown]
# **Width.** SwiGLU has three $d \times d_f$ matrices where the classic FFN has two. To keep the
# parameter count of a classic FFN of width $4d$, solve $3 d\, d_f = 2 d \cdot 4d$:
# $d_f = 8d/3$. That is rarely an integer, and hardware prefers widths that are multiples of a
# tile size, so implementations round it **up** to a multiple of, say, 256. The rounding is what
# breaks the budget: at $d = 512$, $8d/3 = 1365.3$ rounds up to $1536 = 6 \cdot 256$, which is
# $1536 / 1365.3 = 1.125$ times the exact width, hence 12.5% more parameters. At $d = 4096$
# (LLaMA's 7B) $10922.7$ rounds to $11008$, 0.8% more. At $d = 384$, $8d/3 = 1024$ is already a
# multiple of 256 and the budget is met exactly.

# %% tags=["exercise"]
# Exercise 04.6: the SwiGLU width for d = 1000 rounded up to a multiple of 64, and the relative
# excess of its parameters over the 4d FFN's, as a pair (d_f, excess) with excess like +0.125.
width_and_excess = ...
# BEGIN SOLUTION
d_f_1000 = 64 * int(np.ceil(8 * 1000 / 3 / 64))
width_and_excess = (d_f_1000, 3 * 1000 * d_f_1000 / (2 * 1000 * 4000) - 1)
# END SOLUTION

# %%
check("04.6", width_and_excess)

# %%
# After the exercise: the library's swiglu_hidden_size and ffn_parameter_count, on the three widths
# of the text.
from refmath.ffn import ffn_parameter_count, swiglu_hidden_size  # noqa: E402

for d_model in (384, 512, 4096):
    d_swiglu = swiglu_hidden_size(d_model, multiple_of=256)
    plain = ffn_parameter_count(d_model, 4 * d_model)
    gated = ffn_parameter_count(d_model, d_swiglu, gated=True)
    print(f"d = {d_model:4d}: 8d/3 = {8 * d_model / 3:8.1f} -> d_f = {d_swiglu:5d}; "
          f"plain FFN {plain:,} weights, SwiGLU {gated:,} ({gated / plain - 1:+.2%})")
assert ffn_parameter_count(384, swiglu_hidden_size(384), gated=True) == ffn_parameter_count(384, 4 * 384)

# %% [markdown]
# ## N8: sinusoidal positions
#
# The original Transformer adds to each token's (scaled) embedding a row of a fixed table:
#
# $$P_{i, 2r} = \sin\!\big(i / 10000^{2r/d}\big),\qquad P_{i, 2r+1} = \cos\!\big(i / 10000^{2r/d}\big),$$
#
# and feeds $\sqrt d\, E[a_i] + P_i$ to the first layer. Every pair of columns is a clock turning
# at its own speed, fast on the left, slow on the right.

# %%
P = sinusoidal_positions(64, 32)
np.testing.assert_allclose(P[0], np.tile([0.0, 1.0], 16))
np.testing.assert_allclose(P[5, 0], np.sin(5.0))
fig, ax = plt.subplots(figsize=(5, 3.2), layout="constrained")
image = ax.imshow(P, aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
ax.set(xlabel="feature", ylabel="position i", title="sinusoidal position table")
fig.colorbar(image, ax=ax)
plt.show()

# %% [markdown]
# ## N10: RoPE rotates queries and keys
#
# RoPE splits a query or key of width $d_k$ into $d_k/2$ coordinate pairs and rotates pair $r$ of
# the row at position $p$ by the angle $p\,\omega_r$, with frequencies
#
# $$\omega_r = 10000^{-2r/d_k},\qquad r = 0, \dots, d_k/2 - 1,$$
#
# falling geometrically from 1 radian per token (pair 0) to nearly $10^{-4}$. For $d_k = 4$ they
# are $\omega = (1, 1/100)$. In row-vector form, a pair $(x_{2r}, x_{2r+1})$ becomes
#
# $$\big(x_{2r}\cos\theta - x_{2r+1}\sin\theta,\ \ x_{2r}\sin\theta + x_{2r+1}\cos\theta\big),
# \qquad \theta = p\,\omega_r .$$

# %%
print("angles for d_k = 4 at positions 0..3 (one column per pair):\n",
      rope_angles(np.arange(4), 4))
pair = np.array([[3.0, 4.0]])  # d_k = 2: one pair, omega_0 = 1, so the angle is p radians
by_hand = np.array([[3 * np.cos(1) - 4 * np.sin(1), 3 * np.sin(1) + 4 * np.cos(1)]])
print("(3, 4) at position 1, by hand:", by_hand, " length:", np.linalg.norm(by_hand))
np.testing.assert_allclose(np.linalg.norm(by_hand), 5.0, rtol=1e-14)

# %% tags=["exercise"]
# Exercise 04.7: the row x = (3, 4, 1, 0) (d_k = 4) rotated by RoPE at position 2. Pair 0 turns by
# 2 * 1 radians, pair 1 by 2 * (1/100).
rotated_by_hand = ...
# BEGIN SOLUTION
angles = np.array([2.0, 2.0 / 100])
pairs = np.array([[3.0, 4.0], [1.0, 0.0]])
turned = np.stack([pairs[:, 0] * np.cos(angles) - pairs[:, 1] * np.sin(angles),
                   pairs[:, 0] * np.sin(angles) + pairs[:, 1] * np.cos(angles)], axis=1)
rotated_by_hand = turned.reshape(1, 4)
# END SOLUTION

# %%
check("04.7", rotated_by_hand)

# %% [markdown]
# The library's `rope_forward` turns every pair at once; on the pair $(3, 4)$ at position 1 it gives
# the rotation by hand above.

# %%
from refmath.positions import rope_forward

rotated_at_1, _ = rope_forward(pair, positions=np.array([1]))
print("rope_forward: (3, 4) at position 1:", rotated_at_1)
np.testing.assert_allclose(rotated_at_1, by_hand, rtol=1e-14)

# %% [markdown]
# **Scores depend on the offset only.** Rotations preserve lengths and compose by adding angles,
# so with $R(\theta)$ the rotation of each pair,
#
# $$\big(q_i R(i\omega)^\top\big)\big(k_j R(j\omega)^\top\big)^\top = q_i\, R\big((j - i)\,\omega
# \big)\, k_j^\top :$$
#
# the score of a query at $i$ and a key at $j$ is a function of $j - i$. Values are not rotated.

# %%
d_k = 8
q, k = rng.standard_normal(d_k), rng.standard_normal(d_k)


def score(i, j):
    q_rot, _ = rope_forward(q[None, :], positions=np.array([i]))
    k_rot, _ = rope_forward(k[None, :], positions=np.array([j]))
    return float(q_rot[0] @ k_rot[0])


for i, j in ((0, 3), (10, 13), (100, 103)):
    print(f"q at {i:3d}, k at {j:3d}: score {score(i, j):+.6f}")
np.testing.assert_allclose(score(0, 3), score(100, 103), rtol=1e-12)

offsets = np.arange(-32, 33)
fig, ax = plt.subplots(figsize=(5, 3), layout="constrained")
ax.plot(offsets, [score(40, 40 + o) for o in offsets], ".-")
ax.set(xlabel="offset j - i", ylabel=r"$\tilde q_i \cdot \tilde k_j$",
       title="a RoPE score as a function of the offset")
plt.show()

# %% [markdown]
# **The RoPE backward is the inverse rotation.** For each pair, $\tilde x = x R^\top$ is linear
# with an orthogonal matrix, so $dx = d\tilde x\, R$: the upstream gradient rotated by
# $-\theta$. Nothing of the input is stored, only the angles.

# %% tags=["exercise"]
# Exercise 04.8: the gradient with respect to x = (3, 4, 1, 0) at position 2 for the upstream
# gradient dy = (1, 0, 0, 1), by rotating dy by minus the angles (2, 2/100).
dx_rope = ...
# BEGIN SOLUTION
back = -np.array([2.0, 2.0 / 100])
dy_pairs = np.array([[1.0, 0.0], [0.0, 1.0]])
dx_rope = np.stack([dy_pairs[:, 0] * np.cos(back) - dy_pairs[:, 1] * np.sin(back),
                    dy_pairs[:, 0] * np.sin(back) + dy_pairs[:, 1] * np.cos(back)],
                   axis=1).reshape(1, 4)
# END SOLUTION

# %%
check("04.8", dx_rope)

# %%
check_true("rotating your dx forward gives dy back",
           lambda dx: np.allclose(rope_forward(np.asarray(dx, dtype=float).reshape(1, 4),
                                               positions=np.array([2]))[0],
                                  [[1.0, 0.0, 0.0, 1.0]], rtol=0, atol=1e-14),
           "R is orthogonal: the backward's rotation by -theta is undone by the forward's +theta",
           of=dx_rope)

# %%
from refmath.positions import rope_backward

xs = rng.standard_normal((5, 6))
upstream = rng.standard_normal((5, 6))
analytic = rope_backward(upstream, rope_forward(xs, offset=3)[1])
error = largest_relative_error(analytic, lambda: float(np.sum(rope_forward(xs, offset=3)[0] * upstream)), xs)
print(f"RoPE backward against central differences: {error:.1e}")
assert error < 1e-8

# %% [markdown]
# **Two pair layouts.** refmath, like the RoFormer paper and Meta's original LLaMA code, rotates
# the pairs $(x_{2r}, x_{2r+1})$. Hugging Face's Llama (and GPT-NeoX) rotates
# $(x_r, x_{r + d_k/2})$: the first half of the coordinates against the second
# (`rope_forward(..., layout="half")`). Neither is wrong: they are the same function up to a fixed
# permutation of the coordinates. If the query and key projections' output columns (the rows of
# a PyTorch weight of shape out x in) are permuted so that coordinate $2r$ moves to $r$ and
# $2r + 1$ to $r + d_k/2$, the half layout gives exactly the interleaved layout's scores.
# This is why converting LLaMA checkpoints between the two codebases permutes the rows of
# $W_Q$ and $W_K$.

# %%
d_model, d_k, T = 8, 6, 5
x_tokens = rng.standard_normal((T, d_model))
w_q, w_k = rng.standard_normal((d_model, d_k)), rng.standard_normal((d_model, d_k))
to_half = np.concatenate([np.arange(0, d_k, 2), np.arange(1, d_k, 2)])  # new column c <- old to_half[c]
print("column permutation (interleaved pairs -> halves):", to_half)

q_inter, _ = rope_forward(x_tokens @ w_q)
k_inter, _ = rope_forward(x_tokens @ w_k)
q_half, _ = rope_forward(x_tokens @ w_q[:, to_half], layout="half")
k_half, _ = rope_forward(x_tokens @ w_k[:, to_half], layout="half")
scores_inter, scores_half = q_inter @ k_inter.T, q_half @ k_half.T
print("largest score difference:", np.abs(scores_inter - scores_half).max())
np.testing.assert_allclose(q_half, q_inter[:, to_half], rtol=1e-13, atol=1e-14)
np.testing.assert_allclose(scores_half, scores_inter, rtol=1e-12, atol=1e-13)
print("without the permutation:", np.abs(
    rope_forward(x_tokens @ w_q, layout="half")[0] @ rope_forward(x_tokens @ w_k, layout="half")[0].T
    - scores_inter).max())

# %% [markdown] tags=["question"]
# **Question.** RoPE rotates queries and keys but never values. What would rotating the values
# do to the output of attention, and why is it not wanted?
#
# <!-- BEGIN SOLUTION -->
# The output $o_i = \sum_j a_{ij} v_j$ would mix vectors each rotated by its own position $j$:
# the content carried from token $j$ would arrive in a frame that depends on where $j$ sits, so
# the same word would contribute differently at different absolute positions, and the layers
# above would have to undo the rotation. RoPE's point is that position enters only through the
# *comparison* $q_i k_j^\top$, where the rotations combine into a function of $j - i$; the values
# carry content, not position.
# <!-- END SOLUTION -->

# %% [markdown]
# ## Exercises
#
# 1. Show that the tanh form's derivative tends to 0 as $u \to -\infty$ and to 1 as
#    $u \to \infty$, like the exact form's. Where is the exact GELU's derivative largest?
# 2. Derive $\mathrm{SiLU}'(g) = \sigma(g)(1 + g(1 - \sigma(g)))$ and check it with
#    `silu_backward` and central differences.
# 3. Count SwiGLU's multiply-adds per token against the $4d$ FFN's at $d = 512$ with the rounded
#    width. Is the 12.5% of extra parameters also 12.5% of extra arithmetic?
# 4. Build the $d_k \times d_k$ matrix of RoPE for one position and check that it is orthogonal;
#    use it to show $q_i R(i\omega)^\top R(j\omega) k_j^\top = q_i R((j-i)\omega) k_j^\top$.
# 5. With `rope_forward(..., offset=t)`, show that rotating a cached key once at its own position
#    gives the same score as rotating the whole sequence again at every decode step.
#
# ## References
#
# - Vaswani et al. (2017), *Attention Is All You Need* (the FFN, sinusoidal positions).
# - Hendrycks and Gimpel (2016), *Gaussian Error Linear Units (GELUs)* (both forms).
# - Elfwing, Uchibe and Doya (2018), *Sigmoid-Weighted Linear Units for Neural Network Function
#   Approximation in Reinforcement Learning* (SiLU); Ramachandran, Zoph and Le (2017), *Searching
#   for Activation Functions* (Swish).
# - Shazeer (2020), *GLU Variants Improve Transformer* (SwiGLU and the $2/3$ width).
# - Touvron et al. (2023), *LLaMA: Open and Efficient Foundation Language Models* (SwiGLU with
#   $8d/3$ rounded, RoPE).
# - Su et al. (2021), *RoFormer: Enhanced Transformer with Rotary Position Embedding*.
