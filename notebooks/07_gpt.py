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
#     minutes: 45
#     ids: [M2, N9, N11, L6, K1, O5]
# ---

# %% [markdown]
# # Lesson 7: GPT, a decoder on its own
#
# GPT (Radford et al., 2018, 2019) keeps only the decoder of lesson 6, without cross-attention, and
# trains it to predict the next token of plain text. This lesson builds it: learned absolute
# positions (N9), Post-LN (GPT-1) against Pre-LN with a final norm (GPT-2) (M2), GPT-2's
# initialisation with residual projections scaled by $1/\sqrt{2L}$ (N11), the two facts every
# causal decoder must satisfy, one masked pass scores every prefix (L6) and appending tokens
# changes nothing before them (K1), which parameters take weight decay (O5), and a short training
# run of both arrangements.
#
# **Prerequisites:** lesson 6 (the encoder-decoder), lessons 2 (Post-LN and Pre-LN) and 5 (AdamW).
#
# **Goals:** derive the backward of a learned position table; count GPT-2 small's
# parameters by hand; explain why the residual writers start smaller; check L6 and K1 by brute
# force; write a task as a prompt and instruction tuning as a loss mask; predict an AdamW step from
# the weight-decay groups.
#
# **Catalogue IDs:** M2, N9, N11, L6, K1, O5
#
# **Duration:** about 45 minutes.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np

from refmath.data import CharLMTask
from refmath.lessons import catalogued, check, check_function, check_true
from refmath.models import gpt
from refmath.optim import AdamW, clip_grad_norm, takes_weight_decay, warmup_cosine
from refmath.positions import learned_positions_forward

np.set_printoptions(precision=4, suppress=True)
rng = np.random.default_rng(0)


def n_params(shapes):
    """Number of parameters described by a {name: shape} dict (nothing is allocated)."""
    return sum(math.prod(shape) for shape in shapes.values())


# %% [markdown]
# ## N9: learned absolute positions
#
# GPT adds a learned vector per position: $x_t = E[a_t] + P[t]$. The table $P$ has one row per
# position the model can address, so its length is the longest context; `offset` is where the
# rows start (after a cached prefix). The backward of the add sends $\partial \ell / \partial x_t$
# to row $t$ of $P$, summed over the batch:
#
# $$\frac{\partial \ell}{\partial P_{\tau}} = \sum_{b} \frac{\partial \ell}{\partial x_{b,\,\tau - \text{offset}}},$$
#
# and gives nothing to rows that were not used.

# %%
P = np.array([[0.0, 0.0], [1.0, -1.0], [2.0, -2.0], [3.0, -3.0]])
x = np.zeros((2, 2, 2))  # two sequences of two positions
y_pos, pos_cache = learned_positions_forward(x, P, offset=1)
print("positions 1 and 2 added:\n", y_pos[0])
np.testing.assert_array_equal(y_pos[0], P[1:3])
try:
    learned_positions_forward(x, P, offset=3)
except ValueError as error:
    print("past the table:", error)

# %% [markdown]
# **Exercise 07.1.** The upstream gradient below differs per sequence and position. Write $dP$ by
# hand (shape `(4, 2)`) for `offset = 1`.

# %% tags=["exercise"]
dy = np.array([[[1.0, 0.0], [0.0, 2.0]],
               [[3.0, 1.0], [1.0, 1.0]]])  # (B, T, d) = (2, 2, 2)
dP = ...  # (4, 2)
# BEGIN SOLUTION
dP = np.zeros_like(P)
dP[1:3] = dy.sum(axis=0)
# END SOLUTION

# %%
check("07.1", dP)

# %% [markdown]
# ## M2: GPT, Post-LN (GPT-1) and Pre-LN (GPT-2)
#
# GPT is the decoder of M1 without cross-attention: $x = E[a] + P$ (no $\sqrt{d}$), $L$ layers of
# causal self-attention and a GELU FFN, both with biases, and logits $x_L E^\top$ from the last
# hidden state, with the token table tied. GPT-1 normalises after each residual sum,
# $x \leftarrow \mathrm{LN}(x + F(x))$; GPT-2 normalises the input of each branch,
# $x \leftarrow x + F(\mathrm{LN}(x))$, and adds a final $\mathrm{LN}_f$ before the logits,
# because the stream itself is never normalised. The two parameter sets differ only by that norm.
#
# The residual stream shows the difference. In Post-LN it leaves every layer normalised, each row
# of standard deviation 1 ($\gamma = 1$, $\beta = 0$ at initialisation). In Pre-LN it is a running
# sum that starts as small as the embeddings (std about $0.02\sqrt{2}$) and grows as the layers
# add to it.

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
      sorted(set(gpt.param_shapes(gpt.GPTConfig(norm_position="pre")))
             - set(gpt.param_shapes(gpt.GPTConfig(norm_position="post")))))
