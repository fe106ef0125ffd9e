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
#     minutes: 35
#     ids: [A11, S4, A12, L7]
# ---

# %% [markdown]
# # Lesson 9: numerics and sampling at inference time
#
# A trained model still has to be run, and run cheaply. This lesson covers the numerics that keep
# a softmax finite in half precision (A11, S4), a mask that bounds how far back a token looks and
# the tiles a kernel can then skip (A12), and the rules that turn the last position's logits into
# the next token (L7).
#
# **Prerequisites:** lessons 1 (softmax and attention) and 3 (FlashAttention's tiles and counters,
# F4-F5).
#
# **Goals:** explain why the max-subtracted softmax never overflows and what the library returns
# for a fully masked row; find where float16 breaks the plain formula; count the pairs and tiles
# of a sliding window; compute top-k and top-p by hand.
#
# **Catalogue IDs:** A11, S4, A12, L7
#
# **Duration:** about 35 minutes.

# %%
import matplotlib.pyplot as plt
import numpy as np

from refmath.attention import sdpa_forward
from refmath.flash import FlashCounters, flash_attention_forward
from refmath.inference.generate import generate
from refmath.inference.sampling import next_token_distribution, sample_token, top_k_filter
from refmath.inference.kv_cache import generate_cached
from refmath.lessons import check, check_function, check_true
from refmath.models import decoder

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)

# %% [markdown]
# ## A11: the stable softmax, and a row with nothing to attend to
#
# $\mathrm{softmax}(s)_j = e^{s_j} / \sum_u e^{s_u}$ does not change when the same constant is
# added to every score: the factor $e^c$ cancels. So we subtract the row maximum $m$ first. Every
# exponent is then at most 0, no exponential can overflow, and the largest term is exactly
# $e^0 = 1$, so the denominator is at least 1.
#
# For scores $(1, 2, 3)$: shifted $(-2, -1, 0)$, exponentials $(0.1353, 0.3679, 1)$, sum
# $1.5032$, weights $(0.0900, 0.2447, 0.6652)$. Adding 1000 to every score changes nothing in the
# stable form, while the plain formula overflows even in float64 ($e^{1003} \approx 10^{435}$).

# %%
s = np.array([1.0, 2.0, 3.0])
shifted = np.exp(s - s.max())
print("e^(s - m) =", shifted, " sum =", shifted.sum(), " weights =", shifted / shifted.sum())
a = shifted / shifted.sum()
big = s + 1000.0
a_big = np.exp(big - big.max()) / np.exp(big - big.max()).sum()
np.testing.assert_allclose(a, [0.0900, 0.2447, 0.6652], atol=1e-4)
np.testing.assert_allclose(a_big, a, rtol=1e-15)
with np.errstate(over="ignore", invalid="ignore"):
    plain = np.exp(s + 1000.0) / np.exp(s + 1000.0).sum()
print("plain formula at s + 1000:", plain, "  stable:", a_big)
assert np.isnan(plain).all()


# %% [markdown]
# A masked score is $-\infty$. When a row is masked everywhere (a query with no visible key, such
# as a padded position in a batch), the maximum is itself $-\infty$ and
# $s - m = -\infty - (-\infty)$ is NaN. Such a row has no distribution, so the library treats it
# explicitly: it returns a row of zeros (and zero gradient), and the attention output of that
# query is the zero vector rather than a NaN that would spread through the whole batch.

# %%
masked = np.array([[0.5, -np.inf, 2.0],
                   [-np.inf, -np.inf, -np.inf]])
with np.errstate(invalid="ignore"):
    m = masked.max(axis=1, keepdims=True)
    naive_rows = np.exp(masked - m) / np.exp(masked - m).sum(axis=1, keepdims=True)
print("naive:\n", naive_rows)
assert np.isnan(naive_rows[1]).all()

