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
#     ids: [F4]
# ---

# %% [markdown]
# # Lesson 12: from the equation to the kernel
#
# Attention is one line of mathematics, $O = \mathrm{softmax}(Q K^\top / \sqrt{D} + M)\, V$
# (catalogue A2). This lesson follows that line through three programs that compute it: the dense
# NumPy reference, which builds the whole $T \times T$ score matrix; the tiled NumPy
# FlashAttention of lesson 3, which never does (F1-F5); and the C++/OpenMP kernel behind
# `refmath.kernels`, which runs the same tiles in float32, in base 2, on every core. It derives
# the FlashAttention backward pass from the logsumexp (F4) and checks the kernel's gradients. Then
# the decode step (K2): one query against a long cache, split across the cores and merged by F3,
# read either contiguously or through a page table (K10), with the query heads of a GQA group
# sharing their key/value head (A10). Finally what the kernel buys in time and in memory, and how
# the CUDA versions climb the same ladder on a GPU.
#
# The C++ parts need the compiled module `refmath._C`. Without it, those cells print that they
# were skipped and the NumPy parts still run. Here $D$, $H$, $G$ are the catalogue's $d_h$, $h$,
# $g$, as in the code.
#
# **Prerequisites:** lessons 1 (attention backward, A8), 3 (online softmax and FlashAttention,
# F1-F5; the paged cache, K10) and 8 (GQA's head map and head-sum, A10).
#
# **Goals:** judge a float32 kernel against a float64 reference; compute exponentials in base 2 as
# the kernel does; rebuild the softmax weights from the logsumexp and derive
# $\delta_i = dO_i \cdot O_i$; merge split-K decode statistics; read timings and memory of the
# three programs with the thread count pinned.
#
# **Catalogue IDs:** F4
#
# **Duration:** about 45 minutes.

# %%
import contextlib
import time
import tracemalloc

import matplotlib.pyplot as plt
import numpy as np

from refmath import flash, kernels
from refmath.attention import causal_mask, gqa_head_map, sdpa_backward, sdpa_forward
from refmath.inference.decode import decode_attention
from refmath.lessons import check_close, check_function, check_true
from refmath.softmax import (
    OnlineSoftmaxState,
    online_softmax_block,
    online_softmax_merge,
    online_softmax_result,
)

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
print("build:", kernels.build_info())

# %% [markdown]
# The kernels compute in float32, so "the same answer" needs a yardstick. The one used here (and
# in the project's kernel tests) is the FlashAttention test suite's rule moved up one precision
# (there: a float32 reference and PyTorch in fp16/bf16; here: a float64 reference and plain dense
# float32 NumPy). The kernel's worst error against the reference may be at most a small factor
# (2 for outputs, 3 for gradients) times the float32 NumPy error, plus a floor of four float32
# roundings, $4 u M$ with $u = 2^{-24}$ and $M$ the size of the numbers being summed, for inputs
# on which NumPy happens to be exact.

# %%
U32 = 2.0**-24


def check_float32(label, kernel_out, ref64, numpy32, factor, magnitude):
    """Assert: kernel error <= factor x (NumPy float32 error) + 4 u M, against float64."""
    kernel_err = np.abs(np.asarray(kernel_out, dtype=np.float64) - ref64).max()
    numpy_err = np.abs(np.asarray(numpy32, dtype=np.float64) - ref64).max()
    bound = factor * numpy_err + 4 * U32 * magnitude
    print(f"{label:>4s}: kernel error {kernel_err:.2e}   NumPy float32 error {numpy_err:.2e}   "
          f"bound {bound:.2e}")
    assert kernel_err <= bound, label


# %% [markdown]
# ## A2 and F4: one attention, three programs
#
# Six tokens, head width $D = 4$, a causal mask. The entries of $Q$, $K$ and $V$ are small
# integers and the scale is $1/\sqrt{4} = 1/2$, so every score is a multiple of one half and can
# be read off by hand. Two rows are worth doing on paper:
#
# - Row 0 sees only key 0, so its weight is exactly 1: $o_0 = v_0$, and its logsumexp is the
#   score itself, $\mathrm{lse}_0 = \log e^{s_{00}} = s_{00}$.
# - Row 1 sees keys 0 and 1. Its two scores below are both $-1$, so the weights are
#   $(1/2, 1/2)$, $o_1 = (v_0 + v_1)/2$ and $\mathrm{lse}_1 = \log(2 e^{-1}) = -1 + \ln 2 = -0.3069$.

# %%
T, D = 6, 4
q, k, v = (rng.integers(-1, 3, size=(1, 1, T, D)).astype(np.float64) for _ in range(3))
S = q[0, 0] @ k[0, 0].T / np.sqrt(D)
print("S = Q K^T / 2 (the upper triangle is masked):\n",
      np.where(np.tril(np.ones((T, T))), S, np.nan))
lse_by_hand = np.array([S[0, 0], np.log(np.exp(S[1, 0]) + np.exp(S[1, 1]))])
print("lse of rows 0 and 1 by hand:", lse_by_hand)
assert S[0, 0] == 1.5 and S[1, 0] == S[1, 1] == -1.0

# %% [markdown]
# The dense reference, `sdpa_forward`, builds that $6 \times 6$ matrix, masks it and softmaxes it.
# The tiled reference, `refmath.flash.flash_attention_forward`, walks $2 \times 2$ tiles of it with
# the online softmax and never holds more than one tile (its largest temporary, 8 numbers, is one
# tile's weights times its values, $2 \times D$): with three query tiles and three key tiles it
# computes the six tiles on or below the diagonal and skips the three above it (F5). Both run in
# float64 and agree to rounding. The tiled one also returns the logsumexp of each row,
# $\mathrm{lse}_i = \log \sum_j e^{s_{ij}}$, the one number per row that its backward pass will
# need.

# %%
dense, _ = sdpa_forward(q, k, v, mask=causal_mask(T))
counters = flash.FlashCounters()
tiled, lse = flash.flash_attention_forward(q, k, v, causal=True, block_q=2, block_k=2,
                                           counters=counters)
