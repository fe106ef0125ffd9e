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
# # Lesson 4: the feed-forward block and where tokens sit
#
# Attention mixes tokens; the position-wise feed-forward network transforms each token on its own
# (catalogue N5-N7). Attention alone cannot tell positions apart, so the model is told where
# every token is: by adding a table of sines (N8), a learned table (N9), or by rotating queries
# and keys (RoPE, N10).

# %%
import matplotlib.pyplot as plt
import numpy as np

from refmath.ffn import (
    ffn_forward,
    ffn_parameter_count,
    gelu_forward,
    silu_forward,
    swiglu_hidden_size,
)
from refmath.positions import rope_forward, sinusoidal_positions

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)

# %% [markdown]
# ## N5: without a nonlinearity, two layers are one
#
# `FFN(x) = ReLU(x W_1 + b_1) W_2 + b_2`. Drop the ReLU and the two affine maps collapse into
# one: `x (W_1 W_2) + (b_1 W_2 + b_2)`. The nonlinearity is what makes the hidden width useful.

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
# GELU is `u Phi(u)` with `Phi` the standard normal CDF; GPT-2 used a tanh approximation of it;
# SiLU is `u sigmoid(u)`. All three are smooth versions of ReLU that let a little negative signal
# through.

# %%
u = np.linspace(-4, 4, 401)
exact, _ = gelu_forward(u)
tanh_form, _ = gelu_forward(u, approximate=True)
silu, _ = silu_forward(u)
print(f"largest gap between exact and tanh GELU on [-4, 4]: {np.abs(exact - tanh_form).max():.2e}")

fig, ax = plt.subplots(figsize=(5, 3.2), layout="constrained")
ax.plot(u, np.maximum(u, 0), "k:", label="ReLU")
ax.plot(u, exact, label="GELU (exact)")
ax.plot(u, tanh_form, "--", label="GELU (tanh)")
ax.plot(u, silu, label="SiLU")
ax.set(xlabel="u", ylabel="activation", title="smooth relatives of ReLU")
ax.legend()
plt.show()

# %% [markdown]
# ## N7: SwiGLU and its width
#
# SwiGLU, `[SiLU(x W_g) * (x W_u)] W_d`, has three `d x d_f` matrices instead of two. To keep the
# parameter count of a `4d` FFN, the hidden width becomes `2/3 * 4d = 8d/3`, rounded up to a
# multiple that suits the hardware.

# %%
for d_model in (512, 4096):
    d_swiglu = swiglu_hidden_size(d_model, multiple_of=256)
    print(f"d = {d_model}: plain FFN 4d = {4 * d_model} -> "
          f"{ffn_parameter_count(d_model, 4 * d_model):,} weights; SwiGLU d_f = {d_swiglu} -> "
          f"{ffn_parameter_count(d_model, d_swiglu, gated=True):,} weights")

# %% [markdown]
# ## N8: sinusoidal positions
#
# `P[i, 2r] = sin(i / 10000^{2r/d})` and `P[i, 2r+1] = cos(i / 10000^{2r/d})`: every pair of
# columns is a clock turning at its own speed, fast on the left, slow on the right.

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
# ## N10: RoPE makes scores depend on the offset only
#
# RoPE rotates each coordinate pair of a query at position `i` by the angle `i omega_r`, and each
# key at position `j` by `j omega_r`. Rotations preserve lengths, and the dot product of two
# rotated vectors depends only on the difference of the angles: the score of `q` at `i` with `k`
# at `j` is a function of `j - i`. Values are not rotated.

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
rotated, _ = rope_forward(q[None, :], positions=np.array([7]))
np.testing.assert_allclose(np.linalg.norm(rotated), np.linalg.norm(q), rtol=1e-14)

offsets = np.arange(-32, 33)
fig, ax = plt.subplots(figsize=(5, 3), layout="constrained")
ax.plot(offsets, [score(40, 40 + o) for o in offsets], ".-")
ax.set(xlabel="j - i", ylabel="q_i . k_j", title="a RoPE score as a function of the offset")
plt.show()