q, k, v = rng.standard_normal((2, 4)), rng.standard_normal((3, 4)), rng.standard_normal((3, 2))
o, _ = sdpa_forward(q, k, v, mask=np.where(np.isinf(masked), -np.inf, 0.0))
print("attention output, second query sees no key:", o[1])
np.testing.assert_array_equal(o[1], 0.0)


# %% [markdown]
# **Exercise 09.1.** Write the stable softmax of each row of `rows` yourself: subtract the row
# maximum, exponentiate, divide by the row sum, and give a fully masked row zeros (the library's
# rule), without a NaN anywhere.

# %% tags=["exercise"]
rows = np.array([[1000.0, 1001.0, -np.inf, 999.0],
                 [-np.inf, -np.inf, -np.inf, -np.inf],
                 [0.0, 0.0, 0.0, 0.0]])
stable_rows = ...  # (3, 4)
# BEGIN SOLUTION
row_max = rows.max(axis=1, keepdims=True)
safe_max = np.where(np.isneginf(row_max), 0.0, row_max)  # a fully masked row: shift by 0
e = np.exp(rows - safe_max)
sums = e.sum(axis=1, keepdims=True)
stable_rows = np.divide(e, sums, out=np.zeros_like(e), where=sums > 0)
# END SOLUTION

# %%
check("09.1", stable_rows)

# %% [markdown]
# The library's `softmax_forward` follows that rule: a fully masked row gives zeros.

# %%
from refmath.softmax import softmax_forward

a, _ = softmax_forward(masked)
print("softmax_forward:\n", a)
np.testing.assert_array_equal(a[1], 0.0)
np.testing.assert_allclose(a[0].sum(), 1.0)

# %% [markdown]
# ## S4: why half precision needs the shift
#
# float16 has 5 exponent bits; its largest finite number is 65504, so $e^x$ overflows as soon as
# $x > \ln 65504 = 11.09$, and nothing in the formula keeps the scores below that. The plain
# formula then divides $\infty$ by $\infty$ and returns NaN; the shifted form never exponentiates
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
# The picture: three scores $(x - 2, x - 1, x)$ with the largest one $x$ swept upwards. The plain
# float16 softmax is accurate (to float16 rounding) until the *sum*
# $e^x (1 + e^{-1} + e^{-2})$ passes 65504 (the exercise below finds where): it becomes $\infty$
# and every weight collapses to 0. Once $x$ passes 11.09, $e^x$ itself is $\infty$ and the largest weight is
# NaN (crosses at the top). The shifted form does not care how large $x$ is.

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
ax.axvline(np.log(65504), color="gray", lw=0.8, label=r"$x = \ln 65504$")
ax.set(xlabel="largest score x", ylabel="max error vs float64 (+1e-7)",
       title=r"float16 softmax: overflow at $x = \ln 65504$")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# **Exercise 09.2.** At what largest score $x$ does the plain float16 softmax of $(x - 2, x - 1, x)$
# first break, because the *sum* of the three exponentials passes 65504? Solve
# $e^x (1 + e^{-1} + e^{-2}) = 65504$ for $x$, exactly: the check wants the root of this equation
# to 12 digits, not a value read off the figure. (float16's own rounding moves the break a little;
# the cell after the check shows by how much.)

# %% tags=["exercise"]
x_sum_overflows = ...
# BEGIN SOLUTION
x_sum_overflows = np.log(65504) - np.log(1 + np.exp(-1) + np.exp(-2))
# END SOLUTION

# %%
check("09.2", x_sum_overflows)

# %%
# After the exercise: where float16 itself first breaks, on a grid of step 1e-4 (shown once you
# have answered). It rounds x, each exponential and the sum to 11 bits, and a float16 sum becomes
# inf only from 65520 on (the rounding threshold above 65504), so the break comes a little after
# the root of the equation.
if x_sum_overflows is not ...:
    fine = np.arange(10.6, 10.8, 1e-4)
    with np.errstate(over="ignore"):
        sums16 = np.array([np.exp(np.array([x - 2, x - 1, x], dtype=np.float16)).sum(dtype=np.float16)
                           for x in fine])
    print(f"your root {float(x_sum_overflows):.5f}; the float16 sum is first inf at "
          f"x = {fine[np.argmax(np.isinf(sums16))]:.4f}")