print("o (dense):\n", dense[0, 0])
print("lse (tiled):", lse[0, 0])
print(f"tiles computed {counters.tiles_computed}, skipped {counters.tiles_skipped}, largest "
      f"temporary {counters.largest_temporary} numbers (the score matrix holds {T * T})")
np.testing.assert_allclose(tiled, dense, rtol=1e-13, atol=1e-15)
np.testing.assert_array_equal(dense[0, 0, 0], v[0, 0, 0])  # row 0: weight 1 on key 0
np.testing.assert_allclose(dense[0, 0, 1], (v[0, 0, 0] + v[0, 0, 1]) / 2, rtol=1e-15)
np.testing.assert_allclose(lse[0, 0, :2], [1.5, -1 + np.log(2)], rtol=1e-15)
assert (counters.tiles_computed, counters.tiles_skipped) == (6, 3)
assert counters.largest_temporary == 2 * D  # one tile's weights times its values

# %% [markdown]
# The third program is the C++ kernel, `refmath.kernels.flash_attention_forward`. It takes
# float32 arrays (and checks that it got them), computes in float32 and returns float32 $o$ and
# $\mathrm{lse}$. Its tiles are 128 query rows by 128 keys, so this small example is a single
# tile; the larger check after it, $T = 200$ with a GQA layout (8 query heads reading 2 key/value
# heads, A10), cuts tiles at a length that 128 does not divide. Both are judged by the float32 rule
# against the float64 dense reference.

# %%
q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
dense32, _ = sdpa_forward(q32, k32, v32, mask=causal_mask(T, dtype=np.float32))
visible = np.tril(np.ones((T, T), dtype=bool))
lse_dense = np.log(np.exp(np.where(visible, S, -np.inf)).sum(axis=1))
S32 = q32[0, 0] @ k32[0, 0].T / np.float32(2)
lse_dense32 = np.log(np.exp(np.where(visible, S32, -np.inf)).sum(axis=1))
if HAVE_CPU:
    o_c, lse_c = kernels.flash_attention_forward(q32, k32, v32, causal=True)
    print("o (C++, float32):\n", o_c[0, 0])
    print("lse (C++, float32):", lse_c[0, 0], " dtypes:", o_c.dtype, lse_c.dtype)
    check_float32("o", o_c, dense, dense32, 2, np.abs(v).max())
    check_float32("lse", lse_c[0, 0], lse_dense, lse_dense32, 2, 1 + np.abs(lse_dense).max())
else:
    print("skipped: refmath._C is not built, so there is no C++ kernel to compare")

# %%
B, H, G, T, D = 2, 8, 2, 200, 32
heads = gqa_head_map(H, G)  # query head r reads key/value head heads[r] = r // (H / G)
qg = rng.standard_normal((B, H, T, D))
kg, vg = rng.standard_normal((B, G, T, D)), rng.standard_normal((B, G, T, D))
ref_o, ref_cache = sdpa_forward(qg, kg[:, heads], vg[:, heads], mask=causal_mask(T))
np32_o, np32_cache = sdpa_forward(*(x.astype(np.float32) for x in (qg, kg[:, heads], vg[:, heads])),
                                  mask=causal_mask(T, dtype=np.float32))
print("head map (A10):", heads)
if HAVE_CPU:
    qg32, kg32, vg32 = (x.astype(np.float32) for x in (qg, kg, vg))
    og_c, lseg_c = kernels.flash_attention_forward(qg32, kg32, vg32, causal=True)
    check_float32("o", og_c, ref_o, np32_o, 2, np.abs(vg).max())
else:
    print("skipped: refmath._C is not built")

# %% [markdown]
# ## F1-F3 in base 2: what the kernel keeps per row
#
# Lesson 3 built the online softmax: each query row keeps a running maximum $m$, a running sum
# $l = \sum_j e^{s_j - m}$ and an unnormalised output $u = \sum_j e^{s_j - m} v_j$ (F2); a new
# tile of scores moves the maximum to $m' = \max(m, \text{tile max})$ and rescales what was summed
# by $\alpha = e^{m - m'} \le 1$ (F3); at the end $o = u / l$ and $\mathrm{lse} = m + \log l$.
#
# The kernel does exactly this in base 2. Since $e^x = 2^{x \log_2 e}$, multiplying every score
# by $\log_2 e = 1.4427$ once (the kernel folds it into the scale, as $\tau \log_2 e$ with
# $\tau = 1/\sqrt{D}$) turns every exponential into a power of two, and then $m$ and $l$ are the
# base-2 maximum and sum. At the end $\mathrm{lse} = \ln 2\,(m + \log_2 l)$ converts back.
#
# A power of two is cheap to compute without a library call, which is what lets the compiler
# vectorise the loop: write $x = n + f$ with $n = \mathrm{round}(x)$ and $|f| \le 1/2$; then
# $2^x = 2^n\, 2^f$, where $2^n$ is just an exponent field and $2^f = e^{f \ln 2}$ is a degree-7
# Taylor polynomial. By hand: $e = 2^{1.4427}$ gives $n = 1$, $f = 0.4427$, $2^f = 1.3591$,
# $2 \times 1.3591 = 2.7183$.

# %%
LOG2E = np.log2(np.e)


def exp2_like_the_kernel(x):
    """2^x as the C++ kernels compute it: 2^round(x) times a degree-7 polynomial for 2^f."""
    x = np.clip(np.asarray(x, dtype=np.float64), -127.0, 127.0)
    n = np.round(x)
    f = x - n
    poly = sum((f * np.log(2)) ** i / np.prod(np.arange(1, i + 1)) for i in range(8))
    return np.ldexp(poly, n.astype(int))


for x in (1.0, 2.0):
    n = np.round(x * LOG2E)
    print(f"e^{x:g}: x log2 e = {x * LOG2E:.4f}, n = {n:g}, f = {x * LOG2E - n:+.4f}, "
          f"2^f = {2 ** (x * LOG2E - n):.4f}, 2^n 2^f = {exp2_like_the_kernel(x * LOG2E):.4f}")
