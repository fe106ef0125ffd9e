# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
#   refmath:
#     figures: 1
#     minutes: 40
#     ids: []
# ---

# %% [markdown]
# # Lesson 16: the capstone, a GPT trained with your own backward passes
#
# Lessons 1, 2, 4 and 5 each asked you to write one backward pass, and a gradient check judged
# it. Here the four of them go into one model: a two-layer GPT written in this notebook from the
# library's forward functions, whose backward pass calls *your* softmax, LayerNorm, GELU and
# cross-entropy backward passes through the op contract (`backward(dout, cache)` with the cache
# its forward returned). You check the whole model's gradient against central differences,
# compare it with the same model on the library's backward passes, and train it on characters.
#
# **Prerequisites:** lessons 1 (softmax backward), 2 (LayerNorm backward), 4 (GELU backward),
# 5 (cross-entropy backward, AdamW) and 7 (GPT).
#
# **Goals:** assemble a model's backward pass from op backward passes, cache by cache; check the
# whole model with `refmath.gradcheck.check_param_gradients`; train it with your functions and
# watch the loss fall.
#
# **Catalogue IDs:** none of its own; it assembles those of lessons 1, 2, 4, 5 and 7.
#
# **Duration:** 40 minutes

# %%
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny matrices: one BLAS thread is fastest

import matplotlib.pyplot as plt
import numpy as np

from refmath.data import CharLMTask
from refmath.embedding import embedding_backward, embedding_forward
from refmath.ffn import gelu_forward, linear_backward, linear_forward
from refmath.gradcheck import check_param_gradients
from refmath.lessons import catalogued, check, check_function, check_true
from refmath.losses import cross_entropy_forward
from refmath.norms import layernorm_forward
from refmath.optim import AdamW
from refmath.positions import learned_positions_backward, learned_positions_forward
from refmath.softmax import softmax_forward

np.set_printoptions(precision=4, suppress=True)

# %% [markdown]
# ## Your four backward passes
#
# Paste each function from its lesson (or write it again); each check is the one of its lesson:
# the gradient check on the registry's cases, the library's function, and torch if installed.

# %% tags=["exercise"]
# Exercise 16.1: the softmax backward of lesson 1. `cache.a` is the softmax output (..., n).
def my_softmax_backward(dout, cache):
    dx = ...
    # BEGIN SOLUTION
    a = cache.a
    dx = a * (dout - np.sum(a * dout, axis=-1, keepdims=True))
    # END SOLUTION
    return dx


# %%
from refmath.softmax import softmax_backward

check("16.1", my_softmax_backward)

# %% tags=["exercise"]
# Exercise 16.2: the LayerNorm backward of lesson 2: (dx, dgamma, dbeta) from `cache.xhat`,
# `cache.rstd` and `cache.gamma`, for any number of leading axes.
def my_layernorm_backward(dout, cache):
    dx = dgamma = dbeta = ...
    # BEGIN SOLUTION
    rows = tuple(range(dout.ndim - 1))
    dgamma = np.sum(dout * cache.xhat, axis=rows)
    dbeta = np.sum(dout, axis=rows)
    g = dout * cache.gamma
    dx = cache.rstd * (g - g.mean(axis=-1, keepdims=True)
                       - cache.xhat * np.mean(g * cache.xhat, axis=-1, keepdims=True))
    # END SOLUTION
    return dx, dgamma, dbeta


# %%
from refmath.norms import layernorm_backward

check("16.2", my_layernorm_backward)

# %% tags=["exercise"]
# Exercise 16.3: the GELU backward of lesson 4, both forms (this model uses the tanh form).
# `cache.x` is the input, `cache.approximate` says which form (True: tanh), and `cache.gate` is
# what the forward computed on the way: tanh(sqrt(2/pi) (x + 0.044715 x^3)) for the tanh form,
# Phi(x) (the normal CDF) for the exact one.
def my_gelu_backward(dout, cache):
    dx = ...
    # BEGIN SOLUTION
    x, gate = cache.x, cache.gate
    if cache.approximate:
        dt = (1 - gate**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x**2)
        dx = dout * (0.5 * (1 + gate) + 0.5 * x * dt)
    else:
        dx = dout * (gate + x * np.exp(-x**2 / 2) / np.sqrt(2 * np.pi))
    # END SOLUTION
    return dx


