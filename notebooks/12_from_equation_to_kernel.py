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
#     minutes: 75
#     ids: [F4]
# ---

# %% [markdown]
# # Lesson 12: from the equation to the kernel
#
# Lesson 3 derived tiled attention (F1-F5) and its backward pass; this lesson follows that
# algorithm into the compiled kernels of `refmath.kernels` (C++ with OpenMP; CUDA where built).
# On the way the arithmetic becomes float32, each thread needs scratch memory for its tile, and a
# decode step, with one query row, is split across the cores and merged with F3. The C++ cells
# need the compiled module `refmath._C` and say so when it is missing. $D$, $H$, $G$ are the
# catalogue's $d_h$, $h$, $g$.
#
# **Prerequisites:** lessons 1 (attention, A2), 3 (online softmax and FlashAttention, F1-F5),
# 8 (the GQA head map, A10) and 9 (why a running sum needs float32).
#
# **Goals:** judge a float32 kernel by the float32 rule; say which quantities a kernel keeps in
# float32; count the scratch bytes of a tile from its block sizes and $D$; write the split-K decode
# and its F3 merge; predict how many splits the CPU kernel chooses; read its timings with 8 and
# 16 vector lanes.
#
# **Catalogue IDs:** F4
#
# **Duration:** 75 minutes

# %%
import contextlib
import time

import matplotlib.pyplot as plt
import numpy as np

from refmath import flash, kernels
from refmath.attention import causal_mask, gqa_head_map, sdpa_forward
from refmath.lessons import check, check_function

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # without it, the timings use whatever thread pools the libraries start
    threadpool_limits = None

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)

HAVE_CPU = kernels.cpu_available()
print("C++ kernels available:", HAVE_CPU)
if HAVE_CPU:
    print("vector lanes in use:", kernels.cpu_vector_lanes(), "  threads:", kernels.cpu_threads())

# %% [markdown]
# ## F4 in float32: how close is close enough
#
# Two sequences of $T = 200$ tokens, 8 query heads reading 2 key/value heads (A10), $D = 32$,
# causal, computed three ways: the dense float64 reference `sdpa_forward`, the same dense code on
# float32 inputs (a *plain* float32 implementation), and the C++ kernel, which takes float32,
# computes in float32 and works on tiles of 128 query rows by 128 keys. The first three entries of
# one output row:

# %%
B, H, G, T, D = 2, 8, 2, 200, 32
heads = gqa_head_map(H, G)  # query head r reads key/value head r // (H / G)
qg = rng.standard_normal((B, H, T, D))
kg, vg = rng.standard_normal((B, G, T, D)), rng.standard_normal((B, G, T, D))
ref_o, _ = sdpa_forward(qg, kg[:, heads], vg[:, heads], mask=causal_mask(T))
_, ref_lse = flash.flash_attention_forward(qg, kg, vg, causal=True)  # lesson 3's tiles, float64
qg32, kg32, vg32 = (x.astype(np.float32) for x in (qg, kg, vg))
np32_o, _ = sdpa_forward(qg32, kg32[:, heads], vg32[:, heads],
                         mask=causal_mask(T, dtype=np.float32))
with np.printoptions(precision=9):
    print("float64 reference:", ref_o[1, 3, 150, :3])
    print("float32 NumPy:    ", np32_o[1, 3, 150, :3])
    if HAVE_CPU:
        og_c, lseg_c = kernels.flash_attention_forward(qg32, kg32, vg32, causal=True)
        print("C++ kernel:       ", og_c[1, 3, 150, :3])
    else:
        print("skipped: refmath._C is not built, so there is no C++ kernel to compare")

