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
# # Lesson 6: whole models
#
# The earlier lessons built the parts; this one assembles them into the four networks of the
# catalogue and checks what each of them promises.
#
# - The original encoder-decoder Transformer (M1): the seq2seq factorisation with a shifted
#   decoder input (L1), label smoothing (L4), and a gradient check of the whole network.
# - GPT (M2): token lookup (N12), learned positions (N9), GPT-2's initialisation (N11), and
#   Post-LN against Pre-LN.
# - The modern decoder (M3): RMSNorm, RoPE, grouped-query attention and SwiGLU, with the fused
#   projection (A9) and the head map of GQA (A10).
# - The MLA decoder (M4), briefly.
# - Two facts every decoder must satisfy, checked on GPT, M3 and M4: one masked pass equals every
#   prefix run on its own (L6), and appending tokens changes nothing that came before (K1).
# - Which parameters take weight decay (O5), and a short training run of every decoder.

# %%
import dataclasses
import math

import matplotlib.pyplot as plt
import numpy as np

from refmath.attention import gqa_head_map, mha_forward
from refmath.data import CharLMTask
from refmath.embedding import embedding_backward, embedding_forward
from refmath.gradcheck import numerical_gradient, relative_error
from refmath.losses import cross_entropy_backward, cross_entropy_forward
from refmath.models import decoder, gpt, mla
from refmath.models import transformer as tm
from refmath.optim import AdamW, clip_grad_norm, takes_weight_decay, warmup_cosine
from refmath.positions import learned_positions_backward, learned_positions_forward
from refmath.sizing import (
    attention_parameter_count,
    kv_cache_bytes_per_token,
    mla_cache_bytes_per_token,
)
from refmath.softmax import softmax_forward

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)


def n_params(shapes):
    """Number of parameters described by a {name: shape} dict (nothing is allocated)."""
    return sum(math.prod(shape) for shape in shapes.values())


# %% [markdown]
# ## L1: the decoder reads the target shifted right by one
#
# A translation model factorises the probability of the target `y` given the source `x` token by
# token:
#
# `p(y | x) = prod_t p(y_t | y_1 .. y_{t-1}, x)`.
#
# To score every factor in one pass, the decoder input is the target shifted right by one place,
# with a start token in front: `(BOS, y_1, ..., y_{m-1})`. Position `t` of the decoder reads
# `BOS, y_1 .. y_{t-1}` and is asked for `y_t`; the causal mask stops it from reading further. With
# `BOS = 1`, the target `(5, 6, 7, 2)` becomes the input `(1, 5, 6, 7)`.

# %%
tgt = np.array([[5, 6, 7, 2]])
dec_in = tm.shift_right(tgt, bos_id=1)
print("target       ", tgt[0])
print("decoder input", dec_in[0])
np.testing.assert_array_equal(dec_in, [[1, 5, 6, 7]])

# %% [markdown]
# With label smoothing off, the model's loss is the mean of `-log p(y_t | y_<t, x)` over the
# target tokens, so the probability of the whole target is `exp(-m * loss)` for `m` counted
# tokens. (The tiny preset smooths with 0.1 by default; L4 below.) Below, a tiny
# encoder-decoder (vocabulary 13, two layers of width 16; id 0 is padding and id 1 is BOS) with
# label smoothing switched off: the loss from `tm.forward` equals the mean of `-log p` read off
# the logits of the shifted input, one factor per position.

# %%
plain = dataclasses.replace(tm.TRANSFORMER_TINY, label_smoothing=0.0)
params = tm.init_params(plain, seed=0)
src = np.array([[3, 4, 5, 6, 0]])  # the last source position is padding
batch = {"src": src, "src_lengths": np.array([4]), "tgt": tgt}
loss, _ = tm.forward(params, batch, plain)
z = tm.logits(params, src, batch["src_lengths"], dec_in, plain)  # (1, 4, 13)
p, _ = softmax_forward(z)
factors = p[0, np.arange(4), tgt[0]]  # p(y_t | y_<t, x) for t = 1..4
print("factors p(y_t | y_<t, x):", factors)
print(f"p(y | x) = product = {factors.prod():.3e};  exp(-4 loss) = {np.exp(-4 * loss):.3e}")
np.testing.assert_allclose(loss, -np.log(factors).mean(), rtol=1e-13)

# %% [markdown]
# ## L4: label smoothing
#
# The original Transformer does not train towards a one-hot target. With smoothing `eps` and a
# vocabulary of `V`, the target distribution is
#
# `q = (1 - eps) onehot(y) + eps / V`,
#
# so the right token gets `1 - eps + eps/V` and every token, the right one included, gets at least
# `eps/V`. The loss is the cross-entropy `-sum_v q_v log p_v` and its gradient is `p - q`. For
# `V = 5` and `eps = 0.1`: `q = (0.92, 0.02, 0.02, 0.02, 0.02)`. The gradient returns `q` exactly:
# `q = p - dloss/dz` for one position.

