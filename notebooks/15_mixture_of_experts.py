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
#     minutes: 85
#     ids: [E1, E2, E3, E4, E5, E6, E7, E8, E9, E10]
# ---

# %% [markdown]
# # Lesson 15: mixture of experts
#
# A mixture-of-experts (MoE) layer replaces the one feed-forward of a decoder layer by $E$ of them,
# the *experts*, and a *router* that sends each token to only $k$ of them. The model then holds
# $E$ feed-forwards' worth of parameters but spends the arithmetic of $k$ on each token: Mixtral
# 8x7B holds 46.7B parameters and uses 12.9B per token, DeepSeek-V3 671B and 37B. This lesson
# routes four tokens by hand (E7), follows the gradient through a choice that has none (E2-E4),
# balances the experts' load with a loss (E5) and with DeepSeek-V3's bias (E6), and counts what
# such a model holds, computes and sends between devices.
#
# **Prerequisites:** lessons 4 (SwiGLU, N7), 5 (cross-entropy, AdamW), 8 (the modern decoder)
# and 11 (the DeepSeek presets, memory); lesson 10's decode cost helps in the last section.
#
# **Goals:** choose the top-$k$ experts of a token and renormalise their gates by hand; explain
# why the router's gradient reaches it only through the gates, and write the gates' backward;
# compute the load-balancing loss and say what its gradient does; balance a skewed router with
# DeepSeek-V3's selection bias; count total and active parameters; weigh the memory an MoE holds
# against the arithmetic it does, and the bytes a token sends between devices.
#
# **Catalogue IDs:** E1, E2, E3, E4, E5, E6, E7, E8, E9, E10
#
# **Duration:** about 85 minutes.

# %%
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # tiny matrices: one BLAS thread is fastest

import matplotlib.pyplot as plt
import numpy as np

from refmath.data import CharLMTask
from refmath.ffn import sigmoid, swiglu_forward
from refmath.lessons import catalogued, check, check_function
from refmath.models import decoder
from refmath.moe import MoEConfig, moe_backward, moe_forward, moe_param_shapes, routing_margin
from refmath.optim import AdamW
from refmath.sizing import PRESETS, ModelConfig, format_bytes

# The functions that compute an exercise's answer (expert_load, expert_balance_loss,
# parameter_counts, ...) are imported only after their exercise.

np.set_printoptions(precision=4, suppress=True)

# %% [markdown]
# ## E1, E4: a feed-forward made of experts
#
# For a token $x$ (a row of width $d$), the router computes one logit per expert and turns them
# into scores, a softmax over the experts (Mixtral, Qwen2-MoE, DeepSeek-V2) or an elementwise
# sigmoid (DeepSeek-V3):
#
# $$z = x W_r,\qquad s = \operatorname{softmax}(z)\ \text{or}\ \sigma(z)\qquad (E1).$$
#
# The $k$ best scores pick the experts $\mathcal T$, and the output is their weighted sum, plus
# the shared experts $S$ that every token goes through (DeepSeek's; Mixtral has none):
#
# $$y = \sum_{j \in \mathcal T} g_j\, E_j(x) + S(x),\qquad
# E_j(x) = \big[\operatorname{SiLU}(x W^{(j)}_g) \odot (x W^{(j)}_u)\big] W^{(j)}_d\qquad (E4),$$
#
# each expert a SwiGLU of its own (lesson 4). Below, a layer of $E = 4$ experts of width 3 on
# $d = 4$, top-2, five tokens: `moe_forward` gathers each expert's tokens, runs the expert on
# them only and adds the gated results back; the same output, token by token, from the
# definition.

# %%
rng = np.random.default_rng(1)
small = MoEConfig(n_experts=4, top_k=2, d_expert=3, norm_topk=True)
small_params = {name: rng.standard_normal(shape) / np.sqrt(shape[-2])
                for name, shape in moe_param_shapes(4, small).items()}
for name, shape in moe_param_shapes(4, small).items():
    print(f"{name:16s} {shape}")
tokens5 = np.random.default_rng(5).standard_normal((5, 4))
y5, cache5 = moe_forward(tokens5, small_params, small)
print("experts chosen per token:\n", cache5.indices, "\ngates:\n", cache5.gates)
by_definition = np.zeros_like(y5)
for n in range(5):
    for j, e in enumerate(cache5.indices[n]):
        expert_out, _ = swiglu_forward(tokens5[n], small_params["experts.w_gate"][e],
                                       small_params["experts.w_up"][e],
                                       small_params["experts.w_down"][e])
        by_definition[n] += cache5.gates[n, j] * expert_out
np.testing.assert_allclose(y5, by_definition, rtol=1e-13, atol=1e-15)
print("tokens sent to each expert:", cache5.load, "(5 tokens x 2 choices)")

# %% [markdown]
# ## E7, E2, E3: top-2 routing by hand
#
# Four tokens, four experts, top-2, the router's logits given directly:
#
# $$z = \ln\begin{pmatrix} 4 & 2 & 1 & 1\\ 1 & 1 & 2 & 4\\ 1 & 3 & 3 & 1\\ 1 & 1 & 1 & 1
# \end{pmatrix}.$$
#
# (The softmax runs along each row, over the experts: its rows sum to 8, 8, 8 and 4, its columns
# to 7, so a softmax down the columns, over the tokens, gives other numbers.)
#
# The steps, as Mixtral takes them:
#
# 1. the softmax over the experts, $p_{n,i} = e^{z_{n,i}} / \sum_u e^{z_{n,u}}$;
# 2. the selection (E2): each token's $k = 2$ largest probabilities, best first; equal
#    probabilities go to the lower expert index (the rule of `refmath.moe.route`, a stable sort;
#    `torch.topk` leaves it unspecified);
# 3. the gates (E3): the chosen probabilities renormalised to sum to 1,
#    $g_j = p_{\mathcal T_j} / \sum_l p_{\mathcal T_l}$ (Mixtral always; Qwen2-MoE's
#    `norm_topk_prob`; DeepSeek-V2 keeps the probabilities and scales them instead).

