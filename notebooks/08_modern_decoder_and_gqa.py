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
#     minutes: 55
#     ids: [M3, A9, A10, A13, N13, N14, N15, N16, N17, N18, N19, N20, N21, N22, M5]
# ---

# %% [markdown]
# # Lesson 8: the modern decoder and grouped-query attention
#
# A Llama-style decoder (Touvron et al., 2023) keeps GPT-2's Pre-norm arrangement and changes
# every part: RMSNorm, rotary positions, SwiGLU, no biases, and keys and values shared by groups of
# query heads (grouped-query attention, GQA; Ainslie et al., 2023). This lesson builds the layer
# (M3), fuses its three projections into one (A9), maps query heads to key/value heads (A10),
# derives by hand why a shared key/value head's gradient is a *sum* over the query heads that read
# it, and counts what grouping saves and what it does not (A13). It ends with options of the
# same layer: context extension by rescaling RoPE's frequencies (N13-N17), QK-norm (N18), and
# Gemma's soft-capped scores, GeGLU and local layers (N19, N20), and the parallel block of GPT-J,
# PaLM and Falcon with OLMo 2's norms after the sublayers (N21, N22).
#
# **Prerequisites:** lessons 1 (attention backward, A8), 2 (RMSNorm), 4 (SwiGLU, RoPE) and 7 (GPT).
#
# **Goals:** read the shapes of an M3 layer; show that one fused projection equals three; derive
# the head-sum in $dK$ and $dV$ and check it by central differences; count, per decode step, the
# FLOPs and bytes of MHA, GQA and MQA, and say why GQA leaves the score arithmetic unchanged; say
# why RoPE does not extrapolate past its training context and how interpolation, NTK, Llama 3.1's
# rule and YaRN each slow its pairs; see why QK-norm bounds the scores, and what a soft cap does
# to a score and to its gradient.
#
# **Catalogue IDs:** M3, A9, A10, A13, N13, N14, N15, N16, N17, N18, N19, N20, N21, N22, M5
#
# **Duration:** about 55 minutes.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np

from refmath.attention import (
    causal_attention_forward,
    causal_mask,
    gqa_head_map,
    mha_forward,
    sdpa_backward,
    sdpa_forward,
)
from refmath.gradcheck import check_param_gradients, relative_error
from refmath.lessons import catalogued, check, check_function, check_true
from refmath.models import decoder
from refmath.sizing import attention_parameter_count

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)


def n_params(shapes):
    """Number of parameters described by a {name: shape} dict (nothing is allocated)."""
    return sum(math.prod(shape) for shape in shapes.values())


# %% [markdown]
# ## M3: the layer
#
# $$x' = x + \mathrm{Attn}(\mathrm{RMSNorm}(x)), \qquad
#   x'' = x' + \big(\mathrm{SiLU}(z W_{\text{gate}}) \odot (z W_{\text{up}})\big) W_{\text{down}},
#   \quad z = \mathrm{RMSNorm}(x'),$$
#
# with no biases anywhere, no position table (RoPE rotates queries and keys inside attention,
# N10), $g$ key/value heads shared by $h$ query heads, an FFN of width about $8d/3$, a final
# RMSNorm and an untied output matrix. With $d = 32$, $h = 4$, $g = 2$: $d_h = 8$, so `w_q` is
# $32 \times 32$, `w_k` and `w_v` are $32 \times 16$, and $8 \cdot 32 / 3 = 85.3$, rounded up to a
# multiple of 16, is $d_f = 96$.

# %%
m3 = decoder.DecoderConfig(vocab_size=32, max_seq_len=16, d_model=32, n_layers=2, n_heads=4,
                           n_kv_heads=2, ffn_multiple_of=16)
shapes = decoder.param_shapes(m3)
for name, shape in shapes.items():
    if not name.startswith("layers.1."):
        print(f"{name:>22}  {shape}")
assert shapes["layers.0.attn.w_k"] == (32, 16) and m3.d_f == 96
# no position table, and the only vectors are RMSNorm gains: no biases, no LayerNorm shifts
assert "pos_emb" not in shapes
assert all(name.endswith(".gamma") for name, shape in shapes.items() if len(shape) == 1)

# %% [markdown]
# A forward and backward pass, and `refmath.gradcheck.check_param_gradients` on every parameter
# tensor (six coordinates of each, five-point central differences in float64, against the bound
# of the module's docstring).

# %%
params = decoder.init_params(m3, seed=0)
tokens = rng.integers(0, 32, (2, 8))
batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
loss, cache = decoder.forward(params, batch, m3)
grads = decoder.backward(cache)
result = check_param_gradients(lambda p: decoder.forward(p, batch, m3)[0], grads, params)
print(f"loss {float(loss):.4f} (log 32 = {np.log(32):.4f}); gradient check passed: "
      f"{result.passed}, worst {result.worst} with error {result.errors[result.worst]:.1e} "
      f"against the bound {result.bound:.1e}")
assert result.passed

# %% [markdown]
# The layer's backward is its two halves run in reverse, each the backward of a function you
# have met. The FFN half is SwiGLU (lesson 4, N7): with $g = z W_{\text{gate}}$,
# $u = z W_{\text{up}}$, $s = \mathrm{SiLU}(g)$ and $m = s \odot u$, the chain rule gives
#
# $$dm = dy\, W_{\text{down}}^\top,\quad du = dm \odot s,\quad
# dg = (dm \odot u) \odot \mathrm{SiLU}'(g),\quad dz = dg\, W_{\text{gate}}^\top + du\,
# W_{\text{up}}^\top,$$
#
# with $\mathrm{SiLU}'(g) = \sigma(g)\,\big(1 + g\,(1 - \sigma(g))\big)$, and each weight's
# gradient its input transposed times its output's gradient, summed over every row of the batch.