# %% [markdown]
# Neither float32 answer is the reference. The kernel tests use FlashAttention's rule, moved up
# one precision: against float64, the kernel's largest error may be at most
#
# $$c \cdot \max |o_{\text{NumPy float32}} - o_{\text{float64}}| \;+\; 4\, u\, M,$$
#
# $c = 2$ for outputs, 3 for gradients. The plain implementation rounds where the kernel does, so a
# correct kernel stays within a small multiple of its error, while a bug (a wrong key, scale or
# mask) moves the answer by a fraction of its size. The second term is a floor for inputs on which
# NumPy happens to be exact: four roundings of the largest number summed, $M$ ($\max |v|$ for an
# output), with $u = 2^{-24}$ float32's unit roundoff, half the gap $2^{-23}$ after 1.
# (`refmath.conformance`, catalogue C1, holds anyone's kernel to a rule of this kind.)

# %%
U32 = 2.0**-24  # float32's unit roundoff

# %% [markdown]
# **Exercise 12.1.** Compute the rule's bound for the output $o$ of this example, from `ref_o`
# (float64), `np32_o` (plain float32) and the values `vg`.

# %% tags=["exercise"]
bound_o = ...  # a number: the largest error the rule allows the kernel's o
# BEGIN SOLUTION
numpy_error = np.abs(np32_o.astype(np.float64) - ref_o).max()
bound_o = 2 * numpy_error + 4 * U32 * np.abs(vg).max()
# END SOLUTION

# %%
check("12.1", bound_o)

# %%
big_v = np.abs(vg).max()  # M for the outputs below

# %% [markdown]
# Every kernel result below is judged by this rule. For the logsumexp, $M = 1 + \max|\mathrm{lse}|$:
# it is $m + \log l$, and both terms carry a rounding of their own size.

# %%
def check_float32(label, kernel_out, ref64, numpy32, factor, magnitude):
    """Assert: kernel error <= factor x (NumPy float32 error) + 4 u M, both against float64.
    It prints the kernel's error and the verdict, not the bound: the bound on o is exercise 12.1's
    answer."""
    kernel_err = np.abs(np.asarray(kernel_out, dtype=np.float64) - ref64).max()
    numpy_err = np.abs(np.asarray(numpy32, dtype=np.float64) - ref64).max()
    bound = factor * numpy_err + 4 * U32 * magnitude
    print(f"{label:>9s}: kernel error {kernel_err:.2e}, "
          + ("within the rule's bound" if kernel_err <= bound else "OVER the rule's bound"))
    assert kernel_err <= bound, label


s32 = (qg32 @ kg32[:, heads].swapaxes(-1, -2)) / np.float32(np.sqrt(D))
lse32 = np.log(np.exp(np.where(np.tril(np.ones((T, T), dtype=bool)), s32, -np.inf)).sum(axis=-1))
if HAVE_CPU:
    check_float32("o", og_c, ref_o, np32_o, 2, big_v)
    check_float32("lse", lseg_c, ref_lse, lse32, 2, 1 + np.abs(ref_lse).max())
else:
    print("skipped: refmath._C is not built")

# %% [markdown] tags=["question"]
# **Question.** Why compare the kernel with a multiple of plain float32's error on the same
# inputs rather than with a fixed tolerance such as `atol=1e-5`?
#
# <!-- BEGIN SOLUTION -->
# Rounding errors scale with the inputs: with the size of the values, the length of the sums ($T$,
# $D$) and how peaked the softmax is. A fixed tolerance is too loose where the errors are small (a
# bug that moves a small output by $10^{-6}$ passes) and too tight where they are large (a correct
# kernel on long rows fails). The plain implementation measures the unavoidable rounding on exactly
# these inputs, and a kernel that rounds in the same places cannot do much worse unless it computes
# something else.
# <!-- END SOLUTION -->

# %% [markdown]
# ## What must stay float32
#
# The tensor-core CUDA versions take fp16 or bf16 inputs, but multiply them *accumulating in
# float32*, and keep $m$, $l$, $u$ and the logsumexp in float32; only the weights $P = e^{s - m}$
# are rounded, as the input of $P V$. Lesson 9 showed a float16 running sum stalling. Here, one row
# of 4096 keys with float16 values, against float64 arithmetic on the same values:

# %%
n_keys = 4096
q_row = rng.standard_normal(64)
k_row, v_row = rng.standard_normal((n_keys, 64)), rng.standard_normal((n_keys, 64))
v16 = v_row.astype(np.float16)
scores = k_row @ q_row / 8
p = np.exp(scores - scores.max())  # weights in [0, 1]
exact = p @ v16.astype(np.float64) / p.sum()
p32 = p.astype(np.float32)  # the tensor-core way: P rounded to float16, sums in float32
rounded_p = (p32.astype(np.float16).astype(np.float32) @ v16.astype(np.float32)) / p32.sum()
p16 = p.astype(np.float16)  # everything in float16: u and l summed key after key
u16, l16 = np.zeros(64, np.float16), np.float16(0)
for j in range(n_keys):
    u16, l16 = u16 + p16[j] * v16[j], l16 + p16[j]
all_half = u16.astype(np.float64) / np.float64(l16)
size = np.abs(exact).max()
err_rounded_p, err_all_half = (np.abs(o - exact).max() / size for o in (rounded_p, all_half))
print(f"l: exact {p.sum():.1f}, float16 running sum {float(l16):.1f}")
print(f"largest error of o over max |o|: P rounded to float16 {err_rounded_p:.1e}; "
      f"u and l summed in float16 {err_all_half:.1e}")
assert err_rounded_p < 1e-3 < 3e-2 < err_all_half

# %% [markdown] tags=["question"]
# **Question.** Why may each weight $P_{ij}$ be rounded to 16 bits when $l$ and $u$ may not?
#
# <!-- BEGIN SOLUTION -->
# Rounding a weight changes that one term by a relative $2^{-11}$ (float16) or $2^{-8}$
# (bfloat16), so the output, a weighted average of the values, moves by at most that fraction of
# the largest value, however many keys there are. A running sum is rounded at every addition by a relative $u$ of the *sum*,
# which grows; once it is large next to the terms, whole terms are lost, and the error grows with
# $T$. So every accumulator ($Q K^\top$ over $D$, $l$ and $u$ over the keys, $dK$, $dV$, $dQ$ in
# the backward) stays float32, and so does the logsumexp, from which the backward rebuilds every
# weight.
# <!-- END SOLUTION -->

# %% [markdown]
# ## F4 in base 2: the kernel's exponentials
#
# The kernels never call `exp`: since $e^x = 2^{x \log_2 e}$, they fold $\log_2 e$ into the scale
# once, keep $m$ and $l$ in base 2 and return $\mathrm{lse} = \ln 2\,(m + \log_2 l)$. A power of
# two needs no library call, so the loop vectorises: with $n = \mathrm{round}(x)$, $f = x - n$,
# $2^n$ is an exponent field written directly and $2^f$ a degree-7 Taylor polynomial
# (`exp2_taylor`, `csrc/tile_math.h`), accurate far below one float32 rounding:

# %%
LOG2E = np.log2(np.e)


def exp2_like_the_kernel(x):
    """2^x as the C++ kernels compute it: 2^round(x) times a degree-7 polynomial for 2^f."""
    x = np.clip(np.asarray(x, dtype=np.float64), -127.0, 127.0)
    n = np.round(x)
    f = x - n
    poly = sum((f * np.log(2)) ** i / np.prod(np.arange(1, i + 1)) for i in range(8))
    return np.ldexp(poly, n.astype(int))


xs = np.linspace(-30, 30, 2001)
rel = np.abs(exp2_like_the_kernel(xs * LOG2E) / np.exp(xs) - 1)
print(f"largest relative error over [-30, 30]: {rel.max():.1e} (float32 rounds at {U32:.1e})")
assert rel.max() < 1e-8

