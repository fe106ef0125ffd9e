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
# # Lesson 3: attention without the T x T matrix, and decoding without recomputation
#
# Two ideas make attention cheap in practice. FlashAttention computes exactly the same output
# block by block, merging partial softmax statistics (catalogue F1-F5). The KV cache keeps every
# past key and value so that a new token attends to them without recomputing them (K2-K7, K10).

# %%
import matplotlib.pyplot as plt
import numpy as np

from refmath.attention import causal_mask, sdpa_forward
from refmath.flash import FlashCounters, flash_attention_forward
from refmath.inference.kv_cache import generate_cached, generate_naive
from refmath.inference.paged import PagedKVCache
from refmath.models import decoder
from refmath.sizing import kv_cache_bytes
from refmath.softmax import (
    online_softmax_block,
    online_softmax_empty,
    online_softmax_merge,
    online_softmax_result,
)

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)

# %% [markdown]
# ## F1-F3: attention as a ratio of sums, merged block by block
#
# For one query, `o = sum_j e^{s_j} v_j / sum_j e^{s_j}` (F1). Split the keys into blocks A and B.
# Each block keeps its own maximum `m`, sum `l = sum e^{s_j - m}` and weighted sum
# `u = sum e^{s_j - m} v_j` (F2). Two blocks merge by rescaling both to the larger maximum (F3):
# `m = max(m_A, m_B)`, `l = e^{m_A - m} l_A + e^{m_B - m} l_B`, `u` likewise, and `o = u / l`.

# %%
scores = np.array([1.0, 3.0, -2.0, 0.5, 2.5])
values = rng.standard_normal((5, 2))
a = online_softmax_block(scores[:2], values[:2])
b = online_softmax_block(scores[2:], values[2:])
print("block A: m =", a.m, " l =", a.l, " u =", a.u)
print("block B: m =", b.m, " l =", b.l, " u =", b.u)
merged = online_softmax_merge(a, b)
weights = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
print("merged o =", online_softmax_result(merged), "  dense o =", weights @ values)
np.testing.assert_allclose(online_softmax_result(merged), weights @ values, rtol=1e-14)

# An empty (or fully masked) block is the state m = -inf, l = 0, u = 0: merging it changes nothing.
empty = online_softmax_empty((), 2)
np.testing.assert_allclose(online_softmax_result(online_softmax_merge(merged, empty)),
                           online_softmax_result(merged), rtol=1e-15)

# %% [markdown]
# ## F4-F5: tiles, and the tiles a causal mask lets us skip
#
# `flash_attention_forward` loops over query tiles and key tiles with that running state. It never
# builds the `T x T` score matrix, and with a causal mask it never visits a tile that lies
# entirely above the diagonal. The counters say what it did; in the picture, white tiles are
# skipped, light ones are cut by the diagonal (masked inside) and dark ones are computed in full.

# %%
T, D, block = 64, 16, 8
q, k, v = (rng.standard_normal((1, 1, T, D)) for _ in range(3))
dense, _ = sdpa_forward(q, k, v, mask=causal_mask(T))
for causal in (False, True):
    counters = FlashCounters()
    o, lse = flash_attention_forward(q, k, v, causal=causal, block_q=block, block_k=block,
                                     counters=counters)
    print(f"causal={causal}: {counters.tiles_computed} tiles computed, {counters.tiles_skipped} "
          f"skipped, {counters.score_pairs} scores; largest temporary {counters.largest_temporary} "
          f"numbers (a T x T matrix holds {T * T})")
np.testing.assert_allclose(o, dense, rtol=1e-12, atol=1e-14)

n = T // block
tile_state = np.array([[2 if j < i else (1 if j == i else 0) for j in range(n)] for i in range(n)])
fig, ax = plt.subplots(figsize=(3.6, 3.2), layout="constrained")
ax.imshow(tile_state, cmap="Blues", vmin=0, vmax=2)
ax.set(title=f"causal {n} x {n} tiles", xlabel="key tile", ylabel="query tile")
plt.show()