# %% [markdown]
# **Exercise 15.1.** By hand (each row of $e^z$ is easy to sum): the probabilities (4, 4), the two
# experts of each token (4, 2), best first, and their gates (4, 2).

# %% tags=["exercise"]
worked_logits = np.log(np.array([[4.0, 2.0, 1.0, 1.0],
                                 [1.0, 1.0, 2.0, 4.0],
                                 [1.0, 3.0, 3.0, 1.0],
                                 [1.0, 1.0, 1.0, 1.0]]))
probs_by_hand = ...  # (4, 4)
top2_by_hand = ...  # (4, 2) expert numbers, best first
gates_by_hand = ...  # (4, 2)
# BEGIN SOLUTION
row_sums = np.array([[8], [8], [8], [4]])
probs_by_hand = np.array([[4, 2, 1, 1], [1, 1, 2, 4], [1, 3, 3, 1], [1, 1, 1, 1]]) / row_sums
top2_by_hand = np.array([[0, 1], [3, 2], [1, 2], [0, 1]])
gates_by_hand = np.array([[2 / 3, 1 / 3], [2 / 3, 1 / 3], [1 / 2, 1 / 2], [1 / 2, 1 / 2]])
# END SOLUTION

# %%
check("15.1a", probs_by_hand)

# %%
check("15.1b", top2_by_hand)

# %%
check("15.1c", gates_by_hand)

# %%
from refmath.moe import router_scores

# After the exercise: the library's routing of the worked example, used below.
_, worked_probs, _ = router_scores(worked_logits, np.eye(4))  # x = the logits, W_r = I
mixtral_style = MoEConfig(n_experts=4, top_k=2, d_expert=1, norm_topk=True)
unnormalised = MoEConfig(n_experts=4, top_k=2, d_expert=1)

# %% [markdown]
# Where probabilities tie, the lower index wins, and every token's gates sum to 1. DeepSeek-V2 restricts the choice to the best groups of experts (one group per device, E2's
# `group_limited_greedy`), and DeepSeek-V3 adds a *bias* $b$ to the scores before choosing
# (`noaux_tc`, section E6). With two groups $\{0, 1\}$, $\{2, 3\}$ and one kept per token, token
# 2's groups tie at their best $3/8$ and it takes experts 1 and 0 ($3/8$ and $1/8$, gates
# $3/4, 1/4$). A bias of 0.3 on expert 2 sends it to experts 2 and 3 instead, with the gates of
# their *unbiased* scores: the bias picks, it never weights.

# %%
from refmath.moe import route

grouped = MoEConfig(n_experts=4, top_k=2, d_expert=1, routing="group_limited_greedy",
                    n_groups=2, topk_groups=1, norm_topk=True)
indices_g, gates_g, _ = route(worked_probs, grouped)
biased = MoEConfig(n_experts=4, top_k=2, d_expert=1, routing="noaux_tc", n_groups=2,
                   topk_groups=1, norm_topk=True, score_bias=True)
indices_b, gates_b, _ = route(worked_probs, biased, bias=np.array([0.0, 0.0, 0.3, 0.0]))
print("group-limited:", indices_g.tolist(), " token 2's gates", gates_g[2])
print("with the bias:", indices_b.tolist(), " token 2's gates", gates_b[2])
np.testing.assert_array_equal(indices_g, [[0, 1], [3, 2], [1, 0], [0, 1]])
np.testing.assert_array_equal(indices_b[2], [2, 3])
np.testing.assert_allclose([gates_g[2], gates_b[2]], [[3 / 4, 1 / 4]] * 2, rtol=1e-15)

# %% [markdown] tags=["question"]
# **Question.** Dividing token 0's chosen *logits* by their sum, $\ln 4 / (\ln 4 + \ln 2)$, also
# gives $2/3$. Is that a rule? And Mixtral's paper writes the gates as a softmax over the top-$k$
# logits, where you renormalised a softmax over all four experts: which is right?
#
# <!-- BEGIN SOLUTION -->
# A coincidence: $\ln 4 = 2 \ln 2$. Logits are defined up to an additive constant per token (the
# softmax does not change when every logit moves by the same amount) and can be zero or
# negative, so their ratios mean nothing; on $\ln(5, 2, 1, 1)$ the ratio gives 0.70, the gate is
# $5/7 = 0.714$. The two forms of the gates are the same: the softmax's normaliser cancels,
# $p_i / \sum_{\mathcal T} p_j = e^{z_i} / \sum_{\mathcal T} e^{z_j}$, and the $k$ largest
# logits are the $k$ largest probabilities, since the softmax is increasing in each logit. So for
# a softmax router the order of "top-$k$" and "softmax" does not matter.
# <!-- END SOLUTION -->

# %% [markdown]
# ## E3, E4: the gates carry the gradient
#
# The selection $\mathcal T$ is a piecewise-constant function of the scores: moving a score a
# little changes nothing, until two scores cross (the $k$-th and the $(k+1)$-th), and then the
# output jumps, as one expert's output is replaced by another's. Its derivative is zero wherever
# it exists. The output still depends smoothly on the gates, and the gates on the scores, so
# the router learns through the gates alone:
#
# $$dg_j = \langle dy,\, E_{\mathcal T_j}(x)\rangle,\qquad
# ds_i = \frac{1}{D}\Big(\rho\, dg_i - \frac{1}{D}\sum_{j} \rho\, dg_j\, s_j\Big)\ \
# (i \in \mathcal T),\qquad ds_i = 0\ \ (i \notin \mathcal T)$$
#
# for gates $g_j = \rho\, s_j / D$, $D = \sum_{l \in \mathcal T} s_l$ (renormalised, scaled by
# $\rho$), then the softmax's backward (A5) to the logits and $dW_r = x^\top dz$.
#
# Below, the small layer's output along a line $x(t) = x_0 + t u$ through the input space,
# projected on a fixed $c$: $f(t) = \langle c, y(x(t))\rangle$. At $t \approx 0.84$ the second
# and third scores cross and $f$ jumps. Away from the crossing, central differences of $f$ agree
# with the backward; straddling it, they measure the jump divided by $2h$, which is no
# derivative at all.