# %%
z = np.array([[2.0, 1.0, 0.0, 0.0, -1.0]])
y = np.array([0])
smoothed, cache = cross_entropy_forward(z, y, label_smoothing=0.1)
p, _ = softmax_forward(z)
q = p - cross_entropy_backward(1.0, cache)
print("target distribution q:", q[0])
print("loss", float(smoothed), "  -sum q log p =", float(-(q * np.log(p)).sum()))
np.testing.assert_allclose(q, [[0.92, 0.02, 0.02, 0.02, 0.02]], rtol=1e-13)
np.testing.assert_allclose(smoothed, -(q * np.log(p)).sum(), rtol=1e-13)

# %% [markdown]
# What smoothing changes: without it, the loss keeps falling as the right logit runs away from the
# others, so the model is pushed towards ever larger logits. With it, the loss is smallest where
# `p = q`, at a finite gap `log(0.92 / 0.02) = log 46 = 3.83` between the right logit and the
# rest, and the smallest loss is the entropy of `q`, `-0.92 log 0.92 - 4 (0.02 log 0.02) = 0.39`,
# not 0.

# %%
gaps = np.linspace(0, 10, 201)
curves = {}
for eps in (0.0, 0.1):
    curves[eps] = [float(cross_entropy_forward(np.array([[m, 0, 0, 0, 0]]), y,
                                               label_smoothing=eps)[0]) for m in gaps]
entropy_q = -(0.92 * np.log(0.92) + 4 * 0.02 * np.log(0.02))
best = gaps[np.argmin(curves[0.1])]
print(f"eps = 0.1: smallest loss {min(curves[0.1]):.4f} at gap {best:.2f}; "
      f"H(q) = {entropy_q:.4f}, log 46 = {np.log(46):.2f}")
assert abs(best - np.log(46)) <= gaps[1] - gaps[0]
assert np.all(np.diff(curves[0.0]) < 0)  # without smoothing it only ever falls
at_q, _ = cross_entropy_forward(np.log(np.array([[0.92, 0.02, 0.02, 0.02, 0.02]])), y,
                                label_smoothing=0.1)
np.testing.assert_allclose(at_q, entropy_q, rtol=1e-13)

fig, ax = plt.subplots(figsize=(5.5, 3.2), layout="constrained")
for eps, style in ((0.0, "-"), (0.1, "--")):
    ax.plot(gaps, curves[eps], style, label=f"eps = {eps}")
ax.axvline(np.log(46), color="gray", lw=0.8)
ax.set(xlabel="gap between the right logit and the others", ylabel="cross-entropy",
       title="V = 5: one-hot target against a smoothed one")
ax.legend()
plt.show()

# %% [markdown]
# ## M1: the original encoder-decoder, forward and backward
#
# The encoder turns the source into `Z`: embeddings scaled by `sqrt(d)` plus sinusoidal
# positions, then `L` Post-LN layers of padding-masked self-attention and a ReLU FFN. The decoder
# does the same to the shifted target, with causal self-attention, and adds a third sublayer in
# every layer: cross-attention, with queries from the decoder and keys and values from `Z`. The
# logits are the last decoder state times `E^T` (one table shared by source, target and output),
# and the loss is the label-smoothed cross-entropy. In training mode, dropout acts on the
# embeddings, on the attention weights and on every sublayer's output before the residual sum
# (the paper names the first and last; dropout on the attention weights is an addition here).
#
# Every gradient of `tm.backward` is written by hand. Central differences check two of them in
# training mode: the same dropout seed draws the same masks in every evaluation, so the loss is a
# fixed function of the parameters. `decoder.layers.1.cross_attn.w_k` is read by every target
# position through `Z`'s keys; `tok_emb` collects three terms, from the source lookup, the target
# lookup and the output projection.

# %%
config = tm.TRANSFORMER_TINY  # label smoothing 0.1, dropout 0.1
params = tm.init_params(config, seed=1)
batch = {"src": rng.integers(2, 13, (2, 6)), "src_lengths": np.array([6, 4]),
         "tgt": rng.integers(2, 13, (2, 5))}


def phi():
    return float(tm.forward(params, batch, config, train=True, rng=7)[0])


loss, cache = tm.forward(params, batch, config, train=True, rng=7)
grads = tm.backward(cache)
print(f"loss {float(loss):.4f}; {len(grads)} gradient tensors, "
      f"{sum(g.size for g in grads.values())} numbers")
check_rng = np.random.default_rng(0)
for name in ("decoder.layers.1.cross_attn.w_k", "tok_emb"):
    coords = check_rng.choice(params[name].size, size=5, replace=False)
    numeric = numerical_gradient(phi, params[name], coords)
    analytic = grads[name].reshape(-1)[coords]
    error = relative_error(analytic, numeric).max()
    print(f"{name}: analytic {analytic}\n{' ' * len(name)}  numeric  {numeric}\n"
          f"{' ' * len(name)}  largest relative error {error:.1e}")
    assert error < 1e-6

# %% [markdown]
# The same code at the paper's base size (`L = 6`, `d = 512`, `h = 8`, `d_f = 2048`, a shared
# vocabulary of 37000) has about 63 million parameters, counted from the shapes alone. (The paper
# reports 65 million.)

# %%
print(f"TRANSFORMER_BASE: {n_params(tm.param_shapes(tm.TRANSFORMER_BASE)):,} parameters")

