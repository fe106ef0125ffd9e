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
#     minutes: 35
#     ids: []
# ---

# %% [markdown]
# # Lesson 14: one modern decoder, every piece
#
# The lessons so far took the Transformer apart equation by equation. This closing lesson puts a
# representative modern decoder back together in one recurrence (Pre-RMSNorm, RoPE, GQA, SwiGLU,
# as in LLaMA; Touvron et al., 2023), rebuilds its logits from the library's single-equation
# functions, and walks through the table of changes that lead from the original Transformer to
# such a model, saying for each one which equation it acts on, which refmath function computes it
# and which lesson taught it. It is a worked composition of the earlier lessons, not a
# specification of every GPT or every LLM.
#
# **Prerequisites:** lessons 1-12 (lesson 13, on loading real checkpoints, is optional here).
#
# **Goals:** write one decoder layer from the equations and match the library's model to
# rounding; tell apart the changes that alter the function a model computes from those that only
# change how or where it is computed; combine the sizing rules into the cost of one decode step.
#
# **Catalogue IDs:** none of its own (a synthesis of lessons 1-12)
#
# **Duration:** about 35 minutes.

# %%
import dataclasses

import matplotlib.pyplot as plt
import numpy as np

from refmath.attention import causal_mask, gqa_head_map, sdpa_forward
from refmath.embedding import embedding_forward
from refmath.ffn import swiglu_forward
from refmath.inference.generate import generate
from refmath.inference.kv_cache import generate_cached
from refmath.lessons import check, check_function
from refmath.models.decoder import DecoderConfig, init_params
from refmath.norms import rmsnorm_forward
from refmath.positions import rope_forward
from refmath.sizing import PRESETS, format_bytes

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)

# %% [markdown]
# ## The recurrence
#
# Start from the token embeddings $H^{(0)} = E[a_{1:T}]$. At depth $\ell$,
#
# $$X = \mathrm{RMSNorm}_{\ell,1}(H^{(\ell-1)}),$$
#
# and for each query head $r$ and key/value head $u$,
#
# $$Q_r = X W_{Q,r},\quad K_u = X W_{K,u},\quad V_u = X W_{V,u},\qquad
#   \tilde Q_{i,r} = Q_{i,r} R_i^\top,\quad \tilde K_{j,u} = K_{j,u} R_j^\top,$$
#
# $$O_r = \mathrm{softmax}\Big(\frac{\tilde Q_r \tilde K_{\pi(r)}^\top}{\sqrt{d_h}} + M\Big)
#   V_{\pi(r)}.$$
#
# Then the two residual additions:
#
# $$U = H^{(\ell-1)} + [O_1 \cdots O_h]\, W_O, \qquad Z = \mathrm{RMSNorm}_{\ell,2}(U), \qquad
#   H^{(\ell)} = U + \big[\mathrm{SiLU}(Z W_g) \odot (Z W_u)\big] W_d.$$
#
# The last row predicts the next token:
#
# $$p_\theta(a_{T+1} \mid a_{1:T}) = \mathrm{softmax}\big(\mathrm{RMSNorm}_{\text{final}}(H^{(L)}_T)
#   \, W_{\text{vocab}}\big).$$
#
# Every symbol is one function of refmath: `embedding_forward` (N12), `rmsnorm_forward` (N2),
# `rope_forward` (N10), `gqa_head_map` (A10), `sdpa_forward` with `causal_mask` (A2), and
# `swiglu_forward` (N7).

# %%
config = DecoderConfig(vocab_size=32, max_seq_len=16, d_model=32, n_layers=2, n_heads=4,
                       n_kv_heads=2, ffn_multiple_of=16)
params = init_params(config, seed=0)
tokens = rng.integers(0, 32, (2, 7))
print("the logits to compute: (B, T, V) =", (*tokens.shape, config.vocab_size))