# %%
x0, u_dir, c_dir = (rng.standard_normal((1, 4)) for _ in range(3))
u_dir /= np.linalg.norm(u_dir)


def along(t):
    """f(t) = <c, y(x0 + t u)> and the layer's cache."""
    y, cache = moe_forward(x0 + t * u_dir, small_params, small)
    return float(np.sum(c_dir * y)), cache


def chosen_set(t):
    return frozenset(along(t)[1].indices[0].tolist())


ts = np.linspace(-2.0, 2.0, 401)
on_the_line = [along(t) for t in ts]
f_t = np.array([value for value, _ in on_the_line])
sets = [frozenset(cache.indices[0].tolist()) for _, cache in on_the_line]
jumps = [i for i in range(1, len(ts)) if sets[i] != sets[i - 1]]
assert len(jumps) == 1, jumps
lo, hi = ts[jumps[0] - 1], ts[jumps[0]]
while hi - lo > 1e-12:  # bisect to the crossing
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if chosen_set(mid) == sets[jumps[0] - 1] else (lo, mid)
t_tie = (lo + hi) / 2
jump = along(hi)[0] - along(lo)[0]
print(f"the selection changes at t = {t_tie:.6f}: experts {sorted(sets[jumps[0] - 1])} -> "
      f"{sorted(sets[jumps[0]])}; f jumps by {jump:.4f}")

h = 1e-3
for label, t in (("far from the crossing, t = 0", 0.0), ("2e-4 before the crossing", t_tie - 2e-4)):
    value, cache = along(t)
    dx, _ = moe_backward(c_dir, cache)
    analytic = float(np.sum(dx * u_dir))
    central = (along(t + h)[0] - along(t - h)[0]) / (2 * h)
    print(f"{label:30s} backward {analytic:+.6f}, central difference {central:+.6f}, "
          f"routing margin {routing_margin(cache.router.scores, small):.1e}")
    if t == 0.0:
        assert abs(central - analytic) < 1e-5 * max(1.0, abs(analytic))
    else:  # the stencil straddles the jump: about jump / (2h)
        assert abs(central - analytic - jump / (2 * h)) < 0.01 * abs(jump / (2 * h))

scores_t = np.array([cache.router.scores[0] for _, cache in on_the_line])
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained")
axes[0].plot(ts, f_t, ".", ms=2)
axes[0].axvline(t_tie, color="gray", ls=":")
axes[0].set(xlabel="t", ylabel=r"$f(t) = \langle c, y(x_0 + t u)\rangle$",
            title="the output jumps where the selection changes")
for e in range(4):
    axes[1].plot(ts, scores_t[:, e], label=f"expert {e}")
axes[1].axvline(t_tie, color="gray", ls=":")
axes[1].set(xlabel="t", ylabel="router probability", title="two scores cross at the jump")
axes[1].legend(fontsize=8)
plt.show()

# %% tags=["exercise"]
# Exercise 15.2: the gates' backward (E3), from the gates to the scores. `dgates` (N, k) is the
# gradient with respect to route's gates; `cache` is the RouteCache route returned:
# cache.indices (N, k) the chosen experts, cache.chosen (N, k) their scores s_j,
# cache.denominator (N, 1) their sum D (None when the gates are not renormalised),
# cache.scaling the factor rho and cache.n_experts E. Return dscores (N, E), zero for every expert
# a token did not choose. The check runs it as the backward of three registered cases (Mixtral's
# renormalised top-2, DeepSeek-V2's top-3 scaled by 16, group-limited top-3) under the gradient
# check, and against route_backward and torch autograd.
def my_route_backward(dgates, cache):
    dscores = ...
    # BEGIN SOLUTION
    dg = dgates * cache.scaling
    if cache.denominator is not None:  # g_j = rho s_j / D, and D holds every chosen score
        d_sum = cache.denominator
        dg = (dg - np.sum(dg * cache.chosen, axis=-1, keepdims=True) / d_sum) / d_sum
    dscores = np.zeros((cache.indices.shape[0], cache.n_experts))
    np.put_along_axis(dscores, cache.indices, dg, axis=1)  # the unchosen get nothing
    # END SOLUTION
    return dscores


# %%
from refmath.moe import route_backward

check("15.2", my_route_backward)

# %% [markdown]
# The whole gradient of the router comes from the gates: with $dg_j = \langle dy, E_j(x)\rangle$
# from the experts' outputs, `route_backward` (the renormalisation) and `router_scores_backward`
# (the softmax, then $x^\top dz$) give exactly the router weight's gradient of `moe_backward`.

# %%
from refmath.moe import router_scores_backward

value0, cache0 = along(0.0)
_, grads0 = moe_backward(c_dir, cache0)
dg0 = np.array([[np.sum(c_dir[0] * cache0.experts[e].out[0]) for e in cache0.indices[0]]])
_, dw_router = router_scores_backward(route_backward(dg0, cache0.route), cache0.router)
print("dg =", dg0, " |dW_r via the gates - moe_backward's| =",
      np.abs(dw_router - grads0["router.w"]).max())
np.testing.assert_allclose(dw_router, grads0["router.w"], rtol=1e-12, atol=1e-15)