# %% [markdown]
# ## N12: the embedding lookup, and repeated tokens in its backward
#
# The lookup `y_n = E[a_n]` copies one row of the table per token. Its backward sends each output
# gradient back to the row it came from; a token that occurs several times receives the sum:
# `dE[v] = sum over n with a_n = v of dy_n`. With ids `(2, 0, 2, 2)` and output gradients
# `(1, 0), (0, 1), (1, 1), (2, 0)`, row 2 gets `(1,0) + (1,1) + (2,0) = (4, 1)`, row 0 gets `(0, 1)`
# and row 1, which no token uses, gets 0. A plain indexed `dE[ids] += dy` would keep only one of
# the three contributions to row 2.

# %%
table = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
ids = np.array([2, 0, 2, 2])
rows, emb_cache = embedding_forward(ids, table)
dy = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])
d_table = embedding_backward(dy, emb_cache)
naive = np.zeros_like(table)
naive[ids] += dy
print("lookup:\n", rows)
print("dE (scatter-add):\n", d_table)
print("dE[ids] += dy keeps one write per row:\n", naive)
np.testing.assert_array_equal(d_table, [[0.0, 1.0], [0.0, 0.0], [4.0, 1.0]])
assert not np.array_equal(naive, d_table)

# %% [markdown]
# ## N9: learned absolute positions
#
# GPT adds a learned vector per position: `x_t = E[a_t] + P[t]`. The table `P` has one row per
# position the model can address, so its length is the longest context; `offset` is where the
# rows start (after a cached prefix). The backward of the add sends `dy_t` to row `t` of `P`,
# summed over the batch, and gives nothing to rows that were not used.

# %%
P = np.array([[0.0, 0.0], [1.0, -1.0], [2.0, -2.0], [3.0, -3.0]])
x = np.zeros((2, 2, 2))  # two sequences of two positions
y_pos, pos_cache = learned_positions_forward(x, P, offset=1)
dx, dP = learned_positions_backward(np.ones((2, 2, 2)), pos_cache)
print("positions 1 and 2 added:\n", y_pos[0])
print("dP (rows 1, 2 get the batch sum 2; rows 0, 3 get 0):\n", dP)
np.testing.assert_array_equal(y_pos[0], P[1:3])
np.testing.assert_array_equal(dP, [[0, 0], [2, 2], [2, 2], [0, 0]])
try:
    learned_positions_forward(x, P, offset=3)
except ValueError as error:
    print("past the table:", error)

# %% [markdown]
# ## M2: GPT, Post-LN (GPT-1) and Pre-LN (GPT-2)
#
# GPT is the decoder of M1 without cross-attention: `x = E[a] + P` (no `sqrt(d)`), `L` layers of
# causal self-attention and a GELU FFN, both with biases, and logits `x_L E^T` from the last
# hidden state `x_L`, with the token table tied. GPT-1 normalises after each residual sum,
# `x <- LN(x + F(x))`; GPT-2 normalises the input of each branch, `x <- x + F(LN(x))`, and adds a
# final `LN_f` before the logits, because the stream itself is never normalised. The two
# parameter sets differ only by that final norm.
#
# The residual stream shows the difference. In Post-LN it leaves every layer normalised, with
# each row of standard deviation 1 (`gamma = 1`, `beta = 0` at initialisation). In Pre-LN it is a
# running sum that starts as small as the embeddings (std about `0.02 sqrt 2`) and grows as the
# layers add to it. (Lesson 2 measured what this does to the gradients by depth, N4.)

# %%
stream_std = {}
tokens = rng.integers(0, 64, (2, 16))
for position in ("post", "pre"):
    config = gpt.GPTConfig(vocab_size=64, max_seq_len=16, n_layers=6, d_model=64, n_heads=4,
                           norm_position=position, dropout=0.0)
    params = gpt.init_params(config, seed=0)
    x = params["tok_emb"][tokens] + params["pos_emb"][:16]
    stds = [x.std(axis=-1).mean()]
    for i in range(config.n_layers):
        x, _ = gpt.layer_forward(x, params, i, config)
        stds.append(x.std(axis=-1).mean())
    stream_std[position] = np.array(stds)
    print(f"{position}-LN stream std (embeddings, then after each layer): {stream_std[position]}")
print("parameters only Pre-LN has:",
      sorted(set(gpt.parameter_shapes(gpt.GPTConfig(norm_position="pre")))
             - set(gpt.parameter_shapes(gpt.GPTConfig(norm_position="post")))))
assert np.all(stream_std["post"][1:] > 0.99)
assert stream_std["pre"][0] < 0.05 and np.all(np.diff(stream_std["pre"]) > 0)

# %% [markdown]
# At full size, GPT-2 small (12 layers, width 768, 12 heads, context 1024, 50257 tokens, tied
# output) has 124,439,808 parameters.

# %%
gpt2_small = n_params(gpt.parameter_shapes(gpt.GPT_CONFIGS["gpt2-small"]))
print(f"gpt2-small: {gpt2_small:,} parameters")
assert gpt2_small == 124_439_808

# %% [markdown]
# ## N11: initialisation, std 0.02 and residual projections scaled by 1/sqrt(2L)
#
# Every weight matrix and both embedding tables start as `N(0, 0.02^2)`; biases and `beta` at 0,
# gains at 1. The two matrices that write into the residual stream, the attention output `w_o`
# and the FFN's second matrix (`w2` in GPT, `w_down` in M3), start with std `0.02 / sqrt(2L)`.
# For `L = 4` that is `0.02 / sqrt 8 = 0.00707`. The measured std of each tensor, layer by layer:

# %%
config = gpt.GPTConfig(vocab_size=64, max_seq_len=32, n_layers=4, d_model=64, n_heads=4,
                       dropout=0.0)
params = gpt.init_params(config, seed=0)
residual_std = 0.02 / math.sqrt(2 * config.n_layers)
kinds = sorted({name.split(".", 2)[-1] for name in params if name.startswith("layers.")})
print(f"{'tok_emb':>12}: std {params['tok_emb'].std():.5f}")
print(f"{'pos_emb':>12}: std {params['pos_emb'].std():.5f}")
for kind in kinds:
    values = [params[f"layers.{i}.{kind}"] for i in range(config.n_layers)]
    if values[0].ndim == 1:  # biases and LayerNorm gains and shifts: constants
        print(f"{kind:>12}: every entry {values[0][0]:g}")
    else:
        print(f"{kind:>12}: std " + " ".join(f"{v.std():.5f}" for v in values)
              + f"   mean {np.mean([v.mean() for v in values]):+.1e}")
for name, value in params.items():
    if name.endswith("gamma"):
        np.testing.assert_array_equal(value, 1.0)
    elif value.ndim == 1:
        np.testing.assert_array_equal(value, 0.0)
    else:  # within five standard errors of the sample std
        sigma = residual_std if name.endswith(("attn.w_o", "ffn.w2")) else 0.02
        assert abs(value.std() - sigma) < 5 * sigma / math.sqrt(2 * (value.size - 1)), name

# %% [markdown]
# The modern decoder follows the same rule, with `w_down` as the FFN's writing matrix and RMSNorm
# gains at 1 (it has no biases):

# %%
deep_m3 = decoder.DecoderConfig(vocab_size=64, max_seq_len=32, d_model=64, n_layers=4, n_heads=4,
                                n_kv_heads=2, ffn_multiple_of=16)
m3_params = decoder.init_params(deep_m3, seed=0)
for kind in ("attn.w_q", "attn.w_k", "attn.w_o", "ffn.w_gate", "ffn.w_down"):
    print(f"{kind:>12}: std " + " ".join(f"{m3_params[f'layers.{i}.{kind}'].std():.5f}"
                                         for i in range(deep_m3.n_layers)))
for name, value in m3_params.items():
    if name.endswith("gamma"):
        np.testing.assert_array_equal(value, 1.0)
    else:
        writes_stream = name.endswith(("attn.w_o", "ffn.w_down"))
        sigma = 0.02 / math.sqrt(2 * deep_m3.n_layers) if writes_stream else 0.02
        assert abs(value.std() - sigma) < 5 * sigma / math.sqrt(2 * (value.size - 1)), name

# %% [markdown]
# Why `1/sqrt(2L)`: the final stream is the embedding plus `2L` branch outputs. If the branches
# are roughly uncorrelated and each adds variance `s^2`, the stream gains `2L s^2`, growing with
# depth. Dividing each writing matrix by `sqrt(2L)` divides each branch's variance by `2L`, so
# the total added is about `s^2` at every depth. Below, the variance a Pre-LN GPT adds to the
# stream at initialisation, with the scaled matrices and with the same draws multiplied back by
# `sqrt(2L)`.

# %%
depths = [1, 2, 4, 8, 16]
added = {True: [], False: []}
tokens = rng.integers(0, 64, (4, 16))
for n_layers in depths:
    config = gpt.GPTConfig(vocab_size=64, max_seq_len=16, n_layers=n_layers, d_model=64,
                           n_heads=4, dropout=0.0)
    base = gpt.init_params(config, seed=0)
    for scaled in (True, False):
        params = {name: value if scaled or not name.endswith(("attn.w_o", "ffn.w2"))
                  else value * math.sqrt(2 * n_layers) for name, value in base.items()}
        x = params["tok_emb"][tokens] + params["pos_emb"][:16]
        start = x.var()
        for i in range(n_layers):
            x, _ = gpt.layer_forward(x, params, i, config)
        added[scaled].append(x.var() - start)
for n_layers, a, b in zip(depths, added[True], added[False]):
    print(f"L = {n_layers:2}: variance added, scaled {a:.2e}, unscaled {b:.2e}")
assert max(added[True]) < 1.3 * min(added[True])  # flat in depth
assert added[False][-1] > 10 * added[False][0]  # grows roughly like 2L

fig, ax = plt.subplots(figsize=(5.5, 3.2), layout="constrained")
ax.plot(depths, added[True], "o-", label="std 0.02 / sqrt(2L)")
ax.plot(depths, added[False], "s-", label="std 0.02")
ax.set(xscale="log", yscale="log", xlabel="layers L", ylabel="variance added to the stream",
       title="residual writers at initialisation")
ax.set_xticks(depths, [str(d) for d in depths])
ax.legend()
plt.show()

