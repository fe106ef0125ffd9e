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
# # Lesson 2: normalisation, and where to put it
#
# LayerNorm and RMSNorm on a vector small enough to check by hand (catalogue N1-N3), then the
# question that separates the original Transformer from GPT-2 and every modern LLM: normalise
# after the residual sum (Post-LN) or before the sublayer (Pre-LN)? (N4)

# %%
import matplotlib.pyplot as plt
import numpy as np

from refmath.models import gpt
from refmath.norms import layernorm_forward, rmsnorm_forward

np.set_printoptions(precision=4, suppress=True)

# %% [markdown]
# ## N1-N3: the worked example
#
# For `x = (2, 4, 6, 8)`: the mean is 5 and the (biased) variance is `(9 + 1 + 1 + 9) / 4 = 5`,
# so LayerNorm gives `(-3, -1, 1, 3) / sqrt(5)`. RMSNorm skips the mean: the mean square is
# `(4 + 16 + 36 + 64) / 4 = 30`, so it gives `(2, 4, 6, 8) / sqrt(30)`. With `gamma = 1`,
# `beta = 0` and `eps = 0` the library must agree exactly.

# %%
x = np.array([2.0, 4.0, 6.0, 8.0])
ln, _ = layernorm_forward(x, np.ones(4), np.zeros(4), eps=0.0)
rms, _ = rmsnorm_forward(x, np.ones(4), eps=0.0)
print("LayerNorm", ln, "expected", np.array([-3, -1, 1, 3]) / np.sqrt(5))
print("RMSNorm  ", rms, "expected", x / np.sqrt(30))
np.testing.assert_allclose(ln, np.array([-3.0, -1.0, 1.0, 3.0]) / np.sqrt(5), rtol=1e-15)
np.testing.assert_allclose(rms, x / np.sqrt(30), rtol=1e-15)

# %% [markdown]
# LayerNorm output always has mean 0 and variance 1 before `gamma` and `beta`; RMSNorm output has
# mean square 1 but keeps whatever mean the input had. Shifting the input shows the difference.

# %%
for shift in (0.0, 10.0):
    ln, _ = layernorm_forward(x + shift, np.ones(4), np.zeros(4), eps=0.0)
    rms, _ = rmsnorm_forward(x + shift, np.ones(4), eps=0.0)
    print(f"shift {shift:4}: LayerNorm {ln}   RMSNorm {rms}")

# %% [markdown]
# ## N4: Post-LN against Pre-LN
#
# Post-LN computes `y = LN(x + F(x))`; its Jacobian is `J_LN (I + J_F)`: every layer's gradient
# passes through a normalisation on the way down. Pre-LN computes `y = x + F(LN(x))`; its Jacobian
# is `I + J_F J_LN`, so the identity path carries the gradient from the loss to every layer
# untouched. (`tests/test_norms.py::test_post_and_pre_ln_jacobians_n4` checks both formulas
# against numerical Jacobians.)
#
# At initialisation this shows in the size of the weight gradients by depth. Below, a 12-layer GPT
# in each arrangement, same seed, same batch: the norm of the gradient of each layer's first FFN
# matrix.

# %%
rng = np.random.default_rng(0)
batch_tokens = rng.integers(0, 64, size=(4, 33))
batch = {"tokens": batch_tokens[:, :-1], "targets": batch_tokens[:, 1:]}

norms = {}
for position in ("post", "pre"):
    config = gpt.GPTConfig(vocab_size=64, max_seq_len=32, n_layers=12, d_model=64, n_heads=4,
                           norm_position=position, dropout=0.0)
    params = gpt.init_params(config, seed=0)
    loss, cache = gpt.forward(params, batch, config)
    grads = gpt.backward(cache)
    norms[position] = [np.linalg.norm(grads[f"layers.{i}.ffn.w1"]) for i in range(config.n_layers)]
    print(f"{position}-LN: loss {float(loss):.3f} (log 64 = {np.log(64):.3f}), "
          f"gradient norms from layer 0 to 11: {np.round(norms[position], 4)}")

fig, ax = plt.subplots(figsize=(5.5, 3.2), layout="constrained")
for position, marker in (("post", "o"), ("pre", "s")):
    ax.plot(range(12), norms[position], marker + "-", label=f"{position}-LN")
ax.set(yscale="log", xlabel="layer (0 = nearest the input)", ylabel="|dL/dW1| at init",
       title="weight gradients by depth at initialisation")
ax.legend()
plt.show()

# %% [markdown]
# What the measurement shows, at GPT-2's initialisation (weights with std 0.02):
#
# - Post-LN: every layer gets a gradient of the same size. Each `LN` rescales the residual
#   stream to unit size, and with small weights each branch adds little, so `J_LN (I + J_F)` is
#   close to a projection of norm about 1 at every layer.
# - Pre-LN: the gradients are about 30 times larger, and grow gently towards the input. The
#   residual stream is never normalised except by the final `ln_f`, and at initialisation it is
#   as small as the embeddings (printed below): `ln_f` divides by that scale, which amplifies the
#   gradient flowing back into the stream. Going down, `dL/dx_l = dL/dx_{l+1} (I + J_F J_LN)`
#   adds each layer's branch term on top of the identity path, so lower layers collect a little
#   more.
#
# The Pre-LN identity path is what lets deep Pre-LN models train without the careful learning
# rate warmup that Post-LN models needed; the scale of the stream, not just the placement of the
# norm, decides the size of the gradients at the start.

# %%
pre = gpt.GPTConfig(vocab_size=64, max_seq_len=32, n_layers=12, d_model=64, n_heads=4, dropout=0.0)
params = gpt.init_params(pre, seed=0)
stream = params["tok_emb"][batch["tokens"]] + params["pos_emb"][: batch["tokens"].shape[1]]
print(f"std of the residual stream entering layer 0: {stream.std():.4f}; "
      f"ratio of the mean gradient norms pre/post: {np.mean(norms['pre']) / np.mean(norms['post']):.1f}")