# %% [markdown] tags=["question"]
# **Question.** DeepSeek-V3 scores with a sigmoid and renormalises the chosen scores. Is that a
# softmax over the chosen logits, as it is for a softmax router? And a gradient that is the same
# for every chosen gate ($dg_j = c$) gives what $ds$ when the gates are renormalised, and why?
#
# <!-- BEGIN SOLUTION -->
# No: $\sigma(z_i) / \sum_{\mathcal T} \sigma(z_j)$ is not $e^{z_i} / \sum_{\mathcal T} e^{z_j}$.
# For chosen logits $(2, 0)$ the sigmoid gates are $0.881 / (0.881 + 0.5) = 0.638$ and $0.362$,
# the softmax would give $0.881$ and $0.119$. (Only the softmax has a normaliser that cancels.)
# A uniform $dg$ gives $ds = 0$: renormalised gates always sum to $\rho$, so moving the scores
# cannot change $\sum_j g_j$, and $c \sum_j g_j$ is all that a uniform gradient sees. In the
# formula, $ds_i = \frac{\rho c}{D}(1 - \frac{1}{D}\sum_j s_j) = 0$. The router only learns from
# *differences* between the chosen experts' usefulness $\langle dy, E_j(x)\rangle$.
# <!-- END SOLUTION -->

# %% [markdown]
# ## E5: load balance
#
# Nothing in the language-model loss spreads the tokens over the experts. An expert that happens
# to receive more tokens early is trained more, becomes more useful, scores higher and receives
# more tokens still; the others idle (*routing collapse*), and on many devices the busiest expert
# sets the pace. DeepSeek-V2's expert-level balance loss counts the load against the router's
# probabilities over $N$ tokens; below, the $N$ tokens of a batch:
#
# $$\mathcal L_{\text{ExpBal}} = \sum_{i=1}^{E} f_i\, P_i,\qquad
# f_i = \frac{E}{k N}\,\text{load}_i,\qquad P_i = \frac{1}{N}\sum_{n=1}^{N} p_{n,i}.$$
#
# An even load gives every $f_i = 1$, so the loss is $\sum_i P_i = 1$. If every token goes to
# the same $k$ experts and puts all its probability on them, $f_i = E/k$ there and the loss is
# $E / k$. (Switch Transformer and Mixtral write $\frac{E}{N}\sum_i \text{load}_i P_i$, $k$ times
# this.) It is added to the training loss with a small coefficient $\alpha$; ST-MoE's router
# *z-loss* $\frac{1}{N}\sum_n (\log \sum_e e^{z_{n,e}})^2$ is often added too, to keep the
# logits small. On the worked example: load $(2, 3, 2, 1)$, $\mathcal L_{\text{ExpBal}} = 1$,
# and each row's $\log \sum_e e^{z}$ is $\ln 8$ (the last row's $\ln 4$), so the z-loss is
# $\frac14 (3 \cdot 9 + 4) (\ln 2)^2 = \frac{31}{4} (\ln 2)^2$.

# %% [markdown]
# **Exercise 15.3.** Six tokens, four experts, top-2, with the router probabilities below (no ties
# among the two best of any row). Compute the load of each expert and $\mathcal L_{\text{ExpBal}}$.

# %% tags=["exercise"]
probs6 = np.array([[0.5, 0.3, 0.1, 0.1],
                   [0.4, 0.1, 0.3, 0.2],
                   [0.6, 0.2, 0.1, 0.1],
                   [0.1, 0.5, 0.3, 0.1],
                   [0.3, 0.4, 0.1, 0.2],
                   [0.2, 0.1, 0.3, 0.4]])
load6_by_hand = ...  # (4,)
balance_loss_by_hand = ...
# BEGIN SOLUTION
load6_by_hand = np.array([4, 4, 3, 1])  # tokens 0, 1, 2, 4 | 0, 2, 3, 4 | 1, 3, 5 | 5
f6 = 4 / (2 * 6) * load6_by_hand
balance_loss_by_hand = np.sum(f6 * probs6.mean(axis=0))
# END SOLUTION

# %%
check("15.3a", load6_by_hand)

# %%
check("15.3b", balance_loss_by_hand)

# %%
# After the exercise: the library's load and balance loss, on the examples of the section
from refmath.moe import expert_balance_loss, expert_load, router_z_loss

N_even, E4, k2 = 8, 4, 2
uniform = np.full((N_even, E4), 1 / E4)
round_robin = np.array([[n % E4, (n + 1) % E4] for n in range(N_even)])  # each expert 4 times
collapsed = np.tile([0.5, 0.5, 0.0, 0.0], (N_even, 1))
to_the_first_two = np.tile([0, 1], (N_even, 1))
at_balance = expert_balance_loss(uniform, expert_load(round_robin, E4), k2)[0]
at_collapse = expert_balance_loss(collapsed, expert_load(to_the_first_two, E4), k2)[0]
worked_load = expert_load(route(worked_probs, mixtral_style)[0], 4)
worked_balance = expert_balance_loss(worked_probs, worked_load, 2)[0]
worked_z = router_z_loss(worked_logits)[0]
print(f"balanced: {at_balance:.4f}   collapsed onto 2 of 4: {at_collapse:.4f} (E / k = {E4 / k2})")
print(f"worked example: load {worked_load}, L_ExpBal {worked_balance:.4f}, z-loss {worked_z:.6f} "
      f"= 31/4 (ln 2)^2 = {31 / 4 * np.log(2) ** 2:.6f}")
assert at_balance == 1.0 and at_collapse == E4 / k2
np.testing.assert_array_equal(worked_load, [2, 3, 2, 1])
np.testing.assert_allclose([worked_balance, worked_z], [1.0, 31 / 4 * np.log(2) ** 2], rtol=1e-14)
load6 = expert_load(route(probs6, unnormalised)[0], 4)  # used below

# %% [markdown]
# The load is a count of a selection, piecewise constant like the selection itself: no gradient
# goes through $f$. All of it goes through $P$:
# $\partial \mathcal L / \partial p_{n,i} = f_i / N$, and through the softmax (A5)
# $\partial \mathcal L / \partial z_{n,i} = p_{n,i}\,(f_i - \sum_u p_{n,u} f_u) / N$: positive
# for the experts loaded above the token's probability-weighted average, whose logits gradient
# descent therefore lowers, negative for the others. Here the least loaded expert gains on every
# token and the two most loaded lose (the signs below).