# %% tags=["exercise"]
# Exercise 08.1: write the SwiGLU backward. `cache` is the SwiGLUCache of swiglu_forward: `x` (..., d),
# `w_gate`, `w_up` (d, d_f), `w_down` (d_f, d), `gate.x` = g = x W_gate and `gate.sig` = sigma(g),
# `up` = u = x W_up, `hidden` = m. Return (dx, dw_gate, dw_up, dw_down) for a `dout` of shape
# (..., d), with any number of leading axes. The check runs it as the backward of swiglu_forward
# on the registry's three cases (2-D to 5-D) under the gradient check, and against
# swiglu_backward (and torch autograd, if installed).
def my_swiglu_backward(dout, cache):
    dx = dw_gate = dw_up = dw_down = ...
    # BEGIN SOLUTION
    g, sig, u = cache.gate.x, cache.gate.sig, cache.up
    s = g * sig  # SiLU(g)
    d, d_f = cache.w_gate.shape
    x_rows = cache.x.reshape(-1, d)  # every row of every leading axis is one sample
    dw_down = cache.hidden.reshape(-1, d_f).T @ dout.reshape(-1, cache.w_down.shape[1])
    dm = dout @ cache.w_down.T
    dg = dm * u * sig * (1 + g * (1 - sig))  # SiLU'(g) = sigma + g sigma (1 - sigma)
    du = dm * s
    dw_gate = x_rows.T @ dg.reshape(-1, d_f)
    dw_up = x_rows.T @ du.reshape(-1, d_f)
    dx = dg @ cache.w_gate.T + du @ cache.w_up.T
    # END SOLUTION
    return dx, dw_gate, dw_up, dw_down


# %%
check("08.1", my_swiglu_backward)

# %% [markdown]
# ## A9: one fused projection equals three
#
# $[Q\;K\;V] = X\,[W_Q\;W_K\;W_V]$: concatenating the three weight matrices side by side gives
# one matrix of width $(h + 2g) d_h$, one matrix product instead of three, and the same numbers
# up to rounding.

# %% [markdown]
# **Exercise 08.2.** With $d = 4$, $h = 2$, $g = 1$, $d_h = 2$, build the fused parameter dict
# `{"w_qkv": ..., "w_o": ...}` from `separate`.

# %% tags=["exercise"]
d, h, g, d_h = 4, 2, 1, 2
x = rng.standard_normal((3, d))
separate = {"w_q": rng.standard_normal((d, h * d_h)), "w_k": rng.standard_normal((d, g * d_h)),
            "w_v": rng.standard_normal((d, g * d_h)), "w_o": rng.standard_normal((h * d_h, d))}
fused = ...  # {"w_qkv": (4, 8) array, "w_o": separate["w_o"]}
# BEGIN SOLUTION
fused = {"w_qkv": np.concatenate([separate["w_q"], separate["w_k"], separate["w_v"]], axis=1),
         "w_o": separate["w_o"]}
# END SOLUTION

# %%
check("08.2", fused)

# %% [markdown]
# ## A10: the head map; MHA is $g = h$, MQA is $g = 1$
#
# Query head $r$ reads key/value head
#
# $$\pi(r) = \left\lfloor \frac{r}{h/g} \right\rfloor \qquad (r = 0, \dots, h - 1),$$
#
# so consecutive blocks of $h/g$ query heads share one key and one value head (counting from 1,
# $\pi(r) = 1 + \lfloor (r - 1)/(h/g) \rfloor$). For $h = 8$:

# %%
for groups in (8, 2, 1):
    print(f"g = {groups}: {gqa_head_map(8, groups)}")
np.testing.assert_array_equal(gqa_head_map(8, 2), [0, 0, 0, 0, 1, 1, 1, 1])
try:
    gqa_head_map(8, 3)
except ValueError as error:
    print("g = 3:", error)

# %% [markdown]
# Each query head keeps its own $W_Q$ columns; only keys and values are shared. So GQA is exactly
# MHA whose key and value matrices repeat each shared head's columns for the $h/g$ query heads of
# its block:

# %%
d, h, g, d_h = 8, 4, 2, 2
x = rng.standard_normal((5, d))
gqa = {"w_q": rng.standard_normal((d, h * d_h)), "w_k": rng.standard_normal((d, g * d_h)),
       "w_v": rng.standard_normal((d, g * d_h)), "w_o": rng.standard_normal((h * d_h, d))}


def repeat_heads(w):
    return w.reshape(d, g, d_h)[:, gqa_head_map(h, g)].reshape(d, h * d_h)


mha = {**gqa, "w_k": repeat_heads(gqa["w_k"]), "w_v": repeat_heads(gqa["w_v"])}
np.testing.assert_allclose(mha_forward(x, gqa, n_heads=h, n_kv_heads=g)[0],
                           mha_forward(x, mha, n_heads=h)[0], rtol=1e-12, atol=1e-14)
print("GQA with g = 2 equals MHA with each key/value head repeated for its 2 query heads")

