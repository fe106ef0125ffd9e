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
#     minutes: 50
#     ids: [M4, K8, K9, S3, K11, S1, S2]
# ---

# %% [markdown]
# # Lesson 11: latent attention, shared pages, and memory
#
# Lesson 10 showed that a decode step costs the bytes it reads. This lesson shrinks and shares
# those bytes and then sizes the whole machine. Multi-head latent attention (MLA, DeepSeek-AI,
# 2024) caches one short latent row per token instead of every head's key and value (M4), scores
# against it without expanding it (K8, *weight absorption*), and keeps a separate rotary key
# because RoPE would break the absorption (K9, *decoupled RoPE*). Then the cache savings of every
# design side by side (S3), pages shared between sequences with copy on write (K11), and the
# memory of serving and of training (S1, S2).
#
# **Prerequisites:** lessons 8 (GQA, A13) and 10 (what a token costs, K3, K13); lesson 3's paged
# cache (K10).
#
# **Goals:** derive the two regroupings that let MLA attend over latents; explain why RoPE needs a
# decoupled key; compute cache sizes of MHA, GQA, MQA and MLA; count shared pages; size serving
# and AdamW training memory.
#
# **Catalogue IDs:** M4, K8, K9, S3, K11, S1, S2
#
# **Duration:** about 50 minutes.

# %%
import matplotlib.pyplot as plt
import numpy as np

from refmath.gradcheck import check_param_gradients
from refmath.inference.kv_cache import decode_step, prefill
from refmath.inference.paged import PagedKVCache
from refmath.lessons import catalogued, check, check_function, check_true
from refmath.models import mla
from refmath.norms import rmsnorm_forward
from refmath.positions import rope_forward
from refmath.sizing import (
    PRESETS,
    format_bytes,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    mla_cache_bytes,
    mla_cache_bytes_per_token,
    parameter_counts,
)
from refmath.softmax import softmax_forward

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)

# %% [markdown]
# ## M4: the MLA decoder at a glance
#
# The MLA decoder is the M3 layer of lesson 8 with multi-head latent attention in place of GQA.
# Keys and values come from one latent row per token, $c_j = x_j W_{DKV}$ of width $d_c$,
# expanded per head by $W_{UK}$ and $W_{UV}$ ($U_K$, $U_V$ in the catalogue); position enters
# through a separate rotated key $k^R_j$ of width $d_R$, shared by all heads. The scores are
#
# $$s_{ij,r} = \frac{q^C_{i,r} (k^C_{j,r})^\top + q^R_{i,r} (k^R_j)^\top}{\sqrt{d_k + d_R}}.$$
#
# Every head's content key and value are linear in $c_j$, so a cache needs only $c_j$ and
# $k^R_j$: $d_c + d_R$ numbers per token and layer, against $2 h d_h$ for MHA. Below, $d = 32$,
# $h = 4$, $d_c = 16$, $d_R = 4$: 20 numbers instead of 64. Every gradient of `mla.backward` is
# hand-written; `check_param_gradients` compares each tensor with central differences.

# %%
m4 = mla.MLAConfig(vocab_size=32, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, d_c=16,
                   d_rope=4, ffn_multiple_of=16)
for name, shape in mla.param_shapes(m4).items():
    if name.startswith("layers.0.attn."):
        print(f"{name:>22}  {shape}")
params = mla.init_params(m4, seed=0)
seq = rng.integers(0, 32, (2, 8))
batch = {"tokens": seq[:, :-1], "targets": seq[:, 1:]}
loss, cache = mla.forward(params, batch, m4)
grads = mla.backward(cache)
c, k_r = mla.layer_latents(cache)[0]
print(f"loss {float(loss):.4f}; layer 0 caches c {c.shape} and k^R {k_r.shape}: "
      f"{m4.d_c + m4.d_rope} numbers per token, MHA would cache 2 h d_h = {2 * m4.n_heads * m4.d_h}")
assert c.shape == (2, 7, 16) and k_r.shape == (2, 7, 4)
result = check_param_gradients(lambda p: mla.forward(p, batch, m4)[0], grads, params, max_coords=4)
print(f"gradient check of every tensor: passed {result.passed}, worst error "
      f"{result.errors[result.worst]:.1e} (bound {result.bound:.1e})")
assert result.passed