# %% [markdown]
# The shift fixes the exponentials, not the sum. Over a long row, a running sum kept in float16
# stops growing once it is large next to each new term (at 32, float16 numbers are 1/32 apart, so
# adding anything below 1/64 does nothing). That is why kernels keep $l = \sum e^{s - m}$ in
# float32 even when the scores are in half precision. Here the row has 4096 scores, most of whose
# terms $e^{s - m}$ are far below 1/64: the float16 running sum stalls several percent short.

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
# In a local (sliding-window) causal mask, query $i$ sees key $j$ only when
# $i - w + 1 \le j \le i$ (0-based): itself and the $w - 1$ tokens before it. For $T = 6$, $w = 3$
# the visible pairs number $1 + 2 + 3 + 3 + 3 + 3 = 15$, row by row, against $T(T+1)/2 = 21$ for
# the full causal mask. For long sequences the count grows as $O(T w)$ instead of $O(T^2)$.

# %%
T, w = 6, 3
query, key = np.arange(T)[:, None], np.arange(T)[None, :]
seen = (key <= query) & (key > query - w)  # query i sees keys i - w + 1 .. i
print(seen.astype(int))
visible = int(np.count_nonzero(seen))
assert visible == 1 + 2 + 3 + 3 + 3 + 3 == 15  # the rows' counts, read off the mask above


# %% [markdown]
# **Exercise 09.3.** Write the number of visible pairs as a formula in $T$ and $w$ (for
# $T \ge w$: count the first $w$ rows, then the others), and evaluate it for a window $w = 4$ over
# $T = 10$ tokens (not from the mask).

# %% tags=["exercise"]
pairs_by_formula = ...
# BEGIN SOLUTION
pairs_by_formula = 4 * 5 // 2 + (10 - 4) * 4
# END SOLUTION

# %%
check("09.3", pairs_by_formula)


# %% [markdown]
# The mask alone only changes the result; to save work a kernel has to skip the hidden pairs.
# `flash_attention_forward(..., window=w)` does that by tiles: for each tile of queries it visits
# only the key tiles that hold at least one visible pair. In the picture, each square is one
# $8 \times 8$ tile of the $48 \times 48$ score matrix for $w = 16$: dark tiles lie wholly inside
# the band, light ones are cut by its edges (masked inside), white ones are never touched. The
# counters confirm the tally, and the output equals dense attention with the same mask.

# %%
from refmath.attention import local_window_mask

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

fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), layout="constrained")
mask_image = axes[0].imshow(allowed, cmap="Greys", vmin=0, vmax=1)
fig.colorbar(mask_image, ax=axes[0], ticks=[0, 1]).ax.set_yticklabels(["hidden", "visible"])
axes[0].set(title=f"visible pairs, T = {T}, w = {w}", xlabel="key j", ylabel="query i")
for edge in range(0, T + 1, block):
    axes[0].axhline(edge - 0.5, color="tab:blue", lw=0.4)
    axes[0].axvline(edge - 0.5, color="tab:blue", lw=0.4)
image = axes[1].imshow(tile_state, cmap="Blues", vmin=0, vmax=2)
axes[1].set(title=f"{block} x {block} tiles", xlabel="key tile", ylabel="query tile")
bar = fig.colorbar(image, ax=axes[1], ticks=[0, 1, 2])
bar.ax.set_yticklabels(["skipped", "cut", "full"])
plt.show()

