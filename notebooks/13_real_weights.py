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
# # Lesson 13: real weights, the same function as the library everyone uses
#
# refmath's models are written for reading, but they are not toys: a checkpoint trained with
# Hugging Face `transformers` runs in them and gives the same logits. This lesson follows one
# tiny checkpoint through `refmath.hf`:
#
# - what a Hugging Face model directory holds: `config.json` and a safetensors file, whose
#   format fits in a paragraph;
# - how weight names and layouts map (`nn.Linear` stores $W^\top$, refmath stores $W$);
# - why RoPE's two pair layouts, *interleaved* and *half*, are the same function once the query
#   and key columns are permuted;
# - how a bfloat16 number becomes a float32 without NumPy knowing what a bfloat16 is;
# - and a comparison of logits with `transformers` itself, when it is installed.

# %%
import json
import math
import tempfile
from pathlib import Path

import numpy as np

from refmath import hf
from refmath.models import decoder
from refmath.positions import rope_forward

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)
workdir = Path(tempfile.mkdtemp())

# %% [markdown]
# ## A tiny Llama, written as a Hugging Face checkpoint
#
# A modern decoder (M3) with grouped-query attention, RoPE in the *interleaved* layout (the
# original Llama code's, and refmath's default), random weights in float64.

# %%
config = decoder.DecoderConfig(vocab_size=50, max_seq_len=32, d_model=32, n_layers=2, n_heads=4,
                               n_kv_heads=2, d_ff=48, rope_layout="interleaved")
params = decoder.init_params(config, seed=1)
params = {k: v + 0.05 * rng.standard_normal(v.shape) for k, v in params.items()}
directory = hf.save_checkpoint(workdir / "tiny-llama", "llama", config, params)
print(sorted(p.name for p in directory.iterdir()))
print(json.dumps(hf.read_config(directory), indent=1))

# %% [markdown]
# ## The safetensors format
#
# Eight bytes give the length $N$ of a JSON header; the header maps each tensor's name to its
# dtype, shape and byte range; the raw little-endian data follow. Nothing is pickled, so reading a
# file runs no code, and any tensor can be read on its own, through a memory map, without reading
# the others. That is how `refmath.hf` keeps its peak memory near the size of the converted
# parameters.

# %%
with open(directory / hf.WEIGHTS_FILE, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
for name in sorted(header)[:6]:
    print(f"{name:<45} {header[name]}")
print(f"... {len(header) - 1} tensors, header {n} bytes")

# %% [markdown]
# Hugging Face's `q_proj.weight` of shape `(h d_h, d)` is `nn.Linear`'s $W_Q^\top$: it computes
# $x W_Q^\top$. refmath's `w_q` is `(d, h d_h)` and computes `x @ w_q`, so the loader transposes
# every linear weight. (GPT-2's `Conv1D` already stores $W$.)

# %% [markdown]
# ## Two RoPE layouts, one function
#
# RoPE rotates coordinate pairs of each head by angles $p\,\omega_r$. The interleaved layout pairs
# $(x_{2r}, x_{2r+1})$; Hugging Face's Llama (`rotate_half`) pairs $(x_r, x_{r+d/2})$. With the
# permutation $\pi = [0, 2, 4, \dots, 1, 3, 5, \dots]$ of a head's coordinates,
#
# $$\operatorname{RoPE}_{\text{half}}(x_\pi) = \operatorname{RoPE}_{\text{interleaved}}(x)_\pi ,$$
#
# and a score $\tilde q \cdot \tilde k$ does not change when both vectors are permuted alike. So a
# model trained with one layout runs with the other once the columns of $W_Q$ and $W_K$ are
# permuted by $\pi$ within each head; `save_checkpoint` does exactly that
# (`hf.interleaved_to_half`). Checked on one head:

# %%
d_h = 8
pi = np.concatenate([np.arange(0, d_h, 2), np.arange(1, d_h, 2)])
x = rng.standard_normal((5, d_h))  # 5 positions
interleaved = rope_forward(x, layout="interleaved")[0]
half = rope_forward(x[:, pi], layout="half")[0]
print("RoPE_half(x_pi) == RoPE_interleaved(x)_pi:", np.allclose(half, interleaved[:, pi]))
q, k = rng.standard_normal((2, 5, d_h))
scores = rope_forward(q, layout="interleaved")[0] @ rope_forward(k, layout="interleaved")[0].T
scores_half = rope_forward(q[:, pi], layout="half")[0] @ rope_forward(k[:, pi], layout="half")[0].T
print("largest score difference:", np.abs(scores - scores_half).max())

# %% [markdown]
# So the checkpoint loads with `rope_layout="half"` and its weights untouched, and computes the
# same logits as the interleaved model we started from:

# %%
name, loaded_config, loaded = hf.load_checkpoint(directory, dtype=np.float64)
print(name, "rope_layout:", loaded_config.rope_layout)
tokens = rng.integers(0, config.vocab_size, (2, 12))
z_ours = decoder.logits(params, tokens, config)
z_loaded = decoder.logits(loaded, tokens, loaded_config)
print("largest logit difference, interleaved model vs the loaded half-layout one:",
      np.abs(z_ours - z_loaded).max())

# %% [markdown]
# ## bfloat16 without bfloat16
#
# Most released checkpoints are bfloat16: a float32 with the low 16 bits of its mantissa cut
# off (1 sign bit, the same 8 exponent bits, 7 mantissa bits). NumPy has no such dtype, but it
# needs none: shifting the 16-bit pattern up by 16 bits gives the float32 of exactly the same
# value. Rounding a float32 to bfloat16 keeps the upper half, rounded to nearest even:

# %%
values = np.array([1.0, -2.5, math.pi, 1e-3, 65504.0], dtype=np.float32)
bits = values.view(np.uint32)
rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # the bf16 patterns
back = (rounded.astype(np.uint32) << 16).view(np.float32)
for v, r, b in zip(values, rounded, back):
    print(f"{v:>12.6g}  bf16 bits {r:016b}  -> {b:.6g}  (relative error {abs(b - v) / abs(v):.1e})")

# %% [markdown]
# ## Against `transformers`
#
# With `transformers` (and torch) installed, the same directory loads there and gives the same
# logits. In a float64 model `transformers` still evaluates RMSNorm and RoPE's angles in float32,
# so the agreement below is at float32's level, about $10^{-7}$; `tests/test_hf.py` evaluates
# those two in float64 as well and finds a relative difference near $10^{-15}$ for every
# supported model type. Without `transformers`, the lesson says so and keeps the comparison
# above, against the checkpoint refmath wrote itself.

# %%
try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None
    print("transformers is not installed (pip install transformers): the comparison with it is "
          "skipped here; tests/test_hf.py makes it for every supported model type")
if transformers is not None:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
    with torch.no_grad():
        z_theirs = model(torch.as_tensor(tokens)).logits.numpy()
    error = np.abs(z_loaded - z_theirs).max() / np.abs(z_theirs).max()
    print(f"{type(model).__name__}: largest logit difference {error:.1e} of the largest logit")
    assert error < 1e-6

# %% [markdown]
# ## What a real model needs
#
# GPT-2 small has 124,439,808 parameters: 475 MiB in float32. `benchmarks/hf_load.py` writes a
# checkpoint of that shape and measures the load's peak memory at about 1.07 times the converted
# parameters. An 8B model needs about 30 GiB in float32, and the activations of a forward pass on
# top; `python -m refmath sizes --hf DIR` gives the parameter count, the KV cache per token and
# the training memory from the directory's own `config.json`.

# %%
print(f"this lesson's model: {hf.parameter_count(hf.read_config(directory)):,} parameters")