# %% [markdown]
# ## The head-sum in the key and value gradients
#
# Forward, head $u$'s keys and values are *copied* to every query head $r$ with $\pi(r) = u$. The
# backward of a copy is a sum (the same rule as the embedding of lesson 6, N12): each query head
# $r$ runs the ordinary attention backward (A8) on its copy,
# $dV^{(r)} = A_r^\top dO_r$ and $dK^{(r)} = \tau\, dS_r^\top Q_r$, and the shared head receives
#
# $$dK_u = \sum_{r:\ \pi(r) = u} dK^{(r)}, \qquad dV_u = \sum_{r:\ \pi(r) = u} dV^{(r)}.$$
#
# By hand, with $h = 2$ query heads sharing $g = 1$ key/value head, $T = 2$ tokens, $d_h = 1$ (so
# $\tau = 1$) and a causal mask. Keys $k = (0, \ln 3)$. Head 0's queries are 0, so its row 1 puts
# weights $(1/2, 1/2)$ on the two keys; head 1's second query is 1, so its scores are
# $(0, \ln 3)$ and its weights $(1/4, 3/4)$. Row 0 sees only key 0 (weight 1) in both heads:
#
# $$A_0 = \begin{pmatrix} 1 & 0 \\ \tfrac12 & \tfrac12 \end{pmatrix}, \qquad
#   A_1 = \begin{pmatrix} 1 & 0 \\ \tfrac14 & \tfrac34 \end{pmatrix}.$$
#
# The upstream gradients are $dO_0 = (1, 2)^\top$ and $dO_1 = (2, 4)^\top$. Each query head's
# $dV^{(r)} = A_r^\top dO_r$ is a vector of two numbers, and the shared head gets their sum:
# exercise 08.3 below.

# %%
q_small = np.array([0.0, 0.0, 0.0, 1.0]).reshape(1, 2, 2, 1)  # (B, H, T, D)
k_small = np.array([0.0, np.log(3.0)]).reshape(1, 1, 2, 1)   # (B, G, T, D)
v_small = np.array([1.0, -1.0]).reshape(1, 1, 2, 1)
do_small = np.array([1.0, 2.0, 2.0, 4.0]).reshape(1, 2, 2, 1)
o_small, cache_small = causal_attention_forward(q_small, k_small, v_small)
print("attention weights of the two query heads:\n", cache_small.saved.a[0])

# %% [markdown]
# **Exercise 08.3.** Write the shared head's $dV$ from the two weight matrices, shape `(1, 1, 2, 1)`.

# %% tags=["exercise"]
A0 = np.array([[1.0, 0.0], [0.5, 0.5]])
A1 = np.array([[1.0, 0.0], [0.25, 0.75]])
dv_shared = ...  # (1, 1, 2, 1)
# BEGIN SOLUTION
dv_shared = (A0.T @ do_small[0, 0] + A1.T @ do_small[0, 1]).reshape(1, 1, 2, 1)
# END SOLUTION

# %%
check("08.3", dv_shared)

# %% [markdown]
# **Exercise 08.4.** Now at a size where no one computes by hand: $h = 4$, $g = 2$, $T = 5$,
# $d_h = 3$, float64. `per_head` holds the gradients each query head computes for its copy of the
# keys, shape $(B, h, T, d_h)$. Collect them into the $g$ shared heads: which query heads' copies
# belong to shared head $u$ is the head map $\pi$ of A10 (no loop over heads is needed, and no
# code above does it for you); the check compares your $dK$ with central differences of
# $\phi(K) = \sum O \odot dO$ from `refmath.gradcheck.numerical_gradient`.

