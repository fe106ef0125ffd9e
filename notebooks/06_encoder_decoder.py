# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
#   refmath:
#     figures: 1
#     minutes: 40
#     ids: [L1, L4, M1, N12]
# ---

# %% [markdown]
# # Lesson 6: the encoder-decoder Transformer
#
# The earlier lessons built the parts; this one assembles the first whole network of the
# catalogue, the original encoder-decoder Transformer of Vaswani et al. (2017), and checks what it
# promises: the decoder reads the target shifted right by one (L1), it trains towards a smoothed
# target (L4), every one of its gradients is written by hand and agrees with central differences
# (M1), and the embedding table it shares between source, target and output collects the gradients
# of repeated tokens by summing them (N12).
#
# **Prerequisites:** lessons 1 (attention, A1-A8), 2 (LayerNorm) and 5 (cross-entropy, L2-L3).
#
# **Goals:** build the shifted decoder input and read $p(y \mid x)$ off the logits; name the three
# label-smoothing conventions and say which one refmath computes; check a whole model's gradient
# by central differences; derive the scatter-add backward of an embedding lookup.
#
# **Catalogue IDs:** L1, L4, M1, N12
#
# **Duration:** about 40 minutes.

# %%
import dataclasses
import math

import matplotlib.pyplot as plt
import numpy as np

from refmath.embedding import embedding_forward
from refmath.gradcheck import numerical_gradient, relative_error
from refmath.lessons import catalogued, check, check_function
from refmath.losses import cross_entropy_forward
from refmath.models import transformer as tm
from refmath.softmax import softmax_forward

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)


def n_params(shapes):
    """Number of parameters described by a {name: shape} dict (nothing is allocated)."""
    return sum(math.prod(shape) for shape in shapes.values())


# %% [markdown]
# ## L1: the decoder reads the target shifted right by one
#
# A translation model factorises the probability of the target $y$ given the source $x$ token by
# token:
#
# $$p(y \mid x) = \prod_{t=1}^{m} p(y_t \mid y_1, \dots, y_{t-1}, x).$$
#
# To score every factor in one pass, the decoder input is the target shifted right by one place,
# with a start token in front: $(\mathrm{BOS}, y_1, \dots, y_{m-1})$. Position $t$ of the decoder
# reads $\mathrm{BOS}, y_1, \dots, y_{t-1}$ and is asked for $y_t$; the causal mask stops it from
# reading further. With $\mathrm{BOS} = 1$, the target $(5, 6, 7, 2)$ becomes the input
# $(1, 5, 6, 7)$.

# %%
tgt = np.array([[5, 6, 7, 2]])
dec_in = tm.shift_right(tgt, bos_id=1)
print("target       ", tgt[0])
print("decoder input", dec_in[0])
np.testing.assert_array_equal(dec_in, [[1, 5, 6, 7]])

# %% [markdown]
# **Exercise 06.1.** Build the decoder input of a batch of two targets by hand, with NumPy only (no
# `tm.shift_right`): a column of BOS ids in front, the last target token dropped.

# %% tags=["exercise"]
targets_2 = np.array([[9, 4, 4, 2], [3, 8, 2, 0]])
bos = 1
shifted_by_hand = ...  # (2, 4) integer array
# BEGIN SOLUTION
shifted_by_hand = np.concatenate([np.full((2, 1), bos), targets_2[:, :-1]], axis=1)
# END SOLUTION

# %%
check("06.1", shifted_by_hand)

# %% [markdown]
# With label smoothing off, the model's loss is the mean of $-\log p(y_t \mid y_{<t}, x)$ over
# the $m$ target tokens, so the probability of the whole target is $e^{-m \ell}$. Below, a tiny
# encoder-decoder (vocabulary 13, two layers of width 16; id 0 is padding and id 1 is BOS) with
# label smoothing switched off: the loss from `tm.forward` equals the mean of $-\log p$ read off
# the logits of the shifted input, one factor per position.

# %%
plain = dataclasses.replace(tm.TRANSFORMER_TINY, label_smoothing=0.0)
params = tm.init_params(plain, seed=0)
src = np.array([[3, 4, 5, 6, 0]])  # the last source position is padding
batch = {"src": src, "src_lengths": np.array([4]), "tgt": tgt}
loss, _ = tm.forward(params, batch, plain)
z = tm.logits(params, src, batch["src_lengths"], dec_in, plain)  # (1, 4, 13)
p, _ = softmax_forward(z)
print(f"loss {float(loss):.4f}; logits of shape {z.shape}")

