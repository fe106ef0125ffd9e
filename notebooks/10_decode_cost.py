# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
#   refmath:
#     figures: 4
#     minutes: 60
#     ids: [K3, K5, K13, K12]
# ---

# %% [markdown]
# # Lesson 10: what a generated token costs
#
# Lesson 3 built the KV cache. This lesson asks what it holds and what each new token costs:
# why keys and values are cached and queries are not, keys stored after their rotation (K3), the
# cost of a prompt against the cost of one new token (K5), why a decode step is bound by memory
# bandwidth rather than arithmetic, measured on this machine (K13), a cache stored as small
# integers to move fewer bytes (K12), and weights stored in fewer bytes, their tokens per second
# measured against the bandwidth bound.
#
# **Prerequisites:** lessons 3 (KV cache, K2, K6) and 8 (GQA and what it saves, A13).
#
# **Goals:** say which vectors a decode step needs; rebuild a cached RoPE key by hand; count
# prefill and decode work; compute the arithmetic intensity of prefill and decode and the lower
# bound on time per token from bytes and bandwidth; quantise a group to 4 bits by hand and bound
# its error; count the bytes a token reads with its weights in Q8_0, and read refmath's own tokens
# per second in float32, bf16, f16 and Q8_0 against the bound.
#
# **Catalogue IDs:** K3, K5, K13, K12
#
# **Duration:** about 60 minutes.

# %%
import contextlib
import os
import time

import matplotlib.pyplot as plt
import numpy as np

from refmath import kernels
from refmath.attention import sdpa_forward
from refmath.lessons import check
from refmath.models import decoder
from refmath.norms import rmsnorm_forward
from refmath.positions import rope_forward
from refmath.sizing import (
    PRESETS,
    decode_step_flops,
    decode_step_traffic,
    format_bytes,
    kv_cache_bytes,
    prefill_traffic,
    quantized_kv_cache_bytes,
)
from refmath.softmax import softmax_forward

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)

# %% [markdown]
# ## Why keys and values are cached, and queries are not
#
# At decode step $t$, one head at one depth computes
#
# $$o_t = \mathrm{softmax}\!\Big(\frac{q_t K_{1:t}^\top}{\sqrt{d_k}}\Big) V_{1:t}.$$
#
# It needs the *current* query $q_t$ and *all* keys and values $k_{1:t}$, $v_{1:t}$. The old
# queries $q_1, \dots, q_{t-1}$ do not appear: they were needed for the old outputs, which are
# already computed and, by K1 (lesson 7), never change. So a cache keeps K and V for every past
# token and layer, and nothing of Q. (Training is different: its backward pass needs every
# query, or their recomputation.)
#
# ## K3: RoPE keys are cached after their rotation
#
# With rotary positions, the key of token $j$ is rotated by $R_j$ before it is used. A score only
# sees the difference of the two rotations,
# $(q_t R_t^\top)(k_j R_j^\top)^\top = q_t R_{j - t}\, k_j^\top$ up to the sign convention of the
# angle, so the rotation of key $j$ never needs to change: it is rotated once, at its own
# position, when it enters the cache. At decode step $t$ only the new query and the new key are
# rotated. Caching unrotated keys would instead cost a rotation of all $t$ keys at every step.
# The flip side: a cached key is only valid for the position rule it was rotated with. A server
# that changes how positions are counted or scaled (an offset, a RoPE scaling rule for longer
# contexts) must recompute the cache, not reuse it.
#
# Below, a tiny decoder (2 layers, 4 query heads, 2 key/value heads of width 16) and six tokens;
# after exercise 10.1 it prefills the first 3 and decodes 3 more.

# %%
config = decoder.preset("tiny", max_seq_len=32)
params = decoder.init_params(config, seed=0)
tokens = np.array([[5, 17, 42, 7, 99, 3]])

# %% [markdown]
# **Exercise 10.1.** Rebuild layer 0's keys by hand: RMS-normalise the token embeddings with
# `layers.0.ln1.gamma`, project with `layers.0.attn.w_k`, split into $g$ heads of width $d_h$
# (shape $(B, g, T, d_h)$), and rotate row $j$ by position $j$ with `rope_forward`.

# %% tags=["exercise"]
keys_by_hand = ...  # (1, 2, 6, 16)
# BEGIN SOLUTION
u, _ = rmsnorm_forward(params["tok_emb"][tokens], params["layers.0.ln1.gamma"], config.norm_eps)
raw = (u @ params["layers.0.attn.w_k"]).reshape(1, 6, config.kv_heads, config.d_h)
raw = raw.transpose(0, 2, 1, 3)  # (B, g, T, d_h), not yet rotated
keys_by_hand, _ = rope_forward(raw, base=config.rope_base)  # row j rotated by position j
# END SOLUTION

# %%
check("10.1", keys_by_hand)

# %% [markdown]
# The cache holds exactly those keys: prefill 3 tokens, decode 3 more, and layer 0's cache is the
# keys you rebuilt; once written, a key never changes.

# %%
from refmath.inference.kv_cache import decode_step, prefill