xs = np.linspace(-30, 30, 2001)
rel = np.abs(exp2_like_the_kernel(xs * LOG2E) / np.exp(xs) - 1)
print(f"largest relative error of the polynomial form over [-30, 30]: {rel.max():.1e} "
      f"(float32 rounds at {U32:.1e})")
assert rel.max() < 1e-8

# %% [markdown]
# **Your turn.** Compute $e^3$ the kernel's way: $x = 3 \log_2 e$, $n = \mathrm{round}(x)$,
# $f = x - n$, then $2^n \cdot 2^f$ (use `np.ldexp(2.0 ** f, n)` for the exponent field). Keep
# $n$ and $f$ too.

# %% tags=["exercise"]
n_exp, f_exp, e_cubed = ..., ..., ...
# BEGIN SOLUTION
x_exp = 3 * LOG2E
n_exp = int(np.round(x_exp))
f_exp = x_exp - n_exp
e_cubed = np.ldexp(2.0**f_exp, n_exp)
# END SOLUTION

# %%
check_close("n", n_exp, lambda: np.round(3 * LOG2E), rtol=0,
            hint="round x = 3 log2 e to the nearest integer")
check_true("|f| <= 1/2", lambda f: abs(f) <= 0.5, "f = x - round(x)", of=f_exp)
check_close("e^3", e_cubed, lambda: np.exp(3.0), rtol=1e-14)

# %% [markdown]
# Here is one row of the loop in NumPy, base 2, 16 keys per tile, next to the kernel's answer for
# the same row (row 150 of head 3 of the $T = 200$ example, 151 visible keys). The picture shows
# what the row carries from tile to tile: $m$ only ever grows, and whenever it does, $l$ is
# multiplied by $2^{m - m'}$ before the new tile's weights are added, so it can drop. $m$ and $l$
# are all the softmax needs; $u$ (not drawn) is rescaled by the same factor.

# %%
b, r, i, tile = 0, 3, 150, 16
tau2 = LOG2E / np.sqrt(D)  # the scale and log2 e, folded into one factor
s2 = tau2 * (kg[b, heads[r], :i + 1] @ qg[b, r, i])  # base-2 scores of the visible keys
v_row = vg[b, heads[r], :i + 1]
m2, l2, u2 = -np.inf, 0.0, np.zeros(D)
trace = []
for j0 in range(0, i + 1, tile):
    s_tile, v_tile = s2[j0:j0 + tile], v_row[j0:j0 + tile]
    m_new = max(m2, s_tile.max())
    alpha = 2.0 ** (m2 - m_new)  # 0 on the first tile, when m = -inf
    p = 2.0 ** (s_tile - m_new)
    l2, u2, m2 = alpha * l2 + p.sum(), alpha * u2 + p @ v_tile, m_new
    trace.append((j0 + len(s_tile), m2, l2))
o_row, lse_row = u2 / l2, np.log(2) * (m2 + np.log2(l2))
print(f"after {len(trace)} tiles: m = {m2:.4f} (base 2), l = {l2:.4f}, lse = ln 2 (m + log2 l) "
      f"= {lse_row:.6f}")
np.testing.assert_allclose(o_row, ref_o[b, r, i], rtol=1e-12)
np.testing.assert_allclose(lse_row, np.log(np.exp(s2 / LOG2E).sum()), rtol=1e-13)
if HAVE_CPU:
    print(f"the C++ kernel's lse for this row: {lseg_c[b, r, i]:.6f}")
    np.testing.assert_allclose(lseg_c[b, r, i], lse_row, rtol=1e-6)
    np.testing.assert_allclose(og_c[b, r, i], o_row, rtol=1e-5, atol=1e-5)

keys_seen, ms, ls = np.array(trace).T
fig, axes = plt.subplots(1, 2, figsize=(9, 3), layout="constrained")
axes[0].step(keys_seen, ms, where="post")
axes[0].set(xlabel="keys folded in", ylabel="m (base 2)", title="running maximum")
axes[1].step(keys_seen, ls, where="post", color="tab:orange")
axes[1].set(xlabel="keys folded in", ylabel="l = sum 2^(s - m)", title="running sum, rescaled")
plt.show()

# %% [markdown]
# The kernel runs that loop body for a whole tile of query rows at once, and some of them see
# nothing in a tile (the causal mask gives them $-\infty$ scores there), or have seen nothing yet
# ($m = -\infty$, $l = 0$, $u = 0$): for a row with neither, $m - m'$ is $-\infty - (-\infty)$.

# %% tags=["exercise"]
# Your turn: write one tile step of the kernel's loop, in base 2, for R query rows at once: the
# running state m (R,), l (R,), u (R, D), the tile's base-2 scores s_tile (R, n) (-inf where
# masked) and its values v_tile (n, D). Return the new (m, l, u). A row that has seen no visible
# key, before or in this tile, must stay the empty state (no NaN). The check compares it with
# online_softmax_merge of lesson 3 (in base e, converted) on a first tile and a later causal one.
def my_tile_step(m, l, u, s_tile, v_tile):
    m_new = l_new = u_new = ...
    # BEGIN SOLUTION
    m_new = np.maximum(m, s_tile.max(axis=1))
    shift = np.where(np.isneginf(m_new), 0.0, m_new)  # no key seen yet: shift by 0
    alpha = 2.0 ** (m - shift)  # 0 where m = -inf
    p = 2.0 ** (s_tile - shift[:, None])
    l_new = alpha * l + p.sum(axis=1)
    u_new = alpha[:, None] * u + p @ v_tile
    # END SOLUTION
    return m_new, l_new, u_new