# %% [markdown]
# **Exercise 06.2.** From `p` (shape `(1, 4, 13)`), pick the four factors $p(y_t \mid y_{<t}, x)$ and
# multiply them: the probability the model gives the whole target.

# %% tags=["exercise"]
p_target = ...  # a number
# BEGIN SOLUTION
p_target = p[0, np.arange(4), tgt[0]].prod()
# END SOLUTION

# %%
check("06.2", p_target)

# %% [markdown]
# ## L4: label smoothing, three conventions
#
# The original Transformer trains with "label smoothing of value $\epsilon_{ls} = 0.1$" and cites
# Szegedy et al. (2016); the paper gives no formula. Three formulas are in use, and they differ in
# where the mass $\epsilon$ goes. For a vocabulary of $V$ tokens and the right token $y$:
#
# | convention | right token | each other token | used by |
# |---|---|---|---|
# | uniform mix | $1 - \epsilon + \epsilon / V$ | $\epsilon / V$ | Szegedy et al. (2016), PyTorch's `label_smoothing` |
# | wrong tokens only | $1 - \epsilon$ | $\epsilon / (V - 1)$ | tensor2tensor |
# | wrong tokens except padding | $1 - \epsilon$ | $\epsilon / (V - 2)$, padding 0 | the Annotated Transformer |
#
# **refmath computes the first**, $q = (1 - \epsilon)\,\mathrm{onehot}(y) + \epsilon / V$
# (`refmath.losses.cross_entropy_forward`, whose per-token loss is
# $-(1 - \epsilon) \log p_y - \tfrac{\epsilon}{V} \sum_v \log p_v$). The second is the first
# with another value of $\epsilon$ (exercise 06.4 finds which: compare the two columns). The
# third cannot be reached by changing $\epsilon$: it gives the padding token exactly 0.
#
# Whatever the convention, the loss of one position is the cross-entropy
# $\ell = -\sum_v q_v \log p_v$ with $p = \operatorname{softmax}(z)$. Lesson 5 differentiated it
# for a one-hot $q$; a smoothed $q$ puts mass on every token, and its gradient is yours to derive
# below. For $V = 5$ and $\epsilon = 0.1$, refmath's target is
# $q = (0.92, 0.02, 0.02, 0.02, 0.02)$.

# %%
z = np.array([[2.0, 1.0, 0.0, 0.0, -1.0]])
y = np.array([0])
smoothed, cache = cross_entropy_forward(z, y, label_smoothing=0.1)
p, _ = softmax_forward(z)
q = np.full((1, 5), 0.1 / 5)
q[0, y[0]] += 1 - 0.1  # (1 - epsilon) on the target, epsilon / V on every token
print("target distribution q:", q[0])
print("loss", float(smoothed), "  -sum q log p =", float(-(q * np.log(p)).sum()))
np.testing.assert_allclose(q, [[0.92, 0.02, 0.02, 0.02, 0.02]], rtol=1e-13)
np.testing.assert_allclose(smoothed, -(q * np.log(p)).sum(), rtol=1e-13)

# %% [markdown]
# **Exercises 06.3 and 06.4.** Take tensor2tensor's target for the same $V = 5$, $\epsilon = 0.1$,
# $y = 0$ (the table's second row). 06.3: derive $\partial \ell / \partial z$ for a target $q$ that
# is any distribution (write $\log p_v = z_v - \log \sum_u e^{z_u}$, and use $\sum_v q_v = 1$),
# and give it for tensor2tensor's target at the logits `z` above. 06.4: find the `label_smoothing`
# value that makes refmath train towards that target, and compute that loss with
# `cross_entropy_forward`.

# %% tags=["exercise"]
dz_t2t = ...        # (5,) the gradient of tensor2tensor's loss with respect to z
eps_for_refmath = ...
loss_t2t = ...      # cross_entropy_forward(z, y, label_smoothing=eps_for_refmath)[0]
# BEGIN SOLUTION
V, eps = 5, 0.1
q_t2t = np.full(V, eps / (V - 1))
q_t2t[0] = 1 - eps
dz_t2t = p[0] - q_t2t  # d/dz_u of -sum_v q_v (z_v - logsumexp z) = -q_u + p_u sum_v q_v
eps_for_refmath = eps * V / (V - 1)
loss_t2t = float(cross_entropy_forward(z, y, label_smoothing=eps_for_refmath)[0])
# END SOLUTION