# %%
from refmath.ffn import gelu_backward

check("16.3", my_gelu_backward)

# %% tags=["exercise"]
# Exercise 16.4: the cross-entropy backward of lesson 5 (no label smoothing): p - y on the counted
# rows, divided by n_counted for the mean, times dout. `cache.probs` (..., V) is softmax(logits),
# `cache.targets` (...) the target ids (0 where not counted), `cache.counted` (...) a bool mask of
# the tokens in the loss, `cache.n_counted` their number, and `cache.reduction` "mean" or "sum".
def my_cross_entropy_backward(dout, cache):
    dlogits = ...
    # BEGIN SOLUTION
    per_token = cache.probs - np.eye(cache.probs.shape[-1])[cache.targets]
    if cache.reduction == "mean":
        per_token = per_token / max(cache.n_counted, 1)
    dlogits = dout * np.where(cache.counted[..., None], per_token, 0.0)
    # END SOLUTION
    return dlogits


# %%
from refmath.losses import cross_entropy_backward

check("16.4", my_cross_entropy_backward)

# %% [markdown]
# ## The model, by the op contract
#
# A Pre-LN GPT (lesson 7) with one attention head per layer, learned positions, a GELU (tanh)
# FFN and an untied output matrix. Its forward pass calls the library's forward functions and
# keeps every cache; its backward pass runs them in reverse and takes the four backward passes
# from `ops`, a dict of functions with the library's signatures. Everything else is lesson 1's
# attention backward written out, and the library's linear, position and embedding backward.

# %%
D, LAYERS, SEQ = 32, 2, 16


