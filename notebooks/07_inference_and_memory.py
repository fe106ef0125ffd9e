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
# # Lesson 7: serving a model, and what it costs in memory
#
# Lesson 3 built the KV cache and FlashAttention's tiles. This lesson follows a model into
# deployment. First the numerics that keep a softmax finite in half precision (catalogue A11, S4)
# and a mask that bounds how far back a token looks (A12). Then the cache in more detail: keys
# stored after their rotation (K3), the cost of a prompt against the cost of one new token (K5),
# latent attention that caches one short row per token (K8, K9), pages shared between sequences
# (K11) and a cache stored as small integers (K12). Then how tokens are picked (L7), and finally
# the arithmetic of memory: for serving, for training, and for each attention design (S1-S3).

# %%
import matplotlib.pyplot as plt
import numpy as np

from refmath.attention import local_window_mask, sdpa_forward
from refmath.flash import FlashCounters, flash_attention_forward
from refmath.inference.generate import (
    generate,
    next_token_distribution,
    sample_token,
    top_k_filter,
    top_p_filter,
)
from refmath.inference.kv_cache import decode_step, generate_cached, prefill
from refmath.inference.paged import PagedKVCache
from refmath.inference.quantized import (
    QuantizedKVCache,
    decode_with_quantized_cache,
    dequantize,
    quantize,
)
from refmath.models import decoder, mla
from refmath.norms import rmsnorm_forward
from refmath.positions import rope_forward
from refmath.sizing import (
    PRESETS,
    adamw_training_memory,
    attention_cache_rows,
    decode_step_flops,
    format_bytes,
    inference_memory_rule_of_thumb,
    kv_cache_bytes,
    mla_cache_bytes,
    parameter_counts,
    quantized_kv_cache_bytes,
)
from refmath.softmax import softmax_forward

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)

# %% [markdown]
# ## A11: the stable softmax, and a row with nothing to attend to
#
# `softmax(s)_j = e^{s_j} / sum_u e^{s_u}` does not change when the same constant is added to
# every score: the factor `e^c` cancels. So we subtract the row maximum `m` first. Every
# exponent is then at most 0, no exponential can overflow, and the largest term is exactly
# `e^0 = 1`, so the denominator is at least 1.
#
# For scores `(1, 2, 3)`: shifted `(-2, -1, 0)`, exponentials `(0.1353, 0.3679, 1)`, sum `1.5032`,
# weights `(0.0900, 0.2447, 0.6652)`. Adding 1000 to every score changes nothing in the stable form,
# while the plain formula overflows even in float64 (`e^1003` is about `10^435`).

# %%
s = np.array([1.0, 2.0, 3.0])
shifted = np.exp(s - s.max())
print("e^(s - m) =", shifted, " sum =", shifted.sum(), " weights =", shifted / shifted.sum())
a, _ = softmax_forward(s)
a_big, _ = softmax_forward(s + 1000.0)
np.testing.assert_allclose(a, [0.0900, 0.2447, 0.6652], atol=1e-4)
np.testing.assert_allclose(a_big, a, rtol=1e-15)
with np.errstate(over="ignore", invalid="ignore"):
    plain = np.exp(s + 1000.0) / np.exp(s + 1000.0).sum()
print("plain formula at s + 1000:", plain, "  stable:", a_big)
assert np.isnan(plain).all()

# %% [markdown]
# A masked score is `-inf`. When a row is masked everywhere (a query with no visible key, such as
# a padded position in a batch), the maximum is itself `-inf` and `s - m = -inf - (-inf)` is NaN.
# Such a row has no distribution, so the library treats it explicitly: it returns a row of zeros
# (and zero gradient), and the attention output of that query is the zero vector rather than a
# NaN that would spread through the whole batch.

# %%
masked = np.array([[0.5, -np.inf, 2.0],
                   [-np.inf, -np.inf, -np.inf]])
with np.errstate(invalid="ignore"):
    m = masked.max(axis=1, keepdims=True)
    naive_rows = np.exp(masked - m) / np.exp(masked - m).sum(axis=1, keepdims=True)
print("naive:\n", naive_rows)
a, _ = softmax_forward(masked)
print("softmax_forward:\n", a)
assert np.isnan(naive_rows[1]).all()
np.testing.assert_array_equal(a[1], 0.0)
np.testing.assert_allclose(a[0].sum(), 1.0)

q, k, v = rng.standard_normal((2, 4)), rng.standard_normal((3, 4)), rng.standard_normal((3, 2))
o, _ = sdpa_forward(q, k, v, mask=np.where(np.isinf(masked), -np.inf, 0.0))
print("attention output, second query sees no key:", o[1])
np.testing.assert_array_equal(o[1], 0.0)

# %% [markdown]
# ## S4: why half precision needs the shift
#
# float16 has 5 exponent bits; its largest finite number is 65504, so `e^x` overflows as soon as
# `x > ln 65504 = 11.09`, and nothing in the formula keeps the scores below that. The plain
# formula then divides `inf` by `inf` and returns NaN; the shifted form never exponentiates
# anything above 0.

# %%
s16 = np.array([8.0, 10.0, 12.0], dtype=np.float16)
fp16_max = float(np.finfo(np.float16).max)
print("float16 max:", fp16_max, "  ln of it:", np.log(fp16_max))
with np.errstate(over="ignore", invalid="ignore"):
    e = np.exp(s16)
    naive16 = e / e.sum()
stable16, _ = softmax_forward(s16)
reference, _ = softmax_forward(s16.astype(np.float64))
print("exp in float16:", e, " naive softmax:", naive16)
print("stable float16 softmax:", stable16, " float64 reference:", reference)
assert np.isinf(e[2]) and np.isnan(naive16[2])
assert stable16.dtype == np.float16
np.testing.assert_allclose(stable16, reference, rtol=2e-3)

# %% [markdown]
# The picture: three scores `(x - 2, x - 1, x)` with the largest one `x` swept upwards. The plain
# float16 softmax is accurate (to float16 rounding) up to about `x = 10.7`. There the *sum*
# `e^x (1 + e^{-1} + e^{-2}) = 1.50 e^x` passes 65504 first: it becomes `inf` and every weight
# collapses to 0. Once `x` passes 11.09, `e^x` itself is `inf` and the largest weight is NaN
# (crosses at the top). The shifted form does not care how large `x` is.

