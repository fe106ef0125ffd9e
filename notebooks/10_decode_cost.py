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
#     minutes: 45
#     ids: [K3, K5, K13, K12]
# ---

# %% [markdown]
# # Lesson 10: what a generated token costs
#
# Lesson 3 built the KV cache. This lesson asks what it holds and what each new token costs:
# why keys and values are cached and queries are not, keys stored after their rotation (K3), the
# cost of a prompt against the cost of one new token (K5), why a decode step is bound by memory
# bandwidth rather than arithmetic, measured on this machine (K13), and a cache stored as small
# integers to move fewer bytes (K12).
#
# **Prerequisites:** lessons 3 (KV cache, K2, K6) and 8 (GQA and what it saves, A13).
#
# **Goals:** say which vectors a decode step needs; rebuild a cached RoPE key by hand; count
# prefill and decode work; compute the arithmetic intensity of prefill and decode and the lower
# bound on time per token from bytes and bandwidth; quantise a group to 4 bits by hand and bound
# its error.
#
# **Catalogue IDs:** K3, K5, K13, K12
#
# **Duration:** about 45 minutes.

# %%
import contextlib
import time

import matplotlib.pyplot as plt
import numpy as np

from refmath import kernels
from refmath.attention import sdpa_forward
from refmath.inference.quantized import QuantizedKVCache, decode_with_quantized_cache
from refmath.lessons import catalogued, check, check_function, check_true
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
from refmath.inference.decode import decode_attention

def decode_inputs():
    draw = np.random.default_rng(3)
    inputs = []
    for heads, kv_heads, lengths in ((4, 2, [5, 2, 0]), (4, 1, [6, 3, 1]), (2, 2, [4, 6, 2])):
        k = draw.standard_normal((3, kv_heads, 6, 8))
        v = draw.standard_normal((3, kv_heads, 6, 8))
        for b, length in enumerate(lengths):  # padding: large numbers that must not be read
            k[b, :, length:], v[b, :, length:] = 50.0, -50.0
        inputs.append((draw.standard_normal((3, heads, 8)), k, v, np.array(lengths)))
    return inputs


def interleaved_heads(q, k_cache, v_cache, lengths):
    """A slip: query head r reads key/value head r % g instead of r // (h / g)."""
    heads = np.arange(q.shape[1]) % k_cache.shape[1]
    return decode_attention(q, k_cache[:, heads], v_cache[:, heads], lengths)


def nan_for_empty(q, k_cache, v_cache, lengths):
    """A slip: a sequence with no key divides 0 by 0."""
    out = decode_attention(q, k_cache, v_cache, lengths)
    return np.where(np.asarray(lengths)[:, None, None] == 0, np.nan, out)


check_function("your decode attention", my_decode_attention, decode_attention, inputs=decode_inputs,
               rtol=1e-12, hint="mask the rows at or past each length; query head r reads "
                                "r // (H / G)",
               slips={"the padding read: every sequence attends to all T_max rows":
                          lambda q, k, v, lengths: decode_attention(q, k, v, np.full(len(lengths), 6)),
                      "no 1/sqrt(D) scale": lambda q, k, v, lengths:
                          decode_attention(q, k, v, lengths, scale=1.0),
                      "GQA heads interleaved: head r reads r % g, not r // (h/g)": interleaved_heads,
                      "an empty sequence gives NaN (0 / 0), not 0": nan_for_empty})

# %% [markdown]
# ## K5: the prompt is quadratic, each new token linear
#
# Prefilling a prompt of $P$ tokens is one causal pass: query $i$ meets keys $0..i$, so
# $1 + 2 + \dots + P = P(P+1)/2$ visible pairs per head and layer, $O(P^2)$. (The reference
# computes the whole $P \times P$ score matrix and masks it, $P^2$ scores; a causal kernel skips
# the upper triangle.) A decode step at position $t$ has one query and $t + 1$ keys:
# $O(t\,h\,d_h)$ work per layer, linear in the context.

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
# **Exercise 10.3.** A prompt of $P = 5$ tokens, then 3 decode steps. How many visible pairs per head
# and layer in total? (Prefill, then each step's new query meets all keys so far, itself
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
# dominate the bytes; each sequence's cache pulls $I$ lower at long contexts and large batches). A prefill of $T$ tokens reads the same
# weights once for all $T$ tokens, so $I_{\text{prefill}} \approx 2BT/b$ grows with the prompt.
# `refmath.sizing.decode_step_traffic` and `prefill_traffic` count both; `decode_time_lower_bound`
# divides.

# %%
llama = PRESETS["llama-3-8b"]
step = decode_step_traffic(llama, context=8192)
print(f"Llama-3-8B decode at t = 8192: {step.flops / 1e9:.1f} GFLOP, weights "
      f"{format_bytes(step.weight_bytes)}, cache {format_bytes(step.cache_bytes)}, "
      f"intensity {step.intensity:.2f} FLOP/byte")
for batch in (1, 8, 64):
    print(f"  batch {batch:2}: decode intensity {decode_step_traffic(llama, 8192, batch).intensity:6.1f}")
for tokens_in in (1, 64, 512, 4096):
    print(f"  prefill of {tokens_in:4}: intensity {prefill_traffic(llama, tokens_in).intensity:7.1f}")
assert 1 < step.intensity < 1.3  # the attention FLOPs add a little at t = 8192

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
# the codes, and $\hat x$.

# %% tags=["exercise"]
x = np.array([3.5, -1.2, 0.3, 2.0])
scale_by_hand = ...
x_hat_by_hand = ...  # (4,)
# BEGIN SOLUTION
scale_by_hand = 3.5 / 7
x_hat_by_hand = scale_by_hand * np.clip(np.round(x / scale_by_hand), -7, 7)
# END SOLUTION

# %%
check("10.5a", scale_by_hand)

# %%
check("10.5b", x_hat_by_hand)

# %%
check_true("error at most half a step", lambda x_hat: np.all(np.abs(x - x_hat) <= 0.25),
           "|x - x_hat| <= s / 2", of=x_hat_by_hand)

# %% [markdown]
# Smaller groups mean smaller scales (a group's scale is set by its largest entry), hence smaller
# errors, but more scales to store: each costs 2 bytes, $2/G$ bytes per element on top of the
# $q/8$ of the payload. Dettmers et al. (2022) report a few large-magnitude feature dimensions in
# the activations of large trained models; here we plant such channels: 4 of the 128 are 10 times
# larger than the rest, and only the groups that contain them get coarse steps. The bound
# $|x - \hat x| \le s/2$ holds for every element and every group size.

# %%
from refmath.inference.quantized import dequantize, quantize

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