# %% [markdown]
# The same at larger sizes: with the window fixed at 32, the scores evaluated grow linearly in
# $T$; with a plain causal mask they grow like $T^2 / 2$. The counted scores include the masked
# pairs inside cut tiles, so here they are about 1.5 times the visible pairs: with 16-wide tiles
# and $w = 32$ each query tile touches three key tiles (the first two tiles touch one and two),
# 48 keys per query where 32 are visible. That is $16 \cdot 16 \cdot (3T/16 - 3)$ scores, still
# $O(T w)$.

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
       title=r"$O(T^2)$ against $O(T w)$")
ax.legend()
plt.show()

# %% [markdown]
# ## L7: picking the next token
#
# Generation repeats $a_{t+1} \sim \pi(\cdot \mid a_1, \dots, a_t)$. From the last position's
# logits $z$:
#
# - greedy takes $\arg\max z$;
# - temperature $\tau$ samples from $\mathrm{softmax}(z / \tau)$: $\tau < 1$ sharpens, $\tau > 1$
#   flattens;
# - top-k keeps the $k$ most probable tokens and renormalises;
# - top-p (nucleus) keeps the most probable tokens, in order, until their mass reaches $p$.
#
# By hand, with $\pi = (0.5, 0.2, 0.15, 0.1, 0.05)$: top-2 keeps
# $(0.5, 0.2) / 0.7 = (0.714, 0.286)$. Top-p with $p = 0.8$: the masses before each token are
# $0, 0.5, 0.7, 0.85, 0.95$; tokens whose preceding mass is below 0.8 are kept, the first three,
# renormalised by 0.85 to $(0.588, 0.235, 0.176)$.

# %%
pi = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
z = np.log(pi)
dists = {
    "pi = softmax(z)": next_token_distribution(z),
    "tau = 0.5": next_token_distribution(z, temperature=0.5),
    "tau = 2": next_token_distribution(z, temperature=2.0),
    "top-k, k = 2": top_k_filter(pi, 2),
    # by hand, as above: the library's top_p_filter is exercise 09.5's to write
    "top-p, p = 0.8": np.array([0.5, 0.2, 0.15, 0.0, 0.0]) / 0.85,
}
for name, dist in dists.items():
    print(f"{name:15s}", dist)
np.testing.assert_allclose(dists["pi = softmax(z)"], pi, rtol=1e-14)
np.testing.assert_allclose(dists["tau = 0.5"], pi**2 / (pi**2).sum(), rtol=1e-14)
np.testing.assert_allclose(dists["top-k, k = 2"], [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0], rtol=1e-14)

fig, axes = plt.subplots(1, len(dists), figsize=(11, 2.6), sharey=True, layout="constrained")
for ax, (name, dist) in zip(axes, dists.items()):
    ax.bar(range(5), dist, color="tab:blue")
    ax.set(title=name, xticks=range(5), xlabel="token")
axes[0].set_ylabel("probability")
plt.show()

# %% [markdown]
# **Exercise 09.4.** For $\pi = (0.1, 0.4, 0.2, 0.3)$ (not sorted!) and $p = 0.6$, write the top-p
# distribution by hand: sort, keep the tokens whose preceding mass is below $p$, renormalise, and
# put the numbers back at their tokens.

# %% tags=["exercise"]
pi4 = np.array([0.1, 0.4, 0.2, 0.3])
top_p_by_hand = ...  # (4,)
# BEGIN SOLUTION
top_p_by_hand = np.array([0.0, 0.4, 0.0, 0.3]) / 0.7  # 0.4 first (mass before 0), then 0.3 (0.4)
# END SOLUTION

# %%
check("09.4", top_p_by_hand)

# %% tags=["exercise"]
# Exercise 09.5: write top-p filtering as a function of a distribution `probs` (V,) (summing to one,
# in any order) and p in (0, 1]: keep the most probable tokens, in decreasing order, while the
# mass before each is below p; zero the others; renormalise; keep every number at its token.
# The check compares it with top_p_filter on five distributions, one with a token whose mass
# before it is exactly p (0.5 + 0.3 = 0.8: it is not kept) and one where the first token alone
# reaches p.
def my_top_p_filter(probs, p):
    filtered = ...
    # BEGIN SOLUTION
    order = np.argsort(-probs, kind="stable")  # most probable first
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(probs.shape, dtype=bool)
    keep[order[mass_before < p]] = True
    kept = np.where(keep, probs, 0.0)
    filtered = kept / kept.sum()
    # END SOLUTION
    return filtered