# %%
def library_tile_step(m, l, u, s_tile, v_tile):
    """Lesson 3's merge of the state with the tile's block, in base e: a base-2 score s is the
    base-e score s ln 2, and l and u are the same sums in either base."""
    merged = online_softmax_merge(OnlineSoftmaxState(m * np.log(2), l, u),
                                  online_softmax_block(s_tile * np.log(2), v_tile))
    return merged.m / np.log(2), merged.l, merged.u


def tile_inputs():
    draw = np.random.default_rng(5)
    first = draw.standard_normal((4, 6))
    first[2] = -np.inf  # row 2 sees nothing in the first tile
    later = draw.standard_normal((4, 6)) + np.array([[3.0], [-3.0], [0.0], [0.0]])
    later[np.triu(np.ones((4, 6), dtype=bool), 3)] = -np.inf  # causal: later keys hidden
    later[3] = -np.inf  # row 3 sees nothing here either...
    v_first, v_later = draw.standard_normal((6, 3)), draw.standard_normal((6, 3))
    empty = (np.full(4, -np.inf), np.zeros(4), np.zeros((4, 3)))
    m1, l1, u1 = library_tile_step(*empty, first, v_first)
    m1[3], l1[3], u1[3] = -np.inf, 0.0, 0.0  # ...and nothing before it
    return [(*empty, first, v_first), (m1, l1, u1, later, v_later)]


def old_sums_not_rescaled(m, l, u, s_tile, v_tile):
    """A slip: the tile's weights against the new maximum, the old sums left as they were."""
    m_new, l_new, u_new = library_tile_step(m, l, u, s_tile, v_tile)
    alpha = np.where(np.isneginf(m), 0.0, 2.0 ** (m - np.where(np.isneginf(m_new), 0.0, m_new)))
    return m_new, l_new - alpha * l + l, u_new - alpha[:, None] * u + u


def nan_for_rows_with_no_key(m, l, u, s_tile, v_tile):
    """A slip: -inf - (-inf) for a row that has seen no key."""
    m_new, l_new, u_new = library_tile_step(m, l, u, s_tile, v_tile)
    none = np.isneginf(m_new)
    return m_new, np.where(none, np.nan, l_new), np.where(none[:, None], np.nan, u_new)


check_function("your tile step", my_tile_step, library_tile_step, inputs=tile_inputs,
               outputs=("m", "l", "u"), rtol=1e-12, reference_name="lesson 3's online_softmax_merge",
               hint="m' = max(m, tile max); rescale l and u by 2^(m - m'); guard m' = -inf",
               slips={"natural exponentials of base-2 scores": lambda m, l, u, s, v: tuple(
                          online_softmax_merge(OnlineSoftmaxState(m, l, u),
                                               online_softmax_block(s, v))),
                      "the old l and u not rescaled to the new maximum": old_sums_not_rescaled,
                      "NaN for a row that has seen no key: -inf - (-inf)": nan_for_rows_with_no_key})

# %% [markdown]
# ## F4: the backward pass from the logsumexp
#
# The forward pass kept $O$ and $\mathrm{lse}$, nothing of size $T \times T$. The backward pass
# rebuilds each tile of weights from them,
#
# $$P_{ij} = e^{s_{ij} - \mathrm{lse}_i} = 2^{\,s_{ij} \log_2 e \,-\, \mathrm{lse}_i \log_2 e},$$
#
# exactly the softmax weights, with no running maximum to correct. The softmax backward
# (A5, A8) needs the row sums $\sum_j P_{ij}\, dP_{ij}$ with $dP = dO\, V^\top$; since
# $\sum_j P_{ij} v_j = o_i$,
#
# $$\sum_j P_{ij}\, dP_{ij} = \sum_j P_{ij}\, (dO_i \cdot v_j) = dO_i \cdot \sum_j P_{ij} v_j
#   = dO_i \cdot O_i =: \delta_i,$$
#
# one dot product per row and again nothing of size $T \times T$. Then
#
# $$dS = P \odot (dP - \delta), \quad dV = P^\top dO, \quad dQ = \tau\, dS\, K,
#   \quad dK = \tau\, dS^\top Q,$$
#
# and each key/value head receives the sum over the query heads that read it (A10, lesson 8).
# First the identities on the $T = 200$ example, in float64:

# %%
do = rng.standard_normal(qg.shape)
_, ref_lse = flash.flash_attention_forward(qg, kg, vg, causal=True)
scores = np.where(causal_mask(T) == 0, (qg @ kg[:, heads].swapaxes(-1, -2)) / np.sqrt(D), -np.inf)
P = 2.0 ** (scores * LOG2E - ref_lse[..., None] * LOG2E)
np.testing.assert_allclose(P, ref_cache.a, rtol=1e-12, atol=1e-15)
dP = do @ vg[:, heads].swapaxes(-1, -2)
print("P rebuilt from lse equals the softmax weights of the dense reference")

# %% [markdown]
# **Your turn.** Compute $\delta$, shape $(B, H, T)$, from `do` and the forward output `ref_o`
# alone (no `P`, no `dP`).

# %% tags=["exercise"]
delta = ...  # (B, H, T)
# BEGIN SOLUTION
delta = (do * ref_o).sum(axis=-1)
# END SOLUTION

# %%
check_close("delta = rowsum(dO * O)", delta, lambda: (P * dP).sum(axis=-1), rtol=1e-10,
            atol=1e-12, hint="one dot product per row",
            slips={"rowsum(dO) times rowsum(O): the product goes inside the sum": lambda:
                       do.sum(axis=-1) * ref_o.sum(axis=-1)})

# %% [markdown] tags=["question"]
# **Question.** Dense attention's backward (lesson 1) computes $\sum_j A_{ij}\, dA_{ij}$ from the
# stored weights $A$. Why can the FlashAttention backward not do the same, what does it store
# instead, and how many numbers per row does that cost?
#
# <!-- BEGIN SOLUTION -->
# FlashAttention never stores $A$ (that is $T^2$ numbers per head, the memory it exists to avoid).
# It stores $O$ (needed anyway as the output) and one logsumexp per row. The weights of a tile are
# rebuilt as $e^{s_{ij} - \mathrm{lse}_i}$ by recomputing the tile's scores, and the row sum
# $\sum_j P_{ij}\,dP_{ij}$ equals $\delta_i = dO_i \cdot O_i$, one dot product of length $D$. So
# the extra state is one number per row ($\mathrm{lse}_i$), $O(T)$, plus $\delta$, also one number
# per row, computed at the start of the backward pass.
# <!-- END SOLUTION -->

