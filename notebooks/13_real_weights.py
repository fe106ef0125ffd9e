# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
#   refmath:
#     figures: 2
#     minutes: 40
#     ids: []
# ---

# %% [markdown]
# # Lesson 13: real weights, the same function as the library everyone uses
#
# refmath's models are written for reading, but they are not toys: a checkpoint trained with
# Hugging Face `transformers` (Wolf et al., 2020) runs in them and gives the same logits. This
# lesson follows one tiny checkpoint through `refmath.hf`:
#
# - what a Hugging Face model directory holds: `config.json` and a safetensors file, whose
#   format fits in a paragraph;
# - how weight names and layouts map (`nn.Linear` stores $W^\top$, refmath stores $W$);
# - why RoPE's two pair layouts, *interleaved* and *half*, are the same function once the query
#   and key columns are permuted;
# - how a bfloat16 number becomes a float32 without NumPy knowing what a bfloat16 is;
# - and a comparison of logits with `transformers` itself, when it is installed.
#
# **Prerequisites:** lessons 4 (RoPE and its two pair layouts), 7 (GPT) and 8 (the modern decoder
# and GQA); lesson 9's floating-point formats help with the bfloat16 part.
#
# **Goals:** read a tensor out of a safetensors file with nothing but its header; say why every
# linear weight is transposed on loading; show that the half and interleaved RoPE layouts differ
# by a permutation of the query and key rows within each head, and write that permutation;
# convert bfloat16 bit patterns to float32 by hand and bound their rounding error; count a
# checkpoint's parameters and bytes from its `config.json`.
#
# **Catalogue IDs:** none of its own (it loads the models of lessons 7 and 8 from real checkpoints)
#
# **Duration:** about 40 minutes.

# %%
import json
import math
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from refmath import hf
from refmath.lessons import check, check_function, check_true
from refmath.models import decoder
from refmath.positions import rope_forward

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)
workdir = Path(tempfile.mkdtemp())

# %% [markdown]
# ## A tiny Llama, written as a Hugging Face checkpoint
#
# A modern decoder (lesson 8) with grouped-query attention, $h = 4$ query heads sharing $g = 2$
# key/value heads of width $d_h = 8$, RoPE in the *interleaved* layout (the original Llama code's,
# and refmath's default), an untied output matrix, random weights in float64.

# %%
config = decoder.DecoderConfig(vocab_size=50, max_seq_len=32, d_model=32, n_layers=2, n_heads=4,
                               n_kv_heads=2, d_ff=48, rope_layout="interleaved")
params = decoder.init_params(config, seed=1)
params = {k: v + 0.05 * rng.standard_normal(v.shape) for k, v in params.items()}
directory = hf.save_checkpoint(workdir / "tiny-llama", "llama", config, params)
weights_path = directory / hf.WEIGHTS_FILE
print(sorted(p.name for p in directory.iterdir()))
print(json.dumps(hf.read_config(directory), indent=1))

# %% [markdown]
# ## The safetensors format
#
# Eight bytes give the length $N$ of a JSON header, as a little-endian unsigned integer; the
# header maps each tensor's name to its dtype, shape and byte range `data_offsets` $[b, e)$,
# counted from the end of the header; the raw little-endian data follow. A tensor's bytes are
# therefore bytes $8 + N + b$ to $8 + N + e$ of the file. Nothing is pickled, so reading a file
# runs no code, and any tensor can be read on its own, through a memory map, without reading the
# others. That is how `refmath.hf` keeps its peak memory near the size of the converted
# parameters.