# %%
from refmath.inference.sampling import top_p_filter

check("09.5", my_top_p_filter)

# %% [markdown]
# The library's `top_p_filter` gives the distribution of the figure above, computed there by hand:

# %%
print("top_p_filter(pi, 0.8) =", top_p_filter(pi, 0.8))
np.testing.assert_allclose(top_p_filter(pi, 0.8), dists["top-p, p = 0.8"], rtol=1e-14)

# %% [markdown]
# A sampler draws a uniform number $u$ and returns the first token whose cumulative probability
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
# With a model: a tiny decoder (untrained, so its tokens mean nothing, but the rules are the
# same). Greedy ignores the seed; sampling with one seed gives one sequence every time, and the
# cached generator of lesson 3 draws the same tokens as the one that recomputes every prefix.

# %%
config = decoder.preset("tiny", max_seq_len=32)
params = decoder.init_params(config, seed=0)
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


# %% [markdown] tags=["question"]
# **Question.** Why is greedy decoding the limit $\tau \to 0$ of temperature sampling, and why
# does top-k with $k = 1$ give the same tokens? Which of the rules above can ever draw a token
# whose probability under $\pi$ is below $10^{-6}$?
#
# <!-- BEGIN SOLUTION -->
# $\mathrm{softmax}(z/\tau)_j \propto e^{(z_j - z_{\max})/\tau}$: every token below the maximum
# gets a weight $e^{-(\text{gap})/\tau} \to 0$, so all the mass goes to $\arg\max z$ (ties split
# it). Top-1 keeps only the most probable token, with probability 1. Plain sampling and
# temperature sampling with any $\tau > 0$ can draw it (with small probability); top-k can only if
# it ranks among the $k$ most probable, and top-p only if the mass of the more probable tokens is
# below $p$.
# <!-- END SOLUTION -->

# %% [markdown]
# ## Exercises
#
# 1. Prove that $\mathrm{softmax}(s + c) = \mathrm{softmax}(s)$ for any constant $c$, and that
#    after subtracting the maximum the denominator lies in $[1, n]$ for $n$ scores.
# 2. bfloat16 has 8 exponent bits. Find the score above which its plain softmax overflows.
# 3. For a window $w$ and tiles of size $b$ dividing $w$, how many key tiles does a query tile
#    touch far from the start? Check your answer with `FlashCounters`.
# 4. Show that top-p with $p = 1$ and top-k with $k = V$ both return $\pi$ itself.
# 5. With `sample_token` and 10,000 seeded draws, estimate the distribution at $\tau = 2$ and
#    compare it with `next_token_distribution`.
#
# ## References
#
# - Vaswani, A., et al. (2017). Attention Is All You Need. (The masked softmax of attention.)
# - Micikevicius, P., et al. (2018). Mixed Precision Training. (Half-precision storage with
#   single-precision accumulation.)
# - Dao, T., et al. (2022). FlashAttention: Fast and Memory-Efficient Exact Attention with
#   IO-Awareness. (Tiles skipped under masks.)
# - Beltagy, I., Peters, M. E., and Cohan, A. (2020). Longformer: The Long-Document Transformer.
#   (Sliding-window attention.)
# - Jiang, A. Q., et al. (2023). Mistral 7B. (A sliding window of 4096 in a decoder.)
# - Fan, A., Lewis, M., and Dauphin, Y. (2018). Hierarchical Neural Story Generation. (Top-k
#   sampling.)
# - Holtzman, A., et al. (2020). The Curious Case of Neural Text Degeneration. (Nucleus, top-p,
#   sampling.)