# %%
from refmath.moe import expert_balance_loss_backward
from refmath.softmax import SoftmaxCache, softmax_backward

_, balance_cache = expert_balance_loss(probs6, load6, 2)
dz6 = softmax_backward(expert_balance_loss_backward(1.0, balance_cache), SoftmaxCache(probs6))
f_of_6 = 4 / (2 * 6) * load6
print("sign of dL/dz per token (rows) and expert (columns):\n", np.sign(dz6).astype(int))
np.testing.assert_array_equal(np.sign(dz6), np.sign(f_of_6 - probs6 @ f_of_6[:, None]))
assert np.all(dz6[:, 3] < 0) and np.all(dz6[:, :2] > 0)

# %% [markdown] tags=["question"]
# **Question.** The worked example's load $(2, 3, 2, 1)$ is uneven, yet its balance loss is
# exactly 1, the value at an even load. Is a loss of 1 a sign of balance? What does its gradient
# do there?
#
# <!-- BEGIN SOLUTION -->
# No. $\sum_i f_i P_i = 1$ whenever the mean probabilities $P$ are uniform, since
# $\sum_i f_i = E$ for any load: the loss measures how much the load and the probability pile
# up on the *same* experts, not the load alone. In the worked example every column of $p$ sums to
# 1, so $P = (1/4, 1/4, 1/4, 1/4)$. The gradient is not zero there: $f_i / N$ with
# $f = (1, 3/2, 1, 1/2)$ still lowers the logits of the overloaded expert 1 and raises those of
# the underloaded expert 3, relative to each token's weighted average, and the next selection
# follows the probabilities.
# <!-- END SOLUTION -->

# %% [markdown]
# ## E6: DeepSeek-V3's bias balancing
#
# A balance loss adds a gradient that has nothing to do with predicting text, and a large
# $\alpha$ costs quality. DeepSeek-V3 balances mainly without one (*auxiliary-loss-free*
# balancing). It keeps E5's form only as a *complementary sequence-wise* loss: $N$ is then the
# tokens of one sequence, not of a batch, and $\alpha$ is very small, there only to stop a single
# sequence from being extremely unbalanced. The main mechanism: each expert has a bias $b_i$,
# added to its score for choosing only (the gates use
# the scores themselves), and after every training step
#
# $$b_i \leftarrow b_i - \gamma\,\operatorname{sign}\big(\text{load}_i -
# \overline{\text{load}}\big),$$
#
# lowering the bias of every overloaded expert and raising it for every underloaded one, with a
# fixed speed $\gamma$ (0.001 for most of DeepSeek-V3's training). The bias is not trained by
# the gradient: it enters only the selection, whose derivative is zero (`moe_backward` gives it a
# zero gradient).

# %% [markdown]
# **Exercise 15.4.** Biases $(0, 0.01, -0.02, 0)$, loads $(5, 1, 3, 3)$, $\gamma = 0.001$: the
# biases after one update.

# %% tags=["exercise"]
bias_before = np.array([0.0, 0.01, -0.02, 0.0])
load_step = np.array([5.0, 1.0, 3.0, 3.0])
bias_after_by_hand = ...  # (4,)
# BEGIN SOLUTION
bias_after_by_hand = bias_before - 0.001 * np.array([1.0, -1.0, 0.0, 0.0])  # mean load 3
# END SOLUTION

# %%
check("15.4", bias_after_by_hand)

# %% [markdown]
# A simulation of the rule alone: 512 tokens a step, 8 experts, top-2, sigmoid scores from
# logits drawn afresh each step with a fixed skew from $+1$ (expert 0) to $-1$ (expert 7), so
# that at $b = 0$ expert 0 receives more than ten times the tokens of expert 7. With
# $\gamma = 0.001$ each bias moves by $\gamma$ a step against its expert's excess, and after
# about 200 steps each expert holds close to the mean $Nk/E = 128$; the sign rule then keeps each
# bias within a few steps of its balance point.

# %%
from refmath.moe import balance_bias_update

E8, k_sim, N_sim, gamma = 8, 2, 512, 0.001
v3_like = MoEConfig(n_experts=E8, top_k=k_sim, d_expert=1, scoring="sigmoid", norm_topk=True,
                    score_bias=True)
skew = np.linspace(1.0, -1.0, E8)
sim_rng = np.random.default_rng(0)
bias = np.zeros(E8)
sim_loads = []
for step in range(300):
    scores = sigmoid(sim_rng.standard_normal((N_sim, E8)) + skew)
    chosen, _, _ = route(scores, v3_like, bias)
    sim_loads.append(expert_load(chosen, E8))
    bias = balance_bias_update(bias, sim_loads[-1], gamma)
sim_loads = np.array(sim_loads)
imbalance = sim_loads.max(axis=1) / sim_loads.mean(axis=1)
print(f"first step: loads {sim_loads[0]}, max / mean {imbalance[0]:.2f}")
print(f"last 50 steps: mean loads {sim_loads[-50:].mean(axis=0).round(1)}, "
      f"max / mean {imbalance[-50:].mean():.2f}; biases {bias.round(3)}")
assert imbalance[0] > 2 and imbalance[-50:].mean() < 1.2
assert np.all(np.diff(bias) > 0)  # the experts the skew favours end with the lowest biases

fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained")
colours = plt.cm.viridis(np.linspace(0, 0.9, E8))
for e in range(E8):
    axes[0].plot(sim_loads[:, e], color=colours[e], lw=0.8, label=f"expert {e}")
