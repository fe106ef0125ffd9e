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
#     ids: [F1, F2, F3, F4, F5, F6, K2, K4, K6, K7, K10]
#     minutes: 50
# ---

# %% [markdown]
# # Lesson 3: attention without the $T \times T$ matrix, and decoding without recomputation
#
# Two ideas make attention cheap in practice. FlashAttention computes exactly the same output
# block by block, merging partial softmax statistics, and its backward pass recomputes the
# weights from one saved number per row; what it saves is memory and traffic to slow memory. The
# KV cache keeps every past key and value so that a new token attends to them without
# recomputing them, at a memory cost that paging hands out a page at a time.
#
# **Prerequisites:** lesson 1 (attention and its backward pass, A2 and A8); the softmax
# Jacobian (A5).
#
# **Goals:** merge softmax statistics of two blocks by hand; compute the FlashAttention backward
# of a tile from the logsumexp; count the tiles a causal mask skips and the bytes the dense and
# tiled forms move; count the query-key pairs of generation with and without a cache; compute
# the size of a KV cache; read a page table.
#
# **Catalogue IDs:** F1, F2, F3, F4, F5, F6, K2, K4, K6, K7, K10
#
# **Duration:** 50 minutes

# %%
import matplotlib.pyplot as plt
import numpy as np

from refmath.attention import causal_mask, sdpa_forward
from refmath.flash import FlashCounters, flash_attention_forward
from refmath.gradcheck import numerical_gradient, relative_error
from refmath.inference.kv_cache import generate_cached, generate_naive
from refmath.inference.paged import PagedKVCache
from refmath.lessons import check
from refmath.models import decoder
from refmath.softmax import (
    OnlineSoftmaxState,
    online_softmax_block,
    online_softmax_empty,
    online_softmax_result,
)

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)

# %% [markdown]
# ## F1-F3: attention as a ratio of sums, merged block by block
#
# For one query with scores $s_j$, the output is a ratio of two sums (F1):
#
# $$o = \frac{\sum_j e^{s_j} v_j}{\sum_j e^{s_j}} .$$
#
# Split the keys into blocks $A$ and $B$. Each block keeps its own maximum, sum and weighted sum
# (F2):
#
# $$m_A = \max_{j \in A} s_j,\qquad l_A = \sum_{j \in A} e^{s_j - m_A},\qquad
# u_A = \sum_{j \in A} e^{s_j - m_A} v_j .$$
#
# Two blocks merge by rescaling both to the larger maximum (F3), and the output is the ratio:
#
# $$m = \max(m_A, m_B),\quad l = e^{m_A - m} l_A + e^{m_B - m} l_B,\quad
# u = e^{m_A - m} u_A + e^{m_B - m} u_B,\quad o = u / l .$$

# %%
scores = np.array([1.0, 3.0, -2.0, 0.5, 2.5])
values = rng.standard_normal((5, 2))
a = online_softmax_block(scores[:2], values[:2])
b = online_softmax_block(scores[2:], values[2:])
print("block A: m =", a.m, " l =", a.l, " u =", a.u)
print("block B: m =", b.m, " l =", b.l, " u =", b.u)
weights = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
print("dense o =", weights @ values)

# %% [markdown]
# A kernel that merges two tiles no longer has their scores, only their states. Here are two such
# states, C and D, of blocks whose scores are not given: only F3 can merge them.

# %%
state_c = OnlineSoftmaxState(m=np.float64(2.0), l=np.float64(1.5), u=np.array([0.5, -1.0]))
state_d = OnlineSoftmaxState(m=np.float64(3.5), l=np.float64(1.25), u=np.array([2.0, 0.25]))

# %% tags=["exercise"]
# Exercise 03.1: merge by hand the states C and D above: give (m, l) of the merged state, from
# state_c.m, state_c.l, state_d.m and state_d.l.
merged_m_l = ...
# BEGIN SOLUTION
m_merged = max(state_c.m, state_d.m)
merged_m_l = (m_merged, np.exp(state_c.m - m_merged) * state_c.l
              + np.exp(state_d.m - m_merged) * state_d.l)
# END SOLUTION

# %%
check("03.1", merged_m_l)

# %% [markdown]
# The kernels merge whole tiles of query rows at once, and some of those rows have seen no key
# yet: a causal tile above the diagonal, a padded sequence, a split of the keys that holds
# nothing visible for that query. Such a row is the empty state $m = -\infty$, $l = 0$, $u = 0$,
# and a merge must keep it exact: with one empty side, $e^{-\infty - m} = 0$ drops it; with both
# sides empty, $m = -\infty$ and $m_A - m$ is $-\infty - (-\infty)$, which is NaN.