assert np.all(stream_std["post"][1:] > 0.99)
assert stream_std["pre"][0] < 0.05 and np.all(np.diff(stream_std["pre"]) > 0)

# %% [markdown]
# **Exercise 07.2.** GPT-2 small has $L = 12$ layers of width $d = 768$, a context of 1024, a
# vocabulary of $V = 50257$ and a tied output. Per layer: $W_{QKV}$ ($d \times 3d$) and $W_O$
# ($d \times d$) with biases, an FFN $d \to 4d \to d$ with biases, and two LayerNorms ($2d$
# each). Add the token and position tables and the final LayerNorm: how many parameters?

# %% tags=["exercise"]
L, d, T_ctx, V = 12, 768, 1024, 50257
gpt2_by_hand = ...  # an integer
# BEGIN SOLUTION
per_layer = (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
gpt2_by_hand = V * d + T_ctx * d + L * per_layer + 2 * d
# END SOLUTION

# %%
check("07.2", gpt2_by_hand)

# %% [markdown]
# ## N11: initialisation, std 0.02 and residual projections scaled by $1/\sqrt{2L}$
#
# Every weight matrix and both embedding tables start as $\mathcal N(0, 0.02^2)$; biases and
# $\beta$ at 0, gains at 1. The two matrices that write into the residual stream, the attention
# output $W_O$ and the FFN's second matrix, start with std $0.02 / \sqrt{2L}$.
#
# Why: the final stream is the embedding plus $2L$ branch outputs. If the branches are roughly
# uncorrelated and each adds variance $s^2$, the stream gains $2L s^2$, growing with depth.
# Dividing each writing matrix by $\sqrt{2L}$ divides each branch's variance by $2L$, so the total
# added is about $s^2$ at every depth. Below, the variance a Pre-LN GPT adds to the stream at
# initialisation, with the scaled matrices and with the same draws multiplied back by
# $\sqrt{2L}$.

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
ax.plot(depths, added[True], "o-", label=r"std $0.02 / \sqrt{2L}$")
ax.plot(depths, added[False], "s-", label="std 0.02")
ax.set(xscale="log", yscale="log", xlabel="layers L", ylabel="variance added to the stream",
       title="residual writers at initialisation")
ax.set_xticks(depths, [str(d) for d in depths])
ax.legend()
plt.show()

# %% [markdown]
# **Exercise 07.3.** For a 4-layer GPT initialised with `seed=0`, measure the std of every layer's
# `attn.w_o`, average them, and compare with the std the rule prescribes.

# %% tags=["exercise"]
config4 = gpt.GPTConfig(vocab_size=64, max_seq_len=32, n_layers=4, d_model=64, n_heads=4,
                        dropout=0.0)
params4 = gpt.init_params(config4, seed=0)
prescribed_std = ...  # the rule's std for w_o
measured_std = ...    # the mean over the 4 layers of params4[f"layers.{i}.attn.w_o"].std()
# BEGIN SOLUTION
prescribed_std = 0.02 / math.sqrt(2 * config4.n_layers)
measured_std = np.mean([params4[f"layers.{i}.attn.w_o"].std() for i in range(4)])
# END SOLUTION

# %%
check("07.3a", prescribed_std)

# %%
check("07.3b", measured_std)

# %% [markdown]
# ## L6: one masked pass scores every prefix
#
# Training computes all $T$ next-token losses of a sequence in one pass. That is only honest if
# position $t$'s prediction is exactly what the model would say given the prefix
# $a_1, \dots, a_t$ alone. The causal mask guarantees it; here we check it by brute force: run
# every prefix on its own, keep only the loss of its last position (a loss mask), and average.

# %%
gpt_config = gpt.GPTConfig(vocab_size=32, max_seq_len=16, n_layers=2, d_model=32, n_heads=4,
                           dropout=0.0)
params = gpt.init_params(gpt_config, seed=3)
seq = rng.integers(0, 32, (2, 8))
batch = {"tokens": seq[:, :-1], "targets": seq[:, 1:]}
T = batch["tokens"].shape[1]

# %% [markdown]
# **Exercise 07.4.** For each $n = 1, \dots, T$, run `gpt.forward` on the first $n$ tokens with a
# `loss_mask` that counts only the last position, and average the $T$ losses.

# %% tags=["exercise"]
mean_of_prefixes = ...
# BEGIN SOLUTION
prefix_losses = []
for n in range(1, T + 1):
    last_only = np.zeros((2, n), dtype=int)
    last_only[:, -1] = 1
    prefix = {"tokens": batch["tokens"][:, :n], "targets": batch["targets"][:, :n],
              "loss_mask": last_only}
    prefix_losses.append(float(gpt.forward(params, prefix, gpt_config)[0]))
mean_of_prefixes = np.mean(prefix_losses)
# END SOLUTION

# %%
check("07.4", mean_of_prefixes)

# %%
# After the exercise: the one pass's loss, which the T separate runs reproduce (shown once you
# have answered).
parallel, _ = gpt.forward(params, batch, gpt_config)
if mean_of_prefixes is not ...:
    print(f"one pass over T = {T}: loss {float(parallel):.12f}; your T runs: "
          f"{float(mean_of_prefixes):.12f}")

# %% [markdown]
# ## The prefix is the conditioning: tasks, instructions, preferences
#
# The encoder-decoder of lesson 6 conditions on a source through cross-attention; GPT has no
# source and no cross-attention, so whatever it should condition on has to be written into the
# prefix. "Decoder-only" names exactly that: the causal computation and the missing encoder, not a
# model that stops representing its input. Because the targets are the text shifted by one,
# ordinary text is training data, and a task becomes part of the prompt:
#
# $$p_\theta(\text{answer} \mid \text{instruction}, \text{examples}, \text{question}).$$
#
# GPT-3 (Brown et al., 2020) solved tasks from such prompts, examples included, without a
# gradient step per task; that is a measured result, not a theorem that scale must produce it.
# Instruction tuning keeps the model and the loss and changes the data to (question, answer)
# pairs, counting only the answer's tokens. The catalogue (L5) and lesson 5 write it as a **sum**
# over the answer's tokens,
#
# $$\mathcal L_{\mathrm{SFT}} = -\sum_t \log p_\theta(a_t \mid q, a_{<t}),$$
#
# while `gpt.forward`, like PyTorch's default, returns the mean over the counted tokens: the sum
# divided by $|a|$. Lesson 5 showed what the difference does to the gradient.
#
# Preference training (RLHF, as in InstructGPT, Ouyang et al., 2022) then shifts which answers get
# the higher probability; the model still generates by sampling its next-token distribution.
#
# Every one of these trains on the same pairs: the text is read by the model *and* is its own
# target, one token apart. Position $t$ of a row sees the tokens up to its own and is scored on the
# token that follows it in the text. A training batch is cut from one long stream of token ids:
# each row is a window of the stream that starts at a drawn position (`CharLMTask.batch` draws
# them), and the model reads `context` tokens per row. How many tokens of the stream does a row
# take, and where do its inputs and its targets sit in them?

# %% tags=["exercise"]
# Exercise 07.5: the batch GPT trains on from the stream below, with rows that start at `starts`
# and a context of 4 tokens. Give the pair (inputs, targets), each of shape (3, 4): row i is read
# from stream[starts[i]] on.
stream = np.array([5, 17, 3, 3, 9, 0, 21, 4, 11, 2, 30, 7, 16, 25])
starts = np.array([2, 7, 8])
context = 4
inputs_and_targets = ...
# BEGIN SOLUTION
windows = stream[starts[:, None] + np.arange(context + 1)]  # the last token is a target only
inputs_and_targets = (windows[:, :-1], windows[:, 1:])
# END SOLUTION

# %%
check("07.5", inputs_and_targets)

# %% [markdown]
# **Exercise 07.6.** Below, a question `q` of 4 tokens and an answer `a` of 3 for the GPT above. The
# model reads `q + a` shifted by one. Compute the SFT loss, the sum, yourself from `gpt.logits`
# (a log softmax, then the answer's targets), and the `loss_mask` with which `gpt.forward` counts
# the same tokens.

# %%
q_ids, a_ids = rng.integers(0, 32, 4), rng.integers(0, 32, 3)
sequence = np.concatenate([q_ids, a_ids])[None]  # (1, 7)
sft_batch = {"tokens": sequence[:, :-1], "targets": sequence[:, 1:]}
sft_logits = gpt.logits(params, sft_batch["tokens"], gpt_config)  # (1, 6, 32)

# %% tags=["exercise"]
sft_loss = ...
answer_mask = ...
# BEGIN SOLUTION
log_p = sft_logits - np.log(np.exp(sft_logits).sum(axis=-1, keepdims=True))
# the target at position t is sequence[t + 1]: an answer token from t = len(q) - 1 on
first = len(q_ids) - 1
picked = log_p[0, np.arange(first, sequence.shape[1] - 1), sft_batch["targets"][0, first:]]
sft_loss = -picked.sum()
answer_mask = np.zeros(sft_batch["tokens"].shape, dtype=int)
answer_mask[:, first:] = 1
# END SOLUTION

# %%
check("07.6a", sft_loss)

# %%
check("07.6b", answer_mask)

# %% [markdown] tags=["question"]
# **Question.** Instruction tuning changed neither the network nor the loss function, only the
# data and which tokens count. Why is that enough for the model to answer instructions, and why
# does a preference-trained model still need a sampling rule at generation time?
#
# <!-- BEGIN SOLUTION -->
# The model is trained to predict what follows a prefix; if the training text is instructions
# followed by good answers, the continuation it learns for an instruction is an answer. The loss
# mask only keeps the gradient from teaching it to produce the questions. Preference training
# moves probability between candidate answers, but what the model outputs is still a
# distribution over the next token, so generation still picks from it one token at a time
# (greedy, temperature, top-k, top-p: lesson 9).
# <!-- END SOLUTION -->

# %% [markdown]
# ## K1: appending tokens changes nothing that came before
#
# The same mask has a second consequence, the one a KV cache relies on: what a cache keeps for
# position $t$, at every depth, depends on tokens $1, \dots, t$ only. Append three tokens to a
# sequence of five: the first five rows of every layer's keys and values, and of the logits, stay
# as they were (the test suite checks the same for the modern decoder and for MLA).

# %%
short = rng.integers(0, 32, (2, 5))
long = np.concatenate([short, rng.integers(0, 32, (2, 3))], axis=1)
_, short_cache = gpt.forward(params, {"tokens": short, "targets": short}, gpt_config)
_, long_cache = gpt.forward(params, {"tokens": long, "targets": long}, gpt_config)
change = 0.0
for layer_s, layer_l in zip(short_cache.layers, long_cache.layers):
    for s_rows, l_rows in ((layer_s.attn.branch.attn.k, layer_l.attn.branch.attn.k),
                           (layer_s.attn.branch.attn.v, layer_l.attn.branch.attn.v)):
        # (B, h, T, d_h): positions on axis 2
        change = max(change, np.abs(l_rows[:, :, :5] - s_rows).max())
        np.testing.assert_allclose(l_rows[:, :, :5], s_rows, rtol=1e-12, atol=1e-14)
z_short, z_long = gpt.logits(params, short, gpt_config), gpt.logits(params, long, gpt_config)
print(f"largest change in the first five rows: keys and values {change:.1e}, "
      f"logits {np.abs(z_long[:, :5] - z_short).max():.1e}")
np.testing.assert_allclose(z_long[:, :5], z_short, rtol=1e-12, atol=1e-14)

# %% [markdown] tags=["question"]
# **Question.** K1 holds for GPT at every depth, not only in the first layer. Why is that not
# obvious, and what property of each layer makes it true? Would it still hold with Post-LN?
#
# <!-- BEGIN SOLUTION -->
# Layer 2's keys at position $t$ are computed from layer 1's outputs at position $t$, which mix
# information from other positions through attention. It holds because every sublayer is either
# position-wise (LayerNorm, the FFN, the projections, the residual sum) or causal attention, whose
# output at $t$ reads only positions $\le t$; by induction on depth, every row $t$ at every depth
# depends on tokens $1..t$ only. Post-LN only moves a position-wise LayerNorm, so yes, it holds.
# (Batch statistics, as in BatchNorm over time, would break it.)
# <!-- END SOLUTION -->

# %% [markdown]
# ## O5: which parameters take weight decay
#
# AdamW shrinks each parameter by $1 - \eta\lambda$ per step. That suits weight matrices; it does
# not suit biases and norm gains and shifts (pulling a gain towards 0 is not a simpler model, only
# a different one). So parameters come in groups with their own $\lambda$: the default rule of
# `takes_weight_decay` gives $\lambda$ to the layers' weight matrices and the output head, and 0 to
# biases, norm gains and shifts, and embedding tables (a common choice, not a universal one:
# decay shrinks every row at every step, while a rare token's row gets a gradient only when the
# token occurs).

# %%
shapes_of = gpt.param_shapes(gpt_config)
leaves = {}
for name in shapes_of:
    leaves.setdefault(name.split(".")[-1], takes_weight_decay(name))
decayed = sum(math.prod(s) for n, s in shapes_of.items() if takes_weight_decay(n))
print(f"decay {sorted(k for k, v in leaves.items() if v)}")
print(f"no decay {sorted(k for k, v in leaves.items() if not v)}; "
      f"{decayed / n_params(shapes_of):.0%} of the parameters decay")

# %% [markdown]
# **Exercise 07.7.** One AdamW step with $\eta = 0.1$, $\lambda = 0.5$ and a zero gradient: Adam's
# own update is then zero, so only the decay acts. Predict every parameter after the step, as a
# dict, from `before` and `takes_weight_decay`.

# %% tags=["exercise"]
before = gpt.init_params(gpt_config, seed=0)
predicted = ...  # {name: array}
# BEGIN SOLUTION
predicted = {name: value * (1 - 0.1 * 0.5 if takes_weight_decay(name) else 1.0)
             for name, value in before.items()}
# END SOLUTION

# %%
check("07.7", predicted)

# %% [markdown]
# With a gradient, the step is lesson 5's AdamW (O1, O2, O4) with this lesson's rule for the
# decay (O5): with $g$ the parameter's gradient and $s$ the number of the step (1 for the first),
#
# $$m_s = \beta_1 m_{s-1} + (1 - \beta_1) g,\quad v_s = \beta_2 v_{s-1} + (1 - \beta_2) g^2,\quad
# \theta_s = (1 - \eta\lambda)\,\theta_{s-1} - \eta\,\frac{m_s / (1 - \beta_1^s)}
# {\sqrt{v_s / (1 - \beta_2^s)} + \epsilon},$$
#
# with $\lambda = 0$ for the parameters `takes_weight_decay` leaves alone. The settings are
# GPT-3's: $\beta = (0.9, 0.95)$, $\lambda = 0.1$.

# %% tags=["exercise"]
# Exercise 07.8: write one AdamW step for one parameter: its name (for the decay rule), its value
# theta, its gradient g, the moments m and v before the step, and the step number s (1, 2, ...).
# Return (new theta, new m, new v), without changing the arrays you are given. The check compares
# it with refmath's AdamW and with torch.optim.AdamW (if installed) on five parameters, at the
# first step and later ones, with gradients from 1e-4 to 3 (so that eps matters).
LR, BETAS, EPS, WD = 0.01, (0.9, 0.95), 1e-8, 0.1


def my_adamw_step(name, theta, g, m, v, s):
    new_theta = new_m = new_v = ...
    # BEGIN SOLUTION
    beta1, beta2 = BETAS
    new_m = beta1 * m + (1 - beta1) * g
    new_v = beta2 * v + (1 - beta2) * g * g
    m_hat, v_hat = new_m / (1 - beta1**s), new_v / (1 - beta2**s)
    decay = WD if takes_weight_decay(name) else 0.0
    new_theta = theta * (1 - LR * decay) - LR * m_hat / (np.sqrt(v_hat) + EPS)
    # END SOLUTION
    return new_theta, new_m, new_v


# %%
check("07.8", my_adamw_step)

# %% [markdown]
# ## GPT learns
#
# Everything together: 60 steps of AdamW (weight decay 0.1 on the parameters O5 decays), a
# warmup-cosine learning rate and gradient clipping at 1, in float32, for GPT in both
# arrangements, width 32 and depth 2, on batches of 8 windows of 32 characters of a generated
# English text. Both start at about $\log V$ and end well below (by more than 0.5 nats) the
# unigram entropy, the loss of a model that ignores the context. (The ranking of the two after so
# few steps, from one seed, is not a verdict on the arrangements.)

# %%
task = CharLMTask(seq_len=32, n_sentences=400)
V = task.vocab_size
unigram = task.unigram_entropy()
print(f"V = {V}, log V = {np.log(V):.3f}; unigram entropy {unigram:.3f}, "
      f"entropy rate of the text {task.entropy_rate():.3f} (nats per character)")
steps, max_lr = 60, 1e-2
curves = {}
for position in ("post", "pre"):
    config = gpt.GPTConfig(vocab_size=V, max_seq_len=32, n_layers=2, d_model=32, n_heads=4,
                           norm_position=position, dropout=0.0)
    params = gpt.init_params(config, seed=0, dtype=np.float32)
    optimiser = AdamW(lr=max_lr, weight_decay=0.1)
    losses = []
    for step in range(1, steps + 1):
        loss, cache = gpt.forward(params, task.batch("train", step - 1, 8, seed=0), config)
        grads = gpt.backward(cache)
        clip_grad_norm(grads, 1.0)
        optimiser.step(params, grads, lr=warmup_cosine(step, max_lr, warmup=10, total=steps,
                                                        min_lr=max_lr / 10))
        losses.append(float(loss))
    curves[f"GPT {position}-LN"] = np.array(losses)
    print(f"{position}-LN: first loss {losses[0]:.3f}, mean of the last 10 "
          f"{np.mean(losses[-10:]):.3f}")
    assert abs(losses[0] - np.log(V)) < 0.1
    assert np.mean(losses[-10:]) < unigram - 0.5

fig, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
for label, losses in curves.items():
    ax.plot(np.arange(1, steps + 1), losses, lw=1, label=label)
ax.axhline(unigram, color="gray", ls="--", label="unigram entropy")
ax.axhline(task.entropy_rate(), color="black", ls=":", label="entropy rate of the text")
ax.set(xlabel="step", ylabel="cross-entropy (nats per character)",
       title=f"two tiny GPTs, {steps} steps of AdamW")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## Exercises
#
# 1. Write the backward of the Pre-LN layer $x \leftarrow x + F(\mathrm{LN}(x))$ in terms of $F$'s
#    and LN's Jacobians, and compare it with Post-LN's (catalogue N4).
# 2. With the variance argument of N11, predict the variance added to the stream by 16 unscaled
#    layers from the value for 1 layer, and compare with the printed numbers.
# 3. L6 needs a loss mask to count only the last position of each prefix. Show that without the
#    mask, the mean over prefixes weights early positions more than the one-pass loss does.
# 4. Change `takes_weight_decay` so that embeddings decay too, train again, and compare the final
#    losses and the norm of `tok_emb`.
# 5. GPT-2 ties the output matrix to `tok_emb`. Which three terms make up `tok_emb`'s gradient in
#    GPT (compare with lesson 6's M1)?
#
# ## References
#
# - Radford, A., et al. (2018). Improving Language Understanding by Generative Pre-Training.
#   (GPT, Post-LN, learned positions.)
# - Radford, A., et al. (2019). Language Models are Unsupervised Multitask Learners. (GPT-2,
#   Pre-LN with a final LayerNorm, residual projections scaled by $1/\sqrt{N}$.)
# - Xiong, R., et al. (2020). On Layer Normalization in the Transformer Architecture.
# - Loshchilov, I., and Hutter, F. (2017). Decoupled Weight Decay Regularization. (AdamW.)
# - Vaswani, A., et al. (2017). Attention Is All You Need. (The causal mask of the decoder.)
# - Brown, T., et al. (2020). Language Models are Few-Shot Learners. (GPT-3: tasks from prompts
#   and examples, without a gradient step per task.)
# - Ouyang, L., et al. (2022). Training language models to follow instructions with human
#   feedback. (InstructGPT: supervised fine-tuning, then RLHF.)