# %% [markdown]
# The C++ backward organises these products for a CPU. Every tile product has one form, $C = AB$
# built up by scaling whole rows of $B$ with entries of $A$, a loop the compiler vectorises along
# the rows. Where a product needs a transposed operand ($K^\top$ for the scores in the forward
# pass; tiles of $Q$, $dO$ or $dS$ here), that tile is first copied transposed into scratch. Every
# output element is written by exactly one thread, so no atomic additions are needed. When there
# are enough (batch, key/value head) pairs to share among the threads, one pass over them
# accumulates $dK$, $dV$ and $dQ$ tile by tile; otherwise a first pass computes $dK$ and $dV$ and
# a second, over query tiles, computes $dQ$. Both schedules give the same bits (the cell forces
# each in turn and compares). Against the dense float64 `sdpa_backward` (its key/value gradients
# summed over each group), by the float32 rule with factor 3; the floor also carries
# $1 + \max |\mathrm{lse}|$, because every weight is rebuilt from a float32 lse, and takes as $M$
# the largest gradient entry, for $dK$ and $dV$ after the sum over the group.

# %%
dq_ref, dk_ref, dv_ref = sdpa_backward(do, ref_cache)
dq_32, dk_32, dv_32 = sdpa_backward(do.astype(np.float32), np32_cache)