# %% tags=["exercise"]
# Exercise 03.2: write the merge F3 as a function of two OnlineSoftmaxState (m and l of shape
# (...,), u of shape (..., d_v)), for any shape of query rows. It must return the empty state
# (not NaN) for a row where both sides are empty. The check compares it with
# online_softmax_merge on the blocks above and on a batch of rows with empty sides.
def my_online_softmax_merge(a, b):
    m = l = u = ...
    # BEGIN SOLUTION
    m = np.maximum(a.m, b.m)
    shift = np.where(np.isneginf(m), 0.0, m)  # both sides empty: shift by 0, never by -inf
    alpha, beta = np.exp(a.m - shift), np.exp(b.m - shift)
    l = alpha * a.l + beta * b.l
    u = alpha[..., None] * a.u + beta[..., None] * b.u
    # END SOLUTION
    return OnlineSoftmaxState(m, l, u)


# %%
from refmath.softmax import online_softmax_merge

check("03.2", my_online_softmax_merge)

# %% [markdown]
# The library's `online_softmax_merge` is F3 with that guard: merged, the blocks A and B give the
# dense output, and merging an empty (or fully masked) block, the state $m = -\infty$, $l = 0$,
# $u = 0$, changes nothing.

# %%
merged = online_softmax_merge(a, b)
print("merged o =", online_softmax_result(merged), "  dense o =", weights @ values)
np.testing.assert_allclose(online_softmax_result(merged), weights @ values, rtol=1e-14)
empty = online_softmax_empty((), 2)
np.testing.assert_allclose(online_softmax_result(online_softmax_merge(merged, empty)),
                           online_softmax_result(merged), rtol=1e-15)

# %% [markdown]
# ## F4-F5: tiles, and the tiles a causal mask lets us skip
#
# `flash_attention_forward` loops over query tiles and key tiles with that running state. It never
# builds the $T \times T$ score matrix: the extra memory is $O(T)$, the logsumexp
# $\mathrm{lse}_i = m_i + \log l_i$ of each row (F4). The arithmetic is the dense one,
# $O(B h T^2 d_h)$, except that with a causal mask it never visits a tile that lies entirely above
# the diagonal (F5). The counters say what it did; the picture shows which tiles those are, each
# tile's state read off the mask and checked against the counters: white tiles are skipped,
# light ones are cut by the diagonal (masked inside) and dark ones are computed in full.

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

# Each tile's state read off the mask the loop applies: how many of its block x block pairs are
# visible (0: skipped, all: computed in full, in between: cut by the diagonal, masked inside).
# The picture must tell the same story as the counters of the causal run just printed.
n = T // block
visible = (causal_mask(T) == 0).reshape(n, block, n, block).sum(axis=(1, 3))
tile_state = np.where(visible == 0, 0, np.where(visible == block * block, 2, 1))
assert np.count_nonzero(tile_state) == counters.tiles_computed  # visited: cut or full
assert np.count_nonzero(tile_state == 0) == counters.tiles_skipped
assert visible[tile_state > 0].size * block * block == counters.score_pairs
fig, ax = plt.subplots(figsize=(4.6, 3.2), layout="constrained")
colours = plt.get_cmap("Blues")(np.array([0.0, 0.45, 0.9]))
ax.imshow(colours[tile_state])
ax.set(title=f"causal {n} x {n} tiles of {block} x {block}", xlabel="key tile", ylabel="query tile")
ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="grey", label=label)
                   for c, label in zip(colours, (f"skipped ({counters.tiles_skipped})",
                                                 f"cut by the diagonal ({np.sum(tile_state == 1)})",
                                                 f"computed in full ({np.sum(tile_state == 2)})"))],
          loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, frameon=False)
plt.show()

# %% [markdown]
# ## F4: the backward pass from the logsumexp
#
# The backward pass needs the weights $P_{ij}$ again, but the forward kept no $T \times T$
# matrix. It kept $\mathrm{lse}_i = \log \sum_j e^{S_{ij}}$, the row's full normaliser, so any
# tile of weights comes back exactly from its scores:
#
# $$P_{ij} = e^{S_{ij} - \mathrm{lse}_i} .$$
#
# The softmax backward of A8 needs $\sum_j P_{ij}\, dP_{ij}$ over the whole row. Since
# $dP_{ij} = dO_i \cdot v_j$ and $O_i = \sum_j P_{ij} v_j$, that sum is
# $\delta_i = dO_i \cdot O_i$, a dot product of two vectors the forward already produced. Then,
# tile by tile,
#
# $$dV_j \mathrel{+}= P^\top dO_i,\quad dP = dO_i V_j^\top,\quad
# dS = P \odot (dP - \delta_i),\quad dQ_i \mathrel{+}= \tau\, dS\, K_j,\quad
# dK_j \mathrel{+}= \tau\, dS^\top Q_i .$$
#
# A small case, four queries and six keys of width 2, causal:

# %%
q_small, k_small, v_small = (rng.standard_normal((1, 1, n, 2)) for n in (4, 6, 6))
o_small, lse_small = flash_attention_forward(q_small, k_small, v_small, causal=True, block_q=2,
                                             block_k=2)
do_small = rng.standard_normal(o_small.shape)
print("logsumexp per row:", lse_small[0, 0])

# %% tags=["exercise"]
# Exercise 03.3: dQ of the small case from the saved logsumexp, without calling the library: the
# scores S = tau q k^T with tau = 1/sqrt(2), the causal mask (query i sits at key position i + 2,
# so it sees keys 0 .. i + 2), P = exp(S - lse), delta = rowsum(dO * O), dS, then dQ.
dq_from_lse = ...
# BEGIN SOLUTION
tau = 1 / np.sqrt(2)
S_small = tau * q_small[0, 0] @ k_small[0, 0].T
visible = np.arange(6)[None, :] <= np.arange(4)[:, None] + 2
P_small = np.where(visible, np.exp(S_small - lse_small[0, 0][:, None]), 0.0)
delta = np.sum(do_small[0, 0] * o_small[0, 0], axis=1, keepdims=True)
dS_small = P_small * (do_small[0, 0] @ v_small[0, 0].T - delta)
dq_from_lse = (tau * dS_small @ k_small[0, 0])[None, None]
# END SOLUTION

# %%
check("03.3", dq_from_lse)

# %% [markdown]
# And the tiled backward is the gradient of the tiled forward: central differences of
# $\sum O \odot dO$ (`refmath.gradcheck.numerical_gradient`, float64) agree for $Q$, $K$ and $V$.

# %%
from refmath.flash import flash_attention_backward

grads_small = dict(zip("qkv", flash_attention_backward(do_small, q_small, k_small, v_small, o_small,
                                                        lse_small, causal=True, block_q=2,
                                                        block_k=2)))
for name, array in (("q", q_small), ("k", k_small), ("v", v_small)):
    numeric = numerical_gradient(
        lambda: float(np.sum(flash_attention_forward(q_small, k_small, v_small, causal=True,
                                                     block_q=2, block_k=2)[0] * do_small)),
        array, np.arange(array.size)).reshape(array.shape)
    error = float(relative_error(grads_small[name], numeric).max())
    print(f"d{name}: largest relative error against central differences {error:.1e}")
    assert error < 1e-7

# %% [markdown] tags=["question"]
# **Question.** The forward pass ends with $m_i$ and $l_i$ for every row, but keeps only
# $\mathrm{lse}_i = m_i + \log l_i$. Why is one number enough, and why is it safe in floating
# point to compute $e^{S_{ij} - \mathrm{lse}_i}$?
#
# <!-- BEGIN SOLUTION -->
# The weight is $P_{ij} = e^{S_{ij} - m_i} / l_i = e^{S_{ij} - m_i - \log l_i}$: only the sum
# $m_i + \log l_i$ enters. Since $l_i \ge 1$ (the maximum's own term is $e^0$),
# $\mathrm{lse}_i \ge m_i \ge S_{ij}$, so every exponent is at most 0 and every $P_{ij}$ lies in
# $[0, 1]$: no overflow, whatever the scores.
# <!-- END SOLUTION -->

# %% [markdown]
# ## F6: what the tiles save is traffic to slow memory
#
# On a GPU, arithmetic happens on the chip, and the arrays live in a slower memory (HBM) that
# moves a few terabytes per second. Dense attention, as usually written, sends two $T \times T$
# matrices there and back: it writes the scores $S$, reads them for the softmax, writes the
# weights $P$, reads them for $PV$. The tiled form reads $Q$, $K$, $V$ and writes $O$ (and the
# logsumexp), but reads $K$ and $V$ again for each of the $\lceil T/B_q \rceil$ query tiles:
#
# $$\text{dense: } 4 B h T^2 + O(B h T d_h)\ \text{elements},\qquad
# \text{tiled: } B h T d_h \big(2 + 2\lceil T / B_q \rceil\big) + B h T .$$
#
# For long sequences the dense form moves about $2 B_q / d_h$ times as much. The flash counters
# count the tiled form's loads and stores as the loop makes them; `attention_memory_traffic`
# gives both in closed form (both after exercise 03.4, which asks for the dense count).