axes[0].axhline(N_sim * k_sim / E8, color="black", ls="--", lw=0.8)
axes[0].set(xlabel="step", ylabel="tokens routed", title=rf"bias balancing, $\gamma$ = {gamma}")
axes[0].legend(fontsize=7, ncol=2)
axes[1].bar(range(E8), bias, color=colours)
axes[1].set(xlabel="expert", ylabel="bias after 300 steps", title="the biases undo the skew")
plt.show()

# %% [markdown]
# The same on a model in training: the tiny decoder of lesson 8 with an MoE feed-forward in both
# layers (8 experts of width 16, top-2), 100 steps of AdamW on characters, three ways: no
# balancing, the balance loss with $\alpha = 0.1$, and DeepSeek-V3's sigmoid router with the bias
# updated after each step ($\gamma = 0.01$: a run of 100 steps needs a faster rule than one of
# 14.8T tokens). `decoder.expert_loads(cache)` gives each layer's load from the forward pass.
# Without balancing, a few experts take most tokens; both balancing rules keep the load near the
# mean of 64. (These short runs say nothing about the quality trade-off at scale.)

# %%
task = CharLMTask(seq_len=32, n_sentences=400)
shape = dict(n_experts=8, top_k=2, d_expert=16)
runs = {"no balancing": (MoEConfig(**shape, norm_topk=True), 0.0),
        "balance loss, alpha = 0.1": (MoEConfig(**shape, norm_topk=True, balance_coef=0.1),
                                      0.0),
        "bias, gamma = 0.01": (MoEConfig(**shape, scoring="sigmoid", norm_topk=True,
                                         score_bias=True), 0.01)}
train_loads, train_losses = {}, {}
for label, (moe, speed) in runs.items():
    config = decoder.DecoderConfig(vocab_size=task.vocab_size, max_seq_len=32, d_model=32,
                                   n_layers=2, n_heads=4, d_ff=64, moe=moe)
    params = decoder.init_params(config, seed=0, dtype=np.float32)
    trained = [name for name in params if not name.endswith("router.bias")]
    optimiser = AdamW(lr=1e-2, weight_decay=0.0)
    loads, losses = [], []
    for step in range(100):
        loss, cache = decoder.forward(params, task.batch("train", step, 8, seed=0), config)
        grads = decoder.backward(cache)
        optimiser.step({n: params[n] for n in trained}, {n: grads[n] for n in trained})
        layer_loads = decoder.expert_loads(cache)
        if speed:  # outside the gradient: the selection bias follows the load
            for layer, load in layer_loads.items():
                name = f"layers.{layer}.ffn.router.bias"
                params[name] = balance_bias_update(params[name], load, speed)
        loads.append(np.stack(list(layer_loads.values())))  # (layers, experts)
        losses.append(float(loss) - decoder.moe_aux_loss(cache))
    train_loads[label], train_losses[label] = np.array(loads), np.array(losses)
    late = train_loads[label][-20:]
    print(f"{label:28s} max / mean load over the last 20 steps "
          f"{(late.max(axis=2) / late.mean(axis=2)).mean():.2f}; "
          f"cross-entropy {np.mean(losses[-10:]):.3f} (first {losses[0]:.3f})")


def late_imbalance(label):
    late = train_loads[label][-20:]
    return (late.max(axis=2) / late.mean(axis=2)).mean()


unbalanced = late_imbalance("no balancing")
assert unbalanced > 1.8
assert all(late_imbalance(label) < 0.75 * unbalanced for label in list(runs)[1:])

fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), layout="constrained", sharey=True)
window = np.ones(5) / 5  # a 5-step running mean, to see through the batches' noise
for ax, (label, loads) in zip(axes, train_loads.items()):
    for e in range(8):
        ax.plot(np.arange(4, 100), np.convolve(loads[:, 1, e], window, "valid"),
                color=colours[e], lw=0.9)
    ax.axhline(64, color="black", ls="--", lw=0.8)
    ax.set(xlabel="step", title=label)
axes[0].set_ylabel("tokens routed, layer 1 (of 512)")
fig.suptitle("expert load over training: 8 experts, top-2, 256 tokens a step")
plt.show()

# %% [markdown] tags=["question"]
# **Question.** Why does DeepSeek-V3 add the bias to the scores it chooses with, but weight the
# chosen experts' outputs by the unbiased scores? And why is the bias moved by a fixed step of
# the load's sign rather than learned by gradient descent like the other parameters?
#
# <!-- BEGIN SOLUTION -->
# The bias is there to change *which* experts a token uses, not *what* the layer computes with
# them: if it also weighted the outputs, balancing would rescale the output of the favoured and
# neglected experts for every token, an interference with the language model that the gates'
# gradient would then have to undo. With the gates from the unbiased scores, once the choice is
# made the output is the one the router's own scores give. And the bias has no useful gradient:
# it enters only the selection, a piecewise-constant function, so its derivative is zero
# wherever it exists (and `moe_backward` returns zero for it). The load tells the direction
# instead; a step of fixed size $\gamma$ makes the rule independent of the batch size and of how
# uneven the load is, at the price of a small oscillation around the balance point.
# <!-- END SOLUTION -->

# %% [markdown]
# ## E8: total against active parameters
#
# Per MoE layer, a token multiplies by the router ($d E$), its $k$ routed experts ($3 d d_e$
# each) and the shared ones; the other $E - k$ experts sit idle for it. The published "active"
# count is the total without them:
#
# $$P_{\text{active}} = P - L_{\text{MoE}}\,(E - k)\, 3 d d_e.$$
#
# The embedding table and the output matrix are counted whole, though a token reads one row of
# the first; `active_parameters` also gives `matmul`, the weights a token multiplies by (the
# logits' $d V$ included, the lookup not), whose double is its FLOPs through the weights.

# %% [markdown]
# **Exercise 15.5.** A small MoE decoder: $L = 4$ layers, $d = 256$, multi-head attention with
# $h = g = 4$ heads of 64 ($4 d^2$ parameters a layer), two RMSNorm gains of $d$ per layer and a
# final one, vocabulary 1000 with an untied output matrix, and in every layer an MoE
# feed-forward: a router, $E = 8$ routed experts of width $d_e = 512$, top-2, and one shared
# expert of the same width. Count its total and its active parameters.