def per_kv_head(dx):
    """Sum over the query heads that read each key/value head: (B, H, ...) -> (B, G, ...)."""
    return dx.reshape(dx.shape[0], G, H // G, *dx.shape[2:]).sum(axis=2)


if HAVE_CPU:
    do32 = do.astype(np.float32)
    dq_c, dk_c, dv_c = kernels.flash_attention_backward(do32, qg32, kg32, vg32, og_c, lseg_c,
                                                        causal=True)
    grow = 1 + np.abs(ref_lse).max()
    dk_ref_g, dv_ref_g = per_kv_head(dk_ref), per_kv_head(dv_ref)
    check_float32("dq", dq_c, dq_ref, dq_32, 3, grow * np.abs(dq_ref).max())
    check_float32("dk", dk_c, dk_ref_g, per_kv_head(dk_32), 3, grow * np.abs(dk_ref_g).max())
    check_float32("dv", dv_c, dv_ref_g, per_kv_head(dv_32), 3, grow * np.abs(dv_ref_g).max())
    by_schedule = {}
    for schedule in ("one pass", "two passes"):
        with kernels.backward_schedule(schedule):
            by_schedule[schedule] = kernels.flash_attention_backward(
                do32, qg32, kg32, vg32, og_c, lseg_c, causal=True)
    for name, one_pass, two_passes in zip(("dq", "dk", "dv"), by_schedule["one pass"],
                                          by_schedule["two passes"]):
        np.testing.assert_array_equal(one_pass, two_passes, err_msg=name)
    print("one pass and two passes: dq, dk and dv are bit for bit the same")
else:
    print("skipped: refmath._C is not built")

# %% [markdown]
# ## K2 and F3: decode, split across the cores
#
# A decode step (K2) has one new query per head and a long cache:
# $o = \mathrm{softmax}(\tau\, q K^\top) V$ over the sequence's $n$ cached keys. With one query
# row there is no query tile to share among threads, so the kernel cuts the keys instead, into
# `splits` chunks: separate work items that any thread may take, chunk $s$ reduced to the partial
# statistics $(m_s, l_s, u_s)$ of its keys (F2); a second, tiny loop merges them (F3):
#
# $$m = \max_s m_s, \qquad l = \sum_s e^{m_s - m}\, l_s, \qquad
#   o = \frac{\sum_s e^{m_s - m}\, u_s}{l}.$$
#
# In exact arithmetic the merge changes nothing, so the answer depends on `splits` only through
# rounding. The query heads of a GQA group are handled together, so each cached key is read once
# per group (A10). Slots past a sequence's length are never read; here they hold NaN to prove it.
#
# First the merge in NumPy, for one (sequence, query head): four chunks of 1024 keys.

# %%
B, H, G, D, T_max = 2, 8, 2, 64, 4096
lengths = np.array([4096, 1000])
heads = gqa_head_map(H, G)
q_dec = rng.standard_normal((B, H, D))
k_cache = rng.standard_normal((B, G, T_max, D))
v_cache = rng.standard_normal((B, G, T_max, D))
for b, n_b in enumerate(lengths):
    k_cache[b, :, n_b:] = np.nan
    v_cache[b, :, n_b:] = np.nan

scores0 = k_cache[0, heads[5]] @ q_dec[0, 5] / np.sqrt(D)  # sequence 0, query head 5
parts = [online_softmax_block(scores0[c:c + 1024], v_cache[0, heads[5], c:c + 1024])
         for c in range(0, 4096, 1024)]
for s, part in enumerate(parts):
    print(f"split {s}: m = {part.m:.4f}  l = {part.l:.4f}")
merged = parts[0]
for part in parts[1:]:
    merged = online_softmax_merge(merged, part)
print(f"merged:  m = {merged.m:.4f}  l = {merged.l:.4f}")
whole, _ = sdpa_forward(q_dec[0, 5][None], k_cache[0, heads[5]], v_cache[0, heads[5]])
np.testing.assert_allclose(online_softmax_result(merged), whole[0], rtol=1e-12, atol=1e-15)


# %% [markdown]
# **Your turn.** Merge the four `parts` yourself with the three formulas above (each part has
# `.m`, `.l` and `.u`), and give the attention output $o$.

# %% tags=["exercise"]
o_merged_by_hand = ...  # (D,)
# BEGIN SOLUTION
m_all = max(part.m for part in parts)
l_all = sum(np.exp(part.m - m_all) * part.l for part in parts)
o_merged_by_hand = sum(np.exp(part.m - m_all) * part.u for part in parts) / l_all
# END SOLUTION

# %%
check_close("merged decode output", o_merged_by_hand, lambda: whole[0], rtol=1e-12, atol=1e-15,
            slips={"the parts' outputs averaged: each must be weighted by its rescaled l": lambda:
                       np.mean([online_softmax_result(part) for part in parts], axis=0),
                   "u and l added without rescaling to the largest m": lambda:
                       sum(part.u for part in parts) / sum(part.l for part in parts)})

# %% [markdown]
# Now the kernel on both sequences and all heads. `decode_attention` is one function with three
# backends and the same arguments: `"numpy"` is the reference, which attends over each sequence's
# first $n_b$ keys with `sdpa_forward` (run here in float64 and in float32), and `"cpu"` is the C++
# kernel `refmath.kernels.decode`, run with `splits=1` (one thread walks each whole context) and
# `splits=4`.

# %%
q_dec32, k_cache32, v_cache32 = (x.astype(np.float32) for x in (q_dec, k_cache, v_cache))
ref_dec = decode_attention(q_dec, k_cache, v_cache, lengths)
np32_dec = decode_attention(q_dec32, k_cache32, v_cache32, lengths)
if HAVE_CPU:
    on_cpu = decode_attention(q_dec32, k_cache32, v_cache32, lengths, backend="cpu")
    np.testing.assert_array_equal(on_cpu, kernels.decode(q_dec32, k_cache32, v_cache32, lengths))
    one = kernels.decode(q_dec32, k_cache32, v_cache32, lengths, splits=1)
    four = kernels.decode(q_dec32, k_cache32, v_cache32, lengths, splits=4)
    big_v = np.nanmax(np.abs(v_cache))
    assert np.isfinite(one).all() and np.isfinite(four).all()  # no NaN slot was read
    check_float32("splits=1", one, ref_dec, np32_dec, 2, big_v)
    check_float32("splits=4", four, ref_dec, np32_dec, 2, big_v)
    print(f"largest difference between splits=1 and splits=4: {np.abs(one - four).max():.1e}")
    np.testing.assert_allclose(four, one, rtol=0, atol=8 * U32 * big_v)
else:
    print("skipped: refmath._C is not built")

# %% [markdown]
# ## K10: the same decode through a page table
#
# A paged cache (lesson 3) stores tokens in pages of $p$ slots drawn from a shared pool; token $j$
# of sequence $b$ lives in slot $j \bmod p$ of physical page `page_table[b, j // p]`. The kernel
# takes the pool in the layout of `PagedKVCache`, $(n_{\text{pages}}, G, p, D)$, and a table
# padded with $-1$.
#
# Below, the contiguous caches are cut into pages of 16 tokens and the pages are scattered over a
# pool in a random order, with spare pages full of NaN. Sequence 0 needs $4096 / 16 = 256$ pages,
# sequence 1 needs $\lceil 1000 / 16 \rceil = 63$, the last one holding 8 tokens, so token 999
# sits in logical page 62, slot 7. The kernel only sees the table, so its answer must be the
# contiguous one.
#
# Inside, both forms hand the arithmetic the same thing: a block of 16 keys given as 16 row
# pointers, gathered from one page or several (here, one 16-slot page). With `splits=1` the blocks
# are the same 16 keys in the same order, and the two answers agree to the last bit. With `splits=4` the paged form cuts
# its list of pages and the contiguous form its list of keys (250 keys a split for sequence 1,
# against 16 pages, 256 keys), so the sums are rounded in a different order: equal up to float32
# rounding.

# %%
p = 16
n_used = [-(-int(n_b) // p) for n_b in lengths]
n_pages = sum(n_used) + 20  # a few spare pages that no sequence owns
order = rng.permutation(n_pages)
page_table = np.full((B, max(n_used)), -1, dtype=np.int32)
k_pages = np.full((n_pages, G, p, D), np.nan, dtype=np.float32)
v_pages = np.full((n_pages, G, p, D), np.nan, dtype=np.float32)
taken = 0
for b, n_b in enumerate(lengths):
    for i in range(n_used[b]):
        page = order[taken]
        taken += 1
        page_table[b, i] = page
        n = min(p, n_b - i * p)  # filled slots of this page
        k_pages[page, :, :n] = k_cache32[b, :, i * p:i * p + n]
        v_pages[page, :, :n] = v_cache32[b, :, i * p:i * p + n]
j = 999
last_page = page_table[1, n_used[1] - 1]
print("sequence 1, first pages:", page_table[1, :6], "... last:", last_page)
filled = ~np.isnan(k_pages[last_page, 0, :, 0])
print(f"sequence 1: {n_used[1]} pages, the last holding {filled.sum()} tokens")
assert n_used[1] == 63 and filled.tolist() == [True] * 8 + [False] * 8
print(f"token {j} of sequence 1: logical page {j // p}, slot {j % p} -> physical page "
      f"{page_table[1, j // p]}")
np.testing.assert_array_equal(k_pages[page_table[1, j // p], :, j % p], k_cache32[1, :, j])

if HAVE_CPU:
    for splits in (1, 4):
        paged = kernels.paged_decode(q_dec32, k_pages, v_pages, page_table, lengths, splits=splits)
        contiguous = kernels.decode(q_dec32, k_cache32, v_cache32, lengths, splits=splits)
        diff = np.abs(paged - contiguous).max()
        print(f"splits={splits}: paged vs contiguous, largest difference {diff:.1e}")
        np.testing.assert_allclose(paged, contiguous, rtol=0, atol=8 * U32 * big_v)
        if splits == 1:
            np.testing.assert_array_equal(paged, contiguous)
else:
    print("skipped: refmath._C is not built")

# %% [markdown]
# ## F5: what it buys, in time
#
# All three programs do the same arithmetic, $O(B H T^2 D)$ multiply-adds (about half of it under
# a causal mask, for the two that skip hidden tiles). The differences are in how they do it.
# Below, $B = 1$, $H = 4$, $D = 64$, causal, float32: dense NumPy, the tiled NumPy reference
# ($16 \times 16$ tiles, a Python loop per tile, so only the two smallest lengths), and the C++
# kernel.
#
# Timings on a shared machine are noisy, and thread pools sized to every core (NumPy's BLAS, the
# kernel's OpenMP, `kernels.cpu_threads()` threads each) spin and fight when other work runs: an
# unpinned run on a busy 2-core machine timed dense NumPy at 132 ms for $T = 128$ and 108 ms for
# $T = 1024$, backwards. So the cell pins every pool to one thread (with threadpoolctl when it is
# installed; setting `OMP_NUM_THREADS=1` and `OPENBLAS_NUM_THREADS=1` before starting Python does
# the same), takes the median of 5 runs (of 1 for the tiled NumPy reference), and draws a recorded
# measurement beside the live one. Nothing is asserted about the times.

# %%
def median_seconds(fn, repeats=5):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


# Recorded by this cell on the project's 2-core AMD EPYC build machine (x86-64 with AVX2: 8 float32
# lanes), one thread, while other jobs shared it: milliseconds at T = 128, 256, 512, 1024.
RECORDED_MS = {"dense NumPy": [0.852, 12.2, 55.7, 195.0], "tiled NumPy": [24.0, 69.8, np.nan, np.nan],
               "C++ kernel": [0.632, 2.0, 16.6, 56.0]}
THREADS = 1  # one thread per pool: stable on a shared machine, and the same for all three
lengths_t = [128, 256, 512, 1024]
timings = {"dense NumPy": [], "tiled NumPy": [], "C++ kernel": []}
pinned = threadpool_limits(limits=THREADS) if threadpool_limits else contextlib.nullcontext()
with pinned:
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

fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True, layout="constrained")
panels = ((RECORDED_MS, "recorded: 2-core build machine, 1 thread", 1.0),
          ({k: np.array(v) * 1e3 for k, v in timings.items()},
           f"this machine, now: {THREADS} thread", 1.0))
for ax, (table, title, _) in zip(axes, panels):
    for (name, ms), marker in zip(table.items(), "os^"):
        if not np.all(np.isnan(ms)):
            ax.loglog(lengths_t, ms, marker + "-", label=name)
    ax.set(xlabel="sequence length T", title=title)
    ax.minorticks_off()  # only the four lengths as ticks: no overlapping minor labels
    ax.set_xticks(lengths_t, [str(T) for T in lengths_t])
    ax.legend(fontsize=8)
axes[0].set_ylabel("ms, median (tiled NumPy: 1 run)")
fig.suptitle("causal attention forward, B = 1, H = 4, D = 64, float32", fontsize=10)
plt.show()

# %% [markdown]
# What ran: the kernel is compiled twice, once for 8-lane vectors (AVX2, or the baseline
# instruction set doing the same work) and once for 16-lane vectors (AVX-512), and picks the
# widest the CPU supports. `cpu_vector_lanes(8)` forces the 8-lane copy, which is how the tests
# reach it on an AVX-512 machine; here it is timed (median of five) at $T = 1024$ and the default
# restored.

# %%
if HAVE_CPU:
    lanes = kernels.cpu_vector_lanes()
    print("vector lanes:", lanes, "  OpenMP:", kernels.build_info().get("openmp"))
    if lanes == 16:
        try:
            assert kernels.cpu_vector_lanes(8) == 8  # the 8-lane copy is now the one in use
            with threadpool_limits(limits=THREADS) if threadpool_limits else contextlib.nullcontext():
                t8 = median_seconds(lambda: kernels.flash_attention_forward(qt, kt, vt, causal=True))
        finally:
            kernels.cpu_vector_lanes(16)
        print(f"T = 1024: 16 lanes {timings['C++ kernel'][-1] * 1e3:.2f} ms, "
              f"8 lanes {t8 * 1e3:.2f} ms (16-lane time / 8-lane time = "
              f"{timings['C++ kernel'][-1] / t8:.2f})")
        print("vector lanes after restoring the default:", kernels.cpu_vector_lanes())
else:
    print("skipped: refmath._C is not built")

# %% [markdown]
# Read the two times as one measurement, not as a law. Twice the lanes doubles the work per
# instruction only in the vectorised parts (the $2^x$ polynomial, the multiply-adds of the tile
# products); the rest of the loop (each row's maximum and rescaling, loading the key and value
# tiles, the loop's bookkeeping) does not get faster, and some CPUs lower their clock while they
# run 512-bit instructions. So the 16-lane copy can come out a little faster or a little slower
# than the 8-lane one: on a shared 2-core machine one run gave 11.98 ms for 16 lanes against
# 10.78 ms for 8, a gap of the size of the run-to-run noise there. The 8-lane copy is there for
# CPUs without AVX-512 and for the tests, not for speed.

# %% [markdown]
# ## F4 and F5: what it buys, in memory
#
# Dense attention holds the scores and the weights, $B H T^2$ numbers each (and keeps the weights
# for its backward pass). The tiled programs keep $O$ and one lse per row, $O(T)$, plus scratch
# of a fixed size: in the C++ forward pass each thread holds one tile of scores
# ($128 \times 128$), its output rows and their tile product ($2 \times 128 \times D$), a
# transposed key tile ($D \times 128$) and three numbers per row, about 160 KiB for $D = 64$,
# whatever $T$ is.
#
# `tracemalloc` sees the memory of every NumPy array, so it can measure the peak of each call at
# $T = 1024$ (the arrays from the timing above). It does not see the kernel's C++ scratch, which
# is why the formula is given above.

# %%
def peak_bytes(fn):
    tracemalloc.start()
    tracemalloc.reset_peak()
    result = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del result
    return peak


T = 1024
score_bytes = 4 * T * T * 4  # H = 4 heads of T x T float32 scores
o_lse_bytes = 4 * T * 64 * 4 + 4 * T * 4
dense_peak = peak_bytes(lambda: sdpa_forward(qt, kt, vt, mask=mask))
tiled_peak = peak_bytes(lambda: flash.flash_attention_forward(qt, kt, vt, causal=True,
                                                              block_q=64, block_k=64))
print(f"one T x T score matrix per head, 4 heads: {score_bytes / 2**20:.1f} MiB; "
      f"o and lse: {o_lse_bytes / 2**20:.2f} MiB")
print(f"peak NumPy memory: dense {dense_peak / 2**20:.1f} MiB, tiled {tiled_peak / 2**20:.2f} MiB")
assert dense_peak >= 2 * score_bytes  # scores and weights
assert tiled_peak < 2 * o_lse_bytes
if HAVE_CPU:
    kernel_peak = peak_bytes(lambda: kernels.flash_attention_forward(qt, kt, vt, causal=True))
    print(f"peak NumPy memory of the C++ call: {kernel_peak / 2**20:.2f} MiB (its outputs)")
    assert kernel_peak < 1.1 * o_lse_bytes
scratch = 4 * (128 * 128 + 2 * 128 * 64 + 3 * 128 + 64 * 128)
print(f"C++ forward scratch per thread, D = 64: {scratch / 2**10:.1f} KiB")

T_range = np.array([2**n for n in range(10, 18)])
fig, ax = plt.subplots(figsize=(5.5, 3.4), layout="constrained")
ax.loglog(T_range, 4 * 4 * T_range**2 / 2**20, "o-", label="scores, H T^2 float32")
ax.loglog(T_range, (4 * T_range * 64 * 4 + 4 * T_range * 4) / 2**20, "s-",
          label="o and lse, H T (D + 1) float32")
ax.axhline(scratch / 2**20, color="gray", ls=":", label="kernel scratch per thread")
ax.set(xlabel="sequence length T", ylabel="MiB",
       title="memory of one attention call, H = 4, D = 64")
ax.legend(fontsize=8)
plt.show()
T = 2**17
print(f"T = {T}: scores {4 * 4 * T * T / 2**30:.0f} GiB, "
      f"o and lse {(4 * T * 64 * 4 + 4 * T * 4) / 2**20:.0f} MiB")

# %% [markdown]
# At $T = 131072$ the score matrices of four heads alone take 256 GiB, while the output and the
# logsumexp take about 130 MiB: one of the two reasons for FlashAttention (the other is speed,
# from fewer reads and writes of slow memory).
#
# ## On a GPU: the CUDA ladder
#
# Where a CUDA toolkit is found at build time, `refmath._cuda` holds the same forward pass as a
# short ladder of versions, each a file in `csrc/cuda/` that says what it changes and why it is
# faster, and each held to the same float64 reference:
#
# - **v1** (`flash_v1.cu`): one thread per query row, walking the keys one at a time with the
#   online-softmax state of F3. No shared memory, no synchronisation; slow because every thread
#   fetches every key and value row it uses from global memory.
# - **v2** (`flash_v2.cu`): a block of 32 query rows copies each 32-key tile of $K$ and $V$ into
#   shared memory once and all its rows use it; scores, row maxima and sums are split across the
#   lanes of a warp, and the softmax state is updated once per tile rather than once per key.
# - **v3** (`flash_v3.cu`): both products, $Q K^\top$ and $P V$, on the tensor cores
#   (`mma.sync m16n8k16`: a $16 \times 16$ tile times a $16 \times 8$ tile, of fp16 or bf16,
#   accumulated in fp32, for $D = 64$ or 128), exponentials in base 2 as on the CPU, and the
#   weights passed straight from one product to the next in registers.
#
# The backward pass (`flash_backward.cu`) and the paged split-K decode (`paged_decode.cu`, a
# partial $(m, l, u)$ per split and a second kernel for the F3 merge) complete the set.
# `kernels.flash_versions()` lists the versions that were built (empty without the CUDA module),
# and a CuPy array passed to `kernels.flash_attention_forward(..., version="v2")` runs that one.

# %%
print("CUDA versions built:", kernels.flash_versions() or "none")
print(kernels.cuda_build_info())

# %% [markdown]
# ## Exercises
#
# 1. Bound the relative error of the degree-7 polynomial for $2^f$ on $|f| \le 1/2$ by the first
#    omitted Taylor term, and compare with the measured $10^{-8}$.
# 2. Derive $dS = P \odot (dP - \delta)$ from the softmax Jacobian of A5, row by row.
# 3. Show that merging split-K statistics is associative and commutative (F3), and explain why the
#    kernel's answer still depends on `splits` in float32.
# 4. With the recorded timings, estimate the exponent $k$ in $t \propto T^k$ for the dense NumPy
#    program and the C++ kernel between $T = 512$ and 1024. Which term of the cost explains each?
# 5. Count the bytes the dense forward pass writes and reads for the $T \times T$ scores and
#    weights, against the tiled kernel's reads of $Q$, $K$, $V$ and writes of $O$ and lse.
#
# ## References
#
# - Dao, T., et al. (2022). FlashAttention: Fast and Memory-Efficient Exact Attention with
#   IO-Awareness. (Tiling, the online softmax, recomputation from the logsumexp in the backward
#   pass.)
# - Milakov, M., and Gimelshein, N. (2018). Online normalizer calculation for softmax.
# - Dao, T. (2023). FlashAttention-2: Faster Attention with Better Parallelism and Work
#   Partitioning. (Splitting the work of the forward and backward passes across threads.)
# - Kwon, W., et al. (2023). Efficient Memory Management for Large Language Model Serving with
#   PagedAttention. (Paged decode.)
# - Ainslie, J., et al. (2023). GQA: Training Generalized Multi-Query Transformer Models from
#   Multi-Head Checkpoints.