_, cache = prefill(decoder, params, config, tokens[:, :3])
keys_after_prefill = cache.layer(0)[0].copy()
for t in range(3, 6):
    decode_step(decoder, params, config, cache, tokens[:, t])
cached_keys = cache.layer(0)[0]  # (B, g, T, d_h)
# once written, a key never changes: the first three rows are exactly those of the prefill
np.testing.assert_array_equal(cached_keys[:, :, :3], keys_after_prefill)
print("cached keys of layer 0:", cached_keys.shape)
del cache  # not kept: two more decode steps on it would answer exercise 10.3

# %% [markdown]
# What a decode step does with the cache is the equation at the top for one new query per
# sequence: a batch of sequences of different lengths shares one cache array of $T_{\max}$ rows,
# sequence $b$ holding its keys in the first $L_b$ rows (the rest is padding, whatever it holds),
# and query head $r$ reads key/value head $\pi(r) = \lfloor r / (h/g) \rfloor$ (A10). That is
# `refmath.inference.decode.decode_attention(q, k_cache, v_cache, lengths)`, the function the
# C++ and CUDA decode kernels are checked against.

# %% tags=["exercise"]
# Exercise 10.2: write one decode step of attention over a padded cache. `q` is (B, H, D), one query
# per sequence and head; `k_cache` and `v_cache` are (B, G, T_max, D); `lengths` (B,) says how
# many rows of each sequence are real. Return o (B, H, D), with o = 0 for a sequence of length 0.
# The check compares it with decode_attention on GQA, MQA and MHA caches whose padding holds
# large numbers.
def my_decode_attention(q, k_cache, v_cache, lengths):
    out = ...
    # BEGIN SOLUTION
    B, H, D = q.shape
    G, T_max = k_cache.shape[1], k_cache.shape[2]
    heads = np.arange(H) // (H // G)  # query head r reads key/value head r // (H / G)
    k, v = k_cache[:, heads], v_cache[:, heads]  # (B, H, T_max, D)
    scores = np.einsum("bhd,bhtd->bht", q, k) / np.sqrt(D)
    visible = np.arange(T_max)[None, None, :] < np.asarray(lengths)[:, None, None]
    weights, _ = softmax_forward(np.where(visible, scores, -np.inf))  # no key: a row of zeros
    out = np.einsum("bht,bhtd->bhd", weights, v)
    # END SOLUTION
    return out


# %%
check("10.2", my_decode_attention)

# %% [markdown]
# ## K5: the prompt is quadratic, each new token linear
#
# Prefilling a prompt of $P$ tokens is one causal pass: query $i$ meets keys $0..i$, so
# $1 + 2 + \dots + P = P(P+1)/2$ visible pairs per head and layer, $O(P^2)$. (The reference
# computes the whole $P \times P$ score matrix and masks it, $P^2$ scores; a causal kernel skips
# the upper triangle.) A decode step at position $t$ has one query and $t + 1$ keys:
# $O(t\,h\,d_h)$ work per layer, linear in the context.

# %%
P = 4
_, demo = prefill(decoder, params, config, tokens[:, :P])
print(f"after a prefill of {P}: visible pairs per head, per layer", demo.counts.visible,
      " scores computed", demo.counts.scores)