# %% [markdown]
# ## M3: the modern decoder
#
# A Llama-style layer keeps GPT-2's Pre-norm arrangement and changes every part:
#
# `x' = x + Attn(RMSNorm(x))`,  `x'' = x' + SwiGLU(RMSNorm(x'))`,
#
# with RMSNorm instead of LayerNorm, no biases anywhere, no position table (RoPE rotates queries
# and keys inside attention, N10), `g` key/value heads shared by `h` query heads (GQA), and the
# gated FFN `(SiLU(x W_gate) * (x W_up)) W_down` of width about `8d/3`. A final RMSNorm and an
# (untied) output matrix give the logits. With `d = 32`, `h = 4`, `g = 2`: `d_h = 8`, so `w_q` is
# `32 x 32`, `w_k` and `w_v` are `32 x 16`, and `d_f = 8 * 32 / 3 = 85.3`, rounded up to a
# multiple of 16, is 96.

# %%
m3 = decoder.DecoderConfig(vocab_size=32, max_seq_len=16, d_model=32, n_layers=2, n_heads=4,
                           n_kv_heads=2, ffn_multiple_of=16)
shapes = decoder.param_shapes(m3)
for name, shape in shapes.items():
    if not name.startswith("layers.1."):
        print(f"{name:>22}  {shape}")
assert shapes["layers.0.attn.w_k"] == (32, 16) and m3.d_f == 96
# no position table, and the only vectors are RMSNorm gains: no biases, no LayerNorm shifts
assert "pos_emb" not in shapes
assert all(name.endswith(".gamma") for name, shape in shapes.items() if len(shape) == 1)

# %% [markdown]
# A forward and backward pass, and a central-difference check of two parameters: `w_k`, whose
# gradient sums over the two query heads that share each key head, and an RMSNorm gain.

# %%
params = decoder.init_params(m3, seed=0)
tokens = rng.integers(0, 32, (2, 8))
batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
loss, cache = decoder.forward(params, batch, m3)
grads = decoder.backward(cache)
print(f"loss {float(loss):.4f} (log 32 = {np.log(32):.4f})")
for name in ("layers.0.attn.w_k", "layers.1.ln2.gamma"):
    coords = check_rng.choice(params[name].size, size=5, replace=False)
    numeric = numerical_gradient(lambda: float(decoder.forward(params, batch, m3)[0]),
                                 params[name], coords)
    error = relative_error(grads[name].reshape(-1)[coords], numeric).max()
    print(f"{name}: largest relative error {error:.1e}")
    assert error < 1e-6

# %% [markdown]
# ## A9: one fused projection equals three
#
# `[Q K V] = X [W_Q W_K W_V]`: concatenating the three weight matrices side by side gives one
# matrix of width `(h + 2g) d_h`, one matrix product instead of three, and the same numbers up to
# rounding. With `d = 4`, `h = 2`, `g = 1`, `d_h = 2` the fused matrix is `4 x 8`.

# %%
d, h, g, d_h = 4, 2, 1, 2
x = rng.standard_normal((3, d))
separate = {"w_q": rng.standard_normal((d, h * d_h)), "w_k": rng.standard_normal((d, g * d_h)),
            "w_v": rng.standard_normal((d, g * d_h)), "w_o": rng.standard_normal((h * d_h, d))}
fused = {"w_qkv": np.concatenate([separate["w_q"], separate["w_k"], separate["w_v"]], axis=1),
         "w_o": separate["w_o"]}
y_separate, _ = mha_forward(x, separate, n_heads=h, n_kv_heads=g)
y_fused, _ = mha_forward(x, fused, n_heads=h, n_kv_heads=g)
print("w_qkv shape", fused["w_qkv"].shape,
      "  largest difference", np.abs(y_fused - y_separate).max())
assert fused["w_qkv"].shape == (d, (h + 2 * g) * d_h)
np.testing.assert_allclose(y_fused, y_separate, rtol=1e-12, atol=1e-14)

# %% [markdown]
# ## A10: the GQA head map; MHA is g = h, MQA is g = 1
#
# Query head `r` reads key/value head `pi(r) = floor(r / (h/g))`, counting heads from 0 (counting
# from 1 it reads `1 + floor((r-1) / (h/g))`): consecutive blocks of `h/g` query heads share one
# key and one value head. For `h = 8`:

# %%
for g in (8, 2, 1):
    print(f"g = {g}: {gqa_head_map(8, g)}")