# %% tags=["exercise"]
toy_total = ...
toy_active = ...
# BEGIN SOLUTION
expert = 3 * 256 * 512
per_layer = 4 * 256**2 + 2 * 256 + 256 * 8 + 8 * expert + expert
toy_total = 4 * per_layer + 256 + 2 * 1000 * 256
toy_active = toy_total - 4 * (8 - 2) * expert
# END SOLUTION

# %%
check("15.5a", toy_total)

# %%
check("15.5b", toy_active)

# %%
from refmath.sizing import active_parameters, parameter_counts

toy = ModelConfig("toy-moe", n_layers=4, d_model=256, n_heads=4, kv_heads=4, head_dim=64,
                  vocab_size=1000, moe=MoEConfig(n_experts=8, top_k=2, d_expert=512, n_shared=1))
toy_counts = active_parameters(toy)
assert parameter_counts(toy).total == toy_counts.total
if all(isinstance(yours, (int, float, np.number)) and yours == counted  # shown once 15.5 is right
       for yours, counted in ((toy_total, toy_counts.total), (toy_active, toy_counts.active))):
    print(f"total {toy_counts.total:,}, active {toy_counts.active:,} "
          f"({toy_counts.active / toy_counts.total:.0%}): the library agrees")
else:
    print("the library's counts are compared here once 15.5a and 15.5b are right")

# %% [markdown]
# The same count for three published models:

# %%
for name in ("mixtral-8x7b", "deepseek-v2", "deepseek-v3"):
    cfg = PRESETS[name]
    counts = active_parameters(cfg)
    print(f"{name:13s} total {counts.total / 1e9:7.2f}B "
          f"(published {float(cfg.published_params) / 1e9:g}B)   active "
          f"{counts.active / 1e9:6.2f}B, matmul {counts.matmul / 1e9:6.2f}B "
          f"(published {float(cfg.published_active) / 1e9:g}B)   {cfg.moe_layers} MoE layers")
mixtral = active_parameters(PRESETS["mixtral-8x7b"])
v3 = active_parameters(PRESETS["deepseek-v3"])
assert (round(mixtral.total / 1e8), round(mixtral.active / 1e8)) == (467, 129)
assert round(v3.total / 1e9) == 671 and round(v3.matmul / 1e9) == 37

# %% [markdown]
# Mixtral's 46.7B and 12.9B come out to every digit published. DeepSeek-V3's 671B does too; its
# 37B is the matmul count rounded (36.6B), where the convention Mixtral's figure follows gives
# 37.6B: the published figures do not all use one convention (the docstring of
# `refmath.sizing.active_parameters` has the details).

# %% [markdown]
# ## E9, E10: the memory against the compute, and the all-to-all
#
# An MoE computes like a dense model of its active size and must hold all of its total. Per
# token, the weights' FLOPs are $F = 2\,(P_{\text{matmul}} + d V)$ while the devices hold
# $b P$ bytes: a dense model holds about $b/2$ bytes per FLOP of a token, an MoE many more.

# %%
from refmath.sizing import memory_against_compute

rows = {}
for name in ("llama-3-8b", "mixtral-8x7b", "deepseek-v2", "deepseek-v3"):
    m = memory_against_compute(PRESETS[name])
    rows[name] = m
    print(f"{name:13s} weights {format_bytes(m.weight_bytes):>10s} in bf16 "
          f"(routed experts {m.expert_bytes / m.weight_bytes:4.0%}), "
          f"{m.token_flops:.2e} FLOPs a token, {m.bytes_per_flop:5.2f} bytes per FLOP")
assert round(rows["deepseek-v3"].bytes_per_flop) == 18
assert round(rows["llama-3-8b"].bytes_per_flop, 2) == 1.07

fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), layout="constrained")
names = list(rows)
where = np.arange(len(names))
axes[0].bar(where - 0.2, [rows[n].total / 1e9 for n in names], 0.4, label="total")
axes[0].bar(where + 0.2, [rows[n].active / 1e9 for n in names], 0.4, label="active")
axes[0].set(yscale="log", ylabel="parameters (billions)", xticks=where,
            title="what the model holds, and what a token uses")
axes[0].set_xticklabels(names, fontsize=8)
axes[0].legend(fontsize=8)
axes[1].bar(where, [rows[n].bytes_per_flop for n in names], color="tab:purple")
axes[1].set(ylabel="bytes of weights per FLOP of a token", xticks=where,
            title="memory against compute (bf16)")
axes[1].set_xticklabels(names, fontsize=8)
plt.show()

# %% [markdown]
# Such models are spread over many devices by *expert parallelism*: each device holds some of
# the experts, and a token's hidden row ($d$ numbers of $b$ bytes) must travel to the devices of
# its $k$ experts (dispatch) and their outputs back (combine), an all-to-all in every MoE layer.
# With the experts spread evenly over $D$ devices, an expert is on the token's own device with
# probability $1/D$, so a token sends and receives on average
#
# $$2\,k\,\Big(1 - \frac{1}{D}\Big)\,d\,b\ \text{bytes per MoE layer.}$$
#
# DeepSeek-V3's *node-limited* routing sends each token to experts on at most $M = 4$ of its 8
# nodes (the `noaux_tc` groups), once to each node: $2 \min(k, M)(1 - 1/D)\, d\, b$ with
# $D = 8$ nodes.

# %% [markdown]
# **Exercise 15.6.** DeepSeek-V3: $d = 7168$, $k = 8$, bf16 ($b = 2$). The average bytes a token
# sends and receives in one MoE layer with the 256 experts over $D = 64$ devices, and with
# node-limited routing over 8 nodes, at most 4 per token.