# %% tags=["exercise"]
B, H, G, T, D = 1, 4, 2, 5, 3
q5 = rng.standard_normal((B, H, T, D))
k5, v5 = rng.standard_normal((B, G, T, D)), rng.standard_normal((B, G, T, D))
do5 = rng.standard_normal((B, H, T, D))
heads = gqa_head_map(H, G)
_, repeated_cache = sdpa_forward(q5, k5[:, heads], v5[:, heads], mask=causal_mask(T))
_, per_head, _ = sdpa_backward(do5, repeated_cache)  # (B, H, T, D): one copy per query head
dk_shared = ...  # (B, G, T, D)
# BEGIN SOLUTION
dk_shared = per_head.reshape(B, G, H // G, T, D).sum(axis=2)
# END SOLUTION

# %%
check("08.4", dk_shared)

# %%
check_true("your dK holds all of the per-head gradient",
           lambda dk: np.allclose(np.sum(dk, axis=1), np.sum(per_head, axis=1), rtol=1e-12,
                                  atol=1e-12),
           "each shared head is read by two query heads: nothing of their gradients is dropped",
           of=dk_shared)

# %% [markdown]
# ## A13: what grouping saves, and what it does not
#
# One attention block has $d\,h d_h + 2\,d\,g d_h + h d_h\,d$ weights. At $d = 4096$, $h = 32$,
# $d_h = 128$: MHA ($g = 32$) has $4d^2 = 67{,}108{,}864$; GQA with $g = 8$ has
# $2d^2 + 2d(d/4) = 41{,}943{,}040$; MQA ($g = 1$) has $34{,}603{,}008$.
#
# Per decode step at context $t$, count the work of one layer for one sequence (2 FLOPs per
# multiply-add): the Q and O projections, $4 d h d_h$ (each a $d \times h d_h$ product with one
# token's vector); the K and V projections, $4 d g d_h$; the scores $q k^\top$ and the weighted sum
# $A V$ of every query head against the $t$ cached keys and values; and the bytes of cache read
# ($b$ bytes per element). Count those last two yourself in exercise 08.5. Every query head still
# scores every key, so **the score arithmetic does not depend on $g$**: grouping divides the K/V
# projections, their parameters and the cache by $h/g$, and nothing else. What it buys at
# decode time is fewer bytes to read (lesson 10: decode is bound by memory bandwidth), not fewer
# FLOPs. `refmath.sizing.attention_design_cost` gives the counts (after exercise 08.5, which asks
# for two of them); the parameters first:

# %%
for name, groups in (("MHA", 32), ("GQA", 8), ("MQA", 1)):
    print(f"{name} g = {groups:2}: params {attention_parameter_count(4096, 32, groups, 128):>11,}")
assert attention_parameter_count(4096, 32, 8, 128) == 2 * 4096**2 + 2 * 4096 * 1024 == 41_943_040
layer0_attn = n_params({k: v for k, v in shapes.items() if k.startswith("layers.0.attn.")})
assert layer0_attn == attention_parameter_count(m3.d_model, m3.n_heads, m3.kv_heads, m3.d_h)

# %% [markdown]
# **Exercise 08.5.** For Llama-3-8B's shape ($d = 4096$, $h = 32$, $g = 8$, $d_h = 128$) at $t = 8192$
# and 2-byte elements, count by hand (a) the FLOPs of the scores and the weighted sum, and (b) the
# cache bytes, of one layer's decode step for one sequence. (c) A decode step reads the layer's
# attention weights (the GQA count printed above, in 2-byte elements) and its cache: at what
# context $t$ does the cache read of one sequence equal the weights' bytes?

# %% tags=["exercise"]
score_flops_by_hand = ...
cache_bytes_by_hand = ...
cache_equals_weights_at = ...
# BEGIN SOLUTION
score_flops_by_hand = 4 * 32 * 128 * 8192  # q k^T and A V: h d_h t multiply-adds each, 2 FLOPs
cache_bytes_by_hand = 2 * 8192 * 8 * 128 * 2  # K and V, t tokens, g heads of d_h, 2 bytes
cache_equals_weights_at = 2 * 41_943_040 / (2 * 8 * 128 * 2)  # weight bytes / cache bytes per token
# END SOLUTION

# %%
check("08.5a", score_flops_by_hand)

# %%
check("08.5b", cache_bytes_by_hand)

# %%
check("08.5c", cache_equals_weights_at)

# %%
from refmath.sizing import attention_design_cost

for name, groups in (("MHA", 32), ("GQA", 8), ("MQA", 1)):
    cost = attention_design_cost(4096, 32, groups, 128, context=8192)
    print(f"{name} g = {groups:2}: per step: scores {cost.score_flops / 1e6:6.1f} MFLOP, K/V "
          f"projections {cost.kv_projection_flops / 1e6:5.1f} MFLOP, cache read "
          f"{cost.cache_bytes / 2**20:5.1f} MiB")

group_counts = [32, 16, 8, 4, 2, 1]
costs = [attention_design_cost(4096, 32, gg, 128, context=8192) for gg in group_counts]
assert len({c.score_flops for c in costs}) == 1
fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.4), layout="constrained")
axes[0].plot(group_counts, [c.score_flops / 1e6 for c in costs], "o-", label="scores and values")
axes[0].plot(group_counts, [c.q_o_projection_flops / 1e6 for c in costs], "^-",
             label="Q and O projections")
axes[0].plot(group_counts, [c.kv_projection_flops / 1e6 for c in costs], "s-",
             label="K and V projections")
axes[0].set(xscale="log", yscale="log", xlabel="key/value heads g (h = 32)",
            ylabel="MFLOP per decode step, one layer", title="FLOPs: only K/V projections shrink")
axes[1].plot(group_counts, [c.cache_bytes / 2**20 for c in costs], "o-", color="tab:red")
axes[1].set(xscale="log", yscale="log", xlabel="key/value heads g (h = 32)",
            ylabel="MiB of cache read, one layer", title="bytes: the cache shrinks as g")
for ax in axes:
    ax.set_xticks(group_counts, [str(gg) for gg in group_counts])
    ax.invert_xaxis()
axes[0].legend(fontsize=8)
fig.suptitle("one decode step at t = 8192, d = 4096, d_h = 128, bf16", fontsize=10)
plt.show()

# %% [markdown] tags=["question"]
# **Question.** You have a trained MHA checkpoint with $h = 32$ and want a GQA model with $g = 8$.
# Why can you not simply keep every fourth key/value head, and what do Ainslie et al. (2023) do
# instead?
#
# <!-- BEGIN SOLUTION -->
# The query heads of a group were trained against their *own* keys and values; giving three of
# them another head's keys changes their scores and outputs, and the model degrades. Ainslie et
# al. build each shared head's $W_K$ and $W_V$ by mean-pooling the projection matrices of the
# heads in its group, then *uptrain*: continue pre-training the converted model for a small
# fraction (about 5%) of the original pre-training compute, which recovers most of MHA's quality
# at close to MQA's decoding speed. GQA is a different model, not an exact rewrite of MHA.
# <!-- END SOLUTION -->

# %% [markdown]
# So GQA is a choice made before training, or paid for afterwards: a grouped model computes a
# different function from the MHA model it came from (the shared head cannot equal all the heads
# it replaces), and Ainslie et al. recover the quality by mean-pooling the key/value heads of each
# group and then uptraining, continuing pre-training for about 5% of its original compute.