# %%
check("06.3", dz_t2t)

# %%
check("06.4", loss_t2t)

# %% [markdown]
# The gradient you derived, $p - q$ for any target distribution, says that smoothing changes one
# thing in the backward pass of lesson 5: the one-hot target becomes $q$. (So the library's
# gradient gives $q$ back: $q = p - \partial \ell / \partial z$ for one position.)

# %% tags=["exercise"]
# Exercise 06.5: write the cross-entropy backward with label smoothing (start from your lesson-5
# function). `cache.label_smoothing` is eps; the other fields are lesson 5's: `probs` (..., V) is
# softmax(logits); `targets` (...) the target ids, with 0 at the positions left out of the loss;
# `counted` (...) is True where a position enters the loss (not ignored, inside the loss mask);
# `n_counted` is how many do; `reduction` is "mean" (the sum divided by n_counted) or "sum".
# Return dlogits, shaped like probs; a position left out gets 0. The check runs it as the
# backward of cross_entropy_forward on all eleven cross-entropy cases of the registry (with and
# without smoothing, padding, loss masks, mean and sum) under the gradient check, and against
# cross_entropy_backward (and torch's cross_entropy with label_smoothing, if installed).
def my_smoothed_cross_entropy_backward(dout, cache):
    dlogits = ...
    # BEGIN SOLUTION
    vocab, eps = cache.probs.shape[-1], cache.label_smoothing
    q = (1 - eps) * np.eye(vocab)[cache.targets] + eps / vocab  # the smoothed target
    per_token = cache.probs - q
    if cache.reduction == "mean":
        per_token = per_token / max(cache.n_counted, 1)
    dlogits = dout * np.where(cache.counted[..., None], per_token, 0.0)
    # END SOLUTION
    return dlogits


# %%
from refmath.losses import cross_entropy_backward

check("06.5", my_smoothed_cross_entropy_backward)

# %% [markdown]
# The library's gradient gives the smoothed target back, $q = p - \partial \ell / \partial z$:

# %%
np.testing.assert_allclose(p - cross_entropy_backward(1.0, cache), q, rtol=1e-13)
print("p - dloss/dz =", (p - cross_entropy_backward(1.0, cache))[0])

# %% [markdown]
# What smoothing changes: without it, the loss keeps falling as the right logit runs away from the
# others, so the model is pushed towards ever larger logits. With it, the loss is smallest where
# $p = q$, at a finite gap $\log(0.92 / 0.02) = \log 46 = 3.83$ between the right logit and the
# rest, and the smallest loss is the entropy of $q$,
# $H(q) = -0.92 \log 0.92 - 4 \cdot 0.02 \log 0.02 = 0.39$, not 0.

# %%
gaps = np.linspace(0, 10, 201)
curves = {}
for eps in (0.0, 0.1):
    curves[eps] = [float(cross_entropy_forward(np.array([[m, 0, 0, 0, 0]]), y,
                                               label_smoothing=eps)[0]) for m in gaps]
entropy_q = -(0.92 * np.log(0.92) + 4 * 0.02 * np.log(0.02))
best = gaps[np.argmin(curves[0.1])]
print(f"eps = 0.1: smallest loss {min(curves[0.1]):.4f} at gap {best:.2f}; "
      f"H(q) = {entropy_q:.4f}, log 46 = {np.log(46):.2f}")
assert abs(best - np.log(46)) <= gaps[1] - gaps[0]
assert np.all(np.diff(curves[0.0]) < 0)  # without smoothing it only ever falls
at_q, _ = cross_entropy_forward(np.log(np.array([[0.92, 0.02, 0.02, 0.02, 0.02]])), y,
                                label_smoothing=0.1)
np.testing.assert_allclose(at_q, entropy_q, rtol=1e-13)

fig, ax = plt.subplots(figsize=(5.5, 3.2), layout="constrained")
for eps, style in ((0.0, "-"), (0.1, "--")):
    ax.plot(gaps, curves[eps], style, label=fr"$\epsilon$ = {eps}")