# %%
tops = np.linspace(0.0, 16.0, 161)
naive_err, stable_err = [], []
for x in tops:
    row = np.array([x - 2.0, x - 1.0, x])
    ref, _ = softmax_forward(row)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(row.astype(np.float16))
        naive_err.append(np.abs(e / e.sum() - ref).max())
    stable_err.append(np.abs(softmax_forward(row.astype(np.float16))[0] - ref).max())
naive_err, stable_err = np.array(naive_err), np.array(stable_err)
broken = np.isnan(naive_err)
assert broken.any() and tops[broken].min() > np.log(65504) and not np.isnan(stable_err).any()
sum_overflows = (tops > 10.75) & (tops < 11.05)  # e^x finite, the sum of the three not
assert np.all(naive_err[sum_overflows] > 0.5) and np.all(naive_err[tops < 10.5] < 2e-3)

fig, ax = plt.subplots(figsize=(5.5, 3.2), layout="constrained")
ax.semilogy(tops[~broken], naive_err[~broken] + 1e-7, label="plain exp / sum in float16")
ax.semilogy(tops, stable_err + 1e-7, "--", label="max subtracted, float16")
ax.plot(tops[broken], np.full(broken.sum(), 1.0), "rx", ms=4, label="NaN")
ax.axvline(np.log(65504), color="gray", lw=0.8)
ax.set(xlabel="largest score x", ylabel="max error vs float64 (+1e-7)",
       title="float16 softmax: overflow at x = ln 65504")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The shift fixes the exponentials, not the sum. Over a long row, a running sum kept in float16
# stops growing once it is large next to each new term (at 32, float16 numbers are 1/32 apart, so
# adding anything below 1/64 does nothing). That is why kernels keep `l = sum e^{s - m}` in float32
# even when the scores are in half precision. Here the row has 4096 scores, most of whose terms
# `e^{s - m}` are far below 1/64: the float16 running sum stalls several percent short.

# %%
scores = 2.0 * rng.standard_normal(4096)
terms16 = np.exp((scores - scores.max()).astype(np.float16))
exact_sum = np.exp(scores - scores.max()).sum()
running16 = np.cumsum(terms16, dtype=np.float16)[-1]  # one term after another, as a loop would
running32 = np.cumsum(terms16, dtype=np.float32)[-1]
print(f"exact {exact_sum:.4f}   running float16 sum {running16:.4f}   "
      f"running float32 sum {running32:.4f}")
rel16, rel32 = abs(running16 - exact_sum) / exact_sum, abs(running32 - exact_sum) / exact_sum
assert rel16 > 0.05 and rel32 < 0.001

# %% [markdown]
# ## A12: a sliding window
#
# In a local (sliding-window) causal mask, query `i` sees key `j` only when `i - w + 1 <= j <= i`
# (0-based): itself and the `w - 1` tokens before it. For `T = 6`, `w = 3` the visible pairs number
# `1 + 2 + 3 + 3 + 3 + 3 = 15`, that is `w(w+1)/2 + (T - w) w`, against `T(T+1)/2 = 21` for the
# full causal mask. For long sequences that is `O(T w)` instead of `O(T^2)`.

# %%
T, w = 6, 3
mask = local_window_mask(T, w)
print((mask == 0).astype(int))
visible = int(np.count_nonzero(mask == 0))
assert visible == w * (w + 1) // 2 + (T - w) * w == 15

# %% [markdown]
# The mask alone only changes the result; to save work a kernel has to skip the hidden pairs.
# `flash_attention_forward(..., window=w)` does that by tiles: for each tile of queries it visits
# only the key tiles that hold at least one visible pair. In the picture, each square is one
# `8 x 8` tile of the `48 x 48` score matrix for `w = 16`: dark tiles lie wholly inside the band,
# light ones are cut by its edges (masked inside), white ones are never touched. The counters
# confirm the tally, and the output equals dense attention with the same mask.

# %%
T, w, block, D = 48, 16, 8, 8
q, k, v = (rng.standard_normal((1, 1, T, D)) for _ in range(3))
counters = FlashCounters()
o, _ = flash_attention_forward(q, k, v, window=w, block_q=block, block_k=block, counters=counters)
dense, _ = sdpa_forward(q, k, v, mask=local_window_mask(T, w))
np.testing.assert_allclose(o, dense, rtol=1e-12, atol=1e-14)

allowed = local_window_mask(T, w) == 0
n = T // block
per_tile = allowed.reshape(n, block, n, block).sum(axis=(1, 3))
tile_state = np.where(per_tile == 0, 0, np.where(per_tile == block * block, 2, 1))
print(f"{counters.tiles_computed} tiles computed, {counters.tiles_skipped} skipped, "
      f"{counters.score_pairs} scores evaluated for {allowed.sum()} visible pairs")
assert counters.tiles_computed == np.count_nonzero(tile_state)
assert counters.tiles_skipped == np.count_nonzero(tile_state == 0)

fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.4), layout="constrained")
axes[0].imshow(allowed, cmap="Greys")
axes[0].set(title=f"visible pairs, T = {T}, w = {w}", xlabel="key j", ylabel="query i")
axes[1].imshow(tile_state, cmap="Blues", vmin=0, vmax=2)
axes[1].set(title=f"{block} x {block} tiles: skipped / cut / full", xlabel="key tile",
            ylabel="query tile")
for ax in axes[:1]:
    for edge in range(0, T + 1, block):
        ax.axhline(edge - 0.5, color="tab:blue", lw=0.4)
        ax.axvline(edge - 0.5, color="tab:blue", lw=0.4)
plt.show()

# %% [markdown]
# The same at larger sizes: with the window fixed at 32, the scores evaluated grow linearly in `T`;
# with a plain causal mask they grow like `T^2 / 2`. The counted scores include the masked pairs
# inside cut tiles, so here they are about 1.5 times the visible pairs: with 16-wide tiles and
# `w = 32` each query tile touches three key tiles (the first two tiles touch one and two), `48`
# keys per query where `32` are visible. That is `16 * 16 * (3 T / 16 - 3)` scores, still `O(T w)`.

# %%
lengths = [64, 128, 256, 512]
win_pairs, causal_pairs = [], []
for T in lengths:
    q, k, v = (rng.standard_normal((1, 1, T, 8)) for _ in range(3))
    for store, options in ((win_pairs, dict(window=32)), (causal_pairs, dict(causal=True))):
        c = FlashCounters()
        flash_attention_forward(q, k, v, block_q=16, block_k=16, counters=c, **options)
        store.append(c.score_pairs)