# %%
with open(weights_path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
for tensor_name in sorted(header)[:6]:
    print(f"{tensor_name:<45} {header[tensor_name]}")
print(f"... {len(header) - 1} tensors, header {n} bytes")

# %% [markdown]
# **Exercise 13.1.** Read `model.embed_tokens.weight` out of the file with `open`, `f.seek`, `f.read`
# and `np.frombuffer` (its dtype `F64` is NumPy's `"<f8"`), reshaped to the header's shape. The
# check compares it with the embedding table the model was saved from, `params["tok_emb"]`
# (both are $V \times d$: an embedding is a lookup table, not a linear map, so nothing is
# transposed).

# %% tags=["exercise"]
tensor_name = "model.embed_tokens.weight"
embedding = ...  # (50, 32) float64, straight from the bytes of weights_path
# BEGIN SOLUTION
begin, end = header[tensor_name]["data_offsets"]
with open(weights_path, "rb") as f:
    f.seek(8 + n + begin)
    embedding = np.frombuffer(f.read(end - begin), dtype="<f8").reshape(
        header[tensor_name]["shape"])
# END SOLUTION

# %%
check("13.1", embedding)


# %% [markdown]
# The rest of the lesson reads its tensors with `refmath.hf`'s own reader, which does what you
# just did (and checks that each tensor lies inside the file):

# %%
def read_tensor(path, tensor_name):
    """One tensor of a safetensors file as float64, read by refmath.hf through its header alone."""
    return hf._read_tensor(hf._read_header(Path(path))[tensor_name], np.float64)


# %% [markdown]
# ## Weight layouts: $W$ against $W^\top$
#
# Hugging Face's `k_proj.weight` of shape $(g d_h, d)$ is `nn.Linear`'s $W_K^\top$: the layer
# computes $x W_K^\top$ for a row vector $x$. refmath's `w_k` is $(d, g d_h)$ and computes
# $x W_K$, so the loader transposes every linear weight. (GPT-2's `Conv1D` already stores $W$.)
# The value projection is stored exactly transposed; the query and key projections are also
# permuted, as the next section explains.

# %%
k_proj = read_tensor(weights_path, "model.layers.0.self_attn.k_proj.weight")
v_proj = read_tensor(weights_path, "model.layers.0.self_attn.v_proj.weight")
print("k_proj.weight", k_proj.shape, "  refmath w_k", params["layers.0.attn.w_k"].shape)
print("v_proj.weight is w_v transposed:", np.array_equal(v_proj.T, params["layers.0.attn.w_v"]))
print("k_proj.weight is w_k transposed:", np.array_equal(k_proj.T, params["layers.0.attn.w_k"]))

# %% [markdown]
# ## Two RoPE layouts, one function
#
# RoPE (Su et al., 2021) rotates coordinate pairs of each head by angles $p\,\omega_r$. The
# interleaved layout pairs $(x_{2r}, x_{2r+1})$; Hugging Face's Llama (`rotate_half`) pairs
# $(x_r, x_{r+d_h/2})$. With the permutation $\pi = [0, 2, 4, \dots, 1, 3, 5, \dots]$ of a
# head's coordinates,
#
# $$\operatorname{RoPE}_{\text{half}}(x_\pi) = \operatorname{RoPE}_{\text{interleaved}}(x)_\pi ,$$
#
# and a score $\tilde q \cdot \tilde k = \sum_j \tilde q_j \tilde k_j$ does not change when both
# vectors are permuted alike. So a model trained with one layout runs with the other once the
# columns of $W_Q$ and $W_K$ are permuted by $\pi$ within each head; `save_checkpoint` does
# exactly that (`hf.interleaved_to_half`). Checked on one head:

# %%
d_h = config.d_h
pi = np.concatenate([np.arange(0, d_h, 2), np.arange(1, d_h, 2)])
x = rng.standard_normal((5, d_h))  # 5 positions
interleaved = rope_forward(x, layout="interleaved")[0]
half = rope_forward(x[:, pi], layout="half")[0]
print("pi =", pi)
print("RoPE_half(x_pi) == RoPE_interleaved(x)_pi:", np.allclose(half, interleaved[:, pi]))
q, k = rng.standard_normal((2, 5, d_h))
scores = rope_forward(q, layout="interleaved")[0] @ rope_forward(k, layout="interleaved")[0].T
scores_half = rope_forward(q[:, pi], layout="half")[0] @ rope_forward(k[:, pi], layout="half")[0].T
print("largest score difference:", np.abs(scores - scores_half).max())

# %% [markdown]
# The permutation can be read off the file itself: the figure marks the pairs (row $i$ of
# `q_proj.weight`, column $j$ of refmath's $W_Q$) that hold the same $d$ numbers. Within each of
# the four heads (the red lines), row $i$ holds column $\pi_i$: the even coordinates first, then
# the odd ones.

# %%
q_proj = read_tensor(weights_path, "model.layers.0.self_attn.q_proj.weight")  # (h d_h, d)
w_q = params["layers.0.attn.w_q"]                                             # (d, h d_h)


def equal_rows_and_columns(rows_of, columns_of):
    """1 where row i of rows_of holds the numbers of column j of columns_of (drawn, not kept: it
    is not an answer to the exercise below)."""
    return np.array([[np.array_equal(rows_of[i], columns_of[:, j])
                      for j in range(columns_of.shape[1])] for i in range(rows_of.shape[0])],
                    dtype=float)


fig, ax = plt.subplots(figsize=(5.6, 4.6), layout="constrained")
image = ax.imshow(equal_rows_and_columns(q_proj, w_q), cmap="Greys", vmin=0, vmax=1)
for edge in range(d_h, w_q.shape[1], d_h):
    ax.axhline(edge - 0.5, color="tab:red", lw=0.8)
    ax.axvline(edge - 0.5, color="tab:red", lw=0.8)
ax.set(xlabel="column $j$ of refmath's $W_Q$ (interleaved pairs)",
       ylabel="row $i$ of q_proj.weight (half pairs)",
       title="one permutation per head between the RoPE layouts")
fig.colorbar(image, ax=ax, ticks=[0, 1], label="1 where row $i$ equals column $j$")
plt.show()

# %% [markdown]
# **Exercise 13.2.** Loading a Hugging Face checkpoint into a model that uses the *interleaved*
# layout needs the inverse: the row of `q_proj.weight` that each interleaved column comes from.
# Write `rows`, an integer array of length $h d_h$, such that `q_proj[rows].T` is refmath's $W_Q$
# (for one head it is $\pi^{-1} = [0, d_h/2, 1, d_h/2 + 1, \dots]$: interleaved coordinate $2r$
# is half coordinate $r$, and $2r + 1$ is $r + d_h/2$). The cell after the check applies
# its first $g d_h$ entries to the keys.

# %% tags=["exercise"]
heads = config.n_heads
rows = ...  # (h * d_h,) integers
# BEGIN SOLUTION
one_head = np.stack([np.arange(d_h // 2), np.arange(d_h // 2) + d_h // 2], axis=1).reshape(-1)
rows = (np.arange(heads)[:, None] * d_h + one_head[None, :]).reshape(-1)
# END SOLUTION

# %%
check_true("rows is a permutation of the rows",
           lambda r: np.array_equal(np.sort(r), np.arange(heads * d_h)),
           "each of the h d_h rows must be used exactly once", of=rows)

# %%
check("13.2", rows)

# %%
# After the exercise: the same rows load both W_Q and, their first g d_h, W_K.
if rows is not Ellipsis and np.array_equal(np.sort(rows), np.arange(heads * d_h)):
    print("W_Q loads exactly:", np.array_equal(q_proj[rows].T, w_q), "  W_K:",
          np.array_equal(k_proj[rows[:config.kv_heads * d_h]].T, params["layers.0.attn.w_k"]))

# %% tags=["exercise"]
# Exercise 13.3: write the loader's permutation as a function: `my_half_to_interleaved(w, head_dim)`
# takes the columns of a query or key projection in the "half" layout (last axis n * head_dim, n
# heads; a bias (n * head_dim,) too) and returns them in the interleaved layout, the inverse of
# `hf.interleaved_to_half`. The check compares it with that inverse on this checkpoint's q_proj
# and k_proj (transposed), a bias, a single head and head widths 4 to 16.
def my_half_to_interleaved(w, head_dim):
    out = ...
    # BEGIN SOLUTION
    half = head_dim // 2
    within = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    n_heads = w.shape[-1] // head_dim
    columns = (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)
    out = w[..., columns]
    # END SOLUTION
    return out


# %%
check("13.3", my_half_to_interleaved)

# %% [markdown] tags=["question"]
# **Question.** `save_checkpoint` permutes the columns of $W_Q$ and $W_K$ but leaves $W_V$ and
# $W_O$ as they are. Why is that enough, and what would the model compute if only $W_Q$ were
# permuted?
#
# <!-- BEGIN SOLUTION -->
# The layout only matters where RoPE acts, on queries and keys, and they meet only in the score
# $\tilde q \cdot \tilde k = \sum_j \tilde q_j \tilde k_j$. $\pi$ sends each interleaved pair
# $(2r, 2r+1)$ to the half pair $(r, r + d_h/2)$ with the same frequency $\omega_r$, so the half
# layout rotates the permuted vectors exactly as the interleaved one rotated the originals, and a
# sum over $j$ does not care in which order its terms come when $q$ and $k$ are reordered alike.
# Values are never rotated: their columns meet only the rows of $W_O$, in the same order on
# both sides, so nothing needs to move (permuting $W_V$'s columns together with $W_O$'s rows would
# be harmless, and pointless). Permuting $W_Q$ alone would multiply $q_{\pi_j}$ with $k_j$:
# different scores, a different, and untrained, model.
# <!-- END SOLUTION -->

# %% [markdown]
# So the checkpoint loads with `rope_layout="half"` and its weights untouched, and computes the
# same logits as the interleaved model we started from:

# %%
model_name, loaded_config, loaded = hf.load_checkpoint(directory, dtype=np.float64)
print(model_name, "rope_layout:", loaded_config.rope_layout)
tokens = rng.integers(0, config.vocab_size, (2, 12))
z_ours = decoder.logits(params, tokens, config)
z_loaded = decoder.logits(loaded, tokens, loaded_config)
print("largest logit difference, interleaved model vs the loaded half-layout one:",
      np.abs(z_ours - z_loaded).max())

# %% [markdown]
# ## bfloat16 without bfloat16
#
# Most released checkpoints are bfloat16 (Kalamkar et al., 2019): a float32 with the low 16 bits
# of its mantissa cut off, keeping 1 sign bit $s$, the same 8 exponent bits $e$ and 7 mantissa
# bits $m$. A normal bfloat16 pattern is the number
#
# $$x = (-1)^s \, 2^{e - 127} \left(1 + \frac{m}{2^7}\right),$$
#
# and float32 is the same formula with $m / 2^{23}$. NumPy has no bfloat16 dtype, but it needs
# none: the 16 bits of a bfloat16, placed as the upper half of 32 bits with zeros below, are the
# float32 of exactly the same value.

# %% [markdown]
# **Exercise 13.4.** Turn the bfloat16 patterns below (as `uint16`) into a float32 array of the same
# values, with integer operations and a `.view`, no floating-point arithmetic. The check decodes
# $s$, $e$ and $m$ with the formula above instead.

# %% tags=["exercise"]
patterns = np.array([0x3F80, 0xC020, 0x4049, 0x3A83, 0x0080, 0x7F7F], dtype=np.uint16)
as_float32 = ...  # float32 array, one value per pattern
# BEGIN SOLUTION
as_float32 = (patterns.astype(np.uint32) << 16).view(np.float32)
# END SOLUTION

# %%
check_true("a float32 array", lambda a: np.asarray(a).dtype == np.float32,
           "view the 32-bit patterns as float32", of=as_float32)

# %%
check("13.4", as_float32)

# %%
# After the exercise: your values, beside the patterns, once they are right.
s, e, m = patterns >> 15, (patterns >> 7) & 0xFF, patterns & 0x7F
assert np.all((e > 0) & (e < 255))  # normal numbers only: the formula holds
by_fields = (-1.0) ** s * 2.0 ** (e.astype(np.int64) - 127) * (1 + m / 2**7)
if isinstance(as_float32, np.ndarray) and np.array_equal(as_float32, by_fields):
    print(dict(zip([f"0x{p:04X}" for p in patterns], as_float32.tolist())))
else:
    print("the decoded values are shown here once 13.4 is right")

# %% [markdown]
# The other way loses bits. Rounding a float32 to bfloat16 keeps its upper half, rounded to
# nearest with ties to even: add $2^{15} - 1$, plus the lowest kept bit, before dropping the low
# 16 bits. The relative error of a normal number is then at most $u = 2^{-8}$, half a unit in the
# last of its 8 significant bits:

# %%
def to_bf16(values):
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even (finite values)."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(patterns):
    """bfloat16 patterns (normal numbers) -> float32, by the fields and the formula above (your
    answer to 13.4 does it with integers and a view)."""
    s, e, m = patterns >> 15, (patterns >> 7) & 0xFF, patterns & 0x7F
    assert np.all((e > 0) & (e < 255)), "normal numbers only: the formula holds"
    return ((-1.0) ** s * 2.0 ** (e.astype(np.int64) - 127) * (1 + m / 2**7)).astype(np.float32)


values = np.array([0.1, -7.3, math.e, 2e-5, 65504.0], dtype=np.float32)  # not 13.4's
rounded = to_bf16(values)
back = from_bf16(rounded)
for v, r, b in zip(values, rounded, back):
    print(f"{v:>12.6g}  bf16 bits {r:016b}  -> {b:.6g}  (relative error {abs(b - v) / abs(v):.1e})")

# %% [markdown]
# Over twenty decades of float32 values, bfloat16's relative error stays below the same
# $2^{-8}$ everywhere. float16 (5 exponent bits, 10 mantissa bits) is eight times more precise
# where it has normal numbers, between $2^{-14}$ and $65504$, and breaks outside: below, its
# subnormals lose significant bits until values round to zero (relative error 1); above, it
# overflows to infinity.

# %%
x_values = np.logspace(-10, 10, 4001).astype(np.float32)
bf16_error = np.abs(from_bf16(to_bf16(x_values)) - x_values) / x_values
with np.errstate(over="ignore"):
    fp16_values = x_values.astype(np.float16).astype(np.float32)
fp16_error = np.abs(fp16_values - x_values) / x_values
assert bf16_error.max() <= 2.0**-8
fig, ax = plt.subplots(figsize=(7.5, 3.8), layout="constrained")
ax.loglog(x_values, np.where(bf16_error > 0, bf16_error, np.nan), ".", ms=2, color="tab:blue",
          label="bfloat16 (8 exponent bits, 8 significant bits)")
finite = np.isfinite(fp16_values) & (fp16_error > 0)
ax.loglog(x_values[finite], fp16_error[finite], ".", ms=2, color="tab:orange",
          label="float16 (5 exponent bits, 11 significant bits)")
ax.axhline(2.0**-8, color="tab:blue", ls="--", lw=1, label="$u = 2^{-8}$ (bfloat16)")
ax.axhline(2.0**-11, color="tab:orange", ls="--", lw=1, label="$u = 2^{-11}$ (float16)")
ax.axvspan(65520, x_values.max(), color="tab:red", alpha=0.12, label="float16 overflows to inf")
ax.axvspan(x_values.min(), 2.0**-14, color="grey", alpha=0.12, label="float16 subnormal or zero")
ax.set(xlabel="float32 value $x$", ylabel=r"relative error $|\mathrm{round}(x) - x| / x$",
       title="rounding a float32 to 16 bits", ylim=(1e-9, 2))
ax.legend(fontsize=7, loc="lower left", ncol=2)
plt.show()

# %% [markdown] tags=["question"]
# **Question.** float16 has three more mantissa bits than bfloat16. Why are most large models
# trained and released in bfloat16 all the same, and what does the last line of the rounding
# table above (65504) show?
#
# <!-- BEGIN SOLUTION -->
# Range matters more than the last bits. bfloat16 has float32's 8 exponent bits, so anything a
# float32 model holds (activations of several thousand, small gradients around $10^{-8}$) stays
# a normal number; float16's largest value is 65504 and its smallest normal $2^{-14} \approx 6
# \cdot 10^{-5}$, so float16 training needs loss scaling to keep gradients from flushing to zero
# (Micikevicius et al., 2018) and still risks overflow in activations, while bfloat16 trains with
# the float32 recipe (Kalamkar et al., 2019). Converting is also trivial: bfloat16 to float32 is a
# shift, float32 to bfloat16 a rounding of the upper half. Weights tolerate the coarser precision,
# a relative error of at most $2^{-8}$. The table shows the cost: 65504, float16's largest number,
# is not a bfloat16 number; it rounds to $65536 = 2^{16}$, an error of $5 \cdot 10^{-4}$.
# <!-- END SOLUTION -->

# %% [markdown]
# ## Against `transformers`
#
# With `transformers` (and torch) installed, the same directory loads there and gives the same
# logits. In a float64 model `transformers` still evaluates RMSNorm and RoPE's angles in float32,
# so the agreement below is at float32's level, about $10^{-7}$; `tests/test_hf.py` evaluates
# those two in float64 as well and finds a relative difference near $10^{-15}$ for every
# supported model type. Without `transformers`, the lesson says so and keeps the comparison
# above, against the checkpoint refmath wrote itself. (torch and `transformers` are imported
# here only: importing them takes several seconds.)

# %%
import warnings

# transformers draws a loading bar with tqdm, which in a notebook without ipywidgets only warns
# that it cannot (when transformers is imported): no bar, and no such warning.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="IProgress not found")
    try:
        import torch
        import transformers
    except ImportError:
        torch = transformers = None
        print("transformers is not installed (pip install transformers): the comparison with it "
              "is skipped here; tests/test_hf.py makes it for every supported model type")
if transformers is not None:
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
    with torch.no_grad():
        z_theirs = model(torch.as_tensor(tokens)).logits.numpy()
    error = np.abs(z_loaded - z_theirs).max() / np.abs(z_theirs).max()
    print(f"{type(model).__name__}: largest logit difference {error:.1e} of the largest logit")
    assert error < 1e-6

# %% [markdown]
# ## What a real model needs
#
# A checkpoint's size follows from its `config.json`. For a Llama-style decoder with vocabulary
# $V$, width $d$, $L$ layers, $h$ query and $g$ key/value heads of width $d_h$ and an FFN of
# width $d_f$, each layer holds two RMSNorm gains ($2d$), $W_Q$ and $W_O$ ($2\,d\,h d_h$), $W_K$
# and $W_V$ ($2\,d\,g d_h$) and the three SwiGLU matrices ($3\,d\,d_f$); the model adds the
# embedding ($V d$), the final gain ($d$) and, when untied, the output matrix ($V d$). GPT-2
# (Radford et al., 2019) has biases everywhere, LayerNorm (a gain and a shift), a learned position
# table and a tied output: per layer $W_{QKV}$ ($d \times 3d$, plus $3d$), $W_O$ ($d^2 + d$), the
# FFN ($d \times 4d + 4d$ and $4d \times d + d$) and two LayerNorms ($4d$); the model adds the
# token and position tables and a final LayerNorm ($2d$).

# %% [markdown]
# **Exercise 13.5.** Count the parameters of this lesson's checkpoint from the fields of its
# `config.json`, then those of GPT-2 small ($V = 50257$, 1024 positions, $d = 768$, $L = 12$, tied
# output) and its size in MiB in float32.

# %% tags=["exercise"]
hf_config = hf.read_config(directory)
V, d, L = hf_config["vocab_size"], hf_config["hidden_size"], hf_config["num_hidden_layers"]
h, g = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
d_f, untied = hf_config["intermediate_size"], not hf_config["tie_word_embeddings"]
tiny_count = ...
gpt2_count = ...
gpt2_float32_mib = ...
# BEGIN SOLUTION
d_head = hf_config["head_dim"]
per_layer = 2 * d + 2 * d * h * d_head + 2 * d * g * d_head + 3 * d * d_f
tiny_count = V * d + L * per_layer + d + (V * d if untied else 0)
dg = 768
gpt2_layer = (dg * 3 * dg + 3 * dg) + (dg * dg + dg) + (dg * 4 * dg + 4 * dg) + (4 * dg * dg + dg) \
    + 4 * dg
gpt2_count = 50257 * dg + 1024 * dg + 12 * gpt2_layer + 2 * dg
gpt2_float32_mib = 4 * gpt2_count / 2**20
# END SOLUTION

# %%
check("13.5a", tiny_count)

# %%
check("13.5b", gpt2_count)

# %%
check("13.5c", gpt2_float32_mib)

# %% [markdown]
# In bfloat16 GPT-2 small takes half its float32 size. `benchmarks/hf_load.py` writes a checkpoint
# of that shape and measures the load's peak memory at about 1.07 times the converted parameters. An 8B model needs about 30 GiB in float32, and the
# activations of a forward pass on top; `python -m refmath sizes --hf DIR` gives the parameter
# count, the KV cache per token and the training memory from the directory's own `config.json`.

# %%
from refmath.sizing import hf_parameter_count

if tiny_count == hf_parameter_count(hf_config):  # the count is 13.5a's answer: shown once right
    print(f"this lesson's model: {hf_parameter_count(hf_config):,} parameters, "
          f"{weights_path.stat().st_size:,} bytes on disk in float64")
else:
    # not even the file's size: 8 bytes a parameter, past the header, is the count again
    print("this lesson's model: its count and size on disk are shown here once 13.5a is right")

# %% [markdown]
# ## Exercises
#
# 1. Check that your `my_half_to_interleaved` and `hf.interleaved_to_half` compose to the
#    identity on a $(d, h d_h)$ matrix, and use it to load this lesson's checkpoint into a model
#    with `rope_layout="interleaved"` that gives the same logits.
# 2. Round float32 to bfloat16 by truncation (drop the low 16 bits) instead of to nearest even.
#    Show on the figure's values that the worst relative error doubles to $2^{-7}$ and that every
#    error has the sign that moves the value towards zero: a bias that rounding to nearest avoids.
# 3. Store this lesson's checkpoint in bfloat16: convert every tensor with `to_bf16`, write a
#    safetensors file by hand (a header with dtype `"BF16"` and the right `data_offsets`), load it
#    with `hf.load_checkpoint` and measure how far its logits move from the float64 model's.
# 4. From Llama 2 7B's configuration (Touvron et al., 2023: $V = 32000$, $d = 4096$, $L = 32$,
#    $h = g = 32$, $d_f = 11008$, untied output) count its parameters by hand, check the count with
#    `hf_parameter_count`, and give its size in bfloat16 in GiB.
# 5. A shard of a large checkpoint has a header of 40 kB and tensors of 2 GB. Estimate how many
#    bytes reading one $4096 \times 4096$ bfloat16 matrix from it through a memory map touches,
#    and compare with loading the same shard from a pickled PyTorch `.bin` file with `torch.load`,
#    which by default reads all of it (and runs the pickle's code).
#
# ## References
#
# - Radford, A., Wu, J., Child, R., Luan, D., Amodei, D., and Sutskever, I. (2019). Language Models
#   are Unsupervised Multitask Learners. (GPT-2, the model whose checkpoint layout `Conv1D` keeps.)
# - Touvron, H., et al. (2023). LLaMA: Open and Efficient Foundation Language Models.
# - Touvron, H., et al. (2023). Llama 2: Open Foundation and Fine-Tuned Chat Models.
# - Su, J., et al. (2021). RoFormer: Enhanced Transformer with Rotary Position Embedding.
# - Wolf, T., et al. (2020). Transformers: State-of-the-Art Natural Language Processing.
#   (The `transformers` library whose checkpoints this lesson reads.)
# - Kalamkar, D., et al. (2019). A Study of BFLOAT16 for Deep Learning Training.
# - Micikevicius, P., et al. (2018). Mixed Precision Training. (float16 training and loss
#   scaling.)