# %% [markdown]
# ## K8: weight absorption, scoring against the cache without expanding it
#
# Two regroupings of the products remove the expansion:
#
# - scores: $q\, k_j^\top = q\,(c_j W_{UK})^\top = (q\, W_{UK}^\top)\, c_j^\top$. With
#   $\hat q = q W_{UK}^\top$ (width $d_c$, computed once per step) each score is a dot product
#   with the cached latent itself;
# - values: $\sum_j a_j v_j = \sum_j a_j c_j W_{UV} = \big(\sum_j a_j c_j\big) W_{UV}$: one
#   up-projection per head per step, instead of one per cached token.
#
# These identities are exact for the factorised weights MLA is trained with; they do not say that
# an arbitrary MHA model can be compressed to a small $d_c$ without error.

# %% [markdown]
# **Exercise 11.1.** On integers, four cached latents of width 3 and one head with $d_k = 2$: compute
# the absorbed query $\hat q$ and the four scores $\hat q\, c_j^\top$ (no $k_j$ anywhere).

# %% tags=["exercise"]
c_lat = rng.integers(-2, 3, size=(4, 3)).astype(float)
W_UK = rng.integers(-2, 3, size=(3, 2)).astype(float)
W_UV = rng.integers(-2, 3, size=(3, 2)).astype(float)
q_c = np.array([[1.0, -1.0]])
absorbed_scores = ...  # (1, 4)
# BEGIN SOLUTION
q_hat = q_c @ W_UK.T
absorbed_scores = q_hat @ c_lat.T
# END SOLUTION

# %%
check("11.1", absorbed_scores)

# %%
weights, _ = softmax_forward(q_c @ (c_lat @ W_UK).T / np.sqrt(2))
np.testing.assert_allclose(weights @ (c_lat @ W_UV), (weights @ c_lat) @ W_UV, rtol=1e-14)

# %% [markdown]
# **What the identities do not show.** The regrouping needs keys that *are* $c_j W_{UK}$: weights
# trained in that factorised form. An MHA model trained with a full $W_K$ ($d \times h d_k$) has
# latents only if $W_K = W_{DKV} W_{UK}$ for some $W_{DKV}$ ($d \times d_c$), which holds
# exactly only when $d_c \ge \operatorname{rank} W_K$. Below, the key weights of two MHA layers
# with $d = 24$ and four heads of 4: a random one, and one whose $W_K$ happens to be a product
# through a narrower width.

# %% tags=["exercise"]
# Exercise 11.2: for each of the two, the smallest latent width d_c for which W_K = W_DKV W_UK
# can hold exactly. Give the pair (for mha_w_k, for factored_w_k).
draw = np.random.default_rng(11)
mha_w_k = draw.standard_normal((24, 4 * 4))
factored_w_k = draw.standard_normal((24, 6)) @ draw.standard_normal((6, 4 * 4))
smallest_d_c = ...
# BEGIN SOLUTION
smallest_d_c = (np.linalg.matrix_rank(mha_w_k), np.linalg.matrix_rank(factored_w_k))
# END SOLUTION

# %%
check("11.2", smallest_d_c)

# %% [markdown]
# A generic $W_K$ has full rank and leaves no room: compressing it to a smaller $d_c$ is an
# approximation with an error (the best one, by the singular value decomposition, drops its
# smallest singular values), and whether a model survives it is an empirical question, not a
# consequence of the identities above.

# %% [markdown]
# The MLA model decodes either way (`mla_path="expanded"` or `"absorbed"`). From the same prompt,
# every step gives the same logits to float64 rounding. Per cached token, the expanded path builds
# $h (d_k + d_v)$ numbers at every step; the absorbed one reads the $d_c + d_R$ that are stored.

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
h, d_k, d_v = mla_config.n_heads, mla_config.d_h, mla_config.d_v
print(f"numbers per cached token and layer: expanded {h * (d_k + d_v)}, "
      f"absorbed {mla_config.d_c + mla_config.d_rope}")


# %% [markdown]
# ## K9: decoupled RoPE, and what MLA caches
#
# RoPE cannot be applied to $k = c\, W_{UK}$: the score would become
# $q_i R_i^\top R_j W_{UK}^\top c_j^\top$, with a rotation that depends on the key's position $j$
# between $q$ and $W_{UK}^\top$, so no single $\hat q$ could serve every cached token. MLA
# therefore adds a small separate rotary part: each head's query gets $q^R$ (width $d_R$), and
# each token one rotary key $k^R_j$, rotated at its own position (K3) and **shared by all
# heads**. The cache holds, per token and layer, only the latent $c_j$ and $k^R_j$:
#
# $$M_{\mathrm{MLA}} = B\,L\,T\,(d_c + d_R)\,b \text{ bytes}.$$
#
# For the tiny model, $d_c = 32$ and $d_R = 8$: 40 numbers per token and layer, against
# $2 h d_h = 128$ for multi-head attention with the same heads.

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
# Put together, one decode step of one MLA layer reads only the cache. Per head $r$, with the
# absorbed query $\hat q_r = q^C_r W_{UK,r}^\top$ (width $d_c$),
#
# $$s_{j,r} = \frac{\hat q_r\, c_j^\top + q^R_r\, (k^R_j)^\top}{\sqrt{d_k + d_R}},\qquad
# a_r = \mathrm{softmax}(s_r),\qquad o_r = \Big(\sum_j a_{j,r}\, c_j\Big)\, W_{UV,r},$$
#
# and no $k_j$ or $v_j$ is ever formed.