# %% tags=["exercise"]
bytes_64_devices = ...
bytes_node_limited = ...
# BEGIN SOLUTION
bytes_64_devices = 2 * 8 * (1 - 1 / 64) * 7168 * 2
bytes_node_limited = 2 * min(8, 4) * (1 - 1 / 8) * 7168 * 2
# END SOLUTION

# %%
check("15.6a", bytes_64_devices)

# %%
check("15.6b", bytes_node_limited)

# %%
from refmath.sizing import expert_parallel_bytes, expert_parallel_traffic

v3_cfg = PRESETS["deepseek-v3"]
traffics = {"64 devices": expert_parallel_traffic(v3_cfg, devices=64),
            "node-limited, 4 of 8 nodes": expert_parallel_traffic(v3_cfg, node_limited=True)}
# the bytes a layer are 15.6's answers: shown once yours are right
answered = all(isinstance(yours, (int, float, np.number))
               and np.isclose(yours, t.per_layer, rtol=1e-12) for yours, t in zip((bytes_64_devices, bytes_node_limited), traffics.values()))
if not answered:
    print("the library's traffic is shown here once 15.6a and 15.6b are right")
for label, traffic in traffics.items() if answered else ():
    print(f"{label:28s} {format_bytes(traffic.per_layer):>10s} a layer, "
          f"{format_bytes(traffic.per_token):>10s} a token through the "
          f"{v3_cfg.moe_layers} MoE layers")
row_bytes = v3_cfg.d_model * 2
print(f"the token's hidden row itself: {format_bytes(row_bytes)}")
if answered:  # in rows of the token, still 15.6's answers
    node_limited_rows = expert_parallel_bytes(7168, 8, 8, max_devices=4) / row_bytes
    print(f"node-limited routing moves {node_limited_rows:.2f} rows a layer, "
          f"{expert_parallel_bytes(7168, 8, 64) / row_bytes:.2f} on 64 devices")

# %% [markdown] tags=["question"]
# **Question.** At decode with a batch of $B$ tokens, how many of a layer's experts must be read
# from memory, if each token picks its $k$ of $E$ uniformly and independently? What does that
# mean for DeepSeek-V3 ($k/E = 8/256$) at $B = 1$ and at $B = 64$, against lesson 10's rule that
# decode costs the bytes it reads?
#
# <!-- BEGIN SOLUTION -->
# An expert is missed by one token with probability $1 - k/E$, by all $B$ with $(1 - k/E)^B$, so
# the expected number read is $E\,(1 - (1 - k/E)^B)$. At $B = 1$ that is $k = 8$: a decode step
# reads the active weights only, and a lone token is served at the cost of a 37B model. At
# $B = 64$ it is $256\,(1 - (31/32)^{64}) = 222$ experts, 87% of them: the step reads nearly the
# whole model while each token still computes with 37B. Batching makes a dense model's decode
# cheaper per token because all $B$ tokens share every weight read; an expert read at $B = 64$
# serves on average $B k / 222 = 2.3$ tokens. So an MoE's bytes per token fall far more slowly
# with the batch, and it needs much larger batches (or more devices, each holding fewer experts)
# before its decode becomes compute bound.
# <!-- END SOLUTION -->

# %% [markdown]
# ## Exercises
#
# 1. For sigmoid scores the balance losses use $p = s / \sum_e s_e$ per token. Derive the
#    backward of that normalisation and check it with `refmath.gradcheck` on the registered
#    DeepSeek-V3 MoE case.
# 2. With `device_balance_loss`, show that for softmax probabilities the device-level loss is 1
#    on one device and equals the expert-level loss with one expert per device.
# 3. Rerun the bias simulation with $\gamma = 0.01$ and $\gamma = 0.0001$: how many steps until
#    the load is within 20% of the mean, and how large is the oscillation afterwards? Why does a
#    sign rule oscillate instead of settling?
# 4. Train the tiny MoE with `top_k = 1` (Switch Transformer's routing) and with `norm_topk`
#    off; what do the loads and the gates' gradient look like? (At $k = 1$ a renormalised gate
#    is always 1.)
# 5. Plot $E\,(1 - (1 - k/E)^B)$ against $B$ for Mixtral and DeepSeek-V3 and turn it into bytes
#    read per decode step with `refmath.sizing.decode_step_traffic`; compare with the formula.
# 6. DeepSeek-V2's device-limited routing keeps the best $M = 3$ of 8 groups by their best
#    score, V3 the best 4 by the sum of their two best: construct scores where the two rules keep
#    different groups, and check with `route`.
#
# ## References
#
# - Shazeer, N., et al. (2017). Outrageously Large Neural Networks: The Sparsely-Gated
#   Mixture-of-Experts Layer. (Top-$k$ gating, a load-balancing term.)
# - Fedus, W., Zoph, B., and Shazeer, N. (2022). Switch Transformers: Scaling to Trillion
#   Parameter Models with Simple and Efficient Sparsity. (Top-1 routing, the auxiliary
#   load-balancing loss $\frac{E}{N}\sum_i \text{load}_i P_i$.)
# - Zoph, B., et al. (2022). ST-MoE: Designing Stable and Transferable Sparse Expert Models.
#   (The router z-loss.)
# - Jiang, A. Q., et al. (2024). Mixtral of Experts. (8 experts, top-2, softmax over the top-$k$
#   logits; 46.7B total, 12.9B active.)
# - DeepSeek-AI, et al. (2024). DeepSeek-V2: A Strong, Economical, and Efficient
#   Mixture-of-Experts Language Model. arXiv:2405.04434. (Shared and fine-grained experts,
#   device-limited routing, expert- and device-level balance losses.)
# - DeepSeek-AI, et al. (2024). DeepSeek-V3 Technical Report. arXiv:2412.19437. (Sigmoid
#   scores, auxiliary-loss-free balancing with a selection bias, node-limited routing; 671B
#   total, 37B active.)
# - Wang, L., et al. (2024). Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts.
#   (The bias update rule.)