ax.axvline(np.log(46), color="gray", lw=0.8, label=r"gap $\log 46$, where $p = q$")
ax.axhline(entropy_q, color="gray", lw=0.8, ls=":", label=r"$H(q) = 0.39$")
ax.set(xlabel="gap between the right logit and the others", ylabel="cross-entropy (nats)",
       title="V = 5: one-hot target against a smoothed one")
ax.legend(fontsize=8)
plt.show()

# %% [markdown] tags=["question"]
# **Question.** The base Transformer has $V = 37000$ and $\epsilon = 0.1$. How much probability
# does the right token get in the target under each of the three conventions, and how much does
# each wrong token get? Does the choice matter much at this size?
#
# <!-- BEGIN SOLUTION -->
# Uniform mix: $0.9 + 0.1/37000 = 0.9000027$ and $0.1/37000 = 2.7027 \times 10^{-6}$ per token;
# tensor2tensor: $0.9$ and $0.1/36999 = 2.7028 \times 10^{-6}$; Annotated Transformer: $0.9$ and
# $0.1/36998 = 2.7028 \times 10^{-6}$ (padding 0). The targets differ by about $3 \times 10^{-6}$,
# so at this vocabulary the choice hardly matters; it matters for small vocabularies such as the
# $V = 5$ above ($0.92$ against $0.9$), and it matters when comparing losses across code bases,
# since $H(q)$, the smallest reachable loss, differs.
# <!-- END SOLUTION -->

# %% [markdown]
# ## M1: the original encoder-decoder, forward and backward
#
# The encoder turns the source into $Z$: embeddings scaled by $\sqrt{d}$ plus sinusoidal
# positions, then $L$ Post-LN layers of padding-masked self-attention and a ReLU FFN. The decoder
# does the same to the shifted target, with causal self-attention, and adds a third sublayer in
# every layer: cross-attention, with queries from the decoder and keys and values from $Z$. The
# logits are the last decoder state times $E^\top$ (one table shared by source, target and
# output), and the loss is the label-smoothed cross-entropy. In training mode, dropout acts on the
# embeddings, on the attention weights and on every sublayer's output before the residual sum
# (the paper names the first and last; dropout on the attention weights is an addition here).
#
# Every gradient of `tm.backward` is written by hand. Central differences check two of them in
# training mode: the same dropout seed draws the same masks in every evaluation, so the loss is a
# fixed function of the parameters. `decoder.layers.1.cross_attn.w_k` is read by every target
# position through $Z$'s keys; `tok_emb` collects three terms, from the source lookup, the target
# lookup and the output projection.

# %%
config = tm.TRANSFORMER_TINY  # label smoothing 0.1, dropout 0.1
params = tm.init_params(config, seed=1)
batch = {"src": rng.integers(2, 13, (2, 6)), "src_lengths": np.array([6, 4]),
         "tgt": rng.integers(2, 13, (2, 5))}


def phi():
    return float(tm.forward(params, batch, config, train=True, rng=7)[0])


loss, cache = tm.forward(params, batch, config, train=True, rng=7)
grads = tm.backward(cache)
print(f"loss {float(loss):.4f}; {len(grads)} gradient tensors, "
      f"{sum(g.size for g in grads.values())} numbers")
check_rng = np.random.default_rng(0)
for name in ("decoder.layers.1.cross_attn.w_k", "tok_emb"):
    coords = check_rng.choice(params[name].size, size=5, replace=False)
    numeric = numerical_gradient(phi, params[name], coords)
    analytic = grads[name].reshape(-1)[coords]
    error = relative_error(analytic, numeric).max()
    print(f"{name}: largest relative error {error:.1e}")
    assert error < 1e-6

# %% [markdown]
# **Exercise 06.6.** Check one more tensor the same way: the encoder's first-layer query matrix
# `encoder.layers.0.self_attn.w_q`, at the 4 coordinates `coords_wq` drawn below. Compute the
# numerical gradient there with `numerical_gradient(phi, ...)`, and read the hand-written
# backward's values at the same coordinates out of `grads`. The check compares each of the two
# with its own recomputation, so a copy of one into the other is caught: the two agree to about
# $10^{-10}$, not exactly.