# %% [markdown]
# ## N13-N17: context extension, rescaling RoPE's frequencies
#
# **Why RoPE does not extrapolate.** Pair $r$ turns at $\omega_r = b^{-2r/d_h}$ radians per token,
# a wavelength $\lambda_r = 2\pi/\omega_r$. Over a training context of $L$ tokens the fast pairs turn
# many times, but every pair with $\lambda_r > L$ never completes a turn: past $L$ its angles (and
# the score patterns they make with every other pair) were never seen in training. The
# relative-position identity still holds; what fails is that the model never learned what those
# angles mean. Every fix slows some pairs down so that the longer context $sL$ maps onto angles
# seen in training:
#
# - **position interpolation** (linear, N13; Chen et al., 2023): $\omega'_r = \omega_r/s$ for
#   every pair. Nothing new is seen, but the fast pairs, which tell neighbours apart, are
#   squeezed $s$ times too;
# - **NTK-aware / dynamic NTK** (N14; bloc97 and emozilla, 2023): grow the base,
#   $b' = b\,(s\ell/L - (s-1))^{d_h/(d_h-2)}$ at length $\ell$, which leaves pair 0 alone and slows
#   the slow pairs most; "dynamic" recomputes $b'$ from the current length, so it is exactly RoPE
#   up to $L$;
# - **Llama 3.1's rule** (N15; Grattafiori et al., 2024): keep the pairs with
#   $\lambda_r < L/\beta$, divide those with $\lambda_r > L/\alpha$ by $s$, and blend between;
# - **YaRN** (N16; Peng et al., 2023): the same idea counted in rotations, a linear ramp between
#   the pair that turns $\beta_{\text{fast}}$ times over $L$ (kept) and the one that turns
#   $\beta_{\text{slow}}$ times (interpolated), plus a temperature: queries and keys are scaled by
#   $m = 0.1\ln s + 1$, so every score by $m^2$. DeepSeek moves that temperature into the softmax
#   scale, $\mu(s;\text{mscale\_all\_dim})^2/\sqrt{d_k}$;
# - **LongRoPE** (N17; Ding et al., 2024, Phi-3): a searched divisor per pair, one set for short
#   and one for long sequences, and $m = \sqrt{1 + \ln s/\ln L}$.

# %% [markdown]
# **Exercise 08.6.** Llama 3.1's rule by hand for $d_h = 8$, $b = 500$, $L = 32$, $s = 8$, $\alpha = 1$,
# $\beta = 4$. The frequencies are $\omega_r = 500^{-r/4}$; a pair whose wavelength is under
# $L/\beta = 8$ keeps $\omega_r$, one over $L/\alpha = 32$ gets $\omega_r/8$, and one between gets
# $(1-\gamma)\,\omega_r/8 + \gamma\,\omega_r$. The weight $\gamma$ is linear in the number of
# turns the pair makes over the trained context, $L/\lambda_r$, and it joins the two ends without a
# jump: $\gamma = 0$ where the pair would be divided by $s$ ($\lambda_r = L/\alpha$) and
# $\gamma = 1$ where it would be kept ($\lambda_r = L/\beta$). Work out $\gamma$ from that, then
# give the four new frequencies.

# %% tags=["exercise"]
llama3_by_hand = ...
# BEGIN SOLUTION
w = 500.0 ** (-np.arange(4) / 4)
lam = 2 * np.pi / w
gamma = (32 / lam - 1) / (4 - 1)
llama3_by_hand = np.where(lam < 8, w, np.where(lam > 32, w / 8, (1 - gamma) * w / 8 + gamma * w))
# END SOLUTION

# %%
check("08.6", llama3_by_hand)

# %% [markdown]
# The library's `rope_inv_freq` computes every rule; on Llama 3.1's shape ($d_h = 128$,
# $b = 500{,}000$, $L = 8192$, $s = 8$) each one slows the pairs this way:

# %%
from refmath.positions import rope_forward, rope_frequencies_change, rope_inv_freq

d_h, base, L, s = 128, 500000.0, 8192, 8.0  # Llama 3.1's head width, base and trained context
omega, _ = rope_inv_freq(d_h, base)
rules = {
    "position interpolation": dict(rope_type="linear", factor=s),
    "dynamic NTK at 8L": dict(rope_type="dynamic", factor=s, original_max_seq_len=L),
    "llama3": dict(rope_type="llama3", factor=s, original_max_seq_len=L),
    "YaRN": dict(rope_type="yarn", factor=s, original_max_seq_len=L),
}
print(f"pairs that never complete a turn in {L} tokens: {int(np.sum(2 * np.pi / omega > L))} "
      f"of {d_h // 2}")
fig, ax = plt.subplots(figsize=(6, 3.4), layout="constrained")
for label, rule in rules.items():
    scaled, m = rope_inv_freq(d_h, base, rule, seq_len=int(s * L))
    ax.plot(2 * np.pi / omega, scaled / omega, ".-", label=f"{label} (m = {m:.3f})")
ax.axvline(L, color="grey", lw=0.8, ls="--")
ax.text(L * 1.1, 0.6, "wavelength = L", fontsize=8, color="grey")
ax.set(xscale="log", yscale="log", xlabel=r"wavelength $\lambda_r = 2\pi/\omega_r$ (tokens)",
       ylabel=r"$\omega'_r / \omega_r$", title="how each rule slows RoPE's pairs (s = 8)")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# **A length-dependent rule invalidates the cache.** Keys are cached already rotated (K3). Dynamic