# %% tags=["exercise"]
# Exercise 03.4: the bytes the *dense* forward moves (read plus written) for one sequence of
# T = 2048 tokens at GPT-2's shape (h = 12, d_h = 64, 2 bytes per element), from the counts
# above: Q, K, V read once, S and P written and read, O written.
dense_2048 = ...
# BEGIN SOLUTION
T2, h2, dh2 = 2048, 12, 64
dense_2048 = 2 * (3 * h2 * T2 * dh2 + 4 * h2 * T2 * T2 + h2 * T2 * dh2)
# END SOLUTION

# %%
check("03.4", dense_2048)

# %%
from refmath.flash import attention_memory_traffic

counters = FlashCounters()
q_t, k_t, v_t = (rng.standard_normal((1, 2, 100, 8)) for _ in range(3))
flash_attention_forward(q_t, k_t, v_t, block_q=32, block_k=16, counters=counters)
closed_form = attention_memory_traffic(1, 2, 100, 100, 8, tiled=True, block_q=32,
                                       bytes_per_element=1)
print(f"counted in the loop: {counters.elements_read} read, {counters.elements_written} written; "
      f"closed form: {closed_form.read_bytes} read, {closed_form.written_bytes} written")
np.testing.assert_array_equal((counters.elements_read, counters.elements_written), closed_form)

# %% [markdown]
# At GPT-2 small's attention shape ($h = 12$, $d_h = 64$, 2-byte floats, one sequence), with
# query tiles of 128 rows:

# %%
lengths = 2 ** np.arange(7, 15)
dense_bytes = [attention_memory_traffic(1, 12, t, t, 64, bytes_per_element=2).total_bytes
               for t in lengths]
tiled_bytes = {block: [attention_memory_traffic(1, 12, t, t, 64, tiled=True, block_q=block,
                                                bytes_per_element=2).total_bytes for t in lengths]
               for block in (128, 32)}
for t, dense, tiled in zip(lengths, dense_bytes, tiled_bytes[128]):
    print(f"T = {t:5d}: dense {dense / 2**20:9.1f} MiB, tiled {tiled / 2**20:8.1f} MiB, "
          f"ratio {dense / tiled:.2f}")

fig, ax = plt.subplots(figsize=(5.5, 3.4), layout="constrained")
ax.plot(lengths, np.array(dense_bytes) / 2**20, "o-", label="dense: S and P through slow memory")
for block, style in ((128, "s-"), (32, "^--")):
    ax.plot(lengths, np.array(tiled_bytes[block]) / 2**20, style, label=f"tiled, $B_q = {block}$")
ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="MiB moved (forward)",
       title=r"attention's traffic, $h = 12$, $d_h = 64$, fp16")
ax.set_xticks(lengths, [str(t) for t in lengths], rotation=45)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Both curves grow like $T^2$: tiling does not change the order, it divides the constant by
# $2B_q/d_h$, and it removes the $T^2$ *storage*. With query tiles of 32 rows and $d_h = 64$
# the ratio is about 1: re-reading $K$ and $V$ costs as much as the scores did. The tiles must be
# as large as the on-chip memory allows.

# %% [markdown]
# ## K2 and K4: decoding with a cache
#
# A decode step appends the new token's key and value to the cache and attends with its query
# only (K2): $o_t = \operatorname{softmax}\big(q_t K_{1:t}^\top / \sqrt{d_k}\big) V_{1:t}$. Old
# queries are never needed again. Without a cache, generating token $t$ reruns the whole prefix:
# $t^2$ query-key pairs, so $\sum_t t^2 = N(N+1)(2N+1)/6$ over $N$ positions. With the cache, the
# new query meets $t$ cached keys: $\sum_t t = N(N+1)/2$ in all (K4). Both produce exactly the
# same tokens.

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
ax.plot(steps, np.cumsum(steps**2), label=r"recompute the prefix: $\sum t^2$")
ax.plot(steps, np.cumsum(steps), label=r"KV cache: $\sum t$")
ax.set(xlabel="generated positions N", ylabel="query-key pairs", title="cost of generation (K4)")
ax.legend()
plt.show()