# %% tags=["exercise"]
name = "encoder.layers.0.self_attn.w_q"
coords_wq = check_rng.choice(params[name].size, size=4, replace=False)  # flat indices into w_q
numeric_wq = ...   # central differences at coords_wq, shape (4,)
analytic_wq = ...  # the hand-written backward (grads) at coords_wq, shape (4,)
# BEGIN SOLUTION
numeric_wq = numerical_gradient(phi, params[name], coords_wq)
analytic_wq = grads[name].reshape(-1)[coords_wq]
# END SOLUTION

# %%
check("06.6", (numeric_wq, analytic_wq))

# %%
# After the exercise: how closely your two agree (shown once you have answered).
if numeric_wq is not ... and analytic_wq is not ...:
    print(f"{name}: largest relative error {relative_error(analytic_wq, numeric_wq).max():.1e}")

# %% [markdown]
# The same code at the paper's base size ($L = 6$, $d = 512$, $h = 8$, $d_f = 2048$, a shared
# vocabulary of 37000) has about 63 million parameters, counted from the shapes alone. (The paper
# reports 65 million; see `refmath.sizing.PRESETS["transformer-base"]` for what is known of the
# difference.)

# %%
print(f"TRANSFORMER_BASE: {n_params(tm.param_shapes(tm.TRANSFORMER_BASE)):,} parameters")

# %% [markdown]
# ## N12: the embedding lookup, and repeated tokens in its backward
#
# The lookup $y_n = E[a_n]$ copies one row of the table per token. Its backward sends each output
# gradient back to the row it came from; a token that occurs several times receives the sum:
#
# $$\frac{\partial \ell}{\partial E_v} = \sum_{n:\ a_n = v} \frac{\partial \ell}{\partial y_n}.$$
#
# For example, ids $(1, 1)$ with output gradients $(1, 0)$ and $(0, 2)$ give row 1 the sum
# $(1, 2)$, and every row that no token uses gets 0. A plain indexed `dE[ids] += dy` keeps only
# one of the contributions to a repeated row: below, the ids $(2, 0, 2, 2)$ use row 2 three times.

# %%
table = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
ids = np.array([2, 0, 2, 2])
rows, emb_cache = embedding_forward(ids, table)
dy = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])
naive = np.zeros_like(table)
naive[ids] += dy
print("lookup:\n", rows)
print("dE[ids] += dy keeps one write per row:\n", naive)

# %% [markdown]
# **Exercise 06.7.** Write the scatter-add backward yourself: a loop over the tokens, or
# `np.add.at`. The check compares it with the library's backward of the lookup.

# %% tags=["exercise"]
d_table = ...  # (3, 2)
# BEGIN SOLUTION
d_table = np.zeros_like(table)
np.add.at(d_table, ids, dy)
# END SOLUTION

# %%
check("06.7", d_table)

# %% [markdown]
# In M1 the same table is read three times (source lookup, target lookup, output projection
# $x E^\top$), so its gradient is the sum of three such terms: the `tok_emb` check above
# covered all three at once.
#
# ## Exercises
#
# 1. Show that the derivative of the smoothed loss with respect to the logits is $p - q$ for
#    each of the three conventions, and that only the target $q$ changes.
# 2. The smoothed loss is bounded below by $H(q)$. For the uniform mix, write $H(q)$ as a function
#    of $\epsilon$ and $V$ and evaluate it for $\epsilon = 0.1$, $V = 37000$.
# 3. In `tm.forward`, mark one source position as padding that was not before. Which gradients
#    become exactly zero, and why (think of A8's masked keys)?
# 4. The decoder input starts with BOS; the target ends with EOS (id 2 here). What goes wrong at
#    generation time if training used targets without EOS?
# 5. Count the parameters of `TRANSFORMER_BASE` by hand from $L$, $d$, $d_f$ and $V$, and find
#    where the 63 million differ from the paper's 65 million.
#
# ## References
#
# - Vaswani, A., et al. (2017). Attention Is All You Need. (The encoder-decoder, shifted decoder
#   input, label smoothing $\epsilon_{ls} = 0.1$, shared embeddings.)
# - Szegedy, C., et al. (2016). Rethinking the Inception Architecture for Computer Vision. (Label
#   smoothing as a mixture with the uniform distribution.)
# - Vaswani, A., et al. (2018). Tensor2Tensor for Neural Machine Translation. (The tensor2tensor
#   library.)
# - Rush, A. (2018). The Annotated Transformer. Workshop for NLP Open Source Software.