# NTK's frequencies change with the current length once it passes $L$, so a key rotated when the
# sequence was shorter no longer matches the one a full recomputation would make: past $L$ every
# decode step would mix two sets of frequencies. refmath's cached step refuses there, and
# `generate` prefills afresh (Hugging Face keeps the stale keys).

# %%
dynamic = dict(rope_type="dynamic", factor=4.0, original_max_seq_len=16)
key = rng.standard_normal((1, 8))
at = {length: rope_forward(key, positions=np.array([3]),
                           inv_freq=rope_inv_freq(8, 500.0, dynamic, length)[0])[0]
      for length in (10, 16, 17)}
print("key at position 3, rotated at lengths 10 and 16 differ by", np.abs(at[10] - at[16]).max())
print("... at lengths 16 and 17 differ by", np.abs(at[16] - at[17]).max())
print("stale from 16 to 17 tokens:", rope_frequencies_change(dynamic, 16, 17),
      "; from 10 to 16:", rope_frequencies_change(dynamic, 10, 16))

# %% [markdown]
# ## N18: QK-norm
#
# Qwen3 and Gemma 3 RMS-normalise each head's query and key (over its $d_h$ coordinates, with one
# learned gain of width $d_h$ shared by the heads) after the projections and before RoPE; OLMo 2
# normalises the whole query and key projections ($h d_h$ and $g d_h$ wide) instead. Then
# $|\hat q \cdot \hat k| \le d_h \max_j |\gamma_{q,j}\gamma_{k,j}|$, whatever the weights, which
# keeps the logits of attention from growing without bound in training (Dehghani et al., 2023).
# The backward is RMSNorm's (N2), the gain's gradient summed over heads and tokens:
# `decoder.DecoderConfig(qk_norm="head")`; OLMo 2's form is its own family file's,
# `refmath.models.olmo2`.

# %%
qk_config = decoder.DecoderConfig(vocab_size=11, max_seq_len=8, d_model=16, n_layers=1,
                                  n_heads=4, n_kv_heads=2, qk_norm="head")
qk_params = {name[len("layers.0.attn."):]: value
             for name, value in decoder.init_params(qk_config, seed=3).items()
             if name.startswith("layers.0.attn.")}
big = {**qk_params, "w_q": 100.0 * qk_params["w_q"]}  # a query projection grown 100-fold
xq = rng.standard_normal((1, 5, 16))
q_small, _, _ = decoder.queries_keys(xq, qk_params, qk_config)
q_big, _, _ = decoder.queries_keys(xq, big, qk_config)
change = np.abs(q_big - q_small).max() / np.abs(q_small).max()
print(f"a 100x larger W_Q changes the normalised, rotated queries by {change:.1e} of their size "
      f"(only through eps)")
assert change < 1e-3

# %% [markdown]
# ## N19, N20: Gemma's soft caps, GeGLU and local layers
#
# Gemma 2 (Gemma Team, 2024) bounds its attention scores and its logits with a **soft cap**,
#
# $$ y = c \tanh(x / c), $$
#
# with $c = 50$ on the scores (after the score scale $1/\sqrt{d_k}$, *before* the mask, so a
# masked $-\infty$ stays $-\infty$) and $c = 30$ on the final logits. Gemma 2's config writes that
# scale $1/\sqrt{s_q}$, with $s_q$ its `query_pre_attn_scalar` (not RoPE's factor $s$ above).
# Below $c$ the cap is almost the identity ($y = x - x^3/(3c^2) + \dots$); far above, the output
# flattens at $c$ and so does the gradient: a score that has run away stops growing, and stops
# being pushed. Its backward is one multiplication by the slope $\partial y / \partial x$ (exercise 08.7 asks for it). Gemma's
# feed-forward is **GeGLU**, SwiGLU with a tanh-GELU gate, $[\operatorname{GELU}_{\tanh}(x W_g) \odot x W_u] W_d$ (N20);
# every RMSNorm gain is $1 + w$ with $w$ stored, the embeddings are multiplied by $\sqrt d$, and
# Gemma 2 and 3 also normalise each sublayer's *output* ("sandwich" norms). Their layers alternate
# between **local** ones, which slide a window of 4096 tokens (Gemma 3: 1024, five local layers
# per global one, the local ones with their own RoPE base), and **global** ones, which see the
# whole context: `GemmaConfig(windows=..., local_rope_base=...)` (`refmath.models.gemma`, Llama's
# decoder with these differences), each layer computing with its own `gemma.layer_config`.

# %%
x = np.linspace(-150, 150, 601)
y = 50.0 * np.tanh(x / 50.0)  # Gemma 2's cap on the attention scores, c = 50
fig, left = plt.subplots(figsize=(3.6, 2.8), layout="constrained")
left.plot(x, x, color="grey", lw=0.8, ls="--", label="identity")
left.plot(x, y, label="$50 \\tanh(x/50)$")
left.set(xlabel="score $x$", ylabel="capped score", title="the cap")
left.legend(fontsize=8)
plt.show()
from refmath.models import gemma as gemma_model

gemma = gemma_model.GemmaConfig(vocab_size=11, max_seq_len=8, d_model=16, n_layers=4, n_heads=4,
                                n_kv_heads=2, head_dim=4, d_ff=48, generation=3,
                                windows=(4, 4, 4, None), local_rope_base=100.0, rope_base=10000.0)
