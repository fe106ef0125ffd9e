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
# # Lesson 5: the loss and the optimiser
#
# A language model is trained to predict the next token: the loss is the mean negative
# log-probability of the right token (L2), its gradient with respect to the logits is simply
# `p - y` (L3), and the same loss with some tokens masked out gives the fine-tuning loss (L5).
# Adam and AdamW then turn gradients into steps (O1-O7).

# %%
import matplotlib.pyplot as plt
import numpy as np

from refmath.losses import cross_entropy_backward, cross_entropy_forward
from refmath.optim import SGD, Adam, AdamW, transformer_schedule, warmup_cosine
from refmath.softmax import softmax_forward

np.set_printoptions(precision=4, suppress=True)

# %% [markdown]
# ## L2, L3: cross-entropy and its gradient p - y
#
# Three positions, a vocabulary of four. The loss averages `-log p[target]` over the positions;
# the gradient of that mean is `(p - onehot(target)) / 3`.

# %%
logits = np.array([[2.0, 1.0, 0.0, -1.0],
                   [0.0, 0.0, 0.0, 0.0],
                   [1.0, 3.0, 0.5, 0.0]])
targets = np.array([0, 2, 1])
loss, cache = cross_entropy_forward(logits, targets)
p, _ = softmax_forward(logits)
print("loss", float(loss), "  by hand", -np.mean(np.log(p[np.arange(3), targets])))
print("a uniform row costs log 4 =", np.log(4))
dlogits = cross_entropy_backward(1.0, cache)
np.testing.assert_allclose(dlogits, (p - np.eye(4)[targets]) / 3, rtol=1e-13)
print("gradient = (p - y) / 3:\n", dlogits)

# %% [markdown]
# ## L5: the fine-tuning loss counts the answer only
#
# In supervised fine-tuning the prompt is given, not predicted: a 0/1 loss mask removes the prompt
# positions from the mean and from the gradient.

# %%
mask = np.array([0, 0, 1])  # two prompt positions, one answer position
sft, sft_cache = cross_entropy_forward(logits, targets, loss_mask=mask)
print("SFT loss", float(sft), "= -log p of the answer token", -np.log(p[2, 1]))
print("gradient rows of the prompt are zero:\n", cross_entropy_backward(1.0, sft_cache))

# %% [markdown]
# ## O1, O2: Adam's bias correction
#
# Adam keeps running means of the gradient and of its square, `m` and `v`, started at zero. Early
# on they are too small by the factors `1 - beta^s`; dividing by those factors corrects them. With
# a constant gradient `g`, the corrected moments are exactly `g` and `g^2` from the first step.

# %%
params = {"w": np.array([1.0, -2.0])}
g = {"w": np.array([0.3, -0.1])}
adam = Adam(lr=0.1)
for step in range(1, 4):
    adam.step(params, g)
    m_hat, v_hat = adam.corrected_moments("w")
    print(f"step {step}: m_hat = {m_hat}, v_hat = {v_hat}")
    np.testing.assert_allclose(m_hat, g["w"], rtol=1e-13)  # equal up to rounding
    np.testing.assert_allclose(v_hat, g["w"] ** 2, rtol=1e-13)

# %% [markdown]
# ## O3, O4, O7: weight decay inside Adam or beside it
#
# For plain SGD, adding `lambda theta` to the gradient is the same as shrinking the weights by
# `1 - eta lambda` each step. For Adam it is not: the decay term passes through the division by
# `sqrt(v_hat)`, so its effect depends on the gradient history. A weight with large data gradients
# is barely decayed; a weight with no data gradient, as below, takes normalised steps of size about
# `eta` whatever `lambda` is, reaching 0 in about `1/eta` steps and then oscillating around it.
# AdamW applies the decay beside the Adam step, as `theta (1 - eta lambda)`, the same shrinkage as
# SGD's.

# %%
def run(optimiser, steps=50):
    p = {"w": np.array([1.0])}
    for _ in range(steps):
        optimiser.step(p, {"w": np.array([0.0])})
    return float(p["w"][0])


print("SGD + L2   :", run(SGD(lr=0.1, weight_decay=0.1, decay_of=lambda name: 0.1)),
      "  (1 - 0.01)^50 =", 0.99**50)
print("Adam + L2  :", run(Adam(lr=0.1, weight_decay=0.1, decay_of=lambda name: 0.1)))
print("AdamW      :", run(AdamW(lr=0.1, weight_decay=0.1, decay_of=lambda name: 0.1)),
      "  (1 - 0.01)^50 =", 0.99**50)

# %% [markdown]
# ## O6: learning-rate schedules
#
# The original Transformer warmed up linearly and then decayed as `1/sqrt(step)`:
# `d^{-1/2} min(s^{-1/2}, s w^{-3/2})`. Most LLMs now warm up linearly and follow a cosine down.

# %%
steps = np.arange(1, 20001)
fig, axes = plt.subplots(1, 2, figsize=(9, 3), layout="constrained")
axes[0].plot(steps, [transformer_schedule(s, d_model=512, warmup=4000) for s in steps])
axes[0].set(title="original: d^-0.5 min(s^-0.5, s w^-1.5)", xlabel="step", ylabel="learning rate")
axes[1].plot(steps, [warmup_cosine(s, max_lr=3e-4, warmup=2000, total=20000, min_lr=3e-5)
                     for s in steps])
axes[1].set(title="linear warmup, cosine decay", xlabel="step")
plt.show()