assert demo.counts.visible == [P * (P + 1) // 2] * config.n_layers
assert demo.counts.scores == [P * P] * config.n_layers
decode_step(decoder, params, config, demo, tokens[:, P])
print("after one decode step:", demo.counts.visible)
assert demo.counts.visible == [P * (P + 1) // 2 + P + 1] * config.n_layers
del demo  # not kept: more decode steps on it would answer exercise 10.3

# %% [markdown]
# **Exercise 10.3.** A prompt of $P = 5$ tokens, then 3 decode steps. How many visible pairs per
# head and layer in total? (Prefill, then each step's new query meets all keys so far, itself
# included.)

# %% tags=["exercise"]
total_pairs = ...
# BEGIN SOLUTION
total_pairs = 5 * 6 // 2 + 6 + 7 + 8
# END SOLUTION

# %%
check("10.3", total_pairs)

# %% [markdown]
# At full size the weights dominate a decode step at first: every token passes through all the
# projections and the feed-forward layers whatever the context. `decode_step_flops` counts both
# parts (2 FLOPs per multiply-add) for Llama-3-8B's shape: the weights cost about 15 GFLOP per
# token, the attention $4 L h d_h = 0.52$ MFLOP per cached token, so attention overtakes the
# weights near 29k tokens of context. Mistral-7B's sliding window of 4096 caps the attention term:
# past the window, each step costs the same.

# %%
measured = [prefill(decoder, params, config, np.zeros((1, p), dtype=np.int64))[1].counts.visible[0]
            for p in range(1, 17)]
assert measured == [p * (p + 1) // 2 for p in range(1, 17)]

llama, mistral = PRESETS["llama-3-8b"], PRESETS["mistral-7b"]
contexts = np.linspace(1, 65536, 257).astype(int)
llama_steps = [decode_step_flops(llama, int(t)) for t in contexts]
mistral_steps = [decode_step_flops(mistral, int(t)) for t in contexts]
per_key = 4 * llama.n_layers * llama.n_heads * llama.head_dim
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
# ## K13: decode is bound by memory bandwidth
#
# FLOPs are not the whole cost. A processor does at most $\pi$ FLOP/s and its memory delivers at
# most $\beta$ bytes/s, so a step that does $F$ FLOPs and moves $M$ bytes takes at least
# $\max(F/\pi,\ M/\beta)$. Its **arithmetic intensity** $I = F / M$ (FLOPs per byte) decides
# which bound binds: below $\pi / \beta$ the step is bandwidth bound (the *roofline* of Williams
# et al., 2009).
#
# A decode step multiplies one token (per sequence) by every weight matrix: 2 FLOPs per weight,
# while each weight, read once, costs $b$ bytes. With the cache read as well,
#
# $$t_{\text{token}} \;\ge\; \frac{\text{weight bytes} + \text{cache bytes}}{\beta},
#   \qquad I_{\text{decode}} \approx \frac{2B}{b},$$
#
# about 1 FLOP per byte at batch $B = 1$ in 16 bits (the approximation holds while the weights
# dominate the bytes; each sequence's cache pulls $I$ lower at long contexts and large batches).
# A prefill of $T$ tokens reads the same weights once for all $T$ tokens, so
# $I_{\text{prefill}} \approx 2BT/b$ grows with the prompt.
# `refmath.sizing.decode_step_traffic` and `prefill_traffic` count both; `decode_time_lower_bound`
# divides.

# %%
llama = PRESETS["llama-3-8b"]
print("Llama-3-8B at t = 8192, FLOP per byte:")
for batch in (1, 8, 64):
    print(f"  batch {batch:2}: decode intensity {decode_step_traffic(llama, 8192, batch).intensity:6.1f}")
for tokens_in in (1, 64, 512, 4096):
    print(f"  prefill of {tokens_in:4}: intensity {prefill_traffic(llama, tokens_in).intensity:7.1f}")
# the attention FLOPs add a little at t = 8192
assert 1 < decode_step_traffic(llama, context=8192).intensity < 1.3

# %% [markdown]
# **Exercise 10.4.** By hand: Llama-3-8B has $P_{\text{matmul}} + dV = 7{,}504{,}658{,}432$ weights
# that a decode step multiplies by (every projection, the FFN and the output matrix; not the
# embedding table, of which a step reads one row). In bf16 ($b = 2$), with a cache of 8192 tokens
# at 128 KiB each (lesson 3, K6), what is the lower bound on the time per token, in seconds, on a
# memory system of $\beta = 2 \times 10^{12}$ bytes/s?

# %% tags=["exercise"]
seconds_per_token = ...
# BEGIN SOLUTION
seconds_per_token = (2 * 7_504_658_432 + 8192 * 128 * 1024) / 2e12
# END SOLUTION

# %%
check("10.4", seconds_per_token)

# %%
# After the exercise: the library's count of the same step (shown once you have answered; the
# check compares with its bytes over 2e12 bytes/s).
step = decode_step_traffic(llama, context=8192)
if seconds_per_token is not ...:
    print(f"Llama-3-8B decode at t = 8192: {step.flops / 1e9:.1f} GFLOP, weights "
          f"{format_bytes(step.weight_bytes)}, cache {format_bytes(step.cache_bytes)}, "
          f"intensity {step.intensity:.2f} FLOP/byte; {step.total_bytes / 2e12 * 1e3:.2f} ms per "
          f"token at 2e12 bytes/s (you said {1e3 * seconds_per_token:.2f} ms)")

# %% [markdown]
# ### This machine's roofline, measured now
#
# `refmath.kernels.stream_sum` reads a float32 array once on every kernel thread: the bandwidth a
# decode step, which reads everything once, can reach. A float32 matrix product of size 1024 gives
# a FLOP rate to compare with. Timings on a shared machine vary from run to run, so the thread
# count is pinned to one thread per pool (BLAS and OpenMP, with threadpoolctl when it is
# installed; setting `OMP_NUM_THREADS=1` and `OPENBLAS_NUM_THREADS=1` before starting Python does
# the same): a single core's roofline, which a busy machine disturbs least. Each figure is the
# median of 7 runs, and a recorded measurement stands beside the live one. Nothing is asserted
# about the times.

# %%
from refmath.sizing import decode_time_lower_bound

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # the numbers are then whatever the default thread pools give
    threadpool_limits = None


def median_seconds(fn, repeats=7):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


# recorded by this cell on the project's 2-core AMD EPYC build machine (x86-64 with AVX2, no
# AVX-512), one thread, while other jobs shared it
RECORDED = {"bandwidth": 3.1e9, "flops": 20.6e9}
threads = 1
pinned = threadpool_limits(limits=threads) if threadpool_limits else contextlib.nullcontext()
with pinned:
    stream = np.ones(2**24, dtype=np.float32)  # 64 MiB, larger than any cache
    matrix = np.ones((1024, 1024), dtype=np.float32)
    if kernels.cpu_available():
        live_bandwidth = stream.nbytes / median_seconds(lambda: kernels.stream_sum(stream))
    else:
        live_bandwidth = stream.nbytes / median_seconds(lambda: stream.sum())
    live_flops = 2 * 1024**3 / median_seconds(lambda: matrix @ matrix, repeats=5)
print(f"{threads} thread; live: {live_bandwidth / 1e9:.1f} GB/s, {live_flops / 1e9:.1f} GFLOP/s "
      f"(ridge at {live_flops / live_bandwidth:.1f} FLOP/byte); recorded: "
      f"{RECORDED['bandwidth'] / 1e9:.1f} GB/s, {RECORDED['flops'] / 1e9:.1f} GFLOP/s")
if seconds_per_token is not ...:  # 10.4's bytes over this bandwidth: shown once answered
    print(f"Llama-3-8B at t = 8192 on this machine: at least "
          f"{decode_time_lower_bound(step, live_bandwidth):.2f} s per token")

# %%
intensity = np.logspace(-1, 4, 200)
fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
for (bw, peak, label, style) in ((RECORDED["bandwidth"], RECORDED["flops"], "recorded", "--"),
                                 (live_bandwidth, live_flops, "this machine, now", "-")):
    axes[0].loglog(intensity, np.minimum(peak, intensity * bw) / 1e9, style,
                   label=f"{label}: {bw / 1e9:.1f} GB/s, {peak / 1e9:.0f} GFLOP/s")
marks = {"decode, B = 1": decode_step_traffic(llama, 8192).intensity,
         "decode, B = 64": decode_step_traffic(llama, 8192, 64).intensity,
         "prefill, T = 512": prefill_traffic(llama, 512).intensity}
for (name, value), colour in zip(marks.items(), ("tab:red", "tab:orange", "tab:green")):
    axes[0].axvline(value, color=colour, lw=1, ls=":", label=f"{name}: I = {value:.0f}")
axes[0].set(xlabel="arithmetic intensity (FLOP per byte)", ylabel="attainable GFLOP/s",
            title="roofline: min(peak, I x bandwidth)")
axes[0].legend(fontsize=7, loc="lower right")
contexts_k = np.array([1, 2048, 8192, 32768, 65536])
bounds = [decode_step_traffic(llama, int(t)) for t in contexts_k]
axes[1].plot(contexts_k / 1024, [b.weight_bytes / live_bandwidth for b in bounds], "s-",
             label="weights alone")
axes[1].plot(contexts_k / 1024, [b.total_bytes / live_bandwidth for b in bounds], "o-",
             label="weights + KV cache")
axes[1].set(xlabel="context (thousands of tokens)", ylabel="seconds per token, lower bound",
            title=f"Llama-3-8B, batch 1, at {live_bandwidth / 1e9:.1f} GB/s")
axes[1].legend(fontsize=8)
plt.show()

# %% [markdown]
# The ratio of the two bounds is what matters, not this machine's absolute speed: at batch 1 a
# decode step does about one FLOP per byte, two to three orders of magnitude below the ridge
# point of a modern processor, so making the arithmetic faster changes nothing; fewer bytes (GQA,
# lesson 8; MLA, lesson 11; a quantised cache, below) or a larger batch that shares each weight
# read are what speed decoding up.
#
# ## K12: a cache of small integers
#
# A symmetric quantiser stores each group of $G$ consecutive numbers as integers in
# $[-q_{\max}, q_{\max}]$ ($q_{\max} = 2^{q-1} - 1$: 127 for 8 bits, 7 for 4 bits) and one scale:
#
# $$s = \frac{\max_i |x_i|}{q_{\max}}, \qquad c_i = \mathrm{clip}\big(\mathrm{round}(x_i / s),
#   -q_{\max}, q_{\max}\big), \qquad \hat x_i = s\, c_i.$$
#
# Rounding to the nearest integer is off by at most one half, so $|x_i - \hat x_i| \le s/2$: half
# a step.

# %% [markdown]
# **Exercise 10.5.** Quantise $x = (3.5, -1.2, 0.3, 2.0)$ to 4 bits in one group by hand: the scale,
# the codes, and $\hat x$; then the error $|x_i - \hat x_i|$ of each element, which the bound says
# is at most half a step.

# %% tags=["exercise"]
x = np.array([3.5, -1.2, 0.3, 2.0])
scale_by_hand = ...
x_hat_by_hand = ...  # (4,)
error_by_hand = ...  # (4,): |x - x_hat|
# BEGIN SOLUTION
scale_by_hand = 3.5 / 7
x_hat_by_hand = scale_by_hand * np.clip(np.round(x / scale_by_hand), -7, 7)
error_by_hand = np.abs(x - x_hat_by_hand)
# END SOLUTION

# %%
check("10.5a", scale_by_hand)

# %%
check("10.5b", x_hat_by_hand)

# %%
check("10.5c", error_by_hand)

# %% [markdown]
# Smaller groups mean smaller scales (a group's scale is set by its largest entry), hence smaller
# errors, but more scales to store: each costs 2 bytes, $2/G$ bytes per element on top of the
# $q/8$ of the payload. Dettmers et al. (2022) report a few large-magnitude feature dimensions in
# the activations of large trained models; here we plant such channels: 4 of the 128 are 10 times
# larger than the rest, and only the groups that contain them get coarse steps. The bound
# $|x - \hat x| \le s/2$ holds for every element and every group size.

# %%
from refmath.inference.quantized import (QuantizedKVCache, decode_with_quantized_cache,
                                         dequantize, quantize)

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
# An error in a key moves the scores, $q (k - \hat k)^\top / \sqrt{d_h}$; an error in a value
# moves the weighted sum directly: the weights are at least 0 and add up to 1, so the output moves
# by at most the largest value error, $\max s/2$. Here one new query per head against 64 cached
# tokens, measured against float64: with only the keys dequantised, with only the values
# dequantised, and with both, as `decode_with_quantized_cache` attends over the cache.

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
# The bytes: the payload is $2BLTg\,d_h\,q/8$ and each group adds a scale. `QuantizedKVCache`
# stores exactly what `quantized_kv_cache_bytes` predicts. At the shape of lesson 3's worked table
# with GQA ($L = 32$, $T = 8192$, $g = 8$, $d_h = 128$), float16 takes 1 GiB; int8 with groups of
# 32 takes 512 MiB of payload and 32 MiB of scales, int4 half the payload again. By K13, that is
# also the factor by which the cache's share of a decode step's time shrinks.

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
# ## The bandwidth law, measured: fewer bytes per weight
#
# K12 stored the cache in fewer bytes. The weights can be stored the same way, and at batch 1
# they are most of what a token reads. A decode step multiplies one row by every weight matrix:
# each weight is read once per token and used in one multiply-add, 2 FLOPs. In float32 that is
# half a FLOP per byte, far below the ridge point measured above (several FLOPs per byte), so the
# arithmetic waits for the memory and K13's bound, written as a rate, is the whole story:
#
# $$\text{tokens/s} \;\le\; \frac{\beta}{\text{bytes read per token}}.$$
#
# `generate(..., weights=fmt)` stores the seven matrices of every layer ($W_q, W_k, W_v, W_o$
# and the FFN's three) and the output head in a narrower format (`refmath.weight_formats`,
# catalogue W1 and W2): `"bf16"` or `"f16"`, 2 bytes a weight, or `"q8_0"`, llama.cpp's 8-bit
# blocks: 32 `int8` codes and one float16 scale per block of 32 weights, 34 bytes per 32 weights,
# K12's $q/8 + 2/G$ with $q = 8$ and $G = 32$. The compiled decode step reads the stored bytes,
# turns each back into the float32 number it stands for, and sums in float32. The head is read
# whole at every step like a layer's matrix, so it is stored the same way (llama.cpp's converter
# rounds it too); the embedding table and the norms' gains stay float32, and a token reads one
# row of the table (a tied head is rounded as a copy: the lookup still reads the float32 table).
#
# The model below is small enough to run in seconds and wide enough for its layers to outweigh
# everything else: 4 layers of width $d = 512$, 8 query heads and $g = 2$ key/value heads of
# $d_h = 64$, a SwiGLU width $d_f = 1536$, a vocabulary of $V = 256$, an untied head.

# %%
from refmath.models.decoder_config import DecoderConfig

small_config = DecoderConfig(vocab_size=256, max_seq_len=64, d_model=512, n_layers=4, n_heads=8,
                             n_kv_heads=2, d_ff=1536)
given_bandwidth = 25.6e9  # bytes/s, for exercise 10.7: two DDR4-3200 channels, a desktop's memory
print(small_config)

# %% [markdown]
# **Exercise 10.6.** With the layers and the head stored in Q8_0, how many bytes of weights does
# one token read? Count the seven matrices of each layer from the shapes above ($W_q$:
# $d \times h d_h$; $W_k$, $W_v$: $d \times g d_h$; $W_o$: $h d_h \times d$; the FFN: three of
# $d \times d_f$) and the head ($d \times V$), then add the float32 parameters a token reads: the
# two gains of each layer and the final norm's, and one row of the embedding table. (Not the KV
# cache.)

# %% tags=["exercise"]
q8_bytes_per_token = ...
# BEGIN SOLUTION
d, L, V = small_config.d_model, small_config.n_layers, small_config.vocab_size
h, g, d_h, d_f = small_config.n_heads, small_config.kv_heads, small_config.d_h, small_config.d_f
layer_weights = L * (2 * d * h * d_h + 2 * d * g * d_h + 3 * d * d_f)  # W_q, W_o; W_k, W_v; FFN
q8_bytes_per_token = (layer_weights + d * V) * 34 / 32 + 4 * ((2 * L + 1) * d + d)  # + the head
# END SOLUTION

# %%
check("10.6", q8_bytes_per_token)

# %% [markdown]
# **Exercise 10.7.** On a memory system that reads `given_bandwidth` $= 2.56 \times 10^{10}$ bytes
# per second, at most how many tokens per second can this model make with its layers in Q8_0?

# %% tags=["exercise"]
q8_bound = ...
# BEGIN SOLUTION
q8_bound = given_bandwidth / q8_bytes_per_token
# END SOLUTION

# %%
check("10.7", q8_bound)

# %% [markdown]
# ### The law on this machine
#
# Now the real thing, on one thread as the roofline above. Each format's weights are stored once
# (`stored_model`, which `generate(..., weights=fmt)` calls afresh every time) and the
# timed loop is `generate`'s own (`sliding_next_logits`: a prefill, then one compiled decode step
# per token, greedy), so that only the tokens are timed; its tokens are checked against
# `generate`'s. The bytes a token reads are those the stored arrays occupy, the float32 rest, and
# the cache a step reads on average.
#
# The bound is measured, not assumed: a plain sequential read (`refmath.kernels.stream_sum`) of
# exactly as many bytes as a token of each format reads, and of sizes between, timed in the same
# turns as the tokens. A token reads its weights again and again, so its bytes sit wherever that
# many bytes stay on this machine: in main memory when they outgrow the last-level cache, in the
# cache when they fit (a large server cache holds all of this model, a laptop's only part of it),
# and a repeated read of the same size finds them in the same place. The bound for $x$ bytes is
# one token per read of $x$ bytes, $\beta(x) / x$ tokens/s; where every size comes from main
# memory, $\beta$ is one number and the bound is the curve $\beta / x$, drawn dotted for the
# float32 model's read.
#
# Tokens and reads alike are timed in CPU seconds of the one thread that runs them
# (`time.thread_time`), not by the wall clock: on a shared machine the wall clock also counts the
# time other programs held the core, which can triple a token's time; the CPU seconds count only
# the time ours ran. Each figure is a median. (The other programs still share the caches and the
# memory, so the figures move a little with the load average, printed.)

# %%
from refmath.fast.products import kernel_products
from refmath.inference.generate import generate
from refmath.inference.kv_cache import sliding_next_logits
from refmath.inference.layer_formats import LAYER_MATRICES, stored_model
from refmath.inference.weight_layout import decode_layout
from refmath.sizing import kv_cache_bytes_per_token
from refmath.weight_formats import bytes_per_weight

WEIGHT_FORMATS = ("f32", "bf16", "f16", "q8_0")
small_params = decode_layout(decoder.init_params(small_config, seed=0, dtype=np.float32))
small_prompt = np.arange(8)[None]  # one sequence of 8 tokens
steps, rounds = 20, 4  # decode steps timed per run; runs per format


def is_stored_matrix(name):
    """The matrices a format stores: the layers' seven and the head."""
    return name.rsplit(".", 1)[-1] in LAYER_MATRICES or name == "lm_head"


n_stored_weights = sum(v.size for k, v in small_params.items() if is_stored_matrix(k))
float32_rest = (sum(v.nbytes for k, v in small_params.items()
                    if not is_stored_matrix(k) and k != "tok_emb")
                + small_params["tok_emb"][0].nbytes)  # the gains, one embedding row
keys_read = small_prompt.shape[1] + 1 + np.arange(steps)  # step j attends to 8 + j + 1 keys
cache_read = kv_cache_bytes_per_token(small_config.n_layers, small_config.kv_heads,
                                      small_config.d_h, 4) * keys_read.mean()


def one_thread():
    """One thread in every pool: BLAS and OpenMP (threadpoolctl, where installed) and refmath's
    kernels, as the roofline above."""
    stack = contextlib.ExitStack()
    if threadpool_limits:
        stack.enter_context(threadpool_limits(limits=1))
    stack.enter_context(kernels.cpu_thread_limit(1))
    return stack


def decode_run(params_fmt, stored, fmt):
    """One greedy generation of `steps` tokens after the prompt: (the CPU seconds of each token,
    the tokens). A token's time is one pass of the loop: pick it, append it, one decode step."""
    next_logits = sliding_next_logits(decoder, params_fmt, small_config, small_config.max_seq_len,
                                      "cpu", stored, fmt, kernel_products)
    tokens = small_prompt
    z = next_logits(tokens)  # the prefill: not timed
    seconds = []
    for _ in range(steps):
        start = time.thread_time()
        tokens = np.concatenate([tokens, z.argmax(axis=-1)[:, None]], axis=1)
        z = next_logits(tokens)  # one decode step
        seconds.append(time.thread_time() - start)
    assert kernels.cpu_last_team() == 1  # the step ran on this thread alone, as its CPU time says
    return seconds, tokens


measured = kernels.cpu_available()
if not measured:
    print("The compiled module refmath._C is not available here, so there is no compiled "
          "generation to time: the figure below draws the bound at the roofline's bandwidth alone.")
else:
    formats = {}
    for fmt in WEIGHT_FORMATS:
        if fmt == "f32":
            params_fmt, stored = small_params, None
        else:  # the restored float32 parameters (the NumPy reference) and the stored matrices;
            # small_config's head is untied, so the config the run takes is small_config itself
            params_fmt, _, stored = stored_model(decoder, small_params, small_config, fmt)
        stored_bytes = (sum(s.nbytes for s in stored.values()) if stored else
                        sum(v.nbytes for k, v in small_params.items() if is_stored_matrix(k)))
        assert stored_bytes == n_stored_weights * bytes_per_weight(fmt)  # the count of 10.6
        formats[fmt] = {"stored": stored, "bytes": stored_bytes + float32_rest + cache_read,
                        "params": params_fmt, "seconds": []}
    # the reads: each format's bytes, and sizes between, to draw the bound as a curve
    sizes = sorted({int(f["bytes"]) // 4 for f in formats.values()}
                   | {int(x) for x in np.geomspace(0.2, 1.15, 5) * formats["f32"]["bytes"] / 4})
    reads = {n: [] for n in sizes}  # floats read -> seconds of each read
    with one_thread():
        buffer = np.ones(max(sizes), dtype=np.float32)
        kernels.stream_sum(buffer)  # untimed: every page touched once
        for fmt, f in formats.items():  # untimed warm-up, and the tokens against generate's
            _, tokens = decode_run(f["params"], f["stored"], fmt)
            assert np.array_equal(tokens[0, :12], generate(
                decoder, small_params, small_config, small_prompt[0], 4, greedy=True,
                backend="cpu", weights=fmt, products=kernel_products))
        for _ in range(rounds):  # in turns: each generation, then a read of every size
            for fmt, f in formats.items():
                f["seconds"] += decode_run(f["params"], f["stored"], fmt)[0]
                for n in sizes:
                    start = time.thread_time()
                    kernels.stream_sum(buffer[:n])  # a plain sequential read of 4n bytes
                    reads[n].append(time.thread_time() - start)
    # medians of CPU seconds, the tokens' and the reads' alike
    read_seconds = {4 * n: float(np.median(t)) for n, t in reads.items()}  # bytes -> seconds
    print(f"1 thread, CPU seconds: the median of {rounds * steps} tokens and of "
          f"{rounds * len(formats)} reads of each size; load average {os.getloadavg()[0]:.1f}; "
          f"the cache a token reads: {cache_read / 1e3:.0f} kB on average")
    for fmt, f in formats.items():
        f["rate"] = 1 / float(np.median(f["seconds"]))
        f["read"] = read_seconds[4 * (int(f["bytes"]) // 4)]  # a read of this format's bytes
        f["bound"] = 1 / f["read"]  # tokens/s: one token per read of its bytes
        print(f"{fmt:>5}: {f['bytes'] / 1e6:5.2f} MB per token, read at "
              f"{f['bytes'] / f['read'] / 1e9:4.1f} GB/s; {f['rate']:6.1f} tokens/s, bound "
              f"{f['bound']:6.1f}: {100 * f['rate'] / f['bound']:3.0f}% of it; "
              f"{1e3 * (1 / f['rate'] - f['read']):.2f} ms per token beyond the read")

# %%
fig, ax = plt.subplots(figsize=(6.5, 4), layout="constrained")
f32_bytes = n_stored_weights * 4 + float32_rest + cache_read
x_mb = np.linspace(0.2, 1.15, 200) * f32_bytes / 1e6
if measured:
    curve = sorted(read_seconds.items())
    ax.plot([x / 1e6 for x, _ in curve], [1 / t for _, t in curve], "k.-",
            label="bound: one token per read of its bytes")
    beta = f32_bytes / formats["f32"]["read"]  # the float32 model's read, as one bandwidth
    ax.plot(x_mb, beta / (x_mb * 1e6), "k:", lw=1, label=f"the float32 model's read, {beta / 1e9:.1f} GB/s, / bytes")
    for (fmt, f), marker in zip(formats.items(), "osDv"):
        ax.plot(f["bytes"] / 1e6, f["rate"], marker, ms=8,
                label=f"{fmt}: {f['rate']:.0f} tokens/s, {100 * f['rate'] / f['bound']:.0f}% of "
                      f"its bound")
else:
    ax.plot(x_mb, live_bandwidth / (x_mb * 1e6), "k-",
            label=f"bound: {live_bandwidth / 1e9:.1f} GB/s / bytes per token")
ax.set(xlabel="bytes read per token (MB)", ylabel="tokens per second",
       title="greedy decoding at batch 1, one thread", ylim=(0, None))
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# **The fraction of the bound** is the share of a token's time that a plain read of its bytes
# would take: 100% is a token that costs nothing but the reading of its weights at the speed a
# read reaches. The rest, printed as the time beyond the read, is everything else a token costs,
# and whatever the products lose against a plain read of the same bytes.
#
# **Why the points fall below the curve.** A token is more than its weights: attention over the
# cache, the rotation of the new query and key, the final norm in NumPy, the argmax, and Python's
# work around each step (the loop, the calls into the compiled module, the head's among them, the
# small arrays they make). These costs do not shrink with the bytes of the weights, so the fewer
# the bytes, the larger their share: the same millisecond weighs more beside a Q8_0 token than
# beside a float32 one. In a 7-billion-parameter model the weights are hundreds of times larger
# and these costs shrink in proportion; a small model like this one is the worst case. Where this
# lesson was written (one thread of a 2-core Intel Xeon shared with other jobs, load average
# 10), two runs gave float32 208-212 tokens/s (76% of its bound), bf16 366-381 (59-63%), f16
# 350-388 (57-64%) and Q8_0 512-521 (54-56%), with 0.8-1.2 ms per token beyond the read in every
# format: the fixed costs, the same for all four, are most of the gap there. (Those runs kept the
# head in float32, 0.5 MB a token here, 4% of a Q8_0 token's bytes; it is stored in the format
# now.)
#
# **Why half the bytes is not twice the speed on a CPU.** The stored numbers are not the numbers
# multiplied: each weight is turned back into float32 first (bf16 by a 16-bit shift, f16 by a
# conversion instruction, Q8_0 by a conversion of the `int8` code, its block's scale applied once to
# the block's sum, $d \sum_i q_i x_i$), by the same core that does the multiply-adds. In float32 a
# core does 2 FLOPs for every 4 bytes it reads; in Q8_0, 2 FLOPs and a conversion for every 1.06
# bytes, nearly four times the work per byte. Where the core cannot do that work as fast as the
# bytes arrive, the step is bound by the core, not the memory, and the point sits further below its
# bound than the fixed costs alone would put it. `benchmarks/weight_formats.py` times the products
# alone against a read of their bytes: on the same machine (one thread, AVX-512, load average 7.7),
# bf16's and f16's products of a 1536 x 512 and a 4096 x 4096 matrix ran at 99-101% of the read,
# Q8_0's at 44% and 68%, when it still multiplied every weight by its scale (applying the scale once
# per block's sum brought a 4096 x 4096 matrix from 79% to 93% on a quiet 2-core Intel Xeon,
# `benchmarks/results/2026-12-07-0624-weight_formats.md`). In the whole generation above, that loss
# is mixed with the fixed costs and the noise: compare the time beyond the read of Q8_0 with bf16's.
# A GPU, with far more arithmetic per byte of bandwidth, hides the conversion; llama.cpp's CPU
# kernel for Q8_0 rounds the activations to 8 bits as well and multiplies integers, less work per
# byte for a little more rounding.


# %% [markdown] tags=["question"]
# **Question.** A decode step of Llama-3-8B at batch 1 and context 8192 moves about 16 GB. You
# may either double the processor's FLOP rate or quantise the KV cache to int4 (groups of 32).
# Which makes the step faster, and by roughly how much? What would change at batch 64?
#
# <!-- BEGIN SOLUTION -->
# Doubling the FLOP rate does nothing: the step is bandwidth bound ($I \approx 1.2$ FLOP/byte,
# below any processor's ridge point $\pi / \beta$). Quantising the cache from 1 GiB to int4 with
# groups of 32 (0.28 GiB with its scales) cuts the step from 16.1 GB to 15.3 GB, about 5%
# faster, because at batch 1 the 15.0 GB of weights dominate. At batch 64 every sequence reads its
# own cache: 68.7 GB of cache against the same 15.0 GB of weights, and int4 cuts the step from
# 83.7 GB to 34.3 GB, 2.4 times faster. The intensity then rises from about 15 to 36 FLOP/byte:
# whether the step is still bandwidth bound depends on the ridge point, about 7 FLOP/byte on the
# recorded machine (compute bound there) and hundreds on accelerators built for matrix products.
# <!-- END SOLUTION -->

# %% [markdown]
# ## Exercises
#
# 1. Show that with a sliding window (Mistral-7B, $w = 4096$) the lower bound on time per token
#    stops growing past $t = w$, and compute it at this machine's bandwidth.
# 2. At which batch size does a Llama-3-8B decode step reach the ridge point of the recorded
#    roofline? Ignore the cache first, then include it at $t = 2048$.
# 3. Derive $I_{\text{prefill}}$ for a prompt of $T$ tokens exactly from `prefill_traffic`'s
#    formula, and find the $T$ above which prefill is compute bound on this machine.
# 4. Prove the half-step bound $|x - \hat x| \le s/2$, and find the input for which it is tight.
# 5. Why may a RoPE cache become invalid if a serving system changes its position scaling rule?
# 6. llama.cpp's Q4_0 stores a block of 32 weights as 16 bytes of 4-bit codes and one float16
#    scale. Compute the bytes a token of the lesson's model reads with its layers in Q4_0, its
#    bound on this machine, and, from the time beyond the read measured for Q8_0, the tokens per
#    second you expect. What would make the prediction too optimistic?
# 7. Time the four formats again on two threads (`kernels.cpu_thread_limit(2)` and
#    `threadpool_limits(limits=2)`), with the reads on two threads as well (time them by the wall
#    clock then: `time.thread_time` counts one thread). Which points move towards their bound?
#    Which of a token's costs does the second core share, and which stay on the first?
#
# ## References
#
# - Shazeer, N. (2019). Fast Transformer Decoding: One Write-Head is All You Need. (Decoding is
#   bound by memory traffic of keys, values and weights.)
# - Williams, S., Waterman, A., and Patterson, D. (2009). Roofline: An Insightful Visual
#   Performance Model for Multicore Architectures. Communications of the ACM.
# - Pope, R., et al. (2023). Efficiently Scaling Transformer Inference. (Arithmetic intensity of
#   prefill and decode.)
# - Su, J., et al. (2021). RoFormer: Enhanced Transformer with Rotary Position Embedding.
# - Dettmers, T., et al. (2022). LLM.int8(): 8-bit Matrix Multiplication for Transformers at
#   Scale. (Outlier feature dimensions.)
# - Kwon, W., et al. (2023). Efficient Memory Management for Large Language Model Serving with
#   PagedAttention.