# %% tags=["exercise"]
# Exercise 11.3: write the absorbed decode step for one token and h heads. `q_c` (h, d_k) and `q_r`
# (h, d_R) are the new token's content and rotary queries; `c` (T, d_c) and `k_r` (T, d_R) are
# the cache (the rotary keys are shared by every head); `w_uk` (h, d_c, d_k) and `w_uv`
# (h, d_c, d_v) are the per-head up-projections. Return o (h, d_v). The first check compares it
# with the expanded computation (every head's keys and values built from the cache) on three
# caches; the second watches the arrays your function computes, and says wrong if one of them is
# a key or a value (it has both a token axis T and a d_k or d_v axis).
def my_absorbed_attention(q_c, q_r, c, k_r, w_uk, w_uv):
    out = ...
    # BEGIN SOLUTION
    q_hat = np.einsum("hk,hck->hc", q_c, w_uk)  # q^C W_UK^T, per head
    scores = (q_hat @ c.T + q_r @ k_r.T) / np.sqrt(q_c.shape[-1] + q_r.shape[-1])  # (h, T)
    weights, _ = softmax_forward(scores)
    out = np.einsum("hc,hcv->hv", weights @ c, w_uv)  # (sum_j a_j c_j) W_UV, per head
    # END SOLUTION
    return out


# %%
check("11.3", my_absorbed_attention)

# %%
check("11.3b", my_absorbed_attention)

# %% [markdown]
# ## S3: how much each attention design saves, computed
#
# A rule of thumb says GQA cuts the key/value heads by 4-8x and MLA caches roughly 5-10x less than
# multi-head attention. The calculator gives exact figures instead. Per token and layer, each
# design caches what its attention reads back: MHA, GQA and MQA a key and a value of width $d_h$
# for each of their $h$, $g$ or one key/value heads (lesson 8), MLA what K9 showed.
#
# Llama-3-8B has $h = 32$ and $g = 8$: its GQA cache is 4x smaller than MHA's, the low end of the
# claim. Llama does not use MLA; the calculator's MLA row for it is a hypothetical one with
# DeepSeek-V2's proportions $d_c = 4 d_h$, $d_R = d_h / 2$.

# %% [markdown]
# **Exercise 11.4.** DeepSeek-V2's attention shape: $L = 60$, $h = 128$, $d_h = 128$, $d_c = 512$,
# $d_R = 64$. Per token and layer, how many numbers does MLA cache, and how many would MHA of the
# same shape cache? (c) A GQA design of the same head width $d_h$ would cache as much as MLA with
# how many key/value heads $g$? Set its count equal to MLA's and solve; $g$ need not be whole.

# %% tags=["exercise"]
mla_numbers = ...
mha_numbers = ...
kv_heads_like_mla = ...
# BEGIN SOLUTION
mla_numbers = 512 + 64
mha_numbers = 2 * 128 * 128
kv_heads_like_mla = mla_numbers / (2 * 128)  # 2 g d_h = d_c + d_R
# END SOLUTION

# %%
check("11.4a", mla_numbers)

# %%
check("11.4b", mha_numbers)

# %%
check("11.4c", kv_heads_like_mla)

# %%
from refmath.sizing import attention_cache_rows

ds = PRESETS["deepseek-v2"]
ds_rows = {r.kind: r for r in attention_cache_rows(ds.n_layers, ds.n_heads, ds.kv_heads,
                                                   ds.head_dim, 8192, latent_dim=ds.d_c,
                                                   rope_dim=ds.d_rope)}

# %% [markdown]
# Against MHA of its own shape, MLA caches some 57 times less, well outside the quoted 5-10x. The
# saving depends entirely on the baseline: against GQA with 8 key/value heads of the same width
# (2048 numbers) it is 3.6x, and your $g$ says how few key/value heads GQA would need to match
# MLA outright. The table below (printed once you have answered 11.4) gives the bytes at
# $T = 8192$.