# %% [markdown]
# ## K2 and K4: decoding with a cache
#
# Without a cache, generating token `t` reruns the whole prefix: `t^2` query-key pairs, so
# `N(N+1)(2N+1)/6` over `N` positions. With the cache, the new token's query meets `t` cached keys:
# `N(N+1)/2` in all. Both produce exactly the same tokens.

# %%
config = decoder.preset("tiny", vocab_size=32, max_seq_len=64)
params = decoder.init_params(config, seed=0)
prompt = np.array([3])
N = 40
cached = generate_cached(decoder, params, config, prompt, N, greedy=True)
naive = generate_naive(decoder, params, config, prompt, N, greedy=True)
np.testing.assert_array_equal(cached.tokens, naive.tokens)
print("same tokens:", cached.tokens[:12], "...")
print(f"pairs per layer and head: naive {naive.counts.scores[0]} "
      f"(N(N+1)(2N+1)/6 = {N * (N + 1) * (2 * N + 1) // 6}), cached {cached.counts.scores[0]} "
      f"(N(N+1)/2 = {N * (N + 1) // 2})")

steps = np.arange(1, N + 1)
fig, ax = plt.subplots(figsize=(5, 3), layout="constrained")
ax.plot(steps, np.cumsum(steps**2), label="recompute the prefix: sum t^2")
ax.plot(steps, np.cumsum(steps), label="KV cache: sum t")
ax.set(xlabel="generated positions N", ylabel="query-key pairs", title="cost of generation (K4)")
ax.legend()
plt.show()

# %% [markdown]
# ## K6-K7: what the cache costs in memory
#
# `2 B L T g d_h b` bytes: keys and values, for every layer, token, key/value head and head
# width. At `L = 32, T = 8192, d_h = 128` in 2-byte floats, full multi-head attention (`g = 32`)
# needs 4 GiB per sequence; sharing key/value heads (GQA `g = 8`, MQA `g = 1`) divides it.

# %%
for name, g in (("MHA", 32), ("GQA", 8), ("MQA", 1)):
    size = kv_cache_bytes(batch=1, layers=32, tokens=8192, kv_heads=g, head_dim=128,
                          bytes_per_element=2)
    print(f"{name} g={g:2d}: {size / 2**20:8.0f} MiB")

# %% [markdown]
# ## K10: paging
#
# A paged cache stores tokens in fixed-size pages drawn from a shared pool; each sequence keeps a
# table of its pages, so memory is handed out a page at a time and no sequence reserves space for
# its maximum length. Decoding walks a sequence's pages and merges one online-softmax block per
# page, the same F3 rule as above.

# %%
g, d, page = 2, 8, 4
cache = PagedKVCache(n_pages=16, page_size=page, n_kv_heads=g, head_dim=d)
for seq, length in ((0, 7), (1, 10)):
    cache.add_sequence(seq)
    cache.append(seq, rng.standard_normal((length, g, d)), rng.standard_normal((length, g, d)))
print("page tables:", {seq: cache.page_table(seq) for seq in (0, 1)},
      " waste:", {seq: cache.waste(seq) for seq in (0, 1)}, "token slots")

q_new = rng.standard_normal((2, 4, d))  # one new query per sequence, 4 query heads
paged = cache.decode(q_new, [0, 1])  # page by page, merged with F3
for row, seq in enumerate((0, 1)):
    k_seq, v_seq = cache.gather(seq)  # (T, g, d): the same tokens, laid out contiguously
    kh = np.repeat(k_seq.transpose(1, 0, 2), 2, axis=0)  # query head r reads kv head r // 2
    vh = np.repeat(v_seq.transpose(1, 0, 2), 2, axis=0)
    dense, _ = sdpa_forward(q_new[row][:, None, :], kh, vh)
    np.testing.assert_allclose(paged[row], dense[:, 0, :], rtol=1e-12)
print("paged decode equals attention over the gathered cache")