np.testing.assert_array_equal(gqa_head_map(8, 8), np.arange(8))
np.testing.assert_array_equal(gqa_head_map(8, 2), np.arange(8) // (8 // 2))  # floor(r / (h/g))
np.testing.assert_array_equal(gqa_head_map(8, 2), [0, 0, 0, 0, 1, 1, 1, 1])
np.testing.assert_array_equal(gqa_head_map(8, 1), np.zeros(8, dtype=int))
try:
    gqa_head_map(8, 3)
except ValueError as error:
    print("g = 3:", error)

# %% [markdown]
# Each query head keeps its own `W_Q` columns; only keys and values are shared. So GQA is exactly
# MHA whose key and value matrices repeat each shared head's columns for the `h/g` query heads of
# its block:

# %%
d, h, g, d_h = 8, 4, 2, 2
x = rng.standard_normal((5, d))
gqa = {"w_q": rng.standard_normal((d, h * d_h)), "w_k": rng.standard_normal((d, g * d_h)),
       "w_v": rng.standard_normal((d, g * d_h)), "w_o": rng.standard_normal((h * d_h, d))}


def repeat_heads(w):
    return w.reshape(d, g, d_h)[:, gqa_head_map(h, g)].reshape(d, h * d_h)


mha = {**gqa, "w_k": repeat_heads(gqa["w_k"]), "w_v": repeat_heads(gqa["w_v"])}
np.testing.assert_allclose(mha_forward(x, gqa, n_heads=h, n_kv_heads=g)[0],
                           mha_forward(x, mha, n_heads=h)[0], rtol=1e-12, atol=1e-14)
print("GQA with g = 2 equals MHA with each key/value head repeated for its 2 query heads")

# %% [markdown]
# Sharing saves parameters and, above all, cache (K6). One attention block has
# `d h d_h + 2 d g d_h + h d_h d` weights. At `d = 4096`, `h = 32`, `d_h = 128`:
# MHA (`g = 32`) has `4 d^2 = 67,108,864`; GQA with `g = 8` has `2 d^2 + 2 d (d/4) = 41,943,040`;
# MQA (`g = 1`) has `2 d^2 + 2 d 128 = 34,603,008`. The tiny M3 above agrees with the same formula.

# %%
for name, g in (("MHA", 32), ("GQA", 8), ("MQA", 1)):
    print(f"{name} g = {g:2}: {attention_parameter_count(4096, 32, g, 128):>11,} parameters, "
          f"K and V cache {kv_cache_bytes_per_token(1, g, 128, 2):>6,} bytes per token and layer "
          f"in 16 bits")
assert attention_parameter_count(4096, 32, 32, 128) == 4 * 4096**2 == 67_108_864
assert attention_parameter_count(4096, 32, 8, 128) == 2 * 4096**2 + 2 * 4096 * 1024 == 41_943_040
assert attention_parameter_count(4096, 32, 1, 128) == 34_603_008
layer0_attn = n_params({k: v for k, v in shapes.items() if k.startswith("layers.0.attn.")})
assert layer0_attn == attention_parameter_count(m3.d_model, m3.n_heads, m3.kv_heads, m3.d_h)

# %% [markdown]
# ## M4: the MLA decoder at a glance
#
# The MLA decoder is the M3 layer with multi-head latent attention in place of GQA. Keys and
# values come from one latent row per token, `c_j = x_j W_DKV` of width `d_c`, expanded per head
# by `W_UK` and `W_UV` (`U_K`, `U_V` in the catalogue); position enters through a separate
# rotated key `k^R_j` of width `d_R`, shared by all heads. The scores are
# `(q^C k^C^T + q^R k^R^T) / sqrt(d_k + d_R)`. Every head's content key and value are linear in
# `c_j`, so a cache needs only `c_j` and `k^R_j`: `d_c + d_R` numbers per token and layer, against
# `2 h d_h` for MHA.
# Below, `d = 32`, `h = 4`, `d_c = 16`, `d_R = 4`: 20 numbers instead of 64.

# %%
m4 = mla.MLAConfig(vocab_size=32, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, d_c=16,
                   d_rope=4, ffn_multiple_of=16)
for name, shape in mla.param_shapes(m4).items():
    if name.startswith("layers.0.attn."):
        print(f"{name:>22}  {shape}")
params = mla.init_params(m4, seed=0)
loss, cache = mla.forward(params, batch, m4)
grads = mla.backward(cache)
c, k_r = mla.layer_latents(cache)[0]
print(f"loss {float(loss):.4f}; layer 0 caches c {c.shape} and k^R {k_r.shape}: "
      f"{m4.d_c + m4.d_rope} numbers per token, "
      f"MHA would cache 2 h d_h = {2 * m4.n_heads * m4.d_k}")
assert c.shape == (2, 7, 16) and k_r.shape == (2, 7, 4)
assert set(grads) == set(params)

# %% [markdown]
# At GPT-2-small scale (the `small` preset: 12 layers, 12 heads of width 64, `d_c = 256`,
# `d_R = 32`), the MLA cache per token is `12 * (256 + 32) * 2` bytes, against
# `12 * 2 * 12 * 64 * 2` for MHA: 5.3 times smaller.

# %%
big = mla.preset("small")
mla_bytes = mla_cache_bytes_per_token(big.n_layers, big.d_c, big.d_rope, 2)
mha_bytes = kv_cache_bytes_per_token(big.n_layers, big.n_heads, big.d_k, 2)
print(f"MLA {mla_bytes:,} bytes per token, MHA {mha_bytes:,}: ratio {mha_bytes / mla_bytes:.2f}; "
      f"{n_params(mla.param_shapes(big)):,} parameters")
assert mla_bytes == 12 * 288 * 2 and mha_bytes == 12 * 2 * 12 * 64 * 2

# %% [markdown]
# ## L6: one masked pass scores every prefix
#
# Training computes all `T` next-token losses of a sequence in one pass. That is only honest if
# position `t`'s prediction is exactly what the model would say given the prefix `a_1 .. a_t`
# alone. The causal mask guarantees it; here we check it by brute force: run every prefix on its
# own, keep only the loss of its last position (a loss mask), and average. For every decoder the
# result equals the one-pass loss up to rounding, and every prefix's last logits equal the row of
# the one-pass logits.

# %%
gpt_config = gpt.GPTConfig(vocab_size=32, max_seq_len=16, n_layers=2, d_model=32, n_heads=4,
                           dropout=0.0)
decoders = {"GPT (M2)": (gpt, gpt_config), "modern (M3)": (decoder, m3), "MLA (M4)": (mla, m4)}
T = batch["tokens"].shape[1]
for label, (module, config) in decoders.items():
    params = module.init_params(config, seed=3)
    parallel, _ = module.forward(params, batch, config)
    full_logits = module.logits(params, batch["tokens"], config)
    prefix_losses = []
    for n in range(1, T + 1):
        last_only = np.zeros((2, n), dtype=int)
        last_only[:, -1] = 1
        prefix = {"tokens": batch["tokens"][:, :n], "targets": batch["targets"][:, :n],
                  "loss_mask": last_only}
        prefix_losses.append(float(module.forward(params, prefix, config)[0]))
        np.testing.assert_allclose(module.logits(params, prefix["tokens"], config)[:, -1],
                                   full_logits[:, n - 1], rtol=1e-12, atol=1e-14)
    print(f"{label:12}: one pass {float(parallel):.12f}, mean of {T} prefix runs "
          f"{np.mean(prefix_losses):.12f}")
    np.testing.assert_allclose(parallel, np.mean(prefix_losses), rtol=1e-13)

# %% [markdown]
# ## K1: appending tokens changes nothing that came before
#
# The same mask has a second consequence, the one a KV cache relies on: what a cache keeps for
# position `t`, at every depth, depends on tokens `1 .. t` only. For GPT and M3 that is each
# layer's keys and values; for MLA, each layer's latent `c` and rotated key `k^R`. Append three
# tokens to a sequence of five and, in every decoder, the first five rows of each of those
# tensors, and the first five rows of logits, stay as they were, up to rounding at most.

# %%
def cached_states(module, cache):
    """Per layer, the two tensors a cache keeps, with positions on axis 1: (B, T, ...)."""
    if module is mla:
        return mla.layer_latents(cache)  # c (B, T, d_c) and k^R (B, T, d_R)
    if module is gpt:
        pairs = [(layer.attn.branch.attn.k, layer.attn.branch.attn.v) for layer in cache.layers]
    else:
        pairs = decoder.layer_kv(cache)
    return [(np.moveaxis(k, 2, 1), np.moveaxis(v, 2, 1)) for k, v in pairs]  # from (B, g, T, d_h)


short = rng.integers(0, 32, (2, 5))
long = np.concatenate([short, rng.integers(0, 32, (2, 3))], axis=1)
for label, (module, config) in decoders.items():
    params = module.init_params(config, seed=4)
    _, short_cache = module.forward(params, {"tokens": short, "targets": short}, config)
    _, long_cache = module.forward(params, {"tokens": long, "targets": long}, config)
    states_short = cached_states(module, short_cache)
    states_long = cached_states(module, long_cache)
    assert len(states_short) == len(states_long) == config.n_layers
    change = 0.0
    for pair_short, pair_long in zip(states_short, states_long):
        for s_rows, l_rows in zip(pair_short, pair_long):
            assert l_rows.shape[1] == 8 and s_rows.shape[1] == 5
            change = max(change, np.abs(l_rows[:, :5] - s_rows).max())
            np.testing.assert_allclose(l_rows[:, :5], s_rows, rtol=1e-12, atol=1e-14)
    z_short, z_long = module.logits(params, short, config), module.logits(params, long, config)
    print(f"{label:12}: largest change in the first five rows: cached states {change:.1e}, "
          f"logits {np.abs(z_long[:, :5] - z_short).max():.1e}")
    np.testing.assert_allclose(z_long[:, :5], z_short, rtol=1e-12, atol=1e-14)

# %% [markdown]
# ## O5: which parameters take weight decay
#
# AdamW shrinks each parameter by `1 - eta lambda` per step. That suits weight matrices; it does
# not suit biases and norm gains and shifts (pulling a gain towards 0 is not a simpler model, only
# a different one). So parameters come in groups with their own `lambda`: the default rule of
# `takes_weight_decay` gives `lambda` to the layers' weight matrices and the output head, and 0 to
# biases, norm gains and shifts, and embedding tables (a common choice, not a universal one: decay
# shrinks every row at every step, while a rare token's row gets a gradient only when the token
# occurs).

# %%
for label, shapes_of in (("M1", tm.param_shapes(tm.TRANSFORMER_TINY)),
                         ("M2", gpt.parameter_shapes(gpt_config)),
                         ("M3", decoder.param_shapes(m3))):
    leaves = {}
    for name in shapes_of:
        leaves.setdefault(name.split(".")[-1], takes_weight_decay(name))
    decayed = sum(math.prod(s) for n, s in shapes_of.items() if takes_weight_decay(n))
    print(f"{label}: decay {sorted(k for k, v in leaves.items() if v)}")
    print(f"    no decay {sorted(k for k, v in leaves.items() if not v)}; "
          f"{decayed / n_params(shapes_of):.0%} of the parameters decay")
assert takes_weight_decay("layers.0.attn.w_q") and takes_weight_decay("lm_head")
assert not any(takes_weight_decay(n) for n in ("layers.0.ln1.gamma", "layers.0.ln1.beta",
                                                "layers.0.attn.b_q", "layers.0.ffn.b1",
                                                "tok_emb", "pos_emb"))

# %% [markdown]
# One AdamW step with a zero gradient shows the groups at work: with `eta = 0.1` and
# `lambda = 0.5`, every decayed tensor is multiplied by exactly `1 - 0.05 = 0.95`, and the others
# do not move.

# %%
params = gpt.init_params(gpt_config, seed=0)
before = {name: value.copy() for name, value in params.items()}
AdamW(lr=0.1, weight_decay=0.5).step(params, {name: np.zeros_like(v) for name, v in params.items()})
for name in ("layers.0.attn.w_q", "layers.0.ffn.w2", "layers.0.ln1.gamma", "layers.0.attn.b_q",
             "tok_emb"):
    ratio = np.linalg.norm(params[name]) / max(np.linalg.norm(before[name]), 1e-300)
    print(f"{name:>20}: |after| / |before| = {ratio:.4f}" if before[name].any()
          else f"{name:>20}: zero before, zero after")
for name in params:
    expected = before[name] * (0.95 if takes_weight_decay(name) else 1.0)
    np.testing.assert_allclose(params[name], expected, rtol=1e-15)

# %% [markdown]
# ## Every decoder learns
#
# Everything together: 150 steps of AdamW (weight decay 0.1 on the parameters O5 decays), a
# warmup-cosine learning rate and gradient clipping at 1, in float32, for GPT in both
# arrangements, the modern decoder and the MLA decoder, all of width 32 and depth 2, on batches of
# 8 windows of 32 characters of a generated English text. Every model starts at about `log V` and
# ends well below (by more than 0.5 nats) the unigram entropy, the loss of a model that ignores
# the context. (The ranking of the four
# after so few steps, from one seed, is not a verdict on the architectures.)

# %%
task = CharLMTask(seq_len=32, n_sentences=400)
V = task.vocab_size
unigram = task.unigram_entropy()
print(f"V = {V}, log V = {np.log(V):.3f}; unigram entropy {unigram:.3f}, "
      f"entropy rate of the text {task.entropy_rate():.3f} (nats per character)")
models = {
    "GPT Post-LN": (gpt, gpt.GPTConfig(vocab_size=V, max_seq_len=32, n_layers=2, d_model=32,
                                       n_heads=4, norm_position="post", dropout=0.0)),
    "GPT Pre-LN": (gpt, gpt.GPTConfig(vocab_size=V, max_seq_len=32, n_layers=2, d_model=32,
                                      n_heads=4, dropout=0.0)),
    "modern (M3)": (decoder, decoder.DecoderConfig(vocab_size=V, max_seq_len=32, d_model=32,
                                                   n_layers=2, n_heads=4, n_kv_heads=2,
                                                   ffn_multiple_of=16)),
    "MLA (M4)": (mla, mla.MLAConfig(vocab_size=V, max_seq_len=32, d_model=32, n_layers=2,
                                    n_heads=4, d_c=16, d_rope=4, ffn_multiple_of=16)),
}
steps, max_lr = 150, 3e-3
curves = {}
for label, (module, config) in models.items():
    params = module.init_params(config, seed=0, dtype=np.float32)
    optimiser = AdamW(lr=max_lr, weight_decay=0.1)
    losses = []
    for step in range(1, steps + 1):
        loss, cache = module.forward(params, task.batch("train", step - 1, 8, seed=0), config)
        grads = module.backward(cache)
        clip_grad_norm(grads, 1.0)
        optimiser.step(params, grads, lr=warmup_cosine(step, max_lr, warmup=20, total=steps,
                                                        min_lr=max_lr / 10))
        losses.append(float(loss))
    curves[label] = np.array(losses)
    print(f"{label:12}: first loss {losses[0]:.3f} (log V = {np.log(V):.3f}), "
          f"mean of the last 10 {np.mean(losses[-10:]):.3f} (unigram entropy {unigram:.3f})")
    assert abs(losses[0] - np.log(V)) < 0.1
    assert np.mean(losses[-10:]) < unigram - 0.5

fig, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
for label, losses in curves.items():
    ax.plot(np.arange(1, steps + 1), losses, lw=1, label=label)
ax.axhline(unigram, color="gray", ls="--", label="unigram entropy")
ax.axhline(task.entropy_rate(), color="black", ls=":", label="entropy rate of the text")
ax.set(xlabel="step", ylabel="cross-entropy (nats per character)",
       title="four tiny decoders, 150 steps of AdamW")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The same four recipes at the sizes of their presets, counted from their shapes: M1 at the
# paper's base size, the three decoders at GPT-2-small scale.

# %%
full_size = {
    "TRANSFORMER_BASE (M1)": tm.param_shapes(tm.TRANSFORMER_BASE),
    "gpt2-small (M2)": gpt.parameter_shapes(gpt.GPT_CONFIGS["gpt2-small"]),
    "llama-small (M3)": decoder.param_shapes(decoder.preset("llama-small")),
    "MLA small (M4)": mla.param_shapes(mla.preset("small")),
}
for label, shapes_of in full_size.items():
    print(f"{label:>22}: {n_params(shapes_of):>12,} parameters")