for T, pw, pc in zip(lengths, win_pairs, causal_pairs):
    pv = 32 * 33 // 2 + (T - 32) * 32
    print(f"T = {T:4d}: window 32 -> {pw:6d} scores (visible {pv:6d}, ratio {pw / pv:.2f}), "
          f"causal -> {pc:6d}")
# doubling T doubles the windowed work (up to the constant first block) and quadruples the causal
assert win_pairs[-1] - win_pairs[-2] == 2 * (win_pairs[-2] - win_pairs[-3])
assert win_pairs == [16 * 16 * (3 * (T // 16) - 3) for T in lengths]
visible_pairs = [32 * 33 // 2 + (T - 32) * 32 for T in lengths]
assert all(1.45 < pw / pv < 1.5 for pw, pv in zip(win_pairs, visible_pairs))
assert 3.5 < causal_pairs[-1] / causal_pairs[-2] < 4.0

fig, ax = plt.subplots(figsize=(5, 3), layout="constrained")
ax.plot(lengths, causal_pairs, "o-", label="causal")
ax.plot(lengths, win_pairs, "s-", label="sliding window, w = 32")
ax.set(xlabel="sequence length T", ylabel="scores evaluated (one head)",
       title="O(T^2) against O(T w)")
ax.legend()
plt.show()

# %% [markdown]
# ## K3: RoPE keys are cached after their rotation
#
# With rotary positions, the key of token `j` is rotated by the angle `j omega` before it is used.
# A score only sees the difference of the two rotations, `q_t R(t omega)^T (k_j R(j omega)^T)^T =
# q_t R((j - t) omega) k_j^T`, so the rotation of key `j` never needs to change: it is rotated once,
# at its own position, when it enters the cache. At decode step `t` only the new query and the new
# key are rotated, both by `t omega`. Caching unrotated keys would instead cost a rotation of all
# `t` keys at every step.
#
# Below, a tiny decoder (2 layers, 4 query heads, 2 key/value heads of width 16) prefills 3 tokens
# and decodes 3 more. Layer 0's keys can be rebuilt by hand: normalise the embeddings, project with
# `W_K`, split into heads, rotate row `j` by position `j`.

# %%
config = decoder.preset("tiny", max_seq_len=32)
params = decoder.init_params(config, seed=0)
tokens = np.array([[5, 17, 42, 7, 99, 3]])
_, cache = prefill(decoder, params, config, tokens[:, :3])
keys_after_prefill = cache.layer(0)[0].copy()
for t in range(3, 6):
    decode_step(decoder, params, config, cache, tokens[:, t])

u, _ = rmsnorm_forward(params["tok_emb"][tokens], params["layers.0.ln1.gamma"], config.norm_eps)
raw = (u @ params["layers.0.attn.w_k"]).reshape(1, 6, config.kv_heads, config.d_h)
raw = raw.transpose(0, 2, 1, 3)  # (B, g, T, d_h), not yet rotated
rotated, _ = rope_forward(raw, base=config.rope_base)  # row j rotated by position j
cached_keys = cache.layer(0)[0]
np.testing.assert_allclose(cached_keys, rotated, rtol=1e-12, atol=1e-15)
# once written, a key never changes: the first three rows are exactly those of the prefill
np.testing.assert_array_equal(cached_keys[:, :, :3], keys_after_prefill)
print("cached key, head 0, position 4:", cached_keys[0, 0, 4, :4], "...")
print("the same key unrotated:        ", raw[0, 0, 4, :4], "...")
assert not np.allclose(cached_keys[0, 0, 4], raw[0, 0, 4])

# %% [markdown]
# ## K5: the prompt is quadratic, each new token linear
#
# Prefilling a prompt of `P` tokens is one causal pass: query `i` meets keys `0..i`, so
# `1 + 2 + ... + P = P(P+1)/2` visible pairs per head and layer, `O(P^2)`. (The reference computes
# the whole `P x P` score matrix and masks it, `P^2` scores; a causal kernel skips the upper
# triangle.) A decode step at position `t` has one query and `t + 1` keys: `O(t h d_h)` work per
# layer, linear in the context.

# %%
P = 5
_, cache = prefill(decoder, params, config, tokens[:, :P])
print("after a prefill of 5: visible pairs per head, per layer", cache.counts.visible,
      " scores computed", cache.counts.scores)
assert cache.counts.visible == [P * (P + 1) // 2] * config.n_layers == [15, 15]
assert cache.counts.scores == [P * P] * config.n_layers
decode_step(decoder, params, config, cache, tokens[:, P])
print("after one decode step:", cache.counts.visible)
assert cache.counts.visible == [15 + 6] * config.n_layers

measured = [prefill(decoder, params, config, np.zeros((1, p), dtype=np.int64))[1].counts.visible[0]
            for p in range(1, 17)]
assert measured == [p * (p + 1) // 2 for p in range(1, 17)]

# %% [markdown]
# At full size the weights dominate a decode step at first: every token passes through all the
# projections and the feed-forward layers whatever the context. `decode_step_flops` counts both
# parts (2 FLOPs per multiply-add) for Llama-3-8B's shape: the weights cost about 15 GFLOP per
# token, the attention `4 L h d_h = 0.52` MFLOP per cached token, so attention overtakes the
# weights near 29k tokens of context. Mistral-7B's sliding window of 4096 caps the attention term:
# past the window, each step costs the same.

# %%
llama, mistral = PRESETS["llama-3-8b"], PRESETS["mistral-7b"]
contexts = np.linspace(1, 65536, 257).astype(int)
llama_steps = [decode_step_flops(llama, int(t)) for t in contexts]
mistral_steps = [decode_step_flops(mistral, int(t)) for t in contexts]
per_key = 4 * llama.layers * llama.heads * llama.head_dim
crossover = llama_steps[0].weights / per_key
print(f"Llama-3-8B: weights {llama_steps[0].weights / 1e9:.2f} GFLOP per token, attention "
      f"{per_key / 1e6:.3f} MFLOP per cached token; equal at t = {crossover:.0f}")
assert all(f.attention == per_key * t for f, t in zip(llama_steps, contexts))
assert mistral_steps[-1].attention == per_key * 4096

fig, axes = plt.subplots(1, 2, figsize=(9, 3.3), layout="constrained")
p_axis = np.arange(1, 17)
axes[0].plot(p_axis, measured, "o", label="counted in prefill")
axes[0].plot(p_axis, p_axis * (p_axis + 1) / 2, "-", label="P(P+1)/2")
axes[0].set(xlabel="prompt length P", ylabel="visible pairs (one head, one layer)",
            title="prefill: quadratic")
axes[0].legend()
axes[1].plot(contexts, [f.total / 1e9 for f in llama_steps], label="Llama-3-8B")
axes[1].plot(contexts, [f.total / 1e9 for f in mistral_steps], label="Mistral-7B (window 4096)")
axes[1].axhline(llama_steps[0].weights / 1e9, color="gray", ls=":", label="Llama weights alone")
axes[1].set(xlabel="context t", ylabel="GFLOP per decode step", title="decode: linear in t")
axes[1].legend(fontsize=8)
plt.show()

# %% [markdown]
# ## K8: latent attention can score against the cache without expanding it
#
# Multi-head latent attention (MLA) projects each token to one short latent row `c_j = x_j W_DKV`
# (width `d_c`), and makes every head's key and value from it: `k_j = c_j W_UK`, `v_j = c_j W_UV`.
# Two regroupings of the products remove the expansion:
#
# - scores: `q k_j^T = q (c_j W_UK)^T = (q W_UK^T) c_j^T`. With `q_hat = q W_UK^T` (width `d_c`,
#   computed once per step) each score is a dot product with the cached latent itself;
# - values: `sum_j a_j v_j = sum_j a_j c_j W_UV = (sum_j a_j c_j) W_UV`: one up-projection per
#   head per step, instead of one per cached token.
#
# On integers the regrouped products agree exactly: four cached latents of width 3, one head with
# `d_k = d_v = 2` (the algebra only; the model is checked next).

# %%
c_lat = rng.integers(-2, 3, size=(4, 3)).astype(float)
W_UK = rng.integers(-2, 3, size=(3, 2)).astype(float)
W_UV = rng.integers(-2, 3, size=(3, 2)).astype(float)
q_c = np.array([[1.0, -1.0]])
expanded_scores = q_c @ (c_lat @ W_UK).T
q_hat = q_c @ W_UK.T
absorbed_scores = q_hat @ c_lat.T
print("q (c W_UK)^T =", expanded_scores, "  (q W_UK^T) c^T =", absorbed_scores)
np.testing.assert_array_equal(expanded_scores, absorbed_scores)
weights, _ = softmax_forward(expanded_scores / np.sqrt(2))
np.testing.assert_allclose(weights @ (c_lat @ W_UV), (weights @ c_lat) @ W_UV, rtol=1e-14)

# %% [markdown]
# The MLA model decodes either way (`mla_path="expanded"` or `"absorbed"`). From the same prompt,
# every step gives the same logits to float64 rounding. Per cached token, the expanded path builds
# `h (d_k + d_v)` numbers at every step; the absorbed one reads the `d_c + d_R` that are stored.

# %%
mla_config = mla.preset("tiny", max_seq_len=32)
mla_params = mla.init_params(mla_config, seed=0)
prompt = np.array([[11, 200, 3]])
z_abs, cache_abs = prefill(mla, mla_params, mla_config, prompt, mla_path="absorbed")
z_exp, cache_exp = prefill(mla, mla_params, mla_config, prompt, mla_path="expanded")
worst = np.abs(z_abs - z_exp).max()
for token in (8, 64, 150, 9):
    ids = np.array([token])
    z_abs = decode_step(mla, mla_params, mla_config, cache_abs, ids, mla_path="absorbed")
    z_exp = decode_step(mla, mla_params, mla_config, cache_exp, ids, mla_path="expanded")
    worst = max(worst, np.abs(z_abs - z_exp).max())
print(f"largest logit difference over the prompt and 4 steps: {worst:.1e} "
      f"(logits are of size {np.abs(z_abs).max():.2f})")
assert worst < 1e-12
h, d_k, d_v = mla_config.n_heads, mla_config.d_k, mla_config.d_v
print(f"numbers per cached token and layer: expanded {h * (d_k + d_v)}, "
      f"absorbed {mla_config.d_c + mla_config.d_rope}")

# %% [markdown]
# ## K9: what MLA caches
#
# RoPE cannot be applied to `k = c W_UK`: the score would become `q R_t^T R_j W_UK^T c_j^T`, with a
# rotation that depends on the key's position `j` between `q` and `W_UK^T`, so no single `q_hat`
# could serve every cached token. MLA therefore adds a small separate rotary part: each
# head's query gets `q^R` (width `d_R`), and each token one rotary key `k^R_j`, rotated at its own
# position (K3) and **shared by all heads**. The score is
# `(q^C k^C^T + q^R k^R^T) / sqrt(d_k + d_R)`, and the cache holds, per token and layer, only the
# latent `c_j` and `k^R_j`:
#
# `M_MLA = B L T (d_c + d_R) b` bytes.
#
# For the tiny model, `d_c = 32` and `d_R = 8`: 40 numbers per token and layer, against
# `2 h d_h = 128` for multi-head attention with the same heads.

# %%
c_cached, kr_cached = cache_abs.layer(0)
print("layer 0 holds latents", c_cached.shape, "and rotary keys", kr_cached.shape, "(no head axis)")
u, _ = rmsnorm_forward(mla_params["tok_emb"][np.array([[11, 200, 3, 8, 64, 150, 9]])],
                       mla_params["layers.0.ln1.gamma"], mla_config.norm_eps)
np.testing.assert_allclose(c_cached, u @ mla_params["layers.0.attn.w_dkv"], rtol=1e-12, atol=1e-15)
rope_keys_by_hand, _ = rope_forward(u @ mla_params["layers.0.attn.w_kr"], base=mla_config.rope_base)
np.testing.assert_allclose(kr_cached, rope_keys_by_hand, rtol=1e-12, atol=1e-15)

slots = cache_abs.max_len
expected = mla_cache_bytes(batch=1, layers=mla_config.n_layers, tokens=slots,
                           latent_dim=mla_config.d_c, rope_dim=mla_config.d_rope,
                           bytes_per_element=8)
print(f"cache storage for {slots} slots in float64: {cache_abs.nbytes} bytes = B L T (d_c + d_R) b "
      f"= 1 * {mla_config.n_layers} * {slots} * {mla_config.d_c + mla_config.d_rope} * 8")
assert cache_abs.nbytes == expected == 1 * 2 * 32 * 40 * 8
mha_equivalent = kv_cache_bytes(1, mla_config.n_layers, slots, mla_config.n_heads, d_k, 8)
print(f"MHA with the same heads: {mha_equivalent} bytes ({mha_equivalent / expected:.1f}x)")
# the same count from arrays: keys and values, (B, h, T, d_k) each, in every layer
mha_arrays = [np.zeros((1, h, slots, d_k)) for _ in range(2 * mla_config.n_layers)]
assert mha_equivalent == sum(a.nbytes for a in mha_arrays)
assert mha_equivalent / cache_abs.nbytes == 2 * h * d_k / (mla_config.d_c + mla_config.d_rope)
assert mha_equivalent / cache_abs.nbytes == 128 / 40 == 3.2

# %% [markdown]
# ## S3: how much each attention design saves, computed
#
# A rule of thumb says GQA cuts the key/value heads by 4-8x and MLA caches roughly 5-10x less than
# multi-head attention. The calculator gives exact figures instead. For a model with `h` heads of
# width `d_h`, per token and layer, MHA caches `2 h d_h` numbers, GQA `2 g d_h`, MQA `2 d_h`, MLA
# `d_c + d_R`.
#
# Llama-3-8B has `h = 32` and `g = 8`: its GQA cache is 4x smaller than MHA's, the low end of the
# claim. Llama does not use MLA; the calculator's MLA row for it is a hypothetical one with
# DeepSeek-V2's proportions `d_c = 4 d_h`, `d_R = d_h / 2` (14.2x smaller than MHA at this shape).
#
# For DeepSeek-V2's attention shape (`L = 60`, `h = 128`, `d_h = 128`, `d_c = 512`, `d_R = 64`) the
# MLA cache is `576` numbers per token and layer against `2 * 128 * 128 = 32768` for MHA of the same
# shape: a ratio of `512/9 = 56.9`, well outside the quoted 5-10x. The ratio depends entirely on the
# baseline: against GQA with 8 key/value heads of the same width (`2048` numbers) it is 3.6x. MLA's
# 576 numbers are what GQA would store with 2.25 key/value heads.

# %%
for name in ("llama-3-8b", "deepseek-v2"):
    c = PRESETS[name]
    rows = attention_cache_rows(c.layers, c.heads, c.kv_heads, c.head_dim, tokens=8192,
                                latent_dim=c.latent_dim, rope_dim=c.rope_dim)
    mha = rows[0].total
    print(f"{name} at T = 8192, bf16:")
    for row in rows:
        print(f"   {row.label:24s} {format_bytes(row.total):>11s}   "
              f"MHA / this = {mha / row.total:6.2f}")

ds = PRESETS["deepseek-v2"]
ds_rows = {r.kind: r for r in attention_cache_rows(ds.layers, ds.heads, ds.kv_heads, ds.head_dim,
                                                   8192, latent_dim=ds.latent_dim,
                                                   rope_dim=ds.rope_dim)}
ratio = ds_rows["MHA"].total / ds_rows["MLA"].total
gqa8 = kv_cache_bytes(1, ds.layers, 8192, 8, ds.head_dim, 2)
print(f"DeepSeek-V2 shape: MHA / MLA = {ratio:.2f}; "
      f"GQA (g=8) / MLA = {gqa8 / ds_rows['MLA'].total:.2f}")
assert abs(ratio - 512 / 9) < 1e-12 and not 5 <= ratio <= 10

llama_rows = {r.kind: r for r in attention_cache_rows(llama.layers, llama.heads, llama.kv_heads,
                                                      llama.head_dim, 8192)}
assert llama_rows["MHA"].total == 4 * llama_rows["GQA"].total  # h / g = 32 / 8

fig, ax = plt.subplots(figsize=(6, 3.2), layout="constrained")
labels = ["MHA (g=128)", "GQA (g=8)", "MLA", "MQA (g=1)"]
per_token = [ds_rows["MHA"].bytes_per_token, kv_cache_bytes(1, ds.layers, 1, 8, ds.head_dim, 2),
             ds_rows["MLA"].bytes_per_token, ds_rows["MQA"].bytes_per_token]
ax.bar(labels, [b / 1024 for b in per_token],
       color=["tab:red", "tab:orange", "tab:green", "tab:blue"])
ax.set(yscale="log", ylabel="KiB per token (all 60 layers, bf16)",
       title="DeepSeek-V2's attention shape: cache per token")
for i, b in enumerate(per_token):
    ax.text(i, b / 1024, f"{b / 1024:.0f}", ha="center", va="bottom")
plt.show()

# %% [markdown]
# ## K11: sharing a prompt between sequences, and copying on write
#
# In a paged cache (lesson 3, K10) a sequence owns a table of page ids, not the pages themselves.
# So two sequences with the same prefix can point at the same pages: `fork` copies the page table
# and adds one to each page's reference count; no key or value moves. This is only correct when
# the child would have computed exactly the same keys and values: the same tokens at the same
# positions, with the same parameters and settings. The cache cannot check that; the caller must.
#
# Full pages are never written again, so they stay shared. The last page is usually part full;
# the first sequence to append to it while it is shared gets a private copy of its filled slots
# (copy on write) and drops one reference. Below: pages of 4 slots, a 6-token prompt in pages 0
# and 1 (page 1 half full), one fork, then one token appended by each sequence.

# %%
g, d, page = 1, 2, 4
pool = PagedKVCache(n_pages=6, page_size=page, n_kv_heads=g, head_dim=d)


def tokens_kv(values):
    """Keys and values (t, g, d) whose entries are the given token labels, easy to follow."""
    x = np.repeat(np.asarray(values, dtype=float)[:, None, None], d, axis=2)
    return x, -x


def snapshot(title):
    refs = [pool.allocator.refcount(p) for p in range(pool.allocator.n_pages)]
    owners = {p: [s for s in pool.seq_ids if p in pool.page_table(s)]
              for p in range(pool.allocator.n_pages)}
    print(f"{title:28s} tables {({s: pool.page_table(s) for s in pool.seq_ids})}  refcounts {refs}")
    return title, refs, owners


pool.add_sequence("A")
pool.append("A", *tokens_kv([1, 2, 3, 4, 5, 6]))
states = [snapshot("prompt of 6 in A")]
pool.fork("A", "B")
states.append(snapshot("fork A -> B"))
assert pool.page_table("B") == pool.page_table("A") == [0, 1]
assert [pool.allocator.refcount(p) for p in (0, 1)] == [2, 2]

pool.append("B", *tokens_kv([70]))  # page 1 is shared and part full: B copies it first
states.append(snapshot("B appends token 70"))
assert pool.page_table("B") == [0, 2] and pool.allocator.refcount(1) == 1
pool.append("A", *tokens_kv([7]))  # page 1 is A's alone now: written in place, no copy
states.append(snapshot("A appends token 7"))
assert pool.page_table("A") == [0, 1] and pool.pages_used == 3

print("A's keys:", pool.gather("A")[0][:, 0, 0], "  B's keys:", pool.gather("B")[0][:, 0, 0])
np.testing.assert_array_equal(pool.gather("A")[0][:, 0, 0], [1, 2, 3, 4, 5, 6, 7])
np.testing.assert_array_equal(pool.gather("B")[0][:, 0, 0], [1, 2, 3, 4, 5, 6, 70])

fig, axes = plt.subplots(len(states), 1, figsize=(6.5, 4.2), layout="constrained")
for ax, (title, refs, owners) in zip(axes, states):
    ax.imshow(np.array(refs)[None, :], cmap="Greens", vmin=0, vmax=2.5)
    for p, r in enumerate(refs):
        ax.text(p, 0, f"page {p}\n{'+'.join(owners[p]) or 'free'}", ha="center", va="center",
                fontsize=8)
    ax.set(xticks=[], yticks=[])
    ax.set_title(title, fontsize=9, loc="left")
fig.suptitle("the page pool; darker = more references", fontsize=10)
plt.show()

# %% [markdown]
# When the shared prefix ends exactly at a page boundary there is nothing to copy: the child's
# next token starts a fresh page of its own, and both full pages stay shared.

# %%
aligned = PagedKVCache(n_pages=4, page_size=4, n_kv_heads=1, head_dim=2)
aligned.add_sequence("A")
aligned.append("A", *tokens_kv(range(1, 9)))
aligned.fork("A", "B")
aligned.append("B", *tokens_kv([90]))
refs = [aligned.allocator.refcount(p) for p in range(4)]
print("tables", {s: aligned.page_table(s) for s in ("A", "B")}, " refcounts", refs)
assert aligned.page_table("B") == [0, 1, 2] and refs == [2, 2, 1, 0]

# %% [markdown]
# At serving size: 16 samples drawn from one 1000-token prompt with pages of 16 tokens. Without
# sharing, each sample stores the prompt itself: `16 * ceil(1000 / 16) = 1008` pages (its first
# new token still fits in the part-full last page). With sharing, the 62 full pages are stored
# once and the part-full last page is copied by each of the 15 forks that appends to it first
# (the original keeps it), `63 + 15 = 78` pages.

# %%
big = PagedKVCache(n_pages=1100, page_size=16, n_kv_heads=1, head_dim=2)
big.add_sequence(0)
big.append(0, *tokens_kv(np.arange(1000)))
for child in range(1, 16):
    big.fork(0, child)
for seq in range(15, -1, -1):  # every sample appends its first token; the original goes last
    big.append(seq, *tokens_kv([1000 + seq]))
unshared = PagedKVCache(n_pages=1100, page_size=16, n_kv_heads=1, head_dim=2)
for seq in range(16):  # the same samples, each storing its own copy of the prompt
    unshared.add_sequence(seq)
    unshared.append(seq, *tokens_kv(np.arange(1000)))
    unshared.append(seq, *tokens_kv([1000 + seq]))
print(f"pages used with sharing: {big.pages_used}; without: {unshared.pages_used}")
assert big.pages_used == 63 + 15
assert unshared.pages_used == 16 * -(-1000 // 16) == 1008

# %% [markdown]
# ## K12: a cache of small integers
#
# A symmetric quantiser stores each group of `G` consecutive numbers as integers in
# `[-q_max, q_max]` (`q_max = 2^{q-1} - 1`: 127 for 8 bits, 7 for 4 bits) and one scale:
#
# `s = max|x| / q_max`, `c_i = clip(round(x_i / s), -q_max, q_max)`, `x_hat_i = s c_i`.
#
# Rounding to the nearest integer is off by at most one half, so `|x_i - x_hat_i| <= s / 2`: half
# a step. By hand, 4 bits, one group `x = (3.5, -1.2, 0.3, 2.0)`: `s = 3.5 / 7 = 0.5`,
# `x / s = (7, -2.4, 0.6, 4)`, codes `(7, -2, 1, 4)`, `x_hat = (3.5, -1, 0.5, 2)`, errors
# `(0, 0.2, 0.2, 0)`, all at most `0.25`.

# %%
x = np.array([3.5, -1.2, 0.3, 2.0])
qt = quantize(x, bits=4, group_size=4)
print("scale", qt.scales, " codes", qt.codes(), " x_hat", dequantize(qt))
assert qt.scales[0] == 0.5
np.testing.assert_array_equal(qt.codes(), [7, -2, 1, 4])
np.testing.assert_allclose(dequantize(qt), [3.5, -1.0, 0.5, 2.0])
assert np.all(np.abs(x - dequantize(qt)) <= 0.25)
print("4 codes take", qt.payload_bytes, "bytes (two per byte) plus", qt.scale_bytes,
      "bytes of float16 scale")

# %% [markdown]
# Smaller groups mean smaller scales (a group's scale is set by its largest entry), hence smaller
# errors, but more scales to store: each costs 2 bytes, `2 / G` bytes per element on top of the
# `q / 8` of the payload. Published measurements of trained models report keys with a few outlier
# channels; here we plant such channels: 4 of the 128 are 10 times larger than the rest, and only
# the groups that contain them get coarse steps. The bound `|x - x_hat| <= s / 2` holds for every
# element and every group size.

# %%
kv = rng.standard_normal((1, 4, 256, 128))
kv[..., [5, 40, 77, 100]] *= 10.0
group_sizes = [4, 8, 16, 32, 64, 128]
results = {}
for bits in (8, 4):
    errors, overhead = [], []
    for G in group_sizes:
        qt = quantize(kv, bits=bits, group_size=G)
        err = np.abs(kv - dequantize(qt))
        assert np.all(err <= qt.element_scales() / 2 * (1 + 1e-12))
        errors.append(err.mean())
        overhead.append(qt.nbytes / kv.size)
    results[bits] = errors, overhead
    print(f"int{bits}: mean |error| for G = {group_sizes}:",
          "  ".join(f"{e:.4f}" for e in errors))
assert all(np.diff(results[8][0]) > 0) and all(np.diff(results[4][0]) > 0)

fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), layout="constrained")
for bits, (errors, overhead) in results.items():
    axes[0].plot(group_sizes, errors, "o-", label=f"int{bits}")
    axes[1].plot(group_sizes, overhead, "o-", label=f"int{bits}")
assert results[8][1][group_sizes.index(32)] == 1 + 2 / 32  # q/8 + 2/G bytes per element
axes[0].set(xscale="log", yscale="log", xlabel="group size G", ylabel="mean |x - x_hat|",
            title="round-trip error")
axes[1].axhline(2, color="gray", ls=":", label="float16")
axes[1].set(xscale="log", xlabel="group size G", ylabel="bytes per element",
            title="payload q/8 + scales 2/G")
for ax in axes:
    ax.set_xticks(group_sizes, [str(G) for G in group_sizes])
    ax.legend(loc="center right")
plt.show()

# %% [markdown]
# An error in a key moves the scores, `q (k - k_hat)^T / sqrt(d_h)`; an error in a value moves the
# weighted sum directly: the weights are at least 0 and add up to 1, so the output moves by at
# most the largest value error, `max s / 2`. Here one new query per head against 64 cached tokens,
# measured against float64: with only the keys dequantised, with only the values dequantised, and
# with both, as `decode_with_quantized_cache` attends over the cache.

# %%
B, g_kv, T_c, d_h, h_q = 1, 2, 64, 32, 4
K_c, V_c = rng.standard_normal((B, g_kv, T_c, d_h)), rng.standard_normal((B, g_kv, T_c, d_h))
q_new = rng.standard_normal((B, h_q, 1, d_h))
heads = np.arange(h_q) // (h_q // g_kv)
exact_o, _ = sdpa_forward(q_new, K_c[:, heads], V_c[:, heads])
for bits in (8, 4):
    qcache = QuantizedKVCache(n_layers=1, bits=bits, group_size=8)
    qcache.append(0, K_c, V_c)
    o_q = decode_with_quantized_cache(q_new, qcache, 0)
    o_k_only, _ = sdpa_forward(q_new, qcache.keys(0)[:, heads], V_c[:, heads])
    o_v_only, _ = sdpa_forward(q_new, K_c[:, heads], qcache.values(0)[:, heads])
    k_err = (K_c - qcache.keys(0))[:, heads]  # (B, h, T, d_h): each query head's key errors
    score_err = np.abs(q_new @ k_err.swapaxes(-1, -2)).max() / np.sqrt(d_h)
    err_k, err_v, err_kv = (np.abs(o - exact_o).max() for o in (o_k_only, o_v_only, o_q))
    print(f"int{bits}: largest score error {score_err:.2e}; largest output error with keys "
          f"only {err_k:.2e}, values only {err_v:.2e}, both {err_kv:.2e}")
    bound = (np.abs(q_new) @ (qcache.quantized_keys(0).element_scales() / 2)[:, heads]
             .swapaxes(-1, -2)).max() / np.sqrt(d_h)
    assert score_err <= bound
    assert err_v <= (qcache.quantized_values(0).element_scales() / 2).max()

# %% [markdown]
# The bytes: the payload is `2 B L T g d_h q / 8` and each group adds a scale. `QuantizedKVCache`
# stores exactly what `quantized_kv_cache_bytes` predicts. At the shape of lesson 3's worked table
# with GQA (`L = 32, T = 8192, g = 8, d_h = 128`), float16 takes 1 GiB; int8 with groups of 32
# takes 512 MiB of payload and 32 MiB of scales, int4 half the payload again.

# %%
qcache = QuantizedKVCache(n_layers=2, bits=4, group_size=8)
for layer in range(2):
    qcache.append(layer, rng.standard_normal((1, 2, 16, 32)), rng.standard_normal((1, 2, 16, 32)))
predicted = quantized_kv_cache_bytes(batch=1, layers=2, tokens=16, kv_heads=2, head_dim=32,
                                     bits=4, group_size=8)
print(f"small int4 cache: stored {qcache.payload_bytes} + {qcache.scale_bytes} bytes, "
      f"predicted {predicted.payload} + {predicted.scales}")
assert (qcache.payload_bytes, qcache.scale_bytes) == (predicted.payload, predicted.scales)

full16 = kv_cache_bytes(1, 32, 8192, 8, 128, 2)
print("float16:", format_bytes(full16))
for bits in (8, 4):
    b = quantized_kv_cache_bytes(1, 32, 8192, 8, 128, bits=bits, group_size=32)
    print(f"int{bits}, G = 32: payload {format_bytes(b.payload)} + scales {format_bytes(b.scales)} "
          f"= {format_bytes(b.total)} ({full16 / b.total:.2f}x smaller)")
assert quantized_kv_cache_bytes(1, 32, 8192, 8, 128, 8, 32).payload == full16 // 2

# %% [markdown]
# ## L7: picking the next token
#
# Generation repeats `a_{t+1} ~ pi(. | a_1 .. a_t)`. From the last position's logits `z`:
#
# - greedy takes `argmax z`;
# - temperature `tau` samples from `softmax(z / tau)`: `tau < 1` sharpens, `tau > 1` flattens;
# - top-k keeps the `k` most probable tokens and renormalises;
# - top-p (nucleus) keeps the most probable tokens, in order, until their mass reaches `p`.
#
# By hand, with `pi = (0.5, 0.2, 0.15, 0.1, 0.05)`: top-2 keeps `(0.5, 0.2) / 0.7 = (0.714, 0.286)`.
# Top-p with `p = 0.8`: the masses before each token are `0, 0.5, 0.7, 0.85, 0.95`; tokens whose
# preceding mass is below 0.8 are kept, the first three, renormalised by 0.85 to
# `(0.588, 0.235, 0.176)`.

# %%
pi = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
z = np.log(pi)
dists = {
    "pi = softmax(z)": next_token_distribution(z),
    "tau = 0.5": next_token_distribution(z, temperature=0.5),
    "tau = 2": next_token_distribution(z, temperature=2.0),
    "top-k, k = 2": top_k_filter(pi, 2),
    "top-p, p = 0.8": top_p_filter(pi, 0.8),
}
for name, dist in dists.items():
    print(f"{name:15s}", dist)
np.testing.assert_allclose(dists["pi = softmax(z)"], pi, rtol=1e-14)
np.testing.assert_allclose(dists["tau = 0.5"], pi**2 / (pi**2).sum(), rtol=1e-14)
np.testing.assert_allclose(dists["top-k, k = 2"], [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0], rtol=1e-14)
np.testing.assert_allclose(dists["top-p, p = 0.8"], [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0],
                           rtol=1e-14)

fig, axes = plt.subplots(1, len(dists), figsize=(11, 2.6), sharey=True, layout="constrained")
for ax, (name, dist) in zip(axes, dists.items()):
    ax.bar(range(5), dist, color="tab:blue")
    ax.set(title=name, xticks=range(5), xlabel="token")
axes[0].set_ylabel("probability")
plt.show()

# %% [markdown]
# A sampler draws a uniform number `u` and returns the first token whose cumulative probability
# exceeds it. With a seeded generator the draws are repeatable, and their frequencies approach the
# filtered distribution; a token that top-p removed is never drawn.

# %%
draws_rng = np.random.default_rng(1)
draws = np.array([sample_token(dists["top-p, p = 0.8"], draws_rng) for _ in range(4000)])
freq = np.bincount(draws, minlength=5) / draws.size
print("frequencies over 4000 draws:", freq)
assert freq[3] == freq[4] == 0
np.testing.assert_allclose(freq, dists["top-p, p = 0.8"], atol=0.03)

# %% [markdown]
# With a model: the tiny decoder from K3 (untrained, so its tokens mean nothing, but the rules are
# the same). Greedy ignores the seed; sampling with one seed gives one sequence every time, and
# the cached generator of lesson 3 draws the same tokens as the one that recomputes every prefix.

# %%
prompt = np.array([5, 17, 42])
greedy = generate(decoder, params, config, prompt, 6, greedy=True)
print("greedy:               ", greedy)
settings = (dict(temperature=0.7), dict(top_k=5), dict(top_p=0.9),
            dict(temperature=1.5, top_k=20, top_p=0.9))
for options in settings:
    first = generate(decoder, params, config, prompt, 6, seed=3, **options)
    again = generate(decoder, params, config, prompt, 6, seed=3, **options)
    cached = generate_cached(decoder, params, config, prompt, 6, seed=3, **options).tokens
    print(f"{str(options):45s}", first)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first, cached)
np.testing.assert_array_equal(generate(decoder, params, config, prompt, 6, greedy=True, seed=99),
                              greedy)

# %% [markdown]
# ## S1 and S2: memory for serving and for training
#
# Serving in bf16 or fp16 takes 2 bytes per parameter for the weights; a common **rule of thumb**
# adds about 20% for activations and the KV cache: `2P * 1.2`. It is a rough allowance, not a
# measurement. Training with AdamW in mixed precision keeps, per parameter, fp16 weights (2 bytes)
# and gradients (2), an fp32 master copy of the weights (4) and two fp32 moments (8): `16P` bytes,
# before any activation. By hand for `P = 1000`: 2400 bytes to serve, 16000 to train.

# %%
small = inference_memory_rule_of_thumb(1000)
train = adamw_training_memory(1000)
print("serving P = 1000:", small, "\ntraining P = 1000:", train)
assert small.weights == 2000 and abs(small.total - 2400) < 1e-9
assert train.total == 16000 == sum(train[:4])

# %% [markdown]
# At full size, Llama-3-8B (8.03e9 parameters): 15 GiB of weights, 18 GiB by the rule of thumb,
# 120 GiB of training state. The plot checks the 20% against the real cache,
# `128 KiB` per token for this model: the allowance covers about 24k cached tokens in total
# (batch times context). A batch of 16 sequences of 8192 tokens needs 16 GiB of cache, far more
# than 20%: for long contexts and large batches compute the cache instead of trusting the rule.

# %%
P_llama = parameter_counts(llama).total
serve = inference_memory_rule_of_thumb(P_llama)
train = adamw_training_memory(P_llama)
per_token = kv_cache_bytes(1, llama.layers, 1, llama.kv_heads, llama.head_dim, 2)
covered = serve.allowance / per_token
print(f"P = {P_llama:.3e}: weights {format_bytes(serve.weights)}, rule of thumb "
      f"{format_bytes(serve.total)}, AdamW training {format_bytes(train.total)}")
print(f"KV cache {format_bytes(per_token)} per token: the 20% covers {covered:.0f} tokens; "
      f"16 x 8192 tokens need {format_bytes(kv_cache_bytes(16, 32, 8192, 8, 128, 2))}")
assert per_token == 128 * 1024 and 24000 < covered < 25000
assert train.total == 16 * P_llama

cached_tokens = np.linspace(0, 131072, 65)
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained",
                         gridspec_kw={"width_ratios": [1.6, 1]})
gib = 2**30
axes[0].plot(cached_tokens / 1024, (serve.weights + per_token * cached_tokens) / gib,
             label="weights + actual KV cache")
axes[0].axhline(serve.total / gib, color="tab:orange", ls="--", label="rule of thumb 2P x 1.2")
axes[0].axhline(serve.weights / gib, color="gray", ls=":", label="weights 2P")
axes[0].axvline(covered / 1024, color="tab:orange", lw=0.6)
axes[0].set(xlabel="cached tokens, batch x context (thousands)", ylabel="GiB",
            title="Llama-3-8B serving memory (activations not shown)")
axes[0].legend(fontsize=8)
parts = {"fp16 weights": train.weights_fp16, "fp16 grads": train.grads_fp16,
         "fp32 master": train.master_fp32, "fp32 m and v": train.adam_moments_fp32}
bottom = 0.0
for name, size in parts.items():
    axes[1].bar(["train (AdamW)"], [size / gib], bottom=bottom,
                label=f"{name} ({size // P_llama}P)")
    bottom += size / gib
axes[1].bar(["serve (rule)"], [serve.total / gib], color="tab:gray")
axes[1].set(ylabel="GiB", title="16P against 2.4P")
axes[1].legend(fontsize=8)
plt.show()