for i in range(gemma.n_layers):
    layer = gemma_model.layer_config(gemma, i)
    print(f"layer {i}: window {layer.sliding_window}, RoPE base {layer.rope_base:g}")

# %% [markdown]
# **Exercise 08.7.** One query of Gemma 2's attention, $d_k = 4$, against four keys: its dot products
# $q k_j^\top$ are `dots` below, and key 3 is masked. (a) Write the row's scores as they enter the
# softmax, `capped` (the scale, the cap $c = 50$ and the mask, in the order the text above gives).
# (b) Derive the slope of each of those scores with respect to its dot product,
# $\partial s_j / \partial (q k_j^\top)$, the chain rule included, and give the four as `slope`
# (a masked score is a constant).

# %% tags=["exercise"]
dots = np.array([0.0, 50.0, 100.0, 200.0])
capped = ...
slope = ...
# BEGIN SOLUTION
scaled = dots / np.sqrt(4)
capped = 50.0 * np.tanh(scaled / 50.0) + np.array([0.0, 0.0, 0.0, -np.inf])
# d/d dots of 50 tanh(dots / (2 * 50)): the c and the 1/c cancel, the 1/sqrt(d_k) stays
slope = np.array([1.0, 1.0, 1.0, 0.0]) * (1.0 - np.tanh(scaled / 50.0) ** 2) / np.sqrt(4)
# END SOLUTION

# %%
check("08.7a", capped)

# %%
check("08.7b", slope)

# %% [markdown]
# The library's `softcap_forward` is that cap; its cache keeps $\tanh(x/c)$, from which the
# backward takes the slope $1 - \tanh^2(x/c)$ (the $c$ outside and the $1/c$ inside cancel): 1 at
# 0, and falling to 0 as the capped score nears $\pm c$.

# %%
from refmath.ffn import softcap_forward

capped_scores, softcap_cache = softcap_forward(np.array([0.0, 25.0, 50.0, 100.0]), 50.0)
if capped is not ... and slope is not ...:  # the library's values, shown once you have answered
    print("softcap_forward at (0, 25, 50, 100), c = 50:", capped_scores,
          " slopes:", 1 - softcap_cache.tanh**2)

# %% [markdown]
# ## N21, N22: the parallel block, and norms after the sublayers
#
# GPT-J, PaLM (Chowdhery et al., 2022) and Falcon do not run the FFN after the attention: both
# read the same normalised input and add to the residual together,
#
# $$ x' = x + \operatorname{Attn}(N_1(x)) + \operatorname{FFN}(N_2(x)) , $$
#
# with $N_2 = N_1$ (one norm: GPT-J, PaLM, Falcon-7B) or a second norm (Falcon-40B). A layer is
# then one step of depth instead of two, and the matrices that read $N_1(x)$ (the query, key and
# value projections and the FFN's gate and up projections) can be one product, which PaLM reports
# as about 15% faster training at scale. The backward adds the two branches' input gradients
# where they meet, at the shared norm's output, and the identity's: $dx = dx' + J_{N}^\top (J_A^\top
# + J_F^\top)\, dx'$. OLMo 2 (N22) moves the norms the other way, onto the sublayers' outputs
# only: $x' = x + \operatorname{RMSNorm}(F(x))$ (`refmath.models.olmo2`). Each is written out in
# its own family file, its `block_forward` and the mirror `layer_backward`: the parallel block in
# `refmath.models.falcon`, with `parallel_block`, `parallel_norms`, `norm` and `ffn` and the PaLM
# preset.

# %%
from refmath.models import falcon

palm = falcon.preset("palm-tiny", vocab_size=32, max_seq_len=8, d_model=16, d_ff=64)
sequential = falcon.preset("palm-tiny", vocab_size=32, max_seq_len=8, d_model=16, d_ff=64,
                           parallel_block=False)
p_params = falcon.init_params(palm, seed=4)
s_params = falcon.init_params(sequential, seed=4)
print("parameters: parallel", n_params(falcon.param_shapes(palm)), "sequential",
      n_params(falcon.param_shapes(sequential)), "(one norm fewer per layer)")
loss_p, cache_p = falcon.forward(p_params, batch, palm)
grad_check = check_param_gradients(lambda p: falcon.forward(p, batch, palm)[0],
                                   falcon.backward(cache_p), p_params)
print(f"PaLM-shaped parallel decoder: loss {float(loss_p):.4f}; gradient check passed: "
      f"{grad_check.passed}")

# %% [markdown]
# Cohere's Command-R (M5, `refmath.models.cohere`) is the same parallel block, written as a family of
# its own: one LayerNorm without a bias feeds attention and a SwiGLU, RoPE rotates interleaved pairs,
# the head is the token table transposed, and the logits are scaled by a constant $s$
# (`logit_scale`), $z = s\, \operatorname{LN}(x^{(L)})\, E^\top$. Since $s$ multiplies the logits
# and nothing else, doubling it doubles every logit, and the softmax sharpens: the same weights give
# another distribution.

# %%
from refmath.models import cohere

def command_r(logit_scale):
    return cohere.CohereConfig(vocab_size=32, max_seq_len=8, d_model=16, n_layers=2, n_heads=4,
                               n_kv_heads=2, d_ff=32, logit_scale=logit_scale)


c_params = cohere.init_params(command_r(0.25), seed=5)
z_quarter = cohere.logits(c_params, batch["tokens"], command_r(0.25))
z_half = cohere.logits(c_params, batch["tokens"], command_r(0.5))
print("logits at s = 1/2 are exactly twice those at s = 1/4:",
      np.array_equal(z_half, 2 * z_quarter))