# %% [markdown]
# ## F4: the scratch memory of a tile
#
# Besides one logsumexp per row, tiled attention needs scratch for the tile at hand: in the
# kernel, a fixed block per thread. A work item of the C++ forward pass is $B_q = 128$ query rows
# of one (sequence, head), walking the keys in tiles of $B_k = 128$; its thread holds, in float32
# (`forward_tile_impl`, `csrc/flash_cpu.cpp`):
#
# - `S`: the tile's scores, then its weights, $B_q \times B_k$;
# - `U`: the unnormalised output rows $u$, $B_q \times D$, and `PV`, this tile's $P V$, also
#   $B_q \times D$;
# - `m`, `l`, `alpha`: running maximum, running sum, the tile's rescaling factor, $B_q$ each;
# - `KT`: the key tile copied transposed, $D \times B_k$ (so that $Q K^\top$ reads both operands
#   along rows), and `Vs`: the value tile copied in column strips, $B_k \times D$.
#
# The block is rounded up to a multiple of 16 floats (one 64-byte cache line), so that each
# thread's block starts on a line of its own. Nothing in it depends on $T$.

# %% [markdown]
# **Exercise 12.2.** How many bytes of scratch does one thread of the C++ forward pass hold at
# $D = 128$?

# %% tags=["exercise"]
scratch_128 = ...  # bytes per thread
# BEGIN SOLUTION
floats = 128 * 128 + 2 * 128 * 128 + 3 * 128 + 2 * 128 * 128
scratch_128 = 4 * (-(-floats // 16) * 16)
# END SOLUTION

# %%
check("12.2", scratch_128)

# %% [markdown]
# The count, against the memory of the attention call itself. (The tests hold the kernel's own
# expression for the block, in `csrc/flash_cpu.cpp`, to the same count, so the list above and the
# kernel cannot drift apart unnoticed.) The dotted line is your answer to 12.2, 16 threads of it,
# once you have one.

# %%
T_range = 2 ** np.arange(10, 18)
fig, ax = plt.subplots(figsize=(5.5, 3.4), layout="constrained")
ax.loglog(T_range, 4 * 4 * T_range**2 / 2**20, "o-", label="scores, $H T^2$ float32")
ax.loglog(T_range, 4 * 4 * T_range * 129 / 2**20, "s-", label="o and lse, $H T (D + 1)$ float32")
if scratch_128 is not Ellipsis:  # drawn from your answer only: the cell computes no scratch itself
    ax.axhline(16 * scratch_128 / 2**20, color="gray", ls=":",
               label="your kernel scratch, 16 threads")
ax.set(xlabel="sequence length T", ylabel="MiB",
       title="memory of one attention call, H = 4, D = 128")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# A few hundred KB at $D = 64$ or 128, about the size of a current x86 core's level-2 cache,
# where a thread's tile stays while the thread works on it. On a GPU the same count decides how
# many thread blocks fit on a multiprocessor: CUDA v2 keeps $Q$ (float32) for 32 rows, a 32-key tile of $K$ and of $V$ and the
# $32 \times 32$ weights in shared memory, 36,992 bytes for fp16 at $D = 128$, where an H100 or
# H200 multiprocessor has at most 228 KB.

# %% [markdown]
# ## K2 and F3: a decode step, split across the cores
#
# A decode step (K2) has one query row per head, and there may be fewer (sequence, key/value
# head) pairs than cores. So the kernel cuts each sequence's $n$ keys into `splits` chunks,
# separate work items (*split-K*; flash-decoding on GPUs), each reduced to $(m_s, l_s, u_s)$ (F2);
# a short second loop merges them (F3):
#
# $$m = \max_s m_s, \qquad l = \sum_s e^{m_s - m}\, l_s, \qquad
#   o = \frac{1}{l} \sum_s e^{m_s - m}\, u_s .$$
#
# A chunk is $c = \lceil n / \text{splits} \rceil$ keys, split $s$ taking keys
# $[\min(n, s c), \min(n, s c + c))$ (`csrc/decode_cpu.cpp`): the last chunks may be short or
# empty, and an empty one, $m_s = -\infty$, $l_s = u_s = 0$, must add nothing.

# %% tags=["exercise"]
# Exercise 12.3: the split-K decode of one query row q (D,) over n keys k (n, D) and values v (n, D),
# scale 1/sqrt(D): cut the keys into `splits` chunks as above, reduce each to (m_s, l_s, u_s),
# merge, and return o (D,), in base e or base 2. The check runs 1000 keys in 4 splits, 10 keys in
# 4 (chunks of 3, 3, 3, 1), 3 keys in 4 (one split empty) and 5 keys in 1, against dense attention.
def my_split_decode(q, k, v, splits):
    o = ...
    # BEGIN SOLUTION
    n, d = k.shape
    chunk = -(-n // splits)
    m_s, l_s, u_s = [], [], []
    for s in range(splits):
        lo, hi = min(n, s * chunk), min(n, s * chunk + chunk)
        if hi == lo:  # an empty split: the empty state, which adds nothing
            m_s.append(-np.inf), l_s.append(0.0), u_s.append(np.zeros(d))
            continue
        split_scores = k[lo:hi] @ q / np.sqrt(d)
        w = np.exp(split_scores - split_scores.max())
        m_s.append(split_scores.max()), l_s.append(w.sum()), u_s.append(w @ v[lo:hi])
    alpha = np.exp(np.array(m_s) - max(m_s))
    o = alpha @ np.array(u_s) / (alpha @ np.array(l_s))
    # END SOLUTION
    return o


# %%
from refmath.inference.decode import decode_attention

check("12.3", my_split_decode)

# %% [markdown]
# Now the kernel (`decode_attention(..., backend="cpu")`, or `kernels.decode(..., splits=...)`)
# on two sequences of 4096 and 1000 cached tokens, $H = 8$, $G = 2$, $D = 64$; slots past a length
# hold NaN, which must never be read. Keys 3000 to 3099 of sequence 0 are pushed along the query
# of head 5, so that they take most of its softmax mass.

# %%
B, H, G, D, T_max = 2, 8, 2, 64, 4096
lengths = np.array([4096, 1000])
heads = gqa_head_map(H, G)
q_dec = rng.standard_normal((B, H, D))
k_cache, v_cache = rng.standard_normal((B, G, T_max, D)), rng.standard_normal((B, G, T_max, D))
k_cache[0, heads[5], 3000:3100] += q_dec[0, 5]  # keys that head 5 of sequence 0 looks for
for b, n_b in enumerate(lengths):
    k_cache[b, :, n_b:] = v_cache[b, :, n_b:] = np.nan
q_dec32, k_cache32, v_cache32 = (x.astype(np.float32) for x in (q_dec, k_cache, v_cache))
ref_dec = decode_attention(q_dec, k_cache, v_cache, lengths)
np32_dec = decode_attention(q_dec32, k_cache32, v_cache32, lengths)
if HAVE_CPU:
    on_cpu = decode_attention(q_dec32, k_cache32, v_cache32, lengths, backend="cpu")
    np.testing.assert_array_equal(on_cpu, kernels.decode(q_dec32, k_cache32, v_cache32, lengths))
    for splits in (1, 4, 16):
        o_splits = kernels.decode(q_dec32, k_cache32, v_cache32, lengths, splits=splits)
        assert np.isfinite(o_splits).all()  # no NaN slot was read
        check_float32(f"splits={splits}", o_splits, ref_dec, np32_dec, 2,
                      np.nanmax(np.abs(v_cache)))
else:
    print("skipped: refmath._C is not built")

# %% [markdown]
# Each split enters the merge with the weight $e^{m_s - m} l_s / l$, its share of the row's
# softmax mass. For head 5 of sequence 0 in 16 splits of 256 keys, nearly all of it lies in the two
# splits that hold keys 3000 to 3099, which is why averaging the splits' outputs is so wrong:

# %%
# each split's (m_s, l_s, u_s) by the library's F2 (chunks of ceil(n / splits) keys, an empty split
# the empty state), and their F3 merge: the same functions that check 12.3's slips
from refmath.lessons.expected.lesson12_from_equation_to_kernel import merged, split_states
from refmath.softmax import online_softmax_result

states = split_states(q_dec[0, 5], k_cache[0, heads[5], :4096], v_cache[0, heads[5], :4096], 16)
shares = np.array([np.exp(st.m - max(s.m for s in states)) * st.l for st in states])
shares /= shares.sum()
averaged = np.mean([online_softmax_result(st) for st in states], axis=0)
print(f"shares of splits 11 and 12: {shares[11]:.3f}, {shares[12]:.3f}; largest error of the merge "
      f"{np.abs(merged(states) - ref_dec[0, 5]).max():.1e}, of the average "
      f"{np.abs(averaged - ref_dec[0, 5]).max():.1e}")
np.testing.assert_allclose(merged(states), ref_dec[0, 5], rtol=1e-12, atol=1e-14)
assert shares[11] + shares[12] > 0.9

fig, ax = plt.subplots(figsize=(5.5, 3), layout="constrained")
ax.bar(np.arange(16), shares)
ax.axvspan(3000 / 256 - 0.5, 3100 / 256 - 0.5, color="tab:orange", alpha=0.3,
           label="keys 3000-3099")
ax.set(xlabel="split s (256 keys each)", ylabel=r"$e^{m_s - m}\, l_s / l$", yscale="log",
       title="each split's weight in the merge: sequence 0, head 5")
ax.legend(fontsize=8)
plt.show()

# %% [markdown] tags=["question"]
# **Question.** The merge is exact in real arithmetic (lesson 3). Why do `splits=1`, 4 and 16 give
# different float32 answers, and why is each the same bits on every run, whatever the number of
# threads?
#
# <!-- BEGIN SOLUTION -->
# Floating-point addition is not associative: other chunks sum the same terms in another order,
# with other rescalings, so they round differently (each within the float32 rule). For a fixed
# count, each split is reduced by one thread in key order and the merge takes the splits in
# order, so the order of every operation is set by the data and the count, not by which thread
# took which split, or when.
# <!-- END SOLUTION -->

# %% [markdown]
# How many splits? Too few leave cores idle; too many make each split so short that its fixed cost
# shows. With `splits=None` the CPU kernel (`choose_splits`, `csrc/decode_cpu.cpp`) aims at about
# 8 work items per thread, so that uneven items (and a thread the system pauses) even out; a work
# item is a (sequence, key/value head) pair and a split (a GQA group's query heads go together
# and read each key once, A10); and no split may be shorter than 512 keys:
#
# $$\text{splits} = \max\!\Big(1,\ \min\!\Big(\Big\lceil \frac{8 \cdot \text{threads}}{B\, G}
#   \Big\rceil,\ \Big\lfloor \frac{n_{\max}}{512} \Big\rfloor\Big)\Big),$$
#
# with $n_{\max}$ the longest sequence. On one thread there is nothing to even out, and every
# split only adds its fixed cost: there the kernel takes one split.

# %% [markdown]
# **Exercise 12.4.** With 16 kernel threads, how many splits are chosen for (a) 3 sequences of 32768
# tokens, 32 query heads reading 8 key/value heads, and (b) one sequence of 4096 tokens with one
# key/value head (MQA)? Give the pair.

# %% tags=["exercise"]
splits_chosen = ...  # (splits for (a), splits for (b))
# BEGIN SOLUTION
splits_a = max(1, min(-(-8 * 16 // (3 * 8)), 32768 // 512))
splits_b = max(1, min(-(-8 * 16 // (1 * 1)), 4096 // 512))
splits_chosen = (splits_a, splits_b)
# END SOLUTION

# %%
check("12.4", splits_chosen)

# %% [markdown]
# The rule can be put to the kernel on this machine: a fixed count gives fixed bits (the question
# above) and another count other bits, so the count whose bits equal those of `splits=None` is
# the one the kernel chose. Work out what your rule gives for each case below, with this
# machine's thread count, before you read the line. (The tests hold the kernel to the rule.)

# %%
if HAVE_CPU:
    threads = kernels.cpu_threads()
    for batch, kv_heads, n in ((1, 1, 32768), (1, 8, 8192), (4, 2, 3000)):
        qs = rng.standard_normal((batch, 4 * kv_heads, 64)).astype(np.float32)
        ks, vs = (rng.standard_normal((batch, kv_heads, n, 64)).astype(np.float32) for _ in "kv")
        auto = kernels.decode(qs, ks, vs, [n] * batch)
        # every count from 1 to one past the 512-key floor's limit, tried against splits=None
        same = [s for s in range(1, n // 512 + 2)
                if np.array_equal(auto, kernels.decode(qs, ks, vs, [n] * batch, splits=s))]
        print(f"B = {batch}, G = {kv_heads}, n = {n}, {threads} threads: "
              f"splits=None has the bits of splits = {same}")
else:
    print("skipped: refmath._C is not built")

# %% [markdown]
# A GPU wants more pieces: a multiprocessor needs several thread blocks at once to hide its memory
# latency. The CUDA decode (`_auto_splits`, `refmath/kernels.py`) aims at 10 blocks per
# multiprocessor and no split under 256 tokens: on a 132-multiprocessor H200, one sequence of
# 32768 tokens with 8 key/value heads gets $\min(\lceil 1320/8 \rceil, 32768/256) = 128$ splits,
# where 16 CPU threads take 16. The paged kernel (`kernels.paged_decode`, K10) splits its list of
# pages instead of its keys, by a rule of the same kind.
#
# ## F4: what it buys in time, with 8 and 16 lanes
#
# Dense NumPy, lesson 3's tiled NumPy ($16 \times 16$ tiles, a Python loop each, so only the two
# smallest lengths) and the C++ kernel, timed here and now: $B = 1$, $H = 4$, $D = 64$, causal,
# float32. Thread pools sized to every core fight with other work on a shared machine, so each is
# pinned to one thread (threadpoolctl, when installed; or `OMP_NUM_THREADS=1
# OPENBLAS_NUM_THREADS=1` before Python starts); each time is a median of 5 runs (1 for the tiled
# NumPy). Nothing is asserted about them.

# %%
def median_seconds(fn, repeats=5):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def one_thread():
    return threadpool_limits(limits=1) if threadpool_limits else contextlib.nullcontext()


lengths_t = [128, 256, 512, 1024]
timings = {"dense NumPy": [], "tiled NumPy": [], "C++ kernel": []}
with one_thread():
    for T in lengths_t:
        qt, kt, vt = (rng.standard_normal((1, 4, T, 64)).astype(np.float32) for _ in range(3))
        mask = causal_mask(T, dtype=np.float32)
        timings["dense NumPy"].append(median_seconds(lambda: sdpa_forward(qt, kt, vt, mask=mask)))
        timings["tiled NumPy"].append(
            median_seconds(lambda: flash.flash_attention_forward(qt, kt, vt, causal=True), 1)
            if T <= 256 else np.nan)
        timings["C++ kernel"].append(
            median_seconds(lambda: kernels.flash_attention_forward(qt, kt, vt, causal=True))
            if HAVE_CPU else np.nan)
for name, ts in timings.items():
    print(f"{name:12s}", "  ".join(f"T={T}: {t * 1e3:7.2f} ms" for T, t in zip(lengths_t, ts)))

fig, ax = plt.subplots(figsize=(5.5, 3.6), layout="constrained")
for (name, seconds), marker in zip(timings.items(), "os^"):
    if not np.all(np.isnan(seconds)):
        ax.loglog(lengths_t, np.array(seconds) * 1e3, marker + "-", label=name)
ax.minorticks_off()  # only the four lengths as ticks: no overlapping minor labels
ax.set_xticks(lengths_t, [str(T) for T in lengths_t])
ax.set(xlabel="sequence length T", ylabel="ms, median",
       title="causal attention forward, H = 4, D = 64, float32, 1 thread")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Each C++ kernel is compiled for vectors of 8 float32 lanes (AVX2) and of 16 (AVX-512) and runs
# the widest the CPU has; `kernels.cpu_vector_lanes(8)` makes an AVX-512 CPU run the 8-lane copy,
# as the tests do. Both, timed at $T = 1024$ on one thread:

# %%
if HAVE_CPU and kernels.cpu_vector_lanes() == 16:
    by_lanes = {}
    try:
        for lanes in (16, 8):
            assert kernels.cpu_vector_lanes(lanes) == lanes
            with one_thread():
                by_lanes[lanes] = median_seconds(
                    lambda: kernels.flash_attention_forward(qt, kt, vt, causal=True))
    finally:
        kernels.cpu_vector_lanes(16)
    print(f"T = 1024: 16 lanes (AVX-512) {by_lanes[16] * 1e3:.2f} ms, 8 lanes (AVX2) "
          f"{by_lanes[8] * 1e3:.2f} ms: the 8-lane copy takes "
          f"{by_lanes[8] / by_lanes[16]:.2f} times as long")
elif HAVE_CPU:
    print("this CPU has no AVX-512: the kernels run their 8-lane copy only")
else:
    print("skipped: refmath._C is not built")

# %% [markdown]
# The ratio belongs to this machine; nothing makes it 2. Twice the lanes halve the instructions
# of the vectorised loops only (the $2^x$ polynomial, the tile products), not each row's
# rescaling, the tile copies or the waits for memory, and some CPUs lower their clock under
# 512-bit instructions; the two copies are also compiled separately, so they differ in more than
# their width. Measured ratios have fallen below 2 and, on one machine, just above it (2.17). On
# some machines the two copies are within noise of each other; the 8-lane copy
# is there for CPUs without AVX-512, and for the tests.
#
# ## On a GPU: the CUDA ladder
#
# Where CUDA was found at build time, the forward pass is a ladder of versions,
# `csrc/cuda/flash_vN.cu`, each held to the same float64 reference and opening with what it changes
# and why that is faster (the documentation's kernels page shows these comments): v1, a thread per
# query row; v2, 32-key tiles of $K$ and $V$ shared by 32 rows in shared memory; v3, both products
# on the tensor cores, 16-bit in and float32 accumulated; v4, the next tile loaded while the
# current one is computed. `kernels.flash_ladder()` lists those built; a CuPy array passed to
# `kernels.flash_attention_forward(..., version="v2")` runs that one.

# %%
for rung in kernels.flash_ladder():
    print(f"{rung.name}: {rung.adds}")
print(kernels.cuda_build_info())

# %% [markdown]
# ## Exercises
#
# 1. The backward pass holds `padded_floats(2 Bq Bk + 6 max(Bq, Bk) D + max(Bq, Bk))` floats per
#    thread (`flash_backward_cpu`). Name its buffers from `backward_kv_tile_impl`, compute the bytes
#    at $D = 64$ and 128, and say whether they fit a 512 KiB level-2 cache.
# 2. Bound the relative error of the degree-7 polynomial for $2^f$ on $|f| \le 1/2$ by the first
#    omitted Taylor term; compare it with the error measured above and with $u = 2^{-24}$.
# 3. On a 132-multiprocessor GPU, how many splits does `_auto_splits` choose for 64 sequences of
#    2048 tokens with 8 key/value heads? From what batch size on does it stop splitting?
# 4. From your timings, estimate the exponent $k$ in $t \propto T^k$ between $T = 512$ and 1024
#    for dense NumPy and for the kernel. Which term of the cost explains each?
#
# ## References
#
# - Dao, T., et al. (2022). FlashAttention: Fast and Memory-Efficient Exact Attention with
#   IO-Awareness. (Tiling and the online softmax; the flash-attention repository's tests hold the
#   kernel to twice the error of a plain implementation in the same precision.)
# - Dao, T. (2023). FlashAttention-2: Faster Attention with Better Parallelism and Work
#   Partitioning. (The work split across thread blocks and warps.)
# - Dao, T., Haziza, D., Massa, F., and Sizov, G. (2023). Flash-Decoding for long-context
#   inference. (Splitting the keys of a decode step and merging the pieces.)
# - Milakov, M., and Gimelshein, N. (2018). Online normalizer calculation for softmax.
# - Higham, N. J. (2002). Accuracy and Stability of Numerical Algorithms, 2nd ed., chapters 2
#   and 4. (Unit roundoff; the error of a floating-point sum.)