# %%
llama = PRESETS["llama-3-8b"]
for name in ("llama-3-8b", "deepseek-v2"):
    cfg = PRESETS[name]
    rows = attention_cache_rows(cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.head_dim, tokens=8192,
                                latent_dim=cfg.d_c, rope_dim=cfg.d_rope)
    mha = rows[0].total
    if kv_heads_like_mla is not ...:  # the table holds 11.4's counts: shown once answered
        print(f"{name} at T = 8192, bf16:")
        for row in rows:
            print(f"   {row.label:24s} {format_bytes(row.total):>11s}   "
                  f"MHA / this = {mha / row.total:6.2f}")
gqa8 = kv_cache_bytes(1, ds.n_layers, 8192, 8, ds.head_dim, 2)
print(f"DeepSeek-V2 shape: GQA (g=8) / MLA = {gqa8 / ds_rows['MLA'].total:.2f}")
llama_rows = {r.kind: r for r in attention_cache_rows(llama.n_layers, llama.n_heads, llama.kv_heads,
                                                      llama.head_dim, 8192)}
assert llama_rows["MHA"].total == 4 * llama_rows["GQA"].total  # h / g = 32 / 8

fig, ax = plt.subplots(figsize=(6, 3.4), layout="constrained")
labels = ["MHA (g=128)", "GQA (g=8)", "MLA", "MQA (g=1)"]
per_token = [ds_rows["MHA"].bytes_per_token, kv_cache_bytes(1, ds.n_layers, 1, 8, ds.head_dim, 2),
             ds_rows["MLA"].bytes_per_token, ds_rows["MQA"].bytes_per_token]
ax.bar(labels, [b / 1024 for b in per_token],
       color=["tab:red", "tab:orange", "tab:green", "tab:blue"])
ax.set(yscale="log", ylabel="KiB per token (all 60 layers, bf16)",
       title="DeepSeek-V2's attention shape: cache per token")
ax.set_ylim(top=max(per_token) / 1024 * 4)  # room for the label above the tallest bar
for i, b in enumerate(per_token):
    ax.text(i, b / 1024 * 1.15, f"{b / 1024:.0f}", ha="center", va="bottom")
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
    pool_image = ax.imshow(np.array(refs)[None, :], cmap="Greens", vmin=0, vmax=2.5)
    for p, r in enumerate(refs):
        ax.text(p, 0, f"page {p}\n{'+'.join(owners[p]) or 'free'}", ha="center", va="center",
                fontsize=8)
    ax.set(xticks=[], yticks=[])
    ax.set_title(title, fontsize=9, loc="left")
bar = fig.colorbar(pool_image, ax=axes, ticks=[0, 1, 2], shrink=0.6)
bar.set_label("reference count")
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
# **Exercise 11.5.** 16 samples are drawn from one 1000-token prompt with pages of 16 tokens; each
# sample then appends one token. How many pages are in use with sharing (the 15 forks each copy
# the part-full last page when they first append; the original keeps it), and how many without?

# %% tags=["exercise"]
pages_shared = ...
pages_unshared = ...
# BEGIN SOLUTION
full_pages, part_full = 1000 // 16, 1  # 62 full pages and one holding 8 tokens
pages_shared = full_pages + part_full + 15
pages_unshared = 16 * (full_pages + part_full)  # each sample's token still fits in its last page
# END SOLUTION

# %%
check("11.5a", pages_shared)

# %%
check("11.5b", pages_unshared)

# %%
# After the exercise: what the two caches hold (checks 11.5a and 11.5b compare your counts
# with these same caches).
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
if pages_shared is not ... and pages_unshared is not ...:  # shown once you have answered
    print(f"pages used with sharing: {big.pages_used} (you said {pages_shared}); "
          f"without: {unshared.pages_used} (you said {pages_unshared})")

# %% [markdown]
# ## S1 and S2: memory for serving and for training
#
# Serving in bf16 or fp16 takes 2 bytes per parameter for the weights; a common **rule of thumb**
# adds about 20% for activations and the KV cache: $2P \times 1.2$. It is a rough allowance, not
# a measurement. Training with AdamW in mixed precision keeps, per parameter, fp16 weights (2
# bytes) and gradients (2), an fp32 master copy of the weights (4) and two fp32 moments (8):
# $16P$ bytes, before any activation.

# %% [markdown]
# **Exercise 11.6.** (a) By the rule of thumb, how many parameters $P$ can a GPU with 80 GB
# ($80 \times 10^9$ bytes) serve in bf16 at most? (A fraction of a parameter is fine.) (b) Some
# trainers keep AdamW's two moments in bf16, 2 bytes each, and everything else as above: how many
# bytes of training state does that take for $P = 1000$?