loss_c, cache_c = cohere.forward(c_params, batch, command_r(0.25))
grad_check = check_param_gradients(lambda p: cohere.forward(p, batch, command_r(0.25))[0],
                                   cohere.backward(cache_c), c_params)
print(f"Command-R-shaped decoder: loss {float(loss_c):.4f}; gradient check passed: "
      f"{grad_check.passed}")

# %% [markdown]
# **Exercise 08.8.** The one product a parallel layer's normalised input goes through, for PaLM-540B's
# shape: $d = 18432$, $h = 48$ query heads of $d_h = 256$, multi-query attention (one key and one
# value head), a SwiGLU of width $d_f = 4d$. How many columns does the fused matrix
# $[W_Q\ W_K\ W_V\ W_{\text{gate}}\ W_{\text{up}}]$ have? Write `fused_columns`.

# %% tags=["exercise"]
fused_columns = ...
# BEGIN SOLUTION
fused_columns = 48 * 256 + 2 * 256 + 2 * 4 * 18432
# END SOLUTION

# %%
check("08.8", fused_columns)

# %% [markdown]
# ## Exercises
#
# 1. Derive $dQ$ for GQA. Why does $dQ$ need no sum over heads, while $dK$ and $dV$ do?
# 2. Show that MQA ($g = 1$) sums the key gradient over all $h$ query heads, and that MHA
#    ($g = h$) sums over one head only.
# 3. Exercise 08.5c found the context $t$ at which one layer's cache read equals its attention
#    weights in bf16 at $g = 8$. With `attention_design_cost`, find it for MQA ($g = 1$) and MHA
#    ($g = 32$) of the same shape. Why does it not grow exactly as $1/g$?
# 4. Fuse the three projections of the modern decoder's layer 0 into one `w_qkv` and check with
#    `mha_forward` that the layer's attention output does not change.
# 5. The tiny M3 above has $g = 2$. Convert it to $g = 1$ by mean-pooling `w_k` and `w_v` over the
#    two heads, and measure how much the loss on the same batch changes.
# 6. Show that dynamic NTK's base gives pair $r = d_h/2 - 1$ exactly the frequency of linear
#    interpolation at the length $sL$, and that pair 0 keeps its frequency at every length.
# 7. With `rope_inv_freq`, find the pair indices where YaRN's ramp starts and ends for Llama 3.1's
#    shape ($d_h = 128$, $b = 500000$, $L = 8192$); how many pairs are fully interpolated?
# 8. Why must the soft cap come before the additive mask and not after it? What would a cap after
#    the mask do to a masked key's weight?
#
# ## References
#
# - Touvron, H., et al. (2023). LLaMA: Open and Efficient Foundation Language Models. (Pre-RMSNorm,
#   SwiGLU and RoPE in one decoder.)
# - Shazeer, N. (2019). Fast Transformer Decoding: One Write-Head is All You Need. (Multi-query
#   attention and the memory traffic of decoding.)
# - Ainslie, J., et al. (2023). GQA: Training Generalized Multi-Query Transformer Models from
#   Multi-Head Checkpoints. (Grouped-query attention, mean-pooled conversion and uptraining.)
# - Zhang, B., and Sennrich, R. (2019). Root Mean Square Layer Normalization.
# - Shazeer, N. (2020). GLU Variants Improve Transformer.
# - Su, J., et al. (2021). RoFormer: Enhanced Transformer with Rotary Position Embedding.
# - Chen, S., et al. (2023). Extending Context Window of Large Language Models via Positional
#   Interpolation. arXiv:2306.15595. (Linear position interpolation.)
# - bloc97 (2023), "NTK-Aware Scaled RoPE", and emozilla (2023), "Dynamically Scaled RoPE"
#   (r/LocalLLaMA posts; the base-growth rule and its dynamic form).
# - Peng, B., Quesnelle, J., Fan, H., and Shippole, E. (2023). YaRN: Efficient Context Window
#   Extension of Large Language Models. arXiv:2309.00071. (The ramp and the temperature.)
# - Grattafiori, A., et al. (2024). The Llama 3 Herd of Models. arXiv:2407.21783. (The llama3
#   frequency rule of Llama 3.1.)
# - Ding, Y., et al. (2024). LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens.
#   arXiv:2402.13753. (Per-pair factors, used by Phi-3.)
# - Dehghani, M., et al. (2023). Scaling Vision Transformers to 22 Billion Parameters.
#   arXiv:2302.05442. (QK-norm against growing attention logits.) Yang, A., et al. (2025).
#   Qwen3 Technical Report. arXiv:2505.09388. OLMo Team (2024). 2 OLMo 2 Furious.
#   arXiv:2501.00656.
# - Chowdhery, A., et al. (2022). PaLM: Scaling Language Modeling with Pathways. arXiv:2204.02311.
#   (The parallel block, multi-query attention, SwiGLU, no biases.) Almazrouei, E., et al. (2023).
#   The Falcon Series of Open Language Models. arXiv:2311.16867.
# - Gemma Team (2024). Gemma 2: Improving Open Language Models at a Practical Size.
#   arXiv:2408.00118. (Soft-capping, sandwich norms, alternating local and global layers.)
#   Gemma Team (2025). Gemma 3 Technical Report. arXiv:2503.19786. (Five local layers per global
#   one, QK-norm.)