def heads_of(x, n):
    """(B, T, n d_h) -> (B, n, T, d_h)."""
    b, t, width = x.shape
    return x.reshape(b, t, n, width // n).transpose(0, 2, 1, 3)


# %% [markdown]
# **Exercise 14.1.** Write the forward pass of the whole decoder from the recurrence, as a function
# `my_logits(params, tokens, config)` returning the logits $(B, T, V)$, with the functions above and
# `heads_of`. The embedding table is `params["tok_emb"]`; the parameters of layer $\ell$ are
# `params[f"layers.{l}.ln1.gamma"]`, `...attn.w_q`, `attn.w_k`, `attn.w_v`, `attn.w_o`,
# `ln2.gamma`, `ffn.w_gate`, `ffn.w_up`, `ffn.w_down`; then `ln_f.gamma` and `lm_head`. Pass
# `base=config.rope_base` and `layout=config.rope_layout` to `rope_forward`, and `config.norm_eps`
# to `rmsnorm_forward`. The check runs it on this model's `params` and `tokens` and on a second
# batch, against the library's decoder (which your function may not call).

# %% tags=["exercise"]
def my_logits(params, tokens, config):
    logits = ...  # (B, T, V)
    # BEGIN SOLUTION
    h, g, T = config.n_heads, config.kv_heads, tokens.shape[1]
    H, _ = embedding_forward(tokens, params["tok_emb"])
    for layer in range(config.n_layers):
        p = {name.split(".", 2)[2]: value for name, value in params.items()
             if name.startswith(f"layers.{layer}.")}
        X, _ = rmsnorm_forward(H, p["ln1.gamma"], config.norm_eps)
        Q, _ = rope_forward(heads_of(X @ p["attn.w_q"], h), base=config.rope_base,
                            layout=config.rope_layout)
        K, _ = rope_forward(heads_of(X @ p["attn.w_k"], g), base=config.rope_base,
                            layout=config.rope_layout)
        V = heads_of(X @ p["attn.w_v"], g)
        shared = gqa_head_map(h, g)
        O, _ = sdpa_forward(Q, K[:, shared], V[:, shared], mask=causal_mask(T))
        U = H + O.transpose(0, 2, 1, 3).reshape(H.shape[0], T, -1) @ p["attn.w_o"]
        Z, _ = rmsnorm_forward(U, p["ln2.gamma"], config.norm_eps)
        F, _ = swiglu_forward(Z, p["ffn.w_gate"], p["ffn.w_up"], p["ffn.w_down"])
        H = U + F
    final, _ = rmsnorm_forward(H, params["ln_f.gamma"], config.norm_eps)
    logits = final @ params["lm_head"]
    # END SOLUTION
    return logits


# %%
check("14.1", my_logits)

# %% [markdown]
# ## From the Transformer to an LLM: what each change acts on
#
# | change | mathematical or execution effect | refmath | lesson |
# |---|---|---|---|
# | translation objective to causal language modelling | learn $\prod_t p_\theta(a_t \mid a_{<t})$ from text | `models.gpt.forward`, `losses.cross_entropy_forward` | 5, 7 |
# | Adam to AdamW | separate multiplicative decay from the gradient moments | `optim.AdamW`, `optim.takes_weight_decay` | 5, 7 |
# | Post-LN to Pre-LN | move normalisation inside the residual branch | `models.gpt.GPTConfig(norm_position=...)` | 2, 7 |
# | LayerNorm to RMSNorm | remove the mean subtraction | `norms.rmsnorm_forward` | 2, 8 |
# | ReLU/GELU to SwiGLU | add a learned gate and a featurewise product | `ffn.swiglu_forward` | 4, 8 |
# | absolute positions to RoPE | rotate Q and K so their product depends on position differences | `positions.rope_forward` | 4, 10 |
# | MHA to GQA/MQA | share K and V across query heads | `attention.gqa_head_map`, `sizing.attention_design_cost` | 8 |
# | materialised attention to FlashAttention | the same attention by tiled sums, less memory traffic | `flash.flash_attention_forward`, `kernels.flash_attention_forward` | 3, 12 |
# | full-prefix recomputation to KV caching | reuse unchanged historical K and V | `inference.kv_cache.decode_step` | 3, 10 |
# | expanded KV storage to MLA latents | a trained factorisation, plus a separate positional key | `models.mla`, `sizing.mla_cache_bytes` | 11 |
# | contiguous allocation to paging | change the address of retained cache values | `inference.paged.PagedKVCache` | 3, 11 |
# | full-precision cache to a quantised cache | fewer bytes per element, with numerical error | `inference.quantized.quantize` | 10 |
#
# The table sorts into three kinds. Some rows change the *model*: the function from tokens to
# probabilities (RMSNorm, SwiGLU, RoPE, GQA, MLA, Pre-LN) or how it is trained (the objective,
# AdamW). Some change only *how* the same function is evaluated: FlashAttention, KV caching and
# paging give the same numbers up to rounding. And one trades exactness for bytes: a quantised
# cache. Two checks of the second kind, on the model above: cached generation draws exactly the
# tokens of full recomputation, and the tiled attention equals the dense one.

# %%
from refmath.models import decoder

prompt = np.array([3, 1, 4, 1, 5])
full = generate(decoder, params, config, prompt, 6, greedy=True)
cached = generate_cached(decoder, params, config, prompt, 6, greedy=True).tokens
print("greedy tokens, full recomputation:", full, "\n                  with a KV cache:", cached)
np.testing.assert_array_equal(full, cached)

# %% [markdown]
# **Exercise 14.2.** Turn the decoder into its MHA twin (every query head with its own key/value
# head) by repeating each shared head's block of $d_h$ columns of `w_k` and `w_v`, as in lesson 8:
# query head $r$ must read shared head `gqa_head_map(h, g)[r]`. Write `twin_w_k`, the twin's `w_k`
# of layer 0, of shape $(d, h\,d_h)$.

# %% tags=["exercise"]
twin_w_k = ...
# BEGIN SOLUTION
d, d_h = config.d_model, config.d_h
repeat = gqa_head_map(config.n_heads, config.kv_heads)
twin_w_k = params["layers.0.attn.w_k"].reshape(d, config.kv_heads, d_h)[:, repeat].reshape(d, -1)
# END SOLUTION

# %%
check("14.2", twin_w_k)

# %% [markdown]
# Is the twin the same function? Expanded this way in every layer, `w_k` and `w_v` give a decoder
# whose logits equal the GQA decoder's to rounding (exercise 1 at the end lets you see it; the
# tests check it). The twin computes the same function with $h/g = 2$ times the K/V parameters
# and cache: GQA is a
# constraint on MHA (shared heads), which is why a GQA model cannot be read off an arbitrary MHA
# checkpoint without uptraining (lesson 8).
#
# ## The cost of one decode step, all together
#
# Lesson 10's bandwidth bound, lesson 8's grouping, and lesson 10's quantised cache combine into
# one picture: the bytes a decode step of Llama-3-8B's shape reads, at a batch of 16 sequences of
# 8192 tokens, for MHA, GQA with $g = 8$, and GQA with int8 and int4 caches (groups of 32). The
# GQA designs read the same 15.0 GB of weights; MHA's wider K and V projections add
# $L \cdot 2 \cdot d\,(h - g)\,d_h = 805{,}306{,}368$ weights, 1.6 GB in bf16.

# %% tags=["exercise"]
# Exercise 14.3: write the cache side of this picture as one function, for any decoder shape of
# `PRESETS` (fields `n_layers`, `kv_heads`, `head_dim`, `sliding_window`: None or w): the bytes of
# the KV cache a decode step of `batch` sequences at `context` tokens reads, in bf16 (bits=None)
# or quantised to `bits` bits in groups of 32 with one 2-byte scale per group. A sliding window
# of w tokens caches only the last w. The check compares it with decode_step_traffic and
# quantized_kv_cache_bytes on Llama-3-8B's shape (MHA, GQA, int8, int4), Mistral-7B's window
# and GPT-2 small.
def my_cache_bytes(shape, context, batch, bits=None):
    total = ...
    # BEGIN SOLUTION
    tokens = context if shape.sliding_window is None else min(context, shape.sliding_window)
    numbers = 2 * batch * tokens * shape.n_layers * shape.kv_heads * shape.head_dim  # K and V
    if bits is None:
        total = 2 * numbers  # bf16: 2 bytes a number
    else:
        total = numbers * bits / 8 + 2 * numbers / 32  # the payload, and a scale per 32
    # END SOLUTION
    return total


# %%
from refmath.lessons.expected.lesson14_synthesis import cache_bytes_reference as library_cache_bytes
from refmath.lessons.expected.lesson14_synthesis import cache_bytes_scales_left_out
from refmath.lessons.expected.lesson14_synthesis import cache_bytes_with_float32_scales
from refmath.sizing import decode_step_traffic, quantized_kv_cache_bytes

check("14.3", my_cache_bytes)

# %%
llama = PRESETS["llama-3-8b"]
batch, context = 16, 8192
designs = {}
for label, kv_heads, bits in (("MHA, bf16", 32, None), ("GQA g=8, bf16", 8, None),
                              ("GQA g=8, int8", 8, 8), ("GQA g=8, int4", 8, 4)):
    shape = dataclasses.replace(llama, kv_heads=kv_heads)
    step = decode_step_traffic(shape, context, batch)
    cache = step.cache_bytes if bits is None else quantized_kv_cache_bytes(
        batch, shape.n_layers, context, kv_heads, shape.head_dim, bits=bits, group_size=32).total
    designs[label] = (step.weight_bytes, cache)
    print(f"{label:15s}: weights {format_bytes(step.weight_bytes)}, cache {format_bytes(cache)}")

# %% [markdown]
# **Exercise 14.4.** From `designs`, compute how many times fewer bytes a decode step of "GQA g=8,
# int4" reads than one of "MHA, bf16" (weights and cache together). By the bandwidth bound, that is
# also its speed-up at best.

# %% tags=["exercise"]
speedup_bound = ...
# BEGIN SOLUTION
speedup_bound = sum(designs["MHA, bf16"]) / sum(designs["GQA g=8, int4"])
# END SOLUTION

# %%
check("14.4", speedup_bound)

# %%
labels = list(designs)
weights_gb = np.array([designs[k][0] for k in labels]) / 1e9
cache_gb = np.array([designs[k][1] for k in labels]) / 1e9
fig, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
ax.bar(labels, weights_gb, label="weights (read once per step)", color="tab:gray")
ax.bar(labels, cache_gb, bottom=weights_gb, label="KV cache (16 sequences x 8192 tokens)",
       color="tab:blue")
for i, total in enumerate(weights_gb + cache_gb):
    ax.text(i, total, f"{total:.0f} GB", ha="center", va="bottom")
ax.set_ylim(top=1.15 * (weights_gb + cache_gb).max())
ax.set(ylabel="GB read per decode step", title="Llama-3-8B shape, batch 16, context 8192")
ax.legend(fontsize=8)
plt.show()

# %% [markdown] tags=["question"]
# **Question.** For each row of the table, say whether a test can check it by comparing with the
# original computation to rounding error, or whether it needs a different kind of evidence. Give
# one example of each kind from the project's tests or lessons.
#
# <!-- BEGIN SOLUTION -->
# FlashAttention (tiled against dense, F4), KV caching (cached against full recomputation, K2 and
# the cell above) and paging (paged against contiguous decode, K10) compute the *same* function:
# they are checked to rounding error. The model changes (RMSNorm, SwiGLU, RoPE, GQA, MLA, Pre-LN)
# define *different* functions: they are checked against their own equations (worked examples
# such as N3, gradient checks, PyTorch autograd with copied weights), and whether they help is an
# empirical question about training, not an identity. The training changes (the objective, AdamW)
# are checked against their recurrences (O1, O4). The quantised cache is an approximation: it is
# checked by *bounds* (half a step per element, the score and output bounds of K12), not by
# equality.
# <!-- END SOLUTION -->

# %% [markdown]
# ## Exercises
#
# 1. Expand every layer's `w_k` and `w_v` as in exercise 14.2, and compare the MHA twin's logits
#    (`decoder.logits` with `dataclasses.replace(config, n_kv_heads=config.n_heads)`) with the
#    GQA decoder's: how far apart are they?
# 2. Extend `my_logits` to return the per-layer keys and values, and check that they equal what
#    `refmath.inference.kv_cache.prefill` stores (K2, K3).
# 3. Replace the RMSNorms of your forward pass by LayerNorms and the SwiGLU by a GELU FFN: which
#    refmath model is that, and what else must change to match it exactly?
# 4. Add MLA to the cost picture: the bytes of a decode step with DeepSeek-V2's latent width
#    ($d_c + d_R = 576$ per token and layer) at Llama-3-8B's depth.
# 5. Which rows of the table change the *parameters* a checkpoint holds, and which could be
#    switched on or off when serving an existing checkpoint?
# 6. Write the backward pass of your forward pass for one layer, using the library's backward
#    functions, and check it with `refmath.gradcheck.check_param_gradients`.
#
# ## References
#
# - Vaswani, A., et al. (2017). Attention Is All You Need.
# - Radford, A., et al. (2018). Improving Language Understanding by Generative Pre-Training.
# - Radford, A., et al. (2019). Language Models are Unsupervised Multitask Learners.
# - Loshchilov, I., and Hutter, F. (2017). Decoupled Weight Decay Regularization.
# - Xiong, R., et al. (2020). On Layer Normalization in the Transformer Architecture.
# - Zhang, B., and Sennrich, R. (2019). Root Mean Square Layer Normalization.
# - Shazeer, N. (2020). GLU Variants Improve Transformer.
# - Su, J., et al. (2021). RoFormer: Enhanced Transformer with Rotary Position Embedding.
# - Shazeer, N. (2019). Fast Transformer Decoding: One Write-Head is All You Need.
# - Ainslie, J., et al. (2023). GQA: Training Generalized Multi-Query Transformer Models from
#   Multi-Head Checkpoints.
# - Dao, T., et al. (2022). FlashAttention: Fast and Memory-Efficient Exact Attention with
#   IO-Awareness.
# - DeepSeek-AI, et al. (2024). DeepSeek-V2: A Strong, Economical, and Efficient
#   Mixture-of-Experts Language Model.
# - Kwon, W., et al. (2023). Efficient Memory Management for Large Language Model Serving with
#   PagedAttention.
# - Touvron, H., et al. (2023). LLaMA: Open and Efficient Foundation Language Models.