# %% tags=["exercise"]
largest_served = ...
train_bytes_bf16_moments = ...
# BEGIN SOLUTION
largest_served = 80e9 / (2 * 1.2)  # 2P x 1.2 bytes = 80e9
train_bytes_bf16_moments = (2 + 2 + 4 + 2 * 2) * 1000  # m and v at 2 bytes each, not 4
# END SOLUTION

# %%
check("11.6a", largest_served)

# %%
check("11.6b", train_bytes_bf16_moments)

# %% [markdown]
# At full size, Llama-3-8B (8.03e9 parameters): 15 GiB of weights, 18 GiB by the rule of thumb,
# 120 GiB of training state. The plot checks the 20% against the real cache, 128 KiB per token
# for this model: the allowance covers about 24k cached tokens in total (batch times context). A
# batch of 16 sequences of 8192 tokens needs 16 GiB of cache, far more than 20%: for long
# contexts and large batches compute the cache instead of trusting the rule.

# %%
from refmath.sizing import adamw_training_memory
from refmath.sizing import inference_memory_rule_of_thumb

P_llama = parameter_counts(llama).total
serve = inference_memory_rule_of_thumb(P_llama)
train = adamw_training_memory(P_llama)
per_token = kv_cache_bytes(1, llama.n_layers, 1, llama.kv_heads, llama.head_dim, 2)
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

# %% [markdown] tags=["question"]
# **Question.** MLA caches $c_j$ and $k^R_j$. Why must $k^R_j$ be cached *after* its rotation, why
# is it shared by all heads, and why is the absorbed path exact only because the rotary part is
# kept out of $c_j$?
#
# <!-- BEGIN SOLUTION -->
# As in K3, a key rotated once at its own position $j$ gives scores that depend only on the offset
# when the query is rotated at its position, so a cached rotated key never needs to change. It is
# shared by all heads so that the positional part adds only $d_R$ numbers per token, not
# $h\,d_R$. Absorption rewrites $q\,(c_j W_{UK})^\top$ as $(q W_{UK}^\top)\,c_j^\top$ with one
# $\hat q$ for every $j$; a rotation $R_j$ applied to $c_j W_{UK}$ would sit between $W_{UK}^\top$
# and $c_j^\top$ and change with $j$, so no single $\hat q$ would exist. Keeping the rotation in a
# separate term, $q^R (k^R_j)^\top$, leaves the content term absorbable.
# <!-- END SOLUTION -->

# %% [markdown]
# ## Exercises
#
# 1. Count the FLOPs of one decode step of one MLA head along the expanded and the absorbed
#    paths at context $t$, and find the $t$ above which absorption is cheaper.
# 2. Show that MLA with $d_c = 2 h d_h$ and no rotary part can represent any MHA layer, so its
#    savings come from choosing $d_c$ much smaller.
# 3. With `attention_cache_rows`, confirm your $g$ of exercise 11.4 for DeepSeek-V2's shape, then
#    find it for the calculator's hypothetical MLA row of Llama-3-8B ($d_c = 4 d_h$,
#    $d_R = d_h / 2$). Why do the two agree, although the models' widths differ?
# 4. A paged cache with pages of $p$ tokens wastes under $p$ slots per sequence. For 256
#    sequences of random lengths in $[1, 4096]$, estimate the waste for $p = 16$ and $p = 256$.
# 5. Add activation memory to the training estimate: what must be stored per token and layer for
#    the backward pass of one Pre-LN layer (count from the caches of `refmath.models.gpt`)?
#
# ## References
#
# - DeepSeek-AI, et al. (2024). DeepSeek-V2: A Strong, Economical, and Efficient
#   Mixture-of-Experts Language Model. (MLA, latent KV compression, decoupled RoPE.)
# - DeepSeek-AI, et al. (2024). DeepSeek-V3 Technical Report. (MLA retained.)
# - Ainslie, J., et al. (2023). GQA: Training Generalized Multi-Query Transformer Models from
#   Multi-Head Checkpoints.
# - Shazeer, N. (2019). Fast Transformer Decoding: One Write-Head is All You Need.
# - Kwon, W., et al. (2023). Efficient Memory Management for Large Language Model Serving with
#   PagedAttention. (Paging and prefix sharing with copy on write.)
# - Micikevicius, P., et al. (2018). Mixed Precision Training. (fp32 master weights.)
# - Loshchilov, I., and Hutter, F. (2017). Decoupled Weight Decay Regularization.