# %% [markdown]
# ## K6-K7: what the cache costs in memory
#
# $$M_{KV} = 2\, B\, L\, T\, g\, d_h\, b \ \text{bytes}$$
#
# keys and values (the 2), for every sequence, layer, token, key/value head and head width, at
# $b$ bytes each (K6). At $L = 32$, $T = 8192$, $d_h = 128$ in 2-byte floats, full multi-head
# attention ($g = 32$) needs 4 GiB per sequence; sharing key/value heads (GQA $g = 8$, MQA
# $g = 1$) divides it (K7).

# %% [markdown]
# A server asks the question the other way round: the memory is given, and the cache decides how
# long the sequences may be. A model card does not list $d_h$ or $g$ under those names either:
# it gives the width $d$, the number of query heads $h$ (so $d_h = d / h$) and of key/value heads.

# %% tags=["exercise"]
# Exercise 03.5: a model of width d = 5120 with 40 layers, 40 query heads and 8 key/value heads
# keeps its cache in 2-byte floats. A server gives the cache of a batch of 8 sequences 24 GiB
# (24 * 2**30 bytes). How many tokens can each sequence hold, in whole tokens?
tokens_that_fit = ...
# BEGIN SOLUTION
per_token = 2 * 40 * 8 * (5120 // 40) * 2  # K and V, every layer, every kv head, d_h = d / h, bytes
tokens_that_fit = (24 * 2**30) // (8 * per_token)
# END SOLUTION

# %%
check("03.5", tokens_that_fit)

# %% [markdown]
# The library's `kv_cache_bytes` is K6: for the three designs above it gives 4 GiB, 1 GiB and
# 128 MiB per sequence.

# %%
from refmath.sizing import kv_cache_bytes

for name, g in (("MHA", 32), ("GQA", 8), ("MQA", 1)):
    size = kv_cache_bytes(batch=1, layers=32, tokens=8192, kv_heads=g, head_dim=128,
                          bytes_per_element=2)
    print(f"{name} g={g:2d}, 2 B L T g d_h b: {2 * 1 * 32 * 8192 * g * 128 * 2 / 2**20:8.0f} MiB")
    assert size == 2 * 1 * 32 * 8192 * g * 128 * 2
    print(f"kv_cache_bytes, {name}: {size / 2**20:.0f} MiB")

# %% [markdown]
# ## K10: paging
#
# A paged cache stores tokens in fixed-size pages of $p$ tokens drawn from a shared pool; each
# sequence keeps a table of its pages, so memory is handed out a page at a time and no sequence
# reserves space for its maximum length. A sequence of $T$ tokens holds $\lceil T/p \rceil$
# pages, and position $j$ (from 0) lives on its page $\lfloor j/p \rfloor$ at offset
# $j \bmod p$: less than a page is wasted per sequence. Decoding walks a sequence's pages and
# merges one online-softmax block per page, the same F3 rule as above.

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

# %% [markdown]
# ## Exercises
#
# 1. Show that the F3 merge is associative and commutative, and that the empty state
#    ($m = -\infty$, $l = 0$, $u = 0$) is its identity. Why does that let a GPU split the keys of
#    one query among several thread blocks (split-K decoding)?
# 2. Derive $\delta_i = dO_i \cdot O_i = \sum_j P_{ij} dP_{ij}$ and compute $dK$ of the small
#    case from the logsumexp as in the exercise above.
# 3. With a causal mask and square tiles of $b$ rows that divide $T$, show that
#    $N(N+1)/2$ of the $N^2$ tiles are computed ($N = T/b$), and check with `FlashCounters`.
# 4. Add the causal mask to the F6 count: how many key tiles does query tile $i$ read? Compare
#    with the counters of a causal `flash_attention_forward`.
# 5. For a page size $p$, what is the expected waste per sequence if lengths are uniform? Compare
#    with reserving the maximum length of 4096 tokens for sequences of 500 tokens on average.
#
# ## References
#
# - Milakov and Gimelshein (2018), *Online normalizer calculation for softmax*.
# - Dao et al. (2022), *FlashAttention: Fast and Memory-Efficient Exact Attention with
#   IO-Awareness* (tiling, the recomputation in the backward, the HBM traffic count).
# - Dao (2023), *FlashAttention-2: Faster Attention with Better Parallelism and Work
#   Partitioning* (the backward with $\delta = \operatorname{rowsum}(dO \odot O)$).
# - Pope et al. (2022), *Efficiently Scaling Transformer Inference* (the KV cache and its memory).
# - Kwon et al. (2023), *Efficient Memory Management for Large Language Model Serving with
#   PagedAttention* (paging).