def init_params(vocab, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: 0.02 * rng.standard_normal(shape)  # noqa: E731
    params = {"tok_emb": normal(vocab, D), "pos_emb": normal(SEQ, D)}
    for l in range(LAYERS):
        params |= {f"layers.{l}.ln1.gamma": np.ones(D), f"layers.{l}.ln1.beta": np.zeros(D),
                   f"layers.{l}.ln2.gamma": np.ones(D), f"layers.{l}.ln2.beta": np.zeros(D),
                   f"layers.{l}.ffn.b1": np.zeros(4 * D), f"layers.{l}.ffn.b2": np.zeros(D),
                   f"layers.{l}.ffn.w1": normal(D, 4 * D), f"layers.{l}.ffn.w2": normal(4 * D, D)}
        for w in ("w_q", "w_k", "w_v", "w_o"):
            params[f"layers.{l}.attn.{w}"] = normal(D, D)
    params |= {"ln_f.gamma": np.ones(D), "ln_f.beta": np.zeros(D), "lm_head": normal(D, vocab)}
    return params


def forward(params, batch):
    """The mean next-token loss and every op's cache."""
    tokens, T = batch["tokens"], batch["tokens"].shape[1]
    x, emb = embedding_forward(tokens, params["tok_emb"])
    x, pos = learned_positions_forward(x, params["pos_emb"])
    mask = np.triu(np.full((T, T), -np.inf), 1)  # causal: a query sees itself and the past
    layers = []
    for l in range(LAYERS):
        p = {name.split(".", 2)[2]: v for name, v in params.items() if name.startswith(f"layers.{l}.")}
        h, ln1 = layernorm_forward(x, p["ln1.gamma"], p["ln1.beta"])
        (q, cq), (k, ck), (v, cv) = (linear_forward(h, p[f"attn.{w}"]) for w in ("w_q", "w_k", "w_v"))
        a, sm = softmax_forward(q @ k.swapaxes(-1, -2) / np.sqrt(D) + mask)
        y, co = linear_forward(a @ v, p["attn.w_o"])
        x = x + y
        h2, ln2 = layernorm_forward(x, p["ln2.gamma"], p["ln2.beta"])
        f1, c1 = linear_forward(h2, p["ffn.w1"], p["ffn.b1"])
        g, cg = gelu_forward(f1, approximate=True)
        f2, c2 = linear_forward(g, p["ffn.w2"], p["ffn.b2"])
        x = x + f2
        layers.append((ln1, cq, ck, cv, q, k, v, a, sm, co, ln2, c1, cg, c2))
    hf, lnf = layernorm_forward(x, params["ln_f.gamma"], params["ln_f.beta"])
    logits, head = linear_forward(hf, params["lm_head"])
    loss, ce = cross_entropy_forward(logits, batch["targets"])
    return float(loss), (emb, pos, layers, lnf, head, ce)


def backward(cache, ops):
    """The gradient of every parameter, with the four backward passes taken from ops."""
    emb, pos, layers, lnf, head, ce = cache
    grads = {}
    dhf, grads["lm_head"], _ = linear_backward(ops["cross_entropy"](1.0, ce), head)
    dx, grads["ln_f.gamma"], grads["ln_f.beta"] = ops["layernorm"](dhf, lnf)
    for l in reversed(range(LAYERS)):
        ln1, cq, ck, cv, q, k, v, a, sm, co, ln2, c1, cg, c2 = layers[l]
        n = f"layers.{l}."
        dg, grads[n + "ffn.w2"], grads[n + "ffn.b2"] = linear_backward(dx, c2)
        dh2, grads[n + "ffn.w1"], grads[n + "ffn.b1"] = linear_backward(ops["gelu"](dg, cg), c1)
        dh2_x, grads[n + "ln2.gamma"], grads[n + "ln2.beta"] = ops["layernorm"](dh2, ln2)
        dx = dx + dh2_x  # the residual path and the FFN branch
        do, grads[n + "attn.w_o"], _ = linear_backward(dx, co)
        ds = ops["softmax"](do @ v.swapaxes(-1, -2), sm) / np.sqrt(D)
        dh = 0.0
        for w, d_out, c in (("w_q", ds @ k, cq), ("w_k", ds.swapaxes(-1, -2) @ q, ck),
                            ("w_v", a.swapaxes(-1, -2) @ do, cv)):
            dh_w, grads[n + f"attn.{w}"], _ = linear_backward(d_out, c)
            dh = dh + dh_w
        dh_x, grads[n + "ln1.gamma"], grads[n + "ln1.beta"] = ops["layernorm"](dh, ln1)
        dx = dx + dh_x  # the residual path and the attention branch
    dx, grads["pos_emb"] = learned_positions_backward(dx, pos)
    grads["tok_emb"] = embedding_backward(dx, emb)
    return grads


# %% [markdown]
# Your functions go in where they are written; a function still returning `...` is replaced by
# the library's, so that the model runs in any case (and the checks below wait for all four). A
# function that is, wraps or calls the library's backward is the library's, and is said to be.

# %%
from refmath.lessons.library_refusal import library_used
from refmath.lessons.trials import Trial


def written(function, *probe):
    """Whether function is written: it returns something other than ... on the probe."""
    try:
        value = function(*probe)
    except NotImplementedError:
        return False
    return not (value is Ellipsis or isinstance(value, tuple) and any(v is Ellipsis for v in value))


probe_rng = np.random.default_rng(1)
z = probe_rng.standard_normal((2, 5))
probes = {"softmax": (z, softmax_forward(z)[1]),
          "layernorm": (z, layernorm_forward(z, np.ones(5), np.zeros(5))[1]),
          "gelu": (z, gelu_forward(z, approximate=True)[1]),
          "cross_entropy": (1.0, cross_entropy_forward(z, np.array([1, 3]))[1])}
yours = {"softmax": my_softmax_backward, "layernorm": my_layernorm_backward,
         "gelu": my_gelu_backward, "cross_entropy": my_cross_entropy_backward}
library = {"softmax": softmax_backward, "layernorm": layernorm_backward, "gelu": gelu_backward,
           "cross_entropy": cross_entropy_backward}
ops, whose = {}, {}
for name in yours:
    if not written(yours[name], *probes[name]):
        ops[name], whose[name] = library[name], "the library (yours is not written yet)"
        continue
    ops[name] = yours[name]  # the model runs what you wrote, whatever it is
    used = library_used(yours[name], library[name], Trial("the probe", probes[name], {}))
    whose[name] = "yours" if used is None else f"the library's: yours {used}"
all_yours = all(whose[name] == "yours" for name in yours)
for name in ops:
    print(f"{name:>13}: {whose[name]}")

# %% [markdown]
# ## The whole model, checked
#
# Central differences of the loss against every parameter tensor (six coordinates of each, the
# derived bound of `refmath.gradcheck`), with your backward passes inside; then the same
# gradients with the library's.

# %%
task = CharLMTask(seq_len=SEQ, n_sentences=400)
params = init_params(task.vocab_size)
batch = task.batch("train", 0, 4, 0)
loss, cache = forward(params, batch)
grads = backward(cache, ops)
result = check_param_gradients(lambda p: forward(p, batch)[0], grads, params)
print(f"loss {loss:.4f} (log V = {np.log(task.vocab_size):.4f}); worst {result.worst}: error "
      f"{result.errors[result.worst]:.1e}, bound {result.bound:.1e}")

# %%
check_true("the gradient check of the whole model, with your backward passes",
           lambda r: r.passed, "a gradient of the model disagrees with central differences",
           of=result if all_yours else None)

# %%
check("16.5", grads if all_yours else None)

# %% [markdown]
# ## Training with your functions
#
# AdamW (lesson 5's), 200 steps of 8 sequences of 16 characters, a linear warm-up over the first
# 20 steps. The loss starts at $\log V$, a uniform guess, and falls below the entropy of the
# character frequencies: the model has learnt more than how often each character occurs.

# %%
params = init_params(task.vocab_size, seed=0)
optimiser, losses = AdamW(lr=3e-3, weight_decay=0.01), []
for step in range(1, 201):
    loss, cache = forward(params, task.batch("train", step, 8, 0))
    optimiser.step(params, backward(cache, ops), lr=3e-3 * min(1.0, step / 20))
    losses.append(loss)
print(f"loss: first step {losses[0]:.3f}, mean of the last 20 {np.mean(losses[-20:]):.3f}, "
      f"character frequencies alone {task.unigram_entropy():.3f}")
if not np.mean(losses[-20:]) < task.unigram_entropy() < losses[0]:
    print("the loss did not fall below the character frequencies' entropy: one of the backward "
          "passes is still wrong (see the checks above)")

fig, ax = plt.subplots(figsize=(6, 3.2), layout="constrained")
ax.plot(range(1, 201), losses, lw=0.8, label="training loss")
ax.axhline(task.unigram_entropy(), color="grey", ls=":", label="character frequencies alone")
ax.set(xlabel="step", ylabel="loss (nats)", title="a GPT trained with "
       + ("your backward passes" if all_yours else "the backward passes above"))
ax.legend()
plt.show()

# %% [markdown] tags=["question"]
# **Question.** Plant a slip in your LayerNorm backward, dbeta averaged over the rows instead of
# summed, and the training curve does not move (try it: the last losses agree to three decimals).
# Why does training not notice, and which of the checks above do?
#
# <!-- BEGIN SOLUTION -->
# The slip multiplies every dbeta by the same constant, 1 / (B T). Adam and AdamW divide each
# coordinate's step by the root of its own second moment, $\hat m / \sqrt{\hat v}$, which does
# not change when the gradient of a parameter is multiplied by a constant (up to $\epsilon$):
# the optimiser takes the same steps, and the loss falls exactly as before. A falling loss proves
# little about a gradient. The checks do see it: the gradient check of the whole model compares
# every parameter tensor with central differences of the loss, the comparison with the library's
# gradients fails on every dbeta, and the check of the function alone (lesson 2's) names the
# slip. (SGD would notice: its steps on the shifts would be B T times too small.)
# <!-- END SOLUTION -->

# %% [markdown]
# ## Exercises
#
# 1. Plant the slip "the -a a^T term dropped (a * dout)" in `my_softmax_backward` and rerun: which checks
#    fail, and why does this slip, unlike the question's, stop the model from learning?
# 2. Add a fifth op of your own: replace the attention's softmax-and-matmul by tiles of keys
#    merged with your online-softmax merge of lesson 3, and check the model again.
# 3. Swap GELU for SwiGLU (your function of lesson 8) and RMSNorm for LayerNorm: the M3 layer of
#    lesson 8. Which parameters disappear, and does the loss fall as fast?
# 4. Count the bytes of every cache `forward` keeps for one batch (lesson 2's exercise 5, for the
#    whole model): which op stores the most, and how does it grow with the sequence length?
#
# ## References
#
# - Karpathy, *llm.c* (`train_gpt2.c`): a GPT-2 trained with hand-written backward passes.
# - Stanford CS231n, assignment 2: layers with caches, checked by numerical gradients.
# - Stanford CS336, assignment 1: a Transformer language model built from scratch.
